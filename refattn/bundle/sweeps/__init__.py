"""Sweeps: a grid of cases from a SPEC file, bounded before any work.

Owns reading a sweep SPEC (TOML/YAML, bounded), validating it against ``schema/sweep-v1.json``,
expanding its grids into normalised cases with stable ids and each case's time and memory
budget (:mod:`.grid`). Writing the sweep is :mod:`refattn.bundle.writing`'s; running it on
workers is :mod:`refattn.distributed`'s.
"""

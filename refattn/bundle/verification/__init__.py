"""Verification: ``refattn verify``, every check a bundle must pass, whatever it claims.

Owns the verifier (:mod:`.verifier`: the steps in order), the recomputation of a case on the
exact generator and the guarantee it meets (:mod:`.recompute`), stored gradients against
numeric derivatives (:mod:`.gradients`), the report (:mod:`.report`) and a bundle's cases read
with these checks for the pytest plugin (:mod:`.checked`). The top room of
:mod:`refattn.bundle`: it may use every other.
"""

"""Dropout: the portable Philox4x32-10 stream, its multipliers, their moments and variants.

Owns the integer generator (:mod:`~refattn.dropout.philox`), the coordinate mapping and the
replayable :class:`Philox` multiplier source (:mod:`~refattn.dropout.stream`), exact and
Monte Carlo moments of the multiplier (:mod:`~refattn.dropout.moments`) and alternative
dropout placements (:mod:`~refattn.dropout.variants`). It imports only the foundation
(:mod:`refattn.errors`, :mod:`refattn._checks`, :mod:`refattn.records`); an
:class:`~refattn.AttentionCall` consumes a stream through its ``MultiplierSource`` protocol.

Examples
--------
>>> from refattn.dropout import Philox
>>> Philox(0.5, seed=2).multiplier(1, 1, 1, 4).tolist()
[[[[0.0, 0.0, 2.0, 0.0]]]]
"""

from __future__ import annotations

from refattn.dropout.philox import philox4x32_10
from refattn.dropout.stream import ALGORITHM, MAPPING, MAPPING_VERSION, Philox, from_manifest

__all__ = ["ALGORITHM", "MAPPING", "MAPPING_VERSION", "Philox", "from_manifest", "philox4x32_10"]

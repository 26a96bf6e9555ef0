"""Visibility: which query reads which key, built from coordinates and named conventions.

Owns the predicate (:class:`VisibilityRelation`, :mod:`~refattn.masks.relation`), its union and
intersection (``a | b``, ``a & b``: :class:`ComposedRelation`, :mod:`~refattn.masks.algebra`),
its constructors (:mod:`~refattn.masks.constructors`), window conventions, packed (varlen)
sequences, block masks for tiled kernels, lowering to and from framework mask encodings
(:mod:`~refattn.masks.framework`) and text rendering. This package is the public face of the
feature; modules inside it import each other directly, never this ``__init__``. It imports only
the foundation (:mod:`refattn.errors`, :mod:`refattn._checks`): never the call, the engine or
anything above them.

Polarity inside refattn is always True = the edge (query i reads key j) exists.

Examples
--------
>>> from refattn import masks
>>> print(masks.render(masks.causal(2, 3, alignment="lower_right").dense()[0, 0]))
q\\k  0 1 2
 0   1 1 0
 1   1 1 1
"""

from __future__ import annotations

from refattn.masks.algebra import BaseRelation, ComposedRelation
from refattn.masks.constructors import (
    CausalAlignment,
    causal,
    compile_visibility,
    from_positions,
    relation,
)
from refattn.masks.packing import (
    Packed,
    PackedSegments,
    PairCounts,
    cu_seqlens_from_lengths,
    pack,
    pair_counts,
    segments_from_cu_seqlens,
    unpack,
)
from refattn.masks.relation import KernelArguments, VisibilityRelation, relation_from_manifest
from refattn.masks.render import EmptyRow, empty_rows, render
from refattn.masks.windows import Window, window_from_inclusive, window_to_inclusive

__all__ = [
    "BaseRelation",
    "CausalAlignment",
    "ComposedRelation",
    "EmptyRow",
    "KernelArguments",
    "Packed",
    "PackedSegments",
    "PairCounts",
    "VisibilityRelation",
    "Window",
    "causal",
    "compile_visibility",
    "cu_seqlens_from_lengths",
    "empty_rows",
    "from_positions",
    "pack",
    "pair_counts",
    "relation",
    "relation_from_manifest",
    "render",
    "segments_from_cu_seqlens",
    "unpack",
    "window_from_inclusive",
    "window_to_inclusive",
]

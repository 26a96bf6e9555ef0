"""Rotary position embeddings (RoPE): the tables and the rotation, forward and backward.

Owns the inverse frequencies and cos/sin tables of a base theta, a rotary dimension and a
scaling (:mod:`~refattn.rope.tables`: none, linear, static NTK, dynamic NTK, YaRN, as
HuggingFace transformers' ``modeling_rope_utils.py`` defines them) and the rotation of the
first ``rotary_dim`` columns of a tensor at per-token positions, in GPT-NeoX's half-split or
GPT-J's interleaved layout, with its exact backward (:mod:`~refattn.rope.apply`, as
FlashAttention's ``flash_attn/layers/rotary.py`` ``apply_rotary_emb_torch`` defines it). Works
on plain float64 arrays: imports only the foundation (:mod:`refattn.errors`,
:mod:`refattn._checks`, :mod:`refattn._boundary`, :mod:`refattn._memory`), never the call or
the engine.

Examples
--------
>>> import numpy as np
>>> from refattn.rope import apply, rope_tables
>>> t = rope_tables(4, 2)
>>> apply(np.array([[[1.0, 0.0]]]), t.cos, t.sin, np.array([[1]])).round(6).tolist()
[[[0.540302, 0.841471]]]
"""

from __future__ import annotations

from refattn.rope.apply import LAYOUTS, apply, apply_backward, check_positions
from refattn.rope.tables import SCALINGS, RopeTables, cos_sin, inverse_frequencies, rope_tables

__all__ = ["LAYOUTS", "SCALINGS", "RopeTables", "apply", "apply_backward", "check_positions",
           "cos_sin", "inverse_frequencies", "rope_tables"]

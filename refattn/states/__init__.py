"""Attention states: partial (output, lse) pairs over disjoint key sets, merged and differentiated.

Owns the public merge of partial states (:func:`merge_state`, :func:`merge_states`), its
backward (:func:`merge_state_backward`, :func:`merge_states_backward`), in natural or base-2
lse and in refattn's, FlashInfer's and FlashAttention's layouts (:mod:`.layouts`), and the
diagnosis of a merge that went wrong in a known way (:func:`diagnose_merge`: wrong lse base,
no renormalisation, lses swapped between partials). Sources: flashinfer-ai/flashinfer
``include/flashinfer/attention/cascade.cuh`` and ``flashinfer/cascade.py``;
Dao-AILab/flash-attention ``csrc/flash_attn/src/flash_fwd_kernel.h``
(``combine_attn_seqk_parallel``); zhuzilin/ring-flash-attention ``ring_flash_attn/utils.py``.
It sits beside :mod:`refattn.masks` and imports only the foundation (errors, _checks,
_boundary, _memory); :mod:`refattn.distributed.keyshard` uses it to merge key shards.

Examples
--------
>>> import numpy as np
>>> from refattn.states import merge_state
>>> out, lse = merge_state(np.ones((1, 1, 1, 2)), np.zeros((1, 1, 1)),
...                        np.zeros((1, 1, 1, 2)), np.full((1, 1, 1), -np.inf))
>>> out.tolist(), lse.tolist()                       # an empty partial weighs nothing
([[[[1.0, 1.0]]]], [[[0.0]]])
"""

from __future__ import annotations

from refattn.states.diagnosis import HYPOTHESES, MergeDiagnosis, diagnose_merge
from refattn.states.layouts import LAYOUTS
from refattn.states.merge import (
    merge_state,
    merge_state_backward,
    merge_states,
    merge_states_backward,
)

__all__ = [
    "HYPOTHESES",
    "LAYOUTS",
    "MergeDiagnosis",
    "diagnose_merge",
    "merge_state",
    "merge_state_backward",
    "merge_states",
    "merge_states_backward",
]

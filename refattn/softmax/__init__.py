"""Softmax over a row's legal support: the contract's Loop 5 oracle and its companions.

Owns the strict finite-row softmax and log-sum-exp (:mod:`~refattn.softmax.strict`), the online
and block normalisers of tiled kernels (:mod:`~refattn.softmax.online`), the Jacobian, entropy
and temperature path (:mod:`~refattn.softmax.curvature`) and per-row diagnostics
(:mod:`~refattn.softmax.diagnostics`). It works on plain score rows: it imports only the
foundation (:mod:`refattn.errors`, :mod:`refattn._checks`), never the call or the engine.

Examples
--------
>>> import numpy as np
>>> from refattn.softmax import softmax
>>> softmax(np.log(np.array([1.0, 3.0]))).tolist()
[0.25, 0.75]
"""

from __future__ import annotations

from refattn.softmax.curvature import (
    JacobianCheck,
    check_jacobian,
    entropy,
    entropy_slope,
    jacobian,
    limiting_distribution,
)
from refattn.softmax.diagnostics import RowDiagnostics, diagnostics
from refattn.softmax.online import (
    NormalizerState,
    block_online_normalizer,
    merge_states,
    online_normalizer,
    probabilities_from_state,
)
from refattn.softmax.strict import (
    NaiveSoftmax,
    logsumexp,
    naive_softmax,
    reconstruct_probs,
    softmax,
)

__all__ = [
    "JacobianCheck",
    "NaiveSoftmax",
    "NormalizerState",
    "RowDiagnostics",
    "block_online_normalizer",
    "check_jacobian",
    "diagnostics",
    "entropy",
    "entropy_slope",
    "jacobian",
    "limiting_distribution",
    "logsumexp",
    "merge_states",
    "naive_softmax",
    "online_normalizer",
    "probabilities_from_state",
    "reconstruct_probs",
    "softmax",
]

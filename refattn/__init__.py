"""refattn: a float64 reference engine for scaled-dot-product attention.

Shape letters, used everywhere in refattn (signatures, einsum strings, comments, tests):

- ``B``: batch
- ``Hq``: query heads; ``Hkv``: key/value heads (``head_map[h]`` names the kv head of h)
- ``Q``: query rows; ``K``: key/value rows
- ``Dk``: query/key feature width; ``Dv``: value feature width

Canonical tensors: q ``(B, Hq, Q, Dk)``, k ``(B, Hkv, K, Dk)``, v ``(B, Hkv, K, Dv)``;
scores and probabilities ``(B, Hq, Q, K)``; output ``(B, Hq, Q, Dv)``.

Examples
--------
>>> import numpy as np, refattn
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
>>> call = refattn.AttentionCall(q, k, v, visible=np.tril(np.ones((4, 4), bool)))
>>> trace = refattn.forward(call)
>>> grads = refattn.backward(trace, np.ones_like(trace.output))
>>> bool(np.allclose(trace.probs.sum(-1), 1.0)), grads.grad_q.shape
(True, (1, 2, 4, 8))
"""

from __future__ import annotations

from refattn import _moved
from refattn._version import __version__
from refattn.analysis.source_identity import check_source_identity
from refattn.call import AttentionCall
from refattn.engine import ValueAndGrad, attention, backward, forward, value_and_grad
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError, RefAttnWarning

_moved.install()  # the flat layout's module paths keep working, with a DeprecationWarning

__all__ = [
    "AttentionCall",
    "Gradients",
    "RefAttnError",
    "RefAttnWarning",
    "Trace",
    "ValueAndGrad",
    "__version__",
    "attention",
    "backward",
    "check_source_identity",
    "forward",
    "value_and_grad",
]

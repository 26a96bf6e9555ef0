"""Plain-NumPy description of a case: the arrays a kernel of one's own takes, and the rules.

Owns :class:`PlainCall` and :func:`plain_call`: every input of a golden case as a float64 NumPy
array in refattn's head-major layout, with the conventions spelled out, for a kernel that is
neither SDPA nor JAX. Nothing here needs a framework. The rules that turn these arrays into the
golden tensors (the contract's, which :mod:`refattn.engine.reference` implements):

1. **Heads.** Query head ``h`` reads kv head ``head_map[h]`` (grouped-query attention:
   ``h // (Hq // Hkv)`` unless the case gives an explicit map).
2. **Scores.** ``s = scale * q @ k^T`` per (b, h), ``(B, Hq, Q, K)``, alpha applied exactly once
   (``scale_placement`` says whether the case applied it after the product or to q or k first;
   in real numbers the same). Other score families (``score`` not ``"dot"``) replace
   ``q @ k^T`` by :mod:`refattn.call.scores`' definition with ``score_params``.
3. **Softcap**, when given: ``s = softcap * tanh(s / softcap)``.
4. **Bias**, when given: ``s = s + bias`` (broadcast to ``(B, Hq, Q, K)``), before the mask.
5. **Mask.** ``s = -inf`` where ``visible`` is False (True = query i reads key j; the same
   polarity as SDPA's and JAX's boolean masks). Every row of ``visible`` has a legal key, or a
   sink: a row the case's policy left without keys is given key 0 here, exactly as refattn's
   ``sanitize_then_zero_invalid_query`` policy does, and such a row is unused (rule 8).
6. **Softmax** over keys: ``P = exp(s - m) / (sum_j exp(s - m) + exp(sink[h] - m))`` with the
   sink term only when ``sink`` is given; ``lse = m + log(denominator)``. A row whose keys are
   all invisible but which has a sink has ``P = 0`` and output 0.
7. **Dropout**, when given: the multiplier ``dropout`` ``(B, Hq, Q, K)`` (0 or 1/(1-p) for
   inverted dropout; any finite real) multiplies P: ``consumed = P * dropout``.
8. **Output** ``consumed @ v[head_map]``, ``(B, Hq, Q, Dv)``, then **zero every row where
   ``query_valid`` is False**; those rows get no gradient.
9. **Gradients** are those of ``sum(grad_output * output)``: ``grad_q`` like q, ``grad_k`` and
   ``grad_v`` summed over the query heads that read each kv head, ``grad_bias`` with the bias's
   own shape (summed over its broadcast axes), ``grad_sink`` like the sink.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.bundle.golden.spec import CaseSpec

__all__ = ["PlainCall", "plain_call"]


def _frozen(x: Any) -> np.ndarray:
    a = np.array(x)  # a private copy: the golden case's arrays stay as they were
    a.flags.writeable = False
    return a


@public
@dataclass(frozen=True, eq=False)
class PlainCall:
    """A case's inputs as read-only NumPy arrays, with the rules of this module's docstring.

    Attributes
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
    k : (B, Hkv, K, Dk) float64 ndarray
    v : (B, Hkv, K, Dv) float64 ndarray
    scale : float
        alpha, the multiplier of the scores.
    scale_placement : {"post", "q", "k", "split"}
    head_map : (Hq,) int64 ndarray
        Query head h reads kv head ``head_map[h]``.
    visible : (B, Hq, Q, K) bool ndarray
        True = query i reads key j; every row has a legal key or a sink (rule 5).
    query_valid : (B, 1, Q, 1) bool ndarray
        Output rows where False are zero and get no gradient.
    bias : float64 ndarray broadcastable to (B, Hq, Q, K), or None
    softcap : float or None
    sink : (Hq,) float64 ndarray or None
    dropout : (B, Hq, Q, K) float64 ndarray or None
        The multiplier Z.
    score : str
        Score family: ``dot``, ``bilinear``, ``additive`` or ``cosine``.
    score_params : dict of str to ndarray
        The family's parameters (empty for ``dot``).
    grad_output : (B, Hq, Q, Dv) float64 ndarray
        G_O, the cotangent of the output.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    scale_placement: str
    head_map: np.ndarray
    visible: np.ndarray
    query_valid: np.ndarray
    grad_output: np.ndarray
    bias: np.ndarray | None = None
    softcap: float | None = None
    sink: np.ndarray | None = None
    dropout: np.ndarray | None = None
    score: str = "dot"
    score_params: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        """The differentiable inputs by canonical name: ``q``, ``k``, ``v`` and, where the case
        has them, ``bias``, ``sink`` and ``score_<param>``; their gradients are compared as
        ``grad_<name>``."""
        out = {"q": self.q, "k": self.k, "v": self.v}
        if self.bias is not None:
            out["bias"] = self.bias
        if self.sink is not None:
            out["sink"] = self.sink
        out.update({f"score_{n}": p for n, p in self.score_params.items()})
        return out


@public
def plain_call(spec: CaseSpec) -> PlainCall:
    """The plain-NumPy description of ``spec`` (every case is expressible this way).

    Parameters
    ----------
    spec : CaseSpec

    Returns
    -------
    PlainCall

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> c = plain_call(case_spec(CASES["gqa_hq8_hkv2_causal"]()))
    >>> c.q.shape, c.k.shape, c.head_map.tolist(), c.visible.shape, c.query_valid.shape
    ((2, 8, 5, 4), (2, 2, 5, 4), [0, 0, 0, 0, 1, 1, 1, 1], (2, 8, 5, 5), (2, 1, 5, 1))
    >>> sorted(c.inputs), c.bias is None, c.dropout is None
    (['k', 'q', 'v'], True, True)
    """
    t = spec.tensors
    family = spec.score_family()
    return PlainCall(
        q=_frozen(t["q"]), k=_frozen(t["k"]), v=_frozen(t["v"]),
        scale=spec.scale, scale_placement=spec.scale_placement,
        head_map=_frozen(np.asarray(t["head_map"], dtype=np.int64)),
        visible=_frozen(spec.visible_full(sanitized=True)),  # (B, Hq, Q, K)
        query_valid=_frozen(spec.query_valid_full()),  # (B, 1, Q, 1)
        grad_output=_frozen(t["grad_output"]),
        bias=_frozen(t["bias"]) if "bias" in t else None,
        softcap=spec.softcap,
        sink=_frozen(t["sink"]) if "sink" in t else None,
        dropout=_frozen(spec.multiplier_full()) if spec.has_dropout else None,
        score=spec.score_family_name,
        score_params={n: _frozen(t[f"score_{n}"]) for n in family.parameters()},
    )

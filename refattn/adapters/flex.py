"""FlexAttention lowering: one golden case as the exact ``flex_attention`` call.

Owns :class:`FlexCall` and :func:`flex_call` (what ``case.to_flex_attention()`` returns) and
:func:`ineligible`. The call is ``torch.nn.attention.flex_attention.flex_attention(query, key,
value, score_mod=..., block_mask=..., scale=..., enable_gqa=..., return_aux=AuxRequest(lse=
True))`` (PyTorch 2.13's signature) with

- q ``(B, Hq, Q, Dk)``, k ``(B, Hkv, K, Dk)``, v ``(B, Hkv, K, Dv)``: refattn's own head-major
  layout, rounded once to the run's dtype; a scale placement's multiplier of q or k applied;
- ``block_mask = create_block_mask(mask_mod, B, Hq, Q, K, device)``: ``mask_mod`` is the case's
  visibility relation evaluated on the ``(b, h, q_idx, kv_idx)`` index tensors (coordinates,
  key validity, segments, prefix, causal, windows; unions and intersections of relations term
  by term), or a lookup into the dense visibility where the case has no relation;
- ``score_mod``: softcap ``c * tanh(s / c)`` then the bias (ALiBi is a bias here) looked up at
  ``(b, h, q_idx, kv_idx)``; flex_attention hands score_mod the score already multiplied by
  ``scale`` (refattn's order: scale, softcap, bias, mask);
- ``scale``: None where the case leaves the scale to the kernel (its default 1/sqrt(Dk) is
  then under test), else alpha;
- ``enable_gqa``: Hq != Hkv with query head h reading kv head h // (Hq // Hkv); any other head
  map expands K/V to Hq heads (their gradients are summed back).

What it cannot express (:func:`ineligible`): other score families (score_mod receives the dot
product, not q and k), dropout (flex_attention has none), sink logits (no extra logit in its
softmax). Rows without a visible key come back as zero with lse ``-inf``; refattn zeroes them
anyway (``query_valid``), and :meth:`FlexCall.outputs` returns ``lse`` only where every query
row is used (an unused row's golden lse is that of its sanitised row).

PyTorch 2.13 runs flex_attention on CPU forward only, eagerly (``NotImplementedError:
FlexAttention does not support backward on CPU``; compiled on CPU it takes float32, float16 and
bfloat16, not float64); gradients need a CUDA device (``to_flex_attention(device="cuda",
requires_grad=True)``). torch is imported inside functions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.adapters import semantic_limits
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec
from refattn.call.placement import operand_multipliers
from refattn.engine.reduce import sum_heads
from refattn.errors import RefAttnError
from refattn.masks import BaseRelation

__all__ = ["FlexCall", "flex_call", "ineligible", "relation_mask_mod"]


def _torch() -> Any:
    try:
        import torch
        from torch.nn.attention import flex_attention  # noqa: F401  (PyTorch >= 2.5)
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError("flex lowering: PyTorch with torch.nn.attention.flex_attention is "
                           f"not installed ({install_hint('compare')})") from None
    return torch


def _is_relation(x: object) -> bool:
    return isinstance(x, BaseRelation)


def _device(torch: Any, device: Any) -> Any:
    """``device`` as a torch device that exists here (a RefAttnError naming it otherwise)."""
    if not isinstance(device, (str, torch.device)):
        raise RefAttnError(f"device: expected a device name such as 'cpu' or a torch.device, "
                           f"got {type(device).__name__}")
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)  # a device that is named but not present fails here
    except (RuntimeError, TypeError, ValueError, AssertionError) as exc:
        text = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise RefAttnError(f"device: {str(device)[:80]!r} cannot be used ({text})") from None
    return dev


@public
def ineligible(spec: CaseSpec) -> str | None:
    """Why ``flex_attention`` cannot express ``spec`` exactly, or None when it can.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> ineligible(case_spec(CASES["sink_per_head"]()))
    'sink logit (flex_attention has no extra logit in its softmax)'
    >>> ineligible(case_spec(CASES["softcap_5"]())) is None
    True
    """
    lim = semantic_limits(spec)
    if lim["family"] != "dot":
        return (f"score family {lim['family']!r} (score_mod receives the dot product q.k, "
                "not q and k)")
    if lim["dropout"]:
        return "dropout multiplier (flex_attention has no dropout)"
    if lim["sink"]:
        return "sink logit (flex_attention has no extra logit in its softmax)"
    return None


@public
def relation_mask_mod(relation: Any, torch: Any, device: Any = "cpu") -> Any:
    """The predicate of a :mod:`refattn.masks` relation (or a union / intersection of them) as
    a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` on torch index tensors.

    The same conjunction as :meth:`refattn.masks.VisibilityRelation.mask_mod`: key validity,
    segments, prefix or causal topology, window bounds (per head where given per head); a
    composed relation combines its terms with ``&`` / ``|``, a term shared over the batch or
    head axis reading index 0.

    Examples
    --------
    >>> import pytest; torch = pytest.importorskip("torch")
    >>> from refattn.masks import causal
    >>> mm = relation_mask_mod(causal(2, 3, alignment="lower_right"), torch)
    >>> i, j = torch.arange(2)[:, None], torch.arange(3)[None, :]
    >>> mm(torch.tensor(0), torch.tensor(0), i, j).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    if not _is_relation(relation):  # (no narrowing: the terms are read duck-typed below)
        raise RefAttnError(f"relation: expected a refattn.masks relation, got "
                           f"{type(relation).__name__}")
    if getattr(torch, "__name__", None) != "torch" or not hasattr(torch, "as_tensor"):
        raise RefAttnError(f"torch: expected the torch module, got {type(torch).__name__}")
    device = _device(torch, device)

    def t(x: Any) -> Any:
        return torch.as_tensor(np.array(x), device=device)  # a writeable copy

    if hasattr(relation, "terms"):  # ComposedRelation
        parts = [(relation_mask_mod(term, torch, device), term.shape[0] > 1, term.shape[1] > 1)
                 for term in relation.terms]
        union = relation.op == "or"

        def composed(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            out = None
            for mod, batched, headed in parts:
                v = mod(b if batched else torch.zeros_like(b), h if headed else
                        torch.zeros_like(h), q_idx, kv_idx)
                out = v if out is None else (out | v if union else out & v)
            return out

        return composed

    q_pos, k_pos, key_valid = t(relation.q_pos), t(relation.k_pos), t(relation.key_valid)
    q_seg = None if relation.q_segment is None else t(relation.q_segment)
    k_seg = None if relation.k_segment is None else t(relation.k_segment)
    prefix = None if relation.prefix_length is None else t(relation.prefix_length)
    causal = relation.causal
    window = relation.window
    bounds = [None if w is None else (t(w) if isinstance(w, np.ndarray) else int(w))
              for w in (window if window is not None else (None, None))]

    def at(bound: Any, h: Any) -> Any:
        return bound[h] if isinstance(bound, torch.Tensor) else bound

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        p, r = q_pos[b, q_idx], k_pos[b, kv_idx]  # query and key coordinates
        out = key_valid[b, kv_idx]
        if q_seg is not None:
            out = out & (q_seg[b, q_idx] == k_seg[b, kv_idx])  # type: ignore[index]
        if prefix is not None:
            P = prefix[b] if prefix.ndim == 1 else prefix[b, h]
            q_in = p < P
            out = out & ((q_in & (r < P)) | (~q_in & (r <= p)))
        elif causal:
            out = out & (r <= p)
        if bounds[0] is not None:
            out = out & (p - r <= at(bounds[0], h))
        if bounds[1] is not None:
            out = out & (r - p <= at(bounds[1], h))
        return out

    return mask_mod


@public
@dataclass(frozen=True, eq=False)
class FlexCall:
    """One case lowered to ``flex_attention`` (see the module docstring for the rules).

    Call it as ``out, aux = flex_attention(*f.args, **f.kwargs)`` and hand the result to
    :meth:`finish` (or ``out``, ``aux.lse`` and the gradients of :attr:`args` to
    :meth:`outputs`), which returns refattn's canonical tensors.

    Attributes
    ----------
    args : tuple of torch.Tensor
        ``(q, k, v)``: q ``(B, Hq, Q, Dk)``, k ``(B, Hkv, K, Dk)``, v ``(B, Hkv, K, Dv)`` in
        the run's dtype (``Hq`` kv heads where an explicit head map expanded them).
    kwargs : dict
        ``score_mod`` (None without softcap and bias), ``block_mask`` (a ``BlockMask``, None
        where every key is visible), ``scale`` (None: flex_attention's default 1/sqrt(Dk)),
        ``enable_gqa``, ``return_aux`` (``AuxRequest(lse=True)``).
    mask_mod : callable or None
        The predicate the block mask was built from (``mask_source`` says from what).
    mask_source : {"relation", "dense", "none"}
    score_mod_terms : tuple of str
        What ``score_mod`` applies, in order: ``softcap``, ``bias``.
    query_valid : (B, 1, Q, 1) bool ndarray
        Output rows where it is False are zero in refattn (and get no gradient).
    grad_output : torch.Tensor
        ``(B, Hq, Q, Dv)``: G_O in the run's dtype, for ``out.backward(f.grad_output)``
        (zero on the rows refattn leaves unused, whose output it zeroes).
    dtype : str
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mask_mod: Any
    mask_source: str
    score_mod_terms: tuple[str, ...]
    query_valid: np.ndarray
    grad_output: Any
    dtype: str
    head_map: np.ndarray
    kv_heads: int
    expand_kv: bool
    query_multiplier: float
    key_multiplier: float
    bias: Any = None

    def outputs(self, output: Any, lse: Any = None, grads: Any = None) -> dict[str, np.ndarray]:
        """flex_attention's ``output`` ``(B, Hq, Q, Dv)``, ``lse`` ``(B, Hq, Q)`` and the
        gradients of ``(q, k, v)`` (and of :attr:`bias`, where given) under refattn's names:
        rows where :attr:`query_valid` is False zeroed, expanded kv heads summed back,
        placement multipliers applied; ``lse`` only where every query row is used."""
        def arr(x: Any) -> np.ndarray:
            return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)

        out = np.where(self.query_valid, arr(output), 0).astype(arr(output).dtype)
        tensors = {"output": out}
        if lse is not None and self.query_valid.all():
            tensors["lse"] = arr(lse)
        if grads is not None:
            g_q, g_k, g_v = (arr(g) for g in grads[:3])
            if self.expand_kv:
                g_k = sum_heads(g_k, self.head_map, self.kv_heads)
                g_v = sum_heads(g_v, self.head_map, self.kv_heads)
            tensors.update(grad_q=_scaled(g_q, self.query_multiplier),
                           grad_k=_scaled(g_k, self.key_multiplier), grad_v=g_v)
            if len(grads) > 3 and grads[3] is not None:
                tensors["grad_bias"] = arr(grads[3])
        return tensors

    def finish(self, result: Any) -> dict[str, np.ndarray]:
        """:meth:`outputs` of what ``flex_attention(*f.args, **f.kwargs)`` returned: the
        tensor, ``(out, lse)`` or ``(out, aux)``."""
        if isinstance(result, tuple):
            out, aux = result[0], result[1]
            return self.outputs(out, getattr(aux, "lse", aux))
        return self.outputs(result)


def _broadcast(mod: Any, shape: tuple[int, ...], torch: Any) -> Any:
    """``mod`` read at batch row / head 0 where the relation is shared over that axis."""
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mod(b if shape[0] > 1 else torch.zeros_like(b),
                   h if shape[1] > 1 else torch.zeros_like(h), q_idx, kv_idx)

    return mask_mod


def _scaled(g: np.ndarray, m: float) -> np.ndarray:  # d/dx f(m x) = m f'(m x)
    return g if m == 1.0 else (g.astype(np.float64) * m).astype(g.dtype)


@public
def flex_call(spec: CaseSpec, *, dtype: Any = "float64", device: Any = "cpu",
              requires_grad: bool = False) -> FlexCall:
    """The ``flex_attention`` call of ``spec`` in ``dtype`` (see :class:`FlexCall`).

    Parameters
    ----------
    spec : CaseSpec
    dtype : {"float64", "float32", "float16", "bfloat16"}
    device : str or torch.device
        Where the tensors and the block mask live (``"cpu"``: forward only in PyTorch 2.13).
    requires_grad : bool
        Make q, k, v (and the bias) leaves that require gradients (CUDA only in 2.13).

    Returns
    -------
    FlexCall

    Raises
    ------
    RefAttnError
        When flex_attention cannot express the case, naming why (:func:`ineligible`).

    Examples
    --------
    >>> import pytest; _ = pytest.importorskip("torch")
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> f = flex_call(case_spec(CASES["gqa_hq8_hkv2_causal"]()), dtype="float32")
    >>> [tuple(x.shape) for x in f.args], f.kwargs["enable_gqa"], f.mask_source
    ([(2, 8, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)], True, 'relation')
    >>> f.kwargs["block_mask"].shape, f.kwargs["scale"] is None
    ((2, 8, 5, 5), True)
    """
    reason = ineligible(spec)  # also bounds the case's scale and softcap (semantic_limits)
    if reason is not None:
        raise RefAttnError(f"{spec.case_id}: flex_attention cannot express this case: {reason}")
    if not isinstance(requires_grad, (bool, np.bool_)):
        raise RefAttnError(f"requires_grad: expected True or False, got {requires_grad!r}")
    requires_grad = bool(requires_grad)
    torch = _torch()
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    device = _device(torch, device)

    precision = precision_name(resolve_dtype(dtype))
    tdtype = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
              "bfloat16": torch.bfloat16}[precision]
    t = spec.tensors
    B, Hq, Q, K = spec.score_shape
    mult = operand_multipliers(spec.scale, spec.scale_placement)
    head_map = np.asarray(t["head_map"], dtype=np.int64)
    Hkv = int(t["k"].shape[1])
    expand = spec.head_map_mode == "explicit" and not np.array_equal(
        head_map, np.arange(Hq) // (Hq // Hkv))

    def tensor(x: np.ndarray, m: float = 1.0, grad: bool = requires_grad) -> Any:
        x = np.asarray(x, dtype=np.float64)
        x = x if m == 1.0 else x * m  # the placement's multiplier, in float64
        out = torch.tensor(np.ascontiguousarray(x), device=device).to(tdtype)
        return out.requires_grad_(grad)

    k_np, v_np = t["k"], t["v"]
    if expand:
        k_np, v_np = np.asarray(k_np)[:, head_map], np.asarray(v_np)[:, head_map]
    args = (tensor(t["q"], mult.query), tensor(k_np, mult.key), tensor(v_np))

    vis = spec.visible_full()  # (B, Hq, Q, K), unsanitised: a row without keys stays empty
    relation = spec.relation()
    mask_source, mask_mod = "none", None
    if not vis.all():
        if relation is not None and np.array_equal(
                np.broadcast_to(relation.dense(), vis.shape), vis):
            mask_source, mask_mod = "relation", _broadcast(
                relation_mask_mod(relation, torch, device), relation.shape, torch)
        else:
            dense = torch.as_tensor(np.array(vis), device=device)  # a writeable copy
            mask_source = "dense"

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return dense[b, h, q_idx, kv_idx]
    block_mask = (None if mask_mod is None else
                  create_block_mask(mask_mod, B, Hq, Q, K, device=device))

    terms: list[str] = []
    cap = spec.softcap
    bias = None
    if cap is not None:
        terms.append("softcap")
    if "bias" in t:
        terms.append("bias")
        bias = tensor(t["bias"])
    score_mod = None
    if terms:
        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if bias is not None:
                full = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
                score = score + full.expand(B, Hq, Q, K)[b, h, q_idx, kv_idx]
            return score

    kwargs = {"score_mod": score_mod, "block_mask": block_mask,
              "scale": None if spec.scale_is_default and spec.scale_placement == "post"
              else float(mult.post),
              "enable_gqa": (not expand) and Hq != Hkv,
              "return_aux": AuxRequest(lse=True)}
    return FlexCall(args, kwargs, mask_mod, mask_source, tuple(terms),
                    np.ascontiguousarray(spec.query_valid_full()),
                    tensor(np.where(spec.query_valid_full(), t["grad_output"], 0.0),
                           grad=False), precision, head_map, Hkv, expand,
                    float(mult.query), float(mult.key), bias)

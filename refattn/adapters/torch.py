"""PyTorch adapter: one golden case through functional SDPA, an eager program and MHA.

Owns the lowering of a case's semantic call (:class:`~refattn.bundle.golden.spec.CaseSpec`) to
PyTorch 2.13's public APIs, each with its own conventions made explicit:

- ``"sdpa"``: ``F.scaled_dot_product_attention`` with a boolean mask in SDPA polarity (True
  participates) or an additive float mask (finite bias, ``-inf`` where not visible), an
  explicit ``scale`` (never the default), ``enable_gqa`` for the grouped head map or an
  explicit expansion of K/V, ``dropout_p=0.0``, and ``is_causal`` only where the whole
  support is the triangle PyTorch documents (upper-left); a lower-right or cache-aligned
  relation always travels as an explicit mask.
- ``"eager"``: the canonical trace written with torch ops (every intermediate materialised,
  gradients by autograd), injecting the golden dropout multiplier Z; also runs score families,
  softcap and sinks.
- ``"mha"``: ``F.multi_head_attention_forward`` with identity projections and the inverted
  boolean polarity of MultiheadAttention (True = blocked; ``key_padding_mask`` True = ignored).

The returned manifest records the requested backend and the one observed (the fused SDPA
operator seen by a dispatch-mode spy, ``math`` when only its decomposition ran, else
``unobserved``). torch is imported inside functions only. Defers the verdict to
:mod:`refattn.bundle.comparison.harness`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn.adapters import AdapterResult, semantic_limits
from refattn.bundle.comparison.candidates import as_numpy
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec, with_strides
from refattn.call.placement import operand_multipliers
from refattn.errors import RefAttnError

__all__ = [
    "PATHS",
    "SdpaArguments",
    "SdpaCall",
    "TorchCase",
    "case_tensors",
    "ineligible",
    "run",
    "sdpa_arguments",
    "sdpa_call",
]

Path = Literal["sdpa", "eager", "mha"]
Backend = Literal["auto", "math", "flash", "efficient", "cudnn"]
PATHS: tuple[str, ...] = ("sdpa", "eager", "mha")

_FUSED_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash_attention_cpu",
    "_scaled_dot_product_flash_attention": "flash_attention",
    "_scaled_dot_product_efficient_attention": "efficient_attention",
    "_scaled_dot_product_cudnn_attention": "cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError(
            f"torch adapter: PyTorch is not installed ({install_hint('compare')})"
        ) from None
    return torch


# -- decisions (pure; no torch needed) -------------------------------------------------------
@public
@dataclass(frozen=True)
class SdpaArguments:
    """How a case is lowered to functional SDPA.

    Attributes
    ----------
    mask : {"none", "bool", "additive"}
        ``bool``: SDPA polarity (True participates); ``additive``: float bias with -inf.
    is_causal : bool
        True only when the support is exactly PyTorch's upper-left triangle.
    scale : float
        The explicit ``scale=`` argument (alpha, or 1.0 when alpha was moved into q/k).
    query_multiplier, key_multiplier : float
        Multipliers applied to q and k before the call (scale placement).
    enable_gqa : bool
        Native grouped-query attention (Hq > Hkv with the grouped head map).
    expand_kv : bool
        K/V expanded to Hq heads by ``head_map`` before the call.
    """

    mask: Literal["none", "bool", "additive"]
    is_causal: bool
    scale: float
    query_multiplier: float
    key_multiplier: float
    enable_gqa: bool
    expand_kv: bool


@public
def ineligible(spec: CaseSpec, path: Path) -> str | None:
    """Why ``path`` cannot express ``spec`` exactly, or None when it can.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> ineligible(case_spec(build_suite("contract")[0]), "sdpa")
    'dropout multiplier (SDPA and MHA are run with dropout off)'
    >>> ineligible(case_spec(build_suite("contract")[0]), "eager") is None
    True
    """
    lim = semantic_limits(spec)
    if path not in PATHS:
        raise RefAttnError(f"path: expected one of {list(PATHS)}, got {path!r}")
    if path == "eager":
        return None
    if lim["family"] != "dot":
        return f"score family {lim['family']!r} (SDPA and MHA compute dot products)"
    if lim["softcap"]:
        return "softcap (not an SDPA or MHA argument)"
    if lim["sink"]:
        return "sink logit (not an SDPA or MHA argument)"
    if lim["dropout"]:
        return "dropout multiplier (SDPA and MHA are run with dropout off)"
    if path == "mha":
        if not lim["equal_kv_width"]:
            return "Dk != Dv (MultiheadAttention projects values to the query head width)"
        if lim["placement"] != "post":
            return f"scale placement {lim['placement']!r} (MHA scales q inside)"
    return None


def _is_upper_left_triangle(spec: CaseSpec) -> bool:
    B, Hq, Q, K = spec.score_shape
    tri = np.tri(Q, K, dtype=bool)  # key j <= query row i: PyTorch's is_causal support
    return bool(np.array_equal(spec.visible_full(sanitized=True),
                               np.broadcast_to(tri, (B, Hq, Q, K))))


@public
def sdpa_arguments(spec: CaseSpec, *, gqa: Literal["native", "expand"] = "native",
                   causal: Literal["explicit", "auto"] = "explicit") -> SdpaArguments:
    """The SDPA lowering of ``spec`` (pure decision; no torch needed).

    ``causal="auto"`` uses ``is_causal=True`` (and no mask) only where the support equals the
    upper-left triangle that PyTorch 2.13 documents and there is no bias, and the triangle
    is the call's own relation: square, or a relation recorded as upper-left aligned. A
    lower-right or cache-position relation is never lowered to ``is_causal``.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> a = sdpa_arguments(case_spec(build_suite("contract")[4]))
    >>> a.mask, a.is_causal, a.enable_gqa, round(a.scale, 6)
    ('additive', False, True, 0.447214)
    """
    if gqa not in ("native", "expand"):
        raise RefAttnError(f"gqa: expected 'native' or 'expand', got {gqa!r}")
    if causal not in ("explicit", "auto"):
        raise RefAttnError(f"causal: expected 'explicit' or 'auto', got {causal!r}")
    a = spec.axes
    mult = operand_multipliers(spec.scale, spec.scale_placement)
    grouped = spec.head_map_mode == "grouped"
    enable_gqa = gqa == "native" and grouped and a["Hq"] != a["Hkv"]
    expand = (not enable_gqa and a["Hq"] != a["Hkv"]) or not grouped
    has_bias = "bias" in spec.tensors
    all_visible = bool(spec.visible_full(sanitized=True).all())
    is_causal = False
    if causal == "auto" and not has_bias and not all_visible and _is_upper_left_triangle(spec):
        relation = spec.call_manifest["visibility"].get("alignment")
        is_causal = a["Q"] == a["K"] or relation == "upper_left"
    mask: Literal["none", "bool", "additive"]
    if has_bias:
        mask = "additive"
    elif is_causal or all_visible:
        mask = "none"
    else:
        mask = "bool"
    return SdpaArguments(mask, is_causal, float(mult.post), float(mult.query),
                         float(mult.key), enable_gqa, expand)


# -- tensors -------------------------------------------------------------------------------
@public
@dataclass(frozen=True, eq=False)
class TorchCase:
    """A case's tensors in torch, in one dtype (inputs are autograd leaves)."""

    q: Any
    k: Any
    v: Any
    bias: Any
    sink: Any
    score_params: dict[str, Any]
    grad_output: Any
    multiplier: Any
    visible: Any  # (B, Hq, Q, K) bool, Policy-3 sanitised rows included
    query_valid: Any  # (B, 1, Q, 1) bool
    head_map: Any  # (Hq,) int64


def _to_torch(x: np.ndarray, precision: str, *, grad: bool = False) -> Any:
    """float64 numpy -> torch in ``precision``, rounded once (ml_dtypes for bfloat16), keeping
    the array's strides."""
    torch = _torch()
    x = np.asarray(x)
    if x.dtype == np.bool_ or x.dtype.kind in "iu":
        return torch.from_numpy(np.array(x))
    if precision == "bfloat16":  # numpy has no bfloat16: move the bits, keep the layout
        bits = x.astype(resolve_dtype("bfloat16"), order="K").view(np.int16)
        t = torch.from_numpy(bits).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(x.astype(resolve_dtype(precision), order="K")))
    return t.requires_grad_(grad)


@public
def case_tensors(spec: CaseSpec, *, dtype: Any = "float64", requires_grad: bool = True
                 ) -> TorchCase:
    """The inputs of ``spec`` as torch tensors in ``dtype`` (q, k, v with their recorded strides).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> import pytest; _ = pytest.importorskip("torch")  # optional stack
    >>> t = case_tensors(case_spec(build_suite("contract")[4]), dtype="bfloat16")
    >>> str(t.q.dtype), tuple(t.k.shape), t.q.requires_grad
    ('torch.bfloat16', (2, 2, 6, 5), True)
    """
    precision = precision_name(resolve_dtype(dtype))
    t = spec.tensors

    def leaf(name: str, role: str | None = None) -> Any:
        x = t[name] if role is None else with_strides(t[name], spec.layout(role)["stride"])
        return _to_torch(x, precision, grad=requires_grad)

    family = spec.score_family()
    return TorchCase(
        q=leaf("q", "query"), k=leaf("k", "key_physical"), v=leaf("v", "value_physical"),
        bias=leaf("bias") if "bias" in t else None,
        sink=leaf("sink") if "sink" in t else None,
        score_params={n: leaf(f"score_{n}") for n in family.parameters()},
        grad_output=_to_torch(t["grad_output"], precision),
        multiplier=_to_torch(spec.multiplier_full(), precision),
        visible=_to_torch(np.ascontiguousarray(spec.visible_full(sanitized=True)), precision),
        query_valid=_to_torch(np.ascontiguousarray(spec.query_valid_full()), precision),
        head_map=_to_torch(np.asarray(t["head_map"], dtype=np.int64), precision),
    )


def _numpy(x: Any) -> np.ndarray:
    return np.array(as_numpy("tensor", x))


# -- observation ---------------------------------------------------------------------------
def _spy() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spy(TorchDispatchMode):
        """Records the name of every ATen operator dispatched below autograd."""

        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return Spy()


def _observed(ops: list[str]) -> str:
    for op in ops:
        if op in _FUSED_OPS:
            return _FUSED_OPS[op]
    seen = set(ops)
    if seen & {"bmm", "mm", "matmul"} and seen & {"_softmax", "_safe_softmax"}:
        return "math"  # the decomposition of SDPA's math backend ran (no fused operator)
    return "unobserved"


def _kernel_context(backend: Backend) -> Any:
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    match backend:
        case "auto":
            return contextlib.nullcontext()
        case "math":
            return sdpa_kernel([SDPBackend.MATH])
        case "flash":
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        case "efficient":
            return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
        case "cudnn":
            return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
        case _:
            raise RefAttnError(
                f"backend: expected one of ['auto', 'math', 'flash', 'efficient', 'cudnn'], "
                f"got {backend!r}"
            )


def _manifest(spec: CaseSpec, *, precision: str, entrypoint: str, requested: str,
              selected: str, is_causal: bool, mask_kind: str, materialized: bool,
              dropout: dict[str, Any] | None = None) -> dict[str, Any]:
    torch = _torch()
    m = copy.deepcopy(dict(spec.call_manifest))
    internal = "backend_internal" if not materialized else precision
    m["numerical"] = {
        "qkv_storage_dtype": precision,
        "score_accumulation_dtype": internal,
        "softmax_accumulation_dtype": internal,
        "probability_dtype": internal,
        "value_accumulation_dtype": internal,
        "output_dtype": precision,
    }
    m["backend"] = {
        "framework_revision": f"torch {torch.__version__}",
        "model_revision": None,
        "entrypoint": entrypoint,
        "requested_backend": requested,
        "selected_backend": selected,
        "device_arch": "cpu",
        "autocast": bool(torch.is_autocast_enabled()),
        "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
        "arithmetic_mode": (f"{precision}; float32 matmul precision "
                            f"{torch.get_float32_matmul_precision()}"),
        "is_causal": is_causal,
        "external_mask_kind": mask_kind,
        "compile_state": "eager",
    }
    if dropout is not None:
        m["dropout"] = {**m["dropout"], **dropout}
    m["materialization"] = {"scores": materialized, "probabilities": materialized}
    return m


# -- shared pieces -------------------------------------------------------------------------
def _kv_heads(tc: TorchCase, k: Any, v: Any, expand: bool) -> tuple[Any, Any]:
    if not expand:
        return k, v
    return k.index_select(1, tc.head_map), v.index_select(1, tc.head_map)  # (B, Hq, K, D)


def _finish(tc: TorchCase, out: Any) -> Any:
    """Zero unused query rows (query_valid False), as the contract's output does."""
    return out.masked_fill(~tc.query_valid, 0.0)  # (B, Hq, Q, Dv)


def _backward(tc: TorchCase, out: Any, extra: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    out.backward(tc.grad_output)
    grads: dict[str, Any] = {"grad_q": tc.q.grad, "grad_k": tc.k.grad, "grad_v": tc.v.grad}
    if tc.bias is not None:
        grads["grad_bias"] = tc.bias.grad
    if tc.sink is not None:
        grads["grad_sink"] = tc.sink.grad
    for name, p in tc.score_params.items():
        grads[f"grad_score_{name}"] = p.grad
    for name, t in (extra or {}).items():
        grads[name] = t.grad
    return {n: g for n, g in grads.items() if g is not None}


# -- the SDPA lowering of a case, as a user calls it --------------------------------------
@public
@dataclass(frozen=True, eq=False)
class SdpaCall:
    """One case lowered to ``torch.nn.functional.scaled_dot_product_attention``.

    Call it as ``F.scaled_dot_product_attention(*sdpa.args, **sdpa.kwargs)``, zero the rows
    refattn calls unused (``sdpa.finish(out)``), then ``out.backward(sdpa.grad_output)`` and
    ``sdpa.grads()`` holds the gradients under refattn's names.

    Attributes
    ----------
    args : (query, key, value) tensors
        query ``(B, Hq, Q, Dk)``, key ``(B, Hkv, K, Dk)``, value ``(B, Hkv, K, Dv)`` in the
        run's dtype: the leaves ``q``, ``k``, ``v`` themselves, or computed from them (a scale
        placement's multiplier applied to q or k; K/V expanded to ``(B, Hq, K, D)`` by an
        explicit head map), so autograd reaches the leaves.
    kwargs : dict
        The exact keywords: ``attn_mask`` (None; a ``(B, Hq, Q, K)`` bool mask in torch's
        polarity, True = takes part, which is refattn's; or, with a bias, a float mask holding
        the bias where visible and ``-inf`` elsewhere), ``dropout_p=0.0``, ``is_causal``
        (True only where the support is torch's upper-left triangle and ``causal="auto"``),
        ``scale`` (always explicit: alpha, or 1.0 when alpha was moved into q or k) and
        ``enable_gqa`` (grouped heads, Hq > Hkv).
    q, k, v : tensors
        The autograd leaves in refattn's layout; ``bias`` the bias leaf (its own shape) or None.
    query_valid : (B, 1, Q, 1) bool tensor
        Output rows where it is False are zero in refattn (and get no gradient).
    grad_output : (B, Hq, Q, Dv) tensor
        The case's G_O.
    arguments : SdpaArguments
        The lowering's decisions.
    precision : str
        The dtype the tensors were rounded to, once, from float64.
    mask_kind : str
        ``none``, ``sdpa_bool_true_participates`` or ``additive_float_minus_inf``.
    """

    args: tuple[Any, Any, Any]
    kwargs: dict[str, Any]
    q: Any
    k: Any
    v: Any
    bias: Any
    query_valid: Any
    grad_output: Any
    arguments: SdpaArguments
    precision: str
    mask_kind: str
    tensors: TorchCase

    def finish(self, out: Any) -> Any:
        """``out`` with the rows refattn calls unused set to zero (no gradient flows there)."""
        return _finish(self.tensors, out)  # (B, Hq, Q, Dv)

    def grads(self) -> dict[str, Any]:
        """The leaves' gradients under refattn's names (``grad_q``, ``grad_k``, ``grad_v``,
        ``grad_bias``), after ``backward``; a leaf without a gradient is left out."""
        tc = self.tensors
        out = {"grad_q": tc.q.grad, "grad_k": tc.k.grad, "grad_v": tc.v.grad}
        if tc.bias is not None:
            out["grad_bias"] = tc.bias.grad
        return {n: g for n, g in out.items() if g is not None}


@public
def sdpa_call(spec: CaseSpec, *, dtype: Any = "float64",
              gqa: Literal["native", "expand"] = "native",
              causal: Literal["explicit", "auto"] = "explicit",
              requires_grad: bool = True) -> SdpaCall:
    """The exact SDPA call of ``spec`` in ``dtype`` (see :class:`SdpaCall`).

    Parameters
    ----------
    spec : CaseSpec
    dtype : {"float64", "float32", "float16", "bfloat16"}
    gqa : {"native", "expand"}
        ``enable_gqa=True`` for grouped heads, or K/V expanded to the query heads.
    causal : {"explicit", "auto"}
        Always an explicit mask, or ``is_causal`` where it is exactly the support.
    requires_grad : bool
        Whether q, k, v (and the bias) are autograd leaves.

    Returns
    -------
    SdpaCall

    Raises
    ------
    RefAttnError
        When SDPA cannot express the case, naming why (:func:`ineligible`).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> import pytest; torch = pytest.importorskip("torch")  # optional stack
    >>> sdpa = sdpa_call(case_spec(CASES["gqa_hq8_hkv2_causal"]()), dtype="float32")
    >>> [tuple(t.shape) for t in sdpa.args], sdpa.kwargs["enable_gqa"], sdpa.kwargs["is_causal"]
    ([(2, 8, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)], True, False)
    >>> sdpa.kwargs["attn_mask"].dtype, sdpa.kwargs["dropout_p"]
    (torch.bool, 0.0)
    >>> out = sdpa.finish(torch.nn.functional.scaled_dot_product_attention(*sdpa.args,
    ...                                                                  **sdpa.kwargs))
    >>> out.backward(sdpa.grad_output)
    >>> sorted(sdpa.grads())
    ['grad_k', 'grad_q', 'grad_v']
    """
    reason = ineligible(spec, "sdpa")
    if reason is not None:
        raise RefAttnError(f"{spec.case_id}: torch SDPA cannot express this case: {reason}")
    torch = _torch()
    precision = precision_name(resolve_dtype(dtype))
    args = sdpa_arguments(spec, gqa=gqa, causal=causal)
    tc = case_tensors(spec, dtype=precision, requires_grad=requires_grad)
    q = tc.q if args.query_multiplier == 1.0 else tc.q * args.query_multiplier
    k = tc.k if args.key_multiplier == 1.0 else tc.k * args.key_multiplier
    k, v = _kv_heads(tc, k, tc.v, args.expand_kv)
    match args.mask:
        case "none":
            mask, kind = None, "none"
        case "bool":
            mask, kind = tc.visible, "sdpa_bool_true_participates"
        case _:  # finite bias first, then -inf where not visible (no bias can revive an edge)
            mask = torch.where(tc.visible, tc.bias, torch.tensor(-torch.inf, dtype=q.dtype))
            kind = "additive_float_minus_inf"
    kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": args.is_causal,
              "scale": args.scale, "enable_gqa": args.enable_gqa}
    return SdpaCall((q, k, v), kwargs, tc.q, tc.k, tc.v, tc.bias, tc.query_valid,
                    tc.grad_output, args, precision, kind, tc)


# -- the three paths -----------------------------------------------------------------------
def _run_sdpa(spec: CaseSpec, precision: str, *, backend: Backend, gqa: Any,
              causal: Any) -> AdapterResult:
    import torch.nn.functional as F

    sdpa = sdpa_call(spec, dtype=precision, gqa=gqa, causal=causal)
    args = sdpa.arguments
    spy = _spy()
    with _kernel_context(backend), spy:
        try:
            out = F.scaled_dot_product_attention(*sdpa.args, **sdpa.kwargs)
        except RuntimeError as exc:
            raise RefAttnError(f"torch sdpa ({backend}): {exc}") from None
    out = sdpa.finish(out)
    selected = _observed(spy.ops)
    grads = _backward(sdpa.tensors, out)
    tensors = {"output": out, **grads}
    manifest = _manifest(
        spec, precision=precision, entrypoint="torch.nn.functional.scaled_dot_product_attention",
        requested=backend, selected=selected, is_causal=args.is_causal,
        mask_kind=sdpa.mask_kind, materialized=selected == "math",
        dropout={"training": False, "p": 0.0, "adapter": "dropout_off"},
    )
    manifest["backend"]["gqa"] = ("enable_gqa" if args.enable_gqa else
                                  "expanded_kv" if args.expand_kv else "equal_heads")
    return AdapterResult(spec.case_id, "torch.sdpa", precision,
                         {n: _numpy(x) for n, x in tensors.items()}, manifest)


def _scores_eager(spec: CaseSpec, tc: TorchCase, k_eff: Any) -> Any:
    """(B, Hq, Q, K) scores of the case's family, scale placement applied."""
    torch = _torch()
    mult = operand_multipliers(spec.scale, spec.scale_placement)
    q = tc.q if mult.query == 1.0 else tc.q * mult.query  # (B, Hq, Q, Dq)
    k = k_eff if mult.key == 1.0 else k_eff * mult.key  # (B, Hq, K, Dk)
    p = tc.score_params
    match spec.score_family_name:
        case "dot":
            u = q @ k.transpose(-1, -2)  # (B, Hq, Q, K)
        case "bilinear":
            u = (q @ p["W"]) @ k.transpose(-1, -2)
        case "additive":
            qt = torch.einsum("bhqd,had->bhqa", q, p["Wq"])  # (B, Hq, Q, Da)
            kt = torch.einsum("bhkd,had->bhka", k, p["Wk"])  # (B, Hq, K, Da)
            pair = torch.tanh(qt[:, :, :, None, :] + kt[:, :, None, :, :]
                              + p["b"][None, :, None, None, :])  # (B, Hq, Q, K, Da)
            u = torch.einsum("bhqka,ha->bhqk", pair, p["v"])
        case "cosine":
            eps = float.fromhex(spec.call_manifest["score"]["eps"]["hex"])
            qn = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(eps)
            kn = k / torch.linalg.vector_norm(k, dim=-1, keepdim=True).clamp_min(eps)
            u = qn @ kn.transpose(-1, -2)
        case other:
            raise RefAttnError(f"torch eager: unknown score family {other!r}")
    return u * mult.post if mult.post != 1.0 else u


def _run_eager(spec: CaseSpec, precision: str) -> AdapterResult:
    torch = _torch()
    tc = case_tensors(spec, dtype=precision)
    k_eff, v_eff = _kv_heads(tc, tc.k, tc.v, True)  # (B, Hq, K, Dk), (B, Hq, K, Dv)
    keep: dict[str, Any] = {}
    scores = _scores_eager(spec, tc, k_eff)  # (B, Hq, Q, K)
    if spec.softcap is not None:
        keep["softcap_input"] = scores
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    keep["scores"] = scores
    biased = scores if tc.bias is None else scores + tc.bias
    keep["biased_scores"] = biased
    masked = biased.masked_fill(~tc.visible, -torch.inf)  # SDPA-free: True = legal
    if tc.sink is not None:  # the sink joins every row's denominator, with no value row
        sink_col = tc.sink[None, :, None, None].expand(*masked.shape[:3], 1)
        full = torch.cat([masked, sink_col], dim=-1)  # (B, Hq, Q, K + 1)
        lse = torch.logsumexp(full, dim=-1)
        row_max = full.amax(dim=-1)
        both = torch.softmax(full, dim=-1)
        probs, sink_probs = both[..., :-1], both[..., -1]
    else:
        lse = torch.logsumexp(masked, dim=-1)
        row_max = masked.amax(dim=-1)
        probs = torch.softmax(masked, dim=-1)
        sink_probs = None
    consumed = probs * tc.multiplier  # the golden dropout multiplier, injected
    out = _finish(tc, consumed @ v_eff)  # (B, Hq, Q, Dv)
    for x in (biased, probs, consumed, keep.get("softcap_input")):
        if x is not None:
            x.retain_grad()  # their gradients are canonical tensors too
    fwd = {**keep, "masked_scores": masked, "row_max": row_max, "lse": lse, "probs": probs,
           "dropout_multiplier": tc.multiplier, "consumed": consumed, "output": out}
    if sink_probs is not None:
        fwd["sink_probs"] = sink_probs
    grads = _backward(tc, out)
    grads["grad_consumed"] = consumed.grad
    grads["grad_probs"] = probs.grad
    grads["grad_scores"] = biased.grad
    if "softcap_input" in keep:
        grads["grad_softcap_input"] = keep["softcap_input"].grad
    tensors = {n: _numpy(x) for n, x in {**fwd, **grads}.items() if x is not None}
    manifest = _manifest(
        spec, precision=precision, entrypoint="refattn.adapters.torch eager (torch ops)",
        requested="eager", selected="eager", is_causal=False,
        mask_kind="masked_fill_true_means_legal", materialized=True,
        dropout={"adapter": "injected_golden_multiplier"} if spec.has_dropout else None,
    )
    return AdapterResult(spec.case_id, "torch.eager", precision, tensors, manifest)


def _key_padding(spec: CaseSpec) -> np.ndarray | None:
    """(B, K) key validity when the relation is pure key padding, else None."""
    vis = spec.visible_full(sanitized=True)  # (B, Hq, Q, K)
    first = vis[:, :1, :1, :]  # (B, 1, 1, K)
    if np.array_equal(vis, np.broadcast_to(first, vis.shape)):
        return first[:, 0, 0, :]
    return None


def _run_mha(spec: CaseSpec, precision: str, *, need_weights: bool) -> AdapterResult:
    import math

    import torch.nn.functional as F

    torch = _torch()
    tc = case_tensors(spec, dtype=precision)
    a = spec.axes
    B, Hq, Q, K, D = a["B"], a["Hq"], a["Q"], a["K"], a["Dk"]
    E = Hq * D
    dt = tc.q.dtype
    # MHA scales q by D**-0.5 itself; any other alpha goes into the query projection
    c = 1.0 if spec.scale_is_default else spec.scale * math.sqrt(D)
    w_in = torch.zeros(3 * E, E, dtype=dt)
    w_in[:E] = torch.eye(E, dtype=dt) * c
    k_eff, v_eff = _kv_heads(tc, tc.k, tc.v, Hq != a["Hkv"] or spec.head_map_mode != "grouped")
    query = tc.q.permute(2, 0, 1, 3).reshape(Q, B, E)  # (Q, B, E), head-major inside E
    dummy = torch.zeros(K, B, E, dtype=dt)  # K/V come pre-projected through static_k/v
    padding = _key_padding(spec) if tc.bias is None else None
    if tc.bias is not None:  # additive float mask: bias, -inf where not visible
        mask = torch.where(tc.visible, tc.bias, torch.tensor(-torch.inf, dtype=dt))
        attn_mask, kpm, kind = mask.expand(B, Hq, Q, K).reshape(B * Hq, Q, K), None, \
            "mha_additive_float"
    elif padding is not None and not padding.all():
        attn_mask, kind = None, "mha_key_padding_true_means_ignored"
        kpm = torch.from_numpy(~padding)  # MHA polarity: True = ignored
    elif padding is not None:
        attn_mask = kpm = None
        kind = "none"
    else:
        attn_mask = (~tc.visible).reshape(B * Hq, Q, K)  # MHA polarity: True = blocked
        kpm, kind = None, "mha_bool_true_means_blocked"
    spy = _spy()
    with spy:
        out, weights = F.multi_head_attention_forward(
            query, dummy, dummy, E, Hq, w_in, None, None, None, False, 0.0,
            torch.eye(E, dtype=dt), None, training=False, key_padding_mask=kpm,
            need_weights=need_weights, attn_mask=attn_mask,
            static_k=k_eff.reshape(B * Hq, K, D), static_v=v_eff.reshape(B * Hq, K, D),
            average_attn_weights=False,
        )
    out = _finish(tc, out.reshape(Q, B, Hq, D).permute(1, 2, 0, 3))
    selected = _observed(spy.ops)
    if need_weights and selected == "math":
        selected = "mha_explicit_softmax"
    grads = _backward(tc, out)
    tensors = {"output": out, **grads}
    if need_weights and weights is not None:  # torch returns them when asked
        tensors["probs"] = weights.detach()  # per head, pre-dropout (dropout is off)
    manifest = _manifest(
        spec, precision=precision, entrypoint="torch.nn.functional.multi_head_attention_forward",
        requested=f"mha need_weights={need_weights}", selected=selected, is_causal=False,
        mask_kind=kind, materialized=need_weights,
        dropout={"training": False, "p": 0.0, "adapter": "dropout_off",
                 "returned_weights": "pre_dropout" if need_weights else "none"},
    )
    return AdapterResult(spec.case_id, "torch.mha", precision,
                         {n: _numpy(x) for n, x in tensors.items()}, manifest)


@public
def run(spec: CaseSpec, path: Path = "sdpa", *, dtype: Any = "float64",
        backend: Backend = "auto", gqa: Literal["native", "expand"] = "native",
        causal: Literal["explicit", "auto"] = "explicit",
        need_weights: bool = True) -> AdapterResult:
    """Run ``spec`` through one PyTorch path in ``dtype``; forward and autograd backward.

    Parameters
    ----------
    spec : CaseSpec
    path : {"sdpa", "eager", "mha"}
    dtype : {"float64", "float32", "float16", "bfloat16"}
    backend : {"auto", "math", "flash", "efficient", "cudnn"}
        SDPA kernel request (``sdpa_kernel``); the manifest records it and what ran.
    gqa : {"native", "expand"}
        SDPA: ``enable_gqa=True`` for the grouped head map, or expand K/V explicitly.
    causal : {"explicit", "auto"}
        SDPA: always pass the relation as a mask, or use ``is_causal`` where it is exact.
    need_weights : bool
        MHA: request per-head weights (its explicit path) or not (its SDPA path).

    Returns
    -------
    AdapterResult

    Raises
    ------
    RefAttnError
        When the path cannot express the case (see :func:`ineligible`) or torch fails.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> import pytest; _ = pytest.importorskip("torch")  # optional stack
    >>> spec = case_spec(build_suite("contract")[4])
    >>> res = run(spec, "sdpa")
    >>> res.compare(spec).passed, res.manifest["backend"]["selected_backend"]
    (True, 'math')
    """
    reason = ineligible(spec, path)
    if reason is not None:
        raise RefAttnError(f"{spec.case_id}: torch path {path!r} cannot run this case: {reason}")
    precision = precision_name(resolve_dtype(dtype))
    match path:
        case "sdpa":
            return _run_sdpa(spec, precision, backend=backend, gqa=gqa, causal=causal)
        case "eager":
            return _run_eager(spec, precision)
        case "mha":
            return _run_mha(spec, precision, need_weights=need_weights)
        case _:  # pragma: no cover - ineligible() rejects other paths
            raise RefAttnError(f"path: {path!r}")

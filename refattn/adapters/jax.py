"""JAX adapter: one golden case through ``jax.nn.dot_product_attention``.

Owns the lowering of a case's semantic call to JAX's functional attention: BTNH layout (the
head-major refattn tensors are transposed, values unchanged), x64 enabled for float64 runs,
the boolean ``mask`` in JAX polarity (True takes part), the finite bias as ``bias``, an
explicit ``scale``, native grouped heads (query head h reads kv head h // G) or an explicit
expansion for any other head map, and ``is_causal`` / ``local_window_size`` only where the
support they generate (upper-left triangle, windows over positions 0..T-1 and 0..S-1) equals
the call's relation exactly; anything else travels as an explicit mask. Gradients come from
``jax.vjp``.

Version-scoped numerical fact (jax ``_dot_product_attention_core``): the XLA implementation
always evaluates the softmax in float32, also for float64 inputs, so a float64 JAX run is
compared under the float32 reference-relative rule and its manifest records
``softmax_accumulation_dtype: float32``.

jax is imported inside functions only. The lowering decisions (:func:`call_arguments`,
:func:`ineligible`) are pure numpy and need no jax. Defers the verdict to
:mod:`refattn.bundle.comparison.harness`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import INT64_MAX, bounded_int
from refattn._memory import check_bytes
from refattn.adapters import AdapterResult, semantic_limits
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec
from refattn.call.placement import operand_multipliers
from refattn.engine.reduce import sum_heads
from refattn.errors import RefAttnError

__all__ = ["JaxArguments", "JaxCall", "call_arguments", "ineligible", "jax_call",
           "native_support", "run"]


def _jax() -> Any:
    try:
        import jax
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError(
            f"jax adapter: JAX is not installed ({install_hint('compare')})"
        ) from None
    return jax


@public
def ineligible(spec: CaseSpec) -> str | None:
    """Why ``jax.nn.dot_product_attention`` cannot express ``spec`` exactly, or None.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> ineligible(case_spec(build_suite("contract")[4]))
    'Dk != Dv (value must have the shape of key)'
    """
    lim = semantic_limits(spec)
    if lim["family"] != "dot":
        return f"score family {lim['family']!r} (dot_product_attention computes dot products)"
    if lim["softcap"]:
        return "softcap (not an argument of jax.nn.dot_product_attention)"
    if lim["sink"]:
        return "sink logit (not an argument of jax.nn.dot_product_attention)"
    if lim["dropout"]:
        return "dropout multiplier (jax.nn.dot_product_attention has no dropout)"
    if not lim["equal_kv_width"]:
        return "Dk != Dv (value must have the shape of key)"
    return None


@public
def native_support(T: int, S: int, *, is_causal: bool,
                   window: tuple[int, int] | None) -> np.ndarray:
    """The (T, S) support that ``is_causal`` and ``local_window_size`` generate in JAX.

    Causal is the upper-left triangle ``j <= i``; a window ``(l, r)`` keeps
    ``i - l <= j <= i + r`` over positions ``0..T-1`` and ``0..S-1``.

    Examples
    --------
    >>> native_support(2, 3, is_causal=True, window=None).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
    >>> native_support(3, 3, is_causal=False, window=(1, 0)).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    T = bounded_int("T", T, lo=0, hi=INT64_MAX)
    S = bounded_int("S", S, lo=0, hi=INT64_MAX)
    check_bytes(4 * T * S + 16 * (T + S), f"the (T, S) = ({T}, {S}) support",
                "it is a dense boolean array")
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    out = np.ones((T, S), bool)
    if is_causal:
        out &= j <= i
    if window is not None:
        left, right = window
        out &= (i <= j + left) & (i >= j - right)
    return out


@public
@dataclass(frozen=True)
class JaxArguments:
    """How a case is lowered to ``jax.nn.dot_product_attention``.

    Attributes
    ----------
    mask : bool
        An explicit boolean mask (JAX polarity: True takes part) is passed.
    is_causal : bool
    local_window_size : (int, int) or None
    scale : float
        Explicit ``scale=`` (alpha, or 1.0 when alpha was moved into q/k).
    query_multiplier, key_multiplier : float
        Scale placement: multipliers applied to q and k before the call.
    expand_kv : bool
        K/V expanded to Hq heads by ``head_map`` (any map other than grouped h // G).
    """

    mask: bool
    is_causal: bool
    local_window_size: tuple[int, int] | None
    scale: float
    query_multiplier: float
    key_multiplier: float
    expand_kv: bool


def _window_candidates(spec: CaseSpec) -> list[tuple[bool, tuple[int, int] | None]]:
    out: list[tuple[bool, tuple[int, int] | None]] = [(True, None)]
    record = spec.call_manifest["visibility"].get("relation") or {}
    w = record.get("window")
    if w is not None and all(isinstance(x, int) or x is None for x in (w["left"], w["right"])):
        # a bound at or beyond max(Q, K) bounds nothing here: clamped before any arithmetic
        # (a manifest's 2**63 - 1 would wrap in ``j + left``; 10**400 would not convert)
        big = max(spec.axes["Q"], spec.axes["K"])
        left, right = (big if x is None else min(bounded_int(
            f"{spec.case_id}: visibility.relation.window.{side}", x, lo=0, hi=INT64_MAX), big)
            for side, x in (("left", w["left"]), ("right", w["right"])))
        out += [(True, (left, right)), (False, (left, right))]
    return out


@public
def call_arguments(spec: CaseSpec, *, native: Literal["explicit", "auto"] = "explicit"
                   ) -> JaxArguments:
    """The lowering of ``spec`` (pure decision; no jax needed).

    ``native="auto"`` replaces the mask by ``is_causal`` and/or ``local_window_size`` only
    when the support they generate equals the call's whole relation and there is no
    Policy-3 sanitised row; a lower-right or cache-position relation over Q != K never
    becomes ``is_causal`` (JAX's triangle is upper-left).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> call_arguments(case_spec(CASES["causal_square"]()), native="auto").is_causal
    True
    >>> call_arguments(case_spec(CASES["causal_lower_right_q3_k7"]()), native="auto").is_causal
    False
    """
    if native not in ("explicit", "auto"):
        raise RefAttnError(f"native: expected 'explicit' or 'auto', got {native!r}")
    a = spec.axes
    mult = operand_multipliers(spec.scale, spec.scale_placement)
    expand = spec.head_map_mode != "grouped"
    vis = spec.visible_full(sanitized=True)
    is_causal, window, mask = False, None, not bool(vis.all())
    sanitized = bool(spec.tensors.get("sanitized_rows", np.zeros(1, bool)).any())
    if native == "auto" and mask and not sanitized:
        for causal, win in _window_candidates(spec):
            support = native_support(a["Q"], a["K"], is_causal=causal, window=win)
            if np.array_equal(vis, np.broadcast_to(support, vis.shape)):
                is_causal, window, mask = causal, win, False
                break
    return JaxArguments(mask, is_causal, window, float(mult.post), float(mult.query),
                        float(mult.key), expand)


@public
@dataclass(frozen=True, eq=False)
class JaxCall:
    """One case lowered to ``jax.nn.dot_product_attention`` (plain NumPy arrays; no jax needed).

    Call it as ``jax.nn.dot_product_attention(*j.primals, **j.kwargs)``, zero the rows refattn
    calls unused (``jnp.where(j.query_valid, out, 0)``), differentiate with
    ``jax.vjp`` and hand the results to :meth:`outputs`, which returns them under refattn's
    names and layout.

    Attributes
    ----------
    primals : tuple of ndarray
        ``(q, k, v)`` or ``(q, k, v, bias)`` in JAX's BTNH layout and the run's dtype (rounded
        once from float64): q ``(B, Q, Hq, Dk)``, k ``(B, K, Hkv, Dk)``, v ``(B, K, Hkv, Dv)``
        (``Hq`` heads when an explicit head map expanded them); the bias in its own shape,
        broadcastable to ``(B, Hq, Q, K)``. A scale placement's multiplier of q or k is
        already applied (:meth:`outputs` applies it to their gradients).
    kwargs : dict
        ``mask`` (None or ``(B, Hq, Q, K)`` bool, True = takes part, which is refattn's and
        JAX's polarity), ``scale`` (explicit), ``is_causal``, ``local_window_size``.
    query_valid : (B, Q, 1, 1) bool ndarray
        Output rows where it is False are zero in refattn (and get no gradient).
    grad_output : (B, Q, Hq, Dv) ndarray
        The case's G_O in BTNH layout.
    arguments : JaxArguments
    dtype : str
        The inputs' dtype. float64 needs x64 enabled in JAX (``jax.config.update(
        "jax_enable_x64", True)``).
    precision : str
        The precision the comparison must use: ``dtype``, except float32 for float64 inputs
        (JAX's softmax runs in float32).
    """

    primals: tuple[np.ndarray, ...]
    kwargs: dict[str, Any]
    query_valid: np.ndarray
    grad_output: np.ndarray
    arguments: JaxArguments
    dtype: str
    precision: str
    head_map: np.ndarray
    kv_heads: int

    def outputs(self, output: Any, grads: Any = None) -> dict[str, np.ndarray]:
        """``output`` (B, Q, Hq, Dv) and the vjp's gradients of :attr:`primals`, in refattn's
        head-major layout and names (``output``, ``grad_q``, ``grad_k``, ``grad_v``,
        ``grad_bias``); kv gradients of expanded heads summed back, placement multipliers
        applied.

        Raises
        ------
        RefAttnError
            When a float64 run came back in another dtype (x64 is off in JAX).
        """
        def head_major(x: Any) -> np.ndarray:  # (B, T, H, D) -> (B, H, T, D)
            return np.asarray(x).transpose(0, 2, 1, 3)

        def scaled(g: np.ndarray, m: float) -> np.ndarray:  # d/dx of f(m x) = m f'(m x)
            return g if m == 1.0 else (g.astype(np.float64) * m).astype(g.dtype)

        out = head_major(output)
        if self.dtype == "float64" and out.dtype != np.float64:
            raise RefAttnError(f"jax returned {out.dtype} for float64 inputs: enable x64 "
                               "(jax.config.update('jax_enable_x64', True))")
        tensors = {"output": out}
        if grads is None:
            return tensors
        a = self.arguments
        g_q, g_k, g_v = (head_major(g) for g in grads[:3])  # (B, H, T, D)
        if a.expand_kv:  # expanded K/V: sum the query heads that share a kv head
            g_k = sum_heads(g_k, self.head_map, self.kv_heads)
            g_v = sum_heads(g_v, self.head_map, self.kv_heads)
        tensors.update(grad_q=scaled(g_q, a.query_multiplier),
                       grad_k=scaled(g_k, a.key_multiplier), grad_v=g_v)
        if len(grads) > 3:
            tensors["grad_bias"] = np.asarray(grads[3])
        return tensors


@public
def jax_call(spec: CaseSpec, *, dtype: Any = "float64",
             native: Literal["explicit", "auto"] = "explicit") -> JaxCall:
    """The ``jax.nn.dot_product_attention`` call of ``spec`` in ``dtype`` (see :class:`JaxCall`).

    Parameters
    ----------
    spec : CaseSpec
    dtype : {"float64", "float32", "float16", "bfloat16"}
    native : {"explicit", "auto"}
        Always an explicit mask, or ``is_causal`` / ``local_window_size`` where they are
        exactly the relation (:func:`call_arguments`).

    Returns
    -------
    JaxCall

    Raises
    ------
    RefAttnError
        When the function cannot express the case, naming why (:func:`ineligible`).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> j = jax_call(case_spec(CASES["gqa_hq8_hkv2_causal"]()), dtype="float32")
    >>> [x.shape for x in j.primals], j.kwargs["mask"].shape, j.query_valid.shape
    ([(2, 5, 8, 4), (2, 5, 2, 4), (2, 5, 2, 4)], (2, 8, 5, 5), (2, 5, 1, 1))
    >>> j.precision, sorted(j.kwargs)
    ('float32', ['is_causal', 'local_window_size', 'mask', 'scale'])
    """
    reason = ineligible(spec)
    if reason is not None:
        raise RefAttnError(f"{spec.case_id}: jax.nn.dot_product_attention cannot express this "
                           f"case: {reason}")
    precision = precision_name(resolve_dtype(dtype))
    np_dtype = resolve_dtype(precision)
    args = call_arguments(spec, native=native)
    t = spec.tensors

    def arr(x: np.ndarray, m: float = 1.0) -> np.ndarray:  # (B, H, T, D) -> (B, T, H, D)
        x = np.asarray(x)
        x = x if m == 1.0 else x * m  # the placement's multiplier, in float64
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(np_dtype))

    head_map = np.asarray(t["head_map"])
    k_np, v_np = t["k"], t["v"]
    if args.expand_kv:  # explicit head map: K/V per query head
        k_np, v_np = k_np[:, head_map], v_np[:, head_map]
    primals: tuple[np.ndarray, ...] = (arr(t["q"], args.query_multiplier),
                                       arr(k_np, args.key_multiplier), arr(v_np))
    if "bias" in t:
        primals += (np.ascontiguousarray(np.asarray(t["bias"]).astype(np_dtype)),)
    mask = np.ascontiguousarray(spec.visible_full(sanitized=True)) if args.mask else None
    valid = np.ascontiguousarray(spec.query_valid_full().transpose(0, 2, 1, 3))  # (B, Q, 1, 1)
    kwargs = {"mask": mask, "scale": args.scale, "is_causal": args.is_causal,
              "local_window_size": args.local_window_size}
    return JaxCall(primals, kwargs, valid, arr(t["grad_output"]), args, precision,
                   "float32" if precision == "float64" else precision, head_map,
                   int(t["k"].shape[1]))


def _x64(enabled: bool) -> Any:
    if not enabled:
        return contextlib.nullcontext()
    try:
        from jax.experimental import (  # type: ignore[attr-defined, unused-ignore]
            enable_x64,  # gone from newer jax (the ImportError below)
        )
    except ImportError:  # newer jax: global switch
        _jax().config.update("jax_enable_x64", True)
        return contextlib.nullcontext()
    return enable_x64(True)


@public
def run(spec: CaseSpec, *, dtype: Any = "float64", native: Literal["explicit", "auto"] =
        "explicit", implementation: Literal["xla", "cudnn"] | None = None) -> AdapterResult:
    """Run ``spec`` through ``jax.nn.dot_product_attention`` in ``dtype``; gradients by vjp.

    Parameters
    ----------
    spec : CaseSpec
    dtype : {"float64", "float32", "float16", "bfloat16"}
        Input dtype (float64 runs with x64 enabled).
    native : {"explicit", "auto"}
        Always pass an explicit mask, or use ``is_causal`` / ``local_window_size`` where they
        reproduce the relation exactly (see :func:`call_arguments`).
    implementation : {"xla", "cudnn"} or None
        The request recorded as ``requested_backend`` (None: ``auto``).

    Returns
    -------
    AdapterResult
        ``output``, ``grad_q``, ``grad_k``, ``grad_v`` (and ``grad_bias``) in refattn's
        head-major layout; ``precision`` is float32 for float64 inputs (JAX's softmax runs in
        float32).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> import pytest; _ = pytest.importorskip("jax")  # optional stack
    >>> spec = case_spec(CASES["causal_square"]())
    >>> res = run(spec)
    >>> res.compare(spec).passed, res.precision
    (True, 'float32')
    """
    reason = ineligible(spec)
    if reason is not None:
        raise RefAttnError(f"{spec.case_id}: jax.nn.dot_product_attention cannot run this "
                           f"case: {reason}")
    precision = precision_name(resolve_dtype(dtype))
    jax = _jax()
    with _x64(precision == "float64"):
        return _run(spec, precision, native, implementation, jax)


def _run(spec: CaseSpec, precision: str, native: Any, implementation: Any,
         jax: Any) -> AdapterResult:
    import jax.numpy as jnp

    call = jax_call(spec, dtype=precision, native=native)
    args = call.arguments
    valid = jnp.asarray(call.query_valid)  # (B, Q, 1, 1)

    def f(*p: Any) -> Any:
        out = jax.nn.dot_product_attention(*p, **call.kwargs, implementation=implementation)
        return jnp.where(valid, out, jnp.zeros((), out.dtype))  # unused rows are zero

    primals = tuple(jnp.asarray(x) for x in call.primals)
    jitted = jax.jit(f)  # one XLA program per case: far faster than op-by-op dispatch
    out, vjp = jax.vjp(jitted, *primals)
    tensors = call.outputs(out, vjp(jnp.asarray(call.grad_output)))
    lowered = jitted.lower(*primals).as_text()
    selected = "cudnn" if "cudnn" in lowered.lower() else "xla"
    effective = "float32" if precision == "float64" else precision
    manifest = copy.deepcopy(dict(spec.call_manifest))
    manifest["numerical"] = {
        "qkv_storage_dtype": precision,
        "score_accumulation_dtype": "float64" if precision == "float64" else "float32",
        "softmax_accumulation_dtype": "float32",
        "probability_dtype": precision,
        "value_accumulation_dtype": "backend_internal",
        "output_dtype": precision,
    }
    manifest["backend"] = {
        "framework_revision": f"jax {jax.__version__}",
        "model_revision": None,
        "entrypoint": "jax.nn.dot_product_attention",
        "requested_backend": implementation or "auto",
        "selected_backend": selected,
        "device_arch": jax.devices()[0].platform,
        "autocast": False,
        "deterministic": True,
        "arithmetic_mode": f"{precision} inputs; softmax in float32",
        "is_causal": args.is_causal,
        "external_mask_kind": "jax_bool_true_takes_part" if args.mask else "none",
        "local_window_size": None if args.local_window_size is None
        else list(args.local_window_size),
        "compile_state": "jit (vjp of the jitted function; its lowering inspected)",
    }
    manifest["dropout"] = {**manifest["dropout"], "training": False, "p": 0.0}
    manifest["materialization"] = {"scores": "backend_internal",
                                   "probabilities": "backend_internal"}
    return AdapterResult(spec.case_id, "jax.dot_product_attention", effective, tensors,
                         manifest)

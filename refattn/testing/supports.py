"""What a function under test supports, and why a case falls outside it.

Owns :class:`Supports` (a user's declaration: score families, dropout kinds, grouped heads,
head maps, bias, masks dense or causal-only, softcap, sinks, value width, dtypes, quantised
pipelines) and
:func:`ineligibility`, the one-line reason a golden case is skipped for it. Reads cases through
:class:`~refattn.bundle.golden.spec.CaseSpec`; runs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec
from refattn.errors import RefAttnError

__all__ = ["DROPOUT_KINDS", "Supports", "ineligibility", "quant_preset"]

#: dropout kinds a function may accept: an explicit multiplier tensor Z (any dropout case: a
#: stream's Z is materialised), or refattn's Philox stream regenerated from its seed
DROPOUT_KINDS = ("multiplier", "philox")
_FAMILIES = ("dot", "bilinear", "additive", "cosine")
_DTYPES = ("float64", "float32", "float16", "bfloat16")


@public
@dataclass(frozen=True)
class Supports:
    """A declaration of what the function under test can compute; the cases outside it are
    skipped with the reason (:func:`ineligibility`).

    The defaults are what ``torch.nn.functional.scaled_dot_product_attention`` expresses
    through :meth:`refattn.testing.Case.to_torch_sdpa`, in float64.

    Attributes
    ----------
    scores : tuple of str
        Score families: ``dot`` (default), ``bilinear``, ``additive``, ``cosine``.
    dropout : tuple of str
        ``()`` (default): no dropout. ``"multiplier"``: the function takes the multiplier Z
        as a tensor (every dropout case). ``"philox"``: it regenerates refattn's Philox
        stream from seed and offset (the stream cases only).
    gqa : bool
        Grouped-query attention, Hkv < Hq with query head h reading kv head h // (Hq // Hkv).
    head_map : bool
        Any other head map (the SDPA and JAX lowerings expand K/V for it).
    bias : bool
        An additive bias (the function returns its gradient as ``grad_bias``).
    masks : {"dense", "causal", "none"}
        ``dense``: any visibility; ``causal``: only all-visible cases and cases whose
        visibility is exactly the causal triangle of ``causal_alignment`` (pass the kernel
        ``causal=case.is_causal``); ``none``: only all-visible cases.
    causal_alignment : {"upper_left", "lower_right"}
        The triangle a causal-only function computes when Q != K, required with
        ``masks="causal"`` (the two differ for every case with Q != K, so a default would
        hide the wrong one): ``upper_left``, key j <= query i (PyTorch's ``is_causal``,
        JAX); ``lower_right``, key j <= i + K - Q (FlashAttention, a KV cache). A case whose
        triangle is the other one is skipped, naming it.
    softcap, sink : bool
        Score softcapping; a per-head sink logit.
    distinct_value_width : bool
        Dv != Dk (``jax.nn.dot_product_attention`` needs Dv == Dk).
    dtypes : tuple of str
        The precisions to run: ``float64``, ``float32``, ``float16``, ``bfloat16``; every case
        is run once per dtype.
    quantized : bool or tuple of str
        ``False`` (default): the function is a float kernel; a quantised case (issue 28: FP8/
        INT8 inputs with a :class:`~refattn.quant.spec.QuantSpec`) runs as a float case, its
        dequantised inputs (``case.q/k/v``) against its real result, like any other case.
        ``True``, or preset names from :data:`refattn.quant.PRESETS` (``"fa3_fp8"``, ...):
        the function is a quantised kernel; only the quantised cases run (of those presets;
        ``True``: every preset and custom specs), every other case is skipped. Its inputs are
        ``case.quant.call``'s q, k, v (as the kernel receives them: FP8 codes decoded, or the
        values it casts itself) with the scales of ``case.quant.spec``; its result is judged
        against the emulated interval (:func:`refattn.quant.check.check_candidate`).

    Examples
    --------
    >>> Supports(masks="causal", causal_alignment="lower_right").causal_alignment
    'lower_right'
    >>> try:
    ...     Supports(masks="causal")
    ... except RefAttnError as exc:
    ...     print(str(exc)[:70])
    Supports(masks='causal'): name the triangle the function computes when
    >>> try:
    ...     Supports(dropout=("bernoulli",))
    ... except RefAttnError as exc:
    ...     print(exc)
    Supports.dropout: expected kinds from ['multiplier', 'philox'], got ['bernoulli']
    >>> Supports(quantized="fa3_fp8").quantized
    ('fa3_fp8',)
    >>> try:
    ...     Supports(quantized=("fa4_fp8",))
    ... except RefAttnError as exc:
    ...     print(str(exc)[:61])
    Supports.quantized: expected True, False or preset names from
    """

    scores: str | tuple[str, ...] = ("dot",)
    dropout: str | tuple[str, ...] = ()
    gqa: bool = True
    head_map: bool = True
    bias: bool = True
    masks: Literal["dense", "causal", "none"] = "dense"
    causal_alignment: Literal["upper_left", "lower_right"] | None = None
    softcap: bool = False
    sink: bool = False
    distinct_value_width: bool = True
    dtypes: str | tuple[str, ...] = ("float64",)
    quantized: bool | str | tuple[str, ...] = False

    def __post_init__(self) -> None:
        self._check_quantized()
        for name, allowed in (("scores", _FAMILIES), ("dropout", DROPOUT_KINDS),
                              ("dtypes", _DTYPES)):
            value = getattr(self, name)
            if isinstance(value, str):  # a single name: the tuple it meant
                value = (value,)
                object.__setattr__(self, name, value)
            bad = [v for v in value if v not in allowed]
            if bad:
                raise RefAttnError(f"Supports.{name}: expected kinds from {list(allowed)}, "
                                   f"got {bad}")
        if not self.dtypes:
            raise RefAttnError("Supports.dtypes: name at least one dtype")
        if self.masks not in ("dense", "causal", "none"):
            raise RefAttnError(f"Supports.masks: expected 'dense', 'causal' or 'none', got "
                               f"{self.masks!r}")
        if self.causal_alignment not in ("upper_left", "lower_right", None):
            raise RefAttnError(f"Supports.causal_alignment: expected 'upper_left' or "
                               f"'lower_right', got {self.causal_alignment!r}")
        if self.masks == "causal" and self.causal_alignment is None:
            raise RefAttnError(
                "Supports(masks='causal'): name the triangle the function computes when Q != "
                "K: causal_alignment='upper_left' (key j <= query i: PyTorch's is_causal, "
                "JAX) or 'lower_right' (key j <= i + K - Q: FlashAttention, a KV cache)")

    def _check_quantized(self) -> None:
        from refattn.quant.presets import PRESETS  # the quant layer, imported when declared

        value = self.quantized
        if isinstance(value, str):  # a single preset: the tuple it meant
            value = (value,)
            object.__setattr__(self, "quantized", value)
        if isinstance(value, bool):
            return
        bad = ([repr(value)] if not isinstance(value, tuple) or not value
               else [repr(v) for v in value if v not in PRESETS])
        if bad:
            raise RefAttnError(f"Supports.quantized: expected True, False or preset names from "
                               f"{list(PRESETS)}, got {', '.join(bad)}")


def _causal_triangle(Q: int, K: int, alignment: str) -> np.ndarray:
    """(Q, K) bool: key j visible from query i under the aligned causal rule."""
    i = np.arange(Q)[:, None]
    j = np.arange(K)[None, :]
    offset = 0 if alignment == "upper_left" else K - Q  # lower right: the last query sees all
    return j <= i + offset


def _mask_reason(spec: CaseSpec, supports: Supports) -> str | None:
    vis = spec.visible_full(sanitized=True)  # (B, Hq, Q, K), the support SDPA/JAX receive
    if vis.all():
        return None
    match supports.masks:
        case "dense":
            return None
        case "none":
            return "a visibility mask (the function supports none: masks='none')"
        case "causal":
            a = spec.axes
            alignment = supports.causal_alignment or "upper_left"  # set with masks="causal"
            tri = np.broadcast_to(_causal_triangle(a["Q"], a["K"], alignment), vis.shape)
            # the triangle as stored, or with the key 0 that rows left empty read (Q > K)
            if np.array_equal(vis, tri) or np.array_equal(spec.visible_full(), tri):
                return None
            other = "lower_right" if alignment == "upper_left" else "upper_left"
            tri = np.broadcast_to(_causal_triangle(a["Q"], a["K"], other), vis.shape)
            if np.array_equal(spec.visible_full(), tri):
                return (f"the {other} causal triangle, not the {alignment} one the function "
                        f"computes (Supports.causal_alignment)")
            return (f"a mask that is not the {alignment} causal triangle (the "
                    "function supports causal masks only: masks='causal')")
        case _:  # pragma: no cover - Supports validates masks
            raise RefAttnError(f"Supports.masks: {supports.masks!r}")


def _dtype_reason(spec: CaseSpec, dtype: str) -> str | None:
    try:
        np_dtype = resolve_dtype(dtype)
    except RefAttnError as exc:
        return str(exc)
    t = spec.tensors
    with np.errstate(over="ignore"):
        for name in ("q", "k", "v", "bias", "sink", "grad_output"):
            if name in t and not np.isfinite(np.asarray(t[name]).astype(np_dtype)).all():
                return f"{name} overflows {precision_name(np_dtype)}"
    return None


def quant_preset(spec: CaseSpec) -> str | None:
    """The preset name of a quantised case (``"custom"`` for a spec not built by a preset),
    or None for a case that is not quantised.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> quant_preset(case_spec(CASES["causal_square"]())) is None
    True
    """
    quant = getattr(spec, "quant", None)
    if quant is None:
        return None
    record = quant.get("spec", quant) if isinstance(quant, Mapping) else quant
    name = record.get("name") if isinstance(record, Mapping) else getattr(record, "name", None)
    return str(name) if name else "custom"


def _quant_reason(spec: CaseSpec, supports: Supports) -> str | None:
    name = quant_preset(spec)
    wanted = supports.quantized
    if not wanted:  # a float kernel runs every case, a quantised one on its real result
        return None
    if name is None:
        return "a float case (Supports.quantized selects the quantised cases only)"
    if isinstance(wanted, tuple) and name not in wanted:
        return (f"the quantised pipeline {name!r}, not one of {list(wanted)} "
                "(Supports.quantized)")
    return None


@public
def ineligibility(spec: CaseSpec, supports: Supports, dtype: Any = "float64") -> str | None:
    """Why the function described by ``supports`` cannot run ``spec`` in ``dtype``, or None.

    Parameters
    ----------
    spec : CaseSpec
    supports : Supports
    dtype : str
        The precision of the run (one of ``supports.dtypes``).

    Returns
    -------
    str or None
        e.g. ``"needs dropout as a multiplier tensor (Supports.dropout)"``.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> ineligibility(case_spec(CASES["dropout_philox"]()), Supports())
    "needs dropout: refattn's Philox stream (Supports.dropout: 'multiplier' or 'philox')"
    >>> causal = Supports(masks="causal", causal_alignment="upper_left")
    >>> ineligibility(case_spec(CASES["causal_square"]()), causal) is None
    True
    >>> print(ineligibility(case_spec(CASES["causal_lower_right_q3_k7"]()), causal)[:60])
    needs the lower_right causal triangle, not the upper_left on
    """
    a = spec.axes
    family = spec.score_family_name
    mode = spec.dropout.get("mode", "none")
    reason: str | None = _quant_reason(spec, supports)
    if reason is not None:
        pass
    elif family not in supports.scores:
        reason = f"the {family!r} score family (Supports.scores)"
    elif spec.softcap is not None and not supports.softcap:
        reason = "a softcap (Supports.softcap)"
    elif "sink" in spec.tensors and not supports.sink:
        reason = "a sink logit (Supports.sink)"
    elif mode == "explicit_multiplier" and "multiplier" not in supports.dropout:
        reason = "dropout as a multiplier tensor (Supports.dropout: 'multiplier')"
    elif mode == "stream" and not supports.dropout:
        reason = ("dropout: refattn's Philox stream (Supports.dropout: 'multiplier' or "
                  "'philox')")
    elif "bias" in spec.tensors and not supports.bias:
        reason = "an additive bias (Supports.bias)"
    elif spec.head_map_mode != "grouped" and not supports.head_map:
        reason = "an explicit head map (Supports.head_map)"
    elif spec.head_map_mode == "grouped" and a["Hq"] != a["Hkv"] and not supports.gqa:
        reason = f"grouped-query attention, Hq={a['Hq']} over Hkv={a['Hkv']} (Supports.gqa)"
    elif a["Dk"] != a["Dv"] and not supports.distinct_value_width:
        reason = f"Dv={a['Dv']} != Dk={a['Dk']} (Supports.distinct_value_width)"
    else:
        reason = _mask_reason(spec, supports)
    if reason is not None:
        return f"needs {reason}"
    return _dtype_reason(spec, dtype)

"""Name the planted bug a failing quantised kernel shows, by re-emulating mutated specs.

Owns :func:`mutations` (the bugs kernel authors plant by accident, each as a changed
:class:`~refattn.quant.spec.QuantSpec`) and :func:`diagnose`, which re-runs the emulated
pipeline under each mutation and names those whose intervals contain the candidate. A
diagnosis is a hypothesis that was tested (docs/STYLE 18): a mutation is named only when its
emulation contains every element of every candidate tensor, the unmutated spec's does not, and
its intervals differ from the unmutated ones (a mutation that changes nothing for this call,
e.g. saturation where nothing overflows, is not a hypothesis this call can test). Two mutations
that give the same intervals (a missing q descale and a missing k descale are one factor of the
exponent multiplier in FA3) are both named: the call cannot tell them apart. Defers the
emulation to :mod:`refattn.quant.pipeline` and the containment test to
:mod:`refattn.quant.check`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from refattn._boundary import public, shown
from refattn.call import AttentionCall
from refattn.errors import RefAttnError
from refattn.quant.check import _candidate, contains, widened
from refattn.quant.spec import QuantSpec, TensorQuant, check_quant

if TYPE_CHECKING:
    from refattn.quant.pipeline import QuantResult

__all__ = ["MUTATION_NAMES", "Mutation", "diagnose", "mutations"]

#: every mutation :func:`mutations` can give, in the order it gives them
MUTATION_NAMES = (
    "missing_q_descale", "missing_k_descale", "missing_v_descale",
    "wrong_kv_head_descales", "wrong_kv_head_q_descale", "wrong_kv_head_k_descale",
    "wrong_kv_head_v_descale", "non_saturating_casts", "l_after_rounding",
    "l_before_rounding", "missing_p_offset", "missing_p_multiplier",
)

#: the head axis of a scale, by granularity (per-head scales only)
_HEAD_AXIS = {"batch_kv_head": 1, "head": 0}


class Mutation(NamedTuple):
    """One planted bug: its name (in ``MUTATION_NAMES``), what the kernel does wrong, the
    spec that emulates that kernel, and the call it receives instead (None: the same call)."""

    name: str
    description: str
    spec: QuantSpec
    call: AttentionCall | None = None


def _with(tq: TensorQuant, **changes: Any) -> TensorQuant:
    values: dict[str, Any] = {
        "format": tq.format, "scale": tq.scale, "granularity": tq.granularity,
        "rounding": tq.rounding, "source": tq.source, "block": tq.block,
        "input_format": tq.input_format}
    values.update(changes)
    return TensorQuant(**values)


def _scale_for(tq: TensorQuant, name: str, call: AttentionCall) -> np.ndarray | None:
    """``tq``'s scale broadcastable to the tensor (None for granularities not handled)."""
    s = tq.scale
    if s is None:
        return None
    match tq.granularity:
        case "tensor":
            return s.reshape(1, 1, 1, 1)
        case "batch_kv_head":  # (B, Hkv); query heads read their kv head's
            return (s[:, call.head_map] if name == "q" else s)[:, :, None, None]
        case "head":  # (H,) of the tensor's own heads
            return s[None, :, None, None]
        case _:
            return None


def _missing_cast_descale(spec: QuantSpec, call: AttentionCall, t: str) -> Mutation | None:
    """A ``"cast"`` tensor whose codes the kernel casts with its scale and then reads with
    descale 1: the same codes come from casting ``x / scale`` with scale 1."""
    tq: TensorQuant = getattr(spec, t)
    s = _scale_for(tq, t, call)
    if s is None:
        return None
    x = getattr(call, t) / s  # float64; fl32 of it is fl32(x / s) except at fp32 ties
    mutated = AttentionCall(*(x if n == t else getattr(call, n) for n in ("q", "k", "v")),
                            visible=call.visible, scale=call.scale, head_map=call.head_map)
    return Mutation(f"missing_{t}_descale",
                    f"the kernel casts {t} with its scale but leaves the descale out (1)",
                    spec.replace(**{t: _with(tq, scale=np.ones_like(tq.scale),
                                             input_format=None)}), mutated)


def mutations(spec: QuantSpec, call: AttentionCall | None = None) -> list[Mutation]:
    """The planted bugs that change ``spec``, each as a mutated spec (and call).

    A missing descale (a ``"codes"`` tensor's scale taken as 1; for a ``"cast"`` tensor, with
    ``call`` given, the codes cast with the scale read with descale 1: the call's tensor
    divided by the scale, cast with scale 1 (the quotient rounded twice, float64 then fp32,
    instead of once: different only where the float64 quotient is an fp32 tie; vLLM's Q,
    multiplied by ``fl32(1 / scale)``, can differ by an fp32 ulp before its cast)), descales
    of the wrong kv head (kv head j reads j + 1's: the scales indexed by kv head, all
    together and each alone; FA3's (B, Hkv) q descale is, FlashInfer's per-query-head q scale
    is not), casts that do not saturate (every satfinite cast, of q/k/v and of P, overflowing
    to NaN or inf instead), l summed from the rounded P where the spec sums the unrounded p
    (and vice versa), FA3's offset left out (``p_offset`` 0), FlashInfer's multiplier left
    out (``p_multiplier`` 1). Mutations that leave the spec as it is are left out.

    Parameters
    ----------
    spec : QuantSpec
    call : AttentionCall, optional
        The call as the kernel receives it (needed for a ``"cast"`` tensor's missing descale).

    Returns
    -------
    list of Mutation

    Examples
    --------
    >>> from refattn.quant import preset
    >>> [m.name for m in mutations(preset("fa3_fp8", v_descale=0.5))]
    ['missing_v_descale', 'non_saturating_casts', 'l_after_rounding', 'missing_p_offset']
    """
    out: list[Mutation] = []
    for t in ("q", "k", "v"):
        tq: TensorQuant = getattr(spec, t)
        if tq.scale is None or np.all(tq.scale == 1.0):
            continue
        if tq.source == "codes":
            out.append(Mutation(f"missing_{t}_descale",
                                f"the kernel leaves {t}'s descale out (1)",
                                spec.replace(**{t: _with(tq, scale=np.ones_like(tq.scale))})))
        elif call is not None:
            m = _missing_cast_descale(spec, call, t)
            if m is not None:
                out.append(m)
    rolled: dict[str, TensorQuant] = {}
    for t in ("q", "k", "v"):
        tq = getattr(spec, t)
        axis = _HEAD_AXIS.get(tq.granularity)
        if tq.scale is None or axis is None:
            continue
        if t == "q" and tq.granularity != "batch_kv_head":
            continue  # q's per-query-head scale is not read through the kv head
        r = np.roll(tq.scale, -1, axis=axis)  # head j reads head j + 1's (mod H)
        if not np.array_equal(r, tq.scale):
            rolled[t] = _with(tq, scale=r)
    if len(rolled) > 1:
        out.append(Mutation("wrong_kv_head_descales",
                            f"the kernel reads the descales of {', '.join(rolled)} from kv "
                            "head j + 1 (mod Hkv) instead of j", spec.replace(**rolled)))
    for t, tq in rolled.items():
        out.append(Mutation(f"wrong_kv_head_{t}_descale",
                            f"the kernel reads {t}'s descale from head j + 1 instead of j",
                            spec.replace(**{t: tq})))
    sat: dict[str, Any] = {}
    for t in ("q", "k", "v"):
        tq = getattr(spec, t)
        if tq.source == "cast" and tq.rounding == "nearest_even_satfinite":
            sat[t] = _with(tq, rounding="nearest_even_nan")
    if spec.p_rounding == "nearest_even_satfinite":
        sat["p_rounding"] = "nearest_even_nan"
    if sat:
        names = [("P" if n == "p_rounding" else n) for n in sat]
        out.append(Mutation("non_saturating_casts",
                            f"the casts of {', '.join(names)} do not saturate (overflow to "
                            "NaN, or inf where the format has one; torch's cast before 2.13)",
                            spec.replace(**sat)))
    if spec.l_from == "unrounded":
        out.append(Mutation("l_after_rounding", "l is summed from the rounded P (the spec sums "
                            "the fp32 p before the cast)", spec.replace(l_from="rounded")))
    else:
        out.append(Mutation("l_before_rounding", "l is summed from the fp32 p before the "
                            "cast (the spec sums the rounded P)",
                            spec.replace(l_from="unrounded")))
    if spec.p_handling == "offset" and spec.p_offset != 0:
        out.append(Mutation("missing_p_offset", f"the +{spec.p_offset:g} exponent offset of p "
                            "is left out (p in [0, 1] before the cast)",
                            spec.replace(p_offset=0.0)))
    if spec.p_handling == "multiplier" and spec.p_multiplier != 1:
        out.append(Mutation("missing_p_multiplier", f"P is not multiplied by "
                            f"{spec.p_multiplier:g} before the cast",
                            spec.replace(p_multiplier=1.0)))
    return out


Bounds = dict[str, tuple[np.ndarray, np.ndarray]]


def _same_intervals(a: Bounds, b: Bounds) -> bool:
    return all(np.array_equal(a[n][0], b[n][0], equal_nan=True)
               and np.array_equal(a[n][1], b[n][1], equal_nan=True) for n in a)


def _inside(bounds: Bounds, cands: dict[str, np.ndarray]) -> bool:
    return all(contains(*bounds[n], c)[0].all() for n, c in cands.items())


@public
def diagnose(result: QuantResult, candidate: dict[str, Any]) -> list[str]:
    """The planted bugs whose emulation contains a candidate that the spec's does not.

    Parameters
    ----------
    result : QuantResult
        The unmutated emulation (from :func:`refattn.quant.pipeline.quantized`).
    candidate : dict of str to float64 ndarray
        As for :func:`refattn.quant.check.check_candidate`.

    Returns
    -------
    list of str
        One line per mutation that fits, ``"<name>: <what the kernel does wrong>; ..."``
        (names from ``MUTATION_NAMES``). Empty when the candidate passes the spec, or when
        no mutation fits (a bug not modelled here, or more than one at once).

    Raises
    ------
    RefAttnError
        As :func:`refattn.quant.check.check_candidate` for a malformed candidate.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import preset, quantized
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (np.round(rng.standard_normal((1, 1, 4, 8)) * 4) / 4 for _ in range(3))
    >>> spec = preset("fa3_fp8", v_descale=0.5)
    >>> result = quantized(AttentionCall(q, k, v), spec)
    >>> buggy = quantized(AttentionCall(q, k, v), mutations(spec)[0].spec)  # v descale left out
    >>> [line.split(":")[0] for line in diagnose(result, {"output": buggy.emulated["output"].mid})]
    ['missing_v_descale']
    """
    from refattn.quant.pipeline import QuantResult, emulate

    if not isinstance(result, QuantResult):
        raise RefAttnError(f"result: expected a QuantResult (refattn.quant.emulate), got "
                           f"{shown(result)}")
    if not isinstance(candidate, dict) or not candidate:
        raise RefAttnError("candidate: expected a non-empty dict of tensor name to float64 "
                           "ndarray")
    cands: dict[str, np.ndarray] = {}
    for name, x in candidate.items():
        if name not in result.emulated:
            raise RefAttnError(f"candidate: {name!r} is not a tensor the pipeline emulates "
                               f"({', '.join(sorted(result.emulated))})")
        cands[name] = _candidate(name, x, np.shape(result.emulated[name].lo))
    base = {n: widened(result.emulated, result.spec, n) for n in cands}
    if _inside(base, cands):
        return []
    found: list[str] = []
    for m in mutations(result.spec, result.call):
        call = m.call or result.call
        try:
            check_quant(call, m.spec)  # the gate, as quantized() runs it
        except RefAttnError:  # the gate refuses the mutated spec for this call
            continue
        em = emulate(call, m.spec)  # the intervals only: no real result per mutation
        alt = {n: widened(em, m.spec, n) for n in cands}
        if _same_intervals(alt, base):
            continue
        if _inside(alt, cands):
            found.append(f"{m.name}: {m.description}; the candidate lies inside this "
                         f"emulation and outside {result.spec.name}'s")
    return found

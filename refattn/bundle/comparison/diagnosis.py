"""Diagnoses of a failing comparison: the kind of error, as a hypothesis that was recomputed
and found to fit (STYLE item 18), never a guess from one element.

Owns :func:`diagnose` and :class:`Diagnosis`. Each hypothesis either undoes a suspected bug
on the candidate and finds that the result passes the comparison's own rule (a transposed
layout, rows that ``query_valid`` should have zeroed), or builds the alternative result and
finds the candidate within the tensor's tolerance of it: a constant ratio (least-squares
``r``, then every element checked against ``r x golden``; ``r = -1`` is a sign flip), the
call recomputed with another scale (``1/Dk`` or 1 where the case uses the default
``1/sqrt(Dk)``; the default where it passes one), with another probability support (no mask,
the other causal triangle, the key padding ignored, a window one key wider or narrower), or
the kv gradients of one query head of each group (the sum over the heads that share a kv
head missing). Recomputations run refattn's numpy engine on the rebuilt call, for calls of
at most :data:`MAX_RECOMPUTED_SCORES` scores (larger ones get the other hypotheses). Called by
:func:`refattn.bundle.comparison.harness.compare`, which owns the rules and passes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from refattn.bundle.golden.spec import CaseSpec
from refattn.engine import backward, forward
from refattn.errors import RefAttnError

__all__ = ["MAX_RECOMPUTED_SCORES", "Diagnosis", "diagnose"]

#: tensors laid out (B, H, T, D): the ones a transposed layout can affect
_BHTD = ("output", "grad_q", "grad_k", "grad_v")
#: a fitted ratio must differ from 1 by more than this to be a diagnosis
_RATIO_MIN = 1e-6
#: recomputed hypotheses run only for calls with at most this many scores (B * Hq * Q * K):
#: each is a numpy forward (and backward) of the whole call, up to about ten of them
MAX_RECOMPUTED_SCORES = 1 << 20


@dataclass(frozen=True)
class Diagnosis:
    """One hypothesis about a failure that was recomputed and found to fit.

    Attributes
    ----------
    kind : {"ratio", "sign", "scale", "support", "gqa_sum", "layout", "query_valid"}
    tensors : tuple of str
        The failing tensors it explains.
    text : str
        The diagnosis in words, e.g. ``output: candidate = 0.5 x golden``.

    Examples
    --------
    >>> Diagnosis("ratio", ("output",), "output: candidate = 0.5 x golden").line()
    'diagnosis: output: candidate = 0.5 x golden'
    """

    kind: str
    tensors: tuple[str, ...]
    text: str

    def line(self) -> str:
        return f"diagnosis: {self.text}"


#: ``passes(name, array)``: does ``array`` pass the comparison's rule for tensor ``name``?
Passes = Callable[[str, np.ndarray], bool]
#: ``fits(name, candidate, alternative)``: is the candidate within the tensor's tolerance of
#: the alternative result?
Fits = Callable[[str, np.ndarray, np.ndarray], bool]


def diagnose(cand: Mapping[str, np.ndarray], gold: Mapping[str, np.ndarray],
             spec: CaseSpec | None, failing: Sequence[str], *, passes: Passes,
             fits: Fits) -> tuple[Diagnosis, ...]:
    """The diagnoses that fit the failing tensors of a comparison.

    Parameters
    ----------
    cand : mapping of str to ndarray
        The candidate's tensors, in their own dtypes.
    gold : mapping of str to ndarray
        The golden tensors.
    spec : CaseSpec or None
        The golden case (its call is rebuilt for the recomputed hypotheses; without it only
        the ratio, layout and sign hypotheses are tried).
    failing : sequence of str
        The tensors that failed the comparison.
    passes, fits : callable
        The comparison's rule (see :data:`Passes` and :data:`Fits`).

    Returns
    -------
    tuple of Diagnosis
        Empty when no hypothesis fits (a correct candidate never fails, so never gets one).

    Examples
    --------
    >>> g = {"output": np.arange(1.0, 7.0).reshape(1, 1, 2, 3)}
    >>> c = {"output": 0.5 * g["output"]}
    >>> close = lambda n, a, h: bool(np.allclose(a, h, rtol=1e-10, atol=1e-12))
    >>> [d.text for d in diagnose(c, g, None, ["output"], passes=lambda n, a: close(n, a, g[n]),
    ...                           fits=close)]
    ['output: candidate = 0.5 x golden (every element)']
    """
    failing = [n for n in failing if n in cand and n in gold
               and np.asarray(gold[n]).dtype.kind == "f"]
    if not failing:
        return ()
    with np.errstate(all="ignore"):  # a hypothesis that overflows simply does not fit
        return _diagnose(cand, gold, spec, failing, passes, fits)


#: what a hypothesis on a call that cannot be rebuilt or rerun raises: it is skipped (a
#: diagnosis never turns a failing report into an error)
_SKIPPED = (RefAttnError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError)


def _diagnose(cand: Mapping[str, np.ndarray], gold: Mapping[str, np.ndarray],
              spec: CaseSpec | None, failing: list[str], passes: Passes,
              fits: Fits) -> tuple[Diagnosis, ...]:
    found: list[Diagnosis] = []
    found += _layouts(cand, gold, failing, passes)
    explained = {n for d in found for n in d.tensors}
    if spec is not None:
        found += _query_valid(cand, spec, [n for n in failing if n not in explained], passes)
        explained = {n for d in found for n in d.tensors}
    rest = [n for n in failing if n not in explained]
    call_level: list[Diagnosis] = []
    if spec is not None and rest and np.prod(spec.score_shape) <= MAX_RECOMPUTED_SCORES:
        try:
            context = _Context(spec, cand)
        except _SKIPPED:  # a call this reader cannot rebuild: no recomputed hypotheses
            context = None
        if context is not None:
            for hypothesis in (_scales, _supports, _gqa_sum):
                try:
                    call_level += hypothesis(context, rest, fits)
                except _SKIPPED:
                    continue
    found += call_level
    explained |= {n for d in call_level for n in d.tensors}
    found += _ratios(cand, gold, [n for n in rest if n not in explained], fits, spec)
    return tuple(found)


# -- hypotheses on the candidate alone ----------------------------------------------------
def _ratios(cand: Mapping[str, np.ndarray], gold: Mapping[str, np.ndarray],
            names: Sequence[str], fits: Fits, spec: CaseSpec | None) -> list[Diagnosis]:
    out = []
    for name in names:
        c = np.asarray(cand[name]).astype(np.float64)
        g = np.asarray(gold[name], dtype=np.float64)
        if c.shape != g.shape:
            continue
        both = np.isfinite(c) & np.isfinite(g)
        gg = float(np.sum(g[both] * g[both]))
        if gg == 0.0:
            continue
        r = float(np.sum(c[both] * g[both])) / gg  # least squares: c ~ r g
        if not np.isfinite(r) or r == 0.0 or abs(r - 1.0) <= _RATIO_MIN:
            continue
        for value in (_simple(r), r):  # the simple fraction when it fits as well
            if fits(name, c, value * g):
                r = value
                break
        else:
            continue
        if r == -1.0:
            out.append(Diagnosis("sign", (name,), f"{name}: candidate = -golden (the sign "
                                 "is flipped; every element)"))
            continue
        note = ""
        if spec is not None and name in ("grad_k", "grad_v"):
            a = spec.axes
            group = a["Hq"] // a["Hkv"] if a["Hkv"] else 0
            if group > 1 and np.isclose(r, 1.0 / group, rtol=1e-9):
                note = (f"; 1/{group}: the mean over the {group} query heads that share a kv "
                        "head, not their sum")
        out.append(Diagnosis("ratio", (name,), f"{name}: candidate = {_number(r)} x golden "
                             f"(every element){note}"))
    return out


def _simple(r: float) -> float:
    """The nearest fraction with a small denominator (0.5, 1/3, 2, -1, ...)."""
    from fractions import Fraction

    return float(Fraction(r).limit_denominator(16))


def _number(r: float) -> str:
    return f"{r:.6g}"


def _layouts(cand: Mapping[str, np.ndarray], gold: Mapping[str, np.ndarray],
             names: Sequence[str], passes: Passes) -> list[Diagnosis]:
    out = []
    for name in names:
        c, g = np.asarray(cand[name]), np.asarray(gold[name])
        if name not in _BHTD or c.ndim != 4 or g.ndim != 4:
            continue
        B, H, T, D = g.shape
        tried: list[tuple[str, np.ndarray]] = []
        if c.shape == (B, T, H, D):
            tried.append((f"{name} is in the BTNH layout {list(c.shape)} (B, T, H, D); "
                          "transposed to BHTD (B, H, T, D) it matches", c.swapaxes(1, 2)))
        if c.shape == g.shape and H != 1 and T != 1:
            if H == T:
                tried.append((f"{name}: the head and time axes are swapped (a BTNH array "
                              "where BHTD is expected); swapped back it matches",
                              c.swapaxes(1, 2)))
            tried.append((f"{name}: a BTNH (B, T, H, D) array reshaped, not transposed, to "
                          "BHTD (B, H, T, D); read as BTNH and transposed it matches",
                          c.reshape(B, T, H, D).swapaxes(1, 2)))
        for text, undone in tried:
            if passes(name, np.ascontiguousarray(undone)):
                out.append(Diagnosis("layout", (name,), text))
                break
    return out


def _query_valid(cand: Mapping[str, np.ndarray], spec: CaseSpec, names: Sequence[str],
                 passes: Passes) -> list[Diagnosis]:
    qv = spec.query_valid_full()  # (B, 1, Q, 1)
    if qv.all():
        return []
    out = []
    for name in names:
        c = np.asarray(cand[name])
        if name not in ("output", "grad_q") or c.ndim != 4 or c.shape[2] != qv.shape[2]:
            continue
        rows = ~qv & np.any(c != 0, axis=-1, keepdims=True)  # (B, Hq, Q, 1) rows not zero
        if rows.any() and passes(name, np.where(qv, c, np.zeros((), c.dtype))):
            out.append(Diagnosis("query_valid", (name,), f"{name}: {int(rows.sum())} row(s) "
                                 "where query_valid is False are not zero; zeroed, it matches "
                                 "(the query_valid zeroing is missing)"))
    return out


# -- hypotheses recomputed from the call --------------------------------------------------
class _Context:
    """The rebuilt call of a case and a recomputation of it with some fields replaced."""

    def __init__(self, spec: CaseSpec, cand: Mapping[str, np.ndarray]) -> None:
        self.spec = spec
        self.call = spec.to_call()
        self.grad_output = spec.tensors.get("grad_output")
        self.backward = self.grad_output is not None and any(
            n.startswith("grad_") and n != "grad_output" for n in cand)
        self.cand = cand

    def run(self, **fields: Any) -> dict[str, np.ndarray] | None:
        """The canonical tensors of the call with ``fields`` replaced, or None when that
        call is not a legal one (e.g. a row left without keys)."""
        try:
            call = replace(self.call, **fields)
            trace = forward(call, backend="numpy")
            out = dict(trace.tensors())
            if self.grad_output is not None and self.backward:
                out.update(backward(trace, self.grad_output).tensors())
        except _SKIPPED:
            return None
        return out


def _fit_all(ctx: _Context, alt: Mapping[str, np.ndarray] | None, names: Sequence[str],
             fits: Fits) -> tuple[str, ...]:
    """The failing tensors the alternative explains, when it explains every tensor the
    candidate holds that it computes (a passing tensor must fit it too); else ()."""
    if alt is None:
        return ()
    checked = [n for n in ctx.cand if n in alt and np.asarray(alt[n]).dtype.kind == "f"
               and np.shape(ctx.cand[n]) == np.shape(alt[n])]
    if not any(n in names for n in checked):
        return ()
    for n in checked:
        if not fits(n, np.asarray(ctx.cand[n]).astype(np.float64), np.asarray(alt[n])):
            return ()
    return tuple(n for n in checked if n in names)


def _scales(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    spec = ctx.spec
    dk = spec.axes["Dk"]
    if spec.scale_is_default:
        case = f"1/sqrt(Dk) = {_number(dk ** -0.5)}, the default"
        alternatives = [(1.0 / dk, f"1/Dk = {_number(1.0 / dk)}",
                         "the kernel's default scale is 1/Dk, not 1/sqrt(Dk)"),
                        (1.0, "1", "the scores are not scaled")]
    else:
        case = f"{_number(spec.scale)}, passed explicitly"
        alternatives = [(dk ** -0.5, f"1/sqrt(Dk) = {_number(dk ** -0.5)}",
                         "the scale argument is ignored (the default used)"),
                        (1.0, "1", "the scores are not scaled")]
    out = []
    for value, label, meaning in alternatives:
        if value == spec.scale:
            continue
        explained = _fit_all(ctx, ctx.run(scale=value), names, fits)
        if explained:
            out.append(Diagnosis("scale", explained, f"{_names(explained)} a "
                                 f"recomputation with scale {label} where the case's is "
                                 f"{case}: {meaning}"))
            break
    return out


def _names(names: Sequence[str]) -> str:
    """``output matches`` or ``output, grad_q match``."""
    return f"{', '.join(names)} {'matches' if len(names) == 1 else 'match'}"


def _triangle(Q: int, K: int, alignment: str) -> np.ndarray:
    """(Q, K) bool: key j visible from query i under the aligned causal rule."""
    offset = 0 if alignment == "upper_left" else K - Q
    return np.arange(K)[None, :] <= np.arange(Q)[:, None] + offset


def _positions_model(spec: CaseSpec) -> dict[str, Any] | None:
    """A single position-based relation (causal, window, key padding), or None."""
    record = spec.call_manifest["visibility"].get("relation")
    if (not record or record.get("schema") != "visibility_relation_v1"
            or record.get("segments") is not None or record.get("prefix_length") is not None
            or record.get("head_sharing") != "shared"):
        return None
    try:
        qp = np.asarray(record["q_positions"], dtype=np.int64)  # (B or 1, Q)
        kp = np.asarray(record["k_positions"], dtype=np.int64)  # (B or 1, K)
        kv = np.asarray(record["key_valid"]["values"], dtype=bool) if record.get(
            "key_valid") else np.ones(kp.shape, bool)
        window = record.get("window")
        left = right = None
        if window is not None:
            if window.get("convention") != "excludes_query":
                return None
            left, right = window.get("left"), window.get("right")
        return {"qp": qp, "kp": kp, "kv": kv, "causal": bool(record.get("causal")),
                "left": left, "right": right, "alignment": record.get("alignment")}
    except (KeyError, TypeError, ValueError):
        return None


def _band(m: Mapping[str, Any], *, shift: int = 0, causal: bool | None = None,
          left: Any = "same", right: Any = "same", padding: bool = True) -> np.ndarray:
    """(B or 1, 1, Q, K) bool visibility of the position model with fields changed."""
    d = m["kp"][:, None, :] - (m["qp"][:, :, None] + shift)  # (B, Q, K) key - query position
    vis = np.ones(d.shape, bool)
    if m["causal"] if causal is None else causal:
        vis &= d <= 0
    left = m["left"] if left == "same" else left
    right = m["right"] if right == "same" else right
    if left is not None:
        vis &= d >= -left
    if right is not None:
        vis &= d <= right
    if padding:
        vis &= m["kv"][:, None, :]
    return vis[:, None]


def _support_alternatives(spec: CaseSpec) -> list[tuple[str, np.ndarray]]:
    a = spec.axes
    Q, K = a["Q"], a["K"]
    vis = spec.visible_full()  # (B, Hq, Q, K)
    record = spec.call_manifest["visibility"].get("relation") or {}
    alts: list[tuple[str, np.ndarray]] = []  # the most specific first: a duplicate is dropped
    m = _positions_model(spec)
    if m is not None and np.array_equal(np.broadcast_to(_band(m), vis.shape), vis):
        if (m["causal"] and record.get("alignment") in ("upper_left", "lower_right")
                and Q != K and not m["kv"].all()):
            other = "lower_right" if record["alignment"] == "upper_left" else "upper_left"
            side = other.replace("_", "-")
            shift = (K - Q) if other == "lower_right" else -(K - Q)
            alts.append((f"the {side} causal triangle with the case's key padding",
                         _band(m, shift=shift)))
        if not m["kv"].all():
            alts.append(("the key padding ignored (keys where key_valid is False read)",
                         _band(m, padding=False)))
        if m["left"] is not None:
            for left in (m["left"] - 1, m["left"] + 1):
                if left >= 0:
                    alts.append((f"a window of {left} keys to the left of the query's own "
                                 f"(the case's has {m['left']}: one key off)",
                                 _band(m, left=left)))
        if m["right"] is not None and not m["causal"]:
            for right in (m["right"] - 1, m["right"] + 1):
                if right >= 0:
                    alts.append((f"a window of {right} keys to the right of the query's own "
                                 f"(the case's has {m['right']}: one key off)",
                                 _band(m, right=right)))
    alts.append(("no mask (every key visible)", np.ones((1, 1, Q, K), bool)))
    for alignment in ("upper_left", "lower_right"):
        side = "upper-left" if alignment == "upper_left" else "lower-right"
        rule = "key j <= query i" if alignment == "upper_left" else (
            f"key j <= query i + {K - Q}")
        alts.append((f"the {side} causal triangle ({rule})", _triangle(Q, K, alignment)))
    out: list[tuple[str, np.ndarray]] = []
    for text, alt in alts:
        full = np.broadcast_to(alt, vis.shape)
        if np.array_equal(full, vis) or any(np.array_equal(full, o) for _, o in out):
            continue
        out.append((text, full))
    return out


def _describe_support(spec: CaseSpec) -> str:
    record = spec.call_manifest["visibility"].get("relation") or {}
    a = spec.axes
    vis = spec.visible_full()  # (B, Hq, Q, K)
    for alignment in ("lower_right", "upper_left") if a["Q"] != a["K"] else ():
        if np.array_equal(vis, np.broadcast_to(_triangle(a["Q"], a["K"], alignment),
                                               vis.shape)):
            return (f"the case's is the {alignment.replace('_', '-')} causal triangle "
                    f"(Q={a['Q']}, K={a['K']})")
    recorded = record.get("alignment")
    if record.get("causal") and recorded in ("upper_left", "lower_right"):
        return f"the case's is the {recorded.replace('_', '-')} causal triangle (Q={a['Q']}, " \
               f"K={a['K']})" + (" with key padding" if record.get("key_valid") and not all(
                   np.asarray(record["key_valid"]["values"], bool).ravel()) else "")
    if spec.visible_full().all():
        return "the case has no mask"
    return "the case's visibility differs"


def _supports(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    if ctx.spec.has_dropout and "dropout_multiplier" not in ctx.spec.tensors:
        return []
    for text, vis in _support_alternatives(ctx.spec):
        explained = _fit_all(ctx, ctx.run(visible=np.ascontiguousarray(vis)), names, fits)
        if explained:
            case = "" if "the case's" in text else f"; {_describe_support(ctx.spec)}"
            return [Diagnosis("support", explained, f"{_names(explained)} a "
                              f"recomputation whose probability support is {text}{case}")]
    return []


def _gqa_sum(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    grads = [n for n in ("grad_k", "grad_v") if n in names]
    call = ctx.call
    head_map = np.asarray(call.head_map)  # (Hq,)
    Hkv = call.k.shape[1]
    groups = [np.flatnonzero(head_map == j) for j in range(Hkv)]
    if not grads or not ctx.backward or max(len(g) for g in groups) < 2:
        return []
    size = min(len(g) for g in groups)
    if size == 0 or any(len(g) != size for g in groups):
        return []
    expanded = ctx.run(k=np.ascontiguousarray(call.k[:, head_map]),
                       v=np.ascontiguousarray(call.v[:, head_map]), head_map=None)
    if expanded is None:
        return []
    for member in (0, size - 1, *range(1, size - 1)):
        heads = np.array([g[member] for g in groups])  # (Hkv,) one query head per kv head
        fitting = [n for n in grads if fits(n, np.asarray(ctx.cand[n]).astype(np.float64),
                                            expanded[n][:, heads])]
        if fitting == grads:
            which = {0: "the first", size - 1: "the last"}.get(member, f"number {member}")
            return [Diagnosis("gqa_sum", tuple(grads), f"{', '.join(grads)} equal one query "
                              f"head's share ({which} of each group of {size}, query heads "
                              f"{heads.tolist()}): the sum over the query heads that share a "
                              "kv head is missing")]
    return []

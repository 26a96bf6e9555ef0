"""Diagnoses of a failing comparison: the kind of error, as a hypothesis that was recomputed
and found to fit (STYLE item 18), never a guess from one element.

Owns :func:`diagnose` and :class:`Diagnosis`. Each hypothesis either undoes a suspected bug
on the candidate and finds that the result passes the comparison's own rule (a transposed
layout, rows that ``query_valid`` should have zeroed), or builds the alternative result and
finds the candidate within the tensor's tolerance of it (the ``fits`` rule, on every failing
tensor it claims):

- a constant ratio (least-squares ``r``, then every element checked against ``r x golden``;
  ``r = -1`` is a sign flip);
- the call recomputed with another scale (``1/Dk`` or 1 where the case uses the default
  ``1/sqrt(Dk)``; the default where it passes one);
- with another probability support (no mask, the other causal triangle, the key padding
  ignored, a window one key wider or narrower);
- with query heads mapped to kv heads interleaved (``h % Hkv``) where the case groups them
  (``h // G``), or grouped where the case gives another explicit map;
- the kv gradients of one query head of each group (the sum over the heads that share a kv
  head missing);
- the call without its dropout multiplier Z (dropout not applied);
- the output of a softmax over the query axis (each column of P normalised over the queries)
  instead of the key axis;
- ``grad_v`` computed with P where ``P^T`` belongs (``sum_h (P*Z) @ G_O``; only expressible,
  and only tried, when Q == K).

Recomputations run on the case's rebuilt call, for calls of at most
:data:`MAX_RECOMPUTED_SCORES` scores (larger ones get the hypotheses on the candidate alone).
Miniatures (up to 2^16 scores), and calls up to :data:`MAX_DENSE_SCORES` whose candidate
holds an intermediate (``probs``, ``scores``, ...), are recomputed as refattn's dense numpy
trace (every intermediate is checked too); otherwise a hypothesis on output and gradients
runs numba's fused forward+backward kernel on the golden generator's fixed layout
(:func:`refattn.engine.numba.generator.generate`: the kernel of ``value_and_grad(backend=
"numba")`` without its per-machine calibration; no ``(B, Hq, Q, K)`` array: its memory is
the inputs, the outputs and an 8 MiB score buffer per thread) and one that needs P walks
each ``(b, h)`` in blocks of query rows of at most :data:`_BLOCK_BYTES` per ``(rows, K)``
float64 array (a few such arrays alive at once). Time is linear in the scores: at the
kernel suite's 4M-score cases each hypothesis takes a fraction of a second. Called by
:func:`refattn.bundle.comparison.harness.compare`, which owns the rules and passes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from refattn.bundle.golden.spec import CaseSpec
from refattn.dropout import Philox
from refattn.engine import backward, forward
from refattn.engine.reference import forward_arrays
from refattn.engine.trace import Trace
from refattn.errors import RefAttnError

__all__ = ["MAX_DENSE_SCORES", "MAX_RECOMPUTED_SCORES", "Diagnosis", "diagnose"]

#: tensors laid out (B, H, T, D): the ones a transposed layout can affect
_BHTD = ("output", "grad_q", "grad_k", "grad_v")
#: a fitted ratio must differ from 1 by more than this to be a diagnosis
_RATIO_MIN = 1e-6
#: recomputed hypotheses run only for calls with at most this many scores (B * Hq * Q * K;
#: the kernel suite's largest case, 16M, is under it), up to about fifteen recomputations
MAX_RECOMPUTED_SCORES = 1 << 24
#: up to this many scores a recomputation may be the numpy reference's dense trace of the call
#: (about twenty (B, Hq, Q, K) float64 arrays with the backward: 160 MiB at most): it is, up
#: to _SMALL scores or where the candidate holds a tensor only that trace gives (scores,
#: probs, ...); otherwise numba's fused forward+backward, and P in blocks of query rows
MAX_DENSE_SCORES = 1 << 20
#: calls this small are always recomputed densely (milliseconds each)
_SMALL = 1 << 16
#: the forward tensors a fused recomputation gives
_SAVED = ("output", "lse", "row_max")
#: and every tensor it gives (with the score family's parameter gradients, grad_score_<name>)
_FUSED = frozenset({*_SAVED, "grad_q", "grad_k", "grad_v", "grad_bias", "grad_sink",
                    "row_dot", "row_dot_output"})
#: bytes of one (rows, K) float64 block of scores or probabilities of a call not dense
_BLOCK_BYTES = 8 << 20


@dataclass(frozen=True)
class Diagnosis:
    """One hypothesis about a failure that was recomputed and found to fit.

    Attributes
    ----------
    kind : str
        ``ratio``, ``sign`` (a constant ratio, -1), ``scale``, ``support`` (another
        probability support), ``head_map`` (GQA heads interleaved, not grouped, or the
        reverse), ``gqa_sum`` (the sum over a kv head's query heads missing), ``dropout``
        (not applied), ``softmax_axis`` (over the queries), ``dv_transpose`` (grad_v with P
        where P^T belongs), ``layout`` (BTNH where BHTD is expected) or ``query_valid`` (the
        zeroing of unused rows missing).
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
    if spec is not None and rest and _scores(spec) <= MAX_RECOMPUTED_SCORES:
        try:
            context = _Context(spec, cand)
        except _SKIPPED:  # a call this reader cannot rebuild: no recomputed hypotheses
            context = None
        if context is not None:
            for hypothesis in _RECOMPUTED:
                todo = [n for n in rest if all(n not in d.tensors for d in call_level)]
                if not todo:  # every failure explained: the others need not run
                    break
                try:
                    call_level += hypothesis(context, todo, fits)
                except (*_SKIPPED, MemoryError):
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
def _scores(spec: CaseSpec) -> int:
    """B * Hq * Q * K of a case."""
    return int(np.prod(spec.score_shape, dtype=np.int64))


def _family(call: Any) -> str:
    """The score family's name (the gate sets ``Dot()`` where none is given)."""
    return "dot" if call.score is None else str(call.score.name)


#: the forward tensors :meth:`_Context.rows` gives, (rows, K) each
_ROWS = ("masked_scores", "probs", "dropout_multiplier", "consumed")


class _Context:
    """The rebuilt call of a case, a recomputation of it with some fields replaced, and its
    probabilities in blocks of query rows.

    Dense (see :data:`MAX_DENSE_SCORES`), every recomputation is the numpy reference's dense
    trace; otherwise :meth:`run` is numba's fused forward+backward (output, ``lse``, ``row_max``
    and the gradients) and :meth:`rows` computes the forward of ``(rows, K)`` blocks of one
    ``(b, h)`` (the dot score only; another family skips the hypotheses that need P).
    """

    def __init__(self, spec: CaseSpec, cand: Mapping[str, np.ndarray]) -> None:
        self.spec = spec
        self.call = spec.to_call()
        self.grad_output = spec.tensors.get("grad_output")
        self.backward = self.grad_output is not None and any(
            n.startswith("grad_") and n != "grad_output" for n in cand)
        self.cand = cand
        n = _scores(spec)
        traced = any(name not in _FUSED and not name.startswith("grad_score_")
                     for name in cand)  # a candidate's probs, scores, ...: only a trace has them
        additive = _family(self.call) == "additive"  # no fused kernel: dense or nothing
        self.dense = n <= _SMALL or (n <= MAX_DENSE_SCORES and (traced or additive))
        if not self.dense and additive:
            raise RefAttnError("the additive score has no recomputation without a dense trace")
        self._trace: Trace | None = None

    def run(self, **fields: Any) -> dict[str, np.ndarray] | None:
        """The canonical tensors of the call with ``fields`` replaced, or None when that
        call is not a legal one (e.g. a row left without keys)."""
        try:
            call = replace(self.call, **fields)
            if not self.dense:
                return self._fused(call)
            trace = forward(call, backend="numpy")
            out = dict(trace.tensors())
            if self.grad_output is not None and self.backward:
                out.update(backward(trace, self.grad_output).tensors())
        except _SKIPPED:
            return None
        return out

    def _fused(self, call: Any) -> dict[str, np.ndarray]:
        """Output, ``lse``, ``row_max`` and gradients of ``call`` with no (B, Hq, Q, K) array:
        numba's fused forward+backward kernel on the golden generator's fixed layout (the
        kernel ``value_and_grad(backend="numba")`` runs, without the per-machine BLAS
        calibration its first call makes, which a failing comparison should not wait for)."""
        from refattn.engine.numba.generator import generate  # loads numba: here only

        B, Hq, Q, _ = call.q.shape
        g_o = self.grad_output if self.grad_output is not None else np.zeros(
            (B, Hq, Q, call.v.shape[3]))  # (B, Hq, Q, Dv)
        if call.returned_weights != "none":  # no weights are returned here: same values
            call = replace(call, returned_weights="none")
        trace, grads = generate(call, g_o)
        out = {n: getattr(trace, n) for n in _SAVED}
        if self.backward:
            out.update(grads.tensors())
        return out

    # -- P in blocks of query rows ----------------------------------------------------------
    def blocks(self) -> Iterator[tuple[int, int]]:
        """``(i0, i1)``: the query rows of one block, covering [0, Q) in order."""
        _, _, Q, K = self.call.score_shape
        step = Q if self.dense else max(1, _BLOCK_BYTES // (8 * K))
        for i0 in range(0, Q, step):
            yield i0, min(i0 + step, Q)

    def rows(self, b: int, h: int, i0: int, i1: int) -> dict[str, np.ndarray]:
        """``masked_scores``, ``probs``, ``dropout_multiplier`` (Z) and ``consumed`` (P * Z)
        of query rows [i0, i1) of ``(b, h)``, each (i1 - i0, K) float64, as the reference
        computes them (the visibility sanitised: a row without keys reads key 0; a sink in
        the denominator)."""
        if self.dense:
            if self._trace is None:
                self._trace = forward(self.call, backend="numpy")
            t = self._trace
            return {n: np.asarray(getattr(t, n))[b, h, i0:i1] for n in _ROWS}
        call = self.call
        if _family(call) != "dot":
            raise RefAttnError(f"no blockwise recomputation of the {_family(call)} score")
        full = call.score_shape  # (B, Hq, Q, K)
        j = int(np.asarray(call.head_map)[h])

        def part(x: Any) -> np.ndarray:  # (1, 1, rows, K) of an array broadcastable to full
            return np.broadcast_to(x, full)[b:b + 1, h:h + 1, i0:i1]

        vis = call.visible_array()  # (B|1, Hq|1, Q, K) bool, or None: compiled once, cached
        fwd = forward_arrays(
            call.q[b:b + 1, h:h + 1, i0:i1], call.k[b:b + 1, j:j + 1], call.v[b:b + 1, j:j + 1],
            head_map=np.zeros(1, np.int64), scale=cast(float, call.scale),
            visible=np.ones((1, 1, 1, 1), bool) if vis is None else part(vis),
            query_valid=call.query_valid_full()[b:b + 1, :, i0:i1],
            bias=None if call.bias is None else part(call.bias),
            multiplier=self._multiplier(b, h, i0, i1), score=call.score,
            scale_placement=call.scale_placement, softcap=call.softcap,
            sink=None if call.sink is None else call.sink[h:h + 1])
        return {n: fwd[n][0, 0] for n in _ROWS}

    def _multiplier(self, b: int, h: int, i0: int, i1: int) -> np.ndarray | None:
        """(1, 1, rows, K) dropout multiplier Z of the block, or None without dropout."""
        z = self.call.dropout
        B, Hq, Q, K = self.call.score_shape
        if z is None:
            return None
        if isinstance(z, np.ndarray):
            return np.broadcast_to(z, (B, Hq, Q, K))[b:b + 1, h:h + 1, i0:i1]
        if isinstance(z, Philox):  # regenerated by coordinates
            return z.multiplier_block(b, h, i0, i1, 0, K, Hq=Hq)[None, None]
        raise RefAttnError(f"no blockwise multiplier of a {type(z).__name__}")


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
    kp, qp = m["kp"], m["qp"] + shift  # (B or 1, K), (B or 1, Q)
    wide = max(int(np.abs(kp).max()), int(np.abs(qp).max())) >= 1 << 30
    kind = np.int64 if wide else np.int32  # int32 halves the transient at kernel sizes
    d = kp.astype(kind)[:, None, :] - qp.astype(kind)[:, :, None]  # (B, Q, K) key - query
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
    out: list[tuple[str, np.ndarray]] = []  # each as built (broadcastable), never expanded
    for text, alt in alts:
        full = np.broadcast_to(alt, vis.shape)
        if np.array_equal(full, vis) or any(
                np.array_equal(full, np.broadcast_to(o, vis.shape)) for _, o in out):
            continue
        out.append((text, alt))
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


def _head_maps(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    """The call recomputed with query heads mapped interleaved (``h % Hkv``) or grouped
    (``h // G``), where the case's map is the other (or another explicit one)."""
    call = ctx.call
    head_map = np.asarray(call.head_map)  # (Hq,)
    Hq, Hkv = head_map.shape[0], call.k.shape[1]
    interleaved = np.arange(Hq) % Hkv  # (Hq,)
    G = Hq // Hkv if Hq % Hkv == 0 else 0
    grouped = np.arange(Hq) // G if G else None  # (Hq,)
    if grouped is not None and np.array_equal(head_map, grouped):
        case = f"h // G = head_map (grouped, G = {G})"
    elif np.array_equal(head_map, interleaved):
        case = "head_map[h] = h % Hkv (interleaved: the case's explicit map)"
    else:
        case = f"head_map[h] = {head_map.tolist()} (the case's explicit map)"
    alternatives = []
    if not np.array_equal(interleaved, head_map):
        alternatives.append((interleaved, f"h % Hkv (interleaved, Hkv = {Hkv})"))
    if grouped is not None and not np.array_equal(grouped, head_map):
        alternatives.append((grouped, f"h // G (grouped, G = {G})"))
    for alt, label in alternatives:
        explained = _fit_all(ctx, ctx.run(head_map=alt), names, fits)
        if explained:
            return [Diagnosis("head_map", explained, f"{', '.join(explained)}: query head h "
                              f"read kv head {label}, not {case}")]
    return []


def _dropout_ignored(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    """The call recomputed without its dropout multiplier Z."""
    if not ctx.spec.has_dropout:
        return []
    explained = _fit_all(ctx, ctx.run(dropout=None), names, fits)
    if not explained:
        return []
    return [Diagnosis("dropout", explained, f"{', '.join(explained)}: dropout was not applied "
                      "(the candidate matches the call without the multiplier Z; Z is "
                      "case.plain.dropout)")]


def _softmax_axis(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    """The output of a softmax over the query axis: each column of P normalised over the
    queries i that see key j (a column no query sees is 0), then ``(P * Z) @ v_eff`` with
    unused rows zeroed. Blocks of query rows: a first pass keeps each column's running max
    and sum of exponentials (K,), a second forms P and the output rows."""
    call = ctx.call
    if "output" not in names or call.sink is not None:  # a sink has no column meaning
        return []
    B, Hq, Q, K = call.score_shape
    head_map = np.asarray(call.head_map)  # (Hq,)
    output = np.zeros((B, Hq, Q, call.v.shape[3]))  # (B, Hq, Q, Dv)
    for b in range(B):
        for h in range(Hq):
            col_max = np.full(K, -np.inf)  # (K,) over the queries so far
            col_sum = np.zeros(K)  # (K,) sum_i exp(s_ij - col_max_j)
            for i0, i1 in ctx.blocks():
                s = ctx.rows(b, h, i0, i1)["masked_scores"]  # (rows, K), -inf where masked
                new = np.maximum(col_max, s.max(axis=0))
                ref = np.where(np.isfinite(new), new, 0.0)  # (K,) no -inf - -inf
                col_sum = col_sum * np.exp(col_max - ref) + np.exp(s - ref).sum(axis=0)
                col_max = new
            ref = np.where(np.isfinite(col_max), col_max, 0.0)
            inv = np.divide(1.0, col_sum, out=np.zeros(K), where=col_sum > 0)  # (K,)
            v = call.v[b, head_map[h]]  # (K, Dv)
            for i0, i1 in ctx.blocks():
                r = ctx.rows(b, h, i0, i1)
                p = np.exp(r["masked_scores"] - ref) * inv  # (rows, K) columns sum to 1
                output[b, h, i0:i1] = (p * r["dropout_multiplier"]) @ v  # (rows, Dv)
    output = np.where(call.query_valid_full(), output, 0.0)  # unused rows are zero
    explained = _fit_all(ctx, {"output": output}, names, fits)
    if not explained:
        return []
    return [Diagnosis("softmax_axis", explained, "output: the softmax runs over the query axis "
                      "(each column of P normalised over the queries i, masked entries "
                      "excluded), not over the keys j: the candidate matches "
                      "softmax(S, axis=-2) @ V where softmax(S, axis=-1) @ V is meant")]


def _dv_transpose(ctx: _Context, names: Sequence[str], fits: Fits) -> list[Diagnosis]:
    """``grad_v`` as ``sum_h (P * Z) @ G_O`` over the query heads of each kv head (G_O zeroed
    on unused rows), where ``(P * Z)^T @ G_O`` belongs: only expressible when Q == K."""
    call = ctx.call
    B, Hq, Q, K = call.score_shape
    if "grad_v" not in names or not ctx.backward or Q != K or ctx.grad_output is None:
        return []
    head_map = np.asarray(call.head_map)  # (Hq,)
    g_o = np.where(call.query_valid_full(), ctx.grad_output, 0.0)  # (B, Hq, Q, Dv)
    grad_v = np.zeros(call.v.shape)  # (B, Hkv, K, Dv)
    for b in range(B):
        for h in range(Hq):
            for i0, i1 in ctx.blocks():
                consumed = ctx.rows(b, h, i0, i1)["consumed"]  # (rows, K) P * Z
                grad_v[b, head_map[h], i0:i1] += consumed @ g_o[b, h]  # rows of (P*Z) @ G_O
    explained = _fit_all(ctx, {"grad_v": grad_v}, names, fits)
    if not explained:
        return []
    return [Diagnosis("dv_transpose", explained, "grad_v: candidate = (P*Z) @ G_O, not "
                      "(P*Z)^T @ G_O (each summed over the query heads of a kv head): dV is "
                      "computed with P where P^T belongs")]


#: the hypotheses recomputed from the call, in the order they are tried (each only on the
#: failures the ones before it left unexplained)
_RECOMPUTED = (_scales, _supports, _head_maps, _gqa_sum, _dropout_ignored, _softmax_axis,
               _dv_transpose)

"""Check a quantised kernel's result against the emulated pipeline and the real result.

Owns :func:`check_candidate` and its :class:`QuantReport`: whether each tensor a kernel returned
lies inside the emulated interval of :func:`refattn.quant.pipeline.quantized` (the tolerance,
derived, not tuned), and how far it is from the real (unquantised) result in the units kernel
authors use (max error, SQNR in dB, FA3's ratio to a bf16 path). Defers the emulation to
:mod:`refattn.quant.pipeline` and the naming of planted bugs to :mod:`refattn.quant.diagnosis`.

The one widening
----------------
The candidate must lie in ``[lo, hi]`` of the emulated interval, which already encloses every
result the kernel's documented arithmetic can give (each cast bit-exact, each fp32/fp16 sum
bounded over every summation order, exp2 within its ulp bound, undocumented arithmetic widened
by the preset). The check adds one widening only, and only for ``"output"`` and ``"lse"``: the
ends are rounded outward onto the grid of the format the kernel returns them in
(``round_down(lo)``, ``round_up(hi)``; the output's format is ``spec.output_format``, lse is
fp32). A cast is monotonic, so if the value before the kernel's last cast lies in
``[lo, hi]``, the value it returns lies in the widened interval; an interval whose ends are
already on that grid is unchanged. Nothing else is added: no relative or absolute slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from refattn._boundary import public, shown
from refattn._checks import as_array, first_index, format_index
from refattn.errors import RefAttnError
from refattn.quant.formats import quantize, round_down, round_up

if TYPE_CHECKING:
    from refattn.quant.bounds import Interval
    from refattn.quant.pipeline import QuantResult
    from refattn.quant.spec import QuantSpec

__all__ = ["QuantReport", "TensorReport", "bf16", "bf16_path", "check_candidate", "contains",
           "widened"]

#: the tensors of the real Trace a candidate's tensor of the same name is compared with
REAL_NAMES = ("output", "lse")
#: the format the kernels return lse in (fp32 in FA3 and FlashInfer)
LSE_FORMAT = "fp32"


@dataclass(frozen=True)
class TensorReport:
    """One candidate tensor against its emulated interval and the real result.

    Attributes
    ----------
    name : str
        The tensor (``"output"``, ``"lse"``, or an intermediate the pipeline emulates).
    shape : tuple of int
    passed : bool
        Every element inside its (widened) interval.
    outside : int
        How many elements lie outside.
    worst_index : tuple of int
        The element farthest outside its interval; when none is outside, the one closest to
        an end of its interval relative to the interval's radius.
    worst_value, worst_lo, worst_hi : float
        The candidate's value there and its interval.
    worst_distance : float
        Its distance from the interval (0 inside; inf for NaN where the interval is finite).
    worst_in_radii : float
        The worst element's distance from its interval's midpoint in units of the interval's
        radius: at most 1 inside, above 1 outside (inf where the radius is 0 and the value
        differs); how far a failure is, in the check's own units.
    max_radius : float
        The largest radius (half width) of the widened intervals: the tolerance in the
        tensor's own units.
    median_radius : float
        The median radius over the elements with a finite interval.
    off_grid : int or None
        Output and lse: how many finite elements are not values of the format the kernel
        returns the tensor in (bf16, fp16, fp32): a candidate that is not what the kernel
        returned (a float32 reference, a value rescaled after the kernel). Reported, not a
        failure by itself.
    max_error, sqnr_db : float or None
        Against the real result (output and lse only): ``max |candidate - real|`` (inf for
        a NaN or infinity the real result does not have) and
        ``10 log10(sum real^2 / sum (candidate - real)^2)`` over the finite elements (inf
        when they are equal, -inf when a non-finite value differs from the real one).
    emulated_max_error : float or None
        ``max |midpoint - real|``: the quantisation error the pipeline itself shows, beside
        which the candidate's ``max_error`` is read.
    bf16_max_error, fa3_ratio : float or None
        Output only: the max error of a bf16 path (:func:`bf16_path`) against the real result,
        and the candidate's ``max_error`` over it (FA3's test asserts ratio <= 2, plus a
        rounding floor, for bf16 inputs; 3 in some versions for FP8).
    """

    name: str
    shape: tuple[int, ...]
    passed: bool
    outside: int
    worst_index: tuple[int, ...]
    worst_value: float
    worst_lo: float
    worst_hi: float
    worst_distance: float
    max_radius: float
    worst_in_radii: float = 0.0
    median_radius: float = 0.0
    off_grid: int | None = None
    max_error: float | None = None
    max_error_index: tuple[int, ...] | None = None
    sqnr_db: float | None = None
    emulated_max_error: float | None = None
    bf16_max_error: float | None = None
    fa3_ratio: float | None = None

    def line(self) -> str:
        """One line: verdict, the worst element, and the distances from the real result."""
        verdict = "inside" if self.passed else f"{self.outside} element(s) outside"
        text = (f"{self.name}: {verdict} the emulated interval (size {math.prod(self.shape)}, "
                f"max radius {self.max_radius:.3g}); worst at {format_index(self.worst_index)}: "
                f"{self.worst_value!r} in [{self.worst_lo!r}, {self.worst_hi!r}]")
        if not self.passed:
            text += (f", {self.worst_distance:.3g} outside ({self.worst_in_radii:.3g} radii "
                     "from the midpoint)")
        if self.off_grid:
            text += f"; {self.off_grid} value(s) not on the returned format's grid"
        if self.max_error is not None:
            text += (f"; vs real: max error {self.max_error:.3g} (the pipeline's own "
                     f"{self.emulated_max_error:.3g}), SQNR {self.sqnr_db:.1f} dB")
        if self.fa3_ratio is not None:
            text += (f", {self.fa3_ratio:.3g}x the bf16 path's max error "
                     f"{self.bf16_max_error:.3g}")
        return text


@public
@dataclass(frozen=True)
class QuantReport:
    """The verdict of :func:`check_candidate`: one :class:`TensorReport` per candidate tensor.

    Attributes
    ----------
    passed : bool
        Every tensor inside its emulated interval.
    spec_name : str
        The preset (or ``"custom"``) the candidate was checked against.
    tensors : dict of str to TensorReport
    widening : str
        What was added to the pipeline's intervals (see the module docstring).
    """

    passed: bool
    spec_name: str
    tensors: dict[str, TensorReport] = field(default_factory=dict)
    widening: str = ""

    def summary(self) -> str:
        """The verdict and one line per tensor."""
        head = (f"{self.spec_name}: {'PASS' if self.passed else 'FAIL'} "
                f"({self.widening})")
        return "\n".join([head, *(t.line() for t in self.tensors.values())])

    def __str__(self) -> str:
        return self.summary()


def contains(lo: np.ndarray, hi: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether each ``x`` lies in ``[lo, hi]``, and its distance from the interval.

    NaN in ``x`` is inside where the interval is NaN (a pipeline that gives NaN there) or
    ``[-inf, inf]`` (the pipeline's "no claim": what a NaN or unbounded operand makes of a
    result, every value and NaN included); +-inf is inside where the interval's end is that
    infinity.

    Parameters
    ----------
    lo, hi, x : (...) float64 ndarray
        Same shape.

    Returns
    -------
    inside : (...) bool ndarray
    distance : (...) float64 ndarray
        0 inside, ``lo - x`` or ``x - hi`` outside, inf for a NaN outside.

    Examples
    --------
    >>> inside, dist = contains(np.array([0.0, 0.0, np.nan, -np.inf, 0.0]),
    ...                         np.array([1.0, 1.0, np.nan, np.inf, 1.0]),
    ...                         np.array([1.0, 1.5, np.nan, np.nan, np.nan]))
    >>> inside.tolist(), dist.tolist()
    ([True, False, True, True, False], [0.0, 0.5, 0.0, 0.0, inf])
    """
    nan_interval = np.isnan(lo) | np.isnan(hi)
    no_claim = (lo == -np.inf) & (hi == np.inf)
    with np.errstate(invalid="ignore"):
        within = (lo <= x) & (x <= hi)
        below = np.where(x < lo, lo - x, 0.0)
        above = np.where(x > hi, x - hi, 0.0)
    inside = np.where(np.isnan(x), nan_interval | no_claim, within & ~nan_interval)
    distance = np.where(inside, 0.0, np.maximum(below, above))
    distance = np.where(~inside & (np.isnan(x) | nan_interval | (distance == 0)), np.inf,
                        distance)
    return inside, distance


def _max_error(c: np.ndarray, r: np.ndarray) -> tuple[float, tuple[int, ...] | None]:
    with np.errstate(invalid="ignore"):
        err = np.where(c == r, 0.0, np.abs(c - r))  # equal infinities: no error
    err = np.where(np.isnan(err), np.inf, err)
    if err.size == 0:
        return 0.0, None
    i = int(np.argmax(err))
    return float(err.flat[i]), tuple(int(j) for j in np.unravel_index(i, err.shape))


def _sqnr_db(c: np.ndarray, r: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        differ = ~((c == r) | (np.isnan(c) & np.isnan(r)))
    if np.any(differ & ~(np.isfinite(c) & np.isfinite(r))):
        return -math.inf  # a non-finite value where the real result differs: infinite noise
    ok = np.isfinite(c) & np.isfinite(r)
    signal = float(np.sum(r[ok] ** 2))
    noise = float(np.sum((c[ok] - r[ok]) ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to fp32, then to bf16 (nearest, ties to even; overflow to +-inf), float64
    out: the bits of ``quantize(quantize(x, "fp32", ...), "bf16", ...)`` through float32's
    bit pattern (round to nearest even at bit 16: add ``0x7FFF`` plus the kept part's lowest
    bit, clear the low half), NaN kept.

    Examples
    --------
    >>> bf16(np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, np.nan])).tolist()
    [1.0, 1.015625, inf, nan]
    """
    with np.errstate(over="ignore", invalid="ignore"):
        f = np.asarray(x, dtype=np.float64).astype(np.float32)  # IEEE: nearest even, overflow
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    out = u.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(f), np.nan, out)


def bf16_path(result: QuantResult) -> np.ndarray:
    """FA3's bf16 PyTorch path (``attention_ref(upcast=False, reorder_ops=True)``) of the
    dequantised call, emulated here in float64.

    The inputs of the real result (``result.real.call``: codes times descales) are rounded to
    fp32 and then to bf16 (as ``(q.float() * q_descale).to(bf16)``); then each of torch's
    operations is rounded to bf16: ``k * scale``; ``S = q @ k^T`` (the products summed in
    float64 and rounded once; torch sums them in fp32, a difference far below a bf16 ulp);
    ``softmax(S)`` (invisible keys -inf); P cast to the spec's P format when it is an FP8
    format (FA3's ``intermediate_dtype``: torch's cast, which cannot overflow as P <= 1);
    ``O = P @ v``. Computed per head and block of query rows (memory O(R K)).

    Returns
    -------
    (B, Hq, Q, Dv) float64 ndarray
        Values of bf16.
    """
    call = result.real.call
    spec = result.spec


    hm = np.asarray(call.head_map)
    q, k, v = bf16(call.q), bf16(call.k), bf16(call.v)
    alpha = call.scale if call.scale is not None else call.q.shape[3] ** -0.5  # set by the gate
    k = bf16(k * float(alpha))  # reorder_ops: the scale on k
    B, Hq, Q, K = call.score_shape
    vis = call.visible_array()
    vis = np.broadcast_to(True if vis is None else vis, call.score_shape)
    out = np.empty((B, Hq, Q, v.shape[3]))
    n = max(1, min(Q, 2**20 // max(K, 1)))  # query rows per block: R K <= 2**20
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, hm[h]], v[b, hm[h]]  # (K, Dk), (K, Dv)
            for i0 in range(0, Q, n):
                s = bf16(q[b, h, i0:i0 + n] @ kh.T)  # (R, K)
                s = np.where(vis[b, h, i0:i0 + n], s, -np.inf)
                with np.errstate(invalid="ignore"):
                    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
                    p = bf16(e / np.sum(e, axis=-1, keepdims=True))
                p = np.where(np.isnan(p), 0.0, p)  # a row with no visible key: nothing
                if spec.p_format in ("e4m3fn", "e5m2"):
                    p = quantize(p, spec.p_format, "nearest_even_satfinite")
                out[b, h, i0:i0 + n] = bf16(p @ vh)
    return out  # (B, Hq, Q, Dv)


def _candidate(name: str, x: object, shape: tuple[int, ...]) -> np.ndarray:
    arr = as_array(f"candidate[{name!r}]", x)
    if arr.dtype != np.float64:
        raise RefAttnError(f"candidate[{name!r}]: expected dtype float64 (the kernel's values "
                           f"converted exactly), got {arr.dtype} (refattn never casts)")
    if arr.shape != shape:
        raise RefAttnError(f"candidate[{name!r}]: expected shape {list(shape)}, got "
                           f"{list(arr.shape)}")
    return arr


def _check_returned_format(name: str, c: np.ndarray, fmt: str, spec_name: str) -> None:
    fin = np.isfinite(c)
    with np.errstate(over="ignore"):
        off = fin & (quantize(np.where(fin, c, 0.0), fmt, "nearest_even") != np.where(fin, c, 0.0))
    idx = first_index(off)
    if idx is not None:
        raise RefAttnError(f"candidate[{name!r}]: value {float(c[idx])!r} at index "
                           f"{format_index(idx)} is not a {fmt} value, the format {spec_name} "
                           f"returns {name} in; pass the kernel's own {name} converted exactly "
                           "to float64 (require_format=False checks other values)")


def _returned_format(spec: QuantSpec, name: str) -> str | None:
    """The format the kernel returns tensor ``name`` in (output and lse only)."""
    return {"output": spec.output_format, "lse": LSE_FORMAT}.get(name)


def widened(emulated: dict[str, Interval], spec: QuantSpec,
            name: str) -> tuple[np.ndarray, np.ndarray]:
    """The interval a candidate's tensor ``name`` must lie in: the emulated one, its ends
    rounded outward onto the returned format's grid for output and lse (the one widening).

    Returns
    -------
    lo, hi : (...) float64 ndarray
    """
    iv = emulated[name]
    lo = np.asarray(iv.lo, dtype=np.float64)
    hi = np.asarray(iv.hi, dtype=np.float64)
    fmt = _returned_format(spec, name)
    if fmt is not None:  # the one widening: outward onto the returned format's grid
        lo, hi = round_down(lo, fmt), round_up(hi, fmt)
    return lo, hi


def _interval(result: QuantResult, name: str) -> tuple[np.ndarray, np.ndarray]:
    return widened(result.emulated, result.spec, name)


@public
def check_candidate(result: QuantResult, candidate: dict[str, Any], *,
                    require_format: bool = True) -> QuantReport:
    """Check a kernel's tensors against the emulated pipeline and the real result.

    Parameters
    ----------
    result : QuantResult
        From :func:`refattn.quant.pipeline.quantized` for the call the kernel ran.
    candidate : dict of str to float64 ndarray
        The kernel's tensors by the pipeline's names: ``"output"`` (B, Hq, Q, Dv),
        ``"lse"`` (B, Hq, Q) (natural log), or any intermediate in ``result.emulated``;
        each converted exactly to float64 (a bf16 or fp32 value is a float64 value).
    require_format : bool
        Refuse an output or lse with a finite value that is not a value of the format the
        kernel returns it in (the spec's ``output_format``; fp32 for lse): a candidate that is
        not the kernel's own tensor (a float32 reference, a rescaled copy). False: check such
        values anyway and count them in ``off_grid``.

    Returns
    -------
    QuantReport
        ``passed`` when every element of every tensor lies inside its emulated interval
        (widened only as the module docstring says); per tensor the worst element, its
        distance from the interval, and for output and lse the max error and SQNR against
        the real result; for output FA3's ratio to a bf16 path.

    Raises
    ------
    RefAttnError
        An empty candidate, a name the pipeline does not emulate, a tensor that is not
        float64 or has the wrong shape, an output or lse off its returned format's grid
        (``require_format``): each before any arithmetic.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import preset, quantized
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (np.round(rng.standard_normal((1, 1, 4, 8)) * 4) / 4 for _ in range(3))
    >>> result = quantized(AttentionCall(q, k, v), preset("fa3_fp8"))
    >>> report = check_candidate(result, {"output": result.emulated["output"].lo})
    >>> report.passed, report.tensors["output"].outside
    (True, 0)
    >>> bad = check_candidate(result, {"output": 2.0 * result.emulated["output"].lo})
    >>> bad.passed
    False
    >>> try:  # a float64 value that is not a bf16 value: not what FA3 returns
    ...     check_candidate(result, {"output": result.real.output})
    ... except RefAttnError as exc:
    ...     print(str(exc).split(": value")[0], "is not a bf16 value" in str(exc))
    candidate['output'] True
    """
    from refattn.quant.pipeline import QuantResult  # the pipeline imports this module

    if not isinstance(result, QuantResult):
        raise RefAttnError(f"result: expected a QuantResult (refattn.quant.emulate), got "
                           f"{shown(result)}")
    if not isinstance(candidate, dict) or not candidate:
        raise RefAttnError("candidate: expected a non-empty dict of tensor name to float64 "
                           f"ndarray, got {shown(candidate)}")
    checked: dict[str, np.ndarray] = {}
    for name, x in candidate.items():  # every tensor validated before any arithmetic
        if name not in result.emulated:
            hint = (" (emulate it with quantized(..., intermediates=True))"
                    if name in ("scores", "probs_q") else "")
            raise RefAttnError(f"candidate: {name!r} is not a tensor the pipeline emulates "
                               f"({', '.join(sorted(result.emulated))}){hint}")
        checked[name] = _candidate(name, x, result.emulated[name].shape)
        fmt = _returned_format(result.spec, name)
        if require_format and fmt is not None:
            _check_returned_format(name, checked[name], fmt, result.spec.name)
    tensors: dict[str, TensorReport] = {}
    for name, c in checked.items():
        lo, hi = _interval(result, name)
        tensors[name] = _tensor_report(result, name, c, lo, hi)
    passed = all(t.passed for t in tensors.values())
    return QuantReport(passed, result.spec.name, tensors,
                       "intervals as emulated; output and lse ends rounded outward onto "
                       "their returned format's grid; no other slack")


def _tensor_report(result: QuantResult, name: str, c: np.ndarray, lo: np.ndarray,
                   hi: np.ndarray) -> TensorReport:
    inside, dist = contains(lo, hi, c)
    with np.errstate(invalid="ignore", over="ignore"):
        rad = (hi - lo) / 2
        mid = lo + rad
        # inside: how close to an end, relative to the radius (1 at an end)
        pos = np.where(rad > 0, np.abs(c - mid) / np.where(rad > 0, rad, 1.0), 0.0)
    pos = np.nan_to_num(pos, nan=0.0)
    with np.errstate(invalid="ignore"):
        pos = np.where((rad == 0) & (c != mid) & np.isfinite(c), np.inf, pos)
    finite_rad = rad[np.isfinite(rad)]
    outside = int(np.count_nonzero(~inside))
    if c.size == 0:
        worst: tuple[int, ...] = ()
        wv = wl = wh = wd = wr = 0.0
    else:
        key = dist if outside else pos
        flat = int(np.argmax(key))
        worst = tuple(int(j) for j in np.unravel_index(flat, c.shape))
        wv, wl, wh, wd = (float(c[worst]), float(lo[worst]), float(hi[worst]),
                          float(dist[worst]))
        wr = float(pos[worst]) if np.isfinite(dist[worst]) else math.inf
    report: dict[str, Any] = {
        "name": name, "shape": tuple(c.shape), "passed": outside == 0, "outside": outside,
        "worst_index": worst, "worst_value": wv, "worst_lo": wl, "worst_hi": wh,
        "worst_distance": wd,
        "max_radius": float(finite_rad.max()) if finite_rad.size else 0.0,
        "median_radius": float(np.median(finite_rad)) if finite_rad.size else 0.0,
        "worst_in_radii": wr,
    }
    fmt = _returned_format(result.spec, name)
    if fmt is not None:
        fin = np.isfinite(c)
        with np.errstate(over="ignore"):
            on = quantize(np.where(fin, c, 0.0), fmt, "nearest_even") == np.where(fin, c, 0.0)
        report["off_grid"] = int(np.count_nonzero(~on))
    if name in REAL_NAMES:
        real = np.asarray(getattr(result.real, name), dtype=np.float64)
        report["max_error"], report["max_error_index"] = _max_error(c, real)
        report["sqnr_db"] = _sqnr_db(c, real)
        report["emulated_max_error"] = _max_error(result.emulated[name].mid, real)[0]
        if name == "output":
            pt, _ = _max_error(bf16_path(result), real)
            report["bf16_max_error"] = pt
            err = report["max_error"]
            report["fa3_ratio"] = (err / pt if pt > 0 else (0.0 if err == 0 else math.inf))
    return TensorReport(**report)

"""The number formats of quantised attention and their casts, bit-exact, float64 in and out.

Owns the six formats a quantised kernel stores or casts to (``FORMATS``: e4m3fn, e5m2, int8,
fp16, bf16, fp32), their codes (:func:`encode`, :func:`decode`), the rounding and overflow rules
(``ROUNDINGS``) and :func:`quantize`, which rounds float64 values onto a format's grid exactly as
the hardware or library cast does, returning the rounded values as float64 (every value of all
six formats is a float64). Nothing here accumulates; bounds on sums live in
:mod:`refattn.quant.bounds`.

Every cast is computed once from the exact float64 input (one rounding): split ``x`` into its
binade with ``frexp``, scale to an integer grid by a power of two (exact), ``rint`` (round half to
even, exact), scale back (exact). No library cast is used, so the result does not depend on a
library's overflow rule or on whether it rounds through float32 first; the tests check it against
numpy's float16/float32 casts, ml_dtypes and torch's float8 casts, and against the codes decoded
from their bit fields.

Rounding rules
--------------
``nearest_even_satfinite``
    Round to nearest, ties to even; a finite overflow or +-inf becomes +-max (PTX
    ``cvt.rn.satfinite``, FA3's P cast). NaN stays NaN.
``nearest_even_nan``
    Round to nearest, ties to even; overflow to NaN where the format has no infinity (e4m3fn:
    every ``|x| > 464``, i.e. whatever rounds past 448, and +-inf) and to +-inf where it has one
    (e5m2, fp16, bf16, fp32). This is ml_dtypes' cast and torch's before 2.13 (the issue's
    "|x| >= 480 becomes NaN"; values in (464, 480) round to the NaN code too). torch 2.13's
    ``.to(torch.float8_e4m3fn)`` saturates instead (``fp8e4m3fn_from_fp32_value`` in
    ``torch/headeronly/util/Float8_e4m3fn.h``: "Finite overflow or inf -> saturate to max
    finite value") and converts a float64 tensor through float32 first (two roundings):
    ``quantize(quantize(x, "fp32", "nearest_even"), "e4m3fn", "nearest_even_satfinite")``.
``nearest_even``
    IEEE 754 round to nearest, ties to even, overflow to +-inf (fp16, bf16, fp32, e5m2; not
    e4m3fn, which has no infinity).
``half_away_from_zero``
    int8 only: round half away from zero (Triton's and CUDA's ``round``, SageAttention's
    quantisation), then saturate to [-128, 127]. int8 also accepts ``nearest_even_satfinite``
    (PTX ``cvt.rni.sat.s8.f32``: ties to even, then saturate). NaN has no int8 value: an error.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from refattn._checks import as_array, check_float64, first_index, format_index
from refattn.errors import RefAttnError

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "FormatInfo",
    "check_on_grid",
    "decode",
    "encode",
    "finite_values",
    "format_info",
    "format_max",
    "quantize",
    "round_down",
    "round_up",
]

FORMATS = ("e4m3fn", "e5m2", "int8", "fp16", "bf16", "fp32")
ROUNDINGS = ("nearest_even_satfinite", "nearest_even_nan", "nearest_even", "half_away_from_zero")

Format = Literal["e4m3fn", "e5m2", "int8", "fp16", "bf16", "fp32"]
Rounding = Literal["nearest_even_satfinite", "nearest_even_nan", "nearest_even",
                   "half_away_from_zero"]


class FormatInfo(NamedTuple):
    """The parameters of one format.

    ``precision`` counts the significand's bits including the implicit one (int8: 8 value bits);
    ``emin`` is the exponent of the smallest normal number (subnormals are multiples of
    ``2**(emin - precision + 1)``); ``max`` the largest finite value; ``nan_code`` the code
    :func:`encode` gives a positive NaN (None for int8); ``rounds`` the rules :func:`quantize`
    accepts for it.
    """

    name: str
    bits: int
    exponent_bits: int
    precision: int
    bias: int
    emin: int
    max: float
    min_subnormal: float
    has_inf: bool
    nan_code: int | None
    code_dtype: type
    rounds: tuple[str, ...]


def _float_info(name: str, ebits: int, mbits: int, *, fn: bool, code_dtype: type,
                rounds: tuple[str, ...]) -> FormatInfo:
    bias = 2 ** (ebits - 1) - 1
    top = 2**ebits - 1  # the all-ones exponent field
    if fn:  # no infinity: the all-ones exponent holds finite values but the all-ones mantissa
        largest = float(np.ldexp(2**mbits + 2**mbits - 2, top - bias - mbits))
        nan = (top << mbits) | (2**mbits - 1)
    else:  # IEEE-like: the all-ones exponent is inf (mantissa 0) and NaN
        largest = float(np.ldexp(2 ** (mbits + 1) - 1, top - 1 - bias - mbits))
        nan = (top << mbits) | (1 << (mbits - 1))  # the canonical quiet NaN
    return FormatInfo(name, 1 + ebits + mbits, ebits, mbits + 1, bias, 1 - bias, largest,
                      float(np.ldexp(1.0, 1 - bias - mbits)), not fn, nan, code_dtype, rounds)


_FLOAT_ROUNDS = ("nearest_even_satfinite", "nearest_even_nan", "nearest_even")
_INFO: dict[str, FormatInfo] = {
    "e4m3fn": _float_info("e4m3fn", 4, 3, fn=True, code_dtype=np.uint8,
                          rounds=("nearest_even_satfinite", "nearest_even_nan")),
    "e5m2": _float_info("e5m2", 5, 2, fn=False, code_dtype=np.uint8, rounds=_FLOAT_ROUNDS),
    "int8": FormatInfo("int8", 8, 0, 8, 0, 0, 127.0, 1.0, False, None, np.uint8,
                       ("half_away_from_zero", "nearest_even_satfinite")),
    "fp16": _float_info("fp16", 5, 10, fn=False, code_dtype=np.uint16, rounds=_FLOAT_ROUNDS),
    "bf16": _float_info("bf16", 8, 7, fn=False, code_dtype=np.uint16, rounds=_FLOAT_ROUNDS),
    "fp32": _float_info("fp32", 8, 23, fn=False, code_dtype=np.uint32, rounds=_FLOAT_ROUNDS),
}


def format_info(fmt: str) -> FormatInfo:
    """The parameters of format ``fmt`` (one of ``FORMATS``).

    Examples
    --------
    >>> info = format_info("e4m3fn")
    >>> info.max, info.min_subnormal, info.precision, info.emin, hex(info.nan_code)
    (448.0, 0.001953125, 4, -6, '0x7f')
    >>> format_info("e5m2").max
    57344.0
    """
    try:
        return _INFO[fmt]
    except (KeyError, TypeError):
        raise RefAttnError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}") from None


def format_max(fmt: str) -> float:
    """The largest finite value of format ``fmt``.

    Examples
    --------
    >>> [format_max(f) for f in ("e4m3fn", "e5m2", "int8", "fp16")]
    [448.0, 57344.0, 127.0, 65504.0]
    >>> format_max("bf16") == float.fromhex("0x1.fep127")
    True
    """
    return format_info(fmt).max


def _float64_array(name: str, x: object) -> np.ndarray:
    arr = as_array(name, x)
    check_float64(name, arr)
    return arr


def _round_significand(x: np.ndarray, info: FormatInfo, to_int: np.ufunc = np.rint) -> np.ndarray:
    """Round onto the format's grid of significands, ignoring its largest value (a result may
    exceed ``info.max``; the caller applies the overflow rule). inf and NaN pass through.
    ``to_int``: np.rint (nearest, ties to even), np.floor or np.ceil (directed)."""
    out = np.array(x, dtype=np.float64, copy=True)
    sel = np.isfinite(out) & (out != 0)
    xs = out[sel]
    _, e2 = np.frexp(xs)  # |x| = m 2**e2, m in [0.5, 1): floor(log2|x|) = e2 - 1
    quantum = np.maximum(e2 - 1, info.emin) - (info.precision - 1)  # exponent of one ulp
    # x * 2**-quantum has at most `precision` integer bits: exact; rint/floor/ceil: exact
    out[sel] = np.ldexp(to_int(np.ldexp(xs, -quantum)), quantum)
    return out  # a negative value rounding to zero keeps its sign (-0.0), as IEEE casts do


def _round_nearest_even(x: np.ndarray, info: FormatInfo) -> np.ndarray:
    return _round_significand(x, info, np.rint)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    whole = np.trunc(x)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, and an infinite x keeps `whole`
        frac = x - whole  # exact: both are float64 and |frac| < 1
    return whole + np.where(np.abs(frac) >= 0.5, np.sign(x), 0.0)


#: arrays at least this large are cast by the numba kernel (the same bits; fewer passes)
_FAST_SIZE = 4096


def quantize(x: object, fmt: str, rounding: str) -> np.ndarray:
    """Round float64 values onto the grid of ``fmt`` under ``rounding``; float64 out.

    Parameters
    ----------
    x : (...) float64 ndarray
        Values to cast (NaN and +-inf accepted where the rule defines them).
    fmt : str
        One of ``FORMATS``.
    rounding : str
        One of ``ROUNDINGS`` that ``fmt`` accepts (``format_info(fmt).rounds``).

    Returns
    -------
    (...) float64 ndarray
        Each element the format's value the cast gives (or NaN / +-inf where the rule says).

    Raises
    ------
    RefAttnError
        ``x`` not float64; an unknown format or rounding, or one the format does not define;
        NaN cast to int8 (naming its index).

    Examples
    --------
    >>> x = np.array([464.0, 465.0, 1e9, -np.inf, 0.0625 + 2**-10, -1e-4])
    >>> quantize(x, "e4m3fn", "nearest_even_satfinite").tolist()
    [448.0, 448.0, 448.0, -448.0, 0.0625, -0.0]
    >>> quantize(x, "e4m3fn", "nearest_even_nan").tolist()
    [448.0, nan, nan, nan, 0.0625, -0.0]
    >>> quantize(np.array([2.5, -2.5, 0.5, -0.49, 200.0]), "int8", "half_away_from_zero").tolist()
    [3.0, -3.0, 1.0, 0.0, 127.0]
    >>> (quantize(np.array([1 + 2**-24, 1 + 3 * 2**-24]), "fp32", "nearest_even") - 1) * 2**23
    array([0., 2.])
    """
    info = format_info(fmt)
    if rounding not in ROUNDINGS:
        raise RefAttnError(f"rounding: {rounding!r} is not one of {', '.join(ROUNDINGS)}")
    if rounding not in info.rounds:
        raise RefAttnError(f"rounding: {rounding!r} is not defined for format {fmt!r} "
                           f"(it accepts {', '.join(info.rounds)})")
    arr = _float64_array("x", x)
    if fmt == "int8":
        nan = np.isnan(arr)
        idx = first_index(nan)
        if idx is not None:
            raise RefAttnError(f"x: NaN at index {format_index(idx)} has no int8 value")
        if rounding == "half_away_from_zero":
            rounded = _round_half_away(arr)
        else:
            rounded = np.rint(arr)
        return np.clip(rounded, -128.0, 127.0) + 0.0  # + 0.0: int8 has no -0
    if arr.size >= _FAST_SIZE:  # the same rule, element by element in numba (tested equal)
        from refattn.engine.numba.quant_softmax import cast_array

        over_rule = 0 if rounding == "nearest_even_satfinite" else (
            1 if rounding == "nearest_even_nan" and not info.has_inf else 2)
        fast = np.empty(arr.shape)
        cast_array(np.ascontiguousarray(arr).reshape(-1), info.emin, info.precision, info.max,
                   over_rule, fast.reshape(-1))
        return fast
    out = _round_nearest_even(arr, info)
    over = np.abs(out) > info.max  # finite overflow after rounding, and +-inf (not NaN)
    if over.any():
        sign = np.sign(out[over])
        match rounding:
            case "nearest_even_satfinite":
                out[over] = sign * info.max
            case "nearest_even_nan" if not info.has_inf:
                out[over] = np.nan
            case "nearest_even_nan" | "nearest_even":
                out[over] = sign * np.inf
            case _:  # pragma: no cover - excluded by info.rounds above
                raise RefAttnError(f"rounding: {rounding!r} is not defined for {fmt!r}")
    return out


def round_down(x: object, fmt: str) -> np.ndarray:
    """The largest value of ``fmt`` at or below each element (round toward -inf), float64 out.

    A directed rounding for bounds: if a quantity lies in ``[lo, hi]``, its cast to ``fmt``
    under any round-to-nearest rule lies in ``[round_down(lo), round_up(hi)]`` (the cast is
    monotonic). Below ``-max``: ``-inf``; above ``max``: ``max``; +-inf and NaN unchanged.

    Parameters
    ----------
    x : (...) float64 ndarray
    fmt : str
        One of ``FORMATS``.

    Returns
    -------
    (...) float64 ndarray

    Examples
    --------
    >>> round_down(np.array([0.3, -0.3, 500.0, -500.0, 448.0]), "e4m3fn").tolist()
    [0.28125, -0.3125, 448.0, -inf, 448.0]
    >>> round_down(np.array([2.7, -2.2]), "int8").tolist()
    [2.0, -3.0]
    """
    return _directed(x, fmt, np.floor)


def round_up(x: object, fmt: str) -> np.ndarray:
    """The smallest value of ``fmt`` at or above each element (round toward +inf), float64 out.

    Above ``max``: ``+inf``; below ``-max``: ``-max``; +-inf and NaN unchanged (see
    :func:`round_down`).

    Examples
    --------
    >>> round_up(np.array([0.3, -0.3, 500.0, -500.0, 2.0**-12]), "e4m3fn").tolist()
    [0.3125, -0.28125, inf, -448.0, 0.001953125]
    """
    return _directed(x, fmt, np.ceil)


def _directed(x: object, fmt: str, to_int: np.ufunc) -> np.ndarray:
    info = format_info(fmt)
    arr = _float64_array("x", x)
    if fmt == "int8":
        out = to_int(arr)
        lo, hi = -128.0, 127.0
    else:
        out = _round_significand(arr, info, to_int)
        lo, hi = -info.max, info.max
    finite = np.isfinite(arr)
    up = to_int is np.ceil
    # beyond the range: toward the infinity we round to, or the nearest end of the range
    out[finite & (out > hi)] = np.inf if up else hi
    out[finite & (out < lo)] = lo if up else -np.inf
    return out


def _not_on_grid(x: np.ndarray, info: FormatInfo, *, nonfinite: bool) -> np.ndarray:
    """Mask of the elements of ``x`` that are not values of the format (NaN and inf count
    as values only when ``nonfinite`` and the format has them)."""
    if info.name == "int8":
        with np.errstate(invalid="ignore"):
            return ~((x == np.trunc(x)) & (x >= -128.0) & (x <= 127.0))
    with np.errstate(invalid="ignore"):
        bad = ~((_round_nearest_even(x, info) == x) & (np.abs(x) <= info.max))
    if nonfinite:
        bad &= ~np.isnan(x)
        if info.has_inf:
            bad &= ~np.isinf(x)
    return bad


def _nearest_values(v: float, info: FormatInfo) -> str:
    """The format's values either side of ``v`` (for an error message)."""
    if not np.isfinite(v):
        return ""
    if abs(v) > info.max:
        return f" (outside +-{info.max!r})"
    if info.name == "int8":
        step = 1.0
    else:  # one ulp of v's binade (the subnormal spacing below the normal range)
        e = max(int(np.frexp(v)[1]) - 1, info.emin) if v != 0 else info.emin
        step = float(np.ldexp(1.0, e - info.precision + 1))
    lo, hi = float(np.floor(v / step) * step), float(np.ceil(v / step) * step)
    return f" (between {lo!r} and {hi!r})"


def check_on_grid(name: str, x: object, fmt: str) -> None:
    """Refuse a tensor with a value that is not a finite value of ``fmt``.

    Parameters
    ----------
    name : str
        The tensor's name for the message (``"q"``, ``"k"``, ...).
    x : (...) float64 ndarray
        Values that should be ``fmt``'s decoded codes.
    fmt : str
        One of ``FORMATS``.

    Raises
    ------
    RefAttnError
        Naming the tensor, the first offending index, its value and the format.

    Examples
    --------
    >>> check_on_grid("k", np.array([[0.5, 448.0], [-0.001953125, 0.0]]), "e4m3fn")
    >>> try:
    ...     check_on_grid("k", np.array([[0.5, 448.0], [0.3, 0.0]]), "e4m3fn")
    ... except RefAttnError as exc:
    ...     print(exc)
    k: value 0.3 at index (1, 0) is not a finite e4m3fn value (between 0.28125 and 0.3125)
    """
    info = format_info(fmt)
    arr = _float64_array(name, x)
    idx = first_index(_not_on_grid(arr, info, nonfinite=False))
    if idx is not None:
        v = float(arr[idx])
        raise RefAttnError(f"{name}: value {v!r} at index {format_index(idx)} is not a finite "
                           f"{fmt} value{_nearest_values(v, info)}")


def encode(values: object, fmt: str) -> np.ndarray:
    """The codes of float64 values that lie on ``fmt``'s grid.

    Parameters
    ----------
    values : (...) float64 ndarray
        Values of the format (NaN and +-inf where the format has them).
    fmt : str
        One of ``FORMATS``.

    Returns
    -------
    (...) ndarray
        uint8 for e4m3fn, e5m2 and int8 (two's complement), uint16 for fp16 and bf16, uint32
        for fp32. -0.0 keeps its sign bit (not in int8); NaN gets the canonical quiet NaN
        (``format_info(fmt).nan_code``, with the sign bit of the NaN).

    Raises
    ------
    RefAttnError
        A value the format cannot hold exactly, naming its index.

    Examples
    --------
    >>> encode(np.array([448.0, -0.0, 2.0**-9, np.nan]), "e4m3fn")
    array([126, 128,   1, 127], dtype=uint8)
    >>> encode(np.array([-1.0, 127.0]), "int8")
    array([255, 127], dtype=uint8)
    >>> encode(np.array([1.0]), "bf16")
    array([16256], dtype=uint16)
    """
    info = format_info(fmt)
    arr = _float64_array("values", values)
    idx = first_index(_not_on_grid(arr, info, nonfinite=True))
    if idx is not None:
        v = float(arr[idx])
        raise RefAttnError(f"values: {v!r} at index {format_index(idx)} is not a value of "
                           f"format {fmt}{_nearest_values(v, info)}")
    if fmt == "int8":
        return arr.astype(np.int8).view(np.uint8)
    mbits = info.precision - 1
    sign = np.signbit(arr).astype(np.int64) << (info.bits - 1)
    a = np.abs(arr)
    finite = np.isfinite(a) & (a != 0)
    field = np.zeros(arr.shape, dtype=np.int64)
    af = a[finite]
    _, e2 = np.frexp(af)
    e = np.maximum(e2 - 1, info.emin)
    sig = np.ldexp(af, mbits - e).astype(np.int64)  # exact integer: on the grid
    normal = af >= np.ldexp(1.0, info.emin)
    # a normal number's exponent field is e + bias, its mantissa the significand less 2**mbits;
    # a subnormal's exponent field is 0 and its mantissa the whole significand
    field[finite] = np.where(normal, ((e + info.bias) << mbits) + sig - (1 << mbits), sig)
    field[np.isinf(a)] = (2**info.exponent_bits - 1) << mbits
    field[np.isnan(a)] = info.nan_code if info.nan_code is not None else 0  # int8: no NaN here
    return (sign | field).astype(info.code_dtype)


def decode(codes: object, fmt: str) -> np.ndarray:
    """The float64 values of ``fmt``'s codes, from their bit fields.

    Parameters
    ----------
    codes : (...) ndarray
        uint8 for e4m3fn, e5m2 and int8 (two's complement), uint16 for fp16 and bf16, uint32
        for fp32 (never cast: another dtype is an error).
    fmt : str
        One of ``FORMATS``.

    Returns
    -------
    (...) float64 ndarray
        The values (NaN and +-inf for those codes).

    Examples
    --------
    >>> decode(np.array([0x7E, 0x7F, 0x80, 0x01, 0x08], dtype=np.uint8), "e4m3fn").tolist()
    [448.0, nan, -0.0, 0.001953125, 0.015625]
    >>> decode(np.array([0x7B, 0x7C, 0x7E], dtype=np.uint8), "e5m2").tolist()
    [57344.0, inf, nan]
    >>> decode(np.array([0x80, 0xFF], dtype=np.uint8), "int8").tolist()
    [-128.0, -1.0]
    """
    info = format_info(fmt)
    arr = as_array("codes", codes)
    if arr.dtype != info.code_dtype:
        raise RefAttnError(f"codes: expected dtype {np.dtype(info.code_dtype).name} for format "
                           f"{fmt}, got {arr.dtype} (refattn never casts)")
    if fmt == "int8":
        return arr.view(np.int8).astype(np.float64)
    c = arr.astype(np.int64)
    mbits = info.precision - 1
    top = 2**info.exponent_bits - 1
    negative = (c >> (info.bits - 1)) & 1
    expo = (c >> mbits) & top
    mant = c & ((1 << mbits) - 1)
    # (2**mbits + mant) 2**(expo - bias - mbits) for a normal code, mant 2**(emin - mbits) for a
    # subnormal one: both exact in float64
    mag = np.where(expo == 0, np.ldexp(mant.astype(np.float64), info.emin - mbits),
                   np.ldexp((mant + (1 << mbits)).astype(np.float64),
                            expo - info.bias - mbits))
    if info.has_inf:
        mag = np.where(expo == top, np.where(mant == 0, np.inf, np.nan), mag)
    else:
        mag = np.where((expo == top) & (mant == (1 << mbits) - 1), np.nan, mag)
    return np.where(negative == 1, -mag, mag)


def finite_values(fmt: str) -> np.ndarray:
    """Every finite value of an 8- or 16-bit format, ascending, -0.0 and +0.0 once as 0.0.

    Returns
    -------
    (N,) float64 ndarray
        253 values for e4m3fn, 247 for e5m2, 256 for int8, 63487 for fp16, 65279 for bf16.

    Examples
    --------
    >>> v = finite_values("e4m3fn")
    >>> v.size, v[:3].tolist(), v[-1].item()
    (253, [-448.0, -416.0, -384.0], 448.0)
    """
    info = format_info(fmt)
    if info.bits > 16:
        raise RefAttnError(f"format: {fmt} has too many values to list (8- and 16-bit formats)")
    vals = decode(np.arange(2**info.bits, dtype=np.uint32).astype(info.code_dtype), fmt)
    return np.unique(vals[np.isfinite(vals)] + 0.0)

"""refattn.quant.formats: every code, every rounding boundary, every overflow rule.

Expectations are derived here, independently of the module: codes are decoded from their bit
fields with exact rationals (``Fraction``), ties are resolved by the parity of the code (the
even significand), and numpy's float16/float32 casts (IEEE round to nearest even, one rounding
from float64), ml_dtypes and torch's float8 casts are second witnesses.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from refattn.errors import RefAttnError
from refattn.quant.formats import (
    FORMATS,
    ROUNDINGS,
    check_on_grid,
    decode,
    encode,
    finite_values,
    format_info,
    format_max,
    quantize,
    round_down,
    round_up,
)

# (exponent bits, mantissa bits, has infinity) from the formats' definitions (OCP FP8 spec for
# e4m3fn / e5m2, IEEE 754 binary16 / binary32, bfloat16)
LAYOUT = {"e4m3fn": (4, 3, False), "e5m2": (5, 2, True), "fp16": (5, 10, True),
          "bf16": (8, 7, True), "fp32": (8, 23, True)}
SMALL = ("e4m3fn", "e5m2", "fp16", "bf16")  # formats whose every code is enumerated
CODE_DTYPE = {"e4m3fn": np.uint8, "e5m2": np.uint8, "int8": np.uint8, "fp16": np.uint16,
              "bf16": np.uint16, "fp32": np.uint32}


def value_of(code: int, fmt: str) -> Fraction | str:
    """The exact value of a code from its fields, or 'nan' / 'inf' / '-inf'."""
    ebits, mbits, has_inf = LAYOUT[fmt]
    bias = 2 ** (ebits - 1) - 1
    sign = -1 if code >> (ebits + mbits) else 1
    e = (code >> mbits) & (2**ebits - 1)
    m = code & (2**mbits - 1)
    if e == 2**ebits - 1:
        if has_inf:
            if m == 0:
                return "inf" if sign > 0 else "-inf"
            return "nan"
        if m == 2**mbits - 1:
            return "nan"
    if e == 0:
        return sign * Fraction(m, 2**mbits) * Fraction(2) ** (1 - bias)
    return sign * (1 + Fraction(m, 2**mbits)) * Fraction(2) ** (e - bias)


def exact_table(fmt: str) -> np.ndarray:
    n = 2 ** (1 + sum(LAYOUT[fmt][:2]))
    out = np.empty(n)
    for c in range(n):
        v = value_of(c, fmt)
        out[c] = float(v)
        if isinstance(v, Fraction):
            assert Fraction(out[c]) == v  # every value is a float64 exactly
        if v == 0 and c >> (n.bit_length() - 2):
            out[c] = -0.0
    return out


TABLES = {fmt: exact_table(fmt) for fmt in SMALL}


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal element by element, NaN equal to NaN, and the sign of every zero equal."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return bool(np.array_equal(a, b, equal_nan=True)
                and np.array_equal(np.signbit(a[a == 0]), np.signbit(b[b == 0])))


# -- formats' parameters ---------------------------------------------------------------------

def test_format_parameters_from_the_definitions():
    assert FORMATS == ("e4m3fn", "e5m2", "int8", "fp16", "bf16", "fp32")
    assert ROUNDINGS == ("nearest_even_satfinite", "nearest_even_nan", "nearest_even",
                         "half_away_from_zero")
    assert format_max("e4m3fn") == 448.0 == 1.75 * 2**8
    assert format_max("e5m2") == 57344.0 == 1.75 * 2**15
    assert format_max("fp16") == 65504.0 == float(np.finfo(np.float16).max)
    assert format_max("fp32") == float(np.finfo(np.float32).max)
    assert format_max("bf16") == (2 - 2**-7) * 2.0**127
    assert format_max("int8") == 127.0
    for fmt in SMALL:
        finite = TABLES[fmt][np.isfinite(TABLES[fmt])]
        assert format_max(fmt) == finite.max()
        assert format_info(fmt).min_subnormal == finite[finite > 0].min()
    assert format_info("fp32").min_subnormal == 2.0**-149
    with pytest.raises(RefAttnError, match="'e4m3' is not one of e4m3fn"):
        format_max("e4m3")


# -- every code ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", SMALL)
def test_decode_every_code_from_its_bit_fields(fmt):
    n = TABLES[fmt].size
    codes = np.arange(n, dtype=np.uint32).astype(CODE_DTYPE[fmt])
    assert same(decode(codes, fmt), TABLES[fmt])


def test_decode_agrees_with_numpy_and_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    views = {"e4m3fn": (np.uint8, ml_dtypes.float8_e4m3fn),
             "e5m2": (np.uint8, ml_dtypes.float8_e5m2),
             "fp16": (np.uint16, np.float16), "bf16": (np.uint16, ml_dtypes.bfloat16)}
    for fmt, (cdt, view) in views.items():
        codes = np.arange(2 ** (8 * np.dtype(cdt).itemsize), dtype=np.uint32).astype(cdt)
        with np.errstate(invalid="ignore"):  # signalling NaN codes
            assert same(decode(codes, fmt), codes.view(view).astype(np.float64)), fmt


def test_decode_fp32_codes_agree_with_numpy():
    rng = np.random.default_rng(0)
    codes = np.concatenate([rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32),
                            np.array([0, 1, 2**23 - 1, 2**23, 0x7F7FFFFF, 0x7F800000, 0x7FC00000,
                                      0x80000000, 0x80000001, 0xFF800000], dtype=np.uint32)])
    with np.errstate(invalid="ignore"):  # signalling NaN codes
        assert same(decode(codes, "fp32"), codes.view(np.float32).astype(np.float64))
    tail = codes[-10:]
    exact = [value_of(int(c), "fp32") for c in tail]
    want = np.array([float(v) for v in exact])
    want[tail == 0x80000000] = -0.0
    assert same(decode(tail, "fp32"), want)


def test_int8_codes_are_twos_complement():
    codes = np.arange(256, dtype=np.uint8)
    expected = np.array([c - 256 if c >= 128 else c for c in range(256)], dtype=np.float64)
    assert same(decode(codes, "int8"), expected)
    assert np.array_equal(encode(expected, "int8"), codes)


@pytest.mark.parametrize("fmt", SMALL)
def test_encode_decode_round_trip_every_code(fmt):
    table = TABLES[fmt]
    codes = np.arange(table.size, dtype=np.uint32).astype(CODE_DTYPE[fmt])
    ok = ~np.isnan(table)
    assert np.array_equal(encode(table[ok], fmt), codes[ok])
    # NaN encodes to the canonical quiet NaN with the NaN's sign
    nan_code = format_info(fmt).nan_code
    assert np.isnan(table[nan_code])
    sign = 1 << (format_info(fmt).bits - 1)
    assert encode(np.array([np.nan, -np.nan]), fmt).tolist() == [nan_code, nan_code | sign]


def test_e4m3fn_nan_codes_and_no_infinity():
    table = TABLES["e4m3fn"]
    assert np.flatnonzero(np.isnan(table)).tolist() == [0x7F, 0xFF]
    assert not np.isinf(table).any()
    assert np.flatnonzero(np.isinf(TABLES["e5m2"])).tolist() == [0x7C, 0xFC]
    assert np.flatnonzero(np.isnan(TABLES["e5m2"])).tolist() == [0x7D, 0x7E, 0x7F,
                                                                  0xFD, 0xFE, 0xFF]


@pytest.mark.parametrize("fmt", SMALL)
def test_codes_are_ordered(fmt):
    table = TABLES[fmt]
    half = table.size // 2
    pos = table[:half][~np.isnan(table[:half])]  # 0x00.. upward: magnitudes increase
    assert np.all(np.diff(pos) > 0)
    assert same(table[half:], -table[:half])  # the sign bit mirrors every code
    assert np.array_equal(finite_values(fmt), np.unique(table[np.isfinite(table)]))


def test_finite_value_counts():
    assert [finite_values(f).size for f in ("e4m3fn", "e5m2", "int8")] == [253, 247, 256]
    assert finite_values("fp16").size == 2 * (2**15 - 2**10) - 1
    with pytest.raises(RefAttnError, match="too many values"):
        finite_values("fp32")


# -- rounding boundaries ---------------------------------------------------------------------

def boundaries(fmt: str):
    """Consecutive finite values (a, b), their midpoints and the value a tie goes to (the one
    whose code is even: the even significand), from the exact table."""
    table = TABLES[fmt]
    codes = np.arange(table.size)
    fin = np.isfinite(table) & ~((table == 0) & np.signbit(table))  # one zero: +0
    order = np.argsort(table[fin], kind="stable")
    vals, cds = table[fin][order], codes[fin][order]
    a, b = vals[:-1], vals[1:]
    mid = (a + b) / 2
    assert np.all(mid == a / 2 + b / 2)  # exact: one more bit than the format holds
    # a zero neighbour's code is even (0x00 or 0x80): the tie goes to zero
    tie = np.where(cds[:-1] % 2 == 0, a, b)
    return a, b, mid, tie


@pytest.mark.parametrize("fmt", SMALL)
@pytest.mark.parametrize("rounding", ["nearest_even_satfinite", "nearest_even_nan"])
def test_every_midpoint_and_its_float64_neighbours(fmt, rounding):
    a, b, mid, tie = boundaries(fmt)
    below, above = np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf)
    assert same(np.abs(quantize(below, fmt, rounding)), np.abs(a))
    assert same(np.abs(quantize(above, fmt, rounding)), np.abs(b))
    assert same(np.abs(quantize(mid, fmt, rounding)), np.abs(tie))
    for x in (below, mid, above):  # a cast keeps the sign, also of a zero
        assert np.array_equal(np.signbit(quantize(x, fmt, rounding)), np.signbit(x))
    assert same(quantize(a, fmt, rounding), a)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "bf16", "fp16"])
def test_every_midpoint_is_float32_exact_and_its_float32_neighbours(fmt):
    a, b, mid, tie = boundaries(fmt)
    m32 = mid.astype(np.float32)
    assert np.array_equal(m32.astype(np.float64), mid)  # the midpoints are float32-exact
    below = np.nextafter(m32, np.float32(-np.inf)).astype(np.float64)
    above = np.nextafter(m32, np.float32(np.inf)).astype(np.float64)
    r = "nearest_even_satfinite"
    assert np.array_equal(quantize(below, fmt, r), a)
    assert np.array_equal(quantize(above, fmt, r), b)
    assert np.array_equal(quantize(mid, fmt, r), tie)


def test_fp16_midpoints_are_not_all_bf16_exact_but_float32_exact():
    _, _, mid, _ = boundaries("fp16")
    assert np.array_equal(mid.astype(np.float32).astype(np.float64), mid)
    assert not np.array_equal(quantize(mid, "bf16", "nearest_even"), mid)


@pytest.mark.parametrize("fmt, witness", [("fp16", np.float16), ("fp32", np.float32)])
def test_ieee_casts_agree_with_numpy(fmt, witness):
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.standard_normal(20000) * np.exp2(rng.integers(-160, 140, 20000)),
        np.exp2(rng.uniform(-30, 20, 5000)),
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-320, -1e308, 65520.0, 65519.99],
    ])
    with np.errstate(over="ignore"):
        expected = x.astype(witness).astype(np.float64)
    assert same(quantize(x, fmt, "nearest_even"), expected)
    assert same(quantize(x, fmt, "nearest_even_nan"), expected)  # the same where inf exists


def test_fp32_rounding_boundaries_including_subnormals():
    rng = np.random.default_rng(2)
    bits = np.concatenate([rng.integers(0, 0x7F7FFFFF, 20000), np.arange(0, 64),
                           np.arange(0x7F7FFFC0, 0x7F7FFFFF), np.arange(0x007FFFC0, 0x00800040)])
    a = bits.astype(np.uint32).view(np.float32).astype(np.float64)
    b = (bits + 1).astype(np.uint32).view(np.float32).astype(np.float64)
    mid = (a + b) / 2
    assert np.all(mid == a / 2 + b / 2)  # exact in float64 (25 bits; 2**-150 at the bottom)
    tie = np.where(bits % 2 == 0, a, b)
    for x, want in ((np.nextafter(mid, -np.inf), a), (np.nextafter(mid, np.inf), b),
                    (mid, tie)):
        assert np.array_equal(quantize(x, "fp32", "nearest_even"), want)
        assert np.array_equal(quantize(-x, "fp32", "nearest_even"), -want)
        assert np.array_equal(x.astype(np.float32).astype(np.float64), want)  # numpy agrees


@pytest.mark.parametrize("fmt", SMALL)
def test_directed_rounding_between_every_pair_of_neighbours(fmt):
    a, b, mid, _ = boundaries(fmt)
    inside = np.concatenate([np.nextafter(a, np.inf), mid, np.nextafter(b, -np.inf)])
    lo, hi = np.tile(a, 3), np.tile(b, 3)
    assert np.array_equal(round_down(inside, fmt), lo)
    assert np.array_equal(round_up(inside, fmt), hi)
    values = np.concatenate([a, b])
    assert np.array_equal(round_down(values, fmt), values)
    assert np.array_equal(round_up(values, fmt), values)
    mx = format_max(fmt)
    beyond = np.array([np.nextafter(mx, np.inf), 1e300, -np.nextafter(mx, np.inf), np.inf,
                       -np.inf])
    assert round_down(beyond, fmt).tolist() == [mx, mx, -np.inf, np.inf, -np.inf]
    assert round_up(beyond, fmt).tolist() == [np.inf, np.inf, -mx, np.inf, -np.inf]


def test_directed_rounding_fp32_and_int8_against_numpy():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(20000) * np.exp2(rng.integers(-150, 120, 20000))
    near = x.astype(np.float32)  # numpy: nearest; the directed results bracket it
    down = np.where(near.astype(np.float64) > x, np.nextafter(near, np.float32(-np.inf)), near)
    up = np.where(near.astype(np.float64) < x, np.nextafter(near, np.float32(np.inf)), near)
    assert np.array_equal(round_down(x, "fp32"), down.astype(np.float64))
    assert np.array_equal(round_up(x, "fp32"), up.astype(np.float64))
    y = np.array([2.5, -2.5, 127.2, 128.5, -128.5, 3.0])
    assert round_down(y, "int8").tolist() == [2, -3, 127, 127, -np.inf, 3]
    assert round_up(y, "int8").tolist() == [3, -2, np.inf, np.inf, -128, 3]


# -- overflow rules --------------------------------------------------------------------------

def test_e4m3fn_overflow_thresholds():
    x = np.array([448.0, 464.0, np.nextafter(464.0, np.inf), 470.0, 479.9, 480.0, 1e300, np.inf])
    sat, nan = 448.0, np.nan
    want_sat = [448, sat, sat, sat, sat, sat, sat, sat]
    want_nan = [448, 448, nan, nan, nan, nan, nan, nan]
    for sign in (1, -1):
        assert same(quantize(sign * x, "e4m3fn", "nearest_even_satfinite"),
                    sign * np.array(want_sat, dtype=float))
        assert same(quantize(sign * x, "e4m3fn", "nearest_even_nan"),
                    sign * np.array(want_nan, dtype=float))
    with pytest.raises(RefAttnError, match="'nearest_even' is not defined for format 'e4m3fn'"):
        quantize(x, "e4m3fn", "nearest_even")


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "fp16", "bf16"])
def test_overflow_thresholds_float32_neighbours(fmt):
    """The tie between max and the next binade's first value (the NaN code of e4m3fn) is
    float32-exact; its float32 neighbours round to max and past it."""
    mx = format_max(fmt)
    threshold = mx + (mx - finite_values(fmt)[-2]) / 2
    t32 = np.float32(threshold)
    assert float(t32) == threshold
    below = float(np.nextafter(t32, np.float32(0)))
    above = float(np.nextafter(t32, np.float32(np.inf)))
    over = np.nan if fmt == "e4m3fn" else np.inf
    x = np.array([below, threshold, above])
    for sign in (1.0, -1.0):
        assert same(quantize(sign * x, fmt, "nearest_even_nan"), sign * np.array([mx, mx, over])
                    if fmt == "e4m3fn" else sign * np.array([mx, over, over]))
        assert same(quantize(sign * x, fmt, "nearest_even_satfinite"), sign * np.full(3, mx))


@pytest.mark.parametrize("fmt", ["e5m2", "fp16", "bf16", "fp32"])
def test_ieee_like_overflow_thresholds(fmt):
    mx = format_max(fmt)
    if fmt == "fp32":
        below_max = float(np.nextafter(np.float32(mx), np.float32(0)))
    else:
        below_max = float(finite_values(fmt)[-2])
    half_ulp = (mx - below_max) / 2  # half the top binade's spacing
    threshold = mx + half_ulp  # the tie between max and 2**(emax+1): goes to the even 2**(emax+1)
    x = np.array([mx, np.nextafter(threshold, 0), threshold, 1e300, np.inf])
    for sign in (1.0, -1.0):
        xs = sign * x
        assert same(quantize(xs, fmt, "nearest_even"),
                    sign * np.array([mx, mx, np.inf, np.inf, np.inf]))
        assert same(quantize(xs, fmt, "nearest_even_nan"), quantize(xs, fmt, "nearest_even"))
        assert same(quantize(xs, fmt, "nearest_even_satfinite"), sign * np.full(5, mx))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "fp16", "bf16", "fp32"])
def test_nan_and_infinity_inputs(fmt):
    for r in format_info(fmt).rounds:
        out = quantize(np.array([np.nan, np.inf, -np.inf]), fmt, r)
        assert np.isnan(out[0])
        if r == "nearest_even_satfinite":
            assert out[1:].tolist() == [format_max(fmt), -format_max(fmt)]
        elif format_info(fmt).has_inf:
            assert out[1:].tolist() == [np.inf, -np.inf]
        else:
            assert np.isnan(out[1:]).all()


def test_signed_zero():
    for fmt in ("e4m3fn", "e5m2", "fp16", "bf16", "fp32"):
        out = quantize(np.array([-0.0, 0.0, -1e-300, 1e-300]), fmt, "nearest_even_satfinite")
        assert out.tolist() == [0.0] * 4 and np.signbit(out).tolist() == [True, False, True, False]
    assert encode(np.array([-0.0]), "e4m3fn").tolist() == [0x80]
    assert encode(np.array([-0.0]), "fp16").tolist() == [0x8000]
    assert encode(np.array([-0.0]), "fp32").tolist() == [0x80000000]
    out = quantize(np.array([-0.0, -0.3]), "int8", "half_away_from_zero")
    assert not np.signbit(out).any()  # int8 has no -0


# -- int8 ------------------------------------------------------------------------------------

def test_int8_half_away_from_zero():
    x = np.array([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, np.nextafter(0.5, 0), -np.nextafter(0.5, 0),
                  126.5, 127.49, 127.5, -128.5, -129.0, 1e300, np.inf, -np.inf, 3.0, -7.25])
    want = [1, -1, 2, -2, 3, -3, 0, 0, 127, 127, 127, -128, -128, 127, 127, -128, 3, -7]
    assert quantize(x, "int8", "half_away_from_zero").tolist() == want
    # cvt.rni.sat: ties to even, then saturate
    assert quantize(x[:6], "int8", "nearest_even_satfinite").tolist() == [0, 0, 2, -2, 2, -2]
    rng = np.random.default_rng(3)
    y = rng.uniform(-140, 140, 10000)
    frac = [Fraction(v) for v in y]  # half away from zero with exact rationals
    ref = [max(-128, min(127, (1 if f > 0 else -1) * int(abs(f) + Fraction(1, 2))))
           for f in frac]
    assert quantize(y, "int8", "half_away_from_zero").tolist() == ref
    with pytest.raises(RefAttnError, match=r"NaN at index \(1\) has no int8 value"):
        quantize(np.array([1.0, np.nan]), "int8", "half_away_from_zero")
    with pytest.raises(RefAttnError,
                       match="'half_away_from_zero' is not defined for format 'fp16'"):
        quantize(y, "fp16", "half_away_from_zero")


# -- witnesses: ml_dtypes and torch ----------------------------------------------------------

def dense_inputs(fmt: str) -> np.ndarray:
    """Every boundary, its float64 and float32 neighbours, and random values over the range."""
    a, _, mid, _ = boundaries(fmt)
    rng = np.random.default_rng(4)
    m32 = mid.astype(np.float32)
    xs = np.concatenate([mid, np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf), a,
                         np.nextafter(m32, np.float32(-np.inf)).astype(np.float64),
                         np.nextafter(m32, np.float32(np.inf)).astype(np.float64),
                         rng.uniform(-1, 1, 5000) * format_max(fmt),
                         np.exp2(rng.uniform(-20, 4, 5000))])
    return np.concatenate([xs, -xs])


@pytest.mark.parametrize("fmt, name", [("e4m3fn", "float8_e4m3fn"), ("e5m2", "float8_e5m2"),
                                       ("bf16", "bfloat16")])
def test_agrees_with_ml_dtypes(fmt, name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = dense_inputs(fmt)
    got = x.astype(getattr(ml_dtypes, name)).astype(np.float64)  # one rounding from float64
    assert same(quantize(x, fmt, "nearest_even_nan"), got)
    over = np.array([470.0, 1e4, np.inf, -np.inf]) * (1 if fmt == "e4m3fn" else 1e3)
    assert same(quantize(over, fmt, "nearest_even_nan"),
                over.astype(getattr(ml_dtypes, name)).astype(np.float64))


def torch_e4m3fn_rule(torch) -> str:
    """torch's e4m3fn overflow rule: saturation from 2.13 on (Float8_e4m3fn.h), NaN before."""
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return "nearest_even_satfinite" if (major, minor) >= (2, 13) else "nearest_even_nan"


@pytest.mark.torch
@pytest.mark.parametrize("fmt, name", [("e4m3fn", "float8_e4m3fn"), ("e5m2", "float8_e5m2"),
                                       ("bf16", "bfloat16"), ("fp16", "float16")])
def test_agrees_with_torch(fmt, name):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name)
    rule = torch_e4m3fn_rule(torch) if fmt == "e4m3fn" else "nearest_even_nan"
    x = dense_inputs(fmt) if fmt != "fp16" else np.concatenate([dense_inputs("e5m2"),
                                                                 boundaries("fp16")[2]])
    x = np.concatenate([x, [1e4, 1e30, np.inf, -np.inf, np.nan]])
    # from float32: one rounding
    x32 = x.astype(np.float32)
    got = torch.from_numpy(x32).to(dtype).to(torch.float64).numpy()
    assert same(quantize(x32.astype(np.float64), fmt, rule), got)
    # from float64: torch rounds to float32 first, then to the format (two roundings)
    got64 = torch.from_numpy(x).to(dtype).to(torch.float64).numpy()
    assert same(quantize(quantize(x, "fp32", "nearest_even"), fmt, rule), got64)
    if fmt == "e4m3fn":  # where the two roundings differ from one, torch is not the single cast
        m = boundaries(fmt)[2]
        above = np.nextafter(m, np.inf)
        single = quantize(above, fmt, rule)
        double = torch.from_numpy(above).to(dtype).to(torch.float64).numpy()
        assert not np.array_equal(single, double)


# -- on the grid, and errors -----------------------------------------------------------------

def test_check_on_grid_names_tensor_index_and_format():
    for fmt in FORMATS:
        vals = finite_values(fmt) if fmt != "fp32" else np.array([1.0, 2.0**-149, -3.5])
        check_on_grid("q", vals.reshape(-1, 1), fmt)  # every finite value passes
    with pytest.raises(RefAttnError, match=r"^v: value 449.0 at index \(0, 2\) is not a finite "
                                           r"e4m3fn value \(outside \+-448.0\)$"):
        check_on_grid("v", np.array([[1.0, 2.0, 449.0]]), "e4m3fn")
    with pytest.raises(RefAttnError, match=r"k: value 1.125 at index \(1\) is not a finite e5m2 "
                                           r"value \(between 1.0 and 1.25\)"):
        check_on_grid("k", np.array([1.0, 1.125]), "e5m2")
    with pytest.raises(RefAttnError, match=r"q: value 0.5 at index \(0\) is not a finite int8"):
        check_on_grid("q", np.array([0.5]), "int8")
    with pytest.raises(RefAttnError, match=r"q: value inf at index \(1\)"):
        check_on_grid("q", np.array([1.0, np.inf]), "fp16")
    with pytest.raises(RefAttnError, match=r"q: value nan at index \(0\)"):
        check_on_grid("q", np.array([np.nan]), "e4m3fn")
    with pytest.raises(RefAttnError, match=r"q: value 1e-05 at index \(0\) is not a finite "
                                           r"e4m3fn value \(between 0.0 and 0.001953125\)"):
        check_on_grid("q", np.array([1e-5]), "e4m3fn")
    with pytest.raises(RefAttnError, match="q: expected dtype float64, got float32"):
        check_on_grid("q", np.ones(2, dtype=np.float32), "e4m3fn")


def test_errors_never_cast():
    with pytest.raises(RefAttnError, match="x: expected dtype float64, got float32"):
        quantize(np.ones(3, dtype=np.float32), "fp16", "nearest_even")
    with pytest.raises(RefAttnError, match="rounding: 'nearest' is not one of"):
        quantize(np.ones(3), "fp16", "nearest")
    with pytest.raises(RefAttnError,
                       match="codes: expected dtype uint8 for format e4m3fn, got int8"):
        decode(np.zeros(3, dtype=np.int8), "e4m3fn")
    with pytest.raises(RefAttnError, match="codes: expected dtype uint16 for format bf16"):
        decode(np.zeros(3, dtype=np.uint8), "bf16")
    with pytest.raises(RefAttnError, match=r"values: 0.3 at index \(1\) is not a value of "
                                           r"format e4m3fn \(between 0.28125 and 0.3125\)"):
        encode(np.array([1.0, 0.3]), "e4m3fn")
    with pytest.raises(RefAttnError, match=r"values: inf at index \(0\) is not a value of "
                                           r"format e4m3fn"):
        encode(np.array([np.inf]), "e4m3fn")
    with pytest.raises(RefAttnError, match=r"values: nan at index \(0\) is not a value of "
                                           r"format int8"):
        encode(np.array([np.nan]), "int8")
    with pytest.raises(RefAttnError, match=r"values: 128.0 at index \(0\)"):
        encode(np.array([128.0]), "int8")
    assert encode(np.array([np.inf, -np.inf]), "e5m2").tolist() == [0x7C, 0xFC]
    assert encode(np.array([np.inf]), "fp32").tolist() == [0x7F800000]


def test_quantize_returns_a_new_float64_array():
    x = np.array([[0.3, 1000.0]])
    out = quantize(x, "e4m3fn", "nearest_even_satfinite")
    assert out.dtype == np.float64 and out.shape == (1, 2) and out is not x
    assert x.tolist() == [[0.3, 1000.0]]
    assert quantize(np.float64(0.3), "e4m3fn", "nearest_even_satfinite").shape == ()

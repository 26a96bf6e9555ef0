"""Every number from outside is bounded before use (issue 40, item 2, reproducers 2-4).

One helper per kind of bound lives in :mod:`refattn._checks` (:func:`bounded_int`,
:func:`bounded_float`, :func:`index_array`); each entry point passes its integers and floats
through them, and a paged call is sized from the blocks it reads. Each reproducer of the issue
ends here in a :class:`RefAttnError` that names the field and its range (on the command line:
one line, exit 2, nothing written), each boundary-but-valid value gives the answer of the
obvious equivalent call, and memory is measured with tracemalloc (numpy reports its
allocations to it) against a bound far below what the unfixed code needed; no test asserts a
time.
"""

from __future__ import annotations

import json
import shutil
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import refattn
from refattn import RefAttnError
from refattn._checks import (
    INT64_MAX,
    INT64_MIN,
    bounded_float,
    bounded_int,
    index_array,
    int_text,
)
from refattn.adapters.flash_attn import flash_attn_with_kvcache, kvcache_call

MiB = 2**20


def _peak(fn, *args, **kwargs):
    """(result, peak bytes traced while ``fn`` ran)."""
    tracemalloc.start()
    try:
        result = fn(*args, **kwargs)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- the helpers ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [7, np.int8(7), np.int32(7), np.uint64(7), np.array(7)])
def test_bounded_int_accepts_integer_scalars_of_every_kind(value):
    n = bounded_int("n", value, lo=0, hi=7)
    assert n == 7 and type(n) is int


def test_bounded_int_accepts_the_whole_uint64_and_int64_ranges_when_asked():
    assert bounded_int("n", np.uint64(2**64 - 1), lo=0, hi=2**64 - 1) == 2**64 - 1
    assert bounded_int("n", np.int64(INT64_MIN), lo=INT64_MIN, hi=INT64_MAX) == INT64_MIN


@pytest.mark.parametrize(("value", "message"), [
    (True, r"n: expected an integer in \[0, 9\], got True"),
    (np.True_, r"n: expected an integer in \[0, 9\], got np.True_"),
    (3.0, r"n: expected an integer in \[0, 9\], got 3.0"),
    (np.float64(2.5), r"n: expected an integer in \[0, 9\], got np.float64\(2.5\)"),
    ("3", r"n: expected an integer in \[0, 9\], got '3'"),
    (None, r"n: expected an integer in \[0, 9\], got None"),
    (np.array([3]), r"n: expected an integer in \[0, 9\], got an int64 array of shape \(1,\)"),
    (10, r"n: 10 is outside the allowed range \[0, 9\]"),
    (-1, r"n: -1 is outside the allowed range \[0, 9\]"),
    (np.uint64(2**64 - 1), r"n: 2\*\*64 - 1 is outside the allowed range \[0, 9\]"),
    (2**70, r"n: 2\*\*70 is outside the allowed range \[0, 9\]"),
])
def test_bounded_int_refuses_by_name_with_the_range(value, message):
    with pytest.raises(RefAttnError, match=message):
        bounded_int("n", value, lo=0, hi=9)


def test_an_integer_too_long_to_print_is_described_not_printed():
    huge = 10**5000  # str() of it raises ValueError (Python's 4,300-digit limit)
    with pytest.raises(RefAttnError, match=r"n: an integer of 16610 bits \(about 10\*\*5000\) "
                                           r"is outside the allowed range \[0, 9\]"):
        bounded_int("n", huge, lo=0, hi=9)
    with pytest.raises(RefAttnError, match=r"x: an integer of 16610 bits"):
        bounded_float("x", huge)
    assert int_text(INT64_MAX) == "2**63 - 1" and int_text(INT64_MIN) == "-2**63"


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.int64(1), np.array(0.5)])
def test_bounded_float_accepts_reals_of_every_kind(value):
    x = bounded_float("x", value, lo=0.0, hi=1.0)
    assert x == float(value) and type(x) is float


@pytest.mark.parametrize(("value", "kw", "message"), [
    (float("nan"), {}, r"x: expected a finite number, got nan"),
    (float("inf"), {}, r"x: expected a finite number, got inf"),
    (float("nan"), {"finite": False}, r"x: expected a number, not NaN, got nan"),
    (True, {}, r"x: expected a number in \[-inf, inf\], got True"),
    ("1", {}, r"x: expected a number in \[-inf, inf\], got '1'"),
    (1j, {}, r"x: expected a number in \[-inf, inf\], got 1j"),
    (0.0, {"lo": 0.0, "lo_open": True}, r"x: 0.0 is outside the allowed range \(0.0, inf\]"),
    (1.0, {"hi": 1.0, "hi_open": True}, r"x: 1.0 is outside the allowed range \[-inf, 1.0\)"),
    (2.0**64 * 2, {"hi": 2.0**64}, r"x: 3.6893488147419103e\+19 is outside the allowed "
                                  r"range \[-inf, 2\*\*64\]"),
])
def test_bounded_float_refuses_by_name_with_the_interval(value, kw, message):
    with pytest.raises(RefAttnError, match=message):
        bounded_float("x", value, **kw)


def test_bounded_float_takes_infinity_only_when_asked():
    assert bounded_float("x", float("inf"), finite=False) == float("inf")
    assert bounded_float("x", 2.0**64, lo=0.0, lo_open=True, hi=2.0**64) == 2.0**64


def test_index_array_checks_dtype_axes_and_the_entries_read():
    used = np.array([[True, True, False]])
    table = np.array([[2, 0, -1]], np.int32)
    out = index_array("t", table, lo=0, hi=2, used=used, dtype=np.int32, ndim=2)
    assert out.dtype == np.int64 and out.tolist() == [[2, 0, -1]]  # -1 padding: not read
    with pytest.raises(RefAttnError, match=r"t: entry \(b=0, p=2\) is -1, expected a value in "
                                           r"\[0, 2\]"):
        index_array("t", table, lo=0, hi=2, letters="bp")
    with pytest.raises(RefAttnError, match=r"t: entry b=1 is 5, expected one page"):
        index_array("t", [0, 5], lo=0, hi=2, letters="b", expected="one page")
    with pytest.raises(RefAttnError, match="t: expected dtype int32, got int64"):
        index_array("t", table.astype(np.int64), lo=0, hi=2, dtype=np.int32)
    with pytest.raises(RefAttnError, match="t: expected an integer array, got dtype float64"):
        index_array("t", [1.0], lo=0, hi=2)
    with pytest.raises(RefAttnError, match="t: expected an integer array, got dtype bool"):
        index_array("t", [True], lo=0, hi=2)
    with pytest.raises(RefAttnError, match=r"t: expected 2 axes, got shape \[3\]"):
        index_array("t", [0, 1, 2], lo=0, hi=2, ndim=2)
    big = np.array([0, 2**64 - 1], np.uint64)  # would wrap to -1 in int64
    with pytest.raises(RefAttnError, match=r"t: value 18446744073709551615 does not fit in "
                                           r"int64 \(entry \(1\)"):
        index_array("t", big, lo=0, hi=2, used=np.array([True, False]))


# -- reproducer 1: window_size=(-1, 2**63 - 1) is full attention, not zeros -------------------
def _kvcache(*, B=2, Q=3, Hq=4, Hkv=2, D=8, ps=4, lens=(9, 5), width=3, seed=0):
    rng = np.random.default_rng(seed)
    pages = B * width + 1
    k_cache = rng.standard_normal((pages, ps, Hkv, D))
    v_cache = rng.standard_normal((pages, ps, Hkv, D))
    table = np.full((B, width), -1, np.int32)
    order, used = rng.permutation(pages), 0
    for b, n in enumerate(lens):
        table[b, :-(-n // ps)] = order[used:used - (-n // ps)]
        used += -(-n // ps)
    return (rng.standard_normal((B, Q, Hq, D)), k_cache, v_cache,
            {"cache_seqlens": np.asarray(lens, np.int32), "block_table": table})


def _run(window, **kw):
    q, kc, vc, args = _kvcache()
    return flash_attn_with_kvcache(q, kc, vc, **args, window_size=window,
                                   return_softmax_lse=True, **kw)


@pytest.mark.parametrize("window", [(-1, 2**63 - 1), (2**63 - 1, -1), (2**63 - 1, 2**63 - 1),
                                    (2**62, 2**62), (np.int64(2**63 - 1), np.int64(-1)),
                                    (12, 12), (12 + 2, 12 + 2), (12 + 3, 12 + 3)])
def test_a_window_bound_at_or_beyond_every_distance_is_no_bound(window):
    """K = 12 canonical keys, Q = 3 queries: a window bound of K + Q or more bounds nothing
    (it used to overflow int64 in ``pos + right``: zero output, lse +inf); a bound of the
    sequence length or just below K + Q is still a finite bound, and reaches every key."""
    out, lse = _run(window)
    want_out, want_lse = _run((-1, -1))
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    assert np.isfinite(lse).all()


def test_the_exact_reach_of_a_window_is_kept():
    """(left, right) = (8, 0) reaches key 0 from the last query of the 9-token sequence: the
    same as unbounded; (7, 0) does not, and differs."""
    causal = _run((-1, -1), causal=True)
    assert np.array_equal(_run((8, -1), causal=True)[0][0], causal[0][0])
    assert not np.array_equal(_run((7, -1), causal=True)[0][0], causal[0][0])


def test_a_huge_window_is_dropped_from_the_paged_call():
    q, kc, vc, args = _kvcache()
    kv = kvcache_call(q, kc, vc, **args, window_size=(2**63 - 1, 2**63 - 1))
    rel: Any = kv.call.relation
    assert rel.window is None  # the same call as the unwindowed one


# -- reproducer 2: a (1, 2**20) block table padded with -1, one token read ----------------------
def test_a_wide_table_is_sized_from_the_blocks_read():
    rng = np.random.default_rng(1)
    pages = rng.standard_normal((4, 16, 2, 8))
    q = rng.standard_normal((1, 1, 4, 8))
    table = np.full((1, 2**20), -1, np.int32)  # 4 MiB of input
    table[0, 0] = 3
    lens = np.array([1], np.int32)
    out, peak = _peak(flash_attn_with_kvcache, q, pages, pages, cache_seqlens=lens,
                      block_table=table)
    assert peak < 16 * MiB, peak  # the unfixed call grew to 18.9 GB
    assert np.array_equal(out[0, 0], pages[3, 0, [0, 0, 1, 1]])  # one key: its value
    kv = kvcache_call(q, pages, pages, cache_seqlens=lens, block_table=table)
    assert kv.call.axes["K"] == 16 and kv.paged.block_table.shape == (1, 1)
    pc = refattn.call.paged_call(q.transpose(0, 2, 1, 3), pages, pages, table, lens, 16)
    assert pc.call.axes["K"] == 16 and pc.paged.K == 16


def test_a_contiguous_cache_is_sized_from_the_tokens_read():
    rng = np.random.default_rng(2)
    cache = rng.standard_normal((2, 4096, 1, 4))
    q = rng.standard_normal((2, 1, 1, 4))
    kv = kvcache_call(q, cache, cache, cache_seqlens=3)
    assert kv.call.axes["K"] == 3
    full = flash_attn_with_kvcache(q, cache[:, :3], cache[:, :3])
    assert np.array_equal(flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3), full)


def test_a_call_that_reads_more_than_memory_holds_is_refused_before_allocating(monkeypatch):
    """Every block may be read (a shared page 2**20 times: 2**24 tokens): the estimate is
    checked against the memory available before anything is gathered."""
    import refattn.engine.memory

    monkeypatch.setattr(refattn.engine.memory, "available_bytes", lambda: 2**30)
    pages = np.zeros((1, 16, 8, 128))
    q = np.zeros((1, 1, 8, 128))
    table = np.zeros((1, 2**20), np.int32)
    with pytest.raises(RefAttnError, match=r"memory: flash_attn_with_kvcache over \(batch_size, "
                                           r"nheads_k, tokens read\) = \(1, 8, 16777216\) needs "
                                           r"about \d+ bytes"):
        _peak(flash_attn_with_kvcache, q, pages, pages, cache_seqlens=2**24, block_table=table)
    lens = np.array([2**24])
    with pytest.raises(RefAttnError, match=r"memory: the paged call of \(B, Hkv, K\) = "
                                           r"\(1, 8, 16777216\) keys needs about"):
        refattn.call.paged_call(q.transpose(0, 2, 1, 3), pages, pages, table, lens, 16,
                                shared_pages=True)
    paged = refattn.call.PagedKV(pages, pages, table, lens, 16, shared_pages=True)
    with pytest.raises(RefAttnError, match=r"memory: gathering \(B, K\) = \(1, 16777216\)"):
        paged.keys()


# -- reproducer 3: cache_seqlens and window_size beyond int64 -----------------------------------
@pytest.mark.parametrize(("kw", "message"), [
    ({"cache_seqlens": 2**70}, r"cache_seqlens: 2\*\*70 is outside the allowed range \[1, 12\]"),
    ({"cache_seqlens": np.uint64(2**64 - 1)},
     r"cache_seqlens: 2\*\*64 - 1 is outside the allowed range \[1, 12\]"),
    ({"cache_seqlens": 0}, r"cache_seqlens: 0 is outside the allowed range \[1, 12\]"),
    ({"window_size": (2**70, 2**70)},
     r"window_size\[0\]: 2\*\*70 is outside the allowed range \[-2\*\*63, 2\*\*63 - 1\]"),
    ({"window_size": (0, -(2**63) - 1)},
     r"window_size\[1\]: -9223372036854775809 is outside the allowed range"),
    ({"window_size": (True, 0)}, r"window_size\[0\]: expected an integer .*, got True"),
    ({"softcap": 10**400}, r"softcap: expected a finite real number, got an integer of 1329 "
                           r"bits"),
    ({"softcap": float("inf")}, r"softcap: expected a finite real number, got inf"),
    ({"softmax_scale": 0.0}, r"softmax_scale: 0.0 is outside the allowed range \(0.0, inf\]"),
    ({"softmax_scale": 10**400}, r"softmax_scale: expected a finite real number or None, got "
                                 r"an integer of 1329 bits"),
    ({"alibi_slopes": np.full(4, np.inf)}, r"alibi_slopes: non-finite value inf at index \(0\)"),
    ({"alibi_slopes": np.full(4, 1e300)}, r"alibi_slopes: entry \(0\) is 1e\+300, beyond "
                                          r"float32's range"),
    ({"cache_batch_idx": np.zeros(2, np.int32)}, r"cache_leftpad / cache_batch_idx: not with "
                                                 r"a block_table"),
])
def test_scalar_arguments_out_of_range_name_the_field(kw, message):
    q, kc, vc, args = _kvcache()
    if "cache_seqlens" in kw:
        args.pop("cache_seqlens")
    with pytest.raises(RefAttnError, match=message):
        flash_attn_with_kvcache(q, kc, vc, **{**args, **kw})


def test_an_integer_cache_seqlens_of_any_integer_type_is_the_same_call():
    q, kc, vc, args = _kvcache(lens=(12, 12))
    table = args["block_table"]
    want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=12, block_table=table)
    for n in (np.int64(12), np.uint64(12), np.array([12, 12], np.int32)):
        assert np.array_equal(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n,
                                                      block_table=table), want)


# -- reproducer 4: quantisation blocks ------------------------------------------------------------
def test_a_quant_block_beyond_int64_is_refused_by_name():
    from refattn.quant.spec import QuantSpec, TensorQuant

    with pytest.raises(RefAttnError, match=r"block: 2\*\*100 is outside the allowed range "
                                           r"\[1, 2\*\*63 - 1\]"):
        TensorQuant("int8", None, "token_block", "half_away_from_zero", "cast", block=2**100)
    with pytest.raises(RefAttnError, match=r"block: expected an integer below 2\*\*128 in "
                                           r"magnitude or None, got 64.0"):
        TensorQuant("int8", None, "token_block", "half_away_from_zero", "cast",
                    block=64.0)  # type: ignore[arg-type]
    m = refattn.quant.preset("sageattention_int8").to_manifest()
    m["q"]["block"] = 10**400
    with pytest.raises(RefAttnError, match=r"quant.q.block: an integer of 1329 bits"):
        QuantSpec.from_manifest(m)
    for field, value, message in (("kv_tile", 2**70, r"quant.kv_tile: 2\*\*70 is outside"),
                                  ("mma_bits", True, r"quant.mma_bits: expected an integer"),
                                  ("mma_bits", 54, r"quant.mma_bits: 54 is outside the allowed "
                                                   r"range \[2, 53\]")):
        bad = refattn.quant.preset("sageattention_int8").to_manifest()
        bad[field] = value
        with pytest.raises(RefAttnError, match=message):
            QuantSpec.from_manifest(bad)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("p_offset", 65.0, r"p_offset: 65.0 is outside the allowed range \[0.0, 64.0\]"),
    ("p_multiplier", 0.0, r"p_multiplier: 0.0 is outside the allowed range \(0.0, 2\*\*128\]"),
    ("exp2_ulp", float("nan"), r"exp2_ulp: expected a finite real number, got nan"),
    ("log2e", 10**400, r"log2e: expected a finite real number, got an integer of 1329 bits"),
    ("kv_tile", 2**64, r"kv_tile: 2\*\*64 is outside the allowed range"),
    ("mma_bits", 24.0, r"mma_bits: expected an integer below 2\*\*128 in magnitude, got 24.0"),
])
def test_quant_spec_fields_are_bounded(field, value, message):
    with pytest.raises(RefAttnError, match=message):
        refattn.quant.preset("fa3_fp8").replace(**{field: value})


def test_a_quant_scale_beyond_float_is_refused_by_name():
    from refattn.quant.spec import TensorQuant

    with pytest.raises(RefAttnError, match=r"scale: expected an array .* or None, got an "
                                           r"integer of 1329 bits"):
        TensorQuant("int8", 10**400, "tensor", "half_away_from_zero",  # type: ignore[arg-type]
                    "codes")
    with pytest.raises(RefAttnError, match=r"q_descale: an integer of 1329 bits"):
        refattn.quant.preset("fa3_fp8", q_descale=10**400)


def test_a_block_at_or_beyond_the_axis_is_the_axis():
    """SageAttention's per-block int8 with q's block = the axis, 2**26 or 2**62 tokens: one
    block, the same intervals, and arrays sized from the axis (the unfixed emulation padded
    to the block: 4.16 GB at 2**26, a traceback at 2**62)."""
    from refattn.quant.pipeline import emulate

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 40, 16)).astype(np.float16).astype(np.float64)
    call = refattn.AttentionCall(x, x, x)
    base = refattn.quant.preset("sageattention_int8")

    def with_block(n):
        return base.replace(q=refattn.quant.TensorQuant(
            "int8", None, "token_block", base.q.rounding, "cast", block=n,
            input_format=base.q.input_format))

    want = emulate(call, with_block(40))
    for n in (41, 2**26, 2**62):
        got, peak = _peak(emulate, call, with_block(n))
        assert peak < 64 * MiB, (n, peak)
        for name, iv in want.items():
            assert np.array_equal(got[name].lo, iv.lo) and np.array_equal(got[name].hi, iv.hi)
    assert not np.array_equal(emulate(call, with_block(8))["output"].hi, want["output"].hi)


@pytest.fixture(scope="module")
def sage_bundle(tmp_path_factory) -> Path:
    from refattn.bundle import write_bundle
    from refattn.bundle.suites.conformance import CASES

    out = tmp_path_factory.mktemp("bounds") / "b"
    write_bundle(out, [CASES["quant_sageattention_int8_causal"]()], suite="conformance",
                 progress=False)
    return out


@pytest.mark.parametrize("block", [2**26, 2**62, 10**400])
def test_a_bundle_whose_manifest_sets_a_huge_quant_block(sage_bundle, tmp_path, block):
    """Blocks of 2**26 and 2**62 tokens are one block of the axis: verify passes with little
    memory; 10**400 is beyond the range and is named (it was numpy's TypeError)."""
    from refattn.bundle.verification.verifier import verify

    bundle = tmp_path / "b"
    shutil.copytree(sage_bundle, bundle)
    case = "quant_sageattention_int8_causal"
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["cases"][case]["quant"]["spec"]["q"]["block"] = block
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report, peak = _peak(verify, bundle, gradcheck=False)
    assert peak < 256 * MiB, peak
    if block < 2**63:
        assert report.passed, [p.reason for p in report.all_problems]
    else:
        reasons = [p.reason for p in report.all_problems]
        assert not report.passed and any(
            "manifest quant: quant.q.block: an integer of 1329 bits (about 10**400) is outside "
            "the allowed range [1, 2**63 - 1]" in r for r in reasons), reasons


# -- reproducer 5: sweep SPECs ------------------------------------------------------------------
_BASE = 'name = "t"\n[[grid]]\nshape = [[1, 1, 1, 2, 2, 4, 4]]\n'


@pytest.mark.parametrize(("suffix", "text", "message"), [
    (".toml", _BASE + "seed = [" + "9" * 5000 + "]\n",
     "an integer of more than 4300 digits; every SPEC integer is at most"),
    (".yaml", "name: t\ngrid:\n- shape: [[1, 1, 1, 2, 2, 4, 4]]\n  seed: [" + "9" * 5000
     + "]\n", "an integer of more than 4300 digits; every SPEC integer is at most"),
    (".toml", _BASE + "scale = [1e300]\n",
     "grid/0: scale: 1e+300 is outside the allowed range (0.0, 2**64]"),
    (".toml", _BASE + "seed = [18446744073709551616]\n",
     "grid/0/seed/0: 18446744073709551616 is greater than the maximum"),
    (".toml", _BASE + 'mask = [{ kind = "window", left = 65537 }]\n',
     "grid/0/mask/0/left: 65537 is greater than the maximum of 65536"),
    (".toml", _BASE + 'mask = [{ kind = "key_padding", pad = 100000 }]\n',
     "grid/0/mask/0/pad: 100000 is greater than the maximum of 65536"),
])
def test_a_bad_spec_number_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, suffix,
                                                                  text, message):
    from refattn.cli import main

    if sys.get_int_max_str_digits() == 0 and "digits" in message:
        pytest.skip("this interpreter has no integer-string limit")
    spec = tmp_path / f"s{suffix}"
    spec.write_text(text)
    out = tmp_path / "b"
    assert main(["sweep", str(spec), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.name]  # nothing beside --out


@pytest.mark.parametrize(("fields", "message"), [
    ({"shape": [1, 1, 1, 2, 65537, 4, 4]}, r"shape K: 65537 is outside the allowed range "
                                           r"\[1, 65536\]"),
    ({"shape": [1, 1, 1, 2, True, 4, 4]}, r"shape K: expected an integer"),
    ({"shape": [1, 1, 1, 2, 2, 4]}, r"shape: expected 7 integers"),
    ({"shape": {"B": 1}}, r"shape: missing \['Hq', 'Hkv', 'Q', 'K', 'Dk', 'Dv'\]"),
    ({"seed": 2**64}, r"seed: 2\*\*64 is outside the allowed range \[0, 2\*\*64 - 1\]"),
    ({"seed": -1}, r"seed: -1 is outside"),
    ({"scale": 2.0**64 * (1 + 2**-52)}, r"scale: .* is outside the allowed range "
                                        r"\(0.0, 2\*\*64\]"),
    ({"scale": 10**400}, r"scale: an integer of 1329 bits"),
    ({"mask": {"kind": "window", "left": 2**70}}, r"mask left: 2\*\*70 is outside"),
    ({"mask": {"kind": "window", "left": 1, "causal": "yes"}}, r"mask causal: expected true "
                                                               r"or false"),
    ({"mask": {"kind": "segments", "count": 0}}, r"mask count: 0 is outside"),
    ({"score": {"family": "additive", "da": 2**70}}, r"score da: 2\*\*70 is outside"),
    ({"score": {"family": "cosine", "eps": 0.0}}, r"score eps: 0.0 is outside"),
    ({"dropout": {"p": 1.0, "seed": 1}}, r"dropout p: 1.0 is outside the allowed range "
                                         r"\[0.0, 1.0\)"),
    ({"dropout": {"p": 0.1, "seed": 1, "offset": 2**32}}, r"dropout offset: 2\*\*32 is outside "
                                                          r"the allowed range \[0, 2\*\*32 - 1\]"),
    ({"quant": "fa3_fp8", "quant_scale": 10**400}, r"quant_scale: an integer of 1329 bits"),
])
def test_normalize_bounds_every_number(fields, message):
    """:func:`normalize` bounds what it reads even where no schema ran before it."""
    from refattn.bundle.sweeps.grid import normalize

    with pytest.raises(RefAttnError, match=message):
        normalize({"shape": [1, 1, 1, 2, 2, 4, 4], **fields})


def test_boundary_spec_values_are_accepted_unchanged():
    from refattn.bundle.sweeps.grid import case_id, normalize

    top = normalize({"shape": [1, 1, 1, 2, 2, 4, 4], "scale": 2.0**64, "seed": 2**64 - 1,
                     "dropout": {"p": 0.5, "seed": 2**64 - 1, "offset": 2**32 - 1},
                     "mask": {"kind": "window", "left": 65536, "right": 65536}})
    assert top["scale"] == 2.0**64 and top["seed"] == 2**64 - 1
    # an integral float is the integer it always was (JSON Schema's integer): the same id
    assert case_id(normalize({"shape": [1, 1, 1, 2.0, 2, 4, 4], "seed": 3.0})) == case_id(
        normalize({"shape": [1, 1, 1, 2, 2, 4, 4], "seed": 3}))


def test_a_window_of_the_whole_sequence_is_the_unwindowed_case():
    """A window bound of K (or the schema's maximum) reaches every key: the visibility of the
    mask it equals (lower-right causal; each description draws its own tensors)."""
    from refattn.bundle.sweeps.grid import build_case, normalize

    def visible(mask):
        case = build_case(normalize({"shape": [1, 1, 1, 3, 5, 4, 4], "mask": mask}))
        return case.call.visible_full()

    want = visible("causal_lower_right")
    for left in (4, 5, 65536):
        assert np.array_equal(visible({"kind": "window", "left": left, "causal": True}), want)
    assert not np.array_equal(visible({"kind": "window", "left": 3, "causal": True}), want)


# -- reproducer 6: a ragged list ------------------------------------------------------------------
@pytest.mark.parametrize("ragged", [[[1.0, 2.0], [3.0]], [[[[1.0, 2.0]], [[3.0]]]]])
def test_a_ragged_list_names_the_tensor(ragged):
    with pytest.raises(RefAttnError, match=r"AttentionCall: q: expected an array \(of numbers: "
                                           r"no ragged nested sequence\), got \[\["):
        refattn.AttentionCall(ragged, ragged, ragged)
    x = np.zeros((1, 1, 2, 4))
    with pytest.raises(RefAttnError, match=r"bias: expected an array \(of numbers: no ragged "
                                           r"nested sequence\) or None, got \[\["):
        refattn.AttentionCall(x, x, x, bias=[[0.0, 1.0], [2.0]])  # type: ignore[arg-type]
    with pytest.raises(RefAttnError, match=r"q: a ragged nested sequence"):
        flash_attn_with_kvcache(ragged, np.zeros((1, 2, 1, 4)), np.zeros((1, 2, 1, 4)))


# -- the other integers and floats read from outside ---------------------------------------------
def test_masks_bound_positions_and_window_bounds():
    from refattn.masks import cu_seqlens_from_lengths, relation

    pos = np.array([[0, 1]])
    with pytest.raises(RefAttnError, match=r"window left: 2\*\*70 is outside the allowed range "
                                           r"\[0, 2\*\*63 - 1\]"):
        relation(pos, pos, window=(2**70, 0))
    assert relation(pos, pos, window=(2**63 - 1, 0)).kernel_arguments().left.tolist() == [
        2**63 - 1]
    with pytest.raises(RefAttnError, match=r"k_pos: entry \(b=0, k=0\) is -4611686018427387905, "
                                           r"expected a value in \[-2\*\*62, 2\*\*62 - 1\]"):
        relation(pos, np.array([[-(2**62) - 1, 0]]), window=(5, 0))
    # the extreme positions' distance, 2**63 - 1, fits: a window of 5 keeps them apart
    far = relation(np.array([[2**62 - 1]]), np.array([[-(2**62)]]), window=(5, 0),
                   key_valid=np.array([[True]]))
    assert not far.dense().any()
    with pytest.raises(RefAttnError, match=r"lengths: they add up to 2\*\*63 tokens"):
        cu_seqlens_from_lengths([2**62, 2**62])


def test_call_scalars_beyond_float_are_named():
    x = np.zeros((1, 1, 2, 4))
    with pytest.raises(RefAttnError, match=r"scale: expected a finite real number or None, got "
                                           r"an integer of 1329 bits"):
        refattn.AttentionCall(x, x, x, scale=10**400)
    with pytest.raises(RefAttnError, match=r"softcap: expected a finite real number or None, "
                                           r"got an integer of 1329 bits"):
        refattn.AttentionCall(x, x, x, softcap=10**400)
    with pytest.raises(RefAttnError, match=r"eps: expected a positive finite zero-norm floor"):
        refattn.call.scores.Cosine(eps=10**400)
    with pytest.raises(RefAttnError, match=r"num_heads: 2\*\*70 is outside the allowed range"):
        refattn.call.bias.alibi_slopes(2**70)
    with pytest.raises(RefAttnError, match=r"q_pos: entry \(0\) is 1152921504606846976, "
                                           r"expected a value in \[-2\*\*53, 2\*\*53\]"):
        refattn.call.bias.alibi(refattn.call.bias.alibi_slopes(2), np.array([2**60]), [0])
    with pytest.raises(RefAttnError, match=r"page_size: expected an integer below 2\*\*128 in "
                                           r"magnitude, got 4.0"):
        refattn.call.PagedKV(np.zeros((2, 4, 1, 2)), np.zeros((2, 4, 1, 2)),
                             np.array([[0]]), np.array([3]), 4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("stride", "message"), [
    ([1.5, 1], r"q.stride\[0\]: expected an integer"),
    ([10**400, 1], r"q.stride\[0\]: an integer of 1329 bits"),
    ("12", r"q.stride: expected a list of element strides, got str"),
])
def test_a_manifest_stride_is_an_integer(stride, message):
    from refattn.bundle.golden.spec import with_strides

    with pytest.raises(RefAttnError, match=message):
        with_strides(np.zeros((2, 3)), stride, "q.stride")
    assert with_strides(np.zeros((2, 3)), [np.int64(1), 2]).strides == (8, 16)


def test_a_manifest_window_is_clamped_before_the_jax_lowering_adds_to_it():
    """A relation window of 2**63 - 1 in a manifest bounds nothing over Q, K = 9: the JAX
    lowering clamps it to max(Q, K) before ``j + left`` (which wrapped in int64), and names a
    bound beyond int64."""
    import copy
    import dataclasses

    from refattn.adapters.jax import call_arguments
    from refattn.bundle.golden.spec import case_spec
    from refattn.bundle.suites.conformance import CASES

    spec = case_spec(CASES["sliding_window_bidirectional"]())

    def with_window(left, right):
        manifest = copy.deepcopy(dict(spec.call_manifest))
        manifest["visibility"]["relation"]["window"].update(left=left, right=right)
        return dataclasses.replace(spec, call_manifest=manifest)

    assert call_arguments(spec, native="auto").local_window_size == (2, 2)
    huge = call_arguments(with_window(2**63 - 1, 2**63 - 1), native="auto")
    assert huge.mask  # (9, 9) does not generate the stored band: the explicit mask, no wrap
    with pytest.raises(RefAttnError, match=r"visibility.relation.window.left: 2\*\*70 is "
                                           r"outside the allowed range"):
        call_arguments(with_window(2**70, 2), native="auto")


def test_page_size_and_max_bytes_are_integers():
    from refattn.adapters.flash_attn import page_size_note
    from refattn.quant.pipeline import check_emulation_memory

    assert page_size_note(np.int64(512)) is None
    with pytest.raises(RefAttnError, match=r"page_size: expected an integer"):
        page_size_note(256.0)  # type: ignore[arg-type]
    x = np.zeros((1, 1, 2, 4))
    with pytest.raises(RefAttnError, match=r"max_bytes: expected an integer"):
        check_emulation_memory(refattn.AttentionCall(x, x, x), max_bytes="1")  # type: ignore
    check_emulation_memory(refattn.AttentionCall(x, x, x), max_bytes=np.int64(2**40))


# -- found by the surface fuzzer (tests/hostile/test_fuzz_surface.py) on its first run ---------
@pytest.mark.parametrize("length", [2**31, 2**62])
def test_lengths_whose_arrays_exceed_the_memory_are_refused_before_allocating(length):
    from refattn.adapters.jax import native_support
    from refattn.masks import causal
    from refattn.masks.packing import unpack

    with pytest.raises(RefAttnError, match="memory: a causal relation"):
        causal(length, length, alignment="upper_left")
    with pytest.raises(RefAttnError, match=r"memory: the \(T, S\)"):
        native_support(length, 4, is_causal=True, window=None)
    with pytest.raises(RefAttnError, match="memory: unpacking"):
        unpack(np.zeros((1, 1, 3, 2)), np.array([0, 1, 3]), length=length)
    with pytest.raises(RefAttnError, match=r"k_len: 2\*\*70 is outside"):
        causal(1, 2**70, alignment="upper_left")
    with pytest.raises(RefAttnError, match="T: -1 is outside"):
        native_support(-1, 4, is_causal=True, window=None)


def test_boundary_lengths_still_give_the_answer():
    from refattn.adapters.jax import native_support
    from refattn.masks import causal
    from refattn.masks.packing import unpack

    assert native_support(0, 3, is_causal=True, window=None).shape == (0, 3)
    assert causal(1, 1, alignment="lower_right").dense().tolist() == [[[[True]]]]
    out = unpack(np.arange(6.0).reshape(1, 1, 3, 2), np.array([0, 1, 3]), length=3)
    assert out.shape == (2, 1, 3, 2) and out[1, 0, :2].ravel().tolist() == [2.0, 3.0, 4.0, 5.0]
    assert not out[0, 0, 1:].any() and not out[1, 0, 2].any()


def test_ragged_positions_are_named():
    from refattn.masks import from_positions

    with pytest.raises(RefAttnError, match="q_pos: a ragged nested sequence"):
        from_positions([[1, 2], [3]], np.arange(4))


def test_flex_device_and_relation_are_checked_before_torch_sees_them():
    torch = pytest.importorskip("torch")
    from refattn.adapters.flex import relation_mask_mod
    from refattn.masks import causal

    rel = causal(2, 3, alignment="lower_right")
    for device in (0, 2**64, float("nan"), [1]):
        with pytest.raises(RefAttnError, match="device: expected a device name"):
            relation_mask_mod(rel, torch, device)
    if not torch.cuda.is_available():
        with pytest.raises(RefAttnError, match="device: 'cuda:7' cannot be used"):
            relation_mask_mod(rel, torch, "cuda:7")
    with pytest.raises(RefAttnError, match=r"relation: expected a refattn\.masks"):
        relation_mask_mod(0, torch)
    with pytest.raises(RefAttnError, match="torch: expected the torch module"):
        relation_mask_mod(rel, np)


# -- the generated CLI / SPEC / manifest fuzz's findings (tests/hostile/cli_surface.py) ---------
@pytest.fixture(scope="module")
def one_case_bundle(tmp_path_factory) -> Path:
    from refattn.bundle import write_bundle
    from refattn.bundle.suites import build_suite

    out = tmp_path_factory.mktemp("fuzz-findings") / "bundle"
    write_bundle(out, build_suite("contract")[1:2], suite="contract", progress=False)
    return out


def _mutated_copy(bundle: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(next(iter(manifest["cases"].values())))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _verify(directory: Path, capsys) -> tuple[int, str]:
    from refattn.cli import main

    code = main(["verify", str(directory), "--no-gradcheck", "--quiet"])
    return code, capsys.readouterr().err


def test_a_manifest_integer_of_5000_digits_is_one_line_exit_2(one_case_bundle, tmp_path,
                                                              capsys):
    """Finding: json.loads raised Python's ValueError (more than 4,300 digits) through
    ``refattn verify``: a traceback."""
    from refattn.bundle.storage.manifest import parse_manifest

    copy = tmp_path / "bundle"
    shutil.copytree(one_case_bundle, copy)
    text = (copy / "manifest.json").read_text()
    (copy / "manifest.json").write_text(text.replace('"schema_version"',
                                                     '"x": ' + "9" * 5000 + ', "schema_version"'))
    code, err = _verify(copy, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "integer literal of 5000 digits" in err
    with pytest.raises(RefAttnError, match="of 4301 digits"):
        parse_manifest(b'{"a": -' + b"1" * 4301 + b"}")
    assert parse_manifest(b'{"a": ' + b"9" * 4300 + b"}") == {"a": 10**4300 - 1}


@pytest.mark.parametrize(("edit", "where"), [
    (lambda e: e["call"]["tensors"]["query"]["shape"].__setitem__(0, True), "shape"),
    (lambda e: e["call"]["dropout"].__setitem__("training", 0), "training"),
    (lambda e: e["call"]["visibility"].__setitem__("all_legal", 0), "all_legal"),
])
def test_verify_compares_the_recorded_call_strictly(one_case_bundle, tmp_path, capsys, edit,
                                                    where):
    """Finding: ``True == 1`` and ``0 == False``: a shape of ``true`` or a flag of ``0``
    passed verify."""
    code, err = _verify(_mutated_copy(one_case_bundle, tmp_path, edit), capsys)
    assert code in (1, 2) and (code == 1 or len(err.strip().splitlines()) == 1)


@pytest.mark.parametrize("key", ["causal_alignment", "window_convention"])
def test_verify_checks_the_alignment_of_a_case_without_a_relation(one_case_bundle, tmp_path,
                                                                  capsys, key):
    """Finding: without a visibility relation these two conventions were never compared, so
    any string passed."""
    copy = _mutated_copy(one_case_bundle, tmp_path,
                         lambda e: e["conventions"].__setitem__(key, "upper_left"))
    code, _ = _verify(copy, capsys)
    assert code == 1

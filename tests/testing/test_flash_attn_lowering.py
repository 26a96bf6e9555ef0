"""case.to_flash_attn() / to_flash_attn_varlen() / to_flash_attn_kvcache(): the arguments of
FlashAttention's documented interface, run through a from-scratch NumPy implementation of that
interface (tests/testing/flash_attn_reference.py, written from its docstrings), match the
golden tensors on every case each entry point accepts, gradients included where the interface
has a backward; refusals are named."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.adapters import flash_attn as fa
from refattn.testing import Case, assert_matches, load_cases

sys.path.insert(0, str(Path(__file__).parent))
import flash_attn_reference as ref

SPECS = load_cases()
BY_NAME = {s.case_id: s for s in SPECS}
RUNS = [(variant, s) for variant in fa.FUNCTIONS for s in SPECS
        if fa.ineligible(s, variant) is None]


def run(call, *, gradients=True, **override):
    fn = getattr(ref, call.function)
    kwargs = {**call.kwargs, **override}
    if call.function == "flash_attn_with_kvcache" or not gradients:
        return call.finish(fn(*call.args, **kwargs))
    result, grads = fn(*call.args, **kwargs, dout=call.grad_output)
    return call.finish(result, grads)


@pytest.mark.parametrize(("variant", "spec"), RUNS, ids=[f"{v}-{s.case_id}" for v, s in RUNS])
def test_the_documented_interface_reproduces_every_case_it_accepts(variant, spec):
    case = Case(spec)
    call = getattr(case, f"to_{variant}")()
    got = run(call)
    if variant != "flash_attn_kvcache":  # "Does not support backward pass"
        assert {"grad_q", "grad_k", "grad_v"} <= set(got)
    # ALiBi travels as slopes: the bias gets no gradient from FlashAttention
    assert_matches(case, got, check="listed" if "bias" in spec.tensors else "auto")


def test_how_many_cases_each_entry_point_accepts():
    counts = {v: sum(r[0] == v for r in RUNS) for v in fa.FUNCTIONS}
    # the 10 quantised cases run as float cases (their dequantised inputs, the real result)
    assert counts == {"flash_attn": 39, "flash_attn_varlen": 45, "flash_attn_kvcache": 42}


@pytest.mark.parametrize(("name", "variant", "why"), [
    ("causal_upper_left_q3_k7", "flash_attn", "visibility is not one window band"),
    ("bias_full", "flash_attn", "bias tensor"),
    ("sink_per_head", "flash_attn", "sink logit"),
    ("dropout_philox", "flash_attn_varlen", "dropout"),
    ("dk16_dv3", "flash_attn", "Dk != Dv"),
    ("gqa_explicit_head_map", "flash_attn", "explicit head map"),
    ("prefix_lm_4_of_8", "flash_attn_varlen", "one window band per packed sequence"),
    ("paged_kv_decode", "flash_attn_kvcache", "Dk != Dv"),
])
def test_refusals_name_the_reason(name, variant, why):
    case = Case(BY_NAME[name])
    assert why in case.not_expressible(variant)
    with pytest.raises(RefAttnError, match=f"{name}: flash_attn.* cannot express this case"):
        getattr(case, f"to_{variant}")()


def test_the_arguments_of_the_documented_interface():
    c = Case(BY_NAME["causal_lower_right_q3_k7"]).to_flash_attn()
    assert c.function == "flash_attn_func" and c.kwargs["causal"] is True
    assert c.kwargs["softmax_scale"] is None  # the kernel's default 1/sqrt(headdim) is tested
    assert set(c.kwargs) == {"dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                             "alibi_slopes", "deterministic", "return_attn_probs"}
    w = Case(BY_NAME["sliding_window_causal_incl3"]).to_flash_attn()
    assert (w.kwargs["causal"], w.kwargs["window_size"]) == (False, (2, 0))
    a = Case(BY_NAME["alibi_per_batch_slopes"]).to_flash_attn()
    assert a.kwargs["alibi_slopes"].shape == (2, 2) and a.kwargs["alibi_slopes"].dtype == \
        np.float32
    assert Case(BY_NAME["alibi_causal"]).to_flash_attn().kwargs["alibi_slopes"].shape == (4,)
    v = Case(BY_NAME["packed_segments"]).to_flash_attn_varlen()
    assert v.args[0].ndim == 3 and v.args[3].dtype == np.int32
    assert v.args[3][-1] == v.args[0].shape[0] and v.args[4][-1] == v.args[1].shape[0]
    k = Case(BY_NAME["decode_batched_positions"]).to_flash_attn_kvcache()
    assert k.function == "flash_attn_with_kvcache"
    assert k.kwargs["cache_seqlens"].tolist() == [128, 61]
    assert k.kwargs["return_softmax_lse"] is True and k.args[1].shape == (2, 128, 2, 4)


def test_a_wrong_argument_fails():  # the comparison can fail: upper-left vs bottom-right
    case = Case(BY_NAME["causal_lower_right_q3_k7"])
    with pytest.raises(AssertionError, match="output"):
        assert_matches(case, run(case.to_flash_attn(), window_size=(-1, -4), causal=False))
    case = Case(BY_NAME["explicit_scale_0p2"])
    with pytest.raises(AssertionError):
        assert_matches(case, run(case.to_flash_attn(), softmax_scale=None))


# -- paged KV caches: the pages and block table as stored, FlashAttention's paged layout --------
# The conformance suite's one paged case (paged_kv_decode) has Dk != Dv, which
# flash_attn_with_kvcache cannot take; these paged golden cases (Dk == Dv) are built here and
# generated by the exact generator like any golden case.
def _paged_case(case_id, table, lens, page, Hq, Hkv, Q, D, *, seed, alibi=None, **kw):
    from refattn.bundle.golden.case import GoldenCase
    from refattn.bundle.golden.spec import case_spec
    from refattn.call.paged import paged_call

    rng = np.random.default_rng(seed)
    table, lens = np.array(table), np.array(lens)
    q = rng.standard_normal((len(lens), Hq, Q, D))  # (B, Hq, Q, D)
    num = int(table.max()) + 1
    kp, vp = rng.standard_normal((2, num, page, Hkv, D))  # (num_pages, page, Hkv, D) each
    if alibi is not None:  # FlashAttention's ALiBi: -slope * |position of the query - j|
        pos = lens[:, None] - Q + np.arange(Q)[None, :]  # (B, Q)
        dist = np.abs(pos[:, :, None] - np.arange(table.shape[1] * page))  # (B, Q, K)
        kw["bias"] = -np.asarray(alibi)[None, :, None, None] * dist[:, None]
    pc = paged_call(q, kp, vp, table, lens, page, **kw)
    g_o = rng.standard_normal((len(lens), Hq, Q, D))
    conv = {"causal_alignment": "explicit_positions", **pc.paged.conventions()}
    return case_spec(GoldenCase(case_id, pc.call, g_o, "paged", ("PagedKV",), conv, pc.paged))


PAGED = {
    # paged_kv_decode's table and lengths with Dv = Dk: GQA, 2 decode tokens, pages of 4
    "decode_gqa_p4": lambda: _paged_case("decode_gqa_p4", [[4, 1, 6], [0, 5, -1]], [11, 6],
                                         4, 4, 2, 2, 4, seed=1),
    # a left window, softcap, an explicit scale and per-head ALiBi, pages of 2
    "window_softcap_alibi_p2": lambda: _paged_case(
        "window_softcap_alibi_p2", [[3, 0, 5, 1], [2, 4, -1, -1]], [7, 3], 2, 2, 1, 3, 4,
        seed=2, window=(2, None), softcap=5.0, scale=0.3, alibi=[0.5, 0.25]),
    # not causal, pages of 256 (what FlashAttention 2's CUDA kernel requires)
    "full_p256": lambda: _paged_case("full_p256", [[1, 0], [2, -1]], [300, 100], 256, 2, 1,
                                     1, 4, seed=3, causal=False),
}


@pytest.fixture(scope="module")
def paged_cases():
    return {name: Case(make()) for name, make in PAGED.items()}


@pytest.mark.parametrize("name", list(PAGED))
def test_a_paged_case_lowers_to_its_pages_and_block_table(paged_cases, name):
    case = paged_cases[name]
    assert case.not_expressible("flash_attn_kvcache") is None
    call = case.to_flash_attn_kvcache()
    t = case.spec.tensors
    kc, vc = call.args[1:3]
    assert kc.shape == t["k_pages"].shape and vc.shape == t["v_pages"].shape  # as stored
    assert call.kwargs["block_table"].dtype == np.int32
    assert call.kwargs["block_table"].tolist() == np.asarray(t["block_table"]).tolist()
    assert call.kwargs["cache_seqlens"].dtype == np.int32
    assert call.kwargs["cache_seqlens"].tolist() == np.asarray(t["seqlens"]).tolist()
    assert (call.notes == ()) == (kc.shape[1] % 256 == 0)  # FA2's CUDA kernel: multiples of 256
    got = run(call)
    assert set(got) == {"output", "lse"}
    assert_matches(case, got, check="listed")


def test_the_paged_arguments(paged_cases):
    c = paged_cases["window_softcap_alibi_p2"].to_flash_attn_kvcache()
    assert (c.kwargs["causal"], c.kwargs["window_size"]) == (False, (2, 0))
    assert (c.kwargs["softcap"], c.kwargs["softmax_scale"]) == (5.0, 0.3)
    assert c.kwargs["alibi_slopes"].tolist() == [0.5, 0.25]
    assert "page_block_size=2" in c.notes[0] and "256" in c.notes[0]
    f = paged_cases["full_p256"].to_flash_attn_kvcache()
    assert (f.kwargs["causal"], f.kwargs["window_size"]) == (False, (-1, -1))


# swapping two whole pages a query sees entirely changes nothing (softmax is order-blind): the
# swaps planted here move keys across the cache length or the window, or under ALiBi
@pytest.mark.parametrize(("name", "blocks"), [("decode_gqa_p4", [1, 2]),
                                              ("window_softcap_alibi_p2", [0, 1]),
                                              ("window_softcap_alibi_p2", [2, 3])])
def test_a_swapped_page_fails(paged_cases, name, blocks):
    case = paged_cases[name]
    call = case.to_flash_attn_kvcache()
    table = call.kwargs["block_table"].copy()
    table[0, blocks] = table[0, blocks[::-1]]
    with pytest.raises(AssertionError, match="output"):
        assert_matches(case, run(call, block_table=table))


def test_the_reference_reads_pages_through_the_table():  # independent of the lowering
    rng = np.random.default_rng(4)
    pages = rng.standard_normal((3, 2, 1, 4))
    q = rng.standard_normal((1, 1, 2, 4))
    lens = np.array([5], np.int32)
    paged = ref.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, causal=True,
                                        block_table=np.array([[2, 0, 1]], np.int32))
    flat = np.concatenate([pages[2], pages[0], pages[1]])[None]  # (1, 6, 1, 4)
    assert np.array_equal(paged, ref.flash_attn_with_kvcache(q, flat, flat, causal=True,
                                                             cache_seqlens=lens))


def test_torch_arguments_for_the_real_kernels():
    torch = pytest.importorskip("torch")
    c = Case(BY_NAME["alibi_per_batch_slopes"]).to_flash_attn_varlen()
    args, kwargs = c.torch_arguments(device="cpu", dtype=torch.float16)
    assert args[0].dtype == torch.float16 and args[0].shape == c.args[0].shape
    assert args[3].dtype == torch.int32 and args[5:] == c.args[5:]
    assert kwargs["alibi_slopes"].dtype == torch.float32  # "fp32", as documented
    assert kwargs["window_size"] == c.kwargs["window_size"]

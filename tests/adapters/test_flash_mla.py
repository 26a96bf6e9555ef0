"""FlashMLA's interface (refattn/adapters/flash_mla.py) and the MLA suite's goldens.

The expected values come from a plain loop written here from FlashMLA's own test reference
(deepseek-ai/FlashMLA tests/test_flash_mla_dense_decoding.py ``reference_torch``, commit
9241ae3): per sequence, the first cache_seqlens[b] tokens gathered through the block table,
NaN in unread slots zeroed, ``tril(diagonal=s_k - s_q)`` when causal, lse by logsumexp, output
0 and lse +inf on a query without a key.
"""

from __future__ import annotations

import numpy as np
import pytest

from refattn.adapters.flash_mla import (
    MlaSchedMeta,
    flash_mla_with_kvcache,
    get_mla_metadata,
    ineligible,
    to_flash_mla,
)
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites import mla as suite
from refattn.bundle.suites.conformance import CASES as CONFORMANCE
from refattn.errors import RefAttnError
from refattn.testing.case import Case

RNG = np.random.default_rng(576)
PAD = 2147480000  # FlashMLA's test pads block_table past a sequence's blocks with this


def reference_torch(cache_seqlens, block_table, q, blocked_k, dv, is_causal, scale=None):
    """FlashMLA's reference in float64 NumPy: q (b, s_q, h_q, d), blocked_k (n, 64, h_kv, d)."""
    b, s_q, h_q, d = q.shape
    block_size, h_kv = blocked_k.shape[1], blocked_k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = np.zeros((b, s_q, h_q, dv))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        cur_len = int(cache_seqlens[i])
        blocks = block_table[i][: -(-cur_len // block_size)]
        kv = blocked_k[blocks].reshape(-1, h_kv, d)[:cur_len].copy()  # (s_k, h_kv, d)
        kv[kv != kv] = 0.0
        s_k = kv.shape[0]
        for h in range(h_q):
            k = kv[:, h // (h_q // h_kv)]  # (s_k, d)
            for r in range(s_q):
                keys = [j for j in range(s_k) if not is_causal or j <= r + s_k - s_q]
                if not keys:
                    continue
                s = np.array([q[i, r, h] @ k[j] for j in keys]) * scale
                m = s.max()
                lse[i, h, r] = m + np.log(np.exp(s - m).sum())
                out[i, r, h] = np.exp(s - lse[i, h, r]) @ k[keys, :dv]
    return out, lse


def generate(b, s_q, lens, h_q, h_kv=1, d=576, block=64, seed=0):
    """FlashMLA's generate_test_data: shuffled blocks, NaN past each sequence's tokens."""
    rng = np.random.default_rng(seed)
    per = max(1, -(-max(lens) // block))
    table = rng.permutation(b * per).reshape(b, per).astype(np.int32)
    q = np.clip(rng.standard_normal((b, s_q, h_q, d)) / 10, -1, 1)
    blocked_k = np.clip(rng.standard_normal((b * per, block, h_kv, d)) / 10, -1, 1)
    for i, n in enumerate(lens):
        used = -(-n // block)
        blocked_k[table[i][used:]] = np.nan
        if n % block:
            blocked_k[table[i][used - 1], n % block:] = np.nan
        table[i][used:] = PAD
    return np.array(lens, np.int32), q, table, blocked_k


@pytest.mark.parametrize("s_q, causal", [(1, False), (2, True), (4, True), (2, False)])
def test_matches_flashmla_reference_varlen_with_zero_length_cache(s_q, causal):
    lens, q, table, k = generate(3, s_q, [130, 0, 3], h_q=16)
    meta, splits = get_mla_metadata(lens, s_q * 16, 1)
    out, lse = flash_mla_with_kvcache(q, k, table, lens, 512, meta, splits, causal=causal)
    ref_out, ref_lse = reference_torch(lens, table, q, k, 512, causal)
    assert out.shape == (3, s_q, 16, 512) and lse.shape == (3, 16, s_q)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)
    assert (out[1] == 0).all() and np.isposinf(lse[1]).all()  # the zero-length cache


def test_numpy_backend_gqa_and_explicit_scale():
    lens, q, table, k = generate(2, 2, [70, 5], h_q=6, h_kv=2, d=24, block=64, seed=1)
    out, lse = flash_mla_with_kvcache(q, k, table, lens, 16, None, None, softmax_scale=0.3,
                                      causal=True, backend="numpy")
    ref_out, ref_lse = reference_torch(lens, table, q, k, 16, True, scale=0.3)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-13)


def test_default_scale_is_head_dim_inverse_sqrt_and_every_cache_may_be_empty():
    lens, q, table, k = generate(2, 1, [40, 9], h_q=4, d=32, seed=2)
    a = flash_mla_with_kvcache(q, k, table, lens, 16, None)
    b = flash_mla_with_kvcache(q, k, table, lens, 16, None, softmax_scale=32 ** -0.5)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    out, lse = flash_mla_with_kvcache(q, k, table, np.zeros(2, np.int32), 16, None)
    assert (out == 0).all() and np.isposinf(lse).all()


def test_metadata_shim_old_and_new_interfaces():
    meta, splits = get_mla_metadata()
    assert isinstance(meta, MlaSchedMeta) and splits is None
    lens, q, table, k = generate(1, 1, [5], h_q=2, d=8, seed=3)
    # the first version's num_splits tensor is accepted and ignored
    a = flash_mla_with_kvcache(q, k, table, lens, 4, np.zeros((1, 8), np.int32),
                               np.zeros(2, np.int32))
    b = flash_mla_with_kvcache(q, k, table, lens, 4, meta, None)
    assert np.array_equal(a[0], b[0])


def test_the_callers_arrays_are_not_modified():
    lens, q, table, k = generate(2, 2, [70, 0], h_q=2, d=8, seed=4)
    before = [x.copy() for x in (lens, q, table, k)]
    flash_mla_with_kvcache(q, k, table, lens, 4, None, causal=True)
    for x, y in zip((lens, q, table, k), before, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kwargs, match", [
    ({"indices": np.zeros((1, 1, 4), np.int32)}, "indices: sparse decoding"),
    ({"is_fp8_kvcache": True}, "is_fp8_kvcache: an FP8 cache"),
    ({"attn_sink": np.zeros(2, np.float32)}, "attn_sink"),
    ({"extra_k_cache": np.zeros((1, 64, 1, 8))}, "extra_k_cache"),
    ({"topk_length": np.zeros(1, np.int32)}, "topk_length"),
    ({"softmax_scale": -1.0}, "softmax_scale"),
    ({"causal": "yes"}, "causal: expected True or False"),
])
def test_refused_arguments(kwargs, match):
    lens, q, table, k = generate(1, 1, [5], h_q=2, d=8, seed=5)
    with pytest.raises(RefAttnError, match=match):
        flash_mla_with_kvcache(q, k, table, lens, 4, None, **kwargs)


def test_bad_inputs_name_the_tensor_the_index_and_the_limit():
    lens, q, table, k = generate(2, 1, [70, 3], h_q=2, d=8, seed=6)
    with pytest.raises(RefAttnError) as exc:
        flash_mla_with_kvcache(q, k, table, lens, 9, None)
    msg = str(exc.value)
    assert msg.startswith("head_dim_v: 9") and "k_cache" in msg and "axis 3" in msg
    assert "head_dim = 8" in msg
    with pytest.raises(RefAttnError, match="q: expected dtype float64"):
        flash_mla_with_kvcache(q.astype(np.float32), k, table, lens, 4, None)
    with pytest.raises(RefAttnError, match="k_cache: expected dtype float64"):
        flash_mla_with_kvcache(q, k.astype(np.float16), table, lens, 4, None)
    with pytest.raises(RefAttnError, match="block_table: expected dtype int32"):
        flash_mla_with_kvcache(q, k, table.astype(np.int64), lens, 4, None)
    with pytest.raises(RefAttnError, match="cache_seqlens: required"):
        flash_mla_with_kvcache(q, k, table, None, 4, None)
    with pytest.raises(RefAttnError, match=r"cache_seqlens: entry b=1 is 999, expected 0 <="):
        flash_mla_with_kvcache(q, k, table, np.array([70, 999], np.int32), 4, None)
    bad_table = table.copy()
    bad_table[1, 0] = 77
    with pytest.raises(RefAttnError, match=r"block_table: entry \(b=1, p=0\) is 77"):
        flash_mla_with_kvcache(q, k, bad_table, lens, 4, None)
    nan_k = k.copy()
    nan_k[table[1, 0], 2, 0, 5] = np.nan  # slot 2 of sequence 1's block: read (3 tokens)
    with pytest.raises(RefAttnError, match=r"k_cache: entry \(\d+, 2, 0, 5\) is nan, in a slot"):
        flash_mla_with_kvcache(q, nan_k, table, lens, 4, None)
    with pytest.raises(RefAttnError, match=r"k_cache: head_dim 8 .* must equal q's head_dim 6"):
        flash_mla_with_kvcache(q[..., :6], k, table, lens, 4, None)
    with pytest.raises(RefAttnError, match="num_heads_q=3 must be a multiple"):
        flash_mla_with_kvcache(np.zeros((2, 1, 3, 8)), np.repeat(k, 2, axis=2), table, lens, 4,
                               None)


# -- goldens: the suite, its lowering and a bundle -------------------------------------------
@pytest.fixture(scope="module")
def specs():
    return {c.case_id: case_spec(c, backend="numba") for c in suite.cases()}


def test_suite_covers_flashmla_shapes(specs):
    heads = {s.axes["Hq"] for s in specs.values()}
    assert heads == {16, 32, 64, 128}
    assert {s.axes["Q"] for s in specs.values()} == {1, 2, 4}
    assert all(s.axes["Dk"] == 576 and s.axes["Dv"] == 512 and s.axes["Hkv"] == 1
               for s in specs.values())
    lens = [x for s in specs.values() if "seqlens" in s.tensors for x in s.tensors["seqlens"]]
    assert 0 in lens
    forms = {s.conventions["mla_form"] for s in specs.values()}
    assert forms == {"paged", "dense", "absorbed"}


def test_to_flash_mla_arguments_reproduce_every_golden(specs):
    for case_id, spec in specs.items():
        assert ineligible(spec) is None, case_id
        c = to_flash_mla(spec)
        out, lse = flash_mla_with_kvcache(*c.args, **c.kwargs)
        want_out, want_lse = c.expected(spec)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13, err_msg=case_id)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-13, err_msg=case_id)
    causal = to_flash_mla(specs["mla_h32_sq2_causal_short"]).kwargs
    assert causal == {"softmax_scale": None, "causal": True}
    absorbed = to_flash_mla(specs["mla_absorbed_h16_sq2"])
    assert absorbed.kwargs == {"softmax_scale": 192 ** -0.5, "causal": True}
    assert absorbed.args[1].shape == (4, 64, 1, 576)  # 100 keys cut into 2 pages of 64 each


def test_ineligible_cases_name_why():
    spec = case_spec(CONFORMANCE["causal_square"]())
    assert "V is not the first Dv columns of K" in ineligible(spec)
    with pytest.raises(RefAttnError, match="flash_mla_with_kvcache cannot express"):
        to_flash_mla(spec)


def test_bundle_writes_verifies_and_its_cases_lower(tmp_path):
    from refattn.bundle.verification.verifier import verify
    from refattn.bundle.writing.write import write_bundle
    from refattn.testing.case import load_cases

    out = tmp_path / "mla"
    chosen = [suite.build_case("mla_h16_sq2_causal_page64_tiny"),
              suite.build_case("mla_absorbed_h16_sq2")]
    write_bundle(out, chosen, suite="mla", backend="numba")
    report = verify(out)
    assert not report.problems and all(not c.problems for c in report.cases), report
    for spec in load_cases(out):
        case = Case(spec)
        c = case.to_flash_mla()
        got = flash_mla_with_kvcache(*c.args, **c.kwargs)
        want = c.expected(case.spec)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-13)
        stored = case.spec.tensors
        assert ("grad_kv_latent_pages" in stored) or ("grad_kv_c" in stored)



def test_verify_catches_a_value_path_dropped_from_the_stored_page_gradient(tmp_path):
    """A planted bug in the stored layout gradient: the value path dropped from the pages'
    gradient, every checksum re-sealed; only the recomputation through the layout reader
    (refattn/bundle/golden/layouts.py READERS["mla_latent"]) can tell."""
    from types import SimpleNamespace

    from refattn.bundle.golden.layouts import read_layout
    from refattn.bundle.verification.verifier import verify
    from refattn.bundle.writing.write import write_bundle
    from refattn.testing.case import load_cases
    from tests.bundle.resealing import reseal_case

    out = tmp_path / "mla"
    write_bundle(out, [suite.build_case("mla_h16_sq2_causal_page64_tiny")], suite="mla",
                 backend="numba")
    (tiny,) = load_cases(out)
    layout = read_layout(tiny.tensors, tiny.conventions, tiny.case_id)
    key_only = layout.page_gradient(SimpleNamespace(
        grad_k=tiny.tensors["grad_k"], grad_v=np.zeros_like(tiny.tensors["grad_v"])))
    assert not np.allclose(key_only, tiny.tensors["grad_kv_latent_pages"])
    reseal_case(out, tiny.case_id, lambda t: t.update(grad_kv_latent_pages=key_only))
    report = verify(out, gradcheck=False)
    assert {p.tensor for p in report.all_problems} == {"grad_kv_latent_pages"}, report


def test_lowering_rounds_the_floats_once_to_the_runs_dtype(specs):
    spec = specs["mla_h16_sq2_causal_page64_tiny"]
    c = Case(spec, "bfloat16").to_flash_mla()
    assert str(c.args[0].dtype) == "bfloat16" and str(c.args[1].dtype) == "bfloat16"
    assert c.args[2].dtype == np.int32 and c.args[3].dtype == np.int32
    assert c.dtype == "bfloat16"
    with pytest.raises(RefAttnError, match="q: expected dtype float64"):
        flash_mla_with_kvcache(*c.args, **c.kwargs)  # the reference computes in float64

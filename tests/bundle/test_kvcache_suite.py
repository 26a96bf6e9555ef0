"""The kvcache suite (refattn.bundle.suites.kvcache): every case builds, its layout maps the
canonical gradients back onto the inputs as given (checked here against central differences
of the whole map: inputs as given -> rotated call -> output), and a few cases write a bundle
that ``verify`` passes, with the layout rebuilt from the file by its reader.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import gradcheck
import refattn
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites.kvcache import CASES, cases
from refattn.bundle.verification.verifier import verify
from refattn.bundle.writing.write import write_bundle
from refattn.call.kvcache import KVCacheAppend


def test_every_case_builds_and_covers_the_matrix():
    built = cases()
    assert len(built) == len(CASES) >= 8
    flags = {f for c in built for f in c.flags}
    assert {"RotaryHalfSplit", "RotaryInterleaved", "PartialRotary", "Append", "Leftpad",
            "BatchIdx", "Paged", "Causal", "Local", "GQA", "MQA", "MHA", "YaRN"} <= flags
    for c in built:
        assert c.conventions["kv_layout"] == "kvcache_append"
        assert c.call.axes["Dk"] in (64, 128)
        assert c.call.query_valid is None  # every query row sees a key
        kc, _ = c.layout.updated_caches()
        assert not np.array_equal(kc, c.layout.k_cache)  # the append wrote something


def _as_given(layout: KVCacheAppend, case, **change):
    """out = the canonical call's forward from the inputs as given (some replaced)."""
    fields = {n: getattr(layout, n) for n in (
        "q", "k_cache", "v_cache", "cache_seqlens", "k", "v", "rotary_cos", "rotary_sin",
        "rotary_interleaved", "cache_leftpad", "cache_batch_idx", "block_table",
        "rotate_q_per_token")}
    fields.update(change)
    conv = case.conventions
    window = None if conv["kvcache_window"] == "none" else tuple(
        None if w < 0 else w for w in conv["kvcache_window"])
    call = KVCacheAppend(**fields).call(causal=conv["kvcache_causal"], window=window)
    return refattn.forward(call).output


@pytest.mark.parametrize("case_id", ["kvcache_leftpad_neox_d64_append3",
                                     "kvcache_batch_idx_gptj_d64",
                                     "kvcache_paged4_gptj_d128_local"])
def test_layout_gradients_pass_central_differences(case_id):
    case = CASES[case_id]()
    layout = case.layout
    grads = refattn.backward(refattn.forward(case.call), case.grad_output)
    mapped = layout.gradient_tensors(grads)
    names = {"q": "grad_kvcache_q", "k": "grad_kvcache_k", "v": "grad_kvcache_v",
             "k_cache": "grad_kvcache_k_cache", "v_cache": "grad_kvcache_v_cache"}

    def fn(**x):
        return _as_given(layout, case, **x)

    def vjp(g, **x):  # the layout's map of the canonical gradients for cotangent g
        got = layout.gradient_tensors(refattn.backward(refattn.forward(case.call), g))
        return {n: got[names[n]] for n in x}

    inputs = {n: np.array(getattr(layout, n)) for n in names}
    report = gradcheck.check_vjp(fn, vjp, inputs, grad_output=case.grad_output, method="central",
                                 mode="directional", directions=2)
    assert report.passed, report
    # the rows the append overwrites carry no gradient of the old contents
    rows, slots = layout._written()
    assert not mapped["grad_kvcache_k_cache"][rows, slots].any()


@pytest.mark.parametrize("ids", [("kvcache_leftpad_neox_d64_append3",
                                  "kvcache_gptj_d128_partial_not_causal_mqa",
                                  "kvcache_paged4_gptj_d128_local")])
def test_cases_write_a_bundle_that_verifies(ids, tmp_path):
    chosen = [CASES[i]() for i in ids]
    out = tmp_path / "kv"
    write_bundle(out, chosen, suite="kvcache", backend="exact", progress=False)
    report = verify(out, gradcheck=False, progress=False)
    assert report.passed, report.format()
    for case in chosen:  # the layout rebuilt from the file by its reader
        spec = case_spec(out / "cases" / f"{case.case_id}.safetensors")
        layout = spec.input_layout()
        assert isinstance(layout, KVCacheAppend)
        kc, _ = layout.updated_caches()
        assert np.array_equal(kc, spec.tensors["kvcache_k_cache_updated"])
        assert np.array_equal(spec.tensors["kvcache_q"], case.layout.q)
        stored = SimpleNamespace(**{n: spec.tensors[n] for n in ("grad_q", "grad_k", "grad_v")})
        mapped = layout.gradient_tensors(stored)  # the stored canonical gradients, mapped
        for name, value in mapped.items():
            assert np.array_equal(spec.tensors[name], value), name


def test_the_reader_names_what_a_file_lacks():
    from refattn.bundle.golden.layouts import read_layout
    from refattn.errors import RefAttnError

    case = CASES["kvcache_batch_idx_gptj_d64"]()
    tensors, conv = case.layout.tensors(), case.conventions
    assert isinstance(read_layout(tensors, conv, "c"), KVCacheAppend)
    with pytest.raises(RefAttnError, match="c: a kvcache_append case needs tensor 'kvcache_q'"):
        read_layout({n: t for n, t in tensors.items() if n != "kvcache_q"}, conv, "c")
    with pytest.raises(RefAttnError, match=r"c: conventions\.rotate_q_per_token: expected true"):
        read_layout(tensors, {**conv, "rotate_q_per_token": 1}, "c")
    bad = {**tensors, "kvcache_cache_batch_idx": np.array([3, 3], np.int32)}
    with pytest.raises(RefAttnError, match="c: cache_batch_idx: entries b=0 and b=1 are both 3"):
        read_layout(bad, conv, "c")

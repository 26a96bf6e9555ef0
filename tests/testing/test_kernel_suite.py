"""The kernel suite through the pytest plugin (issue 39, items 1 and 3).

``@cases(Supports(...), suite="kernels")`` runs a framework's attention over the 304 kernel
cases in its own dtype under refattn's low-precision rule: torch's SDPA in float32 and in
bfloat16 (its CPU kernels' own dtype), forward and backward, must pass every case it can
express. The suite's design (every FlashAttention head dim and length pair, the features at
three head dims and three length pairs that no tile divides) and the plugin's bounded memory
are checked here too.
"""

from __future__ import annotations

import numpy as np
import pytest

from refattn.bundle.suites import kernels
from refattn.testing import Case, Supports, assert_matches, cases, load_cases
from refattn.testing.supports import ineligibility

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.torch
@cases(Supports(dtypes=("float32", "bfloat16")), suite="kernels")
def test_torch_sdpa_passes_the_kernel_suite(case):
    sdpa = case.to_torch_sdpa()
    out = sdpa.finish(F.scaled_dot_product_attention(*sdpa.args, **sdpa.kwargs))
    out.backward(sdpa.grad_output)
    assert_matches(case, {"output": out, **sdpa.grads()})


def test_the_design_covers_the_shape_matrix():
    specs = kernels.SPECS
    assert len(specs) >= 300
    dims = {s.shape[5] for s in specs}
    assert set(kernels.HEAD_DIMS) <= dims and {s.shape[5] for s in specs
                                               if s.shape[5] != s.shape[6]}
    pairs = {(s.shape[3], s.shape[4]) for s in specs}
    assert set(kernels.LENGTH_PAIRS) <= pairs
    assert {s.shape[3] for s in specs if s.mask == "cache"} == {1, 2, 3, 4}  # decode Q=1-4
    assert {s.page_size for s in specs if s.mask == "paged"} == {1, 16, 64, 256}
    heads = {(s.shape[1] > s.shape[2], s.shape[2] == 1 < s.shape[1], s.shape[1] == s.shape[2])
             for s in specs}
    assert heads >= {(True, False, False), (True, True, False), (False, False, True)}
    assert any(s.shape[0] > 1 for s in specs) and any(s.shape[1] > 1 for s in specs)

    def untiled(s):  # a length pair that no 64-row tile divides
        return s.shape[3] % 64 or s.shape[4] % 64

    features = {
        "causal_ul": lambda s: s.mask == "causal_ul", "causal_lr": lambda s: s.mask == "causal_lr",
        "window": lambda s: s.window is not None, "alibi": lambda s: s.alibi,
        "softcap": lambda s: s.softcap is not None, "sink": lambda s: s.sink,
        "dropout": lambda s: s.dropout > 0, "key_padding": lambda s: s.mask == "key_padding",
        "varlen": lambda s: s.mask == "varlen", "paged": lambda s: s.mask == "paged",
        "decode": lambda s: s.mask == "cache",
    }
    for name, has in features.items():
        chosen = [s for s in specs if has(s)]
        assert len({s.shape[5] for s in chosen}) >= 3, name
        assert len({(s.shape[3], s.shape[4]) for s in chosen if untiled(s)}) >= 3, name
    for mask in ("causal", "window"):  # both alignments where Q != K
        for alignment in ("ul", "lr"):
            assert any(s.mask.startswith(mask) and s.mask.endswith(alignment)
                       and s.shape[3] != s.shape[4] for s in specs), (mask, alignment)


def test_varlen_cases_hold_empty_and_one_token_sequences():
    for spec in (s for s in kernels.SPECS if s.mask == "varlen"):
        conv = kernels.build(spec).conventions
        lengths = np.diff(conv["cu_seqlens_k"])
        assert 0 in lengths and 1 in lengths, spec.case_id


def test_the_plugin_reads_the_kernel_suite_a_few_cases_at_a_time():
    """Collection builds no output; reading a case computes it; memory holds a few cases."""
    from refattn.bundle.golden.spec import _Regenerated

    specs = load_cases(suite="kernels")
    assert len(specs) == len(kernels.builders()) > len(kernels.SPECS)
    held = _Regenerated._all
    before = len(held)
    reasons = [ineligibility(s, Supports(dtypes=("float32",)), "float32") for s in specs]
    assert len(held) == before  # eligibility reads inputs only
    assert any(r and "softcap" in r for r in reasons) and reasons.count(None) > 200
    for s in specs[:5]:
        assert Case(s, "float32").expected["output"].shape[-1] == s.axes["Dv"]
    assert len(held) <= _Regenerated.KEEP and len(_Regenerated._inputs) <= _Regenerated.KEEP


def test_an_unknown_suite_is_one_clear_error():
    from refattn.errors import RefAttnError

    with pytest.raises(RefAttnError, match="unknown suite 'kernel'; known suites"):
        load_cases(suite="kernel")


def test_a_kernel_case_a_lowering_cannot_express_names_the_field():
    from refattn.errors import RefAttnError

    specs = {s.case_id: s for s in load_cases(suite="kernels")}
    sink = Case(next(s for n, s in specs.items() if n.startswith("sink_")), "float32")
    assert "sink" in sink.not_expressible("torch_sdpa")
    with pytest.raises(RefAttnError, match="sink"):
        sink.to_torch_sdpa()
    window = Case(next(s for n, s in specs.items() if n.startswith("window_lr_q113")),
                  "float32")
    assert window.not_expressible("flash_attn") is None  # a band FlashAttention's window_size
    assert window.window is not None                       # expresses: (left, right)

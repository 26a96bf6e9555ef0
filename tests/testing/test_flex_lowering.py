"""case.to_flex_attention(): every conformance case flex_attention can express runs through
PyTorch's own flex_attention (eager, CPU, forward: PyTorch 2.13 has no CPU backward) and
matches the golden tensors; the mask_mod built from a relation (composed ones included) is the
relation's dense visibility; what it refuses is named."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.adapters import flex
from refattn.testing import Case, Supports, assert_matches, load_cases
from refattn.testing.supports import ineligibility

torch = pytest.importorskip("torch")
flex_attention_module = pytest.importorskip("torch.nn.attention.flex_attention")
flex_attention = flex_attention_module.flex_attention

SPECS = load_cases()
BY_NAME = {s.case_id: s for s in SPECS}
ACCEPTED = [s for s in SPECS if flex.ineligible(s) is None]


def run(f):
    with warnings.catch_warnings():  # eager flex_attention warns that it is not compiled
        warnings.simplefilter("ignore", UserWarning)
        return f.finish(flex_attention(*f.args, **f.kwargs))


@pytest.mark.parametrize("spec", ACCEPTED, ids=[s.case_id for s in ACCEPTED])
def test_flex_attention_forward_matches_every_case_it_accepts(spec):
    case = Case(spec)
    got = run(case.to_flex_attention())
    assert ("lse" in got) == bool(case.query_valid.all())
    assert_matches(case, got)


@pytest.mark.parametrize("name", ["causal_lower_right_q3_k7", "softcap_5",
                                  "alibi_per_batch_slopes", "gqa_explicit_head_map"])
def test_float32_runs_under_the_float32_rule(name):
    case = Case(BY_NAME[name], "float32")
    f = case.to_flex_attention()
    assert all(a.dtype == torch.float32 for a in f.args)
    got = run(f)
    assert got["output"].dtype == np.float32
    assert_matches(case, got)


def test_it_expresses_exactly_dot_scores_without_dropout_or_sinks():
    # an independent statement of the same set: Supports with softcap on and nothing else
    declared = {s.case_id for s in SPECS if ineligibility(s, Supports(softcap=True)) is None}
    assert {s.case_id for s in ACCEPTED} == declared
    assert len(ACCEPTED) >= 50


@pytest.mark.parametrize(("name", "why"), [
    ("dropout_philox", "dropout"), ("sink_per_head", "sink logit"),
    ("score_bilinear_per_head", "score family 'bilinear'")])
def test_refusals_name_the_reason(name, why):
    case = Case(BY_NAME[name])
    assert why in case.not_expressible("flex_attention")
    with pytest.raises(RefAttnError, match=f"{name}: flex_attention cannot express this case"):
        case.to_flex_attention()


def test_mask_mod_from_every_relation_is_its_dense_visibility():
    create_mask = flex_attention_module.create_mask
    composed = 0
    for spec in SPECS:
        if spec.relation() is None or spec.visible_full().all() or flex.ineligible(spec):
            continue
        f = Case(spec).to_flex_attention()
        assert f.mask_source == "relation", spec.case_id
        B, Hq, Q, K = spec.score_shape
        got = create_mask(f.mask_mod, B, Hq, Q, K, device="cpu").numpy()
        assert np.array_equal(got, spec.visible_full()), spec.case_id
        assert f.kwargs["block_mask"].shape == (B, Hq, Q, K)
        composed += hasattr(spec.relation(), "terms")
    assert composed >= 2  # streaming_llm (union) and document_causal (intersection)


def test_score_mod_scale_and_heads():
    f = Case(BY_NAME["softcap_5"]).to_flex_attention()
    assert f.score_mod_terms == ("softcap", "bias") and f.kwargs["scale"] is None
    s = torch.tensor(7.0, dtype=torch.float64)
    z = torch.tensor(0)
    bias = float(BY_NAME["softcap_5"].tensors["bias"][0, 0, 0, 0])
    got = f.kwargs["score_mod"](s, z, z, z, z)
    assert got.item() == pytest.approx(5 * np.tanh(7 / 5) + bias, rel=1e-15)
    assert Case(BY_NAME["explicit_scale_0p2"]).to_flex_attention().kwargs["scale"] == 0.2
    assert Case(BY_NAME["gqa_hq8_hkv2_causal"]).to_flex_attention().kwargs["enable_gqa"]
    g = Case(BY_NAME["gqa_explicit_head_map"]).to_flex_attention()
    assert not g.kwargs["enable_gqa"] and g.args[1].shape[1] == 4  # K/V expanded to Hq
    grads = tuple(torch.ones_like(a) for a in g.args)
    out = g.outputs(torch.zeros(1, 4, 3, 4, dtype=torch.float64), grads=grads)
    counts = np.bincount(g.head_map, minlength=2).astype(float)
    np.testing.assert_array_equal(out["grad_k"][0, :, 0, 0], counts)  # summed back


def test_a_wrong_score_mod_fails():  # the comparison above can fail
    case = Case(BY_NAME["softcap_5"])
    f = case.to_flex_attention()
    f.kwargs["score_mod"] = None  # drop softcap and bias
    with pytest.raises(AssertionError, match="output"):
        assert_matches(case, run(f))


def test_pytorch_has_no_flex_attention_backward_on_cpu():
    # the documented reason the CPU tests are forward only; when PyTorch adds it, this fails
    f = Case(BY_NAME["causal_square"]).to_flex_attention(requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(*f.args, **f.kwargs)

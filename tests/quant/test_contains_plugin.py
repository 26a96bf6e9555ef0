"""``Supports(quantized=...)``: which golden cases a quantised kernel is given.

A quantised case is a case whose spec carries a quantisation record (``spec.quant``, the
manifest's ``{"spec": QuantSpec.to_manifest()}``); ``quantized=True`` or preset names select
those cases, of the named presets, and skip every other case with the reason; the default runs
them as float cases (their dequantised inputs against their real result).
"""

from __future__ import annotations

import dataclasses

import pytest

from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites.conformance import CASES
from refattn.errors import RefAttnError
from refattn.quant.presets import PRESETS, preset
from refattn.testing.supports import Supports, ineligibility, quant_preset


def _with_quant(spec, quant):
    """A conformance case with a quantisation record (the spec's other fields unchanged)."""
    return dataclasses.replace(spec, quant=quant)


@pytest.fixture(scope="module")
def plain():
    return case_spec(CASES["causal_square"]())


def _quantised(plain, name):
    return _with_quant(plain, {"spec": preset(name).to_manifest()})


def test_the_preset_name_is_read_from_the_record(plain):
    assert quant_preset(plain) is None
    for name in PRESETS:
        assert quant_preset(_quantised(plain, name)) == name
    assert quant_preset(_with_quant(plain, {"spec": {"schema": "x"}})) == "custom"


def test_a_float_kernel_runs_quantised_cases_on_their_real_result(plain):
    """The default declaration: a quantised case is a float case too (its dequantised inputs
    against its real result), judged by the other declarations as usual."""
    causal = Supports(masks="causal", causal_alignment="lower_right")
    assert ineligibility(plain, causal) is None
    assert ineligibility(_quantised(plain, "fa3_fp8"), causal) is None
    upper = Supports(masks="causal", causal_alignment="upper_left")
    assert ineligibility(_quantised(plain, "fa3_fp8"), upper) == ineligibility(plain, upper)


def test_a_quantised_kernel_runs_its_presets_only(plain):
    fa3 = Supports(quantized="fa3_fp8", masks="causal", causal_alignment="lower_right")
    assert ineligibility(_quantised(plain, "fa3_fp8"), fa3) is None
    assert ineligibility(plain, fa3) == (
        "needs a float case (Supports.quantized selects the quantised cases only)")
    assert ineligibility(_quantised(plain, "sageattention_int8"), fa3) == (
        "needs the quantised pipeline 'sageattention_int8', not one of ['fa3_fp8'] "
        "(Supports.quantized)")
    every = Supports(quantized=True, masks="causal", causal_alignment="lower_right")
    for name in PRESETS:
        assert ineligibility(_quantised(plain, name), every) is None
    # the other declarations still apply to a quantised case
    no_masks = Supports(quantized=True, masks="none")
    assert "masks='none'" in ineligibility(_quantised(plain, "fa3_fp8"), no_masks)


@pytest.mark.parametrize("bad", [("fa4_fp8",), (), "int8", ["fa3_fp8"], 1])
def test_unknown_presets_are_refused(bad):
    with pytest.raises(RefAttnError, match=r"Supports(\.|: )quantized: expected"):
        Supports(quantized=bad)

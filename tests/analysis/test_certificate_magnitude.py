"""The rounding certificate at hostile magnitudes (issue 25): bounded work, no lost verdicts.

A bundle from a stranger can hold logits of any size. ``exp(s - lse)`` of logits near 1e38 is
about ``2**-1e39``: its correct rounding is simply ``+0.0``, decidable from a crude bound, and the
certificate must neither build that number exactly nor pass a wrong stored value. Expected
verdicts come from the definitions: a 1-ulp edit of a correctly rounded value is not correctly
rounded; ``exp`` of a difference below -746 rounds to +0.0, so a stored 5e-324 is wrong; the
overflow threshold of binary64 is ``2**1024 - 2**970`` (a tie there rounds to infinity).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpmath import iv

import refattn
from refattn.analysis.certificate import _interval_check, certify
from refattn.errors import RefAttnError

SCALES = [1e7, 1e10, 1e30, 8e38, 1e300]


def _call_at(scale: float) -> refattn.AttentionCall:
    """A 2x3 call whose logits are about ``scale``: row 0 ties keys 0 and 1 (probs 1/2, 1/2, 0)."""
    q = np.array([scale, -0.75 * scale]).reshape(1, 1, 2, 1)
    k = np.array([1.0, 1.0, -0.5]).reshape(1, 1, 3, 1)  # scores: exact products, no overflow
    v = np.array([0.3, -1.7, 2.9]).reshape(1, 1, 3, 1)
    return refattn.AttentionCall(q, k, v)


def _tensors(call: refattn.AttentionCall) -> dict[str, np.ndarray]:
    t = refattn.forward(call, backend="exact")
    g = refattn.backward(t, np.array([1.0, -2.0]).reshape(1, 1, 2, 1))
    return {**t.tensors(), **g.tensors()}


def _failed(call: refattn.AttentionCall, tensors: dict[str, np.ndarray], name: str,
            idx: tuple[int, ...], value: float) -> set[str]:
    x = np.array(tensors[name], dtype=np.float64)
    x[idx] = value
    return {c.tensor for c in certify(call, {**tensors, name: x}).failures}


@pytest.fixture(scope="module", params=SCALES, ids=[f"{s:g}" for s in SCALES])
def case(request):
    call = _call_at(request.param)
    return request.param, call, _tensors(call)


def test_the_golden_is_certified_and_has_the_expected_shape(case):
    scale, call, t = case
    assert certify(call, t).passed
    # the definitions at this scale: row 1's lse is its maximum 0.375 scale (the other terms
    # are exp(-1.125 scale) below its half ulp), so its probabilities are exactly one-hot; the
    # other differences s - lse are below -scale < -746, their exp rounds to +0.0
    p = t["probs"][0, 0]
    assert t["lse"][0, 0, 1] == 0.375 * scale
    np.testing.assert_array_equal(p[1], [0.0, 0.0, 1.0])
    assert p[0, 2] == 0.0 and p[0, 0] == p[0, 1] > 0.4  # the tied keys: exp(s - RN(s + log 2))


@pytest.mark.parametrize("name, idx", [
    ("probs", (0, 0, 0, 0)), ("probs", (0, 0, 1, 2)),
    ("lse", (0, 0, 0)), ("lse", (0, 0, 1)),
    ("output", (0, 0, 0, 0)), ("output", (0, 0, 1, 0)),
])
def test_a_one_ulp_edit_is_caught(case, name, idx):
    _, call, t = case
    x = float(t[name][idx])
    for edited in (np.nextafter(x, np.inf), np.nextafter(x, -np.inf)):
        assert name in _failed(call, t, name, idx, float(edited))


@pytest.mark.parametrize("idx", [(0, 0, 0, 2), (0, 0, 1, 0), (0, 0, 1, 1)])
def test_a_planted_value_in_an_underflowed_probability_is_caught(case, idx):
    _, call, t = case
    assert t["probs"][idx] == 0.0  # the correctly rounded exp of a difference below -746
    assert "probs" in _failed(call, t, "probs", idx, 5e-324)


# -- the rounding decision at binary64's ends, and the loop's cap and budget ----------------
def _check(stored: float, value) -> bool:
    return _interval_check("x", np.array([stored]), lambda i: value(), None, "i",
                           budget_s=60.0).passed


def test_overflow_and_underflow_are_decided_from_clamped_bounds():
    huge = lambda: iv.mpf(2) ** 1100  # noqa: E731
    tie = lambda: iv.mpf(2) ** 1024 - iv.mpf(2) ** 970  # noqa: E731  # rounds to inf (even)
    below = lambda: iv.mpf(2) ** 1024 - iv.mpf(2) ** 970 - 1  # noqa: E731
    big = float(np.finfo(np.float64).max)
    assert _check(np.inf, huge) and not _check(big, huge)
    assert _check(np.inf, tie) and not _check(big, tie)
    assert _check(big, below) and not _check(np.inf, below)
    tiny = lambda: iv.exp(iv.mpf(-1e39))  # noqa: E731
    half_ulp = lambda: iv.mpf(2) ** -1075  # noqa: E731  # a tie between 0 and 5e-324: to 0
    assert _check(0.0, tiny) and not _check(5e-324, tiny) and not _check(-5e-324, tiny)
    assert _check(0.0, half_ulp) and not _check(5e-324, half_ulp)
    assert not _check(np.nan, huge) and not _check(1.0, lambda: iv.mpf(np.nan))


def test_an_undecidable_element_fails_or_raises_never_passes():
    # an interval over 1.0's upper rounding boundary that never narrows: the loop stops at
    # its precision cap with a failure, or at the time budget with an error
    straddle = lambda: iv.mpf([1.0, float(np.nextafter(1.0, 2.0))])  # noqa: E731
    result = _interval_check("probs", np.array([1.0]), lambda i: straddle(), None, "i",
                             budget_s=60.0)
    assert not result.passed and "could not be confirmed" in (result.failure or "")
    with pytest.raises(RefAttnError, match=r"probs element \(i=0\).*time budget of 0 s"):
        _interval_check("probs", np.array([1.0]), lambda i: straddle(), None, "i",
                        budget_s=0.0)


def test_a_golden_at_logits_1e300_is_written_with_a_json_manifest(tmp_path):
    # the reference error of a per-step rounded golden at this magnitude exceeds binary64's
    # range for some elements (was: ValueError "Out of range float values are not JSON
    # compliant: inf" from write_bundle); JSON has no inf, so the record holds the largest
    # three-digit value instead
    import json

    from refattn.analysis.reference_error import LARGEST_RECORDED
    from refattn.bundle.golden.case import GoldenCase
    from refattn.bundle.writing.write import write_bundle

    call = _call_at(1e300)
    case = GoldenCase("logits_1e300", call, np.array([1.0, -2.0]).reshape(1, 1, 2, 1), "1e300")
    out = write_bundle(tmp_path / "b", [case], suite="magnitudes")
    text = out.read_text()  # write_bundle answers the manifest's path
    manifest = json.loads(text, parse_constant=lambda c: pytest.fail(f"manifest holds {c}"))
    (entry,) = manifest["cases"] if isinstance(manifest["cases"], list) else \
        manifest["cases"].values()
    values = [v for e in entry["reference_error"].values() for v in e.values() if v is not None]
    assert values and all(0.0 <= v <= LARGEST_RECORDED for v in values)
    assert max(values) == LARGEST_RECORDED  # some element's error is past binary64's range

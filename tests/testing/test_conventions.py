"""The conventions a kernel decides are public on every case, and the suite exercises each:
default-scale cases (called without a scale), both causal triangles with Q != K, windows."""

from __future__ import annotations

import numpy as np
import pytest

from refattn.testing import Case, Supports, load_cases
from refattn.testing.supports import ineligibility

CASES = [Case(s) for s in load_cases()]
BY_NAME = {c.name: c for c in CASES}


def brute_window(vis: np.ndarray, left: int, right: int) -> np.ndarray:
    """(Q, K) FlashAttention's band, written from its documentation."""
    Q, K = vis.shape[-2:]
    i, j = np.arange(Q)[:, None], np.arange(K)[None, :]
    lo = np.full((Q, K), True) if left < 0 else j >= i + K - Q - left
    hi = np.full((Q, K), True) if right < 0 else j <= i + K - Q + right
    return lo & hi


def test_the_suite_has_default_scale_and_both_causal_triangles_with_q_not_k():
    eligible = [c for c in CASES if ineligibility(c.spec, Supports()) is None]
    defaults = [c for c in eligible if c.scale_is_default]
    assert len(defaults) >= 30 and all(c.scale_argument is None for c in defaults)
    assert all(c.scale_argument == c.scale for c in CASES if not c.scale_is_default)
    for alignment in ("upper_left", "lower_right"):
        rect = [c.name for c in CASES if c.causal_alignment == alignment
                and c.q.shape[2] != c.k.shape[2]]
        assert rect, alignment
    assert "causal_lower_right_q3_k7" in [c.name for c in CASES
                                          if c.causal_alignment == "lower_right"]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_is_causal_and_the_alignment_say_what_the_visibility_is(c):
    vis = c.spec.visible_full()  # (B, Hq, Q, K)
    Q, K = vis.shape[-2:]
    i, j = np.arange(Q)[:, None], np.arange(K)[None, :]
    upper, lower = (np.array_equal(vis, np.broadcast_to(j <= i + off, vis.shape))
                    for off in (0, K - Q))
    assert c.is_causal == ((upper or lower) and not vis.all())
    expected = None if not c.is_causal else ("upper_left" if upper else "lower_right")
    assert c.causal_alignment == expected
    if c.window is not None:  # the band it names is the visibility
        assert np.array_equal(vis, np.broadcast_to(brute_window(vis, *c.window), vis.shape))
    elif vis.all():
        pytest.fail("an all-visible case is the window (-1, -1)")


def test_window_examples():
    assert BY_NAME["self_attention_basic"].window == (-1, -1)
    assert BY_NAME["causal_lower_right_q3_k7"].window == (-1, 0)
    assert BY_NAME["causal_upper_left_q3_k7"].window is None  # not a lower-right band
    assert BY_NAME["sliding_window_causal_incl3"].window == (2, 0)
    assert BY_NAME["sliding_window_bidirectional"].window == (2, 2)
    assert BY_NAME["key_padding_causal"].window is None  # padding differs per batch row


def test_gqa_mapping_and_softcap():
    assert BY_NAME["gqa_hq8_hkv2_causal"].gqa_mapping == "grouped"
    assert BY_NAME["gqa_explicit_head_map"].gqa_mapping == "explicit"
    assert BY_NAME["softcap_5"].softcap == 5.0
    assert BY_NAME["self_attention_basic"].softcap is None

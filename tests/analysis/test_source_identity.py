"""Source identity: permuting K rows without V rows keeps every shape valid but changes the
output; carrying row labels beside the tensors lets the oracle flag it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import AttentionCall, RefAttnError, check_source_identity
from refattn.analysis.source_identity import LabelledRows, labelled_attention, take_rows

B, Hq, Hkv, Q, K, Dk, Dv = 2, 2, 1, 2, 3, 4, 2
LABELS = np.array(["source:0", "source:1", "source:2"])


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Q, Dk)), rng.standard_normal((B, Hkv, K, Dk)),
            rng.standard_normal((B, Hkv, K, Dv)))


def test_permuting_k_alone_is_shape_valid_but_changes_the_output():
    q, k, v = _tensors()
    perm = np.array([2, 0, 1])
    good = refattn.forward(AttentionCall(q, k, v)).output
    corrupt = refattn.forward(AttentionCall(q, k[:, :, perm], v))  # the gate accepts it
    assert corrupt.output.shape == good.shape
    assert np.abs(corrupt.output - good).max() > 0.05
    # the same permutation of both is a legal transformation: the output is unchanged
    both = refattn.forward(AttentionCall(q, k[:, :, perm], v[:, :, perm])).output
    np.testing.assert_allclose(both, good, rtol=1e-14, atol=1e-15)


def test_labels_carried_beside_the_rows_flag_the_corruption():
    q, k, v = _tensors()
    keys, values = LabelledRows(k, LABELS), LabelledRows(v, LABELS)
    perm = np.array([2, 0, 1])
    good = labelled_attention(q, keys, values).output
    moved = labelled_attention(q, take_rows(keys, perm), take_rows(values, perm)).output
    np.testing.assert_allclose(moved, good, rtol=1e-14, atol=1e-15)
    # K gathered under one index map, V under none: the labels travel with their rows
    with pytest.raises(RefAttnError, match=r"key row \(b=0, h=0, j=0\) is labelled 'source:2' "
                                           r"but value row .* is labelled 'source:0'"):
        labelled_attention(q, take_rows(keys, perm), values)
    # a bare relabel (no data movement) is caught the same way
    with pytest.raises(RefAttnError, match=r"K and V were reordered"):
        labelled_attention(q, LabelledRows(k, LABELS[perm]), values)


def test_per_batch_labels_name_the_offending_batch():
    keys = np.array([[0, 1, 2], [10, 11, 12]])
    values = np.array([[0, 1, 2], [10, 12, 11]])  # batch 1 swapped two rows of V only
    with pytest.raises(RefAttnError, match=r"key row \(b=1, j=1\) is labelled 11"):
        check_source_identity(keys, values)
    report = check_source_identity(keys, keys)
    assert report.shape == (2, 3) and report.checked == ("value",)


def test_other_key_indexed_tensors_are_checked_too():
    keys = np.arange(4)
    bias_columns = np.array([0, 1, 3, 2])  # a bias built under another index map
    with pytest.raises(RefAttnError, match=r"key row \(j=2\) is labelled 2 but bias row \(j=2\) "
                                           r"is labelled 3; K and bias"):
        check_source_identity(keys, keys, others={"bias": bias_columns})
    report = check_source_identity(keys, keys, others={"bias": keys, "visible": keys[None]})
    assert report.checked == ("value", "bias", "visible") and report.shape == (1, 4)


def test_label_shapes_must_line_up():
    with pytest.raises(RefAttnError, match=r"label shapes do not broadcast"):
        check_source_identity(np.arange(3), np.arange(4))
    with pytest.raises(RefAttnError, match=r"key_labels: expected labels with a trailing key"):
        check_source_identity(np.int64(3), np.arange(3))
    with pytest.raises(RefAttnError, match=r"labels: expected \[K\] or \[B,K\] with K=3"):
        LabelledRows(np.zeros((1, 1, 3, 2)), np.arange(4))
    with pytest.raises(RefAttnError, match=r"index: expected a 1-D integer array"):
        take_rows(LabelledRows(np.zeros((1, 1, 3, 2)), np.arange(3)), np.array([0.0, 1.0]))


@settings(max_examples=30, deadline=None)
@given(perm=st.permutations(range(5)), seed=st.integers(0, 2**32 - 1))
def test_only_a_shared_index_map_preserves_identity(perm, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 3, 4))
    keys = LabelledRows(rng.standard_normal((1, 1, 5, 4)), np.arange(5) + 100)
    values = LabelledRows(rng.standard_normal((1, 1, 5, 2)), np.arange(5) + 100)
    perm = np.array(perm)
    ref = labelled_attention(q, keys, values).output
    both = labelled_attention(q, take_rows(keys, perm), take_rows(values, perm)).output
    np.testing.assert_allclose(both, ref, rtol=1e-13, atol=1e-14)
    if np.array_equal(perm, np.arange(5)):
        return
    with pytest.raises(RefAttnError, match=r"source identity"):
        labelled_attention(q, take_rows(keys, perm), values)
    # without labels nothing complains, yet the output is different
    corrupt = refattn.forward(AttentionCall(q, take_rows(keys, perm).values, values.values))
    assert not np.allclose(corrupt.output, ref, rtol=1e-9, atol=1e-12)

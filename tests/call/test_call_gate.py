"""Every rejection of the AttentionCall validation gate, each with its message checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refattn import AttentionCall, RefAttnError

B, Hq, Hkv, Q, K, Dk, Dv = 2, 4, 2, 3, 5, 4, 3


def _qkv(rng=None):
    rng = rng or np.random.default_rng(0)
    return (rng.standard_normal((B, Hq, Q, Dk)), rng.standard_normal((B, Hkv, K, Dk)),
            rng.standard_normal((B, Hkv, K, Dv)))


def _reject(match: str, *args, **kwargs) -> RefAttnError:
    with pytest.raises(RefAttnError, match=match) as info:
        AttentionCall(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.complex128])
def test_non_float64_qkv_rejected_never_cast(name, dtype):
    q, k, v = _qkv()
    arrays = {"q": q, "k": k, "v": v}
    arrays[name] = arrays[name].astype(dtype)
    _reject(rf"{name}: expected dtype float64, got {np.dtype(dtype)}", **arrays)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_qkv_names_first_index(name, bad):
    q, k, v = _qkv()
    arrays = {"q": q, "k": k, "v": v}
    arrays[name][1, 1, 2, 0] = bad
    arrays[name][1, 1, 2, 1] = bad  # a later bad value is not the one reported
    _reject(rf"{name}: non-finite value .* at index \(1, 1, 2, 0\)", **arrays)


def test_wrong_ndim_rejected():
    q, k, v = _qkv()
    _reject(r"q: expected 4 axes, got 3", q[0], k, v)


def test_empty_axis_rejected():
    q, k, v = _qkv()
    _reject(r"k: every axis must be non-empty", q, k[:, :, :0], v[:, :, :0])


def test_batch_mismatch_rejected():
    q, k, v = _qkv()
    _reject(r"batch axis B must equal q's B=2, got k B=1", q, k[:1], v[:1])


def test_feature_mismatch_rejected():
    q, k, v = _qkv()
    _reject(r"k: feature axis Dk=3 must equal q's Dk=4", q, k[..., :3], v)


def test_key_value_row_mismatch_rejected():
    q, k, v = _qkv()
    _reject(r"v: key axis K=4 must equal k's K=5", q, k, v[:, :, :4])


def test_kv_head_mismatch_rejected():
    q, k, v = _qkv()
    _reject(r"v: head axis Hkv=1 must equal k's Hkv=2", q, k, v[:, :1])


def test_uneven_grouping_needs_explicit_head_map():
    q, k, v = _qkv()
    _reject(r"Hq % Hkv == 0, got Hq=3, Hkv=2", q[:, :3], k, v)
    call = AttentionCall(q[:, :3], k, v, head_map=np.array([0, 1, 1]))
    assert call.head_map.tolist() == [0, 1, 1]


@pytest.mark.parametrize(
    ("head_map", "match"),
    [
        (np.array([0, 1, 2, 0]), r"head_map: entry h=2 is 2, expected a kv head in \[0, 2\)"),
        (np.array([0, -1, 1, 0]), r"head_map: entry h=1 is -1"),
        (np.array([0, 1]), r"head_map: expected shape \[Hq=4\], got \[2\]"),
        (np.array([0.0, 1.0, 1.0, 0.0]), r"head_map: expected an integer array, got dtype float64"),
        (np.array([True, False, True, False]),
         r"head_map: expected an integer array, got dtype bool"),
    ],
)
def test_head_map_rejections(head_map, match):
    _reject(match, *_qkv(), head_map=head_map)


@pytest.mark.parametrize(
    ("scale", "match"),
    [
        (0.0, r"scale: expected a positive finite multiplier, got 0.0"),
        (-0.5, r"scale: expected a positive finite multiplier, got -0.5"),
        (float("nan"), r"scale: expected a finite real number or None, got nan"),
        (float("inf"), r"scale: expected a finite real number or None, got inf"),
        (True, r"scale: expected a finite real number or None, got True"),
        ("0.5", r"scale: expected a finite real number or None, got '0.5'"),
    ],
)
def test_scale_rejections(scale, match):
    _reject(match, *_qkv(), scale=scale)


def test_scale_default_is_dk_inverse_sqrt_and_explicit_is_kept():
    assert AttentionCall(*_qkv()).scale == Dk ** -0.5
    call = AttentionCall(*_qkv(), scale=0.125)
    assert call.scale == 0.125
    assert call.manifest()["scale"]["source"] == "explicit"


def test_visible_must_be_bool():
    _reject(r"visible: expected dtype bool with True meaning legal, got int64",
            *_qkv(), visible=np.ones((Q, K), dtype=np.int64))
    _reject(r"visible: expected dtype bool .* got float64", *_qkv(), visible=np.ones((Q, K)))


def test_visible_must_broadcast():
    _reject(r"visible: axis 1 \(aligned with K\) has size 4, expected 1 or 5",
            *_qkv(), visible=np.ones((Q, 4), bool))
    _reject(r"visible: has 5 axes, expected at most 4", *_qkv(), visible=np.ones((1,) * 5, bool))


def test_query_valid_must_be_bool_and_broadcast_to_b1q1():
    _reject(r"query_valid: expected dtype bool", *_qkv(), query_valid=np.ones((B, 1, Q, 1)))
    _reject(r"query_valid: axis 1 \(aligned with 1\) has size 4, expected 1 or 1",
            *_qkv(), query_valid=np.ones((B, Hq, Q, 1), bool))


def test_bias_rejections():
    _reject(r"bias: expected dtype float64, got float32",
            *_qkv(), bias=np.zeros((Q, K), np.float32))
    _reject(r"bias: axis 0 \(aligned with Q\) has size 2", *_qkv(), bias=np.zeros((2, K)))
    bias = np.zeros((Hq, Q, K))
    bias[2, 1, 3] = np.inf
    _reject(r"bias: non-finite value inf at index \(2, 1, 3\)", *_qkv(), bias=bias)
    bias[2, 1, 3] = -np.inf  # -inf is a visibility encoding, not a finite preference
    _reject(r"bias: non-finite value -inf", *_qkv(), bias=bias)


def test_dropout_multiplier_rejections():
    _reject(r"dropout: expected dtype float64, got float32",
            *_qkv(), dropout=np.ones((Q, K), np.float32))
    z = np.ones((B, Hq, Q, K))
    z[0, 3, 2, 4] = np.nan
    _reject(r"dropout: non-finite value nan at index \(0, 3, 2, 4\)", *_qkv(), dropout=z)
    _reject(r"dropout: axis 0 \(aligned with K\) has size 3", *_qkv(), dropout=np.ones(3))


def test_policy_and_returned_weights_choices():
    _reject(r"all_masked_rows: expected one of 'reject', 'sanitize_then_zero_invalid_query'",
            *_qkv(), all_masked_rows="nan_to_num")
    _reject(r"returned_weights: expected one of 'none', 'pre_dropout', 'post_dropout'",
            *_qkv(), returned_weights="yes")


def test_empty_row_rejected_under_reject_policy_with_its_index():
    vis = np.ones((B, Hq, Q, K), bool)
    vis[1, 2, 1] = False
    vis[1, 3, 0] = False
    _reject(r"visible: row \(b=1, h=2, i=1\) has no legal key under policy 'reject' "
            r"\(2 such row\(s\)\)", *_qkv(), visible=vis)


def test_consumed_empty_row_rejected_under_sanitize_policy():
    vis = np.ones((B, 1, Q, K), bool)
    vis[0, 0, 2] = False
    policy = "sanitize_then_zero_invalid_query"
    _reject(r"visible: row \(b=0, h=0, i=2\) has no legal key and its query_valid is True "
            r"under policy 'sanitize_then_zero_invalid_query'", *_qkv(), visible=vis,
            all_masked_rows=policy)
    qv = np.ones((B, 1, Q, 1), bool)
    qv[0, 0, 2] = False
    call = AttentionCall(*_qkv(), visible=vis, query_valid=qv, all_masked_rows=policy)
    assert call.manifest()["visibility"]["sanitized_rows"] == Hq
    # the same unused empty row is still an error under the default policy
    _reject(r"row \(b=0, h=0, i=2\) has no legal key under policy 'reject'",
            *_qkv(), visible=vis, query_valid=qv)


def test_error_message_carries_the_call_shapes():
    q, k, v = _qkv()
    err = _reject(r"q: expected dtype float64", q.astype(np.float32), k, v)
    assert str(err).startswith("AttentionCall(q=[2, 4, 3, 4], k=[2, 2, 5, 4], v=[2, 2, 5, 3]): ")
    assert isinstance(err, ValueError)


def test_call_is_frozen_and_arrays_are_read_only_copies():
    q, k, v = _qkv()
    call = AttentionCall(q, k, v)
    with pytest.raises(AttributeError):
        call.scale = 2.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        call.q[0, 0, 0, 0] = 1.0
    q[0, 0, 0, 0] = 123.0  # mutating the caller's array does not change the call
    assert call.q[0, 0, 0, 0] != 123.0


def test_manifest_fields_and_json():
    q, k, v = _qkv()
    q_nc = np.asfortranarray(q)  # a non-contiguous view: strides must be recorded as given
    call = AttentionCall(q_nc, k, v, visible=np.ones((1, 1, Q, K), bool),
                         bias=np.zeros((Hq, 1, K)), dropout=np.full((Q, K), 1.25))
    m = call.manifest()
    json.dumps(m, allow_nan=False)
    assert m["axes"] == {"B": B, "Hq": Hq, "Hkv": Hkv, "Q": Q, "K": K, "Dk": Dk, "Dv": Dv}
    assert m["tensors"]["query"]["contiguous"] is False
    assert m["tensors"]["query"]["stride"] == [s // 8 for s in q_nc.strides]
    assert m["tensors"]["key_physical"]["stride"] == [Hkv * K * Dk, K * Dk, Dk, 1]
    assert m["tensors"]["head_map"] == {"shape": [Hq], "range": [0, Hkv], "mode": "grouped",
                                        "values": [0, 0, 1, 1]}
    assert m["visibility"]["semantic_polarity"] == "true_means_legal"
    assert m["visibility"]["shape"] == [1, 1, Q, K]
    assert m["bias"]["role"] == "finite_preference_only"
    assert m["scale"]["value"] == {"decimal": "0.5", "hex": (0.5).hex()}
    assert m["scale"]["applied_times"] == 1
    assert set(m["numerical"].values()) == {"float64"}
    assert m["dropout"]["mode"] == "explicit_multiplier"
    assert m["dropout"]["location"] == "probabilities_before_value_mixing"
    assert m["backend"]["requested_backend"] == "numpy"
    assert m["materialization"] == {"scores": True, "probabilities": True}

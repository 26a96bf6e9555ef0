"""The portable Philox dropout stream: tiling invariance, seeds, thresholds, validation, calls.

The element-by-element mapping itself is checked against a scalar oracle in test_philox.py.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.dropout import MAPPING_VERSION, Philox
from refattn.errors import RefAttnError
from tests.strategies import score_shapes_and_tiles

SEED = 0x9E3779B97F4A7C15  # both 32-bit halves non-zero


@settings(max_examples=40, deadline=None)
@given(case=score_shapes_and_tiles(), p=st.sampled_from([0.0, 0.1, 0.5, 0.9]))
def test_any_block_regenerated_by_coordinates_equals_the_full_mask_slice(case, p):
    (B, Hq, Q, K), (b, h, i0, i1, j0, j1) = case
    stream = Philox(p, SEED, offset=3)
    full_keep = stream.keep_mask(B, Hq, Q, K)
    full_z = stream.multiplier(B, Hq, Q, K)
    np.testing.assert_array_equal(
        stream.keep_block(b, h, i0, i1, j0, j1, Hq=Hq), full_keep[b, h, i0:i1, j0:j1]
    )
    np.testing.assert_array_equal(
        stream.multiplier_block(b, h, i0, i1, j0, j1, Hq=Hq), full_z[b, h, i0:i1, j0:j1]
    )


@pytest.mark.parametrize(("tile_q", "tile_k"), [(1, 1), (2, 3), (3, 5), (4, 4), (7, 11)])
def test_reverse_order_odd_tiling_reassembles_the_mask(tile_q, tile_k):
    B, Hq, Q, K = 2, 2, 7, 11
    stream = Philox(0.3, SEED, offset=1)
    rebuilt = np.full((B, Hq, Q, K), np.nan)
    tiles = [(b, h, i0, j0) for b in range(B) for h in range(Hq)
             for i0 in range(0, Q, tile_q) for j0 in range(0, K, tile_k)]
    for b, h, i0, j0 in reversed(tiles):  # visiting order must not matter
        i1, j1 = min(i0 + tile_q, Q), min(j0 + tile_k, K)
        rebuilt[b, h, i0:i1, j0:j1] = stream.multiplier_block(b, h, i0, i1, j0, j1, Hq=Hq)
    np.testing.assert_array_equal(rebuilt, stream.multiplier(B, Hq, Q, K))


def test_mask_does_not_depend_on_the_call_extent():
    # a prefix of a bigger call is the same mask: coordinates, not positions in a buffer
    stream = Philox(0.5, SEED)
    np.testing.assert_array_equal(stream.keep_mask(3, 2, 5, 9)[:2, :, :4, :6],
                                  stream.keep_mask(2, 2, 4, 6))


def test_seeds_differing_only_in_the_high_32_bits_give_different_masks():
    low = 0x1234ABCD
    masks = [Philox(0.5, (hi << 32) | low).keep_mask(1, 2, 8, 16) for hi in (0, 1, 0xFFFFFFFF)]
    assert Philox(0.5, (1 << 32) | low).key.tolist() == [low, 1]
    for a in range(3):
        for b in range(a + 1, 3):
            # independent masks at p = 0.5 agree on about half of 256 elements
            assert (masks[a] != masks[b]).sum() > 64


def test_seeds_differing_only_in_the_low_bits_and_offsets_give_different_masks():
    base = Philox(0.5, SEED).keep_mask(1, 1, 8, 16)
    assert (Philox(0.5, SEED ^ 1).keep_mask(1, 1, 8, 16) != base).sum() > 32
    assert (Philox(0.5, SEED, offset=1).keep_mask(1, 1, 8, 16) != base).sum() > 32


def test_same_stream_is_bit_identical_across_instances():
    a = Philox(0.2, SEED, offset=9).multiplier(2, 3, 4, 5)
    b = Philox(0.2, SEED, offset=9).multiplier(2, 3, 4, 5)
    assert a.tobytes() == b.tobytes()


def test_p_zero_gives_z_exactly_one():
    stream = Philox(0.0, SEED)
    assert stream.threshold == 0
    z = stream.multiplier(2, 2, 3, 7)
    assert z.dtype == np.float64
    assert np.array_equal(z, np.ones((2, 2, 3, 7)))


@pytest.mark.parametrize(
    ("p", "threshold"),
    [
        (0.25, 1 << 30),
        (0.5 / 2**32, 0),  # exact half: rounds to even (0)
        (1.5 / 2**32, 2),  # exact half: rounds to even (2)
        (2.5 / 2**32, 2),
        (0.2, 858993459),  # 0.2 * 2**32 = 858993459.2000000476837158203125 exactly
        (1.0 - 2.0**-32, 0xFFFFFFFF),  # the largest threshold that fits
    ],
)
def test_threshold_is_round_half_even_of_the_exact_product(p, threshold):
    assert Philox(p, 1).threshold == threshold


def test_keep_multiplier_is_one_over_one_minus_p_in_binary64():
    for p in (0.1, 0.25, 1 / 3, 0.9):
        stream = Philox(p, 5)
        z = stream.multiplier(1, 1, 4, 8)
        assert set(np.unique(z).tolist()) <= {0.0, 1.0 / (1.0 - p)}


def test_keep_frequency_matches_the_threshold_probability():
    stream = Philox(0.3, SEED)
    keep = stream.keep_mask(4, 4, 64, 64)  # 65,536 draws
    q = 1.0 - stream.threshold / 2**32  # exact keep probability of the integer compare
    se = math.sqrt(q * (1.0 - q) / keep.size)
    assert abs(keep.mean() - q) < 5.0 * se  # declared tolerance: 5 binomial standard errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"p": 1.0, "seed": 0}, r"p: expected a dropout probability in \[0, 1\)"),
        ({"p": -0.1, "seed": 0}, r"p: expected a dropout probability in \[0, 1\)"),
        ({"p": float("nan"), "seed": 0}, r"p: expected a finite real number, got nan"),
        ({"p": 1.0 - 2.0**-33, "seed": 0}, "threshold 2\\*\\*32"),
        ({"p": True, "seed": 0}, "p: expected a finite real number, got True"),
        ({"p": 0.1, "seed": -1}, "seed: expected an integer in"),
        ({"p": 0.1, "seed": 2**64}, "seed: expected an integer in"),
        ({"p": 0.1, "seed": 1.0}, r"seed: expected an integer below 2\*\*128 .* got 1.0"),
        ({"p": 0.1, "seed": True}, r"seed: expected an integer below 2\*\*128 .* got True"),
        ({"p": 0.1, "seed": 0, "offset": 2**32}, "offset: expected an integer in"),
    ],
)
def test_stream_parameters_are_validated(kwargs, message):
    with pytest.raises(RefAttnError, match=message):
        Philox(**kwargs)


def test_numpy_integer_seeds_are_accepted_exactly():
    assert Philox(0.1, np.uint64(2**64 - 1)).seed == 2**64 - 1


def test_block_coordinates_are_validated():
    stream = Philox(0.1, 3)
    with pytest.raises(RefAttnError, match=r"h: head 2 is outside \[0, Hq=2\)"):
        stream.keep_block(0, 2, 0, 1, 0, 1, Hq=2)
    with pytest.raises(RefAttnError, match="expected i0 <= i1"):
        stream.keep_block(0, 0, 3, 1, 0, 1, Hq=1)
    with pytest.raises(RefAttnError, match="i0: expected an integer"):
        stream.keep_block(0, 0, -1, 1, 0, 1, Hq=1)
    with pytest.raises(RefAttnError, match="does not fit in 32 bits"):
        stream.keep_block(2**31, 1, 0, 1, 0, 1, Hq=2)
    assert stream.keep_block(0, 0, 2, 2, 0, 5, Hq=1).shape == (0, 5)


def test_manifest_records_the_stream_as_strings_and_replays():
    stream = Philox(0.125, 2**64 - 2, offset=2**32 - 1)
    m = stream.manifest()
    assert m["algorithm"] == "philox4x32-10"
    assert m["seed"] == str(2**64 - 2) and m["offset"] == str(2**32 - 1)
    assert m["mapping_version"] == MAPPING_VERSION
    assert m["p"] == 0.125 and m["threshold"] == str(2**29)
    again = Philox.from_manifest(json.loads(json.dumps(m, allow_nan=False)))
    assert again == stream
    with pytest.raises(RefAttnError, match="algorithm 'threefry'"):
        Philox.from_manifest({**m, "algorithm": "threefry"})
    with pytest.raises(RefAttnError, match="mapping_version"):
        Philox.from_manifest({**m, "mapping_version": "other"})


def test_attention_call_with_a_stream_runs_forward_and_backward_and_records_it():
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(s) for s in [(2, 4, 5, 3), (2, 2, 6, 3), (2, 2, 6, 2)])
    stream = Philox(0.25, SEED, offset=4)
    call = refattn.AttentionCall(q, k, v, dropout=stream)
    trace = refattn.forward(call)
    np.testing.assert_array_equal(trace.dropout_multiplier, stream.multiplier(2, 4, 5, 6))
    np.testing.assert_array_equal(trace.consumed, trace.probs * trace.dropout_multiplier)
    grads = refattn.backward(trace, rng.standard_normal((2, 4, 5, 2)))
    np.testing.assert_array_equal(grads.grad_probs, grads.grad_consumed * trace.dropout_multiplier)
    drop = call.manifest()["dropout"]
    json.dumps(drop, allow_nan=False)
    assert drop["mode"] == "stream" and drop["training"] is True
    assert (drop["algorithm"], drop["seed"], drop["offset"], drop["p"]) == (
        "philox4x32-10", str(SEED), "4", 0.25)
    assert drop["mapping_version"] == MAPPING_VERSION


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_generation_equals_one_shot_generation(monkeypatch, chunk):
    stream = Philox(0.4, SEED, offset=2)
    whole = stream.keep_mask(2, 3, 5, 13)
    monkeypatch.setattr("refattn.dropout.stream._CHUNK_CALLS", chunk)
    np.testing.assert_array_equal(stream.keep_mask(2, 3, 5, 13), whole)
    np.testing.assert_array_equal(stream.keep_block(1, 2, 1, 4, 3, 11, Hq=3),
                                  whole[1, 2, 1:4, 3:11])

"""The numba Philox4x32-10 port: Random123 known answers, bit-identity with
refattn.dropout.philox and with the coordinate mapping of refattn.dropout.Philox (rows, unaligned
tiles, whole calls)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refattn.dropout import Philox
from refattn.dropout.philox import philox4x32_10 as numpy_philox
from refattn.engine.numba.philox import philox4x32_10, philox_fill, philox_params, philox_row

# Random123 kat_vectors, philox4x32 with 10 rounds: counter, key, expected output words
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_random123_known_answers(counter, key, expected):
    out = philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert out.dtype == np.uint32
    assert tuple(int(w) for w in out) == expected


def test_bit_identical_to_refattn_philox_on_random_words():
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, (2000, 4), dtype=np.uint64).astype(np.uint32)
    keys = rng.integers(0, 2**32, (2000, 2), dtype=np.uint64).astype(np.uint32)
    want = numpy_philox(counters, keys)
    got = np.array([philox4x32_10(c, k) for c, k in zip(counters, keys, strict=True)])
    np.testing.assert_array_equal(got, want)


_P = st.sampled_from([0.0, 2.0**-33, 0.1, 0.25, 0.5, 0.9, 1.0 - 2.0**-32])


@settings(max_examples=60, deadline=None)
@given(p=_P, seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**32 - 1),
       b=st.integers(0, 2), h=st.integers(0, 3), i=st.integers(0, 2**32 - 1),
       j0=st.integers(0, 40), n=st.integers(0, 17))
def test_row_matches_the_stream_on_unaligned_keys(p, seed, offset, b, h, i, j0, n):
    stream = Philox(p, seed, offset=offset)
    z = np.full(n + 1, -1.0)
    philox_row(z, b * 4 + h, i, j0, n, *philox_params(stream))
    want = stream.multiplier_block(b, h, i, i + 1, j0, j0 + n, Hq=4)[0]
    np.testing.assert_array_equal(z[:n], want)  # bit for bit: 0.0 or keep_multiplier
    assert z[n] == -1.0  # nothing written past the row


@settings(max_examples=25, deadline=None)
@given(p=_P, seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**32 - 1),
       shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 5),
                       st.integers(1, 23)))
def test_fill_matches_the_whole_call_multiplier(p, seed, offset, shape):
    stream = Philox(p, seed, offset=offset)
    z = np.empty(shape)
    philox_fill(z, *philox_params(stream))
    want = stream.multiplier(*shape)
    assert np.array_equal(z, want)
    assert np.array_equal(np.signbit(z), np.signbit(want))


def test_threshold_and_multiplier_come_from_the_stream():
    stream = Philox(0.3, seed=2**40 + 5, offset=9)
    key0, key1, offset, threshold, keep = philox_params(stream)
    assert (int(key0), int(key1), int(offset)) == (5, 2**8, 9)
    assert int(threshold) == stream.threshold == round(0.3 * 2**32)
    assert keep == stream.keep_multiplier == 1.0 / (1.0 - 0.3)

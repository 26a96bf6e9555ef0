"""Philox4x32-10 against the Random123 known-answer vectors and a scalar oracle.

The scalar oracle below is written independently from the vectorised generator (Python ints,
one element at a time, key schedule bumped *before* rounds 2..R as in Random123's philox.h) and
also checks the attention coordinate mapping of :mod:`refattn.dropout` element by element.
"""

from __future__ import annotations

import numpy as np
import pytest

from refattn.dropout import Philox, philox4x32_10
from refattn.dropout.philox import _philox4x32
from refattn.errors import RefAttnError

# Random123 tests/kat_vectors, the "philox4x32" lines without that name:
# rounds, counter words 0..3, key words 0..1, expected output words 0..3 (hex)
KAT = """
7 00000000 00000000 00000000 00000000 00000000 00000000 5f6fb709 0d893f64 4f121f81 4f730a48
7 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff 5207ddc2 45165e59 4d8ee751 8c52f662
7 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0 4dfccaba 190a87f0 c47362ba b6b5242a
10 00000000 00000000 00000000 00000000 00000000 00000000 6627e8d5 e169c58d bc57ac4c 9b00dbd8
10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff 408f276d 41c83b0e a20bc7c6 6d5451fd
10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0 d16cfe09 94fdcceb 5001e420 24126ea1
"""


def _kat_rows(rounds: int) -> list[tuple[list[int], list[int], list[int]]]:
    rows = []
    for line in KAT.strip().splitlines():
        fields = line.split()
        if int(fields[0]) == rounds:
            words = [int(w, 16) for w in fields[1:]]
            rows.append((words[0:4], words[4:6], words[6:10]))
    return rows


def scalar_philox(counter: list[int], key: list[int], rounds: int = 10) -> list[int]:
    """One Philox4x32 block with Python ints (the oracle)."""
    mask = 0xFFFFFFFF
    c, k = list(counter), list(key)
    for r in range(rounds):
        if r > 0:
            k = [(k[0] + 0x9E3779B9) & mask, (k[1] + 0xBB67AE85) & mask]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & mask, p1 & mask, ((p0 >> 32) ^ c[3] ^ k[1]) & mask,
             p0 & mask]
    return c


def scalar_keep(p: float, seed: int, offset: int, b: int, h: int, i: int, j: int, Hq: int) -> bool:
    """The documented mapping (docs/ARCHITECTURE.md), transcribed literally for one element."""
    counter = [j >> 2, i, b * Hq + h, offset]
    key = [seed & 0xFFFFFFFF, seed >> 32]
    word = scalar_philox(counter, key)[j & 3]
    return word >= round(p * 2**32)


@pytest.mark.parametrize(("counter", "key", "expected"), _kat_rows(10))
def test_known_answer_vectors_10_rounds(counter, key, expected):
    out = philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert out.dtype == np.uint32
    assert out.tolist() == expected
    assert scalar_philox(counter, key, 10) == expected  # the oracle itself is pinned too


@pytest.mark.parametrize(("counter", "key", "expected"), _kat_rows(7))
def test_known_answer_vectors_7_rounds_pin_the_key_schedule(counter, key, expected):
    # a key bump in the wrong place still passes no 7-round vector
    out = _philox4x32(np.array(counter, np.uint32), np.array(key, np.uint32), 7)
    assert out.tolist() == expected
    assert scalar_philox(counter, key, 7) == expected


def test_known_answer_vectors_vectorised_in_one_call():
    rows = _kat_rows(10)
    counters = np.array([r[0] for r in rows], np.uint32)  # (3, 4)
    keys = np.array([r[1] for r in rows], np.uint32)  # (3, 2)
    assert philox4x32_10(counters, keys).tolist() == [r[2] for r in rows]


def test_vectorised_matches_scalar_oracle_with_broadcasting():
    rng = np.random.default_rng(4)
    counters = rng.integers(0, 2**32, size=(5, 3, 4), dtype=np.uint32)
    keys = rng.integers(0, 2**32, size=(3, 2), dtype=np.uint32)  # broadcasts over axis 0
    out = philox4x32_10(counters, keys)
    assert out.shape == (5, 3, 4)
    for a in range(5):
        for b in range(3):
            assert out[a, b].tolist() == scalar_philox(counters[a, b].tolist(), keys[b].tolist())


def test_rejects_non_uint32_and_bad_shapes():
    good_c, good_k = np.zeros(4, np.uint32), np.zeros(2, np.uint32)
    with pytest.raises(RefAttnError, match="counter: expected dtype uint32, got int64"):
        philox4x32_10(np.zeros(4, np.int64), good_k)
    with pytest.raises(RefAttnError, match="key: expected dtype uint32, got uint64"):
        philox4x32_10(good_c, np.zeros(2, np.uint64))
    with pytest.raises(RefAttnError, match=r"counter: expected shape \(\.\.\., 4\)"):
        philox4x32_10(np.zeros(3, np.uint32), good_k)
    with pytest.raises(RefAttnError, match="do not broadcast"):
        philox4x32_10(np.zeros((2, 4), np.uint32), np.zeros((3, 2), np.uint32))


def test_dropout_mapping_matches_scalar_oracle_element_by_element():
    # both key words non-zero, offset non-zero, K not a multiple of 4, several (b, h)
    seed, offset, p = 0x0123456789ABCDEF, 7, 0.375
    B, Hq, Q, K = 2, 3, 3, 6
    keep = Philox(p, seed, offset).keep_mask(B, Hq, Q, K)
    expected = np.array([
        [[[scalar_keep(p, seed, offset, b, h, i, j, Hq) for j in range(K)] for i in range(Q)]
         for h in range(Hq)] for b in range(B)
    ])
    np.testing.assert_array_equal(keep, expected)
    assert 0 < keep.sum() < keep.size  # both outcomes occur, so the comparison has teeth

"""refattn.adapters.rope_diagnosis: each planted RoPE bug diagnosed as itself, an honest
candidate as nothing. The buggy kernels are FlashAttention's own test reference
(tests/adapters/fa_kvcache_reference.py, no refattn) with the bug planted there: the layout
flipped, the appended keys rotated twice, q not rotated, positions measured from the left
pad; plus a float32 rounding of the honest result (no diagnosis) and an unrelated error (a
failure that no hypothesis explains).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from refattn.adapters.rope_diagnosis import HYPOTHESES, diagnose_kvcache
from refattn.errors import RefAttnError

sys.path.insert(0, str(Path(__file__).parent))
from fa_kvcache_reference import fa_case, fa_reference

#: (seqlen_q, d, batch_idx, leftpad, paged, rotary_fraction, interleaved, new == q, causal,
#: local, alibi, new_kv, mha, seed): rotary on, appends, leftpad on, 3 queries
CALLS = {
    "causal_gqa_leftpad_interleaved": (3, 32, False, True, None, 1.0, True, True, True, False,
                                       False, True, "gqa", 11),
    "not_causal_neox_half_rotary_batch_idx": (3, 32, True, True, None, 0.5, False, False,
                                              False, False, False, True, "mha", 12),
}


def _call(name):
    args = fa_case(*CALLS[name])
    # a left pad on every row, so that positions measured from it differ everywhere
    n = args["cache_seqlens"]
    args["cache_leftpad"] = np.maximum(n // 2, 1).astype(np.int32)
    args["cache_seqlens"] = np.maximum(n, 2).astype(np.int32)
    return args


def _kernel(args, bug=None):
    """The buggy kernel's out and updated k_cache (FA's reference, the bug planted there)."""
    out, kc_ref, _ = fa_reference(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["rotary_cos"],
        args["rotary_sin"], args["cache_seqlens"], args["cache_leftpad"],
        args["cache_batch_idx"], args["block_table"], args["causal"], args["window_size"],
        args["rotary_interleaved"], args["alibi_slopes"], bug=bug)
    k_cache = args["k_cache"].copy()  # the kernel's in-place update
    rows = (np.arange(out.shape[0]) if args["cache_batch_idx"] is None
            else args["cache_batch_idx"])
    k_cache[rows] = kc_ref
    return out, k_cache


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("bug", sorted(HYPOTHESES))
def test_each_planted_bug_is_diagnosed_as_itself(name, bug):
    args = _call(name)
    out, k_cache = _kernel(args, bug)
    found = diagnose_kvcache(args, out, k_cache)
    assert not found.matches_reference and found.max_error > 1e-3
    assert found.kinds == (bug,), found
    assert found.lines[0].startswith("diagnosis: output")
    found = diagnose_kvcache(args, out)  # the output alone says it too
    assert found.kinds == (bug,), found


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_honest_candidate_gets_no_diagnosis(name):
    args = _call(name)
    out, k_cache = _kernel(args)
    found = diagnose_kvcache(args, out.astype(np.float32), k_cache.astype(np.float32),
                             rtol=1e-5, atol=1e-5)
    assert found.matches_reference and found.kinds == () and found.lines == ()


def test_an_unrelated_failure_is_not_explained():
    args = _call("causal_gqa_leftpad_interleaved")
    out, _ = _kernel(args)
    found = diagnose_kvcache(args, out * 1.5)
    assert not found.matches_reference and found.kinds == ()


def test_a_wrong_shape_is_refused():
    args = _call("causal_gqa_leftpad_interleaved")
    out, _ = _kernel(args)
    with pytest.raises(RefAttnError, match=r"output: expected shape \[2, 3, 6, 32\]"):
        diagnose_kvcache(args, out[:, :2])

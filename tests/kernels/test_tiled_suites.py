"""The tiled NumPy kernel over refattn's suites (issue 39, item 4): real shapes find real bugs.

A correct tiled kernel (64 x 64 tiles; split-KV and padded head dims on some cases) in float32
and float16 must pass every kernel case, forward and backward, under refattn's low-precision
rule (the plugin's ``suite="kernels"``). Each planted tile-boundary bug must fail at least one
kernel case where its trigger holds; on the same cases the correct kernel passes (the
honest variant). How many conformance cases each bug fails is measured by
``benchmarks/kernel_bugs.py``: the miniatures (K <= 128, Dk <= 16) miss some of them.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from refattn.bundle.comparison.harness import compare
from refattn.testing import Case, Supports, assert_matches, cases, load_cases
from tests.kernels import tiled

#: what the tiled kernel computes: dot scores, any mask, bias, softcap, sink, dropout as Z
SUPPORTS = dict(softcap=True, sink=True, dropout=("multiplier",), bias=True, masks="dense")


def run(case: Case, dtype: str, **options) -> dict[str, np.ndarray]:
    """The tiled kernel on ``case``'s plain description; its tensors by canonical name."""
    p = case.plain
    r = tiled.attention(p.q, p.k, p.v, head_map=p.head_map, visible=p.visible,
                        query_valid=p.query_valid, scale=p.scale, softcap=p.softcap,
                        sink=p.sink, bias=p.bias, dropout=p.dropout,
                        grad_output=p.grad_output, dtype=dtype, **options)
    out = {"output": r.output, "grad_q": r.grad_q, "grad_k": r.grad_k, "grad_v": r.grad_v}
    if p.bias is not None:
        out["grad_bias"] = r.grad_bias
    if p.sink is not None:
        out["grad_sink"] = r.grad_sink
    return out


def layout(case: Case) -> dict[str, int | None]:
    """64 x 64 tiles; on a third of the cases split-KV in 2 or 3 chunks, and head dims not a
    multiple of 8 zero-padded to 16 (as kernels pad odd head dims)."""
    seed = zlib.crc32(case.name.encode())
    Dk = case.q.shape[-1]
    return {"tile_q": 64, "tile_k": 64, "splits": 1 + seed % 3 if seed % 3 else 1,
            "pad_to": 16 if Dk % 8 else None}


@cases(Supports(dtypes=("float32", "float16"), **SUPPORTS), suite="kernels")
def test_the_tiled_kernel_passes_every_kernel_case(case):
    assert_matches(case, run(case, case.dtype, **layout(case)))


#: (bug, tile options, kernel cases where its trigger holds)
PLANTED = [
    ("drop_last_partial_tile", {}, ("shape_q113_k203", "edge_causal_lr_q63_k65",
                                    "decode_q1_k147")),
    ("causal_offset", {}, ("edge_causal_lr_q127_k129", "causal_lr_q1023_k1024",
                           "decode_q2_k1023")),
    ("pad_garbage", {"pad_to": 16}, ("shape_q113_k211_d111", "edge_causal_lr_q65_k63",
                                     "alibi_q1_k147")),
    ("stale_max_rescale", {}, ("shape_q1024_k1024", "causal_ul_q1023_k1024",
                               "sink_q113_k203")),
    ("splitkv_sum_weights", {"splits": 3}, ("decode_q1_k1023", "shape_q1_k147",
                                            "window_lr_q1_k147")),
]
KERNEL_CASES = {c.name: c for c in (Case(s, "float32") for s in load_cases(suite="kernels"))}


def _pick(prefixes: tuple[str, ...]) -> list[Case]:
    return [next(c for n, c in KERNEL_CASES.items() if n.startswith(p)) for p in prefixes]


@pytest.mark.parametrize(("bug", "options", "prefixes"), PLANTED, ids=[b for b, *_ in PLANTED])
def test_each_planted_bug_fails_kernel_cases_that_the_correct_kernel_passes(bug, options,
                                                                            prefixes):
    failed = []
    for case in _pick(prefixes):
        opts = {"tile_q": 64, "tile_k": 64, **options}
        assert compare(run(case, "float32", **opts), case.spec, dtype="float32",
                       check="gradients").passed, case.name  # the honest variant
        report = compare(run(case, "float32", bug=bug, **opts), case.spec, dtype="float32",
                         check="gradients")
        if not report.passed:
            failed.append(case.name)
    assert failed, f"{bug}: no kernel case of {prefixes} fails"

"""The contract's own fixtures, rebuilt from inputs, as golden cases.

- Loop 6 "Fixed two-query training trace": Q=2, K=3, Dk=Dv=2, rho=0.25, one realised keep
  mask, G_O from "Fixed-mask backward trace". The contract publishes P, not Q and K; the
  inputs below (Q = [[1.58, 0], [-1.08, -1.5]], K rows e1, e2, 0, key 2 illegal for query 0)
  reproduce every published number (P, Z, Pdrop, row sums, O, both D, G_S) to its last digit.
- Loop 7 "two target rows read three source rows": cross-attention with a padded source row
  that carries a finite bias of +7 and must stay excluded; values source:0 = [1, 2],
  source:1 = [2, -1]; the first target row's published P = [0.3650, 0.6350, 0] and
  O = [1.6350, 0.0951].
"""

from __future__ import annotations

import numpy as np

from refattn.bundle.golden.case import GoldenCase
from refattn.call import AttentionCall

__all__ = ["cases", "loop6_call", "loop7_call"]

LOOP6_RHO = 0.25
LOOP6_KEEP = np.array([[1, 0, 0], [0, 1, 1]], dtype=bool)
LOOP6_GRAD_OUTPUT = np.array([[[[0.7, -0.4], [-0.2, 0.9]]]])  # (B, Hq, Q, Dv)


def loop6_call() -> AttentionCall:
    """The Loop 6 two-query training call (B=1, Hq=Hkv=1, Q=2, K=3, Dk=Dv=2).

    Examples
    --------
    >>> import refattn
    >>> t = refattn.forward(loop6_call())
    >>> np.round(t.probs[0, 0], 6).tolist()
    [[0.753474, 0.246526, 0.0], [0.257122, 0.191056, 0.551822]]
    """
    q = np.array([[[[1.58, 0.0], [-1.08, -1.5]]]])  # (B, Hq, Q, Dk)
    k = np.array([[[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]])  # (B, Hkv, K, Dk)
    v = np.array([[[[1.0, -1.0], [2.0, 0.5], [-0.5, 3.0]]]])  # (B, Hkv, K, Dv)
    visible = np.array([[True, True, False], [True, True, True]])  # (Q, K)
    z = LOOP6_KEEP / (1.0 - LOOP6_RHO)  # inverted dropout: 0 or 1/(1-rho)
    return AttentionCall(q, k, v, visible=visible, dropout=z)


def loop7_call() -> AttentionCall:
    """The Loop 7 cross-attention call: two targets read three sources, source 2 is padding.

    Examples
    --------
    >>> import refattn
    >>> t = refattn.forward(loop7_call())
    >>> np.round(t.probs[0, 0, 0], 4).tolist(), np.round(t.output[0, 0, 0], 4).tolist()
    ([0.365, 0.635, 0.0], [1.635, 0.0951])
    """
    q = np.array([[[[0.3, -0.2], [1.0, 0.5]]]])  # (B, Hq, Q, Dk) target rows
    k = np.array([[[[0.5, 0.25], [0.25, -1.0], [4.0, 4.0]]]])  # (B, Hkv, K, Dk) source rows
    v = np.array([[[[1.0, 2.0], [2.0, -1.0], [100.0, 100.0]]]])  # source:2 is PAD
    # query-specific finite preference; the padded source column deliberately gets +7
    bias = np.array([[[[0.0, 0.42985, 7.0], [0.25, -0.25, 7.0]]]])  # (B, Hq, Q, K)
    visible = np.array([[[[True, True, False]]]])  # (B, 1, 1, K): source validity
    return AttentionCall(q, k, v, visible=visible, bias=bias)


def cases() -> list[GoldenCase]:
    """The contract suite (Loop 6 and Loop 7 fixtures plus engine edge cases)."""
    rng = np.random.default_rng(20261130)
    out = [
        GoldenCase(
            "loop6_two_query_training_trace", loop6_call(), LOOP6_GRAD_OUTPUT,
            "Loop 6 fixed two-query trace: rho=0.25, one realised keep mask, fixed G_O",
            ("ContractFixture", "ExplicitMultiplier", "DroppedLegalEdge", "MaskedEdge",
             "CrossAttention"),
        ),
        GoldenCase(
            "loop7_cross_attention_padded_source", loop7_call(),
            np.array([[[[0.5, -1.0], [1.5, 0.25]]]]),
            "Loop 7 cross-attention: padded source row with bias +7 stays excluded",
            ("ContractFixture", "CrossAttention", "KeyPadding", "BiasCannotRevive"),
        ),
    ]
    # An all-dropped legal row next to a dropped legal edge and a masked edge.
    q, k, v = (rng.standard_normal(s) for s in [(1, 1, 3, 4), (1, 1, 4, 4), (1, 1, 4, 3)])
    z = np.full((3, 4), 2.0)
    z[1] = 0.0  # every legal route of query 1 drops
    z[0, 2] = 0.0
    vis = np.ones((3, 4), bool)
    vis[2, 3] = False
    out.append(GoldenCase(
        "all_dropped_row", AttentionCall(q, k, v, visible=vis, dropout=z),
        rng.standard_normal((1, 1, 3, 3)),
        "Row 1 loses every legal route (p=0.5 realisation): zero output, zero gradients",
        ("AllDroppedRow", "DroppedLegalEdge", "MaskedEdge", "ExplicitMultiplier"),
    ))
    # Policy 3: an unused query row with no legal key.
    q, k, v = (rng.standard_normal(s) for s in [(2, 2, 4, 3), (2, 2, 5, 3), (2, 2, 5, 2)])
    vis = np.ones((2, 1, 4, 5), bool)
    vis[1, 0, 3] = False
    qv = np.ones((2, 1, 4, 1), bool)
    qv[1, 0, 3] = False
    qv[0, 0, 1] = False
    out.append(GoldenCase(
        "sanitize_unused_query_rows",
        AttentionCall(q, k, v, visible=vis, query_valid=qv,
                      all_masked_rows="sanitize_then_zero_invalid_query"),
        rng.standard_normal((2, 2, 4, 2)),
        "Policy 3: an empty unused row gets a temporary key; unused rows are exactly zero",
        ("QueryValid", "SanitizedRow", "AllMaskedRow"),
    ))
    # GQA with a broadcast bias, Dk != Dv, Q != K.
    q, k, v = (rng.standard_normal(s) for s in [(2, 4, 3, 5), (2, 2, 6, 5), (2, 2, 6, 3)])
    out.append(GoldenCase(
        "gqa_broadcast_bias_cross",
        AttentionCall(q, k, v, bias=rng.standard_normal((1, 4, 1, 6))),
        rng.standard_normal((2, 4, 3, 3)),
        "GQA Hq=4, Hkv=2 with a per-head key bias broadcast over B and Q; Dk != Dv, Q != K",
        ("GQA", "BiasBroadcast", "CrossAttention", "DkNotDv"),
    ))
    return out

"""Hypothesis strategies for generated refattn inputs (the one module that holds them).

Functions take keyword-only bounds with small defaults. Sections are owned by the feature that
uses them; add new ones with small edits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

# -- visibility (issue 3) ---------------------------------------------------------------------


@st.composite
def bool_relations(
    draw: st.DrawFn,
    *,
    max_batch: int = 2,
    max_heads: int = 3,
    max_q: int = 6,
    max_k: int = 6,
    broadcast: bool = True,
) -> np.ndarray:
    """A (B|1, H|1, Q, K) bool array with arbitrary truth values (True = visible)."""
    B = draw(st.integers(1, max_batch))
    H = draw(st.integers(1, max_heads))
    Q = draw(st.integers(1, max_q))
    K = draw(st.integers(1, max_k))
    if broadcast:
        B = draw(st.sampled_from([1, B]))
        H = draw(st.sampled_from([1, H]))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).random((B, H, Q, K)) < density


@st.composite
def visibility_inputs(
    draw: st.DrawFn,
    *,
    max_batch: int = 2,
    max_heads: int = 3,
    max_q: int = 6,
    max_k: int = 6,
    max_pos: int = 8,
    sizes: tuple[int, int, int, int] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``compile_visibility`` / ``relation`` (always a valid request).

    Covers key padding, causal, two-sided segments, prefix (shared or per head, never with
    causal) and windows (None sides, per-head bounds). ``sizes=(B, H, Q, K)`` fixes Q and K
    and lets B and H be 1 or the given size (terms of one composition).
    """
    if sizes is None:
        B = draw(st.integers(1, max_batch))
        Q = draw(st.integers(1, max_q))
        K = draw(st.integers(1, max_k))
    else:
        B = draw(st.sampled_from(sorted({1, sizes[0]})))
        Q, K = sizes[2], sizes[3]
        max_heads = sizes[1]
    ints = st.integers(-2, max_pos)
    q_pos = np.array(draw(st.lists(st.lists(ints, min_size=Q, max_size=Q),
                                   min_size=B, max_size=B)), dtype=np.int64)
    k_pos = np.array(draw(st.lists(st.lists(ints, min_size=K, max_size=K),
                                   min_size=B, max_size=B)), dtype=np.int64)
    key_valid = np.array(draw(st.lists(st.lists(st.booleans(), min_size=K, max_size=K),
                                       min_size=B, max_size=B)), dtype=bool)
    kwargs: dict[str, Any] = {"q_pos": q_pos, "k_pos": k_pos, "key_valid": key_valid}
    per_head = max_heads > 1 and draw(st.booleans())
    if sizes is not None:
        H = max_heads if per_head else 1
    else:
        H = draw(st.integers(2, max_heads)) if per_head else 1
    if draw(st.booleans()):
        segs = st.integers(0, 2)
        kwargs["q_segment"] = np.array(draw(st.lists(st.lists(segs, min_size=Q, max_size=Q),
                                                     min_size=B, max_size=B)), dtype=np.int64)
        kwargs["k_segment"] = np.array(draw(st.lists(st.lists(segs, min_size=K, max_size=K),
                                                     min_size=B, max_size=B)), dtype=np.int64)
    topology = draw(st.sampled_from(["bidirectional", "causal", "prefix"]))
    if topology == "causal":
        kwargs["causal"] = True
    elif topology == "prefix":
        shape = (B, H) if per_head else (B,)
        kwargs["prefix_length"] = np.array(
            draw(st.lists(st.integers(0, max_pos), min_size=int(np.prod(shape)),
                          max_size=int(np.prod(shape))))
        ).reshape(shape)
    if per_head or draw(st.booleans()):
        def side() -> Any:
            kinds = ["none", "int", "heads", "heads"] if per_head else ["none", "int"]
            kind = draw(st.sampled_from(kinds))
            if kind == "none":
                return None
            if kind == "int":
                return draw(st.integers(0, 4))
            return np.array(draw(st.lists(st.integers(0, 4), min_size=H, max_size=H)))
        left, right = side(), side()
        if left is None and right is None:
            left = draw(st.integers(0, 4))
        kwargs["window"] = (left, right)
    return kwargs


@st.composite
def composed_relations(draw: st.DrawFn, *, max_terms: int = 3, max_depth: int = 2) -> Any:
    """A union / intersection of coordinate relations (``a | b``, ``a & b``, nested).

    The terms share Q and K; each one's batch and head axes are 1 or the composition's.
    """
    from refattn.masks import relation

    sizes = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 6)),
             draw(st.integers(1, 6)))

    def term(depth: int) -> Any:
        if depth >= max_depth or draw(st.booleans()):
            return relation(**draw(visibility_inputs(sizes=sizes)))
        n = draw(st.integers(2, max_terms))
        parts = [term(depth + 1) for _ in range(n)]
        op = draw(st.sampled_from(["or", "and"]))
        out = parts[0]
        for p in parts[1:]:
            out = (out | p) if op == "or" else (out & p)
        return out

    first, second = term(1), term(1)
    return (first | second) if draw(st.booleans()) else (first & second)


@st.composite
def packed_lengths(draw: st.DrawFn, *, max_segments: int = 4, max_len: int = 5) -> list[int]:
    """Example lengths for packing (each >= 1)."""
    return draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_segments))


# -- softmax rows (issue 4) -------------------------------------------------------------------


def score_rows(*, max_k: int = 8, bound: float = 30.0) -> st.SearchStrategy[np.ndarray]:
    """One finite float64 score row (K,) of 1..max_k legal keys in [-bound, bound]."""
    return st.lists(st.floats(-bound, bound, allow_nan=False), min_size=1, max_size=max_k).map(
        lambda xs: np.array(xs, dtype=np.float64)
    )


def dyadic_score_rows(*, max_k: int = 8) -> st.SearchStrategy[np.ndarray]:
    """Rows of multiples of 2**-20 in [-64, 64]: shifting them by an integer up to 2**20 and
    subtracting their max are exact, so translation can be tested bit for bit."""
    return st.lists(st.integers(-(2**26), 2**26), min_size=1, max_size=max_k).map(
        lambda xs: np.array(xs, dtype=np.float64) * 2.0**-20
    )


@st.composite
def rows_and_partitions(
    draw: st.DrawFn, *, max_k: int = 24, bound: float = 700.0
) -> tuple[np.ndarray, list[int]]:
    """A finite row (K,) (|score| <= bound, so native exponentials may overflow) and tile sizes
    (positive, summing to K) of an arbitrary partition of it."""
    k = draw(st.integers(1, max_k))
    row = np.array(draw(st.lists(st.floats(-bound, bound, allow_nan=False), min_size=k,
                                 max_size=k)))
    cuts = sorted(set(draw(st.lists(st.integers(1, k - 1), max_size=k - 1)))) if k > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, k], strict=True)]
    return row, sizes


# -- dropout stream tiles (issue 4) -----------------------------------------------------------


@st.composite
def score_shapes_and_tiles(
    draw: st.DrawFn, *, max_batch: int = 2, max_heads: int = 3, max_q: int = 6, max_k: int = 13
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int, int, int]]:
    """A (B, Hq, Q, K) shape and one tile (b, h, i0, i1, j0, j1) inside it; tiles may be empty
    and are in general not aligned to the 4-key groups of one Philox call."""
    B, Hq = draw(st.integers(1, max_batch)), draw(st.integers(1, max_heads))
    Q, K = draw(st.integers(1, max_q)), draw(st.integers(1, max_k))
    b, h = draw(st.integers(0, B - 1)), draw(st.integers(0, Hq - 1))
    i0 = draw(st.integers(0, Q))
    j0 = draw(st.integers(0, K))
    tile = (b, h, i0, draw(st.integers(i0, Q)), j0, draw(st.integers(j0, K)))
    return (B, Hq, Q, K), tile


# -- gradient-checked attention calls (issue 5) -----------------------------------------------


@st.composite
def attention_calls(
    draw: st.DrawFn,
    *,
    max_batch: int = 2,
    max_kv_heads: int = 2,
    max_group: int = 2,
    max_len: int = 4,
    max_width: int = 4,
) -> Any:
    """A small random :class:`refattn.AttentionCall` for element-wise gradient checks.

    Varies B, Hkv, the GQA group, Q != K, Dk != Dv, the value scale of q/k (peaked or flat
    rows), an optional bias (full or broadcast over B and Q), an optional random visibility
    (every row keeps at least one legal key) and an optional explicit dropout multiplier with
    dropped legal edges. Sizes stay tiny so full mode checks every element quickly.
    """
    from refattn import AttentionCall

    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_kv_heads))
    Hq = Hkv * draw(st.integers(1, max_group))
    Q, K = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    Dk, Dv = draw(st.integers(1, max_width)), draw(st.integers(1, max_width))
    seed = draw(st.integers(0, 2**32 - 1))
    spread = draw(st.sampled_from([0.3, 1.0, 3.0]))  # flat, typical and peaked rows
    rng = np.random.default_rng(seed)
    q = spread * rng.standard_normal((B, Hq, Q, Dk))
    k = spread * rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    kw: dict[str, Any] = {}
    bias = draw(st.sampled_from(["none", "full", "broadcast"]))
    if bias == "full":
        kw["bias"] = rng.standard_normal((B, Hq, Q, K))
    elif bias == "broadcast":
        kw["bias"] = rng.standard_normal((1, Hq, 1, K))
    if draw(st.booleans()):
        vis = rng.random((B, Hq, Q, K)) < 0.7
        vis[..., rng.integers(0, K)] = True  # every row keeps a legal key
        kw["visible"] = vis
    if draw(st.booleans()):
        kw["dropout"] = (rng.random((B, Hq, Q, K)) >= 0.25) / 0.75  # inverted, p = 0.25
    return AttentionCall(q, k, v, **kw)


# -- engine backends: every call feature at once (issue 8) ------------------------------------


@st.composite
def engine_calls(
    draw: st.DrawFn,
    *,
    max_batch: int = 2,
    max_heads: int = 4,
    max_len: int = 12,
    max_width: int = 5,
) -> Any:
    """A random dot-score :class:`refattn.AttentionCall` touching every feature a backend reads.

    Visibility is absent, a dense (possibly broadcast) mask, or a
    :class:`~refattn.masks.VisibilityRelation` (from :func:`visibility_inputs`, so causal,
    prefix, segments, per-head windows and key padding); GQA is grouped or an explicit
    ``head_map``; bias is absent or one of several broadcast shapes; dropout is absent, an
    explicit multiplier (full or broadcast) or a :class:`refattn.dropout.Philox` stream; rows
    without a legal key get ``sanitize_then_zero_invalid_query`` and an unused query, and
    other rows may be unused too.
    """
    from refattn import AttentionCall
    from refattn.dropout import Philox
    from refattn.masks import relation

    kind = draw(st.sampled_from(["all", "dense", "relation"]))
    rel = None
    if kind == "relation":
        rel = relation(**draw(visibility_inputs(max_batch=max_batch, max_heads=max_heads,
                                                max_q=max_len, max_k=max_len)))
        B, H_rel, Q, K = rel.shape
    else:
        B, H_rel = draw(st.integers(1, max_batch)), 1
        Q, K = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    Hq = H_rel if H_rel > 1 else draw(st.integers(1, max_heads))
    Hkv = draw(st.sampled_from([d for d in range(1, Hq + 1) if Hq % d == 0]))
    Dk, Dv = draw(st.integers(1, max_width)), draw(st.integers(1, max_width))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.3, 1.0, 4.0]))  # flat, typical and peaked rows
    q = spread * rng.standard_normal((B, Hq, Q, Dk))
    k = spread * rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["head_map"] = rng.integers(0, Hkv, Hq)
    full = (B, Hq, Q, K)
    if kind == "relation":
        kw["visible"] = rel
        legal = np.broadcast_to(rel.dense(), full)
    elif kind == "dense":
        shape = draw(st.sampled_from([full, (B, 1, Q, K), (1, Hq, Q, K), (Q, K), (B, 1, 1, K)]))
        kw["visible"] = rng.random(shape) < draw(st.sampled_from([0.3, 0.8]))
        legal = np.broadcast_to(kw["visible"], full)
    else:
        legal = np.ones(full, dtype=bool)
    empty = ~legal.any(axis=-1)  # (B, Hq, Q)
    used = rng.random((B, Q)) < draw(st.sampled_from([0.7, 1.0]))
    if empty.any():
        kw["all_masked_rows"] = "sanitize_then_zero_invalid_query"
        used &= ~empty.any(axis=1)
    kw["query_valid"] = used[:, None, :, None]
    bias = draw(st.sampled_from(["none", "full", "heads", "keys", "qk", "rows"]))
    shapes = {"full": full, "heads": (1, Hq, 1, K), "keys": (B, 1, 1, K), "qk": (Q, K),
              "rows": (B, Hq, Q, 1)}
    if bias != "none":
        kw["bias"] = rng.standard_normal(shapes[bias])
    dropout = draw(st.sampled_from(["none", "full", "broadcast", "philox"]))
    if dropout == "full":
        kw["dropout"] = (rng.random(full) >= 0.3) / 0.7
    elif dropout == "broadcast":
        kw["dropout"] = rng.uniform(-1.0, 2.0, (1, 1, Q, K))  # any finite real is allowed
    elif dropout == "philox":
        kw["dropout"] = Philox(draw(st.sampled_from([0.0, 0.1, 0.5, 0.9])),
                               draw(st.integers(0, 2**64 - 1)),
                               offset=draw(st.integers(0, 2**32 - 1)))
    return AttentionCall(q, k, v, **kw)


# -- the exact backend decides every call (issue 25) ------------------------------------------


@st.composite
def exact_calls(
    draw: st.DrawFn,
    *,
    max_batch: int = 2,
    max_kv_heads: int = 2,
    max_group: int = 2,
    max_len: int = 4,
    max_width: int = 3,
) -> tuple[Any, np.ndarray]:
    """A small valid call over every feature, and its grad_output (B, Hq, Q, Dv).

    Score family (dot, bilinear shared or per head, additive, cosine with eps drawn from
    [1e-8, 2] and possibly a clamped row), scale from [0.05, 3] and its placement, softcap
    from [0.3, 60], bias (full, broadcast, ALiBi slopes from [0, 1] per head or per batch row
    and head), sink logits from [-3, 3], dropout (explicit with p from [0, 0.9], Philox, or a
    real multiplier), dense or causal masks and unused rows, GQA and head maps, Q != K. Values
    are continuous normals, multiples of 1/4 (exact sums that land on ties), repeated values
    (equal scores, parallel rows), of widely spread exponents, tiny (subnormal products) or
    huge; q may repeat k's rows. A call the gate refuses (an overflow bound) is rejected.
    """
    from refattn import AttentionCall
    from refattn.call.bias import alibi
    from refattn.call.scores import Additive, Bilinear, Cosine
    from refattn.dropout import Philox
    from refattn.masks import relation

    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_kv_heads))
    Hq = Hkv * draw(st.integers(1, max_group))
    Q, K = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    Dk, Dv = draw(st.integers(1, max_width)), draw(st.integers(1, max_width))
    kind = draw(st.sampled_from(["normal", "dyadic", "repeated", "wide", "tiny", "huge"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def values(*shape: int) -> np.ndarray:
        if kind == "normal":
            return rng.standard_normal(shape)
        if kind == "dyadic":
            return rng.integers(-6, 7, shape) / 4.0
        if kind == "wide":  # exponents from 2**-300 to 2**20: long exact sums, exp(-huge)
            return rng.standard_normal(shape) * 2.0 ** rng.integers(-300, 21, shape)
        if kind == "tiny":  # products in the subnormal range and below
            return rng.standard_normal(shape) * 2.0 ** rng.integers(-1074, -400, shape)
        if kind == "huge":  # scores towards the largest binary64 the gate allows
            return rng.standard_normal(shape) * 2.0 ** rng.integers(100, 500, shape)
        return rng.choice(rng.standard_normal(2), shape)

    q, k, v = values(B, Hq, Q, Dk), values(B, Hkv, K, Dk), values(B, Hkv, K, Dv)
    if Q <= K and Hq == Hkv and draw(st.booleans()):
        q = np.array(k[:, :, :Q])  # self attention: q's rows are k's rows
    kw: dict[str, Any] = {}
    family = draw(st.sampled_from(["dot", "bilinear", "additive", "cosine"]))
    if family == "bilinear":
        kw["score"] = Bilinear(values(Dk, Dk) if draw(st.booleans()) else values(Hq, Dk, Dk))
    elif family == "additive":
        Da = draw(st.integers(1, 3))
        kw["score"] = Additive(values(Hq, Da, Dk), values(Hq, Da, Dk), values(Hq, Da),
                               values(Hq, Da))
    elif family == "cosine":
        eps = draw(st.floats(1e-8, 2.0))
        kw["score"] = Cosine(eps)
        if draw(st.booleans()):  # a row below eps: the clamped branch
            q[..., 0, :] *= draw(st.floats(0.0, 0.9)) * eps / max(np.abs(q[..., 0, :]).max(),
                                                                 1e-300)
    if family != "dot" or draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 3.0))
    if family in ("dot", "bilinear"):
        kw["scale_placement"] = draw(st.sampled_from(["post", "q", "k", "split"]))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.3, 60.0))
    full = (B, Hq, Q, K)
    bias = draw(st.sampled_from(["none", "full", "broadcast", "alibi", "alibi_batch"]))
    if bias == "full":
        kw["bias"] = values(*full)
    elif bias == "broadcast":
        kw["bias"] = values(1, Hq, 1, K)
    elif bias != "none":
        n = Hq * (B if bias == "alibi_batch" else 1)
        slopes = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
        kw["bias"] = alibi(slopes.reshape((B, Hq) if bias == "alibi_batch" else (Hq,)),
                           np.arange(Q) + (K - Q), np.arange(K))
    if draw(st.booleans()):
        kw["sink"] = np.array(draw(st.lists(st.floats(-3.0, 3.0), min_size=Hq, max_size=Hq)))
    mask = draw(st.sampled_from(["none", "dense", "causal"]))
    if mask == "dense":
        kw["visible"] = rng.random(full) < 0.6
    elif mask == "causal":
        kw["visible"] = relation(np.tile(np.arange(Q) + (K - Q), (B, 1)),
                                 np.tile(np.arange(K), (B, 1)), causal=True)
    used = rng.random((B, 1, Q, 1)) < 0.7 if draw(st.booleans()) else np.ones((B, 1, Q, 1),
                                                                            dtype=bool)
    if mask != "none" and "sink" not in kw:  # a row without a legal key must be unused
        dense = kw["visible"] if mask == "dense" else kw["visible"].dense()
        used &= np.broadcast_to(dense, full).any(axis=-1).all(axis=1)[:, None, :, None]
    if not used.all():
        kw["query_valid"] = used
        kw["all_masked_rows"] = "sanitize_then_zero_invalid_query"
    dropout = draw(st.sampled_from(["none", "explicit", "philox", "real"]))
    if dropout != "none":
        p = draw(st.floats(0.0, 0.9))
        if dropout == "explicit":
            kw["dropout"] = (rng.random(full) >= p) / (1.0 - p)
        elif dropout == "philox":
            kw["dropout"] = Philox(p, draw(st.integers(0, 2**64 - 1)))
        else:
            kw["dropout"] = rng.uniform(-1.0, 2.0, (1, 1, Q, K))
    if Hq > Hkv and draw(st.booleans()):
        kw["head_map"] = rng.integers(0, Hkv, Hq)
    from refattn import RefAttnError
    from refattn.call.hazards import check_backward_overflow

    try:
        call = AttentionCall(q, k, v, **kw)
    except RefAttnError:
        assume(False)  # e.g. huge values whose scores could overflow float64
    g_o = rng.standard_normal((B, Hq, Q, Dv)) if kind == "huge" else values(B, Hq, Q, Dv)
    try:
        check_backward_overflow(call, g_o)  # refattn.backward's own up-front check
    except RefAttnError:
        assume(False)
    return call, g_o


# -- extreme softcaps, scales and logits (issue 40) -------------------------------------------

#: softcaps at the edges of binary64: the smallest subnormal, subnormals whose 1 / c overflows,
#: the largest subnormal and smallest normal (2^-1022), tiny and huge normals, the largest finite
EXTREME_SOFTCAPS = (5e-324, 1e-320, 1e-310, 2.0**-1022 - 2.0**-1074, 2.0**-1022, 1e-300, 1e-8,
                    0.5, 30.0, 1e8, 1e300, 1.7976931348623157e308)


@st.composite
def extreme_softcap_calls(
    draw: st.DrawFn,
    *,
    max_batch: int = 2,
    max_group: int = 2,
    max_len: int = 5,
    max_width: int = 3,
) -> tuple[dict[str, Any], np.ndarray]:
    """Keywords of a small dot-score :class:`refattn.AttentionCall`, and its grad_output.

    The softcap is one of :data:`EXTREME_SOFTCAPS` or any positive finite float (subnormals
    included: the gate refuses those, for every backend); the scale runs from 5e-324 to 1e300,
    or equals the softcap (scores / softcap is then q.k, not saturated however small the
    softcap), at any placement; q and k are
    normals times 10^e with e from -160 to 150 (subnormal scores, large logits); K >= 2 (a
    softmax with a gradient); optional: GQA, a bias over keys, a dense mask with a legal key
    in every row. The keywords are returned rather than the
    call: the gate may refuse them (scores that could overflow), which the test checks too.
    Returns ``(keywords, g_o)``, g_o (B, Hq, Q, Dv).
    """
    B, Hkv = draw(st.integers(1, max_batch)), 1
    Hq = Hkv * draw(st.integers(1, max_group))
    Q, K = draw(st.integers(1, max_len)), draw(st.integers(2, max_len))
    Dk, Dv = draw(st.integers(1, max_width)), draw(st.integers(1, max_width))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    softcap = draw(st.sampled_from(EXTREME_SOFTCAPS)
                   | st.floats(5e-324, 1.7976931348623157e308, allow_subnormal=True))
    scale = draw(st.sampled_from([None, 5e-324, 1e-310, 1e-300, 1e-150, 1e-8, 1.0, 1e8, 1e150,
                                  1e300]))
    e_q, e_k = (draw(st.sampled_from([-160, -20, 0, 0, 2, 5, 20, 150])) for _ in range(2))
    kw: dict[str, Any] = {
        "q": rng.standard_normal((B, Hq, Q, Dk)) * 10.0**e_q,
        "k": rng.standard_normal((B, Hkv, K, Dk)) * 10.0**e_k,
        "v": rng.standard_normal((B, Hkv, K, Dv)),
        "softcap": softcap,
        "scale": softcap if scale is None else scale,  # None: x / c is the dot product
        "scale_placement": draw(st.sampled_from(["post", "post", "q", "k", "split"])),
    }
    if draw(st.booleans()):
        kw["bias"] = rng.standard_normal((1, Hq, 1, K))
    if draw(st.booleans()):
        visible = rng.random((B, Hq, Q, K)) < 0.6
        visible[..., rng.integers(0, K)] = True  # every row keeps a legal key
        kw["visible"] = visible
    return kw, rng.standard_normal((B, Hq, Q, Dv))

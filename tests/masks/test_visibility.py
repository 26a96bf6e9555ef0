"""Issue 3: the visibility compiler built from coordinates (contract "Rectangular causal
alignment", "Prefix and window masks", "One predicate compiler", "Causal is a coordinate
relation")."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.linalg import block_diag

from refattn import RefAttnError
from refattn.cli import main
from refattn.masks import (
    VisibilityRelation,
    Window,
    causal,
    compile_visibility,
    empty_rows,
    from_positions,
    relation,
    render,
    window_from_inclusive,
    window_to_inclusive,
)

# The contract's two Q=2, K=5 drawings (published numbers).
UPPER_LEFT_2x5 = [[1, 0, 0, 0, 0],
                  [1, 1, 0, 0, 0]]
LOWER_RIGHT_2x5 = [[1, 1, 1, 1, 0],
                   [1, 1, 1, 1, 1]]


def as_int(vis: np.ndarray) -> list:
    return vis.astype(int).tolist()


# -- rectangular causal alignment -----------------------------------------------------------
def test_contract_rectangular_causal_upper_left():
    rel = causal(2, 5, alignment="upper_left")
    assert as_int(rel.dense()[0, 0]) == UPPER_LEFT_2x5
    assert rel.alignment == "upper_left" and rel.q_pos.tolist() == [[0, 1]]


def test_contract_rectangular_causal_lower_right():
    rel = causal(2, 5, alignment="lower_right")
    assert as_int(rel.dense()[0, 0]) == LOWER_RIGHT_2x5
    # "The second relation follows from coordinates": q_pos = arange(q_len) + past_len
    assert rel.q_pos.tolist() == [[3, 4]]
    assert as_int(from_positions(np.arange(2) + 3, np.arange(5)).dense()[0, 0]) == LOWER_RIGHT_2x5


def test_render_draws_the_contract_matrix():
    drawn = render(causal(2, 5, alignment="upper_left").dense()[0, 0])
    assert drawn == "q\\k  0 1 2 3 4\n 0   1 0 0 0 0\n 1   1 1 0 0 0"
    lr = render(causal(2, 5, alignment="lower_right").dense()[0, 0], q_labels=[3, 4])
    lines = lr.splitlines()
    assert lines[0].split() == ["q_abs\\k_abs", "0", "1", "2", "3", "4"]
    assert [line.split() for line in lines[1:]] == [["3", "1", "1", "1", "1", "0"],
                                                    ["4", "1", "1", "1", "1", "1"]]


def test_decode_at_absolute_position_127_reads_keys_0_to_127():
    rel = from_positions([127], np.arange(128))
    assert rel.dense().shape == (1, 1, 1, 128)
    assert rel.dense().all()
    assert rel.layout == "cache" and rel.alignment == "explicit_positions"
    # the bug the contract names: a local-row-zero (upper-left) triangle reads key 0 only
    wrong = causal(1, 128, alignment="upper_left").dense()[0, 0, 0]
    assert np.flatnonzero(wrong).tolist() == [0]
    # a static cache buffer: 200 allocated slots, 128 initialised; extent says nothing
    key_valid = np.arange(200) < 128
    buffered = from_positions([127], np.arange(200), key_valid=key_valid).dense()[0, 0, 0]
    assert np.flatnonzero(buffered).tolist() == list(range(128))


@pytest.mark.parametrize("Q,K", [(1, 1), (3, 3), (2, 7), (4, 6)])
def test_lower_right_is_upper_left_with_a_cache_offset(Q, K):
    lr = causal(Q, K, alignment="lower_right").dense()[0, 0]
    ul = causal(Q, K, alignment="upper_left").dense()[0, 0]
    assert np.array_equal(lr, np.tril(np.ones((Q, K), bool), k=K - Q))
    assert np.array_equal(ul, np.tril(np.ones((Q, K), bool)))
    assert np.array_equal(lr, ul) == (Q == K)


def test_lower_right_with_more_queries_than_keys_has_empty_rows():
    rel = causal(3, 2, alignment="lower_right")
    assert rel.q_pos.tolist() == [[-1, 0, 1]]
    assert [tuple(r) for r in empty_rows(rel)] == [(0, 0, 0)]


# -- the compiler ---------------------------------------------------------------------------
def test_packed_segments_give_block_diagonal_causal():
    # the contract's packed example
    segment = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]])
    position = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]])
    vis = compile_visibility(position, position, None, causal=True,
                             q_segment=segment, k_segment=segment)
    expected = block_diag(*(np.tril(np.ones((n, n))) for n in (3, 4, 2, 3))).astype(bool)
    assert np.array_equal(vis[0, 0], expected)
    # causal alone lets the second example read the first
    leaky = compile_visibility(position, position, None, causal=True)[0, 0]
    assert leaky[3, 0] and not vis[0, 0, 3, 0]


def test_key_padding_is_a_column_restriction():
    key_valid = np.array([[True, True, False], [True, False, False]])
    pos = np.arange(3)[None].repeat(2, 0)
    vis = compile_visibility(pos, pos, key_valid)
    assert vis.shape == (2, 1, 3, 3)
    assert np.array_equal(vis, np.broadcast_to(key_valid[:, None, None, :], vis.shape))


def test_prefix_lm_relation():
    pos = np.arange(5)[None]
    vis = compile_visibility(pos, pos, None, prefix_length=2)[0, 0]
    # prefix rows see the whole prefix and nothing after; later rows are causal
    assert as_int(vis) == [[1, 1, 0, 0, 0],
                           [1, 1, 0, 0, 0],
                           [1, 1, 1, 0, 0],
                           [1, 1, 1, 1, 0],
                           [1, 1, 1, 1, 1]]
    # the prefix-to-prefix edge (0, 1) is exactly what a separate causal flag would remove
    assert vis[0, 1] and not compile_visibility(pos, pos, None, causal=True)[0, 0, 0, 1]


def test_prefix_per_batch_row():
    pos = np.arange(3)[None].repeat(2, 0)
    vis = compile_visibility(pos, pos, None, prefix_length=np.array([0, 3]))
    assert np.array_equal(vis[0, 0], np.tril(np.ones((3, 3), bool)))  # P=0: plain causal
    assert vis[1, 0].all()  # P=Q: fully bidirectional


@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 1), (0, 2), (None, 1), (3, None)])
def test_window_counts_keys_strictly_before_and_after(left, right):
    n = 6
    pos = np.arange(n)[None]
    vis = compile_visibility(pos, pos, None, window=(left, right))[0, 0]
    ones = np.ones((n, n), bool)
    band = np.tril(ones, k=n if right is None else right)
    band &= np.triu(ones, k=-n if left is None else -left)
    assert np.array_equal(vis, band)
    assert vis.diagonal().all()  # the diagonal is always inside the window


def test_causal_sliding_window_from_the_inclusive_convention():
    # xFormers / cuDNN: a window of 3 counts the query itself -> 2 keys strictly before
    assert window_from_inclusive(3, 1) == Window(2, 0)
    assert window_to_inclusive(Window(2, 0)) == Window(3, 1)
    pos = np.arange(6)[None]
    inc = relation(pos, pos, causal=True, window=(3, 1), window_convention="includes_query")
    exc = relation(pos, pos, causal=True, window=(2, 0))
    assert np.array_equal(inc.dense(), exc.dense())
    assert (inc.dense()[0, 0].sum(axis=1) <= 3).all()
    m = inc.manifest()
    assert m["window_convention"] == "includes_query"
    assert m["window"] == {"left": 2, "right": 0, "convention": "excludes_query", "given": [3, 1]}
    assert exc.manifest()["window_convention"] == "excludes_query"
    assert relation(pos, pos, causal=True).window_convention is None


def test_window_conversion_per_head():
    w = window_from_inclusive(np.array([1, 4]), None)
    assert w.left.tolist() == [0, 3] and w.right is None
    assert window_to_inclusive(w).left.tolist() == [1, 4]


def test_window_bounds_beyond_int64_are_rejected_not_wrapped():
    # uint64 2**63 used to become -2**63 in astype(int64) (an "unbounded" negative side)
    big = np.array([2**63, 1], dtype=np.uint64)
    with pytest.raises(RefAttnError, match=r"window: left is 9223372036854775808, expected <="):
        window_from_inclusive(big, None)
    top = np.iinfo(np.int64).max
    with pytest.raises(RefAttnError, match=r"window: right is 9223372036854775807"):
        window_to_inclusive((0, top))  # + 1 would overflow
    assert window_to_inclusive((0, top - 1)).right == top
    assert window_from_inclusive(np.array([top], dtype=np.uint64), None).left.tolist() == [top - 1]


def test_per_head_windows_give_a_head_axis():
    pos = np.arange(5)[None]
    lefts = np.array([0, 1, 4])
    rel = relation(pos, pos, causal=True, window=(lefts, 0))
    vis = rel.dense()
    assert vis.shape == (1, 3, 5, 5) and rel.head_sharing == "per_head"
    for h, left in enumerate(lefts):
        single = compile_visibility(pos, pos, None, causal=True, window=(int(left), 0))
        assert np.array_equal(vis[0, h], single[0, 0])


def test_per_head_right_bounds():
    pos = np.arange(4)[None]
    vis = compile_visibility(pos, pos, None, window=(0, np.array([0, 2])))
    assert vis.shape == (1, 2, 4, 4)
    assert np.array_equal(vis[0, 0], np.eye(4, dtype=bool))
    assert np.array_equal(vis[0, 1], np.triu(np.tril(np.ones((4, 4), bool), k=2)))


def test_per_head_prefix():
    pos = np.arange(4)[None]
    vis = compile_visibility(pos, pos, None, prefix_length=np.array([[1, 3]]))
    assert vis.shape == (1, 2, 4, 4)
    for h, P in enumerate((1, 3)):
        assert np.array_equal(vis[0, h], compile_visibility(pos, pos, None, prefix_length=P)[0, 0])


def test_tile_matches_dense_without_building_it():
    pos = np.arange(7)[None].repeat(2, 0)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    rel = relation(pos, pos, np.arange(7)[None].repeat(2, 0) < 6, causal=True,
                   q_segment=seg, k_segment=seg, window=(np.array([1, 5]), 0))
    dense = rel.dense()
    for b in range(2):
        for h in range(2):
            for i0, i1, j0, j1 in [(0, 7, 0, 7), (2, 5, 1, 3), (4, 4, 0, 7), (6, 7, 6, 7)]:
                assert np.array_equal(rel.tile(b, i0, i1, j0, j1, h=h),
                                      dense[b, h, i0:i1, j0:j1])


def test_cross_attention_has_no_target_triangle():
    tgt = np.arange(3)[None]
    src = np.arange(5)[None]
    src_valid = np.array([[True, True, True, False, False]])
    vis = compile_visibility(tgt, src, src_valid)[0, 0]
    assert vis.shape == (3, 5) and (vis == src_valid[0]).all()


# -- labels and manifest --------------------------------------------------------------------
def test_labels_are_inferred_and_checked():
    pos = np.arange(4)[None]
    seg = np.array([[0, 0, 1, 1]])
    assert relation(pos, pos).layout == "padded"
    assert relation(pos, pos).alignment == "none"
    assert relation(pos, pos, q_segment=seg, k_segment=seg).layout == "packed"
    assert relation(pos, pos, causal=True).alignment == "explicit_positions"
    assert relation(pos, pos, causal=True, alignment="upper_left").alignment == "upper_left"
    # a square relation is both upper-left and lower-right
    assert relation(pos, pos, causal=True, alignment="lower_right").alignment == "lower_right"
    assert causal(2, 5, alignment="lower_right").layout == "cache"
    assert relation(pos, pos, prefix_length=1).topology == "prefix"


def _relations() -> list[VisibilityRelation]:
    pos = np.arange(5)[None].repeat(2, 0)
    seg = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    kv = np.array([[True] * 5, [True, True, True, False, False]])
    return [
        causal(2, 5, alignment="lower_right"),
        relation(pos, pos, kv, causal=True, q_segment=seg, k_segment=seg),
        relation(pos, pos, prefix_length=np.array([[1, 2, 3], [0, 5, 2]])),
        relation(pos, pos, causal=True, window=(np.array([2, 1]), None),
                 window_convention="includes_query"),
        relation(pos, pos, kv, window=(0, 2)),
    ]


@pytest.mark.parametrize("index", range(5))
def test_manifest_is_json_and_rebuilds_the_relation(index):
    rel = _relations()[index]
    text = json.dumps(rel.manifest(), allow_nan=False)
    again = VisibilityRelation.from_manifest(json.loads(text))
    assert np.array_equal(again.dense(), rel.dense())
    assert again.manifest() == rel.manifest()


def test_manifest_records_the_handoff_fields():
    m = _relations()[1].manifest()
    assert m["semantic_polarity"] == "true_means_legal"
    assert m["layout"] == "packed" and m["topology"] == "causal"
    assert m["head_sharing"] == "shared" and m["shape"] == [2, 1, 5, 5]
    assert m["segments"]["q"] == [[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]
    assert m["key_valid"]["values"][1] == [True, True, True, False, False]
    assert _relations()[2].manifest()["head_sharing"] == "per_head"


def test_empty_rows_lists_every_row():
    vis = np.ones((2, 2, 3, 4), bool)
    vis[0, 1, 2] = False
    vis[1, 0, 0] = False
    assert [tuple(r) for r in empty_rows(vis)] == [(0, 1, 2), (1, 0, 0)]
    assert empty_rows(np.ones((3, 3), bool)) == []


# -- command line ---------------------------------------------------------------------------
def test_cli_mask_prints_the_lower_right_matrix(capsys):
    assert main(["mask", "--q", "2", "--k", "5", "--causal", "lower_right"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1:] for line in lines[1:]] == [
        ["1", "1", "1", "1", "0"], ["1", "1", "1", "1", "1"]]
    assert [line.split()[0] for line in lines[1:]] == ["3", "4"]


def test_cli_mask_upper_left_is_the_contract_drawing(capsys):
    assert main(["mask", "--q", "2", "--k", "5", "--causal", "upper_left"]) == 0
    assert capsys.readouterr().out == "q\\k  0 1 2 3 4\n 0   1 0 0 0 0\n 1   1 1 0 0 0\n"


def test_cli_mask_packed_and_manifest(capsys):
    assert main(["mask", "--lengths", "2,1", "--causal", "upper_left", "--manifest"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["layout"] == "packed" and m["segments"]["q"] == [[0, 0, 1]]
    assert main(["mask", "--q", "4", "--causal", "upper_left", "--window", "3", "1",
                 "--window-convention", "includes_query"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[1:] for r in rows][-1] == ["0", "1", "1", "1"]


def test_cli_mask_reports_empty_rows_and_errors(capsys):
    assert main(["mask", "--q", "3", "--k", "2", "--causal", "lower_right"]) == 0
    assert "rows with no legal key: (b=0, h=0, i=0)" in capsys.readouterr().out
    assert main(["mask", "--q", "3", "--prefix", "1", "--causal", "upper_left"]) == 2
    assert "prefix_length with causal=True" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["mask"], "--q/--k: give at least one of them (or --lengths)"),
    (["mask", "--q", "2", "--q-start", "3", "--causal", "upper_left"],
     "--q-start: explicit positions replace --causal ALIGNMENT; pass one of them"),
    (["mask", "--lengths", "2,3", "--q", "4"], "--lengths: packed Q and K are the total length 5"),
    (["mask", "--lengths", "2,3", "--causal", "lower_right"],
     "--lengths: packed examples use per-example positions"),
    (["mask", "--lengths", "0,0"], "lengths: every one of the 2 sequences is empty"),
    (["mask", "--q", "3", "--window", "none", "none"], "window: (None, None) restricts nothing"),
])
def test_cli_mask_rejections(argv, message, capsys):
    assert main(argv) == 2
    assert f"refattn mask: error: {message}" in capsys.readouterr().err


# -- every rejection, with its message ------------------------------------------------------
P = np.arange(3)[None]
S = np.array([[0, 0, 1]])

REJECTIONS = [
    (lambda: causal(2, 5, alignment="lower"),
     "alignment: expected one of 'upper_left', 'lower_right', got 'lower'"),
    (lambda: causal(2, 5), "causal: missing a required argument: 'alignment'"),
    (lambda: causal(0, 5, alignment="upper_left"), "q_len: 0 is outside the allowed range"),
    (lambda: causal(2, 2.0, alignment="upper_left"), "k_len: expected an integer below"),
    (lambda: compile_visibility(P, P, None, causal=True, prefix_length=1),
     "prefix_length with causal=True: a prefix topology already defines its own causal region"),
    (lambda: compile_visibility(P, P, None, q_segment=S),
     r"q_segment/k_segment: pass both or neither \(got only q_segment\)"),
    (lambda: compile_visibility(P, P, None, k_segment=S),
     r"pass both or neither \(got only k_segment\)"),
    (lambda: compile_visibility(P.astype(float), P, None),
     "q_pos: expected an integer array, got dtype float64"),
    (lambda: compile_visibility(np.arange(3), P, None),
     r"q_pos: expected shape \[B,Q\], got \[3\]"),
    (lambda: compile_visibility(P, np.zeros((2, 3), int), None),
     "k_pos: batch axis B=2 must equal q_pos's B=1"),
    (lambda: compile_visibility(np.zeros((1, 0), int), P, None),
     "q_pos: every axis must be non-empty"),
    (lambda: compile_visibility(P, P, np.ones((1, 3), int)),
     "key_valid: expected dtype bool with True meaning legal, got int64"),
    (lambda: compile_visibility(P, P, np.ones((1, 2), bool)),
     r"key_valid: expected shape \[B=1,K=3\], got \[1, 2\]"),
    (lambda: compile_visibility(P, P, None, causal=1),
     "causal: expected True or False, got 1"),
    (lambda: compile_visibility(P, P, None, q_segment=S, k_segment=np.array([[0, 1]])),
     r"k_segment: expected shape \[B=1,K=3\], got \[1, 2\]"),
    (lambda: compile_visibility(P, P, None, q_segment=S.astype(float), k_segment=S),
     "q_segment: expected an integer array, got dtype float64"),
    (lambda: compile_visibility(P, P, None, prefix_length=-1),
     r"prefix_length: entry \(0\) is -1, expected >= 0"),
    (lambda: compile_visibility(P, P, None, prefix_length=np.array([1, 2])),
     r"prefix_length: expected a scalar, shape \[B=1\] or \[B=1,H\], got \[2\]"),
    (lambda: compile_visibility(P, P, None, prefix_length=1.5),
     "prefix_length: expected an integer array, got dtype float64"),
    (lambda: compile_visibility(P, P, None, window=3),
     r"window: expected a pair \(a tuple or list of 2\)"),
    (lambda: compile_visibility(P, P, None, window=(1, 2, 3)),
     r"window: expected a pair \(a tuple or list of 2\)"),
    (lambda: compile_visibility(P, P, None, window=(-1, 0)),
     r"window: left bound is -1, expected >= 0 \(None means unbounded\)"),
    (lambda: compile_visibility(P, P, None, window=(None, None)),
     r"window: \(None, None\) restricts nothing; pass window=None"),
    (lambda: compile_visibility(P, P, None, window=(1.0, 0)),
     "window: left bound must be an int, None or an"),
    (lambda: compile_visibility(P, P, None, window=(0, np.array([1, -2]))),
     "window: right bound of head h=1 is -2, expected >= 0"),
    (lambda: compile_visibility(P, P, None, window=(np.zeros((2, 2), int), 0)),
     r"window: per-head left bounds must have shape \[H\], got \[2, 2\]"),
    (lambda: compile_visibility(P, P, None, window=(np.array([1, 2]), np.array([1, 2, 3]))),
     r"head axis: per-head inputs disagree on H \(window left H=2, window right H=3\)"),
    (lambda: compile_visibility(P, P, None, prefix_length=np.array([[1, 2]]),
                                window=(np.array([1, 2, 3]), 0)),
     r"per-head inputs disagree on H \(prefix_length H=2, window left H=3\)"),
    (lambda: relation(P, P, layout="jagged"),
     r"layout: expected one of 'padded', 'packed', 'cache' or None, got 'jagged'"),
    (lambda: relation(P, P, causal=True, layout="packed"),
     "layout 'packed' needs q_segment and k_segment: without them packed documents read "
     "each other"),
    (lambda: relation(P, P, causal=True, alignment="diagonal"),
     "alignment: expected one of"),
    (lambda: relation(P, P, alignment="upper_left"),
     "alignment 'upper_left': applies only to a positional relation"),
    (lambda: relation(P, P, causal=True, alignment="none"),
     "alignment 'none': this relation is positional"),
    (lambda: relation(np.array([[3, 4]]), np.arange(5)[None], causal=True,
                      alignment="upper_left"),
     r"alignment 'upper_left' does not match the coordinates: q_pos\[b=0\] is \[3, 4\], "
     r"upper_left alignment needs \[0, 1\]"),
    (lambda: relation(np.array([[0, 1]]), np.arange(5)[None], causal=True,
                      alignment="lower_right"),
     r"q_pos\[b=0\] is \[0, 1\], lower_right alignment needs \[3, 4\]"),
    (lambda: relation(np.array([[1]]), np.array([[0, 2]]), causal=True,
                      alignment="lower_right"),
     r"k_pos\[b=0\] is \[0, 2\], lower_right alignment needs \[0, 1\]"),
    (lambda: relation(P, P, window=(1, 1), window_convention="inclusive"),
     "window_convention: expected one of"),
    (lambda: relation(P, P, window=(0, 1), window_convention="includes_query"),
     r"window: left is 0, expected >= 1 \(a window that counts the query itself"),
    (lambda: window_from_inclusive(2, 0), "window: right is 0, expected >= 1"),
    (lambda: window_from_inclusive(2.5, 1), "window: left must be an int, None or an"),
    (lambda: window_to_inclusive((-1, 0)), "window: left is -1, expected >= 0"),
    (lambda: from_positions(np.zeros((1, 1, 2), int), P),
     r"q_pos: expected shape \[Q\] / \[K\] or \[B,Q\] / \[B,K\], got \[1, 1, 2\]"),
    (lambda: causal(2, 3, alignment="upper_left").tile(0, 1, 3, 0, 1),
     r"tile: expected 0 <= i0 <= i1 <= 2, got \[1, 3\)"),
    (lambda: causal(2, 3, alignment="upper_left").tile(0, 0, 1, 2, 1),
     r"tile: expected 0 <= j0 <= j1 <= 3, got \[2, 1\)"),
    (lambda: causal(2, 3, alignment="upper_left").tile(1, 0, 1, 0, 1),
     r"b: indices must lie in \[0, 1\), got range \[1, 1\]"),
    (lambda: causal(2, 3, alignment="upper_left").tile(0, 0, 1, 0, 1, h=1),
     r"h: indices must lie in \[0, 1\)"),
    (lambda: causal(2, 3, alignment="upper_left").mask_mod(0, 0, 0.5, 0),
     "q_idx: expected integer indices, got dtype float64"),
    (lambda: VisibilityRelation.from_manifest({"schema": "other"}),
     "manifest: expected schema 'visibility_relation_v1', got 'other'"),
    (lambda: empty_rows(np.ones(3, bool)),
     r"visible: expected \[Q,K\], \[H,Q,K\] or \[B,H,Q,K\] axes, got shape \[3\]"),
    (lambda: empty_rows(np.ones((2, 2), int)), "visible: expected dtype bool"),
    (lambda: render(np.ones((1, 2, 2), bool)), r"visible2d: expected shape \[Q,K\]"),
    (lambda: render(np.ones((2, 2))), "visible2d: expected dtype bool"),
    (lambda: render(np.ones((2, 2), bool), q_labels=[1]), "q_labels: expected 2 labels, got 1"),
]


@pytest.mark.parametrize("make,message", REJECTIONS, ids=[m[:40] for _, m in REJECTIONS])
def test_rejections(make, message):
    with pytest.raises((RefAttnError, TypeError), match=message) as info:
        make()
    if "keyword-only" not in message:
        assert info.type is RefAttnError

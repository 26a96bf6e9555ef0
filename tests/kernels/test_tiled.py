"""The tiled test-vehicle kernel: exact in float64 against refattn, close in float32, and each
planted bug changes the result exactly where its trigger holds and nowhere else."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import refattn
from tests.kernels import tiled

FIELDS = ("output", "lse", "grad_q", "grad_k", "grad_v", "grad_bias", "grad_sink")


def _problem(seed: int, *, B: int = 2, Hq: int = 4, Hkv: int = 2, Q: int = 7, K: int = 13,
             Dk: int = 5, Dv: int = 6, mask: str = "full", key_padding: bool = False,
             softcap: float | None = None, sink: bool = False, bias: tuple[int, ...] | None = None,
             dropout: bool = False, invalid_rows: bool = False, empty_rows: bool = False,
             explicit_head_map: bool = False) -> dict[str, Any]:
    """Kernel arguments (the fields of ``case.plain``) of one random problem."""
    rng = np.random.default_rng(seed)
    i = np.arange(Q)[:, None]
    j = np.arange(K)[None, :]
    match mask:
        case "full":
            vis2 = np.ones((Q, K), bool)
        case "causal_upper_left":
            vis2 = j <= i
        case "causal_bottom_right":
            vis2 = j <= i + (K - Q)
        case _:
            raise ValueError(mask)
    visible = np.broadcast_to(vis2, (B, Hq, Q, K)).copy()  # (B, Hq, Q, K)
    if key_padding:
        visible[B - 1, :, :, K - 3:] = False  # the last batch has 3 padded keys
    query_valid = np.ones((B, 1, Q, 1), bool)
    if invalid_rows:
        query_valid[0, 0, 1] = False
        query_valid[B - 1, 0, Q - 1] = False
    if empty_rows:  # a row with no visible key: unused without a sink, lse = sink with one
        visible[0, :, 1] = False
        if not sink:
            query_valid[0, 0, 1] = False
    head_map = (rng.permutation(np.arange(Hq) % Hkv) if explicit_head_map
                else np.arange(Hq) // (Hq // Hkv))
    args: dict[str, Any] = dict(
        q=rng.standard_normal((B, Hq, Q, Dk)), k=rng.standard_normal((B, Hkv, K, Dk)),
        v=rng.standard_normal((B, Hkv, K, Dv)), head_map=head_map, visible=visible,
        query_valid=query_valid, scale=0.7 * Dk ** -0.5, softcap=softcap,
        sink=rng.standard_normal(Hq) if sink else None,
        bias=None if bias is None else rng.standard_normal(bias),
        dropout=np.where(rng.random((B, Hq, Q, K)) < 0.25, 0.0, 1 / 0.75) if dropout else None,
        grad_output=rng.standard_normal((B, Hq, Q, Dv)))
    return args


def _reference(args: dict[str, Any]) -> dict[str, np.ndarray | None]:
    """refattn's float64 forward and backward of the same problem."""
    call = refattn.AttentionCall(
        args["q"], args["k"], args["v"], visible=args["visible"], bias=args["bias"],
        scale=args["scale"], softcap=args["softcap"], sink=args["sink"],
        dropout=args["dropout"], head_map=args["head_map"], query_valid=args["query_valid"],
        all_masked_rows="sanitize_then_zero_invalid_query")
    trace = refattn.forward(call, backend="numpy")
    grads = refattn.backward(trace, args["grad_output"])
    return {"output": trace.output, "lse": trace.lse, "grad_q": grads.grad_q,
            "grad_k": grads.grad_k, "grad_v": grads.grad_v, "grad_bias": grads.grad_bias,
            "grad_sink": grads.grad_sink}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (b never all zero here)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a64 - b64).max() / np.abs(b64).max())


def _fields_rel(res: tiled.Result, ref: dict[str, Any], query_valid: np.ndarray
                ) -> dict[str, float]:
    """Relative distance per field; lse on consumed rows only (refattn sanitises the rest)."""
    out = {}
    for name in FIELDS:
        a, b = getattr(res, name), ref[name]
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if name == "lse":
            rows = np.broadcast_to(query_valid[..., 0], b.shape)  # (B, Hq, Q)
            a, b = a[rows], b[rows]
        out[name] = _rel(a, b)
    return out


#: (problem options, kernel options): every feature, tiles that do and do not divide Q and K
EXACT_CASES = {
    "gqa_causal_bottom_right": (dict(mask="causal_bottom_right", Q=7, K=13),
                                dict(tile_q=3, tile_k=4)),
    "gqa_causal_upper_left_padding_invalid": (
        dict(mask="causal_upper_left", Q=13, K=9, key_padding=True, invalid_rows=True,
             empty_rows=True), dict(tile_q=4, tile_k=3)),
    "softcap_bias_sink_dropout_split2_pad8": (
        dict(mask="causal_bottom_right", Q=6, K=11, Dk=5, Dv=3, softcap=2.5, sink=True,
             bias=(2, 4, 6, 11), dropout=True, invalid_rows=True),
        dict(tile_q=4, tile_k=3, splits=2, pad_to=8)),
    "sink_empty_consumed_row_split3": (
        dict(Q=5, K=10, sink=True, empty_rows=True, bias=(1, 4, 1, 10)),
        dict(tile_q=2, tile_k=3, splits=3)),
    "explicit_head_map_split3_divides": (
        dict(Q=8, K=12, explicit_head_map=True, bias=(8, 12), key_padding=True),
        dict(tile_q=4, tile_k=4, splits=3, pad_to=4)),
    "odd_dims_pad16_split_past_tiles": (
        dict(mask="causal_upper_left", Q=9, K=9, Dk=7, Dv=9, softcap=1.5, dropout=True),
        dict(tile_q=16, tile_k=5, splits=3, pad_to=16)),
    "one_tile_default_sizes": (dict(mask="causal_bottom_right", Q=5, K=17, sink=True), {}),
}


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_float64_kernel_matches_refattn(name):
    problem, kernel = EXACT_CASES[name]
    args = _problem(11, **problem)
    res = tiled.attention(**args, dtype="float64", **kernel)
    errs = _fields_rel(res, _reference(args), args["query_valid"])
    assert max(errs.values()) < 1e-12, errs
    assert res.output.dtype == np.float64 and res.grad_k.shape == args["k"].shape


def test_float32_is_close_to_float64():
    args = _problem(3, mask="causal_bottom_right", Q=40, K=70, Dk=16, Dv=16, softcap=4.0,
                    sink=True, bias=(1, 4, 40, 70), dropout=True, invalid_rows=True)
    opts = dict(tile_q=16, tile_k=32, splits=2, pad_to=8)
    res64 = tiled.attention(**args, dtype="float64", **opts)
    res32 = tiled.attention(**args, dtype="float32", **opts)
    assert res32.output.dtype == np.float32 and res32.lse.dtype == np.float32
    errs = {n: _rel(getattr(res32, n), getattr(res64, n)) for n in FIELDS if n != "lse"}
    assert max(errs.values()) < 5e-6, errs


@pytest.mark.parametrize(("dtype", "bound"), [("float16", 5e-3), ("bfloat16", 4e-2)])
def test_half_precisions_round_their_storage(dtype, bound):
    args = _problem(4, mask="causal_upper_left", Q=20, K=20, Dk=8, Dv=8, bias=(20, 20))
    res64 = tiled.attention(**args, dtype="float64", tile_q=8, tile_k=8)
    res = tiled.attention(**args, dtype=dtype, tile_q=8, tile_k=8)
    assert res.output.dtype.name == dtype and res.grad_bias.dtype.name == dtype
    assert res.lse.dtype == np.float32
    errs = {n: _rel(getattr(res, n), getattr(res64, n)) for n in ("output", "grad_q", "grad_k",
                                                                  "grad_v", "grad_bias")}
    assert max(errs.values()) < bound, errs


#: bug -> (problem, kernel options where it triggers, where it must not change anything)
BUG_CASES = {
    "drop_last_partial_tile": (dict(Q=6, K=13), dict(tile_k=4), dict(tile_k=13),
                               dict(Q=6, K=12), dict(tile_k=4)),
    "causal_offset": (dict(mask="causal_bottom_right", Q=6, K=13), dict(tile_q=4, tile_k=4),
                      None,
                      dict(mask="causal_upper_left", Q=12, K=12), dict(tile_q=5, tile_k=5)),
    "pad_garbage": (dict(Dk=5), dict(pad_to=8), dict(pad_to=None),
                    dict(Dk=8, Dv=5), dict(pad_to=8)),
    "stale_max_rescale": (dict(Q=6, K=16), dict(tile_k=4), dict(tile_k=16),
                          dict(mask="causal_upper_left", Q=4, K=4), dict(tile_k=4)),
    "splitkv_sum_weights": (dict(Q=6, K=16), dict(tile_k=4, splits=3), dict(tile_k=4),
                            dict(Q=6, K=4), dict(tile_k=4, splits=3)),
}


@pytest.mark.parametrize("bug", list(tiled.BUGS))
def test_each_bug_changes_the_result_only_where_it_triggers(bug):
    problem, trigger, quiet_opts, quiet_problem, quiet_opts2 = BUG_CASES[bug]
    args = _problem(5, softcap=3.0, sink=True, bias=(1, 4, 1, problem.get("K", 13)), **problem)
    good = tiled.attention(**args, dtype="float64", **trigger)
    bad = tiled.attention(**args, dtype="float64", bug=bug, **trigger)
    changed = {n: _rel(getattr(bad, n), getattr(good, n)) for n in FIELDS if n != "lse"}
    assert changed["output"] > 1e-6 and changed["grad_q"] > 1e-6, changed
    quiet = [(args, quiet_opts)] if quiet_opts is not None else []
    quiet.append((_problem(6, **quiet_problem), quiet_opts2))
    for q_args, opts in quiet:  # the trigger does not hold: bit-identical
        good = tiled.attention(**q_args, dtype="float64", **opts)
        bad = tiled.attention(**q_args, dtype="float64", bug=bug, **opts)
        for n in FIELDS:
            a, b = getattr(good, n), getattr(bad, n)
            assert (a is None and b is None) or np.array_equal(a, b), (n, opts)


def test_bugs_also_show_in_float32():
    args = _problem(7, mask="causal_bottom_right", Q=6, K=13, Dk=5)
    opts = dict(tile_q=4, tile_k=4, splits=2, pad_to=8, dtype="float32")
    good = tiled.attention(**args, **opts)
    for bug in tiled.BUGS:
        bad = tiled.attention(**args, bug=bug, **opts)
        assert _rel(bad.output, good.output) > 1e-4, bug


def test_key_tiles_cut_contiguous_chunks():
    op = _operands(tile_k=4, splits=3)
    chunks = tiled._key_tiles(op, 13)  # 4 tiles, the last partial, over 3 chunks
    assert chunks == [[(0, 4)], [(4, 8)], [(8, 12), (12, 13)]]
    assert tiled._key_tiles(_operands(tile_k=8, splits=3), 13) == [[], [(0, 8)], [(8, 13)]]
    dropped = tiled._key_tiles(_operands(tile_k=4, splits=1, bug="drop_last_partial_tile"), 13)
    assert dropped == [[(0, 4), (4, 8), (8, 12)]]


def _operands(**options: Any) -> tiled._Operands:
    args = _problem(0, Q=3, K=13)
    op, *_ = tiled._prepare(**{**args, "grad_output": None}, dtype="float64", tile_q=2,
                            **{"pad_to": None, "bug": None, "splits": 1, **options})
    return op


@pytest.mark.parametrize(("change", "message"), [
    (dict(dtype="float8"), "dtype"),
    (dict(tile_k=0), "tile_k: expected a positive integer"),
    (dict(bug="off_by_one"), "bug: expected None or one of"),
    (dict(head_map=np.array([0, 0, 2, 1])), "head_map"),
    (dict(visible=np.ones((5, 5), bool)), "visible: shape [5, 5] does not broadcast"),
    (dict(grad_output=np.ones((2, 4, 7, 5))), "grad_output: expected shape"),
])
def test_bad_arguments_raise_kernel_error(change, message):
    args = _problem(1)
    with pytest.raises(tiled.KernelError, match=r"^attention\(q=\[2, 4, 7, 5\].*") as info:
        tiled.attention(**{**args, **change})
    assert message in str(info.value)

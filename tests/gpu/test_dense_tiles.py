"""A dense mask's tile classes (gpu_backend.launch.dense_tile_classes, kernels/tile_loop.cuh
refattn_set_table_row): the host's table equals the kernels' per-element block vote, computed here
independently tile by tile; the emulator's forward and backward with the table match the
reference, their tile counts match the expected SKIP tiles, and a wrong table is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from gpu_backend import launch
from gpu_backend.emulator_backend import MAX_SHARED_BYTES, EmulatorDevice
from gpu_backend.source import FEATURE_SETS, INSTANCES
from tests.gpu.test_emulator import assert_matches_reference

SKIP, FULL, PARTIAL = 0, 1, 2
HOT = ("attention_forward", "attention_dq", "attention_dkdv")


def _vote(dense: np.ndarray, BR: int, BC: int, rows_are_keys: bool,
          sanitized: np.ndarray | None = None) -> np.ndarray:
    """The block vote of refattn_tile_bits + refattn_tile_class, one tile at a time: a row past
    the end counts for neither any nor all, a column past the end is invisible.

    dense (B, H, Q, K) bool, fully broadcast; sanitized (B, H, Q) adds key 0 to its rows.
    """
    vis = dense.copy()
    if sanitized is not None:
        vis[..., 0] |= sanitized
    if rows_are_keys:
        vis = vis.swapaxes(2, 3)
    B, H, R, C = vis.shape
    out = np.empty((B, H, -(-R // BR), -(-C // BC)), np.uint8)
    for b in range(B):
        for h in range(H):
            for rt in range(out.shape[2]):
                for ct in range(out.shape[3]):
                    some, every = False, True
                    for r in range(rt * BR, min(rt * BR + BR, R)):  # in-range rows only
                        for c in range(ct * BC, ct * BC + BC):
                            v = c < C and bool(vis[b, h, r, c])
                            some |= v
                            every &= v
                    out[b, h, rt, ct] = SKIP if not some else FULL if every else PARTIAL
    return out


def _shapes() -> list[tuple[str, int, int]]:
    """(kind, block rows, block columns) of every instance, general and plain."""
    seen = set()
    for table in (INSTANCES, *(t[0] for t in FEATURE_SETS.values())):
        for kind, widths in table.items():
            for MR, tile in widths.values():
                seen.add((kind, 32 * MR, tile))
    return sorted(seen)


def _masks(rng: np.random.Generator) -> dict[str, np.ndarray]:
    Q, K = 77, 53  # ragged: no tile shape divides them
    qi, kj = np.arange(Q)[:, None], np.arange(K)[None, :]
    block = (qi // 24 == kj // 16)  # block diagonal
    return {
        "random": rng.random((2, 3, Q, K)) < 0.5,
        "sparse": rng.random((2, 3, Q, K)) < 0.02,
        "block_diagonal": block,
        "causal_like": kj <= qi * K // Q,
        "all_true": np.ones((Q, K), bool),
        "all_false": np.zeros((1, 3, Q, K), bool),
        "batch_broadcast": np.stack([block, ~block])[:, None],  # (2, 1, Q, K)
        "key_padding": (rng.random((2, 1, 1, K)) < 0.7),  # (2, 1, 1, K): query broadcast
        "query_rows": (rng.random((1, 3, Q, 1)) < 0.5),  # key broadcast
        "window": np.abs(qi - kj) <= 5,
    }


@pytest.mark.parametrize("kind,BR,BC", _shapes())
def test_table_equals_the_per_element_vote(kind, BR, BC):
    rng = np.random.default_rng(BR * 100 + BC)
    keys = kind == "dkdv"
    for name, mask in _masks(rng).items():
        m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape).astype(np.uint8)
        Q, K = 77, 53
        table = launch.dense_tile_classes(np, m4, Q, K, BR, BC, keys)
        assert table.dtype == np.uint8 and table.flags.c_contiguous
        assert table.shape[:2] == m4.shape[:2], name  # broadcast axes stay extent 1
        B, H = max(m4.shape[0], 2), max(m4.shape[1], 3)
        full = np.broadcast_to(m4 != 0, (B, H, Q, K))
        want = _vote(full, BR, BC, keys)
        np.testing.assert_array_equal(np.broadcast_to(table, want.shape), want,
                                      err_msg=f"{name} {kind} {BR}x{BC}")
        table_bytes, _ = launch.dense_tile_bytes(m4.shape, Q, K, BR, BC, keys)
        assert table_bytes == table.nbytes


def _call(mask, shape=(2, 3, 70, 90, 8), **kw):
    B, H, Q, K, D = shape
    rng = np.random.default_rng(11)
    return refattn.AttentionCall(rng.standard_normal((B, H, Q, D)),
                                 rng.standard_normal((B, H, K, D)),
                                 rng.standard_normal((B, H, K, D)), visible=mask, **kw)


def _block_sparse(Q: int, K: int) -> np.ndarray:
    """Block-diagonal blocks of 64 queries x 40 keys plus every query's first 3 keys."""
    qi, kj = np.arange(Q)[:, None], np.arange(K)[None, :]
    return (qi // 64 == kj // 40) | (kj < 3)


@pytest.fixture
def launches(monkeypatch):
    """Every hot kernel launch: (kernel, tile table (blocks, 2), dense class table, (block
    rows, block columns) of the Plan the class table was made for)."""
    seen: list[tuple[str, np.ndarray, np.ndarray | None, tuple[int, int] | None]] = []
    run, tiles = launch._Launch.run, launch._dense_tiles
    planned: list[tuple[int, int]] = []

    def recording(self, kernel, grid, block, smem=0):
        run(self, kernel, grid, block, smem)
        if kernel.startswith(HOT):
            table = self.slots.get("VIS_TILES")
            blocks = grid[0] * grid[1]  # (the TILES buffer is shared by dq and dk/dv)
            seen.append((kernel, np.array(self.slots["TILES"])[:blocks],
                         None if table is None else np.array(table),
                         planned.pop() if planned else None))

    def planning(L, P, kind):
        planned.append((P.rows, P.tile))
        return tiles(L, P, kind)

    monkeypatch.setattr(launch._Launch, "run", recording)
    monkeypatch.setattr(launch, "_dense_tiles", planning)
    return seen


def _expected_tiles(call, kernel: str, BR: int, BC: int) -> tuple[int, int]:
    """(computed, skipped) of a kernel by the vote over the fully broadcast mask."""
    B, H, Q, K = call.score_shape
    dense = np.broadcast_to(np.asarray(call.visible_full()), (B, H, Q, K))
    classes = _vote(dense, BR, BC, "dkdv" in kernel, call.sanitized_rows())
    skipped = int((classes == SKIP).sum())
    return classes.size - skipped, skipped


@pytest.mark.parametrize("shape,mask", [
    ((1, 2, 130, 120, 8), "block_sparse"),
    ((1, 1, 130, 120, 64), "block_sparse"),
    ((2, 2, 40, 90, 8), "key_padding"),
], ids=["d32", "d64", "key-padding"])
def test_forward_and_backward_with_the_table(shape, mask, launches):
    B, H, Q, K, D = shape
    if mask == "block_sparse":
        vis = _block_sparse(Q, K)
    else:
        vis = np.arange(K) < np.array([50, 90])[:, None, None, None]  # (B, 1, 1, K)
    call = _call(vis, shape)
    g_o = np.random.default_rng(5).standard_normal((B, H, Q, D))
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    g = refattn.backward(t, g_o)
    assert_matches_reference(call, g_o, t, g, mask)
    assert len(launches) == 3
    for kernel, tiles, table, (BR, BC) in launches:
        assert table is not None, kernel  # the table was passed to every kernel
        computed, skipped = tiles.sum(axis=0)
        assert (computed, skipped) == _expected_tiles(call, kernel, BR, BC), kernel
        assert skipped > 0, kernel
    info = t.materialized["dense_tiles"]
    assert info["mask_loads_avoided"] > 0
    assert info["skip"] == t.materialized["tiles_skipped"]


def test_sanitized_rows_vote_key_zero(launches):
    """Rows with no visible key get the temporary key 0: a SKIP tile holding key 0 is voted."""
    Q, K = 70, 90
    vis = _block_sparse(Q, K) & (np.arange(K)[None, :] >= 3)
    vis[5:9] = False  # rows with nothing visible: sanitised
    vis[64:] = False  # the same, alone in the forward's and dq's last row tile
    query_valid = vis.any(axis=1)[None, None, :, None]  # the empty rows are invalid queries
    call = _call(vis, (1, 2, Q, K, 8), all_masked_rows="sanitize_then_zero_invalid_query",
                 query_valid=query_valid)
    assert call.sanitized_rows().any()
    g_o = np.random.default_rng(6).standard_normal((1, 2, Q, 8))
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    g = refattn.backward(t, g_o)
    assert_matches_reference(call, g_o, t, g, "sanitized")
    assert len(launches) == 3
    for kernel, tiles, table, (BR, BC) in launches:
        kind = "dkdv" if "dkdv" in kernel else "forward"
        assert tuple(tiles.sum(axis=0)) == _expected_tiles(call, kernel, BR, BC), kernel
        # the mask's own classes would skip tiles that the sanitised key 0 makes visible: the
        # launch marks every SKIP tile holding key 0 PARTIAL (voted in the kernel)
        dense = np.broadcast_to(vis, (1, 2, Q, K))
        keys = kind == "dkdv"
        voted = _vote(dense, BR, BC, keys, call.sanitized_rows())
        raw = np.broadcast_to(launch.dense_tile_classes(np, vis[None, None], Q, K, BR, BC, keys),
                              voted.shape)
        wrong = (raw == SKIP) & (voted != SKIP)
        assert wrong.any(), kernel
        assert (table[wrong] == PARTIAL).all(), kernel
        key0 = (slice(None), slice(None), 0) if keys else (Ellipsis, 0)
        marked = raw[key0] == SKIP
        np.testing.assert_array_equal(table[key0][marked], PARTIAL)
        np.testing.assert_array_equal(table[~wrong & (raw != SKIP)], raw[~wrong & (raw != SKIP)])


def test_sanitized_rows_with_a_mask_of_full_batch_and_head_extents(launches):
    """A (B, Hq, Q, K) mask needs no broadcast: its table is still a writable copy, so the
    launch can mark the SKIP tiles holding the sanitised key 0 (it raised 'assignment
    destination is read-only' on the view)."""
    Q = K = 8
    vis = np.tril(np.ones((1, 2, Q, K), bool))
    vis[0, 1, 5:, 1] = False  # the heads differ
    vis[0, :, 3] = False  # an empty row in both heads: sanitised
    call = _call(vis, (1, 2, Q, K, 8), all_masked_rows="sanitize_then_zero_invalid_query",
                 query_valid=vis.any(axis=(1, 3))[:, None, :, None])
    assert call.sanitized_rows().any()
    g_o = np.random.default_rng(9).standard_normal((1, 2, Q, 8))
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    g = refattn.backward(t, g_o)
    assert_matches_reference(call, g_o, t, g, "full-extent mask")
    assert all(table is not None for _, _, table, _ in launches)


@pytest.mark.parametrize(("D", "softcap"), [(8, None), (200, None), (200, 4.0)],
                         ids=["d32", "d256-plain", "d256-general"])
def test_a_partial_tile_marked_full_is_caught(monkeypatch, D, softcap):
    """Mutation: the kernels trust the table, so a PARTIAL tile called FULL shows (at D = 256
    too, in the plain instances and the general ones that a softcap call runs: the forward and
    dq read the table there, not only dk/dv)."""
    Q, K = 70, 90
    call = _call(_block_sparse(Q, K), (1, 2, Q, K, D), softcap=softcap)
    g_o = np.random.default_rng(8).standard_normal((1, 2, Q, D))
    ref = refattn.forward(call)
    want = refattn.backward(ref, g_o)
    right = refattn.forward(call, backend="cuda_emulator", materialize=False)
    classes = launch.dense_tile_classes

    def wrong(*args, **kw):
        table = classes(*args, **kw).copy()
        table[table == PARTIAL] = FULL
        return table

    monkeypatch.setattr(launch, "dense_tile_classes", wrong)
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    assert np.abs(t.output - ref.output).max() > 1e-3
    g = refattn.backward(right, g_o)  # a right forward, then dq and dk/dv on wrong tables
    assert np.abs(g.grad_q - want.grad_q).max() > 1e-3  # dq
    assert np.abs(g.grad_v - want.grad_v).max() > 1e-3  # dk/dv


def test_mask_loads_saved_on_a_block_sparse_mask():
    """The figure of docs/gpu.md: (1, 8, 4096, 4096), 64-query x 32-key tiles of the forward,
    blocks of 256 along the diagonal plus a 64-key global prefix."""
    Q = K = 4096
    qi, kj = np.arange(Q)[:, None], np.arange(K)[None, :]
    m = ((qi // 256 == kj // 256) | (kj < 64)).astype(np.uint8)[None, None]
    P = launch.plan("forward", 64, 64, MAX_SHARED_BYTES)
    table = launch.dense_tile_classes(np, m, Q, K, P.rows, P.tile)
    info = launch.dense_tile_counts(table, 1, 8, Q, K, P.rows, P.tile)
    assert info["mask_loads"] == 8 * Q * K
    # independent count: FULL tiles are the diagonal blocks and the prefix columns, the rest of
    # each row tile's columns is SKIP; no tile straddles a block edge (256 = 4 x 64 = 8 x 32)
    full = 8 * (Q // 64) * (256 // 32 + 64 // 32) - 8 * (256 // 64) * (64 // 32)
    assert info["full"] == full and info["partial"] == 0
    assert info["mask_loads_avoided"] == info["mask_loads"]
    assert table.nbytes == (Q // 64) * (K // 32)  # 8 KiB


class _Tight:
    """The emulator with a given amount of free device memory."""

    def __init__(self, device, free: int) -> None:
        self._device, self._free = device, free

    def __getattr__(self, name):
        return getattr(self._device, name)

    def free_bytes(self) -> int:
        return self._free


def test_the_table_is_refused_before_any_launch_when_memory_is_short(launches):
    from gpu_backend import emulator_backend

    Q = K = 1024
    call = _call(np.tril(np.ones((Q, K), bool)), (1, 1, Q, K, 8))
    P = launch.plan("forward", 8, 8, MAX_SHARED_BYTES, features="plain")
    table, work = launch.dense_tile_bytes((1, 1, Q, K), Q, K, P.rows, P.tile)
    assert table == -(-Q // P.rows) * -(-K // P.tile) and work >= 3 * Q * K
    # enough for the call's own buffers (launch._memory_check: about 2.4 MB), not the reduction
    device = _Tight(emulator_backend.device(), table + work - 1)
    with pytest.raises(refattn.RefAttnError, match="visible: the forward kernel's tile classes"):
        launch.forward(device, call, materialize=False)
    assert launches == []


@pytest.mark.parametrize(("limit", "softcap", "kernels"), [
    (MAX_SHARED_BYTES, None, ("forward_plain", "dq_plain", "dkdv_wide")),
    (166912, 4.0, ("forward", "dq", "dkdv"))], ids=["h100-plain", "a100-softcap"])
def test_d256_reads_the_table_in_every_kernel_and_matches(launches, monkeypatch, limit,
                                                          softcap, kernels):
    """At D = 256 too every kernel gets the table (the forward and dq keep the block's row
    address in shared memory, tile_loop.cuh refattn_set_table_row), all three match the
    reference and count the vote's SKIP tiles: a call without features on an H100's shared
    memory (the plain forward and dq, 16-key tiles, and the wide dk/dv, 16-query tiles), a
    softcap call on an A100's (the general instances, 8-wide tiles)."""
    monkeypatch.setattr(EmulatorDevice, "max_shared_bytes", limit)
    Q, K = 24, 50  # keys 40 .. 49 visible to no row past the 3-key prefix: SKIP tiles
    call = _call(_block_sparse(Q, K), (1, 1, Q, K, 200), softcap=softcap)
    g_o = np.random.default_rng(7).standard_normal((1, 1, Q, 200))
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    g = refattn.backward(t, g_o)
    assert_matches_reference(call, g_o, t, g, "d256")
    got = {kernel: table is not None for kernel, _, table, _ in launches}
    assert got == {f"attention_{k}_d256": True for k in kernels}
    for kernel, tiles, _, planned in launches:
        assert tuple(tiles.sum(axis=0)) == _expected_tiles(call, kernel, *planned), kernel

"""The polarity firewall: lower one visibility relation to each framework's mask encoding.

Owns the named adapters from refattn's canonical relation (bool, True = the edge exists,
broadcastable to [B, H, Q, K]) to SDPA bool masks, MultiheadAttention ``attn_mask`` /
``key_padding_mask`` (True = blocked / ignored), additive 0 / -inf biases, varlen
``cu_seqlens`` and PyTorch's ``is_causal`` flag, each with its inverse. Every adapter validates
dtype, shape and broadcast and applies an all-masked-row policy. Defers building relations to
:mod:`refattn.masks` and FlexAttention-style block metadata to :mod:`refattn.masks.blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from refattn._checks import (
    as_array,
    check_bool,
    check_broadcastable,
    check_float64,
    first_index,
    format_index,
)
from refattn.errors import RefAttnError
from refattn.masks.algebra import BaseRelation
from refattn.masks.constructors import causal
from refattn.masks.packing import _cu_seqlens, segments_from_cu_seqlens
from refattn.masks.render import as4, dense_relation

__all__ = [
    "POLARITY",
    "SdpaCausal",
    "VarlenLowering",
    "from_additive_bias",
    "from_cu_seqlens",
    "from_key_padding_mask",
    "from_mha_attn_mask",
    "from_sdpa_bool",
    "from_sdpa_causal",
    "to_additive_bias",
    "to_cu_seqlens",
    "to_key_padding_mask",
    "to_mha_attn_mask",
    "to_sdpa_bool",
    "to_sdpa_causal",
]

RowPolicy = Literal["reject", "allow"]

#: what True (or 0.0) means in each lowered encoding
POLARITY: dict[str, str] = {
    "refattn": "bool, True = edge exists",
    "sdpa_bool": "bool, True = participates",
    "mha_attn_mask": "bool, True = blocked",
    "key_padding_mask": "bool, True = key ignored",
    "additive_bias": "float64, 0 = kept, -inf = excluded",
    "cu_seqlens": "int64 offsets of block-diagonal segments",
    "block_mask": "per query block: partial and full kv blocks; absent = invisible",
    "is_causal": "flag, upper-left causal alignment",
}


def _check_rows(vis: np.ndarray, policy: RowPolicy) -> None:
    if policy == "allow":
        return
    if policy != "reject":
        raise RefAttnError(f"all_masked_rows: expected 'reject' or 'allow', got {policy!r}")
    empty = np.asarray(~as4(vis).any(axis=-1))  # (B, H, Q)
    idx = first_index(empty)
    if idx is not None:
        raise RefAttnError(
            f"visible: row {format_index(idx, 'bhi')} has no legal key; the lowered mask would "
            f"give a NaN row ({int(empty.sum())} such row(s)); fix the relation or pass "
            "all_masked_rows='allow' when those queries are unused"
        )


# -- SDPA boolean: True participates ----------------------------------------------------------
def to_sdpa_bool(
    visible: Any,
    *,
    score_shape: tuple[int, ...] | None = None,
    all_masked_rows: RowPolicy = "reject",
) -> np.ndarray:
    """Lower to ``scaled_dot_product_attention``'s bool ``attn_mask`` (True participates).

    Parameters
    ----------
    visible : bool ndarray broadcastable to (B, Hq, Q, K), or a relation
    score_shape : (B, Hq, Q, K) tuple, optional
        When given, ``visible`` must broadcast to it.
    all_masked_rows : {"reject", "allow"}
        "reject" (default) refuses a row with no legal key.

    Returns
    -------
    bool ndarray
        A copy with the same shape as ``visible`` (same polarity as refattn).

    Examples
    --------
    >>> to_sdpa_bool(np.array([[True, False], [True, True]])).tolist()
    [[True, False], [True, True]]
    """
    vis = dense_relation("visible", visible)
    if score_shape is not None:
        check_broadcastable("visible", vis, score_shape, "B,Hq,Q,K")
    _check_rows(vis, all_masked_rows)
    return vis.copy()


def from_sdpa_bool(mask: Any) -> np.ndarray:
    """Inverse of :func:`to_sdpa_bool`: an SDPA bool mask as a refattn relation (same polarity).

    Examples
    --------
    >>> from_sdpa_bool(np.array([True, False])).tolist()
    [True, False]
    """
    arr = as_array("sdpa_mask", mask)
    check_bool("sdpa_mask", arr)
    return arr.copy()


# -- MultiheadAttention: True blocks -----------------------------------------------------------
def to_mha_attn_mask(
    visible: Any,
    *,
    num_heads: int,
    batch: int | None = None,
    all_masked_rows: RowPolicy = "reject",
) -> np.ndarray:
    """Lower to ``nn.MultiheadAttention``'s bool ``attn_mask`` (True = blocked).

    Parameters
    ----------
    visible : (Q, K) or (B, H, Q, K) bool ndarray, or a relation
        B may be 1 or ``batch``; H may be 1 or ``num_heads``.
    num_heads : int
        H of the module.
    batch : int, optional
        N of the call; needed only when a relation with B = 1 differs between heads.
    all_masked_rows : {"reject", "allow"}

    Returns
    -------
    bool ndarray
        ``(Q, K)`` when the relation is the same for every batch row and head, else
        ``(B * num_heads, Q, K)`` with row ``b * num_heads + h`` (PyTorch's order).

    Examples
    --------
    >>> to_mha_attn_mask(np.tril(np.ones((3, 3), bool)), num_heads=2).astype(int).tolist()
    [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    """
    vis = dense_relation("visible", visible)
    if vis.ndim == 3:
        raise RefAttnError(
            f"visible: a 3-axis relation {list(vis.shape)} is ambiguous here; pass [Q,K] or "
            "[B,H,Q,K]"
        )
    vis = as4(vis)
    B, H, Q, K = vis.shape
    if H not in (1, num_heads):
        raise RefAttnError(f"visible: head axis has size {H}, expected 1 or num_heads={num_heads}")
    if batch is not None and B not in (1, batch):
        raise RefAttnError(f"visible: batch axis has size {B}, expected 1 or batch={batch}")
    _check_rows(vis, all_masked_rows)
    if (vis == vis[:1, :1]).all():
        return ~vis[0, 0]  # (Q, K), shared by every batch row and head
    if batch is None and B == 1:
        raise RefAttnError(
            "batch: needed to expand a per-head relation with B=1 to [B*H,Q,K]; pass batch="
        )
    N = B if batch is None else batch
    full = np.broadcast_to(vis, (N, num_heads, Q, K))
    return ~full.reshape(N * num_heads, Q, K)  # row b * num_heads + h


def from_mha_attn_mask(mask: Any, *, batch: int, num_heads: int) -> np.ndarray:
    """Inverse of :func:`to_mha_attn_mask`.

    Returns
    -------
    bool ndarray
        (1, 1, Q, K) for a 2-D mask, (batch, num_heads, Q, K) for a 3-D one; True = visible.

    Examples
    --------
    >>> from_mha_attn_mask(np.array([[False, True]]), batch=2, num_heads=3).tolist()
    [[[[True, False]]]]
    """
    arr = as_array("mha_attn_mask", mask)
    check_bool("mha_attn_mask", arr)
    if arr.ndim == 2:
        return ~arr[None, None]
    if arr.ndim != 3 or arr.shape[0] != batch * num_heads:
        raise RefAttnError(
            f"mha_attn_mask: expected [Q,K] or [B*H={batch * num_heads},Q,K], "
            f"got {list(arr.shape)}"
        )
    return ~arr.reshape(batch, num_heads, *arr.shape[1:])


def to_key_padding_mask(visible: Any, *, all_masked_rows: RowPolicy = "reject") -> np.ndarray:
    """Lower to ``key_padding_mask`` (B, K) with True = ignored key, for key-column validity only.

    Refuses any relation that differs between heads or query rows: a key padding mask
    cannot express query-key edges (causal, packed, window), only which key columns are real.

    Parameters
    ----------
    visible : (B, H, Q, K) bool ndarray or a relation (coordinates, or a union / intersection)
    all_masked_rows : {"reject", "allow"}

    Returns
    -------
    (B, K) bool ndarray

    Examples
    --------
    >>> vis = np.array([True, True, False])[None, None, None, :]
    >>> to_key_padding_mask(vis).tolist()
    [[False, False, True]]
    """
    vis = dense_relation("visible", visible)
    if vis.ndim != 4:
        raise RefAttnError(
            f"visible: expected [B,H,Q,K] (e.g. [B,1,1,K]) axes, got {list(vis.shape)}"
        )
    columns = vis[:, :1, :1, :]  # (B, 1, 1, K)
    idx = first_index(vis != columns)
    if idx is not None:
        b, _, _, j = idx
        raise RefAttnError(
            f"visible: not key-column validity: edge {format_index(idx, 'bhij')} is "
            f"{bool(vis[idx])} but {format_index((b, 0, 0, j), 'bhij')} is "
            f"{bool(columns[b, 0, 0, j])}; a key_padding_mask can only say which key columns "
            "are real; use to_mha_attn_mask for query-key edges"
        )
    _check_rows(columns, all_masked_rows)
    return ~columns[:, 0, 0, :]


def from_key_padding_mask(mask: Any) -> np.ndarray:
    """Inverse of :func:`to_key_padding_mask`: (B, K) True-ignored to (B, 1, 1, K) visible.

    Examples
    --------
    >>> from_key_padding_mask(np.array([[False, True]])).tolist()
    [[[[True, False]]]]
    """
    arr = as_array("key_padding_mask", mask)
    check_bool("key_padding_mask", arr)
    if arr.ndim != 2:
        raise RefAttnError(f"key_padding_mask: expected shape [B,K], got {list(arr.shape)}")
    return ~arr[:, None, None, :]


# -- additive: 0 keeps, -inf excludes ----------------------------------------------------------
def to_additive_bias(visible: Any, *, all_masked_rows: RowPolicy = "reject") -> np.ndarray:
    """Lower to an additive float64 mask: 0.0 where visible, -inf where not (lowered once).

    Examples
    --------
    >>> to_additive_bias(np.array([[True, False]])).tolist()
    [[0.0, -inf]]
    """
    vis = dense_relation("visible", visible)
    _check_rows(vis, all_masked_rows)
    return np.where(vis, 0.0, -np.inf)


def from_additive_bias(bias: Any) -> np.ndarray:
    """Inverse of :func:`to_additive_bias`: only exact 0.0 and -inf are accepted.

    A finite negative entry is ambiguous (a soft preference or a "large negative" mask
    sentinel such as -1e9?) and is rejected, as are positive values, +inf and NaN.

    Examples
    --------
    >>> from_additive_bias(np.array([0.0, -np.inf])).tolist()
    [True, False]
    """
    arr = as_array("additive_bias", bias)
    check_float64("additive_bias", arr)
    legal = arr == 0.0
    blocked = arr == -np.inf
    idx = first_index(~(legal | blocked))
    if idx is not None:
        value = float(arr[idx])
        if np.isfinite(value) and value < 0:
            why = ("a finite negative value is ambiguous (a soft preference or a large-negative "
                   "sentinel?); visibility needs exactly -inf")
        elif np.isnan(value):
            why = "NaN is not a visibility value"
        elif value == np.inf:
            why = "+inf is not a visibility value"
        else:
            why = "a finite positive value is a preference (bias), not visibility"
        raise RefAttnError(
            f"additive_bias: entry {format_index(idx)} is {value!r}; {why} "
            "(expected exactly 0.0 or -inf)"
        )
    return legal


# -- varlen: cu_seqlens --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class VarlenLowering:
    """A block-diagonal relation as varlen kernel arguments (FlashAttention ``*_varlen``).

    Attributes
    ----------
    cu_seqlens_q : (n + 1,) int64 ndarray
    cu_seqlens_k : (n + 1,) int64 ndarray
    max_seqlen_q, max_seqlen_k : int
    causal : bool
        Each (square) block is causal; otherwise every block is fully visible.
    """

    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


def from_cu_seqlens(
    cu_seqlens_q: Any, *, cu_seqlens_k: Any = None, causal: bool
) -> np.ndarray:
    """Dense (1, 1, Q, K) relation of varlen metadata (inverse of :func:`to_cu_seqlens`).

    Segment s reads keys ``[cu_seqlens_k[s], cu_seqlens_k[s+1])`` from its query rows
    ``[cu_seqlens_q[s], cu_seqlens_q[s+1])``; with ``causal=True`` the blocks must be square
    and each is lower-triangular. A repeated offset is an empty sequence (FlashAttention's
    varlen API allows it): it adds no block; a sequence with queries but no keys leaves its
    rows empty (legal only under an all-masked-row policy or with a sink).

    Examples
    --------
    >>> from_cu_seqlens([0, 1, 3], causal=True)[0, 0].astype(int).tolist()
    [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    >>> from_cu_seqlens([0, 1, 1, 3], causal=True)[0, 0].astype(int).tolist()  # one empty
    [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    """
    cu_q = _cu_seqlens(cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else _cu_seqlens(cu_seqlens_k)
    if cu_k.size != cu_q.size:
        raise RefAttnError(
            f"cu_seqlens_k: expected {cu_q.size} offsets like cu_seqlens_q, got {cu_k.size}"
        )
    if causal and not np.array_equal(cu_q, cu_k):
        raise RefAttnError(
            "causal: varlen causal blocks must be square (cu_seqlens_k == cu_seqlens_q); "
            "rectangular causal alignment is ambiguous here"
        )
    seg_q = segments_from_cu_seqlens(cu_q).segment_ids  # (Q,)
    seg_k = segments_from_cu_seqlens(cu_k).segment_ids  # (K,)
    vis = seg_q[:, None] == seg_k[None, :]  # (Q, K) block-diagonal
    if causal:
        vis &= np.arange(cu_k[-1])[None, :] <= np.arange(cu_q[-1])[:, None]
    return vis[None, None]


def to_cu_seqlens(visible: Any) -> VarlenLowering:
    """Lower a block-diagonal relation of one packed row to ``cu_seqlens`` (and a causal flag).

    Only relations that varlen metadata expresses exactly are accepted: consecutive blocks
    tiling every query and key row, each block either fully visible or (square and) causal.
    Empty sequences leave no trace in a relation, so the offsets returned never repeat;
    ``from_cu_seqlens`` of them is the same relation as that of offsets with empty sequences.

    Parameters
    ----------
    visible : (1, 1, Q, K) or (Q, K) bool ndarray, or a relation

    Returns
    -------
    VarlenLowering

    Raises
    ------
    RefAttnError
        If B or H is not 1, a row is empty, or the relation is not such a block-diagonal one.

    Examples
    --------
    >>> low = to_cu_seqlens(from_cu_seqlens([0, 3, 7, 12, 16], causal=True))
    >>> low.cu_seqlens_q.tolist(), low.causal, low.max_seqlen_q
    ([0, 3, 7, 12, 16], True, 5)
    """
    vis = dense_relation("visible", visible)
    if vis.ndim == 3:
        raise RefAttnError(f"visible: expected [Q,K] or [1,1,Q,K], got {list(vis.shape)}")
    vis4 = as4(vis)
    if vis4.shape[:2] != (1, 1):
        raise RefAttnError(
            f"visible: cu_seqlens describes one packed row shared by all heads; expected "
            f"B=1 and H=1, got shape {list(vis4.shape)}"
        )
    _check_rows(vis4, "reject")
    rel = vis4[0, 0]  # (Q, K)
    Q, K = rel.shape
    first = rel.argmax(axis=1)  # (Q,) first legal key of every row
    last = K - 1 - rel[:, ::-1].argmax(axis=1)  # (Q,) last legal key
    q_starts = np.flatnonzero(np.diff(first, prepend=-1) != 0)  # rows where a block starts
    cu_q = np.append(q_starts, Q)
    k_ends = np.maximum.reduceat(last, q_starts) + 1  # (n,)
    cu_k = np.append(first[q_starts], k_ends[-1])
    tiles = (cu_k[0] == 0 and cu_k[-1] == K and np.array_equal(cu_k[1:-1], k_ends[:-1])
             and (np.diff(cu_k) > 0).all())
    if tiles:
        candidates = [False] + ([True] if np.array_equal(cu_q, cu_k) else [])
        for is_causal in candidates:
            rebuilt = from_cu_seqlens(cu_q, cu_seqlens_k=cu_k, causal=is_causal)[0, 0]
            if np.array_equal(rebuilt, rel):
                return VarlenLowering(cu_q.astype(np.int64), cu_k.astype(np.int64),
                                      int(np.diff(cu_q).max()), int(np.diff(cu_k).max()),
                                      is_causal)
    diag = "blocks do not tile the key axis in order" if not tiles else (
        "some block is neither fully visible nor square-causal")
    raise RefAttnError(
        f"visible: not a block-diagonal relation that cu_seqlens can express ({diag}); "
        "lower it with to_sdpa_bool or to_block_mask instead"
    )


# -- is_causal: PyTorch reads it as upper-left -------------------------------------------------
@dataclass(frozen=True, eq=False)
class SdpaCausal:
    """Arguments for ``scaled_dot_product_attention``: either the flag or an explicit mask.

    Attributes
    ----------
    is_causal : bool
        True only when the relation is exactly the upper-left causal triangle.
    attn_mask : bool ndarray or None
        SDPA bool polarity (True participates) when ``is_causal`` is False.
    """

    is_causal: bool
    attn_mask: np.ndarray | None


def _upper_left(Q: int, K: int) -> np.ndarray:
    return np.arange(K)[None, :] <= np.arange(Q)[:, None]  # (Q, K): j <= i


def to_sdpa_causal(
    visible: Any,
    *,
    mode: Literal["auto", "flag"] = "auto",
    all_masked_rows: RowPolicy = "reject",
) -> SdpaCausal:
    """Lower a causal relation for SDPA, using ``is_causal=True`` only where it is exact.

    PyTorch documents ``is_causal=True`` as upper-left aligned for non-square scores. A
    relation that is exactly the upper-left triangle (for every batch row and head) becomes
    the flag; anything else (a lower-right decode chunk, padding, packing, windows) is
    lowered to an explicit SDPA bool mask, or refused when ``mode="flag"``.

    Parameters
    ----------
    visible : bool ndarray broadcastable to (B, Hq, Q, K), or a relation
    mode : {"auto", "flag"}
        "flag" raises instead of falling back to an explicit mask.
    all_masked_rows : {"reject", "allow"}

    Returns
    -------
    SdpaCausal

    Examples
    --------
    >>> to_sdpa_causal(causal(2, 5, alignment="upper_left")).is_causal
    True
    >>> low = to_sdpa_causal(causal(2, 5, alignment="lower_right"))
    >>> low.is_causal, low.attn_mask[0, 0].astype(int).tolist()
    (False, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    """
    if mode not in ("auto", "flag"):
        raise RefAttnError(f"mode: expected 'auto' or 'flag', got {mode!r}")
    rel = visible if isinstance(visible, BaseRelation) else None
    vis = dense_relation("visible", visible)
    Q, K = vis.shape[-2:]
    vis4 = as4(vis)
    diff = first_index(vis4 != _upper_left(Q, K))
    if diff is None:
        _check_rows(vis, all_masked_rows)
        return SdpaCausal(True, None)
    if mode == "flag":
        if rel is not None and rel.alignment == "lower_right":
            raise RefAttnError(
                f"refusing to lower a lower-right causal relation (Q={Q}, K={K}) to "
                "is_causal=True: PyTorch reads is_causal as upper-left for non-square scores; "
                "pass the explicit mask (mode='auto')"
            )
        raise RefAttnError(
            f"visible: differs from the upper-left causal relation that is_causal=True means "
            f"at edge {format_index(diff, 'bhij')} (visible={bool(vis4[diff])}); "
            "pass the explicit mask (mode='auto')"
        )
    return SdpaCausal(False, to_sdpa_bool(vis, all_masked_rows=all_masked_rows))


def from_sdpa_causal(lowering: SdpaCausal, *, q_len: int, k_len: int) -> np.ndarray:
    """Inverse of :func:`to_sdpa_causal`: the relation SDPA will apply.

    Examples
    --------
    >>> from_sdpa_causal(SdpaCausal(True, None), q_len=2, k_len=3)[0, 0].astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
    """
    if lowering.is_causal:
        return causal(q_len, k_len, alignment="upper_left").dense()
    if lowering.attn_mask is None:
        raise RefAttnError("lowering: is_causal=False needs an attn_mask")
    return from_sdpa_bool(lowering.attn_mask)

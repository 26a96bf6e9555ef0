"""Position biases built from positions: ALiBi (attention with linear biases).

Owns the finite ALiBi preference ``bias[b, h, i, j] = -m[b, h] * |q_pos[i] - k_pos[j]|`` with
slopes per head ``(Hq,)`` or per batch row and head ``(B, Hq)`` (FlashAttention's
``alibi_slopes`` accepts both), the standard head slopes of Press et al. and the chain rule
from ``grad_bias`` to the slopes.
Defers everything else to the call: the bias is an ordinary finite ``bias`` tensor, added
after the scale (and softcap) and BEFORE visibility, so it never revives an illegal edge; its
gradient is the engine's ``grad_bias``.

Under a causal visibility the symmetric distance equals the original ALiBi ``m_h (j - i)``
on every legal edge. FlashAttention's bottom-right aligned convention is
``q_pos = arange(Q) + K - Q``, ``k_pos = arange(K)``.
"""

from __future__ import annotations

import math

import numpy as np

from refattn._checks import as_array, bounded_int, check_finite, check_float64, index_array
from refattn.errors import RefAttnError

#: the most heads :func:`alibi_slopes` makes slopes for (a list of that many floats is built)
_MAX_HEADS = 2**20

__all__ = ["alibi", "alibi_slope_gradient", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes for ``num_heads`` heads (Press et al., reference code).

    For a power of two ``n``, head ``h`` (0-based) gets ``2 ** (-8 (h + 1) / n)``. Otherwise
    the ``n`` slopes of the largest power of two ``n < H`` come first, followed by every
    other slope of the ``2n`` sequence.

    Parameters
    ----------
    num_heads : int
        H >= 1.

    Returns
    -------
    (H,) float64 ndarray

    Examples
    --------
    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> alibi_slopes(3).tolist()  # 2 from n=2, then the first odd-position slope of n=4
    [0.0625, 0.00390625, 0.25]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise RefAttnError(f"num_heads: expected an integer, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise RefAttnError(f"num_heads: expected at least 1 head, got {num_heads}")
    bounded_int("num_heads", num_heads, lo=1, hi=_MAX_HEADS)  # a list of H slopes is built

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))  # 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    H = int(num_heads)
    n = 2 ** math.floor(math.log2(H))
    slopes = power_of_two(n)
    if n < H:
        slopes += power_of_two(2 * n)[0::2][: H - n]
    return np.array(slopes, dtype=np.float64)


def _positions(name: str, x: object) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype.kind in "iu":  # integer positions are exact in float64 within +-2**53 only
        arr = index_array(name, arr, lo=-(2**53), hi=2**53).astype(np.float64)
    else:
        check_float64(name, arr)
    if arr.ndim not in (1, 2):
        raise RefAttnError(f"{name}: expected shape [L] or [B,L], got {list(arr.shape)}")
    check_finite(name, arr)
    return arr


def _distance(q_pos: object, k_pos: object) -> np.ndarray:
    qp = _positions("q_pos", q_pos)
    kp = _positions("k_pos", k_pos)
    qb = qp if qp.ndim == 2 else qp[None]  # (Bq, Q)
    kb = kp if kp.ndim == 2 else kp[None]  # (Bk, K)
    if qb.shape[0] != kb.shape[0] and 1 not in (qb.shape[0], kb.shape[0]):
        raise RefAttnError(
            f"q_pos/k_pos: batch axes {qb.shape[0]} and {kb.shape[0]} do not broadcast"
        )
    diff = qb[:, :, None] - kb[:, None, :]  # (B, Q, K) signed distance i - j
    return np.sqrt(diff * diff)  # |i - j| (positions carry no derivative)


def _slopes(slopes: object) -> np.ndarray:
    """``slopes`` as a finite float64 (H,) or (B, H) array (never cast)."""
    m = as_array("slopes", slopes)
    check_float64("slopes", m)
    if m.ndim not in (1, 2):
        raise RefAttnError(
            f"slopes: expected shape [H] (one slope per head) or [B,H] (per batch row and "
            f"head), got {list(m.shape)}"
        )
    check_finite("slopes", m)
    return m


def alibi(slopes: np.ndarray, q_pos: object, k_pos: object) -> np.ndarray:
    """ALiBi bias ``-slopes[(b,) h] * |q_pos[i] - k_pos[j]|`` for a call's ``bias=``.

    Parameters
    ----------
    slopes : (H,) or (B, H) float64 ndarray
        Per-head slopes (e.g. :func:`alibi_slopes`), or one row of slopes per batch row
        (FlashAttention's ``alibi_slopes`` of shape ``(batch, nheads)``).
    q_pos : (Q,) or (B, Q) integer or float64 ndarray
        Position of every query row.
    k_pos : (K,) or (B, K) integer or float64 ndarray
        Position of every key row.

    Returns
    -------
    (B or 1, H, Q, K) float64 ndarray
        Finite; broadcastable to the call's (B, Hq, Q, K). B is 1 only when the slopes and
        both positions are shared by every batch row.

    Raises
    ------
    RefAttnError
        On non-float64 or non-finite slopes (naming the index), a slope array of another
        rank, or batch axes of slopes and positions that do not broadcast.

    Examples
    --------
    >>> alibi(np.array([0.5]), np.arange(3), np.arange(3))[0, 0].tolist()
    [[-0.0, -0.5, -1.0], [-0.5, -0.0, -0.5], [-1.0, -0.5, -0.0]]
    >>> per_batch = alibi(np.array([[0.5], [0.25]]), np.arange(2), np.arange(2))
    >>> per_batch.shape, per_batch[1, 0].tolist()
    ((2, 1, 2, 2), [[-0.0, -0.25], [-0.25, -0.0]])
    """
    m = _slopes(slopes)
    dist = _distance(q_pos, k_pos)  # (Bd, Q, K)
    if m.ndim == 1:
        return -m[None, :, None, None] * dist[:, None]  # (Bd, H, Q, K)
    if m.shape[0] != dist.shape[0] and 1 not in (m.shape[0], dist.shape[0]):
        raise RefAttnError(
            f"slopes: batch axis B={m.shape[0]} does not broadcast with the positions' batch "
            f"axis B={dist.shape[0]}"
        )
    return -m[:, :, None, None] * dist[:, None]  # (B, H, Q, K)


def alibi_slope_gradient(grad_bias: np.ndarray, q_pos: object, k_pos: object, *,
                         per_batch: bool = False) -> np.ndarray:
    """Chain rule from the engine's ``grad_bias`` of an :func:`alibi` bias to the slopes.

    Parameters
    ----------
    grad_bias : (B or 1, H, Q, K) float64 ndarray
        ``Gradients.grad_bias`` of a call whose bias was ``alibi(slopes, q_pos, k_pos)``.
    q_pos, k_pos
        The positions used to build the bias.
    per_batch : bool
        True for (B, H) slopes: the gradient keeps the batch axis.

    Returns
    -------
    (H,) or (B, H) float64 ndarray
        ``-sum_{b,i,j} grad_bias[b, h, i, j] * |q_pos[i] - k_pos[j]|`` (the sum over b is
        omitted with ``per_batch=True``).

    Examples
    --------
    >>> g = np.ones((1, 2, 2, 2))
    >>> alibi_slope_gradient(g, np.arange(2), np.arange(2)).tolist()
    [-2.0, -2.0]
    >>> alibi_slope_gradient(np.ones((3, 1, 2, 2)), np.arange(2), np.arange(2),
    ...                      per_batch=True).tolist()
    [[-2.0], [-2.0], [-2.0]]
    """
    g = as_array("grad_bias", grad_bias)
    check_float64("grad_bias", g)
    dist = _distance(q_pos, k_pos)  # (Bd, Q, K)
    Bd = dist.shape[0]
    batch_ok = g.ndim == 4 and (g.shape[0] == Bd or (per_batch and Bd == 1))
    if not batch_ok or g.shape[2:] != dist.shape[1:]:
        raise RefAttnError(
            f"grad_bias: expected the alibi bias shape [B,H,Q,K] with B, Q, K = "
            f"{list(dist.shape)}{' (or B of the slopes)' if per_batch else ''}, "
            f"got {list(g.shape)}"
        )
    if per_batch:  # (B, H): one slope gradient per batch row and head
        return -np.einsum("bhqk,bqk->bh", g, np.broadcast_to(dist, (g.shape[0], *dist.shape[1:])))
    return -np.einsum("bhqk,bqk->h", g, dist)

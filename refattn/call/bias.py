"""Position biases built from positions: ALiBi (attention with linear biases).

Owns the finite ALiBi preference ``bias[b, h, i, j] = -m_h * |q_pos[i] - k_pos[j]|``, the
standard head slopes of Press et al. and the chain rule from ``grad_bias`` to the slopes.
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

from refattn._checks import as_array, check_finite, check_float64
from refattn.errors import RefAttnError

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
    if arr.dtype.kind in "iu":
        arr = arr.astype(np.float64)  # integer positions are exact in float64 below 2**53
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


def alibi(slopes: np.ndarray, q_pos: object, k_pos: object) -> np.ndarray:
    """ALiBi bias ``-slopes[h] * |q_pos[i] - k_pos[j]|`` for a call's ``bias=``.

    Parameters
    ----------
    slopes : (H,) float64 ndarray
        Per-head slopes (e.g. :func:`alibi_slopes`).
    q_pos : (Q,) or (B, Q) integer or float64 ndarray
        Position of every query row.
    k_pos : (K,) or (B, K) integer or float64 ndarray
        Position of every key row.

    Returns
    -------
    (B or 1, H, Q, K) float64 ndarray
        Finite; broadcastable to the call's (B, Hq, Q, K).

    Examples
    --------
    >>> alibi(np.array([0.5]), np.arange(3), np.arange(3))[0, 0].tolist()
    [[-0.0, -0.5, -1.0], [-0.5, -0.0, -0.5], [-1.0, -0.5, -0.0]]
    """
    m = as_array("slopes", slopes)
    check_float64("slopes", m)
    if m.ndim != 1:
        raise RefAttnError(f"slopes: expected shape [H], got {list(m.shape)}")
    check_finite("slopes", m)
    dist = _distance(q_pos, k_pos)  # (B, Q, K)
    return -m[None, :, None, None] * dist[:, None]  # (B, H, Q, K)


def alibi_slope_gradient(grad_bias: np.ndarray, q_pos: object, k_pos: object) -> np.ndarray:
    """Chain rule from the engine's ``grad_bias`` of an :func:`alibi` bias to the slopes.

    Parameters
    ----------
    grad_bias : (B or 1, H, Q, K) float64 ndarray
        ``Gradients.grad_bias`` of a call whose bias was ``alibi(slopes, q_pos, k_pos)``.
    q_pos, k_pos
        The positions used to build the bias.

    Returns
    -------
    (H,) float64 ndarray
        ``-sum_{b,i,j} grad_bias[b, h, i, j] * |q_pos[i] - k_pos[j]|``.

    Examples
    --------
    >>> g = np.ones((1, 2, 2, 2))
    >>> alibi_slope_gradient(g, np.arange(2), np.arange(2)).tolist()
    [-2.0, -2.0]
    """
    g = as_array("grad_bias", grad_bias)
    check_float64("grad_bias", g)
    dist = _distance(q_pos, k_pos)  # (B, Q, K)
    if g.ndim != 4 or g.shape[0] != dist.shape[0] or g.shape[2:] != dist.shape[1:]:
        raise RefAttnError(
            f"grad_bias: expected the alibi bias shape [B,H,Q,K] with B, Q, K = "
            f"{list(dist.shape)}, got {list(g.shape)}"
        )
    return -np.einsum("bhqk,bqk->h", g, dist)

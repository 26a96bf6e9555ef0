"""The rotation of RoPE at per-token positions, forward and its exact backward.

Owns :func:`apply`, :func:`apply_backward` and :func:`check_positions`. The definition is
FlashAttention's reference ``apply_rotary_emb_torch`` (Dao-AILab/flash-attention,
``flash_attn/layers/rotary.py``, commit 0251105a2fb19d2957484b7f023cd8c115286ced): with
``cos``, ``sin`` of shape ``(seqlen_ro, rotary_dim / 2)`` and ``c = cos[p]``, ``s = sin[p]``
at a token's position ``p``, the first ``rotary_dim`` columns of ``x`` become ``x * c' +
rotate_half(x) * s'`` and the others are kept, where

- ``interleaved=False`` (GPT-NeoX, "half-split"): columns ``i`` and ``i + rotary_dim / 2``
  form pair ``i``: ``y[i] = x[i] c[i] - x[i + r/2] s[i]``, ``y[i + r/2] = x[i + r/2] c[i] +
  x[i] s[i]`` (``rotate_half`` = ``cat(-x2, x1)``, ``cos`` repeated ``"(2 d)"``);
- ``interleaved=True`` (GPT-J): columns ``2i`` and ``2i + 1`` form pair ``i``: ``y[2i] =
  x[2i] c[i] - x[2i+1] s[i]``, ``y[2i+1] = x[2i+1] c[i] + x[2i] s[i]``.

Each output element is one correctly rounded ``a*c - b*s`` or ``a*c + b*s`` of two rounded
products (``x*c + (-b)*s`` rounds like ``x*c - b*s``), in float64. The backward is the
transpose of that linear map: ``grad_x = R(p)^T grad_y``, the same rotation with ``-sin``
(exact for any table, with or without YaRN's attention factor folded into cos and sin:
the map is ``[[c, -s], [s, c]]`` per pair whatever ``c^2 + s^2`` is).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_finite, check_float64, index_array
from refattn._memory import check_bytes
from refattn.errors import RefAttnError

__all__ = ["LAYOUTS", "apply", "apply_backward", "check_positions"]

#: rotary_interleaved -> the layout's name
LAYOUTS = {False: "gpt-neox half-split: pairs (i, i + rotary_dim / 2)",
           True: "gpt-j interleaved: pairs (2i, 2i + 1)"}


def _tables(cos: Any, sin: Any) -> tuple[np.ndarray, np.ndarray]:
    c, s = as_array("cos", cos), as_array("sin", sin)
    for name, t in (("cos", c), ("sin", s)):
        check_float64(name, t)
        if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
            raise RefAttnError(f"{name}: expected shape [seqlen_ro, rotary_dim / 2] (non-empty)"
                               f", got {list(t.shape)}")
        check_finite(name, t)
    if c.shape != s.shape:
        raise RefAttnError(f"sin: shape {list(s.shape)} must equal cos's {list(c.shape)}")
    return c, s


@public
def check_positions(positions: Any, table_rows: int, *, name: str = "positions",
                    table: str = "cos", letters: str = "bl") -> np.ndarray:
    """``positions`` as int64, each in ``[0, table_rows)``; otherwise a :class:`RefAttnError`
    naming the entry, its value and the table's length ("RoPE table shorter than the
    positions").

    Examples
    --------
    >>> try:
    ...     check_positions(np.array([[0, 5]]), 4, table="rotary_cos")
    ... except RefAttnError as exc:
    ...     print(str(exc)[:71])
    positions: entry (b=0, l=1) is 5, expected a position in [0, 4) (rotary
    """
    arr = as_array(name, positions)
    return index_array(name, arr, lo=0, hi=table_rows - 1,
                       letters=letters if arr.ndim == len(letters) else None,
                       expected=f"a position in [0, {table_rows}) ({table} has {table_rows} "
                                "rows: the RoPE table is shorter than the positions)")


def _rotate(x: Any, cos: Any, sin: Any, positions: Any, interleaved: bool,
            rotary_dim: int | None, sign: float, what: str) -> np.ndarray:
    arr = as_array(what, x)
    check_float64(what, arr)
    if arr.ndim < 2:
        raise RefAttnError(f"{what}: expected shape [B, ..., L, D], got {list(arr.shape)}")
    check_finite(what, arr)
    c, s = _tables(cos, sin)
    half = c.shape[1]
    R = 2 * half
    if rotary_dim is not None and rotary_dim != R:
        raise RefAttnError(f"rotary_dim: {rotary_dim} but cos has {half} columns "
                           f"(rotary_dim / 2 = {half}: rotary_dim = {R})")
    D, L = arr.shape[-1], arr.shape[-2]
    if R > D:
        raise RefAttnError(f"rotary_dim: {R} (2 x cos's columns) exceeds {what}'s head "
                           f"dimension D = {D}")
    pos = as_array("positions", positions)
    if pos.ndim == 1:
        if pos.shape != (L,):
            raise RefAttnError(f"positions: expected shape [L={L}] or [B, L], got "
                               f"{list(pos.shape)}")
    elif pos.ndim == 2:
        if arr.ndim < 3 or pos.shape != (arr.shape[0], L):
            raise RefAttnError(f"positions: expected shape [B={arr.shape[0]}, L={L}] (x is "
                               f"{list(arr.shape)}), got {list(pos.shape)}")
    else:
        raise RefAttnError(f"positions: expected shape [L] or [B, L], got {list(pos.shape)}")
    pos = check_positions(pos, c.shape[0], table="cos", letters="bl" if pos.ndim == 2 else "l")
    check_bytes(6 * arr.nbytes + 16 * pos.size * half, f"rotating {what} of shape "
                f"{list(arr.shape)}", "rotate fewer tokens at once")
    cp, sp = c[pos], s[pos] * sign  # (B, L, half) or (L, half); negation is exact
    if pos.ndim == 2:  # (B, 1, ..., 1, L, half) against x (B, M..., L, D)
        shape = (pos.shape[0],) + (1,) * (arr.ndim - 3) + (L, half)
        cp, sp = cp.reshape(shape), sp.reshape(shape)
    out = np.array(arr, dtype=np.float64, copy=True)
    if interleaved:
        x1, x2 = arr[..., 0:R:2], arr[..., 1:R:2]
        out[..., 0:R:2] = x1 * cp - x2 * sp
        out[..., 1:R:2] = x2 * cp + x1 * sp
    else:
        x1, x2 = arr[..., :half], arr[..., half:R]
        out[..., :half] = x1 * cp - x2 * sp
        out[..., half:R] = x2 * cp + x1 * sp
    return out


@public
def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
          interleaved: bool = False, rotary_dim: int | None = None) -> np.ndarray:
    """RoPE: the first ``rotary_dim`` columns of ``x`` rotated at each token's position.

    Parameters
    ----------
    x : (B, ..., L, D) float64 ndarray
        Any axes between the batch and the tokens (heads) share the tokens' positions.
    cos, sin : (seqlen_ro, rotary_dim / 2) float64 ndarray
        The tables (:func:`refattn.rope.cos_sin`, or FlashAttention's ``rotary_cos`` /
        ``rotary_sin`` as given).
    positions : (B, L) or (L,) integer ndarray
        Token l of batch row b sits at ``positions[b, l]`` (varlen, paged, left-padded and
        decode positions alike), ``0 <= positions < seqlen_ro``.
    interleaved : bool
        False: GPT-NeoX half-split pairs ``(i, i + rotary_dim / 2)``; True: GPT-J pairs
        ``(2i, 2i + 1)`` (FlashAttention's ``rotary_interleaved``).
    rotary_dim : int, optional
        Must equal ``2 * cos.shape[1]`` when given; at most D. Columns from it on are copied.

    Returns
    -------
    (B, ..., L, D) float64 ndarray
        A new array (``x`` is never changed).

    Raises
    ------
    RefAttnError
        A non-float64 or non-finite input, mismatched table shapes, an odd or too large
        rotary dimension, a position outside the table (naming the entry and the table's
        length).

    Examples
    --------
    >>> c, s = np.array([[0.0]]), np.array([[1.0]])        # a quarter turn at position 0
    >>> apply(np.array([[[1.0, 2.0, 3.0]]]), c, s, np.array([[0]])).tolist()
    [[[-2.0, 1.0, 3.0]]]
    """
    return _rotate(x, cos, sin, positions, bool(interleaved), rotary_dim, 1.0, "x")


@public
def apply_backward(grad: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
                   interleaved: bool = False, rotary_dim: int | None = None) -> np.ndarray:
    """The gradient of ``x`` from the gradient of ``apply(x, ...)``: the transpose rotation
    (``-sin``), columns past ``rotary_dim`` passed through. Arguments as :func:`apply`.

    Examples
    --------
    >>> c, s = np.array([[0.0]]), np.array([[1.0]])
    >>> apply_backward(np.array([[[-2.0, 1.0, 3.0]]]), c, s, np.array([[0]])).tolist()
    [[[1.0, 2.0, 3.0]]]
    """
    return _rotate(grad, cos, sin, positions, bool(interleaved), rotary_dim, -1.0, "grad")

"""Visibility diagnostics: rows with no legal key, and the contract's q\\k text matrix.

Owns inspection of an already-built dense relation, and reading a relation or bool array as
one (:func:`dense_relation`, :func:`as4`, shared with the adapters); defers building relations to
:mod:`refattn.masks` and enforcing an all-masked-row policy to the adapters and
:class:`refattn.AttentionCall`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_bool
from refattn.errors import RefAttnError
from refattn.masks.algebra import BaseRelation

__all__ = ["EmptyRow", "as4", "dense_relation", "empty_rows", "render"]


class EmptyRow(NamedTuple):
    """A query row (b, h, i) whose legal key set is empty."""

    b: int
    h: int
    i: int


def dense_relation(name: str, visible: Any) -> np.ndarray:
    """A relation's :meth:`~refattn.masks.BaseRelation.dense` (a coordinate relation or a
    composition), or a checked bool array (shape kept).

    Examples
    --------
    >>> dense_relation("visible", np.eye(2, dtype=bool)).shape
    (2, 2)
    """
    if isinstance(visible, BaseRelation):
        return visible.dense()
    arr = as_array(name, visible)
    check_bool(name, arr)
    if not 2 <= arr.ndim <= 4:
        raise RefAttnError(
            f"{name}: expected [Q,K], [H,Q,K] or [B,H,Q,K] axes, got shape {list(arr.shape)}"
        )
    return arr


def as4(arr: np.ndarray) -> np.ndarray:
    """View of a 2- to 4-axis relation with size-1 leading axes added: (B, H, Q, K)."""
    return arr.reshape((1,) * (4 - arr.ndim) + arr.shape)


@public
def empty_rows(visible: Any) -> list[EmptyRow]:
    """Every (b, h, i) with no legal key.

    Parameters
    ----------
    visible : bool ndarray of shape (Q, K), (H, Q, K) or (B, H, Q, K), or a relation
        Missing leading axes count as size 1.

    Returns
    -------
    list of EmptyRow
        In C order; empty when every row has a legal key.

    Examples
    --------
    >>> empty_rows(np.array([[True, False], [False, False]]))
    [EmptyRow(b=0, h=0, i=1)]
    """
    vis = as4(dense_relation("visible", visible))
    none = ~vis.any(axis=-1)  # (B, H, Q)
    return [EmptyRow(int(b), int(h), int(i)) for b, h, i in zip(*np.nonzero(none), strict=True)]


def _labels(name: str, labels: Sequence[Any] | None, n: int) -> list[str]:
    if labels is None:
        return [str(x) for x in range(n)]
    out = [str(x) for x in labels]
    if len(out) != n:
        raise RefAttnError(f"{name}: expected {n} labels, got {len(out)}")
    return out


@public
def render(
    visible2d: Any,
    *,
    q_labels: Sequence[Any] | None = None,
    k_labels: Sequence[Any] | None = None,
    corner: str | None = None,
) -> str:
    """The relation as the contract draws it: a ``q\\k`` header, then one row of 1/0 per query.

    Parameters
    ----------
    visible2d : (Q, K) bool ndarray
    q_labels, k_labels : sequence, optional
        Row and column labels (default 0..Q-1 and 0..K-1; pass absolute positions to draw a
        cache relation).
    corner : str, optional
        Header corner, default ``"q\\k"`` (``"q_abs\\k_abs"`` when labels are given).

    Returns
    -------
    str
        Lines joined by newlines (no trailing newline).

    Examples
    --------
    >>> print(render(np.tril(np.ones((2, 3), bool))))
    q\\k  0 1 2
     0   1 0 0
     1   1 1 0
    """
    arr = as_array("visible2d", visible2d)
    check_bool("visible2d", arr)
    if arr.ndim != 2:
        raise RefAttnError(f"visible2d: expected shape [Q,K], got {list(arr.shape)}")
    Q, K = arr.shape
    rows = _labels("q_labels", q_labels, Q)
    cols = _labels("k_labels", k_labels, K)
    if corner is None:
        corner = "q\\k" if q_labels is None and k_labels is None else "q_abs\\k_abs"
    cw = max(len(c) for c in cols)  # column width
    lw = max(len(corner), *(len(r) for r in rows))  # label column width
    lines = [corner.ljust(lw) + "  " + " ".join(c.rjust(cw) for c in cols)]
    for label, row in zip(rows, arr, strict=True):
        cells = " ".join(("1" if v else "0").rjust(cw) for v in row)
        lines.append(label.center(lw) + "  " + cells)
    return "\n".join(lines)

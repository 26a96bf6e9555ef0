"""Source identity: key row j and value row j must name the same source object.

Owns the row-label check of the contract ("Source identity survives every legal
transformation"): tensors alone cannot tell that K was gathered, sorted, sharded or cached
under one index map and V under another -- every shape stays valid and the output is
numerically fine but semantically corrupt. Carrying labels beside the rows makes it checkable.
Defers the arithmetic to :mod:`refattn.engine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, format_index
from refattn.call import AttentionCall
from refattn.engine import forward
from refattn.engine.trace import Trace
from refattn.errors import RefAttnError

__all__ = [
    "LabelledRows",
    "SourceIdentityReport",
    "check_source_identity",
    "labelled_attention",
    "take_rows",
]


@dataclass(frozen=True)
class SourceIdentityReport:
    """Result of a passing :func:`check_source_identity`.

    Attributes
    ----------
    shape : tuple of int
        The broadcast label shape that was compared (..., K).
    checked : tuple of str
        Names of the label arrays compared with the key labels.
    """

    shape: tuple[int, ...]
    checked: tuple[str, ...]


def _labels(name: str, x: object) -> np.ndarray:
    arr = as_array(name, x)
    if arr.ndim < 1:
        raise RefAttnError(f"{name}: expected labels with a trailing key axis K, got a scalar")
    return arr


@public
def check_source_identity(
    key_labels: object,
    value_labels: object,
    *,
    others: Mapping[str, object] | None = None,
) -> SourceIdentityReport:
    """Check that every key row and its value row (and any other key-indexed tensor) agree.

    Parameters
    ----------
    key_labels : (K,), (B, K) or (B, Hkv, K) array of labels
        Source object of every key row (any comparable dtype: int ids, strings).
    value_labels : array of labels broadcastable with ``key_labels``
        Source object of every value row.
    others : mapping of str to label arrays, optional
        Further tensors indexed by the key axis (a bias column, a visibility column, a cache
        slot map) that must name the same sources.

    Returns
    -------
    SourceIdentityReport

    Raises
    ------
    RefAttnError
        Naming the first key row whose labels differ, and both labels.

    Examples
    --------
    >>> check_source_identity(["s:0", "s:1"], np.array(["s:0", "s:1"])).shape
    (2,)
    >>> check_source_identity([0, 1, 2], [0, 2, 1])
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: source identity: key row (j=1) is labelled 1 but value \
row (j=1) is labelled 2; K and V were reordered under different index maps
    """
    keys = _labels("key_labels", key_labels)
    named = {"value": _labels("value_labels", value_labels)}
    for name, labels in (others or {}).items():
        named[name] = _labels(f"others[{name!r}]", labels)
    try:
        shape = np.broadcast_shapes(keys.shape, *(a.shape for a in named.values()))
    except ValueError:
        shapes = {"key": list(keys.shape), **{n: list(a.shape) for n, a in named.items()}}
        raise RefAttnError(f"source identity: label shapes do not broadcast: {shapes}") from None
    k_full = np.broadcast_to(keys, shape)
    letters = {1: "j", 2: "bj", 3: "bhj"}.get(len(shape))  # (K,), (B, K), (B, Hkv, K)
    for name, labels in named.items():
        full = np.broadcast_to(labels, shape)
        same = np.asarray(k_full == full)
        if same.shape != shape:  # incomparable dtypes compare as a scalar False
            raise RefAttnError(f"source identity: key and {name} labels cannot be compared")
        bad = np.argwhere(~same)
        if bad.size:
            idx = tuple(int(i) for i in bad[0])
            where = format_index(idx, letters)
            role = "V" if name == "value" else name
            raise RefAttnError(
                f"source identity: key row {where} is labelled {k_full[idx].item()!r} but "
                f"{name} row {where} is labelled {full[idx].item()!r}; K and {role} were "
                "reordered under different index maps"
            )
    return SourceIdentityReport(shape=tuple(int(n) for n in shape), checked=tuple(named))


@dataclass(frozen=True, eq=False)
class LabelledRows:
    """Key-axis rows of one tensor with the source label of every row carried beside them.

    Attributes
    ----------
    values : (B, Hkv, K, D) float64 ndarray
    labels : (K,) or (B, K) array
    """

    values: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        values = np.asarray(self.values)
        labels = np.asarray(self.labels)
        if values.ndim != 4:
            raise RefAttnError(f"values: expected shape [B,Hkv,K,D], got {list(values.shape)}")
        if labels.ndim not in (1, 2) or labels.shape[-1] != values.shape[2]:
            raise RefAttnError(
                f"labels: expected [K] or [B,K] with K={values.shape[2]}, got {list(labels.shape)}"
            )
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "labels", labels)

    def label_grid(self) -> np.ndarray:
        """Labels shaped ``(B or 1, 1, K)`` to compare with another tensor's."""
        lab = self.labels if self.labels.ndim == 2 else self.labels[None]
        return lab[:, None, :]


def take_rows(rows: LabelledRows, index: np.ndarray) -> LabelledRows:
    """Gather key-axis rows and their labels under ONE index map (a legal transformation).

    Parameters
    ----------
    rows : LabelledRows
    index : (K',) integer ndarray
        Rows to take, in order (a permutation, a shard, a cache slot list).

    Returns
    -------
    LabelledRows

    Examples
    --------
    >>> r = LabelledRows(np.arange(3.0).reshape(1, 1, 3, 1), np.array(["a", "b", "c"]))
    >>> take_rows(r, np.array([2, 0])).labels.tolist()
    ['c', 'a']
    """
    idx = as_array("index", index)
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise RefAttnError(
            f"index: expected a 1-D integer array, got {idx.dtype} {list(idx.shape)}"
        )
    return LabelledRows(rows.values[:, :, idx], rows.labels[..., idx])


def labelled_attention(
    q: np.ndarray,
    keys: LabelledRows,
    values: LabelledRows,
    *,
    backend: str = "numpy",
    **call_options: Any,
) -> Trace:
    """Check source identity, then run the call: the oracle with row labels carried beside.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
    keys : LabelledRows
        K rows, (B, Hkv, K, Dk), with labels.
    values : LabelledRows
        V rows, (B, Hkv, K, Dv), with labels.
    backend : str
        Engine backend (default ``"numpy"``).
    **call_options
        Keywords for :class:`~refattn.AttentionCall`.

    Returns
    -------
    Trace

    Raises
    ------
    RefAttnError
        When a key row and its value row name different sources.

    Examples
    --------
    >>> kv = LabelledRows(np.eye(2).reshape(1, 1, 2, 2), np.array([10, 11]))
    >>> labelled_attention(np.zeros((1, 1, 1, 2)), kv, kv).output.ravel().tolist()
    [0.5, 0.5]
    """
    check_source_identity(keys.label_grid(), values.label_grid())
    return forward(AttentionCall(q, keys.values, values.values, **call_options), backend=backend)

"""The layouts of attention states (partial output, lse) that kernels use, read and checked.

Owns :data:`LAYOUTS` and the reading of a state's arrays into one canonical view: the output
``(..., D)`` and the lse ``(...)`` with the same leading axes, partials stacked on axis 0. Each
layout is the one its kernels write:

``"refattn"``
    output ``(B, H, L, D)``, lse ``(B, H, L)`` (a :class:`~refattn.Trace`'s ``output`` and
    ``lse``); stacked partials put the state axis first: ``(S, B, H, L, D)``, ``(S, B, H, L)``.
``"flashinfer"``
    output ``(tokens, heads, dim)``, lse ``(tokens, heads)``; stacked partials put the state
    axis second, as ``flashinfer.cascade.merge_states`` does: ``(tokens, S, heads, dim)``,
    ``(tokens, S, heads)`` (flashinfer-ai/flashinfer ``flashinfer/cascade.py``,
    ``include/flashinfer/attention/cascade.cuh`` MergeStatesKernel).
``"flash_attn"``
    output ``(B, L, H, D)``, lse ``(B, H, L)`` (FlashAttention's ``out`` and ``softmax_lse``);
    stacked partials put the state axis first, as its split-KV accumulators
    (``out_accum`` / ``softmax_lse_accum``, read by ``combine_attn_seqk_parallel`` in
    Dao-AILab/flash-attention ``csrc/flash_attn/src/flash_fwd_kernel.h``):
    ``(S, B, L, H, D)``, ``(S, B, H, L)``.

Checks (a :class:`~refattn.errors.RefAttnError` naming the tensor, the index and the
expectation): float64 only, never cast; shapes that agree; finite outputs; an lse that is
finite or -inf (an empty partial), never +inf or NaN. (layer: masks | dropout | softmax |
states; imports only the foundation)
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from refattn._checks import as_array, check_float64, first_index, format_index
from refattn.errors import RefAttnError

__all__ = ["LAYOUTS", "Layout", "read_partials", "read_state", "to_layout"]

Layout = Literal["refattn", "flashinfer", "flash_attn"]
#: layout -> (output axes, lse axes) as letters, for messages
LAYOUTS: dict[str, tuple[str, str]] = {
    "refattn": ("BHLD", "BHL"),
    "flashinfer": ("NHD", "NH"),
    "flash_attn": ("BLHD", "BHL"),
}


def _layout(layout: str) -> tuple[str, str]:
    if layout not in LAYOUTS:
        raise RefAttnError(f"layout: expected one of {sorted(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def _array(name: str, x: object, ndim: int, axes: str) -> np.ndarray:
    a = as_array(name, x)
    check_float64(name, a)
    if a.ndim != ndim:
        raise RefAttnError(f"{name}: expected {ndim} axes ({axes}), got shape {a.shape}")
    return a


def _check_values(name_out: str, out: np.ndarray, name_lse: str, lse: np.ndarray,
                  out_index: tuple[int, ...], lse_index: tuple[int, ...]) -> None:
    """Finite outputs; an lse finite or -inf. Indexes are reported in the caller's layout
    (``out_index``/``lse_index`` map canonical axes back to the caller's)."""
    bad = ~np.isfinite(out)
    idx = first_index(bad)
    if idx is not None:
        shown = tuple(idx[a] for a in out_index)
        raise RefAttnError(f"{name_out}: non-finite value {out[idx].item()!r} at index "
                           f"{format_index(shown)}; expected a finite partial output")
    bad = np.isnan(lse) | (lse == np.inf)
    idx = first_index(bad)
    if idx is not None:
        shown = tuple(idx[a] for a in lse_index)
        raise RefAttnError(f"{name_lse}: {lse[idx].item()!r} at index {format_index(shown)}; "
                           "expected a finite log-sum-exp or -inf (an empty partial)")


def read_state(out: object, lse: object, layout: str, names: tuple[str, str] = ("out", "lse")
               ) -> tuple[np.ndarray, np.ndarray]:
    """One state in ``layout`` as canonical views: output ``(..., D)``, lse ``(...)``.

    Examples
    --------
    >>> o, s = read_state(np.zeros((2, 3, 4, 5)), np.zeros((2, 4, 3)), "flash_attn")
    >>> o.shape, s.shape
    ((2, 3, 4, 5), (2, 3, 4))
    """
    out_axes, lse_axes = _layout(layout)
    o = _array(names[0], out, len(out_axes), out_axes)
    s = _array(names[1], lse, len(lse_axes), lse_axes)
    if layout == "flash_attn":
        s = s.swapaxes(1, 2)  # (B, H, L) -> (B, L, H), beside out (B, L, H, D)
    _match(names[1], s, o.shape[:-1], layout == "flash_attn", 0)
    identity = tuple(range(o.ndim))
    lse_map = (0, 2, 1) if layout == "flash_attn" else tuple(range(s.ndim))
    _check_values(names[0], o, names[1], s, identity, lse_map)
    return o, s


def _match(name: str, s: np.ndarray, expected: tuple[int, ...], swapped: bool,
           offset: int) -> None:
    """``s`` (canonical) must have the shape ``expected``; the message names the axis in the
    caller's layout."""
    if s.shape == expected:
        return
    for axis, (got, want) in enumerate(zip(s.shape, expected, strict=True)):
        if got != want:
            shown = axis
            if swapped and axis - offset in (1, 2):
                shown = offset + 3 - (axis - offset)  # (B, L, H) back to (B, H, L)
            raise RefAttnError(f"{name}: axis {shown} has length {got}, expected {want} "
                               "(from the output's shape)")


def read_partials(outs: object, lses: object, layout: str,
                  names: tuple[str, str] = ("outs", "lses")) -> tuple[np.ndarray, np.ndarray]:
    """Stacked partials in ``layout`` as canonical views: outputs ``(S, ..., D)``, lses
    ``(S, ...)`` (the state axis moved to the front; views, never copies).

    Examples
    --------
    >>> o, s = read_partials(np.zeros((7, 3, 2, 4)), np.zeros((7, 3, 2)), "flashinfer")
    >>> o.shape, s.shape
    ((3, 7, 2, 4), (3, 7, 2))
    """
    out_axes, lse_axes = _layout(layout)
    o = _array(names[0], outs, len(out_axes) + 1, "S," + out_axes if layout != "flashinfer"
               else "N,S,H,D")
    s = _array(names[1], lses, len(lse_axes) + 1, "S," + lse_axes if layout != "flashinfer"
               else "N,S,H")
    if layout == "flashinfer":
        if s.shape[:2] != o.shape[:2]:
            axis = 0 if s.shape[0] != o.shape[0] else 1
            raise RefAttnError(f"{names[1]}: axis {axis} has length {s.shape[axis]}, expected "
                               f"{o.shape[axis]} (from the outputs' shape)")
        o, s = np.moveaxis(o, 1, 0), np.moveaxis(s, 1, 0)
        out_map: tuple[int, ...] = (1, 0, 2, 3)
        lse_map: tuple[int, ...] = (1, 0, 2)
    elif layout == "flash_attn":
        s = s.swapaxes(2, 3)  # (S, B, H, L) -> (S, B, L, H)
        out_map, lse_map = tuple(range(5)), (0, 1, 3, 2)
    else:
        out_map, lse_map = tuple(range(o.ndim)), tuple(range(s.ndim))
    _match(names[1], s, o.shape[:-1], layout == "flash_attn", 1)
    if o.shape[0] < 1:
        raise RefAttnError(f"{names[0]}: expected at least one partial state, got 0")
    _check_values(names[0], o, names[1], s, out_map, lse_map)  # involutions: their own inverse
    return o, s


def to_layout(out: np.ndarray, lse: np.ndarray, layout: str, stacked: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """Canonical arrays back in ``layout`` (contiguous copies in the caller's axis order).

    Examples
    --------
    >>> o, s = to_layout(np.zeros((2, 4, 3, 5)), np.zeros((2, 4, 3)), "flash_attn")
    >>> o.shape, s.shape
    ((2, 4, 3, 5), (2, 3, 4))
    """
    _layout(layout)
    if stacked and layout == "flashinfer":
        out, lse = np.moveaxis(out, 0, 1), np.moveaxis(lse, 0, 1)
    if layout == "flash_attn":
        lse = lse.swapaxes(-1, -2)
    return np.ascontiguousarray(out), np.ascontiguousarray(lse)

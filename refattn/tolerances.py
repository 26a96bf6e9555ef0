"""Tolerance model of the comparison harness: what "close enough" means at each precision.

Owns the :class:`Tolerances` settings, the precision names (float64, float32, float16,
bfloat16; bfloat16 through ``ml_dtypes``, imported lazily) and the rounding floor
``2 * max|fl(g + 0.3 - 0.3) - g|``. Defers the comparison itself to :mod:`refattn.compare` and
the naive lower-precision reference to :mod:`refattn.lowp`.

Two rules:

- float64 candidates, per element: ``|a - g| <= atol + rtol * |g|``.
- lower precision, per tensor (the FlashAttention test rule, computed by refattn itself):
  ``max|a - g| <= k * max|naive_lp - g| + floor``, with ``k = 2`` for forward tensors
  (output, lse, ...) and ``k = 3`` for gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refattn.errors import RefAttnError

__all__ = [
    "LOWER_PRECISIONS",
    "Tolerances",
    "precision_name",
    "resolve_dtype",
    "round_to",
    "rounding_floor",
]

#: precision names the reference-relative rule accepts
LOWER_PRECISIONS = ("float32", "float16", "bfloat16")
_ALL = ("float64", *LOWER_PRECISIONS)


def resolve_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype for a precision name or dtype-like (``"bfloat16"`` via ml_dtypes).

    Examples
    --------
    >>> resolve_dtype("float32")
    dtype('float32')
    >>> resolve_dtype("bfloat16").name
    'bfloat16'
    """
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or str(dtype)
    name = {"torch.float64": "float64", "torch.float32": "float32", "torch.float16": "float16",
            "torch.bfloat16": "bfloat16", "f8": "float64", "f4": "float32", "f2": "float16",
            "double": "float64", "float": "float32", "half": "float16"}.get(name, name)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise RefAttnError(
                "dtype: bfloat16 needs the ml_dtypes package (pip install 'refattn[compare]')"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    if name not in _ALL:
        raise RefAttnError(f"dtype: expected one of {list(_ALL)}, got {dtype!r}")
    return np.dtype(name)


def precision_name(dtype: np.dtype) -> str:
    """The precision name of a floating dtype (``"bfloat16"`` for ml_dtypes' bfloat16).

    Examples
    --------
    >>> precision_name(np.dtype(np.float16))
    'float16'
    """
    name = np.dtype(dtype).name
    if name not in _ALL:
        raise RefAttnError(
            f"dtype: {name} is not a compared precision; expected one of {list(_ALL)}"
        )
    return name


def round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round ``x`` to ``dtype`` and return it as float32 (float64 stays float64).

    The naive lower-precision reference computes every operation in float32 and rounds its
    result to the storage dtype, as PyTorch's low-precision CPU/GPU ops do.

    Examples
    --------
    >>> float(round_to(np.array(1.0 + 2.0 ** -9), resolve_dtype("bfloat16")))
    1.0
    """
    if dtype == np.float64:
        return np.asarray(x, dtype=np.float64)
    return np.asarray(x).astype(dtype).astype(np.float32)


def rounding_floor(g: np.ndarray, dtype: np.dtype, *, shift: float = 0.3,
                   factor: float = 2.0) -> float:
    """``factor * max|fl(g + shift - shift) - g|`` evaluated in ``dtype`` over finite entries.

    This is the absolute slack that a value of the golden's magnitude cannot avoid after one
    round trip through ``dtype`` (FlashAttention's ``fwd_atol``).

    Examples
    --------
    >>> g = np.array([0.1, -0.7, np.inf])
    >>> rounding_floor(g, np.dtype(np.float64)) < 1e-15
    True
    >>> 1e-3 < rounding_floor(g, resolve_dtype("bfloat16")) < 1e-2
    True
    """
    g = np.asarray(g, dtype=np.float64)
    finite = g[np.isfinite(g)]
    if finite.size == 0:
        return 0.0
    x = finite.astype(dtype)
    y = (x + np.asarray(shift, dtype=dtype)) - np.asarray(shift, dtype=dtype)  # in dtype
    return float(factor * np.max(np.abs(y.astype(np.float64) - finite)))


def _is_gradient(name: str) -> bool:
    return name.startswith("grad_") or name.startswith("row_dot")


@dataclass(frozen=True)
class Tolerances:
    """Settings of both comparison rules (all configurable, defaults in the issue's terms).

    Attributes
    ----------
    atol, rtol : float
        float64 rule, per element: ``|a - g| <= atol + rtol * |g|``.
    k_forward, k_gradient : float
        Lower-precision rule multipliers of the naive reference's error (2 for forward
        tensors such as output and lse; 3 for gradients).
    floor_factor, floor_shift : float
        The floor ``floor_factor * max|fl(g + floor_shift - floor_shift) - g|``.
    k_overrides : mapping of str to float
        Per-tensor multipliers that replace ``k_forward`` / ``k_gradient``.
    float64_overrides : mapping of str to (atol, rtol)
        Per-tensor float64 settings.

    Examples
    --------
    >>> t = Tolerances()
    >>> t.k_for("output"), t.k_for("grad_q"), t.float64_for("lse")
    (2.0, 3.0, (1e-12, 1e-10))
    >>> Tolerances(k_overrides={"lse": 4.0}).k_for("lse")
    4.0
    """

    atol: float = 1e-12
    rtol: float = 1e-10
    k_forward: float = 2.0
    k_gradient: float = 3.0
    floor_factor: float = 2.0
    floor_shift: float = 0.3
    k_overrides: Mapping[str, float] = field(default_factory=dict)
    float64_overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "k_forward", "k_gradient", "floor_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise RefAttnError(
                    f"tolerances: {name} must be a finite number >= 0, got {value!r}"
                )

    def k_for(self, name: str) -> float:
        """The reference-error multiplier of tensor ``name``."""
        if name in self.k_overrides:
            return float(self.k_overrides[name])
        return float(self.k_gradient if _is_gradient(name) else self.k_forward)

    def float64_for(self, name: str) -> tuple[float, float]:
        """``(atol, rtol)`` of tensor ``name`` under the float64 rule."""
        if name in self.float64_overrides:
            atol, rtol = self.float64_overrides[name]
            return float(atol), float(rtol)
        return self.atol, self.rtol

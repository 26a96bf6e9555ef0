"""Tolerance model of the comparison harness: what "close enough" means at each precision.

Owns the :class:`Tolerances` settings, the precision names (float64, float32, float16, bfloat16;
bfloat16 through ``ml_dtypes``, imported lazily) and the rounding floor ``2 * max|fl(g + 0.3 - 0.3)
- g|``. Defers the comparison itself to :mod:`refattn.bundle.comparison.harness` and the naive
lower-precision reference to :mod:`refattn.bundle.comparison.lowp`.

Two rules:

- float64 candidates, per element: ``|a - g| <= atol + rtol * |g|``.
- lower precision, per tensor (the FlashAttention test rule, computed by refattn itself):
  ``max|a - g| <= k * max|naive_lp - g| + floor``, with ``k = 2`` for forward tensors
  (output, lse, ...) and ``k = 3`` for gradients; the floor is the larger of the rounding
  floor and ``natural_floor`` unit roundoffs of the tensor's natural magnitude.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from refattn._boundary import public, shown
from refattn.errors import RefAttnError

__all__ = [
    "LOWER_PRECISIONS",
    "Tolerances",
    "precision_name",
    "resolve_dtype",
    "round_to",
    "rounding_floor",
    "ulp",
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
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or shown(dtype)
    name = {"torch.float64": "float64", "torch.float32": "float32", "torch.float16": "float16",
            "torch.bfloat16": "bfloat16", "f8": "float64", "f4": "float32", "f2": "float16",
            "double": "float64", "float": "float32", "half": "float16"}.get(name, name)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            from refattn._install import install_hint

            raise RefAttnError(
                f"dtype: bfloat16 needs the ml_dtypes package ({install_hint('compare')})"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    if name not in _ALL:
        raise RefAttnError(f"dtype: expected one of {list(_ALL)}, got {shown(dtype)}")
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
    with np.errstate(over="ignore"):  # beyond the dtype's range is +-inf, as in the dtype
        return np.asarray(x).astype(dtype).astype(np.float32)


def ulp(x: float, dtype: np.dtype) -> float:
    """Spacing of ``dtype``'s numbers at magnitude ``|x|`` (bfloat16 included).

    Examples
    --------
    >>> ulp(1.0, np.dtype(np.float32)) == 2.0 ** -23, ulp(0.3, resolve_dtype("bfloat16"))
    (True, 0.001953125)
    """
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import ml_dtypes

        info: Any = ml_dtypes.finfo(dtype)
    else:
        info = np.finfo(dtype)
    x = abs(float(x))
    exponent = max(int(np.floor(np.log2(x))), int(info.minexp)) if x > 0 else int(info.minexp)
    return float(2.0 ** (exponent - int(info.nmant)))


def rounding_floor(g: np.ndarray, dtype: np.dtype, *, shift: float = 0.3,
                   factor: float = 2.0, mode: str = "bound") -> float:
    """The floor of the reference-relative rule, evaluated in ``dtype`` over finite entries.

    ``mode="realized"`` is FlashAttention's ``fwd_atol`` literally:
    ``factor * max|fl(g + shift - shift) - g|``. Its value depends on which numbers a tensor
    happens to hold: a small tensor can land close to representable values and get a floor
    far below the rounding error its magnitude allows (an eager PyTorch run of the very same
    naive algorithm then fails on a 16-element gradient). ``mode="bound"`` (the default)
    never goes below the literal floor and also allows one unit in the last place of the
    largest magnitude: ``factor * max(max|fl(g + shift - shift) - g|, ulp(max|g| + shift))``.

    Examples
    --------
    >>> g = np.array([0.1, -0.7, np.inf])
    >>> rounding_floor(g, np.dtype(np.float64)) < 1e-15
    True
    >>> bf16 = resolve_dtype("bfloat16")
    >>> 1e-3 < rounding_floor(g, bf16, mode="realized") <= rounding_floor(g, bf16) < 2e-2
    True
    >>> rounding_floor(np.zeros(3), np.dtype(np.float32), mode="realized")
    0.0
    >>> rounding_floor(np.zeros(3), np.dtype(np.float32)) == 2 * 2.0 ** -25
    True
    """
    g = np.asarray(g, dtype=np.float64)
    with np.errstate(over="ignore"):
        fits = np.isfinite(g) & np.isfinite(g.astype(dtype))  # representable magnitudes only
    finite = g[fits]
    if finite.size == 0:
        return 0.0
    x = finite.astype(dtype)
    y = (x + np.asarray(shift, dtype=dtype)) - np.asarray(shift, dtype=dtype)  # in dtype
    realized = float(np.max(np.abs(y.astype(np.float64) - finite)))
    match mode:
        case "realized":
            return float(factor * realized)
        case "bound":
            return float(factor * max(realized, ulp(np.max(np.abs(finite)) + shift, dtype)))
        case _:
            raise RefAttnError(f"floor mode: expected 'bound' or 'realized', got {mode!r}")


def _is_gradient(name: str) -> bool:
    return name.startswith("grad_") or name.startswith("row_dot")


@public
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
    floor_mode : {"bound", "realized"}
        ``"realized"`` uses that maximum literally; ``"bound"`` (default) never lets it fall
        below one unit in the last place of ``max|g| + floor_shift`` (see
        :func:`rounding_floor`).
    naive_routes : tuple of str
        Saved-state routes of the naive reference (:data:`refattn.bundle.comparison.lowp.ROUTES`);
        the reference error is the largest over them. ``"stored_probs"`` keeps P for the
        backward; ``"lse_recompute"`` keeps the log-partition and recomputes P, with
        ``D = sum(G_O * O)``, as FlashAttention-style kernels legitimately do.
    natural_floor : float
        The floor never falls below ``natural_floor`` unit roundoffs of the dtype times the
        tensor's natural magnitude (the largest sum of absolute terms behind one element,
        :func:`refattn.bundle.golden.guarantee.natural_scales`; dot-family cases with a
        backward): what a correct kernel's own roundings may reach where the naive algorithm
        happens to cancel exactly (a row with one visible key) or to round luckily (a sum of
        one key, a short decode row). Measured on torch's SDPA in float32 over the kernel
        suite: at most 6.4 such roundoffs where the naive yardstick alone failed it. 0 turns
        it off.
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
    floor_mode: Literal["bound", "realized"] = "bound"
    natural_floor: float = 8.0
    naive_routes: tuple[str, ...] = ("stored_probs", "lse_recompute")
    k_overrides: Mapping[str, float] = field(default_factory=dict)
    float64_overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "k_forward", "k_gradient", "floor_factor",
                     "natural_floor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise RefAttnError(
                    f"tolerances: {name} must be a finite number >= 0, got {value!r}"
                )
        if not self.naive_routes or not set(self.naive_routes) <= {"stored_probs",
                                                                   "lse_recompute"}:
            raise RefAttnError(
                f"tolerances: naive_routes must name 'stored_probs' and/or 'lse_recompute', "
                f"got {self.naive_routes!r}"
            )
        if self.floor_mode not in ("bound", "realized"):
            raise RefAttnError(
                f"tolerances: floor_mode must be 'bound' or 'realized', got {self.floor_mode!r}"
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

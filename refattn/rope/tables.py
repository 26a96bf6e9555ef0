"""RoPE tables: inverse frequencies of a base theta and a scaling, and their cos/sin tables.

Owns :func:`inverse_frequencies`, :func:`cos_sin` and :func:`rope_tables`. The definitions
are HuggingFace transformers' ``src/transformers/modeling_rope_utils.py`` (read at commits
0044e3b3facff1a1ad60b235c69d5b45beae75a4 and a later one with ``mscale`` / ``truncate``):

- ``"none"`` (``_compute_default_rope_parameters``): ``inv_freq[i] = 1 / theta ** (2i /
  rotary_dim)``, ``i < rotary_dim / 2`` (GPT-NeoX, LLaMA; the angle of position p is
  ``p * inv_freq[i]``);
- ``"linear"`` (``_compute_linear_scaling_rope_parameters``, position interpolation):
  ``inv_freq / factor``, i.e. positions divided by ``factor`` (HF divides the frequencies,
  and so does refattn: the products round like HF's);
- ``"ntk"``: the static NTK-aware base change ``theta * factor ** (d / (d - 2))``
  (``_compute_ntk_parameters`` of commit 0044e3b);
- ``"dynamic"`` (``_compute_dynamic_ntk_parameters``, dynamic NTK): ``theta * (factor *
  L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))`` with ``L = max(seq_len,
  max_position_embeddings)`` (``seq_len`` the current length; default: no change of base);
- ``"yarn"`` (``_compute_yarn_parameters``): each frequency between its interpolated
  (``/ factor``) and extrapolated value by a linear ramp over the dimensions between the
  correction dimensions of ``beta_fast`` (default 32) and ``beta_slow`` (default 1)
  rotations over ``original_max_position_embeddings``, floored and ceiled when ``truncate``
  (default), clamped to ``[0, d - 1]``; the attention factor (HF's ``attention_scaling``,
  which multiplies cos and sin) is ``attention_factor`` if given, else ``get_mscale(factor,
  mscale) / get_mscale(factor, mscale_all_dim)`` when both are given (DeepSeek), else
  ``get_mscale(factor) = 0.1 ln(factor) + 1`` (1 when ``factor <= 1``).

HF computes in float32; refattn in float64 from the same formulas, with ``np.cos`` and
``np.sin`` of float64 products ``position * inv_freq``. Those are the platform's (numpy's
SIMD or libm) functions: within an ulp, deterministic on one machine, not guaranteed
bit-identical across machines. A table is therefore an *input*: a golden case stores the
table it used, and kernels are compared given the same table (FlashAttention's kvcache call
takes ``rotary_cos`` / ``rotary_sin`` as arguments for the same reason).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import bounded_float, bounded_int
from refattn._memory import check_bytes
from refattn.errors import RefAttnError

__all__ = ["SCALINGS", "RopeTables", "cos_sin", "inverse_frequencies", "rope_tables"]

#: the scalings :func:`inverse_frequencies` knows (HF's ``rope_type`` names, ``ntk`` static)
SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn")
#: the largest rotary dimension and table length accepted (bounds on numbers from outside)
MAX_ROTARY_DIM = 1 << 16
MAX_SEQLEN = 1 << 31

Scaling = Literal["none", "linear", "ntk", "dynamic", "yarn"]


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    """HF's ``get_mscale`` (YaRN's attention temperature)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_ramp(dim: int, base: float, factor: float, original: int, beta_fast: float,
               beta_slow: float, truncate: bool) -> np.ndarray:
    """HF's ``inv_freq_extrapolation_factor`` (1 - the linear ramp), (dim // 2,)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: "Prevent singularity"
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return 1.0 - ramp


@public
def inverse_frequencies(rotary_dim: int, *, theta: float = 10000.0, scaling: Scaling = "none",
                        factor: float = 1.0, seq_len: int | None = None,
                        max_position_embeddings: int | None = None,
                        original_max_position_embeddings: int | None = None,
                        beta_fast: float = 32.0, beta_slow: float = 1.0,
                        attention_factor: float | None = None, mscale: float | None = None,
                        mscale_all_dim: float | None = None, truncate: bool = True
                        ) -> tuple[np.ndarray, float]:
    """The inverse frequencies ``(rotary_dim / 2,)`` and the attention factor of a scaling.

    Parameters
    ----------
    rotary_dim : int
        Even, in ``[2, 65536]`` (``>= 4`` for the NTK scalings: ``d / (d - 2)``).
    theta : float
        The base, ``> 1`` (HF's ``rope_theta``).
    scaling : {"none", "linear", "ntk", "dynamic", "yarn"}
        See the module docstring for each definition and its source.
    factor : float
        The scaling factor, ``> 0`` (unused by ``"none"``).
    seq_len : int, optional
        ``"dynamic"``: the current sequence length (HF's ``seq_len`` argument).
    max_position_embeddings : int, optional
        ``"dynamic"`` (required): the trained context; ``"yarn"``: used when
        ``original_max_position_embeddings`` is not given (HF's fallback).
    original_max_position_embeddings : int, optional
        ``"yarn"``: the pretrained context the correction range is measured over. HF derives
        ``factor = max_position_embeddings / original_max_position_embeddings`` when a config
        gives the latter: pass that factor.
    beta_fast, beta_slow : float
        ``"yarn"``: rotations bounding the ramp (HF's defaults 32 and 1), ``> 0``.
    attention_factor, mscale, mscale_all_dim : float, optional
        ``"yarn"``: the factor on cos and sin, or HF's ingredients of its default.
    truncate : bool
        ``"yarn"``: floor/ceil the correction range (HF's default True).

    Returns
    -------
    inv_freq : (rotary_dim / 2,) float64 ndarray
    attention_factor : float
        1.0 except for ``"yarn"``.

    Raises
    ------
    RefAttnError
        A number out of its range (named, with the range), a missing argument the scaling
        needs.

    Examples
    --------
    >>> inv, a = inverse_frequencies(4, theta=100.0)
    >>> inv.tolist(), a
    ([1.0, 0.1], 1.0)
    >>> inverse_frequencies(4, theta=100.0, scaling="linear", factor=2.0)[0].tolist()
    [0.5, 0.05]
    >>> round(inverse_frequencies(8, scaling="yarn", factor=4.0,
    ...                           original_max_position_embeddings=64)[1], 6)
    1.138629
    """
    dim = bounded_int("rotary_dim", rotary_dim, lo=2, hi=MAX_ROTARY_DIM)
    if dim % 2:
        raise RefAttnError(f"rotary_dim: {dim} is odd; expected an even number (the rotation "
                           "acts on pairs of columns)")
    base = bounded_float("theta", theta, lo=1.0, lo_open=True, hi=1e300)
    if scaling not in SCALINGS:
        raise RefAttnError(f"scaling: expected one of {list(SCALINGS)}, got {scaling!r}")
    fac = bounded_float("factor", factor, lo=0.0, lo_open=True, hi=1e12)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    attn = 1.0
    if scaling in ("ntk", "dynamic"):
        if dim < 4:
            raise RefAttnError(f"rotary_dim: {dim}; the NTK scalings raise the base to "
                               "d / (d - 2) and need rotary_dim >= 4")
        if scaling == "ntk":
            base = base * fac ** (dim / (dim - 2))
        else:
            if max_position_embeddings is None:
                raise RefAttnError("max_position_embeddings: the dynamic NTK scaling needs "
                                   "it (HF's config.max_position_embeddings)")
            mpe = bounded_int("max_position_embeddings", max_position_embeddings, lo=1,
                              hi=MAX_SEQLEN)
            cur = mpe if seq_len is None else bounded_int("seq_len", seq_len, lo=1,
                                                          hi=MAX_SEQLEN)
            cur = cur if cur > mpe else mpe
            base = base * ((fac * cur / mpe) - (fac - 1)) ** (dim / (dim - 2))
        if not (math.isfinite(base) and base > 1.0):
            raise RefAttnError(f"theta: the scaled base {base!r} is not a finite number > 1 "
                               f"(factor={fac!r})")
    inv = 1.0 / (base ** exponents)
    if scaling == "linear":
        inv = inv / fac
    elif scaling == "yarn":
        given = original_max_position_embeddings
        if given is None:
            given = max_position_embeddings
        if given is None:
            raise RefAttnError("original_max_position_embeddings: the YaRN scaling needs it "
                               "(or max_position_embeddings, HF's fallback)")
        original = bounded_int("original_max_position_embeddings", given, lo=1, hi=MAX_SEQLEN)
        fast = bounded_float("beta_fast", beta_fast, lo=0.0, lo_open=True, hi=1e12)
        slow = bounded_float("beta_slow", beta_slow, lo=0.0, lo_open=True, hi=1e12)
        if attention_factor is not None:
            attn = bounded_float("attention_factor", attention_factor, lo=0.0, lo_open=True,
                                 hi=1e12)
        elif mscale is not None and mscale_all_dim is not None and mscale and mscale_all_dim:
            ms = bounded_float("mscale", mscale, lo=-1e12, hi=1e12)
            msa = bounded_float("mscale_all_dim", mscale_all_dim, lo=-1e12, hi=1e12)
            attn = _get_mscale(fac, ms) / _get_mscale(fac, msa)
        else:
            attn = _get_mscale(fac)
        extrapolation = 1.0 / (base ** exponents)
        interpolation = 1.0 / (fac * base ** exponents)
        keep = _yarn_ramp(dim, base, fac, original, fast, slow, bool(truncate))
        inv = interpolation * (1 - keep) + extrapolation * keep
    return np.ascontiguousarray(inv, dtype=np.float64), float(attn)


@public
def cos_sin(seqlen: int, inv_freq: np.ndarray, attention_factor: float = 1.0
            ) -> tuple[np.ndarray, np.ndarray]:
    """The tables ``cos(p * inv_freq) * a`` and ``sin(p * inv_freq) * a`` for positions
    ``p = 0 .. seqlen - 1``, each ``(seqlen, rotary_dim / 2)`` float64.

    The layout of FlashAttention's ``rotary_cos`` / ``rotary_sin`` (``(seqlen_ro, rotary_dim /
    2)``), and of HF's ``emb.cos() * attention_scaling`` before its duplication to
    ``rotary_dim`` columns.

    Raises
    ------
    RefAttnError
        ``seqlen`` outside ``[1, 2**31]``, ``inv_freq`` not a finite float64 vector, the
        tables too large for the memory available.

    Examples
    --------
    >>> c, s = cos_sin(2, np.array([1.0, 0.5]))
    >>> c.shape, c[0].tolist(), s[1].round(4).tolist()
    ((2, 2), [1.0, 1.0], [0.8415, 0.4794])
    """
    n = bounded_int("seqlen", seqlen, lo=1, hi=MAX_SEQLEN)
    inv = np.asarray(inv_freq)
    if inv.dtype != np.float64 or inv.ndim != 1 or inv.size == 0:
        raise RefAttnError(f"inv_freq: expected a non-empty float64 vector, got dtype "
                           f"{inv.dtype} shape {list(inv.shape)}")
    if not np.isfinite(inv).all():
        raise RefAttnError("inv_freq: expected finite values")
    a = bounded_float("attention_factor", attention_factor, lo=0.0, lo_open=True, hi=1e12)
    check_bytes(8 * n * inv.size * 4, f"RoPE tables of ({n}, {inv.size})",
                "ask for a shorter table")
    angles = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if a != 1.0:
        cos, sin = cos * a, sin * a
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


@public
@dataclass(frozen=True, eq=False)
class RopeTables:
    """One scaling's tables: ``cos``, ``sin`` ``(seqlen, rotary_dim / 2)`` float64, the
    inverse frequencies ``(rotary_dim / 2,)`` and the attention factor folded into cos and
    sin."""

    cos: np.ndarray
    sin: np.ndarray
    inv_freq: np.ndarray
    attention_factor: float

    @property
    def rotary_dim(self) -> int:
        return int(2 * self.inv_freq.shape[0])


@public
def rope_tables(seqlen: int, rotary_dim: int, *, theta: float = 10000.0,
                scaling: Scaling = "none", factor: float = 1.0, seq_len: int | None = None,
                max_position_embeddings: int | None = None,
                original_max_position_embeddings: int | None = None,
                beta_fast: float = 32.0, beta_slow: float = 1.0,
                attention_factor: float | None = None, mscale: float | None = None,
                mscale_all_dim: float | None = None, truncate: bool = True) -> RopeTables:
    """:func:`inverse_frequencies` then :func:`cos_sin` for ``seqlen`` positions.

    Examples
    --------
    >>> t = rope_tables(16, 8, scaling="dynamic", factor=2.0, seq_len=32,
    ...                 max_position_embeddings=16)
    >>> t.cos.shape, t.rotary_dim, t.attention_factor
    ((16, 4), 8, 1.0)
    """
    inv, attn = inverse_frequencies(
        rotary_dim, theta=theta, scaling=scaling, factor=factor, seq_len=seq_len,
        max_position_embeddings=max_position_embeddings,
        original_max_position_embeddings=original_max_position_embeddings,
        beta_fast=beta_fast, beta_slow=beta_slow, attention_factor=attention_factor,
        mscale=mscale, mscale_all_dim=mscale_all_dim, truncate=truncate)
    cos, sin = cos_sin(seqlen, inv, attn)
    return RopeTables(cos, sin, inv, attn)

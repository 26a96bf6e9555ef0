"""One golden case as a test parameter: its tensors, the plain-NumPy description and the
framework lowerings, in the dtype of the run.

Owns :class:`Case` (a :class:`~refattn.bundle.golden.spec.CaseSpec` bound to a dtype;
``case.inputs``, ``case.visible``, ``case.query_valid``, ``case.to_torch_sdpa()``,
``case.to_jax()``) and :func:`load_cases` (the installed conformance suite, generated in this
process by the exact generator, or the cases of a bundle directory). Defers the lowerings to
:mod:`refattn.adapters.plain`, :mod:`refattn.adapters.torch` and :mod:`refattn.adapters.jax`,
which import their frameworks only when called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn.adapters import flash_attn as flash_adapter
from refattn.adapters import flash_mla as flash_mla_adapter
from refattn.adapters import flex as flex_adapter
from refattn.adapters import jax as jax_adapter
from refattn.adapters import torch as torch_adapter
from refattn.adapters.plain import PlainCall, plain_call
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec, case_spec, regenerated_spec
from refattn.bundle.suites import build_suite, default_generator, kernels
from refattn.errors import RefAttnError

__all__ = ["TARGETS", "Case", "causal_alignments", "flash_window", "load_cases"]

#: lowerings a case offers
TARGETS = ("numpy", "torch_sdpa", "jax", "flex_attention", "flash_attn", "flash_attn_varlen",
           "flash_attn_kvcache", "flash_mla")


@public
@dataclass(frozen=True, eq=False)
class Case:
    """A golden case bound to the dtype of one run (what ``@refattn.testing.cases`` yields).

    Attributes
    ----------
    spec : CaseSpec
        The case: its stored tensors (inputs, golden outputs and gradients) and manifest.
    dtype : str
        ``float64``, ``float32``, ``float16`` or ``bfloat16``: the precision the function
        under test runs in; the lowerings round the float64 inputs to it once, and
        :func:`refattn.testing.assert_matches` applies its rule.

    Examples
    --------
    >>> from refattn.bundle.suites.conformance import CASES
    >>> case = Case(case_spec(CASES["causal_square"]()), "float32")
    >>> case.name, case.q.shape, case.visible.shape, case.query_valid.shape
    ('causal_square', (2, 2, 6, 4), (2, 2, 6, 6), (2, 1, 6, 1))
    >>> sorted(case.inputs), case.not_expressible("jax")
    (['k', 'q', 'v'], None)
    """

    spec: CaseSpec
    dtype: str = "float64"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", precision_name(resolve_dtype(self.dtype)))

    def __repr__(self) -> str:
        return f"Case({self.name!r}, dtype={self.dtype!r})"

    # -- what the case is ----------------------------------------------------------------
    @property
    def name(self) -> str:
        """The case id, e.g. ``"causal_lower_right_q3_k7"`` (also the test id)."""
        return self.spec.case_id

    @property
    def comment(self) -> str:
        """One line saying what the case pins down."""
        return self.spec.comment

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(self.spec.flags)

    @property
    def expected(self) -> Mapping[str, np.ndarray]:
        """The golden float64 tensors by canonical name (``output``, ``lse``, ``grad_q``, ...)."""
        return self.spec.tensors

    @property
    def quant(self) -> Any:
        """A quantised case's :class:`~refattn.bundle.golden.quantized.QuantCase` (``.spec``, the
        kernel's :class:`~refattn.quant.spec.QuantSpec` with its scales; ``.call``, the call
        as the kernel receives it: FP8 codes decoded, or the values it casts itself), or None.
        ``case.q``, ``case.k``, ``case.v`` are the dequantised inputs of the real result.

        >>> from refattn.bundle.suites.conformance import CASES
        >>> Case(case_spec(CASES["causal_square"]())).quant is None
        True
        """
        if getattr(self.spec, "quant", None) is None:
            return None
        return self.spec.quant_case()

    # -- the plain-NumPy description (refattn.adapters.plain states the rules) ----------
    @cached_property
    def plain(self) -> PlainCall:
        """:func:`refattn.adapters.plain.plain_call`: every input as float64 NumPy arrays."""
        return plain_call(self.spec)

    def to_numpy(self) -> PlainCall:
        """The plain-NumPy description (every case is expressible this way)."""
        return self.plain

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        """Differentiable inputs, float64: ``q`` (B, Hq, Q, Dk), ``k`` (B, Hkv, K, Dk), ``v``
        (B, Hkv, K, Dv), and ``bias``, ``sink``, ``score_<param>`` where the case has them."""
        return self.plain.inputs

    @property
    def q(self) -> np.ndarray:
        return self.plain.q

    @property
    def k(self) -> np.ndarray:
        return self.plain.k

    @property
    def v(self) -> np.ndarray:
        return self.plain.v

    @property
    def visible(self) -> np.ndarray:
        """(B, Hq, Q, K) bool, True = query i reads key j; every row has a legal key or a
        sink (a row left empty by the case's policy reads key 0 and is unused)."""
        return self.plain.visible

    @property
    def query_valid(self) -> np.ndarray:
        """(B, 1, Q, 1) bool: output rows where False are zero (and get no gradient)."""
        return self.plain.query_valid

    @property
    def scale(self) -> float:
        """alpha: scores are ``scale * q @ k^T``."""
        return self.plain.scale

    # -- the conventions a kernel decides (pass what the case leaves to the kernel) -------
    @property
    def scale_is_default(self) -> bool:
        """True when the case was called without a scale, so the kernel's own default
        (``1/sqrt(Dk)``) is what is under test: call the kernel without one
        (:attr:`scale_argument`)."""
        return self.spec.scale_is_default

    @property
    def scale_argument(self) -> float | None:
        """What to pass as the kernel's ``scale``: None where the case uses the default
        (:attr:`scale_is_default`), else :attr:`scale`.

        Examples
        --------
        >>> from refattn.bundle.suites.conformance import CASES
        >>> Case(case_spec(CASES["causal_square"]())).scale_argument is None
        True
        >>> Case(case_spec(CASES["explicit_scale_0p2"]())).scale_argument
        0.2
        """
        return None if self.scale_is_default else self.scale

    @cached_property
    def _triangles(self) -> tuple[str, ...]:
        return causal_alignments(self.spec)

    @property
    def is_causal(self) -> bool:
        """True when the visibility is exactly a causal triangle (upper-left or lower-right,
        the same for every batch row and head, some key hidden): a kernel's ``causal=True``."""
        return bool(self._triangles)

    @property
    def causal_alignment(self) -> Literal["upper_left", "lower_right"] | None:
        """Which causal triangle the visibility is: ``upper_left`` (key j <= query i:
        PyTorch's ``is_causal``, JAX), ``lower_right`` (key j <= i + K - Q: FlashAttention,
        a KV cache), or None when it is no causal triangle. Where Q == K the two are the
        same triangle and this is ``upper_left``.

        Examples
        --------
        >>> from refattn.bundle.suites.conformance import CASES
        >>> c = Case(case_spec(CASES["causal_lower_right_q3_k7"]()))
        >>> c.is_causal, c.causal_alignment, c.window
        (True, 'lower_right', (-1, 0))
        >>> c = Case(case_spec(CASES["causal_upper_left_q3_k7"]()))
        >>> c.causal_alignment, c.window
        ('upper_left', None)
        """
        return self._triangles[0] if self._triangles else None  # type: ignore[return-value]

    @cached_property
    def window(self) -> tuple[int, int] | None:
        """The visibility as FlashAttention's ``window_size=(left, right)``: key j is visible
        from query i when ``i + K - Q - left <= j <= i + K - Q + right`` (-1: unbounded), the
        same for every batch row and head; ``(-1, -1)`` without a mask, ``(-1, 0)`` for the
        lower-right causal triangle; None when the visibility is no such band.

        Examples
        --------
        >>> from refattn.bundle.suites.conformance import CASES
        >>> Case(case_spec(CASES["sliding_window_causal_incl3"]())).window
        (2, 0)
        """
        return flash_window(self.spec)

    @property
    def gqa_mapping(self) -> Literal["grouped", "explicit"]:
        """``grouped``: query head h reads kv head ``h // (Hq // Hkv)`` (consecutive query
        heads share a kv head; Hq == Hkv is the identity); ``explicit``: another
        :attr:`head_map`, which the kernel must take as given."""
        return "explicit" if self.spec.head_map_mode == "explicit" else "grouped"

    @property
    def softcap(self) -> float | None:
        """The score softcap c (scores ``c * tanh(s / c)``), or None."""
        return self.spec.softcap

    @property
    def head_map(self) -> np.ndarray:
        """(Hq,) int64: query head h reads kv head ``head_map[h]``."""
        return self.plain.head_map

    @property
    def grad_output(self) -> np.ndarray:
        """(B, Hq, Q, Dv) float64: G_O, the cotangent of the output."""
        return self.plain.grad_output

    # -- framework lowerings ------------------------------------------------------------
    def not_expressible(self, target: Literal["numpy", "torch_sdpa", "jax", "flex_attention",
                                              "flash_attn", "flash_attn_varlen",
                                              "flash_attn_kvcache", "flash_mla"]
                        ) -> str | None:
        """Why ``target`` cannot express this case, or None when it can.

        Examples
        --------
        >>> from refattn.bundle.suites.conformance import CASES
        >>> Case(case_spec(CASES["softcap_5"]())).not_expressible("torch_sdpa")
        'softcap (not an SDPA or MHA argument)'
        """
        match target:
            case "numpy":
                return None
            case "torch_sdpa":
                return torch_adapter.ineligible(self.spec, "sdpa")
            case "jax":
                return jax_adapter.ineligible(self.spec)
            case "flex_attention":
                return flex_adapter.ineligible(self.spec)
            case "flash_attn" | "flash_attn_varlen" | "flash_attn_kvcache":
                return flash_adapter.ineligible(self.spec, target)
            case "flash_mla":
                return flash_mla_adapter.ineligible(self.spec)
            case _:
                raise RefAttnError(f"target: expected one of {list(TARGETS)}, got {target!r}")

    def to_torch_sdpa(self, *, dtype: Any = None, **options: Any) -> Any:
        """The exact ``torch.nn.functional.scaled_dot_product_attention`` call in ``dtype``
        (default: the case's), as :class:`refattn.adapters.torch.SdpaCall`:
        ``F.scaled_dot_product_attention(*sdpa.args, **sdpa.kwargs)``.

        ``options``: ``gqa="native" | "expand"``, ``causal="explicit" | "auto"``,
        ``requires_grad``. Raises :class:`~refattn.RefAttnError` naming why when SDPA cannot
        express the case.
        """
        return torch_adapter.sdpa_call(self.spec, dtype=dtype or self.dtype, **options)

    def to_jax(self, *, dtype: Any = None, **options: Any) -> Any:
        """The ``jax.nn.dot_product_attention`` call in ``dtype`` (default: the case's), as
        :class:`refattn.adapters.jax.JaxCall`: ``jax.nn.dot_product_attention(*j.primals,
        **j.kwargs)``; ``j.outputs(out, grads)`` maps the results back.

        ``options``: ``native="explicit" | "auto"``. Raises :class:`~refattn.RefAttnError`
        naming why when the function cannot express the case.
        """
        return jax_adapter.jax_call(self.spec, dtype=dtype or self.dtype, **options)

    def to_flex_attention(self, *, dtype: Any = None, **options: Any) -> Any:
        """The exact ``torch.nn.attention.flex_attention.flex_attention`` call in ``dtype``
        (default: the case's), as :class:`refattn.adapters.flex.FlexCall`: ``out, aux =
        flex_attention(*f.args, **f.kwargs)``, then ``f.finish((out, aux))``. score_mod
        (softcap, bias) and the block mask's mask_mod come from the case's relation.

        ``options``: ``device`` (default ``"cpu"``: forward only in PyTorch 2.13),
        ``requires_grad``. Raises :class:`~refattn.RefAttnError` naming why when
        flex_attention cannot express the case.
        """
        return flex_adapter.flex_call(self.spec, dtype=dtype or self.dtype, **options)

    def to_flash_attn(self, *, dtype: Any = None) -> Any:
        """The arguments of FlashAttention's ``flash_attn_func`` ((B, L, H, D) layout,
        ``softmax_scale``, bottom-right ``causal``, ``window_size``, ``softcap``,
        ``alibi_slopes``) in ``dtype``, as :class:`refattn.adapters.flash_attn.FlashCall`:
        ``c.finish(flash_attn_func(*c.args, **c.kwargs))``. Raises
        :class:`~refattn.RefAttnError` naming why when the interface cannot express the case.
        """
        return flash_adapter.flash_call(self.spec, "flash_attn", dtype=dtype or self.dtype)

    def to_flash_attn_varlen(self, *, dtype: Any = None) -> Any:
        """:meth:`to_flash_attn` for ``flash_attn_varlen_func``: the sequences packed
        ((total, H, D), ``cu_seqlens_q/k``, ``max_seqlen_q/k``)."""
        return flash_adapter.flash_call(self.spec, "flash_attn_varlen",
                                        dtype=dtype or self.dtype)

    def to_flash_attn_kvcache(self, *, dtype: Any = None) -> Any:
        """:meth:`to_flash_attn` for ``flash_attn_with_kvcache`` (forward only): the keys as
        a cache with ``cache_seqlens``; a paged case's pages with its ``block_table``."""
        return flash_adapter.flash_call(self.spec, "flash_attn_kvcache",
                                        dtype=dtype or self.dtype)

    def to_flash_mla(self, *, dtype: Any = None) -> Any:
        """The arguments of FlashMLA's ``flash_mla_with_kvcache`` (forward only) in ``dtype``
        (default: the case's), as :class:`refattn.adapters.flash_mla.FlashMlaCall`: ``out, lse
        = flash_mla_with_kvcache(*c.args, **c.kwargs)``, compared with ``c.expected(spec)``.
        A paged MLA case's latent pages as stored; otherwise the keys cut into pages of 64.
        Raises :class:`~refattn.RefAttnError` naming why when FlashMLA cannot express the
        case (V not the first Dv columns of K, a bias, dropout, ...)."""
        return flash_mla_adapter.to_flash_mla(self.spec, dtype=dtype or self.dtype)


def causal_alignments(spec: CaseSpec) -> tuple[str, ...]:
    """The causal triangles (``upper_left``, ``lower_right``) that ``spec``'s visibility is
    exactly, for every batch row and head; () when it is none of them or hides no key.

    Examples
    --------
    >>> from refattn.bundle.suites.conformance import CASES
    >>> causal_alignments(case_spec(CASES["causal_square"]()))
    ('upper_left', 'lower_right')
    >>> causal_alignments(case_spec(CASES["key_padding_causal"]()))
    ()
    """
    vis = spec.visible_full()  # (B, Hq, Q, K), unsanitised: rows with no key stay empty
    if vis.all():
        return ()
    a = spec.axes
    i, j = np.arange(a["Q"])[:, None], np.arange(a["K"])[None, :]
    found = []
    for alignment, offset in (("upper_left", 0), ("lower_right", a["K"] - a["Q"])):
        if np.array_equal(vis, np.broadcast_to(j <= i + offset, vis.shape)):  # (Q, K)
            found.append(alignment)
    return tuple(found)


def flash_window(spec: CaseSpec) -> tuple[int, int] | None:
    """FlashAttention's ``window_size=(left, right)`` equal to ``spec``'s visibility (the
    diagonal aligned to the lower right; -1 unbounded), or None when it is no such band.

    Examples
    --------
    >>> from refattn.bundle.suites.conformance import CASES
    >>> flash_window(case_spec(CASES["self_attention_basic"]()))
    (-1, -1)
    """
    vis = spec.visible_full()  # (B, Hq, Q, K)
    a = spec.axes
    Q, K = a["Q"], a["K"]
    d = np.arange(K)[None, :] - (np.arange(Q)[:, None] + K - Q)  # (Q, K) key - diagonal
    seen = vis.any(axis=(0, 1))  # (Q, K)
    left = int(max(0, -d[seen].min())) if seen.any() else 0
    right = int(max(0, d[seen].max())) if seen.any() else 0

    def band(lo: int, hi: int) -> np.ndarray:
        return ((lo < 0) | (d >= -lo)) & ((hi < 0) | (d <= hi))

    if not np.array_equal(vis, np.broadcast_to(band(left, right), vis.shape)):
        return None
    if np.array_equal(band(-1, right), band(left, right)):
        left = -1
    if np.array_equal(band(left, -1), band(left, right)):
        right = -1
    return (left, right)


@cache
def _suite(name: str) -> tuple[CaseSpec, ...]:
    """The installed suite's cases, generated in this process by the suite's own generator:
    computed at once where it is exact (the miniatures), regenerated case by case when read
    where it is numba (the kernel suite: no more than a few cases' tensors held at once)."""
    if default_generator(name) == "exact":
        return tuple(case_spec(c) for c in build_suite(name))
    return tuple(regenerated_spec(make) for make in kernels.builders())


def _bundle(directory: Path) -> tuple[CaseSpec, ...]:
    from refattn.bundle.verification.checked import checked_cases  # verify's reading checks

    cases = checked_cases(directory)
    for c in cases:
        if c.spec is None:
            raise RefAttnError(f"{directory}: case {c.case_id!r} is rejected: {c.failure}")
    return tuple(c.spec for c in cases if c.spec is not None)


@public
def load_cases(source: str | os.PathLike | None = None, *, suite: str = "conformance"
               ) -> tuple[CaseSpec, ...]:
    """The golden cases of a bundle directory, or of an installed suite.

    Parameters
    ----------
    source : path, optional
        A bundle directory written by ``refattn golden`` (every file's checksums are
        verified on reading). Default: the installed suite ``suite``, generated in this
        process by the suite's generator (the same bytes as ``refattn golden --suite`` writes
        on this machine): the exact generator for ``conformance`` and ``contract`` (about half
        a second for the conformance suite, once per process); numba for ``kernels``, each
        case when it is first read (well under a second each; a few cases' tensors held).
    suite : {"conformance", "contract", "kernels"}

    Returns
    -------
    tuple of CaseSpec

    Examples
    --------
    >>> [c.case_id for c in load_cases(suite="contract")][:2]
    ['loop6_two_query_training_trace', 'loop7_cross_attention_padded_source']
    """
    if source is None:
        return _suite(suite)
    directory = Path(source)
    if not directory.is_dir():
        raise RefAttnError(f"{directory}: not a bundle directory (expected manifest.json and "
                           "cases/ written by refattn golden)")
    return _bundle(directory)

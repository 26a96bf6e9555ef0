"""Physical input layouts a golden case stores beside its canonical call.

A kernel reads its inputs in its own layout (a paged KV cache, a latent cache whose first
columns are also the values, keys before a rotary embedding); the canonical call is built from
them. A *layout* object keeps those inputs as given and maps the canonical gradients back onto
them. It provides:

- ``tensors()``: the inputs as given, by golden name;
- ``gradient_tensors(grads)``: the gradients of those inputs, by golden name, from the
  canonical call's :class:`~refattn.Gradients`;
- ``conventions()``: what the manifest records, with ``"kv_layout"`` naming the layout.

:data:`READERS` maps each ``kv_layout`` name to the function that rebuilds the layout from a
case file's tensors and conventions, so that ``refattn verify`` recomputes the gradients a case
stores in its layout, whatever wrote it. Defers each layout's arithmetic to its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from refattn._checks import INT64_MAX, bounded_int
from refattn.call.kvcache import KV_LAYOUT, TENSOR_NAMES, KVCacheAppend
from refattn.call.mla import AbsorbedLatent, LatentKV, PagedLatentKV
from refattn.call.paged import PagedKV
from refattn.errors import RefAttnError
from refattn.sparse.layout import read_index_list

__all__ = ["LAYOUT_INPUTS", "READERS", "read_layout"]


def _need(tensors: Mapping[str, Any], names: tuple[str, ...], case_id: str, kind: str) -> None:
    for name in names:
        if name not in tensors:
            raise RefAttnError(f"{case_id}: a {kind} case needs tensor {name!r}")


def _paged(tensors: Mapping[str, Any], conventions: Mapping[str, Any], case_id: str) -> Any:
    _need(tensors, ("k_pages", "v_pages", "block_table", "seqlens"), case_id, "paged")
    page_size = bounded_int(f"{case_id}: conventions.page_size", conventions.get("page_size"),
                            lo=1, hi=INT64_MAX)
    return PagedKV(tensors["k_pages"], tensors["v_pages"], tensors["block_table"],
                   tensors["seqlens"], page_size)


def _mla_latent(tensors: Mapping[str, Any], conventions: Mapping[str, Any], case_id: str) -> Any:
    """An MLA latent layout (:mod:`refattn.call.mla`): dense, paged or absorbed."""
    form = conventions.get("mla_form")
    if form not in ("absorbed", "dense", "paged"):
        raise RefAttnError(f"{case_id}: conventions.mla_form {form!r} is not one of "
                           "['absorbed', 'dense', 'paged']")
    if form == "absorbed":
        _need(tensors, ("q_nope", "q_pe", "kv_c", "k_pe"), case_id, "mla_latent absorbed")
        return AbsorbedLatent(tensors["q_nope"], tensors["q_pe"], tensors["kv_c"],
                              tensors["k_pe"])
    dv = bounded_int(f"{case_id}: conventions.head_dim_v", conventions.get("head_dim_v"),
                     lo=1, hi=INT64_MAX)
    if form == "dense":
        _need(tensors, ("kv_latent",), case_id, "mla_latent dense")
        return LatentKV(tensors["kv_latent"], dv)
    _need(tensors, ("kv_latent_pages", "block_table", "seqlens"), case_id, "mla_latent paged")
    page_size = bounded_int(f"{case_id}: conventions.page_size", conventions.get("page_size"),
                            lo=1, hi=INT64_MAX)
    return PagedLatentKV(tensors["kv_latent_pages"], tensors["block_table"],
                         tensors["seqlens"], page_size, dv,
                         shared_pages=conventions.get("shared_pages") is True)


def _kvcache_append(tensors: Mapping[str, Any], conventions: Mapping[str, Any],
                    case_id: str) -> Any:
    """A ``flash_attn_with_kvcache`` call with appends (:class:`KVCacheAppend`): its
    ``kvcache_*`` inputs as given and its two flags from the conventions."""
    _need(tensors, ("kvcache_q", "kvcache_k_cache", "kvcache_v_cache",
                    "kvcache_cache_seqlens"), case_id, KV_LAYOUT)
    kwargs: dict[str, Any] = {attr: tensors[name] for name, attr in TENSOR_NAMES.items()
                              if name in tensors}
    for flag in ("rotary_interleaved", "rotate_q_per_token"):
        value = conventions.get(flag)
        if not isinstance(value, bool):
            raise RefAttnError(f"{case_id}: conventions.{flag}: expected true or false, got "
                               f"{value!r}")
        kwargs[flag] = value
    try:
        return KVCacheAppend(**kwargs)
    except RefAttnError as exc:
        raise RefAttnError(f"{case_id}: {exc}") from None


#: ``conventions["kv_layout"]`` -> the function rebuilding that layout from a case file
READERS: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any], str], Any]] = {
    "paged": _paged,
    "index_list": read_index_list,  # refattn.sparse: per-query key index lists
    KV_LAYOUT: _kvcache_append,
    "mla_latent": _mla_latent,
}


#: the input tensors the layouts store (given, never computed): no guarantee record lists
#: them, a candidate never computes them, and a regenerated case knows them without arithmetic
LAYOUT_INPUTS = frozenset({
    "k_pages", "v_pages", "block_table", "seqlens",  # paged
    *TENSOR_NAMES,  # kvcache_append: kvcache_q, kvcache_k_cache, ...
    "kv_latent", "kv_latent_pages", "q_nope", "q_pe", "kv_c", "k_pe",  # mla_latent
    "indices", "block_indices",  # index_list
})


def read_layout(tensors: Mapping[str, Any], conventions: Mapping[str, Any],
                case_id: str) -> Any:
    """The layout a case file stores (its ``conventions["kv_layout"]``), or None.

    Parameters
    ----------
    tensors : mapping of str to ndarray
        The case's tensors.
    conventions : mapping
        The case's manifest conventions.
    case_id : str
        Named in errors.

    Raises
    ------
    RefAttnError
        On an unknown ``kv_layout`` or a missing tensor.

    Examples
    --------
    >>> read_layout({}, {}, "c") is None
    True
    """
    kind = conventions.get("kv_layout")
    if kind is None:
        return None
    reader = READERS.get(kind) if isinstance(kind, str) else None
    if reader is None:
        raise RefAttnError(f"{case_id}: conventions.kv_layout {kind!r} is not one of "
                           f"{sorted(READERS)}")
    return reader(tensors, conventions, case_id)

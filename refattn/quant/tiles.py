"""The named kernels' kv tile tables: how many keys each online-softmax step takes, by head dim.

Owns :data:`TILE_TABLES`, :class:`TileRow`, :class:`TileTable`, :class:`TileRule` and
:func:`kernel_tiles` (a table's candidate kv tiles, visiting order and source at a head dim),
:func:`resolve_kv_tile` (the gate's check of a spec's ``kv_tile`` and ``kv_order`` against its
table, run by :func:`refattn.quant.spec.check_quant` before any arithmetic) and
:func:`effective_kv_tile` (the tile the pipeline uses). A table row holds one candidate where the
source fixes the tile from the head dims alone, several where it depends on something the call
does not hold (the number of query rows, the page size, the device's shared memory): then the
caller must pass ``kv_tile``. A head dim without a row (the kernel has no such instantiation)
also asks for ``kv_tile``. Every value is read from the source named in its table
(docs/quant-sources.md, "Kernel tiles"); the tile of a named kernel is never guessed.

The tiles start at key 0 (the last one may be partial) and are visited in the table's order:
FA3 and FlashInfer's SM90 kernels walk ``n_block`` from ``n_block_max - 1`` down, FlashInfer's
FA2 kernel and SageAttention's Triton kernel from 0 up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from refattn._boundary import public
from refattn._checks import INT64_MAX, bounded_int
from refattn.call import AttentionCall
from refattn.errors import RefAttnError

__all__ = [
    "TILE_TABLES",
    "TileRow",
    "TileRule",
    "TileTable",
    "TiledSpec",
    "effective_kv_tile",
    "kernel_tiles",
    "resolve_kv_tile",
    "tile_table",
]


class TiledSpec(Protocol):
    """What :func:`effective_kv_tile` reads of a :class:`~refattn.quant.spec.QuantSpec` (this
    module sits below spec.py, which checks its fields against these tables)."""

    @property
    def tile_table(self) -> str: ...

    @property
    def kv_tile(self) -> int | None: ...

    @property
    def kv_order(self) -> str: ...


@dataclass(frozen=True)
class TileRow:
    """One row of a kernel's table: head dims ``[lo, hi]`` -> the candidate kv tiles.

    Parameters
    ----------
    lo, hi : int
        The head dims (of q and k) the row covers, inclusive.
    tiles : tuple of int
        The kv tiles the kernel may use there (one: the tile is fixed by the head dims).
    head_dim_v : tuple of two ints, optional
        The head dims of v the row covers, inclusive; None: v's head dim equals q's.
    when : str
        What chooses among several tiles (empty when there is one).
    """

    lo: int
    hi: int
    tiles: tuple[int, ...]
    head_dim_v: tuple[int, int] | None = None
    when: str = ""

    def covers(self, head_dim: int, head_dim_v: int) -> bool:
        """Whether the row holds ``(head_dim, head_dim_v)``."""
        if not self.lo <= head_dim <= self.hi:
            return False
        if self.head_dim_v is None:
            return head_dim_v == head_dim
        return self.head_dim_v[0] <= head_dim_v <= self.head_dim_v[1]


@dataclass(frozen=True)
class TileTable:
    """A kernel's kv tile table.

    Parameters
    ----------
    name : str
        The table's name (one of :data:`TILE_TABLES`), the value of ``QuantSpec.tile_table``.
    kernel : str
        The kernel in words.
    order : {"ascending", "descending"}
        The order the kernel visits its kv tiles.
    source : str
        Repository, commit, file and function the rows were read from.
    rows : tuple of TileRow
        The rows; the first that covers a call's head dims is its row.
    covers : str
        The head dims the kernel instantiates (said when a call's have no row).
    """

    name: str
    kernel: str
    order: str
    source: str
    rows: tuple[TileRow, ...]
    covers: str


@dataclass(frozen=True)
class TileRule:
    """A table's answer at one pair of head dims (see :func:`kernel_tiles`).

    Parameters
    ----------
    table, kernel, order, source : str
        As in :class:`TileTable`.
    head_dim, head_dim_v : int
        The head dims asked about.
    tiles : tuple of int
        The candidate kv tiles; empty when the table has no row for these head dims.
    when : str
        What chooses among several candidates, or what the kernel covers when there is none.
    """

    table: str
    kernel: str
    order: str
    source: str
    head_dim: int
    head_dim_v: int
    tiles: tuple[int, ...]
    when: str

    @property
    def ambiguous(self) -> bool:
        """True unless the table gives exactly one tile (the caller must pass ``kv_tile``)."""
        return len(self.tiles) != 1

    @property
    def tile(self) -> int | None:
        """The one tile, or None where the table is ambiguous."""
        return self.tiles[0] if len(self.tiles) == 1 else None

    def dims(self) -> str:
        """The head dims in words."""
        return f"head dim {self.head_dim}" + (
            "" if self.head_dim_v == self.head_dim else f", head_dim_v {self.head_dim_v}")

    def describe(self) -> str:
        """The rule in words, with its source (for error messages)."""
        if not self.tiles:
            return f"no row for {self.dims()}: {self.when}; {self.source}"
        tiles = ", ".join(str(t) for t in self.tiles)
        what = f"kv tile {tiles}" if len(self.tiles) == 1 else f"kv tiles {tiles}"
        return f"{what} at {self.dims()}{'; ' + self.when if self.when else ''}; {self.source}"


# -- the tables (values and sources: docs/quant-sources.md, "Kernel tiles") --------------------
_FA3 = ("Dao-AILab/flash-attention@0251105a2fb1 hopper/tile_size.h tile_size_fwd_sm90 "
        "(element_size 1), called by hopper/flash_fwd_launch_template.h run_flash_fwd "
        "from hopper/flash_api.cpp run_mha_fwd_constexpr")
_FA3_COVERS = ("FA3's FP8 forward instantiates head dims <= 256 with head_dim_v equal, or "
               "head dim in (128, 192] with head_dim_v in (96, 128] (hopper/flash_api.cpp "
               "mha_fwd, run_mha_fwd_constexpr)")


def _fa3_rows(hdim128: int) -> tuple[TileRow, ...]:
    """FA3's FP8 kBlockN for a dense KV cache, no local window, no softcap."""
    return (TileRow(1, 64, (160,)), TileRow(65, 96, (128,)), TileRow(97, 128, (hdim128,)),
            TileRow(129, 192, (160,)), TileRow(129, 192, (160,), head_dim_v=(97, 128)),
            TileRow(193, 256, (128,)))


_VLLM_ROWS_WHEN = "max_seqlen_q * Hq / Hkv"  # FA3's packed query rows (hopper/heuristics.h)
_VLLM = ("vllm-project/flash-attention@2adfc8c2177c (pinned by vllm-project/vllm@3a7b2806 "
         "cmake/external_projects/vllm_flash_attn.cmake) hopper/tile_size.h "
         "tile_size_fwd_sm90 (element_size 1, use_one_mma_wg), hopper/heuristics.h "
         "use_one_mma_wg, hopper/flash_api.cpp get_pagedkv_tma")
_FI90 = ("flashinfer-ai/flashinfer@fb28d7242b35 include/flashinfer/attention/hopper/"
         "quantization/prefill_sm90.cuh SingleFP8PrefillWithKVCacheDispatched (CTA_KV_)")
_FI90_PAGED = ("flashinfer-ai/flashinfer@fb28d7242b35 include/flashinfer/attention/hopper/"
               "quantization/prefill_sm90.cuh BatchFP8PrefillWithPagedKVCacheDispatched "
               "(CTA_KV_)")
_FI90_COVERS = ("FlashInfer's SM90 FP8 prefill instantiates head dims 64, 128 and 256 with "
                "head_dim_v equal (static_assert in prefill_sm90.cuh)")
_FA2 = ("flashinfer-ai/flashinfer@fb28d7242b35 include/flashinfer/attention/prefill.cuh "
        "SinglePrefillWithKVCacheDispatched (CTA_TILE_KV = NUM_MMA_KV * NUM_WARPS_KV * 16), "
        "include/flashinfer/utils.cuh FA2DetermineCtaTileQ, DISPATCH_NUM_MMA_KV")
_FA2_WHEN = ("CTA_TILE_KV = 16 * NUM_MMA_KV, NUM_MMA_KV the largest of 8, 4, 2 (even for an "
             "FP8 cache) within min(the device's shared memory per block over the K/V bytes "
             "of one step, 8 / NUM_MMA_Q), CTA_TILE_Q from the packed query rows "
             "(qo_len * Hq / Hkv: 128 above 64 rows with head dim < 256, 64 above 16 rows; at 16 "
             "rows or fewer CTA_TILE_Q 16 splits each tile over 4 kv warps, not emulated): the "
             "tile the dispatch picks on the device")
_SAGE = ("thu-ml/SageAttention@d1a57a546c3d sageattention/triton/attn_qk_int8_per_block.py "
         "forward (BLOCK_N = 64), _attn_fwd_inner (range(lo, hi, BLOCK_N)); "
         "sageattention/core.py sageattn_qk_int8_pv_fp16_triton (head dims padded to 64 or "
         "128)")

_TABLES: dict[str, TileTable] = {t.name: t for t in (
    TileTable("fa3_fp8", "FlashAttention-3's FP8 forward", "descending", _FA3, _fa3_rows(224),
              _FA3_COVERS),
    TileTable("fa3_fp8_v_colmajor", "FlashAttention-3's FP8 forward with a column-major V",
              "descending", _FA3 + " (v_colmajor: a build with FLASH_ATTENTION_ENABLE_VCOLMAJOR "
              "and v.stride(-1) != 1)", _fa3_rows(192), _FA3_COVERS),
    TileTable("vllm_fa3_fp8", "vLLM's FA3 fork, FP8 over a paged KV cache", "descending", _VLLM,
              (TileRow(1, 63, (160,)),
               TileRow(64, 64, (128, 160), when=f"128 when {_VLLM_ROWS_WHEN} <= 64 (one MMA "
                       "warpgroup), else 160"),
               TileRow(65, 96, (128,)),
               TileRow(97, 127, (160, 224), when="224 only when the pages are read by TMA "
                       f"(page_size % 224 == 0 and {_VLLM_ROWS_WHEN} > 128), else 160"),
               TileRow(128, 128, (96, 160, 224), when=f"96 when {_VLLM_ROWS_WHEN} <= 64 (one "
                       "MMA warpgroup); else 224 when the pages are read by TMA (page_size % "
                       f"224 == 0 and {_VLLM_ROWS_WHEN} > 128), else 160"),
               TileRow(129, 192, (160,)), TileRow(129, 192, (160,), head_dim_v=(97, 128)),
               TileRow(193, 256, (128,))),
              _FA3_COVERS.replace("FA3's", "the fork's")),
    TileTable("flashinfer_sm90_fp8", "FlashInfer's SM90 FP8 prefill (single, ragged)",
              "descending", _FI90,
              (TileRow(64, 64, (128,)), TileRow(128, 128, (192,)), TileRow(256, 256, (128,))),
              _FI90_COVERS),
    TileTable("flashinfer_sm90_fp8_paged", "FlashInfer's SM90 FP8 prefill (paged batch)",
              "descending", _FI90_PAGED,
              (TileRow(64, 64, (128,)), TileRow(128, 128, (128,)), TileRow(256, 256, (64,))),
              _FI90_COVERS),
    TileTable("flashinfer_fa2", "FlashInfer's FA2 prefill with an FP8 KV cache", "ascending",
              _FA2, (TileRow(1, 256, (32, 64, 128), head_dim_v=(1, 256), when=_FA2_WHEN),),
              "the FA2 prefill's head dims up to 256 are tabled here"),
    TileTable("sageattention_triton", "SageAttention's Triton INT8 kernel", "ascending", _SAGE,
              (TileRow(1, 128, (64,)),),
              "SageAttention's Triton path takes head dims up to 128 with head_dim_v equal "
              "(core.py raises for > 128)"),
)}

#: the known table names (``QuantSpec.tile_table`` is one of these or ``""``)
TILE_TABLES: tuple[str, ...] = tuple(_TABLES)


def tile_table(name: str) -> TileTable:
    """The table called ``name`` (one of :data:`TILE_TABLES`).

    Examples
    --------
    >>> tile_table("fa3_fp8").order
    'descending'
    """
    if not isinstance(name, str) or name not in _TABLES:
        raise RefAttnError(f"tile_table: {name!r} is not one of {', '.join(TILE_TABLES)} "
                           "(or '' for no kernel table)")
    return _TABLES[name]


@public
def kernel_tiles(table: str, head_dim: int, head_dim_v: int | None = None) -> TileRule:
    """The candidate kv tiles, visiting order and source of a kernel's table at a head dim.

    Parameters
    ----------
    table : str
        One of :data:`TILE_TABLES`.
    head_dim : int
        The head dim of q and k, at least 1.
    head_dim_v : int, optional
        The head dim of v (None: ``head_dim``).

    Returns
    -------
    TileRule
        ``tiles`` holds one tile where the source fixes it, several where it depends on what
        the call does not hold (``when`` says what), none where the kernel has no such head
        dims (then ``ambiguous`` and the caller must pass ``kv_tile``).

    Raises
    ------
    RefAttnError
        An unknown table or a head dim below 1.

    Examples
    --------
    >>> kernel_tiles("fa3_fp8", 128).tiles
    (224,)
    >>> kernel_tiles("fa3_fp8_v_colmajor", 128).tile
    192
    >>> rule = kernel_tiles("flashinfer_fa2", 128)
    >>> rule.ambiguous, rule.tiles, rule.order
    (True, (32, 64, 128), 'ascending')
    >>> kernel_tiles("flashinfer_sm90_fp8", 96).tiles
    ()
    """
    t = tile_table(table)
    d = bounded_int("head_dim", head_dim, lo=1, hi=INT64_MAX)
    dv = d if head_dim_v is None else bounded_int("head_dim_v", head_dim_v, lo=1, hi=INT64_MAX)
    for row in t.rows:
        if row.covers(d, dv):
            return TileRule(t.name, t.kernel, t.order, t.source, d, dv, row.tiles, row.when)
    return TileRule(t.name, t.kernel, t.order, t.source, d, dv, (), t.covers)


def resolve_kv_tile(table: str, kv_tile: int | None, kv_order: str, head_dim: int,
                    head_dim_v: int) -> int | None:
    """The kv tile a spec means at these head dims, or a :class:`RefAttnError` naming the field.

    ``table == ""``: no kernel table, ``kv_tile`` as given (None: the whole row in one tile).
    Otherwise ``kv_order`` must be the table's order, and ``kv_tile`` None takes the table's
    single tile (ambiguous: refused, asking for ``kv_tile`` with the candidates and the source)
    while a given ``kv_tile`` must be one of the candidates (any, where the table has no row).

    Examples
    --------
    >>> resolve_kv_tile("sageattention_triton", None, "ascending", 64, 64)
    64
    >>> resolve_kv_tile("", None, "ascending", 64, 64) is None
    True
    >>> try:
    ...     resolve_kv_tile("fa3_fp8", 8, "descending", 16, 16)
    ... except RefAttnError as exc:
    ...     print(str(exc)[:61])
    kv_tile: 8 contradicts FlashAttention-3's FP8 forward's table
    """
    if table == "":
        return kv_tile
    rule = kernel_tiles(table, head_dim, head_dim_v)
    if kv_order != rule.order:
        raise RefAttnError(f"kv_order: {kv_order!r} contradicts {rule.kernel}'s table (tiles "
                           f"visited {rule.order}; {rule.source}); pass tile_table='' for a "
                           "custom order")
    if kv_tile is None:
        if not rule.tiles:
            raise RefAttnError(f"kv_tile: None, but {rule.kernel}'s table has no row for "
                               f"{rule.dims()} ({rule.when}; {rule.source}); pass kv_tile for "
                               "the tile to emulate")
        if rule.ambiguous:
            tiles = ", ".join(str(t) for t in rule.tiles)
            raise RefAttnError(f"kv_tile: None is ambiguous in {rule.kernel}'s table at "
                               f"{rule.dims()}: kv tiles {tiles} ({rule.when}; {rule.source}); "
                               f"pass kv_tile=one of {tiles}")
        return rule.tile
    if rule.tiles and kv_tile not in rule.tiles:
        raise RefAttnError(f"kv_tile: {kv_tile} contradicts {rule.kernel}'s table "
                           f"({rule.describe()}); pass tile_table='' for a custom tile")
    return kv_tile


def effective_kv_tile(spec: TiledSpec, call: AttentionCall) -> int | None:
    """The kv tile the pipeline uses for ``call`` under ``spec``.

    The table's single tile when ``spec.kv_tile`` is None and ``spec.tile_table`` names a
    table; ``spec.kv_tile`` when given (checked against the table); None (the whole row in one
    tile) with no table and no ``kv_tile``. Head dims: q's last axis and v's last axis.

    Raises
    ------
    RefAttnError
        As :func:`resolve_kv_tile` (:func:`~refattn.quant.spec.check_quant` raises the same
        error first, naming the preset).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import preset
    >>> x = np.zeros((1, 1, 3, 128))
    >>> effective_kv_tile(preset("fa3_fp8"), AttentionCall(x, x, x))
    224
    >>> effective_kv_tile(preset("fa3_fp8", v_colmajor=True), AttentionCall(x, x, x))
    192
    >>> effective_kv_tile(preset("fa3_fp8").replace(tile_table=""), AttentionCall(x, x, x)) is None
    True
    """
    if not all(hasattr(spec, a) for a in ("tile_table", "kv_tile", "kv_order")):
        raise RefAttnError(f"spec: expected a QuantSpec, got {type(spec).__name__}")
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    return resolve_kv_tile(spec.tile_table, spec.kv_tile, spec.kv_order,
                           int(call.q.shape[3]), int(call.v.shape[3]))

"""The quantisation description of one attention call, and its validation gate.

Owns :class:`TensorQuant` (how q, k or v reaches the kernel: format, scale and its granularity,
rounding, whether the call holds the codes or the values the kernel casts), :class:`QuantSpec`
(the whole pipeline: S accumulation, P's handling, l, PV accumulation, output), their JSON
manifest (:meth:`QuantSpec.to_manifest` / :meth:`QuantSpec.from_manifest`, exact round trip) and
:func:`check_quant`, which refuses a spec that does not fit a call. Defers the casts to
:mod:`refattn.quant.formats`, the kernels' settings to :mod:`refattn.quant.presets` and the
arithmetic to :mod:`refattn.quant.pipeline`.

Scale convention: for every tensor the value the kernel means is ``code * scale`` (the scale is
the *descale*). A ``"codes"`` tensor holds the decoded codes (the real result uses
``codes * scale``); a ``"cast"`` tensor holds the unquantised values and the kernel computes
``code = cast(x / scale)`` (the real result uses ``x`` as given). ``scale=None`` on a ``"cast"``
tensor with ``"token_block"`` granularity is a scale the kernel computes itself
(``amax / format_max`` per block, SageAttention).

Scale shapes by granularity (H is the tensor's own head count: Hq for q, Hkv for k and v):
``"tensor"`` ``()``; ``"batch_kv_head"`` ``(B, Hkv)`` (query heads use their kv head's);
``"head"`` ``(H,)`` (FlashInfer: q per query head, k and v per kv head, no batch axis);
``"token_block"`` ``(B, H, ceil(L / block))``; ``"channel"`` ``(B, H, D)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import INT64_MAX, bounded_float, bounded_int, first_index, format_index
from refattn.call import AttentionCall
from refattn.call.scores import Dot
from refattn.errors import RefAttnError
from refattn.quant.formats import FORMATS, check_on_grid, format_info, quantize
from refattn.quant.tiles import TILE_TABLES, resolve_kv_tile

__all__ = [
    "GRANULARITIES",
    "SOURCES",
    "QuantSpec",
    "TensorQuant",
    "check_quant",
    "scale_shape",
]

GRANULARITIES = ("tensor", "batch_kv_head", "head", "token_block", "channel")
SOURCES = ("codes", "cast")
S_ACCUMULATIONS = ("fp32", "int32", "exact")
PV_ACCUMULATIONS = ("fp32", "fp16_per_tile", "exact")
P_HANDLINGS = ("offset", "multiplier")
L_FROM = ("unrounded", "rounded")
POST_SCALES = ("in_kernel", "after_kernel")
S_DESCALES = ("exponent", "after_dot")
KV_ORDERS = ("ascending", "descending")
MASKS = ("none", "causal", "causal_equal_lengths")
SCHEMA = "refattn_quant_spec_v2"
#: the schema before ``tile_table`` and ``mma_k`` (read as ``tile_table=""``, ``mma_k=0``: its
#: ``kv_tile`` None meant one tile for the whole row, its ``mma_bits`` bounded every addition)
SCHEMA_V1 = "refattn_quant_spec_v1"

#: the range of each float field of :class:`QuantSpec` (every one finite)
_FLOAT_BOUNDS: dict[str, dict[str, Any]] = {
    "p_offset": {"lo": 0.0, "hi": 64.0},  # FA3: 8 (p in [0, 256])
    "p_multiplier": {"lo": 0.0, "lo_open": True, "hi": 2.0**128},  # FlashInfer: 448
    "exp2_ulp": {"lo": 0.0, "hi": 2.0**23},  # 2**23 fp32 ulps: no significant bit left
    "log2e": {"lo": 0.0, "lo_open": True, "hi": 2.0},  # the constant log2(e) ~ 1.4427
    "output_ulp": {"lo": 0.0, "hi": 2.0**23},
}
#: the range of each integer field of :class:`QuantSpec` read from a manifest
_INT_BOUNDS: dict[str, dict[str, int]] = {"kv_tile": {"lo": 1, "hi": INT64_MAX},
                                          "mma_bits": {"lo": 2, "hi": 53},
                                          "mma_k": {"lo": 0, "hi": 2**20}}

Granularity = Literal["tensor", "batch_kv_head", "head", "token_block", "channel"]
Source = Literal["codes", "cast"]


def _scale_array(x: object) -> np.ndarray | None:
    """A scale as a read-only float64 array (a Python or numpy real becomes shape ``()``)."""
    if x is None:
        return None
    if isinstance(x, bool):
        raise RefAttnError(f"scale: expected a float64 array or a real number, got {x!r}")
    if isinstance(x, (int, np.integer)):  # a descale is positive, within float32's range:
        # an int beyond it is refused by name here (float() of it would be an OverflowError)
        arr = np.array(bounded_float("scale", x, lo=0.0, lo_open=True, hi=2.0**128))
    elif isinstance(x, (float, np.floating)):
        arr = np.array(float(x), dtype=np.float64)  # NaN, inf, 0: check_quant names the index
    elif isinstance(x, np.ndarray):
        if x.dtype != np.float64:
            raise RefAttnError(f"scale: expected float64, got {x.dtype} (refattn never casts)")
        arr = np.array(x, dtype=np.float64, copy=True)
    else:
        raise RefAttnError(f"scale: expected a float64 array or a real number, "
                           f"got {type(x).__name__}")
    arr.flags.writeable = False
    return arr


def _float_manifest(x: float) -> str:
    return float(x).hex()


def _float_from_manifest(name: str, x: object) -> float:
    if not isinstance(x, str):
        raise RefAttnError(f"{name}: expected a float.hex string, got {type(x).__name__}")
    try:
        return float.fromhex(x)
    except (ValueError, OverflowError):
        raise RefAttnError(f"{name}: {x!r} is not a float.hex string") from None


@public
@dataclass(frozen=True, eq=False)
class TensorQuant:
    """How one of q, k, v reaches the kernel.

    Parameters
    ----------
    format : str
        The kernel's storage format (one of ``FORMATS``: e4m3fn, e5m2, int8, fp16, bf16, fp32).
    scale : float64 ndarray (shape by granularity) or float, or None
        The descale: the kernel's value is ``code * scale``. None: computed by the kernel
        (``amax / format_max`` per token block; only for ``source="cast"``).
    granularity : {"tensor", "batch_kv_head", "head", "token_block", "channel"}
        Scale shape ``()``, ``(B, Hkv)``, ``(H,)``, ``(B, H, ceil(L / block))`` or
        ``(B, H, D)`` (H: the tensor's own heads).
    rounding : str
        The cast's rule (one of ``ROUNDINGS``) for a ``"cast"`` tensor; recorded for codes.
    source : {"codes", "cast"}
        ``"codes"``: the call holds decoded codes (checked on the grid); ``"cast"``: the call
        holds the values the kernel quantises itself.
    block : int, optional
        Tokens per scale block (``"token_block"`` only), an integer in ``[1, 2**63 - 1]``; a
        block longer than a tensor's token axis is that axis (one block), and the emulation
        sizes its arrays from the axis, never from the block.
    input_format : str, optional
        The format the kernel receives a ``"cast"`` tensor in before quantising it (bf16 for
        vLLM's cache write, fp16 for SageAttention); the call's values must lie on its grid.
        None: any float64 value.

    Examples
    --------
    >>> from refattn.quant import TensorQuant
    >>> tq = TensorQuant("e4m3fn", 0.5, "tensor", "nearest_even_satfinite", "codes")
    >>> tq.scale.shape, float(tq.scale)
    ((), 0.5)
    >>> TensorQuant.from_manifest(tq.to_manifest()) == tq
    True
    """

    format: str
    scale: np.ndarray | None
    granularity: str
    rounding: str
    source: str
    block: int | None = None
    input_format: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _scale_array(self.scale))
        self._check_fields()

    def _check_fields(self) -> None:
        if self.format not in FORMATS:
            raise RefAttnError(f"format: {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.granularity not in GRANULARITIES:
            raise RefAttnError(f"granularity: {self.granularity!r} is not one of "
                               f"{', '.join(GRANULARITIES)}")
        if self.rounding not in format_info(self.format).rounds:
            raise RefAttnError(f"rounding: {self.rounding!r} is not defined for format "
                               f"{self.format!r} (it accepts "
                               f"{', '.join(format_info(self.format).rounds)})")
        if self.source not in SOURCES:
            raise RefAttnError(f"source: {self.source!r} is not one of {', '.join(SOURCES)}")
        if (self.granularity == "token_block") != (self.block is not None):
            raise RefAttnError("block: needed with granularity 'token_block' and only there, "
                               f"got block={self.block!r} with {self.granularity!r}")
        if self.block is not None:
            object.__setattr__(self, "block", bounded_int("block", self.block, lo=1,
                                                          hi=INT64_MAX))
        if self.scale is None and not (self.source == "cast"
                                       and self.granularity == "token_block"):
            raise RefAttnError("scale: None (computed by the kernel) is defined only for a "
                               "'cast' tensor with 'token_block' granularity")
        if self.input_format is not None and self.input_format not in FORMATS:
            raise RefAttnError(f"input_format: {self.input_format!r} is not one of "
                               f"{', '.join(FORMATS)}")
        if self.input_format is not None and self.source != "cast":
            raise RefAttnError("input_format: defined only for a 'cast' tensor")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorQuant):
            return NotImplemented
        return self.to_manifest() == other.to_manifest()

    __hash__ = None  # type: ignore[assignment]

    def to_manifest(self) -> dict[str, Any]:
        """JSON-able description; scales as ``float.hex`` strings (exact)."""
        scale = None if self.scale is None else {
            "shape": list(self.scale.shape),
            "values": [_float_manifest(x) for x in self.scale.ravel()],
        }
        return {"format": self.format, "scale": scale, "granularity": self.granularity,
                "rounding": self.rounding, "source": self.source, "block": self.block,
                "input_format": self.input_format}

    @classmethod
    def from_manifest(cls, m: object, name: str = "tensor") -> TensorQuant:
        """The :class:`TensorQuant` that :meth:`to_manifest` described (checked again)."""
        if not isinstance(m, dict):
            raise RefAttnError(f"{name}: expected a dict, got {type(m).__name__}")
        keys = {"format", "scale", "granularity", "rounding", "source", "block", "input_format"}
        if set(m) != keys:
            raise RefAttnError(f"{name}: expected keys {sorted(keys)}, got {sorted(m)}")
        scale_m = m["scale"]
        scale: np.ndarray | None = None
        if scale_m is not None:
            if not isinstance(scale_m, dict) or set(scale_m) != {"shape", "values"}:
                raise RefAttnError(f"{name}.scale: expected {{'shape', 'values'}} or null")
            shape = scale_m["shape"]
            values = scale_m["values"]
            if not isinstance(shape, list) or len(shape) > 3:
                raise RefAttnError(f"{name}.scale.shape: expected up to 3 non-negative ints, "
                                   f"got {shape!r}")
            shape = [bounded_int(f"{name}.scale.shape[{i}]", n, lo=0, hi=INT64_MAX)
                     for i, n in enumerate(shape)]
            if not isinstance(values, list) or len(values) != math.prod(shape):
                raise RefAttnError(f"{name}.scale.values: expected {math.prod(shape)} values")
            scale = np.array([_float_from_manifest(f"{name}.scale.values", x) for x in values],
                             dtype=np.float64).reshape(shape)
        block = m["block"]  # bounded here to name the manifest field
        if block is not None:
            block = bounded_int(f"{name}.block", block, lo=1, hi=INT64_MAX)
        return cls(m["format"], scale, m["granularity"], m["rounding"], m["source"],
                   block, m["input_format"])


@public
@dataclass(frozen=True, eq=False)
class QuantSpec:
    """The quantised pipeline of one kernel: every quantisation point and accumulation.

    Parameters
    ----------
    q, k, v : TensorQuant
        How each input reaches the kernel.
    s_accumulation : {"fp32", "int32", "exact"}
        S = Q K^T: fp32 accumulation (on the tensor cores: see ``mma_bits``), an exact integer
        sum then scaled in fp32 (INT8), or exact (no rounding, for custom pipelines).
    p_format, p_rounding : str
        The cast of P before the PV product (e4m3fn satfinite for FA3, fp16 for SageAttention).
    p_handling : {"offset", "multiplier"}
        ``"offset"``: p = exp2(S c - (m c - p_offset)) (FA3: +8, p in [0, 256]);
        ``"multiplier"``: P = cast(p * p_multiplier) (FlashInfer: 448), O divided by it.
    l_from : {"unrounded", "rounded"}
        Whether the row sum l adds the fp32 p (before the cast) or the cast P.
    pv_accumulation : {"fp32", "fp16_per_tile", "exact"}
        O's accumulator: fp32 (tensor cores, ``mma_bits``), fp16 within each kv tile then
        added to an fp32 accumulator (SageAttention), or exact.
    output_format : str
        The kernel's output dtype (bf16, fp16, fp32).
    output_post_scale : {"in_kernel", "after_kernel"}
        Where v's descale is applied: inside the kernel before the output cast, or by the
        caller on the kernel's output (a second rounding in the output dtype: FlashInfer FA2).
    k_smoothing : bool
        Subtract K's per-head mean over the sequence before quantising it (SageAttention).
    q_prescale : bool
        Multiply Q by ``scale * log2e`` before quantising it (SageAttention); S is then in log2
        units and the exponent multiplier is 1.
    exp2_ulp : float
        The bound on exp2's error in fp32 ulps (``ex2.approx``).
    name : str
        A preset's name or ``"custom"``.
    s_descale : {"exponent", "after_dot"}
        Where q's and k's descales act: folded into the exponent multiplier
        c = scale * log2e * q_descale * k_descale (FA3) or multiplied onto the integer dot
        (SageAttention).
    log2e : float
        The log2(e) constant the kernel uses (float64; SageAttention writes 1.44269504).
    kv_tile : int, optional
        Keys per step of the online softmax (the running max, the rescale of l and O).
        None: the table's tile for the call's head dims when ``tile_table`` names one (refused
        where the table is ambiguous), else the whole row in one tile (the row max is the
        final max; exact for a kernel whose kv tile holds all keys). With a table, a given
        tile must be one of the table's candidates.
    kv_order : {"ascending", "descending"}
        The order the kernel visits the kv tiles (FA3 walks them from the last); with a
        table, the table's order.
    mma_bits : int
        Significant bits (with the implicit one) of the tensor cores' accumulation: with
        ``mma_k > 0``, of a k-block's sum (every addend, the incoming accumulator included,
        within one unit of that bit of the block's largest magnitude); with ``mma_k = 0``,
        of every addition (one unit in its last place, any order). 24 = fp32 with
        truncation; FP8 tensor-core accumulation is undocumented, widened to 13.
    mma_k : int
        Terms per k-block of the MMA instruction (32: Hopper's FP8 WGMMA; 16:
        ``mma.m16n8k16``), the model of :mod:`refattn.quant.accumulation`; 0: no block
        structure (the any-order bound of ``mma_bits`` per addition).
    output_ulp : float
        Error of the output's division and post-scale in fp32 ulps (approximate division).
    returns_lse : bool
        Whether the kernel returns the log-sum-exp (emulated as ``"lse"``).
    masks : tuple of {"none", "causal", "causal_equal_lengths"}
        The visibilities the kernel supports (causal: lower-right aligned; causal only where
        Q == K, as SageAttention's top-left mask agrees with it only there).
    gqa : bool
        Whether grouped query heads are supported (``head_map[h] = h // (Hq // Hkv)``).
    tile_table : str
        The named kernel's kv tile table (one of :data:`refattn.quant.tiles.TILE_TABLES`) that
        ``kv_tile`` and ``kv_order`` follow, checked by :func:`check_quant` at the call's head
        dims; ``""``: no table (a custom tile).

    Examples
    --------
    >>> from refattn.quant import QuantSpec, preset  # the package's classes (doctests of a module
    >>> spec = preset("fa3_fp8")                     # run on a second copy of it)
    >>> QuantSpec.from_manifest(spec.to_manifest()) == spec
    True
    >>> spec.p_format, spec.p_offset, spec.l_from
    ('e4m3fn', 8.0, 'unrounded')
    """

    q: TensorQuant
    k: TensorQuant
    v: TensorQuant
    s_accumulation: str = "fp32"
    p_format: str = "e4m3fn"
    p_rounding: str = "nearest_even_satfinite"
    p_handling: str = "offset"
    p_offset: float = 0.0
    p_multiplier: float = 1.0
    l_from: str = "unrounded"
    pv_accumulation: str = "fp32"
    output_format: str = "bf16"
    output_post_scale: str = "in_kernel"
    k_smoothing: bool = False
    q_prescale: bool = False
    exp2_ulp: float = 2.0
    name: str = "custom"
    s_descale: str = "exponent"
    log2e: float = 1.4426950408889634  # fl(log2 e): a literal, not a libm call
    kv_tile: int | None = None
    kv_order: str = "ascending"
    mma_bits: int = 24
    mma_k: int = 0
    output_ulp: float = 4.0
    returns_lse: bool = False
    masks: tuple[str, ...] = ("none", "causal")
    gqa: bool = True
    tile_table: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "masks", tuple(self.masks))
        self._check_fields()

    def _check_fields(self) -> None:
        for name in ("q", "k", "v"):
            if not isinstance(getattr(self, name), TensorQuant):
                raise RefAttnError(f"{name}: expected a TensorQuant, "
                                   f"got {type(getattr(self, name)).__name__}")
        choices = {"s_accumulation": S_ACCUMULATIONS, "p_handling": P_HANDLINGS,
                   "l_from": L_FROM, "pv_accumulation": PV_ACCUMULATIONS,
                   "output_post_scale": POST_SCALES, "s_descale": S_DESCALES,
                   "kv_order": KV_ORDERS, "p_format": FORMATS, "output_format": FORMATS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise RefAttnError(f"{name}: {getattr(self, name)!r} is not one of "
                                   f"{', '.join(allowed)}")
        if self.p_rounding not in format_info(self.p_format).rounds:
            raise RefAttnError(f"p_rounding: {self.p_rounding!r} is not defined for "
                               f"{self.p_format!r}")
        if self.p_format == "int8" or self.output_format in ("int8", "e4m3fn", "e5m2"):
            raise RefAttnError(f"p_format/output_format: {self.p_format!r}/"
                               f"{self.output_format!r}: P is a float format and the output "
                               "one of fp16, bf16, fp32")
        for name, kw in _FLOAT_BOUNDS.items():
            object.__setattr__(self, name, bounded_float(name, getattr(self, name), **kw))
        for name in ("k_smoothing", "q_prescale", "returns_lse", "gqa"):
            if not isinstance(getattr(self, name), bool):
                raise RefAttnError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.kv_tile is not None:  # a tile longer than the keys is all of them (one tile)
            object.__setattr__(self, "kv_tile", bounded_int("kv_tile", self.kv_tile,
                                                            **_INT_BOUNDS["kv_tile"]))
        object.__setattr__(self, "mma_bits", bounded_int("mma_bits", self.mma_bits,
                                                         **_INT_BOUNDS["mma_bits"]))
        object.__setattr__(self, "mma_k", bounded_int("mma_k", self.mma_k,
                                                      **_INT_BOUNDS["mma_k"]))
        if not self.masks or any(m not in MASKS for m in self.masks):
            raise RefAttnError(f"masks: expected a non-empty subset of {MASKS}, "
                               f"got {self.masks!r}")
        if not isinstance(self.name, str) or not self.name:
            raise RefAttnError(f"name: expected a non-empty str, got {self.name!r}")
        if not isinstance(self.tile_table, str) or (self.tile_table
                                                    and self.tile_table not in TILE_TABLES):
            raise RefAttnError(f"tile_table: {self.tile_table!r} is not one of "
                               f"{', '.join(TILE_TABLES)} or '' (no kernel table)")
        if self.s_accumulation == "int32" and (self.q.format != "int8" or self.k.format != "int8"):
            raise RefAttnError("s_accumulation: 'int32' needs q and k in int8")
        if self.s_accumulation != "int32" and "int8" in (self.q.format, self.k.format):
            raise RefAttnError("s_accumulation: int8 q/k accumulate in 'int32'")
        if self.v.format == "int8":
            raise RefAttnError("v.format: int8 v is not emulated (no kernel of the presets "
                               "stores it)")
        if self.q_prescale and self.s_descale != "after_dot":
            raise RefAttnError("q_prescale: defined with s_descale='after_dot' (S in log2 "
                               "units, the exponent multiplier 1)")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantSpec):
            return NotImplemented
        return self.to_manifest() == other.to_manifest()

    __hash__ = None  # type: ignore[assignment]

    def replace(self, **changes: Any) -> QuantSpec:
        """A copy with some fields changed (validated again), e.g. a mutated spec.

        Examples
        --------
        >>> from refattn.quant.presets import preset
        >>> preset("fa3_fp8").replace(p_offset=0.0).p_offset
        0.0
        """
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return QuantSpec(**values)

    def to_manifest(self) -> dict[str, Any]:
        """JSON-able description (floats as ``float.hex``), the call manifest's ``quant``.

        Examples
        --------
        >>> import json
        >>> from refattn.quant.presets import preset
        >>> m = preset("sageattention_int8").to_manifest()
        >>> m["schema"], m["name"], m["q"]["format"]
        ('refattn_quant_spec_v2', 'sageattention_int8', 'int8')
        >>> _ = json.dumps(m, allow_nan=False)
        """
        out: dict[str, Any] = {"schema": SCHEMA}
        for f in fields(self):
            x = getattr(self, f.name)
            if isinstance(x, TensorQuant):
                out[f.name] = x.to_manifest()
            elif isinstance(x, float):
                out[f.name] = _float_manifest(x)
            elif isinstance(x, tuple):
                out[f.name] = list(x)
            else:
                out[f.name] = x
        return out

    @classmethod
    def from_manifest(cls, m: object) -> QuantSpec:
        """The spec :meth:`to_manifest` described, validated again (untrusted input).

        A ``refattn_quant_spec_v1`` manifest (no ``tile_table``, no ``mma_k``) is read with
        ``tile_table=""`` and ``mma_k=0``, v1's semantics: ``kv_tile`` None meant the whole row
        in one tile, and ``mma_bits`` bounded every addition in any order.

        Examples
        --------
        >>> from refattn.quant.presets import preset
        >>> m = preset("fa3_fp8").to_manifest()
        >>> m["tile_table"], QuantSpec.from_manifest(m).tile_table
        ('fa3_fp8', 'fa3_fp8')
        >>> v1 = {k: v for k, v in m.items() if k not in ("tile_table", "mma_k")}
        >>> QuantSpec.from_manifest({**v1, "schema": "refattn_quant_spec_v1"}).tile_table
        ''
        """
        if not isinstance(m, dict):
            raise RefAttnError(f"quant: expected a dict, got {type(m).__name__}")
        names = [f.name for f in fields(cls)]
        if m.get("schema") == SCHEMA_V1:  # before tile_table and mma_k: v1's semantics
            names = [n for n in names if n not in ("tile_table", "mma_k")]
        elif m.get("schema") != SCHEMA:
            names = []
        if not names or set(m) != {"schema", *names}:
            want = names or [f.name for f in fields(cls)]
            raise RefAttnError(f"quant: expected schema {SCHEMA!r} with keys {sorted(want)} "
                               f"(or {SCHEMA_V1!r} without tile_table and mma_k), got {sorted(m)}")
        values: dict[str, Any] = {}
        floats = {f.name for f in fields(cls) if f.type == "float"}
        for name in names:
            x = m[name]
            if name in ("q", "k", "v"):
                values[name] = TensorQuant.from_manifest(x, f"quant.{name}")
            elif name in floats:
                values[name] = _float_from_manifest(f"quant.{name}", x)
            elif name in _INT_BOUNDS and x is not None:  # named as the manifest's field
                values[name] = bounded_int(f"quant.{name}", x, **_INT_BOUNDS[name])
            elif name == "masks":
                if not isinstance(x, list):
                    raise RefAttnError(f"quant.masks: expected a list, got {type(x).__name__}")
                values[name] = tuple(x)
            elif name == "tile_table" and not (isinstance(x, str) and
                                               (x == "" or x in TILE_TABLES)):
                raise RefAttnError(f"quant.tile_table: {x!r} is not one of "
                                   f"{', '.join(TILE_TABLES)} or '' (no kernel table)")
            else:
                values[name] = x
        return cls(**values)


# -- the gate ----------------------------------------------------------------------------------
def scale_shape(tq: TensorQuant, tensor: str, call: AttentionCall) -> tuple[int, ...]:
    """The scale shape ``tq``'s granularity needs for ``tensor`` ("q", "k" or "v") of ``call``.

    Examples
    --------
    >>> import numpy as np
    >>> call = AttentionCall(np.zeros((2, 4, 5, 8)), np.zeros((2, 2, 7, 8)), np.zeros((2, 2, 7, 8)))
    >>> tq = TensorQuant("int8", None, "token_block", "half_away_from_zero", "cast", block=4)
    >>> scale_shape(tq, "q", call), scale_shape(tq, "k", call)
    ((2, 4, 2), (2, 2, 2))
    """
    x = getattr(call, tensor)
    B, H, L, D = x.shape
    match tq.granularity:
        case "tensor":
            return ()
        case "batch_kv_head":
            return (B, call.k.shape[1])
        case "head":
            return (H,)
        case "token_block":  # a block longer than the axis is the axis: one block
            return (B, H, -(-L // min(int(tq.block or 1), max(L, 1))))
        case "channel":
            return (B, H, D)
        case other:  # pragma: no cover - TensorQuant refuses it
            raise RefAttnError(f"granularity: {other!r}")


def _check_scale(name: str, tq: TensorQuant, call: AttentionCall, in_fp32: bool) -> None:
    if tq.scale is None:
        return
    want = scale_shape(tq, name, call)
    if tq.scale.shape != want:
        raise RefAttnError(f"{name}.scale: expected shape {list(want)} for granularity "
                           f"{tq.granularity!r}, got {list(tq.scale.shape)}")
    s = tq.scale
    for bad, what in ((np.isnan(s), "NaN"), (np.isinf(s), "infinite"),
                      (s == 0, "zero"), (s < 0, "negative")):
        idx = first_index(bad)
        if idx is not None:
            raise RefAttnError(f"{name}.scale: {what} at index {format_index(idx)} "
                               f"(value {float(s[idx])!r}); a scale must be positive and finite")
    if in_fp32:
        with np.errstate(over="ignore"):
            off = quantize(s, "fp32", "nearest_even") != s
        idx = first_index(off)
        if idx is not None:
            raise RefAttnError(f"{name}.scale: {float(s[idx])!r} at index {format_index(idx)} "
                               "is not a float32 value (the kernel keeps its scales in float32)")
        tiny = s < float.fromhex("0x1p-126")
        idx = first_index(tiny)
        if idx is not None:
            raise RefAttnError(f"{name}.scale: {float(s[idx])!r} at index {format_index(idx)} "
                               "is below float32's smallest normal number 2**-126")


def _is_causal(call: AttentionCall) -> bool:
    vis = call.visible_array()
    if vis is None:
        return False
    Q, K = call.score_shape[2:]
    tril = np.tril(np.ones((Q, K), dtype=bool), K - Q)  # lower-right aligned
    return bool(np.array_equal(np.broadcast_to(vis, call.score_shape),
                               np.broadcast_to(tril, call.score_shape)))


@public
def check_quant(call: AttentionCall, spec: QuantSpec) -> None:
    """Refuse a quantisation spec that does not fit ``call`` (the gate's quant check).

    Checks every scale (shape for its granularity; zero, negative, NaN, infinite; float32
    representable and normal), every ``"codes"`` tensor on its format's grid and every
    ``"cast"`` tensor on its ``input_format``'s grid, and that the call uses no feature the
    kernel does not define (dropout, bias, softcap, sink, query_valid, a non-dot score, a
    scale placement other than post, a visibility other than the kernel's masks, a head map
    other than grouped). Where ``spec.tile_table`` names a kernel's table, ``kv_order`` must be
    its order and ``kv_tile`` one of its tiles at the call's head dims (q's and v's last axes),
    or None where the table gives one tile (:func:`refattn.quant.tiles.resolve_kv_tile`).

    Parameters
    ----------
    call : AttentionCall
        The call whose q, k, v hold what the kernel receives (see :mod:`refattn.quant.spec`).
    spec : QuantSpec
        The pipeline.

    Raises
    ------
    RefAttnError
        Naming the tensor or feature, the index and the expectation.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import check_quant, preset
    >>> x = np.full((1, 1, 2, 4), 0.5)
    >>> check_quant(AttentionCall(x, x, x), preset("fa3_fp8"))
    >>> try:
    ...     check_quant(AttentionCall(x + 0.01, x, x), preset("fa3_fp8"))
    ... except RefAttnError as exc:
    ...     print(str(exc)[:60])
    fa3_fp8: q: value 0.51 at index (0, 0, 0, 0) is not a finite
    >>> try:  # FA3's kBlockN at head dim 4 is 160
    ...     check_quant(AttentionCall(x, x, x), preset("fa3_fp8", kv_tile=8))
    ... except RefAttnError as exc:
    ...     print(str(exc)[:70])
    fa3_fp8: kv_tile: 8 contradicts FlashAttention-3's FP8 forward's table
    """
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    if not isinstance(spec, QuantSpec):
        raise RefAttnError(f"spec: expected a QuantSpec, got {type(spec).__name__}")
    try:
        _check_quant(call, spec)
    except RefAttnError as exc:
        raise RefAttnError(f"{spec.name}: {exc}") from None


def _check_quant(call: AttentionCall, spec: QuantSpec) -> None:
    features = {"dropout": call.dropout, "bias": call.bias, "softcap": call.softcap,
                "sink": call.sink, "query_valid": call.query_valid}
    for feature, value in features.items():
        if value is not None:
            raise RefAttnError(f"{feature}: the kernel defines no {feature} (not emulated for "
                               "a quantised call)")
    score = call.score
    if not isinstance(score, Dot):
        raise RefAttnError(f"score: the kernel computes dot-product scores, got "
                           f"{getattr(score, 'name', score)!r}")
    if call.scale_placement != "post":
        raise RefAttnError(f"scale_placement: the kernel applies the scale after the product, "
                           f"got {call.scale_placement!r}")
    if call.q.shape[3] != call.k.shape[3]:
        raise RefAttnError("q/k: unequal feature widths are not a quantised kernel's call")
    Hq, Hkv = call.q.shape[1], call.k.shape[1]
    grouped = np.arange(Hq) // (Hq // Hkv) if Hq % Hkv == 0 else None
    head_map = np.asarray(call.head_map)
    if grouped is None or not np.array_equal(head_map, grouped):
        raise RefAttnError(f"head_map: the kernel groups query heads (h // (Hq // Hkv)), got "
                           f"{head_map.tolist()}")
    if Hq != Hkv and not spec.gqa:
        raise RefAttnError(f"head_map: the kernel needs Hq == Hkv, got Hq={Hq}, Hkv={Hkv}")
    if call.visible_array() is not None:
        if not _is_causal(call):
            raise RefAttnError(f"visible: the kernel supports {' and '.join(spec.masks)} "
                               "visibility only (causal: lower-right aligned "
                               "tril(ones(Q, K), K - Q)), got another mask")
        Q, K = call.score_shape[2:]
        if "causal" not in spec.masks and not ("causal_equal_lengths" in spec.masks and Q == K):
            raise RefAttnError("visible: the kernel defines no causal mask" + (
                f" for Q != K (its causal mask is top-left aligned; got Q={Q}, K={K})"
                if "causal_equal_lengths" in spec.masks else ""))
    elif "none" not in spec.masks:
        raise RefAttnError("visible: the kernel needs a causal mask")
    for name in ("q", "k", "v"):
        tq: TensorQuant = getattr(spec, name)
        x = getattr(call, name)
        _check_scale(name, tq, call, True)
        if tq.source == "codes":
            check_on_grid(name, x, tq.format)
        elif tq.input_format is not None:
            check_on_grid(name, x, tq.input_format)
        if tq.granularity == "channel" and name != "v":
            raise RefAttnError(f"{name}.granularity: 'channel' scales are emulated for v only "
                               "(a post-scale of the output's columns)")
        if tq.granularity == "token_block" and spec.s_descale == "exponent" and name != "v":
            raise RefAttnError(f"{name}.granularity: 'token_block' scales of q/k act after the "
                               "dot (s_descale='after_dot')")
        if tq.granularity == "token_block" and name == "v":
            raise RefAttnError("v.granularity: 'token_block' scales of v are not emulated")
    if spec.k_smoothing and spec.k.source != "cast":
        raise RefAttnError("k_smoothing: the kernel smooths the K it quantises itself "
                           "(k.source='cast')")
    if spec.q_prescale and spec.q.source != "cast":
        raise RefAttnError("q_prescale: the kernel pre-scales the Q it quantises itself")
    # the kv tiles against the named kernel's table (the call's head dims: q's and v's)
    resolve_kv_tile(spec.tile_table, spec.kv_tile, spec.kv_order, int(call.q.shape[3]),
                    int(call.v.shape[3]))

"""AttentionCall: the immutable description of one attention call and its validation gate.

Owns the contract's ``attention_call_v1`` manifest and every check that must pass before any
arithmetic. Defers the arithmetic to :mod:`refattn.engine` and the dropout stream to
:mod:`refattn.dropout`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal, Protocol, cast, runtime_checkable

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    as_array,
    bounded_float,
    check_bool,
    check_broadcastable,
    check_finite,
    check_float64,
    check_shape,
    compact,
    first_index,
    float64_input,
    format_index,
    immutable_copy,
    int_text,
    memory_error,
    shown_shape,
)
from refattn._version import __version__
from refattn.call.hazards import check_forward_overflow
from refattn.call.placement import PLACEMENTS, ScalePlacement, placement_record
from refattn.call.scores import Dot, ScoreFamily
from refattn.errors import RefAttnError
from refattn.masks import BaseRelation
from refattn.records import float_record, tensor_record

__all__ = ["AttentionCall", "MultiplierSource", "check_head_map"]

AllMaskedRows = Literal["reject", "sanitize_then_zero_invalid_query"]
ReturnedWeights = Literal["none", "pre_dropout", "post_dropout"]
_POLICIES = ("reject", "sanitize_then_zero_invalid_query")
_RETURNED = ("none", "pre_dropout", "post_dropout")


@public
@runtime_checkable
class MultiplierSource(Protocol):
    """A replayable dropout stream (e.g. :class:`refattn.dropout.Philox`).

    ``multiplier(B, Hq, Q, K)`` returns the float64 Z of shape ``(B, Hq, Q, K)``;
    ``manifest()`` returns a JSON-serialisable description (algorithm, seed, offset, p).
    """

    p: float

    def multiplier(self, B: int, Hq: int, Q: int, K: int) -> np.ndarray: ...

    def manifest(self) -> dict[str, Any]: ...


def _frozen_copy(x: np.ndarray) -> np.ndarray:
    out = np.array(x, copy=True)
    out.flags.writeable = False
    return out


def _frozen_broadcast(x: np.ndarray) -> np.ndarray:
    """A read-only copy of ``x`` that stays a broadcast view: only :func:`compact` ``(x)``
    is copied, so a ``np.broadcast_to`` bias or mask of any claimed shape costs what its
    data costs (the dense engines count it at full size in their memory estimate)."""
    small = compact(x)
    if small.shape == x.shape:
        return _frozen_copy(x)
    return np.broadcast_to(_frozen_copy(small), x.shape)  # read-only view of a private copy


def check_head_map(call: AttentionCall) -> np.ndarray:
    """The call's head map, checked again right before a kernel indexes memory with it.

    The gate checked it at construction and keeps it in memory nobody can make writeable,
    but a kernel that reads ``k[head_map[h]]`` without bounds checks (numba, CUDA) must not
    trust even that: this re-checks dtype, shape and every entry against ``[0, Hkv)``.

    Returns
    -------
    (Hq,) int64 ndarray
        The head map to pass to the kernel.

    Raises
    ------
    RefAttnError
        Naming the first entry out of range.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 2, 3, 4)); kv = np.zeros((1, 1, 3, 4))
    >>> check_head_map(AttentionCall(x, kv, kv)).tolist()
    [0, 0]
    """
    hm: Any = call.head_map  # re-checked: the array may have been replaced since validation
    Hq, Hkv = call.q.shape[1], call.k.shape[1]
    if not (isinstance(hm, np.ndarray) and hm.dtype == np.int64 and hm.shape == (Hq,)):
        raise RefAttnError(f"head_map: expected an int64 array of shape [Hq={Hq}] at launch, "
                           f"got {getattr(hm, 'dtype', type(hm).__name__)} "
                           f"{list(np.shape(hm))}")
    bad = np.flatnonzero((hm < 0) | (hm >= Hkv))
    if bad.size:
        h = int(bad[0])
        raise RefAttnError(f"head_map: entry h={h} is {int(hm[h])} at launch, expected a kv "
                           f"head in [0, {Hkv}) (the array was changed after the call was "
                           "validated)")
    return hm


#: the smallest softcap: the smallest normal float64 (a subnormal cap's 1 / c overflows)
SMALLEST_SOFTCAP = 2.0**-1022


def _positive_real(name: str, x: object, what: str) -> float:
    """A positive finite real number (bool and strings are rejected, not converted; an int
    beyond float64's range is refused by name, never an ``OverflowError``)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise RefAttnError(f"{name}: expected a real number, got {type(x).__name__}")
    try:
        return bounded_float(name, x, lo=0.0, lo_open=True)
    except RefAttnError:
        shown = int_text(int(x)) if isinstance(x, (int, np.integer)) else repr(float(x))
        raise RefAttnError(f"{name}: expected a positive finite {what}, got {shown}") from None


def _refuse_scalar_dropout(dropout: object) -> None:
    """``dropout=0.1`` is not a probability here: Z would be 0.1 everywhere. Say what to pass."""
    if isinstance(dropout, (bool, int, float, np.number)) or (
            isinstance(dropout, np.ndarray) and dropout.ndim == 0):
        value = dropout.item() if isinstance(dropout, (np.ndarray, np.number)) else dropout
        raise RefAttnError(
            f"dropout: got the number {value!r}; dropout= takes the multiplier Z (or a stream "
            "that makes it), not a probability, and a bare number would multiply every "
            f"probability by {value!r}. For dropout with p={value!r} pass "
            f"dropout=refattn.dropout.Philox({value!r}, seed=...) (a replayable stream), or "
            f"an explicit multiplier array Z of 0 and 1/(1-p) broadcastable to (B, Hq, Q, K), "
            f"e.g. dropout=np.where(rng.random((B, Hq, Q, K)) < {value!r}, 0.0, "
            f"1 / (1 - {value!r})); dropout=None turns it off")


@public
@dataclass(frozen=True, eq=False)
class AttentionCall:
    """Frozen description of one scaled-dot-product attention call (``attention_call_v1``).

    Validation runs at construction, before any arithmetic; every array is copied and made
    read-only, so the call cannot change after it was checked. A broadcast ``visible``,
    ``query_valid``, ``bias`` or ``dropout`` (``np.broadcast_to``) stays a read-only view of
    a copy of its data; the head map lives in memory nobody can make writeable again (and
    kernels re-check it before launch: :func:`check_head_map`). Array subclasses pass the
    same gate: a masked array with a masked element and ``np.matrix`` are refused. A
    ``MemoryError`` while validating becomes a :class:`RefAttnError` naming the bytes.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
        Queries, head-major.
    k : (B, Hkv, K, Dk) float64 ndarray
        Keys (physical storage: Hkv heads).
    v : (B, Hkv, K, Dv) float64 ndarray
        Values; value row j belongs to the same source row as key j.
    visible : bool ndarray broadcastable to (B, Hq, Q, K), or a relation, optional
        True means the edge (query i reads key j) exists. Default: every edge exists. A
        :class:`~refattn.masks.VisibilityRelation`, or a union / intersection of them
        (``a | b``, ``a & b``: :class:`~refattn.masks.ComposedRelation`), is kept as given
        (``visible`` and ``relation`` are then the relation): the gate checks its rows block
        by block, streaming kernels evaluate it per tile, and :meth:`visible_array` builds
        the dense form only when a dense consumer asks. The manifest records its layout,
        alignment, window convention and head sharing.
    query_valid : bool ndarray broadcastable to (B, 1, Q, 1), optional
        Whether an output row is consumed. Rows with False get exactly zero output and
        exactly zero gradient contributions.
    bias : float64 ndarray broadcastable to (B, Hq, Q, K), optional
        Finite preference added to the scaled scores before visibility is applied.
    scale : float, optional
        Positive finite multiplier alpha applied exactly once to ``q @ k^T``;
        default ``Dk ** -0.5``.
    head_map : (Hq,) integer ndarray, optional
        Query head h reads kv head ``head_map[h]``; default grouped ``h // (Hq // Hkv)``.
    dropout : float64 ndarray broadcastable to (B, Hq, Q, K), or MultiplierSource, optional
        The realised dropout multiplier Z (any finite real; inverted dropout is 0 or
        1/(1-p)), or a replayable stream that generates it (e.g.
        :class:`refattn.dropout.Philox`). A bare number such as ``0.1`` is refused: it is
        not a probability here.
    all_masked_rows : {"reject", "sanitize_then_zero_invalid_query"}
        Policy for rows with no legal key. A consumed row with no legal key is an error,
        except with a ``sink``: there such a row is well defined (every probability 0, the
        sink takes all the mass, output 0, ``lse`` = the sink logit) under either policy, is
        never sanitised, and the manifest lists it (``visibility.empty_rows_with_sink``).
    returned_weights : {"none", "pre_dropout", "post_dropout"}
        Which weights a caller asks for (recorded in the manifest).
    score : ScoreFamily, optional
        Compatibility family from :mod:`refattn.call.scores`: ``Dot()`` (default), ``Bilinear``,
        ``Additive`` or ``Cosine``. Only dot has a default scale; the others need ``scale``.
        Bilinear and additive allow ``k``'s feature width to differ from ``q``'s.
    scale_placement : {"post", "q", "k", "split"}
        Where alpha is applied (exactly once): after the product, on q, on k, or
        ``sqrt(alpha)`` on each. Non-post placements need a family linear in q and k.
    softcap : float, optional
        ``c``: the scaled scores become ``c * tanh(s / c)`` before bias and visibility; a
        normal float64 (at least 2**-1022: a subnormal cap is refused).
    sink : (Hq,) float64 ndarray, optional
        Per-head sink logit that joins every row's softmax denominator with no value row
        (FlashAttention's learnable sink); it makes a row with no legal key well defined.

    Raises
    ------
    RefAttnError
        On any violated invariant, naming the tensor, axis or index and the expectation.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> call = AttentionCall(rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 5, 4)),
    ...                      rng.standard_normal((1, 1, 5, 6)))
    >>> call.axes
    {'B': 1, 'Hq': 2, 'Hkv': 1, 'Q': 3, 'K': 5, 'Dk': 4, 'Dv': 6}
    >>> call.head_map.tolist(), call.scale
    ([0, 0], 0.5)
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    _: KW_ONLY
    visible: np.ndarray | BaseRelation | None = None
    query_valid: np.ndarray | None = None
    bias: np.ndarray | None = None
    scale: float | None = None
    head_map: np.ndarray | None = None
    dropout: np.ndarray | MultiplierSource | None = None
    all_masked_rows: AllMaskedRows = "reject"
    returned_weights: ReturnedWeights = "none"
    score: ScoreFamily | None = None
    scale_placement: ScalePlacement = "post"
    softcap: float | None = None
    sink: np.ndarray | None = None
    ledger: dict[str, Any] = field(init=False, repr=False)
    relation: BaseRelation | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        try:
            try:
                self._validate()
            except MemoryError as exc:
                raise memory_error(exc, "validating the call") from None
        except RefAttnError as exc:
            shapes = ", ".join(  # a ragged list has no shape: then its type
                f"{n}={shown_shape(getattr(self, n))}" for n in ("q", "k", "v")
            )
            raise RefAttnError(f"AttentionCall({shapes}): {exc}") from None

    # -- validation gate ---------------------------------------------------------------
    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _validate(self) -> None:
        q = float64_input("q", self.q, 4)
        k = float64_input("k", self.k, 4)
        v = float64_input("v", self.v, 4)
        ledger: dict[str, Any] = {"query": tensor_record(q), "key_physical": tensor_record(k),
                  "value_physical": tensor_record(v)}
        B, Hq, Q, Dk = q.shape
        Bk, Hkv, K, Dk2 = k.shape
        Bv, Hkv2, K2, _ = v.shape
        for name, arr in (("q", q), ("k", k), ("v", v)):
            if 0 in arr.shape:
                raise RefAttnError(f"{name}: every axis must be non-empty, got {list(arr.shape)}")
        if Bk != B or Bv != B:
            raise RefAttnError(
                f"k/v: batch axis B must equal q's B={B}, got k B={Bk}, v B={Bv} "
                "(q, k, v never broadcast)"
            )
        score = Dot() if self.score is None else self.score
        if not isinstance(score, ScoreFamily):
            raise RefAttnError(
                f"score: expected a refattn.call.scores family (Dot, Bilinear, Additive, Cosine), "
                f"got {type(score).__name__}"
            )
        score.check_call(Hq=Hq, Dq=Dk, Dk=Dk2)
        self._set("score", score)
        if Hkv2 != Hkv:
            raise RefAttnError(f"v: head axis Hkv={Hkv2} must equal k's Hkv={Hkv}")
        if K2 != K:
            raise RefAttnError(
                f"v: key axis K={K2} must equal k's K={K} (value row j pairs with key row j)"
            )
        full = (B, Hq, Q, K)
        self._set("q", _frozen_copy(q))
        self._set("k", _frozen_copy(k))
        self._set("v", _frozen_copy(v))

        # head_map
        if self.head_map is None:
            if Hq % Hkv != 0:
                raise RefAttnError(
                    f"head_map: default grouped mapping needs Hq % Hkv == 0, got Hq={Hq}, "
                    f"Hkv={Hkv}; pass an explicit head_map"
                )
            hm = np.arange(Hq, dtype=np.int64) // (Hq // Hkv)
            ledger["head_map_mode"] = "grouped"
        else:
            hm_in = as_array("head_map", self.head_map)
            if hm_in.dtype.kind not in "iu":  # bool is kind "b": rejected too
                raise RefAttnError(f"head_map: expected an integer array, got dtype {hm_in.dtype}")
            check_shape("head_map", hm_in, (Hq,), "Hq")
            bad = np.flatnonzero((hm_in < 0) | (hm_in >= Hkv))
            if bad.size:
                h = int(bad[0])
                raise RefAttnError(
                    f"head_map: entry h={h} is {int(hm_in[h])}, expected a kv head in [0, {Hkv})"
                )
            hm = hm_in.astype(np.int64)
            ledger["head_map_mode"] = "explicit"
        self._set("head_map", immutable_copy(hm))  # nobody can make it writeable again

        # scale: a multiplier, applied once
        if self.scale is None:
            if not score.has_default_scale:
                raise RefAttnError(
                    f"scale: the {score.name} score has no canonical multiplier; pass an "
                    "explicit scale (Dk ** -0.5 belongs to dot attention only)"
                )
            scale = float(Dk) ** -0.5
            ledger["scale_source"] = "default_dk_inverse_sqrt"
        else:
            scale = _positive_real("scale", self.scale, "multiplier")
            ledger["scale_source"] = "explicit"
        self._set("scale", scale)
        self._validate_modifiers(Hq, score)

        # visibility and query validity
        if isinstance(self.visible, BaseRelation):  # evaluated lazily, never copied
            rel = self.visible
            self._set("relation", rel)
            check_broadcastable("visible", np.broadcast_to(np.False_, rel.shape), full,
                                "B,Hq,Q,K")
            ledger["visible"] = {"shape": list(rel.shape), "dtype": "bool", "device": "cpu",
                                 "source": "relation"}
        elif self.visible is not None:
            vis = as_array("visible", self.visible)
            check_bool("visible", vis)
            check_broadcastable("visible", vis, full, "B,Hq,Q,K")
            ledger["visible"] = tensor_record(vis)
            self._set("visible", _frozen_broadcast(vis))
        if self.query_valid is not None:
            qv = as_array("query_valid", self.query_valid)
            check_bool("query_valid", qv)
            check_broadcastable("query_valid", qv, (B, 1, Q, 1), "B,1,Q,1")
            ledger["query_valid"] = tensor_record(qv)
            self._set("query_valid", _frozen_broadcast(qv))

        # finite bias
        if self.bias is not None:
            bias = as_array("bias", self.bias)
            check_float64("bias", bias)
            check_broadcastable("bias", bias, full, "B,Hq,Q,K")
            check_finite("bias", bias)
            ledger["bias"] = tensor_record(bias)
            self._set("bias", _frozen_broadcast(bias))

        # dropout multiplier
        _refuse_scalar_dropout(self.dropout)
        if self.dropout is not None and not isinstance(self.dropout, MultiplierSource):
            z = as_array("dropout", self.dropout)
            check_float64("dropout", z)
            check_broadcastable("dropout", z, full, "B,Hq,Q,K")
            check_finite("dropout", z)
            ledger["dropout"] = tensor_record(z)
            self._set("dropout", _frozen_broadcast(z))

        if self.all_masked_rows not in _POLICIES:
            raise RefAttnError(
                f"all_masked_rows: expected one of {list(_POLICIES)}, got {self.all_masked_rows!r}"
            )
        if self.returned_weights not in _RETURNED:
            raise RefAttnError(
                f"returned_weights: expected one of {list(_RETURNED)}, "
                f"got {self.returned_weights!r}"
            )
        self._check_rows()
        self._set("ledger", ledger)
        check_forward_overflow(self)  # scores, bias, sink and output stay finite

    def _validate_modifiers(self, Hq: int, score: ScoreFamily) -> None:
        """Scale placement, softcap and sink (the finite score modifiers)."""
        if self.scale_placement not in PLACEMENTS:
            raise RefAttnError(
                f"scale_placement: expected one of {list(PLACEMENTS)}, "
                f"got {self.scale_placement!r}"
            )
        if self.scale_placement != "post" and not score.linear_in_operands:
            raise RefAttnError(
                f"scale_placement: {self.scale_placement!r} moves alpha into an operand, which "
                f"changes the {score.name} score (it is not linear in q and k); use 'post'"
            )
        if self.softcap is not None:
            cap = _positive_real("softcap", self.softcap, "cap")
            if cap < SMALLEST_SOFTCAP:
                raise RefAttnError(
                    f"softcap: {cap!r} is subnormal: a cap must be a normal float64, at least "
                    "2**-1022 (2.2250738585072014e-308); below it 1 / softcap overflows and "
                    "x / softcap is computed differently by each backend (a real kernel's "
                    "softcap is a float32, whose smallest normal is 2**-126)")
            self._set("softcap", cap)
        if self.sink is not None:
            sink = float64_input("sink", self.sink, 1)
            check_shape("sink", sink, (Hq,), "Hq")
            self._set("sink", _frozen_copy(sink))

    def _check_rows(self) -> None:
        if self.sink is not None:  # the sink is every row's support: no row is ever empty
            return
        empty = ~self.row_has_key()  # (B, Hq, Q)
        if not empty.any():
            return
        consumed = np.broadcast_to(self.query_valid_full()[..., 0], empty.shape)  # (B, Hq, Q)
        policy = self.all_masked_rows
        bad = empty if policy == "reject" else empty & consumed
        idx = first_index(bad)
        if idx is not None:
            what = "" if policy == "reject" else " and its query_valid is True"
            raise RefAttnError(
                f"visible: row {format_index(idx, 'bhi')} has no legal key{what} under policy "
                f"{policy!r} ({int(bad.sum())} such row(s)); a sink logit would make it "
                "well defined (sink=)"
            )

    # -- derived views -----------------------------------------------------------------
    @property
    def axes(self) -> dict[str, int]:
        """The logical axis sizes ``{B, Hq, Hkv, Q, K, Dk, Dv}``."""
        B, Hq, Q, Dq = self.q.shape
        _, Hkv, K, Dv = self.v.shape
        Dk = self.k.shape[3]
        axes = {"B": B, "Hq": Hq, "Hkv": Hkv, "Q": Q, "K": K, "Dk": Dk, "Dv": Dv}
        if Dq != Dk:  # bilinear / additive scores may compare unequal widths
            axes["Dq"] = Dq
        return axes

    @property
    def score_shape(self) -> tuple[int, int, int, int]:
        """``(B, Hq, Q, K)``."""
        B, Hq, Q, _ = self.q.shape
        return (B, Hq, Q, self.k.shape[2])

    def visible_array(self) -> np.ndarray | None:
        """The visibility as a read-only bool array broadcastable to (B, Hq, Q, K), or None.

        An array given as ``visible`` is returned as stored. A relation is compiled to its
        dense (B|1, H|1, Q, K) form on the first call and cached; streaming kernels evaluate
        the relation per tile and never call this.

        Examples
        --------
        >>> import numpy as np
        >>> from refattn.masks import causal
        >>> q, kv = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 4, 2))
        >>> call = AttentionCall(q, kv, kv, visible=causal(3, 4, alignment="upper_left"))
        >>> call.visible is call.relation, call.visible_array().shape
        (True, (1, 1, 3, 4))
        """
        rel = self.relation
        if rel is None:  # then visible is an array or None (a relation sets self.relation)
            return cast("np.ndarray | None", self.visible)

        def build() -> np.ndarray:
            dense = rel.dense()
            dense.flags.writeable = False
            return dense

        return self._cached("_visible_dense", build)

    def visible_full(self) -> np.ndarray:
        """Read-only (B, Hq, Q, K) bool view of the visibility (all True when absent)."""
        vis = self.visible_array()
        if vis is None:
            return np.broadcast_to(np.True_, self.score_shape)
        return np.broadcast_to(vis, self.score_shape)

    def row_has_key(self) -> np.ndarray:
        """(B, Hq, Q) bool: whether each query row has at least one legal key.

        Computed from a relation block by block (no dense relation is built) and cached.

        Examples
        --------
        >>> import numpy as np
        >>> from refattn.masks import causal
        >>> q, kv = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 2, 2))
        >>> call = AttentionCall(q, kv, kv, visible=causal(3, 2, alignment="lower_right"),
        ...                      all_masked_rows="sanitize_then_zero_invalid_query",
        ...                      query_valid=np.array([False, True, True])[None, None, :, None])
        >>> call.row_has_key().tolist()
        [[[False, True, True]]]
        """
        rel = self.relation
        if rel is None:
            return np.asarray(self.visible_full().any(axis=-1))
        B, Hq, Q, _ = self.score_shape
        return self._cached("_row_has_key",
                            lambda: np.broadcast_to(rel.row_any(), (B, Hq, Q)))

    def sanitized_rows(self) -> np.ndarray:
        """(B, Hq, Q) bool: rows given the temporary legal key 0 (Policy 3).

        Rows with no legal key under ``sanitize_then_zero_invalid_query`` and no sink. With a
        sink an empty row is well defined and never sanitised (all False).

        Examples
        --------
        >>> import numpy as np
        >>> from refattn.masks import causal
        >>> q, kv = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 2, 2))
        >>> rel = causal(3, 2, alignment="lower_right")   # row 0 reads no key
        >>> AttentionCall(q, kv, kv, visible=rel, sink=np.zeros(1)).sanitized_rows().any()
        np.False_
        """
        if self.sink is not None:
            return np.zeros(self.score_shape[:3], dtype=bool)
        return ~self.row_has_key()

    def empty_rows_with_sink(self) -> np.ndarray:
        """(n, 3) int64: the (b, h, i) of rows with no legal key that the sink fills alone.

        Empty (shape (0, 3)) without a sink or when every row has a legal key.

        Examples
        --------
        >>> import numpy as np
        >>> from refattn.masks import causal
        >>> q, kv = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 2, 2))
        >>> rel = causal(3, 2, alignment="lower_right")
        >>> AttentionCall(q, kv, kv, visible=rel, sink=np.zeros(1)).empty_rows_with_sink().tolist()
        [[0, 0, 0]]
        """
        if self.sink is None:
            return np.zeros((0, 3), dtype=np.int64)
        return np.argwhere(~self.row_has_key()).astype(np.int64)

    def _cached(self, name: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per call, kept on the instance (the dataclass fields stay frozen)."""
        value = self.__dict__.get(name)
        if value is None:
            value = build()
            self._set(name, value)
        return value

    def query_valid_full(self) -> np.ndarray:
        """Read-only (B, 1, Q, 1) bool view of query validity (all True when absent)."""
        B, _, Q, _ = self.q.shape
        if self.query_valid is None:
            return np.broadcast_to(np.True_, (B, 1, Q, 1))
        return np.broadcast_to(self.query_valid, (B, 1, Q, 1))

    def multiplier_full(self) -> np.ndarray | None:
        """The (B, Hq, Q, K) dropout multiplier Z, or None when dropout is off."""
        if self.dropout is None:
            return None
        if isinstance(self.dropout, MultiplierSource):
            z = np.asarray(self.dropout.multiplier(*self.score_shape))
            if z.dtype != np.float64 or z.shape != self.score_shape:
                raise RefAttnError(
                    f"dropout: stream returned {z.dtype} {list(z.shape)}, expected float64 "
                    f"{list(self.score_shape)}"
                )
            check_finite("dropout (the stream's multiplier)", z)
            return z
        return np.broadcast_to(self.dropout, self.score_shape)

    # -- manifest ----------------------------------------------------------------------
    def _dropout_manifest(self) -> dict[str, Any]:
        base = {
            "location": "probabilities_before_value_mixing",
            "returned_weights": self.returned_weights,
        }
        if self.dropout is None:
            return {**base, "training": False, "mode": "none", "p": 0.0,
                    "rng_provenance": "none"}
        if isinstance(self.dropout, MultiplierSource):
            return {**base, "training": True, "mode": "stream", **self.dropout.manifest()}
        return {**base, "training": True, "mode": "explicit_multiplier", "p": None,
                "rng_provenance": "explicit_multiplier_tensor",
                "shape": self.ledger["dropout"]["shape"]}

    def _sink_rows_manifest(self) -> dict[str, Any]:
        """The rows a sink fills alone (present only when there are some)."""
        rows = self.empty_rows_with_sink()
        if not rows.size:
            return {}
        return {"empty_rows_with_sink": {
            "count": int(rows.shape[0]), "rows_bhi": rows.tolist(),
            "rule": "no legal key: probs 0, sink_probs 1, output 0, lse = sink logit"}}

    def _relation_manifest(self) -> dict[str, Any]:
        if self.relation is None:
            return {}
        rel = self.relation.manifest()
        return {key: rel[key] for key in
                ("layout", "alignment", "window_convention", "head_sharing")} | {"relation": rel}

    def manifest(
        self,
        *,
        requested_backend: str = "numpy",
        selected_backend: str = "unobserved",
        materialization: dict[str, Any] | None = None,
        arithmetic_mode: str = "ieee754_binary64",
    ) -> dict[str, Any]:
        """JSON-serialisable ``attention_call_v1`` manifest of this call.

        Parameters
        ----------
        requested_backend, selected_backend : str
            Backend identity; a :class:`~refattn.engine.trace.Trace` fills in what actually ran.
        materialization : dict, optional
            Which logical objects received storage (default: scores and probabilities).
        arithmetic_mode : str
            ``"ieee754_binary64"`` (float64 in a backend's order; the numpy version is
            recorded) or ``"stepwise_correctly_rounded"`` (machine-independent: no numpy
            version is recorded).

        Returns
        -------
        dict
            Axes, tensor ledger, visibility, bias, scale, numerical ledger, dropout,
            backend and materialization. Contains no NaN or infinity.

        Examples
        --------
        >>> import numpy as np, json
        >>> ones = np.ones
        >>> call = AttentionCall(ones((1, 1, 2, 4)), ones((1, 1, 3, 4)), ones((1, 1, 3, 2)))
        >>> m = call.manifest()
        >>> m["schema"], m["scale"]["value"]["decimal"], m["visibility"]["semantic_polarity"]
        ('attention_call_v1', '0.5', 'true_means_legal')
        >>> _ = json.dumps(m, allow_nan=False)
        """
        led = self.ledger
        Hkv = self.k.shape[1]
        # set by validation (None only as constructor input)
        hm, scale = cast(np.ndarray, self.head_map), cast(float, self.scale)
        score = cast(ScoreFamily, self.score)
        sanitized = int(self.sanitized_rows().sum()) if self.all_masked_rows != "reject" else 0
        out: dict[str, Any] = {
            "schema": "attention_call_v1",
            "axes": self.axes,
            "tensors": {
                "query": led["query"],
                "key_physical": led["key_physical"],
                "value_physical": led["value_physical"],
                "head_map": {"shape": [int(hm.shape[0])], "range": [0, Hkv],
                             "mode": led["head_map_mode"],
                             "values": [int(h) for h in hm]},
            },
            "visibility": {
                "semantic_polarity": "true_means_legal",
                "shape": led["visible"]["shape"] if "visible" in led else None,
                "all_legal": self.visible is None,
                "query_valid_shape": led["query_valid"]["shape"] if "query_valid" in led else None,
                "all_masked_row_policy": self.all_masked_rows,
                "sanitized_rows": sanitized,
                "applied": "after_finite_bias",
                **self._relation_manifest(),
                **self._sink_rows_manifest(),
            },
            "bias": None if self.bias is None else {
                "role": "finite_preference_only", "shape": led["bias"]["shape"],
                "stride": led["bias"]["stride"],
            },
            "scale": {
                "value": float_record(scale),
                "source": led["scale_source"],
                **placement_record(scale, self.scale_placement, width=self.q.shape[3]),
            },
            "score": score.manifest(),
            "score_modifiers": {
                "order": "scale, softcap, finite_bias, visibility, softmax_with_sink",
                "softcap": None if self.softcap is None else float_record(self.softcap),
                "sink": None if self.sink is None else {
                    "shape": [int(self.sink.shape[0])], "has_value_row": False,
                    "values": [float_record(x) for x in self.sink],
                },
            },
            "numerical": {
                key: "float64" for key in (
                    "qkv_storage_dtype", "score_accumulation_dtype",
                    "softmax_accumulation_dtype", "probability_dtype",
                    "value_accumulation_dtype", "output_dtype",
                )
            },
            "dropout": self._dropout_manifest(),
            "backend": {
                "framework_revision": f"refattn {__version__}" + (
                    "" if arithmetic_mode == "stepwise_correctly_rounded"
                    else f"; numpy {np.__version__}"),
                "model_revision": None,
                "entrypoint": "refattn.forward",
                "requested_backend": requested_backend,
                "selected_backend": selected_backend,
                "device_arch": "cpu",
                "autocast": False,
                "deterministic": True,
                "arithmetic_mode": arithmetic_mode,
                "is_causal": False,
                "external_mask_kind": "none" if self.visible is None else "bool_true_means_legal",
                "compile_state": "eager",
            },
            "materialization": materialization
            or {"scores": True, "probabilities": True},
        }
        json.dumps(out, allow_nan=False)  # the manifest never carries NaN or infinity
        return out

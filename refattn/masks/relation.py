"""The frozen visibility relation: coordinates, labels and the one predicate over them.

Owns :class:`VisibilityRelation` (validation of its fields, per-element evaluation, the JSON
manifest and its inverse), :class:`KernelArguments` (the same fields as fixed-shape arrays for
compiled tile kernels) and :func:`relation_from_manifest` (a coordinate relation or a
composition of them, from its manifest). Defers per-tile and dense evaluation and the union /
intersection operators to :mod:`refattn.masks.algebra`, the constructors to
:mod:`refattn.masks`, window conventions to :mod:`refattn.masks.windows` and input checks to
:mod:`refattn.masks._inputs`.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal, NamedTuple, cast

import numpy as np

from refattn._boundary import public
from refattn.errors import RefAttnError
from refattn.masks._inputs import (
    POSITION_MAX,
    POSITION_MIN,
    WindowBound,
    head_count,
    int_coordinates,
    key_validity,
    prefix_lengths,
    window_bounds,
)
from refattn.masks.algebra import BaseRelation, ComposedRelation
from refattn.masks.windows import Window, window_to_inclusive

__all__ = ["Alignment", "KernelArguments", "Layout", "VisibilityRelation", "WindowConvention",
           "relation_from_manifest"]

Layout = Literal["padded", "packed", "cache"]
Alignment = Literal["upper_left", "lower_right", "explicit_positions", "none"]
WindowConvention = Literal["excludes_query", "includes_query"]

_LAYOUTS = ("padded", "packed", "cache")
_ALIGNMENTS = ("upper_left", "lower_right", "explicit_positions", "none")
_CONVENTIONS = ("excludes_query", "includes_query")


class KernelArguments(NamedTuple):
    """The predicate's inputs as fixed-shape arrays for a compiled (e.g. numba) tile kernel.

    With ``p = q_pos[b, i]`` and ``r = k_pos[b, j]`` the edge exists iff::

        key_valid[b, j]
        and (not has_segments or q_segment[b, i] == k_segment[b, j])
        and (topology == 0                                              # bidirectional
             or topology == 1 and r <= p                                # causal
             or topology == 2 and ((p < P and r < P) or (p >= P and r <= p)))  # prefix
        and (left[h] < 0 or p - r <= left[h]) and (right[h] < 0 or r - p <= right[h])

    with ``P = prefix_length[b, h]``; a negative window bound means unbounded.
    """

    q_pos: np.ndarray
    """(B, Q) int64."""
    k_pos: np.ndarray
    """(B, K) int64."""
    key_valid: np.ndarray
    """(B, K) bool."""
    has_segments: bool
    q_segment: np.ndarray
    """(B, Q) int64 (zeros without segments)."""
    k_segment: np.ndarray
    """(B, K) int64 (zeros without segments)."""
    topology: int
    """0 bidirectional, 1 causal, 2 prefix."""
    prefix_length: np.ndarray
    """(B, H) int64 (zeros without a prefix)."""
    left: np.ndarray
    """(H,) int64 keys strictly before the query; -1 = unbounded."""
    right: np.ndarray
    """(H,) int64 keys strictly after the query; -1 = unbounded."""


def _bound_at(bound: WindowBound, h: np.ndarray) -> Any:
    return bound if not isinstance(bound, np.ndarray) else bound[h]


def _listed(x: WindowBound | np.ndarray) -> Any:
    return x.tolist() if isinstance(x, np.ndarray) else x


@public
@dataclass(frozen=True, eq=False)
class VisibilityRelation(BaseRelation):
    r"""A visibility relation described by coordinates, not by a dense matrix.

    For batch row b, head h, query row i and key row j, with ``p = q_pos[b, i]`` and
    ``r = k_pos[b, j]``, the relation is the conjunction (True = the edge exists)::

        visible[b, h, i, j] = key_valid[b, j]
            and q_segment[b, i] == k_segment[b, j]          (only when segments are given)
            and topology
            and p - r <= left[h]                            (only when left is not None)
            and r - p <= right[h]                           (only when right is not None)

        topology = (p < P and r < P) or (p >= P and r <= p)  with P = prefix_length[b(, h)]
                 | r <= p                                    when causal (never with a prefix)
                 | True                                      otherwise

    ``left`` / ``right`` count keys strictly before / after the query position, so the
    diagonal ``r == p`` always passes the window (FlashAttention / JAX / ONNX convention).
    A backend may evaluate this per element, per tile (:meth:`tile`) or densely
    (:meth:`dense`); every evaluation must give the same truth values. ``a | b`` and
    ``a & b`` compose relations (:class:`~refattn.masks.algebra.ComposedRelation`), keeping
    their coordinates.

    Build one with :func:`relation` (which also converts windows from the convention that
    counts the query itself); direct construction takes the normalized fields below and
    runs the same validation.

    Attributes
    ----------
    q_pos : (B, Q) int64 ndarray
        Query coordinates (absolute cache positions or segment-local positions).
    k_pos : (B, K) int64 ndarray
        Key coordinates in the same frame as ``q_pos``.
    key_valid : (B, K) bool ndarray
        Whether key row j may contribute to any query (True = valid); None at construction
        means every key is valid.
    causal : bool
        ``r <= p``. Not allowed together with ``prefix_length``.
    q_segment, k_segment : (B, Q) and (B, K) int64 ndarray, or None
        Packed-document ids; both or neither.
    prefix_length : (B,) or (B, H) int64 ndarray, or None
        Prefix-LM boundary P (a scalar is stored as (B,)); (B, H) makes it per head.
    window : (left, right) or None
        Each side None (unbounded), an int >= 0, or an (H,) int64 array (per head).
    layout : {"padded", "packed", "cache"}
        Batch layout; default "packed" when segments are given, else "padded".
    alignment : {"upper_left", "lower_right", "explicit_positions", "none"}
        How query rows line up with key rows. "upper_left" / "lower_right" are checked
        against the coordinates; default "explicit_positions" for a positional relation
        (causal, prefix or window) and "none" otherwise.
    window_convention : {"excludes_query", "includes_query"} or None
        The convention the caller wrote the window in (``window`` itself is always stored
        excluding the query); None without a window.

    Examples
    --------
    >>> from refattn.masks import relation
    >>> rel = relation([[3, 4]], [[0, 1, 2, 3, 4]], causal=True)
    >>> rel.dense()[0, 0].astype(int).tolist()
    [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    >>> rel.tile(0, 0, 1, 3, 5).tolist()
    [[True, False]]
    >>> rel.shape, rel.layout, rel.alignment, rel.head_sharing
    ((1, 1, 2, 5), 'padded', 'explicit_positions', 'shared')
    """

    q_pos: np.ndarray
    k_pos: np.ndarray
    key_valid: np.ndarray | None = None
    _: KW_ONLY
    causal: bool = False
    q_segment: np.ndarray | None = None
    k_segment: np.ndarray | None = None
    prefix_length: np.ndarray | int | None = None
    window: tuple[WindowBound, WindowBound] | None = None
    layout: Layout | None = None
    alignment: Alignment | None = None
    window_convention: WindowConvention | None = "excludes_query"
    _heads: int = field(init=False, repr=False, default=1)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        q_pos = int_coordinates("q_pos", self.q_pos, None, "B,Q", lo=POSITION_MIN,
                                hi=POSITION_MAX)
        B, Q = q_pos.shape
        k_pos = int_coordinates("k_pos", self.k_pos, None, "B,K", lo=POSITION_MIN,
                                hi=POSITION_MAX)
        if k_pos.shape[0] != B:
            raise RefAttnError(
                f"k_pos: batch axis B={k_pos.shape[0]} must equal q_pos's B={B}"
            )
        K = k_pos.shape[1]
        for name, n in (("q_pos", Q), ("k_pos", K), ("batch", B)):
            if n == 0:
                raise RefAttnError(f"{name}: every axis must be non-empty, got B={B}, Q={Q}, K={K}")
        set_(self, "q_pos", q_pos)
        set_(self, "k_pos", k_pos)
        set_(self, "key_valid", key_validity(self.key_valid, (B, K)))
        if not isinstance(self.causal, (bool, np.bool_)):
            raise RefAttnError(f"causal: expected True or False, got {self.causal!r}")
        set_(self, "causal", bool(self.causal))

        if (self.q_segment is None) != (self.k_segment is None):
            given = "q_segment" if self.k_segment is None else "k_segment"
            raise RefAttnError(
                f"q_segment/k_segment: pass both or neither (got only {given}); a one-sided "
                "segment id cannot define block-diagonal visibility"
            )
        if self.q_segment is not None:
            set_(self, "q_segment", int_coordinates("q_segment", self.q_segment, (B, Q), "B,Q"))
            set_(self, "k_segment", int_coordinates("k_segment", self.k_segment, (B, K), "B,K"))

        prefix: np.ndarray | None = None
        if self.prefix_length is not None:
            if self.causal:
                raise RefAttnError(
                    "prefix_length with causal=True: a prefix topology already defines its own "
                    "causal region, and a separate causal flag would remove legal "
                    "prefix-to-prefix edges; pass prefix_length alone"
                )
            prefix = prefix_lengths(self.prefix_length, B)
            set_(self, "prefix_length", prefix)
        window = window_bounds(self.window)
        set_(self, "window", None if window is None else Window(*window))
        set_(self, "_heads", head_count(prefix, window))
        self._resolve_labels()

    def _resolve_labels(self) -> None:
        set_ = object.__setattr__
        layout = self.layout
        if layout is None:
            layout = "packed" if self.q_segment is not None else "padded"
        if layout not in _LAYOUTS:
            raise RefAttnError(f"layout: expected one of {list(_LAYOUTS)}, got {layout!r}")
        if layout == "packed" and self.q_segment is None:
            raise RefAttnError(
                "layout 'packed' needs q_segment and k_segment: without them packed documents "
                "read each other (block-diagonal visibility is required)"
            )
        set_(self, "layout", layout)

        positional = self.causal or self.prefix_length is not None or self.window is not None
        alignment = self.alignment
        if alignment is None:
            alignment = "explicit_positions" if positional else "none"
        if alignment not in _ALIGNMENTS:
            raise RefAttnError(
                f"alignment: expected one of {list(_ALIGNMENTS)}, got {alignment!r}"
            )
        if alignment != "none" and not positional:
            raise RefAttnError(
                f"alignment {alignment!r}: applies only to a positional relation (causal, "
                "prefix_length or window); this relation has none"
            )
        if alignment == "none" and positional:
            raise RefAttnError(
                "alignment 'none': this relation is positional (causal, prefix_length or "
                "window); name its alignment or leave it to default to 'explicit_positions'"
            )
        if alignment in ("upper_left", "lower_right"):
            self._check_alignment(alignment)
        set_(self, "alignment", alignment)

        convention = self.window_convention
        if self.window is None:
            convention = None
        elif convention not in _CONVENTIONS:
            raise RefAttnError(
                f"window_convention: expected one of {list(_CONVENTIONS)}, got {convention!r}"
            )
        set_(self, "window_convention", convention)

    def _check_alignment(self, alignment: str) -> None:
        Q, K = self.q_pos.shape[1], self.k_pos.shape[1]
        offset = 0 if alignment == "upper_left" else K - Q
        k0 = self.k_pos[:, :1]  # (B, 1)
        expected_k = k0 + np.arange(K)  # (B, K)
        expected_q = k0 + offset + np.arange(Q)  # (B, Q)
        for name, got, want in (("k_pos", self.k_pos, expected_k),
                                ("q_pos", self.q_pos, expected_q)):
            rows = np.flatnonzero((got != want).any(axis=1))
            if rows.size:
                b = int(rows[0])
                raise RefAttnError(
                    f"alignment {alignment!r} does not match the coordinates: {name}[b={b}] is "
                    f"{got[b].tolist()}, {alignment} alignment needs {want[b].tolist()}"
                )

    # -- fields as validated (the constructor also takes None, ints, tuples) ------------------
    @property
    def _prefix(self) -> np.ndarray | None:
        """``prefix_length`` as validated: (B,) or (B, H) int64, or None."""
        return cast("np.ndarray | None", self.prefix_length)

    @property
    def _key_valid(self) -> np.ndarray:
        """``key_valid`` as validated: (B, K) bool."""
        return cast(np.ndarray, self.key_valid)

    @property
    def _k_segment(self) -> np.ndarray:
        """``k_segment`` as validated ((B, K) int64; read only when q_segment is given)."""
        return cast(np.ndarray, self.k_segment)

    # -- shape and labels --------------------------------------------------------------
    @property
    def heads(self) -> int:
        """Size of the head axis of the relation: 1 when every head shares it."""
        return self._heads

    @property  # BaseRelation declares shape an attribute (ComposedRelation assigns it)
    def shape(self) -> tuple[int, int, int, int]:  # type: ignore[override]
        """``(B, H, Q, K)`` of :meth:`dense` (H is 1 when head-shared)."""
        B, Q = self.q_pos.shape
        return (B, self.heads, Q, self.k_pos.shape[1])

    @property
    def head_sharing(self) -> Literal["shared", "per_head"]:
        """"per_head" when a window or prefix is given per head, else "shared"."""
        per_head = self._prefix is not None and self._prefix.ndim == 2
        if self.window is not None:
            per_head = per_head or any(isinstance(s, np.ndarray) for s in self.window)
        return "per_head" if per_head else "shared"

    @property
    def topology(self) -> Literal["bidirectional", "causal", "prefix"]:
        """"prefix", "causal" or "bidirectional" (windows and segments restrict any of them)."""
        if self.prefix_length is not None:
            return "prefix"
        return "causal" if self.causal else "bidirectional"

    # -- evaluation ----------------------------------------------------------------------
    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
        """Evaluate the predicate at broadcastable index arrays (FlexAttention ``mask_mod``).

        Parameters
        ----------
        b, h, q_idx, kv_idx : int or integer ndarray
            Batch, head, query-row and key-row indices; broadcast together.

        Returns
        -------
        bool ndarray
            The relation at every broadcast index (shape of the broadcast).

        Examples
        --------
        >>> from refattn.masks import causal
        >>> causal(2, 3, alignment="upper_left").mask_mod(0, 0, 0, np.arange(3)).tolist()
        [True, False, False]
        """
        B, H, Q, K = self.shape
        b, h, i, j = (np.asarray(x) for x in (b, h, q_idx, kv_idx))
        for name, idx, size in (("b", b, B), ("h", h, H), ("q_idx", i, Q), ("kv_idx", j, K)):
            self._check_index(name, idx, size)
        shape = np.broadcast_shapes(b.shape, h.shape, i.shape, j.shape)
        p = self.q_pos[b, i]  # query coordinate
        r = self.k_pos[b, j]  # key coordinate
        out = self._key_valid[b, j]
        if self.q_segment is not None:
            out = out & (self.q_segment[b, i] == self._k_segment[b, j])
        prefix = self._prefix
        if prefix is not None:
            P = prefix[b] if prefix.ndim == 1 else prefix[b, h]
            q_in = p < P
            out = out & ((q_in & (r < P)) | (~q_in & (r <= p)))
        elif self.causal:
            out = out & (r <= p)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                out = out & (p - r <= _bound_at(left, h))
            if right is not None:
                out = out & (r - p <= _bound_at(right, h))
        return np.broadcast_to(out, shape).copy()

    def leaves(self) -> tuple[VisibilityRelation, ...]:
        """``(self,)``: a coordinate relation is its own one leaf."""
        return (self,)

    def program(self) -> np.ndarray:
        """``[0]``: push the one leaf (see :meth:`BaseRelation.program`)."""
        return np.zeros(1, dtype=np.int64)

    def kernel_arguments(self) -> KernelArguments:
        """The relation's fields as fixed-shape arrays (see :class:`KernelArguments`).

        Examples
        --------
        >>> from refattn.masks import causal
        >>> args = causal(2, 5, alignment="lower_right").kernel_arguments()
        >>> args.topology, args.q_pos.tolist(), args.left.tolist()
        (1, [[3, 4]], [-1])
        """
        B, H, Q, K = self.shape

        def per_head(bound: WindowBound) -> np.ndarray:
            if bound is None:
                return np.full(H, -1, dtype=np.int64)
            return np.broadcast_to(np.asarray(bound, dtype=np.int64), (H,)).copy()

        left, right = self.window if self.window is not None else (None, None)
        prefix = np.zeros((B, H), dtype=np.int64)
        P = self._prefix
        if P is not None:
            prefix[:] = P[:, None] if P.ndim == 1 else P
        segmented = self.q_segment is not None
        return KernelArguments(
            self.q_pos, self.k_pos, self._key_valid, segmented,
            self.q_segment if self.q_segment is not None else np.zeros((B, Q), dtype=np.int64),
            self._k_segment if segmented else np.zeros((B, K), dtype=np.int64),
            {"bidirectional": 0, "causal": 1, "prefix": 2}[self.topology],
            prefix, per_head(left), per_head(right),
        )

    # -- manifest ------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description from which the relation can be rebuilt exactly.

        Examples
        --------
        >>> from refattn.masks import causal
        >>> m = causal(2, 5, alignment="lower_right").manifest()
        >>> m["layout"], m["alignment"], m["topology"], m["q_positions"]
        ('cache', 'lower_right', 'causal', [[3, 4]])
        >>> VisibilityRelation.from_manifest(m).dense().sum()
        np.int64(9)
        """
        window = None
        if self.window is not None:
            left, right = self.window
            window = {"left": _listed(left), "right": _listed(right),
                      "convention": "excludes_query"}
            if self.window_convention == "includes_query":
                given = window_to_inclusive(self.window)
                window["given"] = [_listed(given.left), _listed(given.right)]
        return {
            "schema": "visibility_relation_v1",
            "semantic_polarity": "true_means_legal",
            "shape": list(self.shape),
            "layout": self.layout,
            "alignment": self.alignment,
            "topology": self.topology,
            "causal": self.causal,
            "head_sharing": self.head_sharing,
            "window": window,
            "window_convention": self.window_convention,
            "prefix_length": None if self._prefix is None else self._prefix.tolist(),
            "q_positions": self.q_pos.tolist(),
            "k_positions": self.k_pos.tolist(),
            "key_valid": {"polarity": "true_means_valid", "values": self._key_valid.tolist()},
            "segments": None if self.q_segment is None else {
                "q": self.q_segment.tolist(), "k": self._k_segment.tolist()},
        }

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> VisibilityRelation:
        """Rebuild a relation from :meth:`manifest` (inverse of it)."""
        if manifest.get("schema") != "visibility_relation_v1":
            raise RefAttnError(
                f"manifest: expected schema 'visibility_relation_v1', got "
                f"{manifest.get('schema')!r}"
            )
        w = manifest["window"]
        window: tuple[WindowBound, WindowBound] | None = None
        if w is not None:
            left, right = (None if x is None else (x if isinstance(x, int) else np.array(x))
                           for x in (w["left"], w["right"]))
            window = (left, right)
        seg = manifest["segments"]
        prefix = manifest["prefix_length"]
        return cls(
            np.array(manifest["q_positions"], dtype=np.int64),
            np.array(manifest["k_positions"], dtype=np.int64),
            np.array(manifest["key_valid"]["values"], dtype=bool),
            causal=manifest["causal"],
            q_segment=None if seg is None else np.array(seg["q"], dtype=np.int64),
            k_segment=None if seg is None else np.array(seg["k"], dtype=np.int64),
            prefix_length=None if prefix is None else np.array(prefix, dtype=np.int64),
            window=window,
            layout=manifest["layout"],
            alignment=manifest["alignment"],
            window_convention=manifest["window_convention"] or "excludes_query",
        )


@public
def relation_from_manifest(manifest: dict[str, Any]) -> BaseRelation:
    """Rebuild a relation, or a composition of relations, from its manifest.

    Parameters
    ----------
    manifest : dict
        A ``visibility_relation_v1`` or ``visibility_composition_v1`` record.

    Returns
    -------
    VisibilityRelation or ComposedRelation

    Examples
    --------
    >>> from refattn.masks import causal
    >>> rel = causal(2, 4, alignment="upper_left") | causal(2, 4, alignment="lower_right")
    >>> back = relation_from_manifest(rel.manifest())
    >>> bool((back.dense() == rel.dense()).all()), back.op
    (True, 'or')
    """
    schema = manifest.get("schema")
    if schema == "visibility_composition_v1":
        terms = manifest.get("terms")
        if not isinstance(terms, list):
            raise RefAttnError("manifest: a visibility_composition_v1 record needs a 'terms' list")
        return ComposedRelation(manifest["op"], [relation_from_manifest(t) for t in terms])
    return VisibilityRelation.from_manifest(manifest)

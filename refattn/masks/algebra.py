"""The relation algebra: the interface every visibility relation implements, union and
intersection.

Owns :class:`BaseRelation` (the predicate's shape, per-element / per-tile / dense evaluation
and the labels that every consumer reads, plus the operators ``a | b`` and ``a & b``) and
:class:`ComposedRelation`, the union or intersection of relations kept as its terms'
coordinates: it is evaluated term by term, never through a dense matrix, and compiled tile
kernels receive its leaves and a postfix program (:meth:`BaseRelation.program`). Defers the
coordinate relation itself to :mod:`refattn.masks.relation` (a :class:`VisibilityRelation` is
the one leaf kind) and rebuilding a composition from its manifest to
:func:`refattn.masks.relation.relation_from_manifest`.

StreamingLLM's "window OR the first n tokens" (FlashAttention's ``sink_token_length``) is
``window | first_n``; document-causal variants are unions and intersections of predicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import numpy as np

from refattn._boundary import public
from refattn.errors import RefAttnError

__all__ = ["AND", "MAX_DEPTH", "OR", "BaseRelation", "ComposedRelation"]

#: postfix program codes: a leaf index (>= 0) pushes that leaf's truth value
AND, OR = -1, -2
#: deepest nesting of compositions (compiled kernels evaluate with a fixed-size stack)
MAX_DEPTH = 8

Op = Literal["or", "and"]


class BaseRelation:
    """A visibility predicate over (b, h, i, j), True = the edge exists.

    Subclasses provide :attr:`shape`, :meth:`mask_mod`, :meth:`manifest`, the labels
    (:attr:`layout`, :attr:`alignment`, :attr:`window_convention`, :attr:`head_sharing`,
    :attr:`topology`), :meth:`leaves` and :meth:`program`; every other evaluation
    (:meth:`dense`, :meth:`tile`, :meth:`row_any`) is defined here from :meth:`mask_mod`.
    ``a | b`` is the union (an edge exists if it exists in either), ``a & b`` the
    intersection; both keep the operands' coordinates.
    """

    shape: tuple[int, int, int, int]
    layout: str | None  # None only as a VisibilityRelation constructor input (then resolved)
    alignment: str | None
    window_convention: str | None

    # -- what a relation provides ------------------------------------------------------------
    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
        raise NotImplementedError

    def manifest(self) -> dict[str, Any]:
        raise NotImplementedError

    def leaves(self) -> tuple[Any, ...]:
        """The coordinate relations (:class:`VisibilityRelation`) in :meth:`program` order."""
        raise NotImplementedError

    def program(self) -> np.ndarray:
        """Postfix program over :meth:`leaves`: ``l >= 0`` pushes leaf l, :data:`AND` and
        :data:`OR` combine the top two entries; (n,) int64."""
        raise NotImplementedError

    @property
    def heads(self) -> int:
        """Size of the head axis of the relation: 1 when every head shares it."""
        return self.shape[1]

    @property
    def head_sharing(self) -> Literal["shared", "per_head"]:
        raise NotImplementedError

    @property
    def topology(self) -> str:
        raise NotImplementedError

    # -- the algebra ---------------------------------------------------------------------------
    def __or__(self, other: object) -> ComposedRelation:
        if not isinstance(other, BaseRelation):
            return NotImplemented
        return ComposedRelation("or", (self, other))

    def __and__(self, other: object) -> ComposedRelation:
        if not isinstance(other, BaseRelation):
            return NotImplemented
        return ComposedRelation("and", (self, other))

    # -- evaluation from mask_mod --------------------------------------------------------------
    def dense(self) -> np.ndarray:
        """The dense relation.

        Returns
        -------
        (B, H, Q, K) bool ndarray
            H is 1 when every head shares the relation (then it broadcasts over Hq).

        Examples
        --------
        >>> from refattn.masks import causal
        >>> causal(2, 2, alignment="upper_left").dense().shape
        (1, 1, 2, 2)
        """
        B, H, Q, K = self.shape
        return self.mask_mod(
            np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
            np.arange(Q)[None, None, :, None], np.arange(K)[None, None, None, :],
        )

    def tile(self, b: int, i0: int, i1: int, j0: int, j1: int, *, h: int = 0) -> np.ndarray:
        """The relation on query rows ``[i0, i1)`` and key rows ``[j0, j1)``, from coordinates.

        Evaluates the predicate for this tile only; the dense relation is never built.

        Parameters
        ----------
        b : int
            Batch row.
        i0, i1, j0, j1 : int
            Half-open query-row and key-row ranges, ``0 <= i0 <= i1 <= Q`` and likewise for K.
        h : int
            Head (only meaningful for a per-head relation).

        Returns
        -------
        (i1 - i0, j1 - j0) bool ndarray

        Examples
        --------
        >>> from refattn.masks import causal
        >>> causal(4, 4, alignment="upper_left").tile(0, 2, 4, 0, 4).astype(int).tolist()
        [[1, 1, 1, 0], [1, 1, 1, 1]]
        """
        _, _, Q, K = self.shape
        for lo, hi, size, name in ((i0, i1, Q, "i"), (j0, j1, K, "j")):
            if not (0 <= lo <= hi <= size):
                raise RefAttnError(
                    f"tile: expected 0 <= {name}0 <= {name}1 <= {size}, got [{lo}, {hi})"
                )
        return self.mask_mod(b, h, np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :])

    def row_any(self, *, block_elements: int = 1 << 20) -> np.ndarray:
        """Whether each query row has at least one legal key, without the dense relation.

        Evaluates :meth:`tile` over blocks of whole rows of at most ``block_elements``
        edges, so the memory used is bounded by the block, not by Q x K.

        Returns
        -------
        (B, H, Q) bool ndarray
            Equal to ``self.dense().any(axis=-1)``.

        Examples
        --------
        >>> from refattn.masks import causal
        >>> causal(3, 2, alignment="lower_right").row_any().tolist()
        [[[False, True, True]]]
        """
        B, H, Q, K = self.shape
        out = np.zeros((B, H, Q), dtype=bool)
        rows = max(1, block_elements // max(K, 1))
        for b in range(B):
            for h in range(H):
                for i0 in range(0, Q, rows):
                    i1 = min(Q, i0 + rows)
                    out[b, h, i0:i1] = self.tile(b, i0, i1, 0, K, h=h).any(axis=-1)
        return out

    def _check_index(self, name: str, idx: np.ndarray, size: int) -> None:
        if idx.dtype.kind not in "iu":
            raise RefAttnError(f"{name}: expected integer indices, got dtype {idx.dtype}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= size):
            raise RefAttnError(
                f"{name}: indices must lie in [0, {size}), got range "
                f"[{int(idx.min())}, {int(idx.max())}]"
            )


def _common(values: Sequence[Any], mixed: str) -> Any:
    """The value every term agrees on, else ``mixed``."""
    first = values[0]
    return first if all(v == first for v in values) else mixed


@public
class ComposedRelation(BaseRelation):
    """The union (``op="or"``) or intersection (``op="and"``) of visibility relations.

    Built by ``a | b`` and ``a & b`` on any relations (coordinate relations or compositions);
    nested operations of the same kind are flattened (``a | b | c`` has three terms). The
    terms keep their coordinates: the composition is evaluated term by term at the indices
    asked for (:meth:`mask_mod`, :meth:`tile`), never through a dense matrix, and compiled
    kernels receive the leaves and a postfix :meth:`program`.

    Every term must have the same Q and K; its batch and head axes are 1 (shared) or the
    composition's (the largest among the terms). Nesting is at most :data:`MAX_DEPTH` deep.

    Parameters
    ----------
    op : {"or", "and"}
    terms : sequence of BaseRelation
        At least two.

    Raises
    ------
    RefAttnError
        On an unknown op, fewer than two terms, a term that is not a relation, terms whose
        Q, K, batch or head axes disagree (naming the term), or nesting deeper than
        :data:`MAX_DEPTH`.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.masks import relation
    >>> pos = np.arange(6)[None]
    >>> window = relation(pos, pos, causal=True, window=(1, 0))        # 1 key before the query
    >>> first = relation(pos, pos, causal=True, key_valid=pos < 2)      # the first 2 tokens
    >>> streaming = window | first                                       # StreamingLLM
    >>> streaming.dense()[0, 0].astype(int).tolist()[5]
    [1, 1, 0, 0, 1, 1]
    >>> streaming.manifest()["op"], [t["topology"] for t in streaming.manifest()["terms"]]
    ('or', ['causal', 'causal'])
    >>> streaming.program().tolist()   # leaf 0, leaf 1, OR
    [0, 1, -2]
    """

    def __init__(self, op: Op, terms: Sequence[BaseRelation]) -> None:
        if op not in ("or", "and"):
            raise RefAttnError(f"op: expected 'or' or 'and', got {op!r}")
        flat: list[BaseRelation] = []
        for n, term in enumerate(terms):
            if not isinstance(term, BaseRelation):
                raise RefAttnError(
                    f"visible: term {n} of the {_NAMES[op]} is a {type(term).__name__}, "
                    "expected a VisibilityRelation or a composition of them"
                )
            if isinstance(term, ComposedRelation) and term.op == op:
                flat.extend(term.terms)  # associative: (a | b) | c == a | b | c
            else:
                flat.append(term)
        if len(flat) < 2:
            raise RefAttnError(f"terms: a {_NAMES[op]} needs at least two relations, "
                               f"got {len(flat)}")
        self.op: Op = op
        self.terms: tuple[BaseRelation, ...] = tuple(flat)
        Q, K = flat[0].shape[2:]
        B = max(t.shape[0] for t in flat)
        H = max(t.shape[1] for t in flat)
        for n, t in enumerate(flat):
            tb, th, tq, tk = t.shape
            if (tq, tk) != (Q, K) or tb not in (1, B) or th not in (1, H):
                raise RefAttnError(
                    f"visible: term {n} of the {_NAMES[op]} has shape (B, H, Q, K) = "
                    f"{list(t.shape)}, which does not broadcast with {[B, H, Q, K]} (Q and K "
                    "must be equal; B and H must be 1 or the largest)"
                )
        self.shape = (B, H, Q, K)
        if self.depth > MAX_DEPTH:
            raise RefAttnError(
                f"visible: compositions nest {self.depth} deep, at most {MAX_DEPTH} (compiled "
                "kernels evaluate them with a fixed stack); flatten the expression"
            )

    def __repr__(self) -> str:
        sep = " | " if self.op == "or" else " & "
        return "(" + sep.join(repr(t) if isinstance(t, ComposedRelation)
                              else f"<relation {t.topology} {list(t.shape)}>"
                              for t in self.terms) + ")"

    @property
    def depth(self) -> int:
        """Nesting depth: 1 for a composition of coordinate relations."""
        return 1 + max((t.depth if isinstance(t, ComposedRelation) else 0) for t in self.terms)

    # -- labels -----------------------------------------------------------------------------------
    @property
    def layout(self) -> str:  # type: ignore[override]
        """The terms' layout when they agree, else ``"composed"``."""
        return _common([t.layout for t in self.terms], "composed")

    @property
    def alignment(self) -> str:  # type: ignore[override]
        """The terms' alignment when they agree, else ``"composed"``."""
        return _common([t.alignment for t in self.terms], "composed")

    @property
    def window_convention(self) -> str | None:  # type: ignore[override]
        """The window convention of the terms that have a window (None when none has)."""
        given = [t.window_convention for t in self.terms if t.window_convention is not None]
        return _common(given, "composed") if given else None

    @property
    def head_sharing(self) -> Literal["shared", "per_head"]:
        return "per_head" if any(t.head_sharing == "per_head" for t in self.terms) else "shared"

    @property
    def topology(self) -> str:
        return "composed"

    # -- evaluation -------------------------------------------------------------------------------
    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
        """Evaluate the composition at broadcastable index arrays, term by term.

        Examples
        --------
        >>> import numpy as np
        >>> from refattn.masks import causal
        >>> both = causal(3, 3, alignment="upper_left") & causal(3, 3, alignment="lower_right")
        >>> both.mask_mod(0, 0, 1, np.arange(3)).tolist()
        [True, True, False]
        """
        B, H, Q, K = self.shape
        b, h, i, j = (np.asarray(x) for x in (b, h, q_idx, kv_idx))
        for name, idx, size in (("b", b, B), ("h", h, H), ("q_idx", i, Q), ("kv_idx", j, K)):
            self._check_index(name, idx, size)
        combine: Callable[[np.ndarray, np.ndarray], np.ndarray] = (
            np.logical_or if self.op == "or" else np.logical_and)
        out = None
        for t in self.terms:
            tb = b if t.shape[0] > 1 else np.zeros_like(b)  # a shared axis reads index 0
            th = h if t.shape[1] > 1 else np.zeros_like(h)
            value = t.mask_mod(tb, th, i, j)
            out = value if out is None else combine(out, value)
        shape = np.broadcast_shapes(b.shape, h.shape, i.shape, j.shape)
        return np.broadcast_to(cast(np.ndarray, out), shape).copy()  # set: >= 2 terms

    def leaves(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for t in self.terms:
            out.extend(t.leaves())
        return tuple(out)

    def program(self) -> np.ndarray:
        code = AND if self.op == "and" else OR
        prog: list[int] = []
        offset = 0
        for n, t in enumerate(self.terms):
            prog.extend(int(x) + offset if x >= 0 else int(x) for x in t.program())
            offset += len(t.leaves())
            if n:
                prog.append(code)
        return np.array(prog, dtype=np.int64)

    # -- manifest ---------------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description: the op and each term's own manifest.

        Examples
        --------
        >>> from refattn.masks import causal
        >>> m = (causal(2, 3, alignment="upper_left") | causal(2, 3, alignment="lower_right"))
        >>> rec = m.manifest()
        >>> rec["schema"], rec["op"], rec["alignment"], len(rec["terms"])
        ('visibility_composition_v1', 'or', 'composed', 2)
        """
        return {
            "schema": "visibility_composition_v1",
            "semantic_polarity": "true_means_legal",
            "op": self.op,
            "shape": list(self.shape),
            "layout": self.layout,
            "alignment": self.alignment,
            "topology": self.topology,
            "head_sharing": self.head_sharing,
            "window_convention": self.window_convention,
            "terms": [t.manifest() for t in self.terms],
        }


_NAMES = {"or": "union", "and": "intersection"}

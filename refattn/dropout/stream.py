"""The portable attention-dropout stream: Philox4x32-10 draws mapped onto (b, h, i, j).

Owns the draw-to-coordinate mapping, the integer keep decision and the multiplier Z; this module is
the single source of truth that the numba backend and the CUDA kernel re-implement bit for bit.
Defers the generator itself to :mod:`refattn.dropout.philox`, the statistics of the multiplier to
:mod:`refattn.dropout.moments` and alternative placements to :mod:`refattn.dropout.variants`.

Mapping ``refattn-philox-dropout-v1`` (docs/ARCHITECTURE.md, "Portable dropout stream"). For element
``(b, h, i, j)`` of a ``(B, Hq, Q, K)`` call, with dropout probability ``p``, 64-bit unsigned seed
``s`` and 32-bit unsigned offset ``o``::

    counter   = (j >> 2, i, b * Hq + h, o)                  four uint32 words
    key       = (s & 0xffffffff, s >> 32)                   two uint32 words
    word      = philox4x32_10(counter, key)[j & 3]          one uint32
    threshold = round_half_even(p * 2**32)                  integer in [0, 2**32 - 1]
    keep      = word >= threshold                           unsigned integer compare
    Z         = 1.0 / (1.0 - p) if keep else 0.0            two correctly rounded binary64 ops

So one Philox call serves four consecutive keys ``4g .. 4g+3`` of one query row; key ``j`` reads
output word ``j & 3`` (word 0 is the first word Random123 returns). ``p * 2**32`` is exact in
binary64, so the threshold is the round-half-to-even of an exact number (C: ``nearbyint``/
``rint`` in the default rounding mode; Python: ``round``). ``p`` must be in [0, 1) and small enough
that the threshold fits in 32 bits (``p < 1 - 2**-33``); ``p = 0`` gives threshold 0, every
element kept and ``Z = 1.0`` exactly. The keep probability is ``1 - threshold / 2**32``, within
``2**-33`` of ``1 - p``. Every coordinate is an independent function of its own counter, so any
tile order, tile shape, vector width or language regenerates the same mask.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.dropout.philox import philox4x32_10
from refattn.errors import RefAttnError
from refattn.records import float_record

__all__ = ["ALGORITHM", "MAPPING", "MAPPING_VERSION", "Philox", "from_manifest", "philox4x32_10"]

ALGORITHM = "philox4x32-10"
MAPPING_VERSION = "refattn-philox-dropout-v1"
MAPPING = (
    "counter=(j>>2, i, b*Hq+h, offset); key=(seed & 0xffffffff, seed >> 32); "
    "word=philox4x32_10(counter, key)[j & 3]; threshold=round_half_even(p * 2**32); "
    "keep iff word >= threshold (uint32 compare); Z = keep ? 1.0/(1.0-p) : 0.0 (binary64)"
)

_U32 = 1 << 32
_MAX_P = 1.0 - 2.0**-33  # smallest p whose threshold would be 2**32 (does not fit in 32 bits)
_CHUNK_CALLS = 1 << 18  # Philox calls generated at once (bounds the uint64 temporaries)


def _integer(name: str, value: object, upper: int) -> int:
    """A Python int in [0, upper) (bool and floats rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RefAttnError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    out = int(value)
    if not 0 <= out < upper:
        raise RefAttnError(f"{name}: expected an integer in [0, {upper:#x}), got {out}")
    return out


def _probability(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RefAttnError(f"p: expected a real dropout probability, got {type(value).__name__}")
    p = float(value)
    if not (0.0 <= p < 1.0):  # also rejects NaN
        raise RefAttnError(f"p: expected a dropout probability in [0, 1), got {p!r}")
    if p >= _MAX_P:
        raise RefAttnError(
            f"p: {p!r} rounds to threshold 2**32, which does not fit in a uint32 compare; "
            f"expected p < 1 - 2**-33"
        )
    return p


@public
@dataclass(frozen=True)
class Philox:
    """Replayable inverted attention dropout drawn from Philox4x32-10 by coordinates.

    Implements :class:`refattn.call.MultiplierSource`; pass it as ``AttentionCall(dropout=...)``.
    The mapping (module docstring) fixes which 32-bit word every element ``(b, h, i, j)``
    consumes, so any backend or tiling regenerates the same mask from ``(p, seed, offset)``.

    Parameters
    ----------
    p : float
        Dropout probability in [0, 1) (``p = 0`` gives ``Z = 1`` exactly).
    seed : int
        64-bit unsigned seed in [0, 2**64); the low word is key word 0, the high word key word 1.
    offset : int
        32-bit unsigned counter word 3, in [0, 2**32): advance it to draw a fresh stream for
        another call with the same seed.

    Attributes
    ----------
    threshold : int
        ``round(p * 2**32)``; an element is kept iff its word is ``>= threshold``.
    keep_multiplier : float
        ``1.0 / (1.0 - p)``, the value of Z on kept elements.

    Raises
    ------
    RefAttnError
        On a non-integer or out-of-range seed or offset, or p outside [0, 1 - 2**-33).

    Examples
    --------
    >>> stream = Philox(0.25, seed=2026)
    >>> stream.threshold, stream.keep_multiplier
    (1073741824, 1.3333333333333333)
    >>> z = stream.multiplier(1, 2, 3, 5)
    >>> z.shape, sorted(set(z.ravel().tolist()))
    ((1, 2, 3, 5), [0.0, 1.3333333333333333])
    >>> bool((stream.multiplier_block(0, 1, 1, 3, 2, 5, Hq=2) == z[0, 1, 1:3, 2:5]).all())
    True
    """

    p: float
    seed: int
    offset: int = 0
    threshold: int = field(init=False, repr=False)
    keep_multiplier: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = _probability(self.p)
        object.__setattr__(self, "p", p)
        object.__setattr__(self, "seed", _integer("seed", self.seed, 1 << 64))
        object.__setattr__(self, "offset", _integer("offset", self.offset, _U32))
        object.__setattr__(self, "threshold", round(p * _U32))  # exact product; half to even
        object.__setattr__(self, "keep_multiplier", 1.0 / (1.0 - p))

    # -- generation ----------------------------------------------------------------------
    @property
    def key(self) -> np.ndarray:
        """(2,) uint32 ndarray: ``(seed & 0xffffffff, seed >> 32)``."""
        return np.array([self.seed & 0xFFFFFFFF, self.seed >> 32], dtype=np.uint32)

    def _keep(self, bh: np.ndarray, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """keep for rows ``bh`` (flat b*Hq+h), queries [i0, i1), keys [j0, j1): (n, Qt, Kt).

        Generated in chunks of at most ``_CHUNK_CALLS`` Philox calls (bounded temporaries); every
        element depends only on its own coordinates, so chunking cannot change the result.
        """
        n = bh.shape[0]
        keep = np.zeros((n, i1 - i0, j1 - j0), dtype=bool)
        if n == 0 or i1 == i0 or j1 == j0:
            return keep
        g0, g1 = j0 >> 2, (j1 + 3) >> 2  # the Philox calls whose words cover [j0, j1)
        rows_per_chunk = max(1, _CHUNK_CALLS // (g1 - g0))  # query rows per chunk
        for r0 in range(0, n * (i1 - i0), rows_per_chunk):  # flat (bh, i) row index
            r1 = min(r0 + rows_per_chunk, n * (i1 - i0))
            flat = np.arange(r0, r1, dtype=np.int64)
            counter = np.empty((r1 - r0, g1 - g0, 4), dtype=np.uint32)  # (rows, G, 4)
            counter[..., 0] = np.arange(g0, g1, dtype=np.uint32)  # j >> 2
            counter[..., 1] = (i0 + flat % (i1 - i0)).astype(np.uint32)[:, None]  # i
            counter[..., 2] = bh[flat // (i1 - i0)].astype(np.uint32)[:, None]  # b * Hq + h
            counter[..., 3] = self.offset
            words = philox4x32_10(counter, self.key)  # (rows, G, 4): word j & 3 of call j >> 2
            words = words.reshape(r1 - r0, 4 * (g1 - g0))  # column c is key 4 * g0 + c
            words = words[:, j0 - 4 * g0 : j1 - 4 * g0]  # (rows, Kt)
            # integer compare, no floats
            keep.reshape(-1, j1 - j0)[r0:r1] = words >= np.uint32(self.threshold)
        return keep

    def keep_block(
        self, b: int, h: int, i0: int, i1: int, j0: int, j1: int, *, Hq: int
    ) -> np.ndarray:
        """Keep decisions of one tile, generated from coordinates alone.

        Parameters
        ----------
        b, h : int
            Batch and query-head index of the tile.
        i0, i1 : int
            Query rows ``[i0, i1)``.
        j0, j1 : int
            Keys ``[j0, j1)``; need not be aligned to the 4-key groups of one Philox call.
        Hq : int
            Number of query heads of the call (fixes the counter word ``b * Hq + h``).

        Returns
        -------
        (i1 - i0, j1 - j0) bool ndarray
            Equal to ``keep_mask(B, Hq, Q, K)[b, h, i0:i1, j0:j1]`` for any B > b, Q >= i1,
            K >= j1.

        Examples
        --------
        >>> Philox(0.5, 7).keep_block(0, 0, 0, 1, 0, 6, Hq=1).shape
        (1, 6)
        """
        Hq = _integer("Hq", Hq, _U32)
        b = _integer("b", b, _U32)
        h = _integer("h", h, _U32)
        if Hq == 0 or h >= Hq:
            raise RefAttnError(f"h: head {h} is outside [0, Hq={Hq})")
        if b * Hq + h >= _U32:
            raise RefAttnError(f"b, h: counter word b*Hq+h = {b * Hq + h} does not fit in 32 bits")
        i0, i1 = _integer("i0", i0, _U32), _integer("i1", i1, _U32 + 1)
        j0, j1 = _integer("j0", j0, 4 * _U32), _integer("j1", j1, 4 * _U32 + 1)
        if i1 < i0 or j1 < j0:
            raise RefAttnError(
                f"block: expected i0 <= i1 and j0 <= j1, got [{i0}, {i1}) x [{j0}, {j1})"
            )
        return self._keep(np.array([b * Hq + h], dtype=np.int64), i0, i1, j0, j1)[0]

    def multiplier_block(
        self, b: int, h: int, i0: int, i1: int, j0: int, j1: int, *, Hq: int
    ) -> np.ndarray:
        """Z of one tile: ``keep_multiplier`` where kept, ``0.0`` where dropped.

        Returns
        -------
        (i1 - i0, j1 - j0) float64 ndarray

        Examples
        --------
        >>> z = Philox(0.0, 1).multiplier_block(0, 0, 0, 2, 0, 3, Hq=1)
        >>> z.tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
        """
        keep = self.keep_block(b, h, i0, i1, j0, j1, Hq=Hq)
        return np.where(keep, self.keep_multiplier, 0.0)

    def keep_mask(self, B: int, Hq: int, Q: int, K: int) -> np.ndarray:
        """Keep decisions of a whole ``(B, Hq, Q, K)`` call.

        Returns
        -------
        (B, Hq, Q, K) bool ndarray

        Raises
        ------
        RefAttnError
            If a coordinate would not fit its 32-bit counter word.

        Examples
        --------
        >>> m = Philox(0.5, 99).keep_mask(2, 1, 2, 4)
        >>> m.shape, m.dtype
        ((2, 1, 2, 4), dtype('bool'))
        """
        B = _integer("B", B, _U32 + 1)
        Hq = _integer("Hq", Hq, _U32 + 1)
        Q = _integer("Q", Q, _U32 + 1)
        K = _integer("K", K, 4 * _U32 + 1)
        if B * Hq > _U32:
            raise RefAttnError(f"B, Hq: B*Hq = {B * Hq} rows exceed the 32-bit counter word")
        keep = self._keep(np.arange(B * Hq, dtype=np.int64), 0, Q, 0, K)  # (B*Hq, Q, K)
        return keep.reshape(B, Hq, Q, K)

    def multiplier(self, B: int, Hq: int, Q: int, K: int) -> np.ndarray:
        """The dropout multiplier Z of a whole call (the MultiplierSource protocol).

        Returns
        -------
        (B, Hq, Q, K) float64 ndarray
            ``keep_multiplier`` where kept, ``0.0`` where dropped.

        Examples
        --------
        >>> Philox(0.0, 5).multiplier(1, 1, 1, 2).tolist()
        [[[[1.0, 1.0]]]]
        """
        return np.where(self.keep_mask(B, Hq, Q, K), self.keep_multiplier, 0.0)

    # -- provenance ----------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        """JSON-serialisable description of the stream (what a replay needs).

        Seed, offset and threshold are decimal strings (64-bit integers do not survive every
        JSON reader); ``p`` is a float and also recorded as C99 hex.

        Examples
        --------
        >>> m = Philox(0.1, 2**63 + 5, offset=3).manifest()
        >>> m["algorithm"], m["seed"], m["offset"], m["mapping_version"], m["p"]
        ('philox4x32-10', '9223372036854775813', '3', 'refattn-philox-dropout-v1', 0.1)
        >>> Philox.from_manifest(m) == Philox(0.1, 2**63 + 5, offset=3)
        True
        """
        return {
            "algorithm": ALGORITHM,
            "seed": str(self.seed),
            "offset": str(self.offset),
            "mapping_version": MAPPING_VERSION,
            "mapping": MAPPING,
            "p": self.p,
            "p_hex": self.p.hex(),
            "threshold": str(self.threshold),
            "keep_multiplier": float_record(self.keep_multiplier),
            "rng_provenance": "philox4x32-10 counter stream, replayed by coordinates",
        }

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> Philox:
        """Rebuild the stream recorded by :meth:`manifest` (refusing other algorithms)."""
        if manifest.get("algorithm") != ALGORITHM:
            raise RefAttnError(
                f"dropout manifest: algorithm {manifest.get('algorithm')!r} is not {ALGORITHM!r}"
            )
        if manifest.get("mapping_version") != MAPPING_VERSION:
            raise RefAttnError(
                f"dropout manifest: mapping_version {manifest.get('mapping_version')!r} is not "
                f"{MAPPING_VERSION!r}"
            )
        try:
            p = float.fromhex(manifest["p_hex"]) if "p_hex" in manifest else manifest["p"]
            return cls(p, int(manifest["seed"]), offset=int(manifest["offset"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RefAttnError(f"dropout manifest: cannot rebuild the stream ({exc})") from None


@public
def from_manifest(record: dict[str, Any]) -> Philox:
    """Rebuild the stream recorded in a manifest's dropout section (``mode == "stream"``).

    Extra keys of the call manifest (location, training, ...) are ignored; the algorithm and
    mapping version must match this module's.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> x = np.zeros((1, 1, 2, 4))
    >>> call = refattn.AttentionCall(x, x, x, dropout=Philox(0.5, 2**40 + 1))
    >>> from_manifest(call.manifest()["dropout"])
    Philox(p=0.5, seed=1099511627777, offset=0)
    """
    return Philox.from_manifest(record)

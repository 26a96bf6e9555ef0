"""Scale placement: where the one logit multiplier alpha is applied.

Owns the four placements of the contract ("Scale placement and fused APIs") -- ``post``
(``(q k^T) alpha``), ``q`` (``(alpha q) k^T``), ``k`` (``q (alpha k)^T``) and ``split``
(``(sqrt(alpha) q)(sqrt(alpha) k)^T``) -- their manifest record and the declared tolerance under
which they agree. The arithmetic is :mod:`refattn.engine.reference`'s; the contract's
"Scale-placement validation gate" that compares placements is :mod:`refattn.analysis.scale_gate`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

from refattn.errors import RefAttnError
from refattn.records import float_record

__all__ = [
    "PLACEMENTS",
    "PLACEMENT_ATOL",
    "PLACEMENT_RTOL",
    "OperandMultipliers",
    "ScalePlacement",
    "operand_multipliers",
    "placement_record",
]

ScalePlacement = Literal["post", "q", "k", "split"]
PLACEMENTS: tuple[str, ...] = ("post", "q", "k", "split")
_PLACEMENT_NAMES = {
    "post": "post_qk_product",
    "q": "pre_query",
    "k": "pre_key",
    "split": "split_sqrt_query_and_key",
}

#: Declared float64 tolerance under which the four placements agree (outputs and gradients
#: of O(1) inputs). Pre-scaling rounds the operands, post-scaling rounds the accumulator, so
#: the placements are not bitwise equal; the measured worst difference on the tests' random
#: calls is below 1e-14, and every failure mode the gate exists for is above 1e-3.
PLACEMENT_RTOL = 1e-12
PLACEMENT_ATOL = 1e-12


class OperandMultipliers(NamedTuple):
    """Multipliers applied to the query, the key and the product (their product is alpha)."""

    query: float
    key: float
    post: float


def operand_multipliers(alpha: float, placement: ScalePlacement) -> OperandMultipliers:
    """Where alpha goes for one placement; the multiplier is applied exactly once in total.

    Examples
    --------
    >>> operand_multipliers(0.25, "split")
    OperandMultipliers(query=0.5, key=0.5, post=1.0)
    >>> operand_multipliers(0.25, "post")
    OperandMultipliers(query=1.0, key=1.0, post=0.25)
    """
    match placement:
        case "post":
            return OperandMultipliers(1.0, 1.0, alpha)
        case "q":
            return OperandMultipliers(alpha, 1.0, 1.0)
        case "k":
            return OperandMultipliers(1.0, alpha, 1.0)
        case "split":
            root = math.sqrt(alpha)  # sqrt(alpha) on each side, NOT alpha on each side
            return OperandMultipliers(root, root, 1.0)
        case _:
            raise RefAttnError(
                f"scale_placement: expected one of {list(PLACEMENTS)}, got {placement!r}"
            )


def placement_record(alpha: float, placement: ScalePlacement, *, width: int) -> dict[str, Any]:
    """Manifest fields for the multiplier's placement.

    ``width`` is the feature width Dk; the record's ``width`` is Dk when alpha is exactly
    ``Dk ** -0.5`` and None otherwise (an explicit, non-canonical multiplier).

    Examples
    --------
    >>> r = placement_record(0.5, "split", width=4)
    >>> r["placement"], r["width"], r["operand_multipliers"]["query"]["decimal"]
    ('split_sqrt_query_and_key', 4, '0.7071067811865476')
    """
    m = operand_multipliers(alpha, placement)
    return {
        "placement": _PLACEMENT_NAMES[placement],
        "requested_placement": placement,
        "semantics": "multiplicative_inverse_temperature",
        "effective_logit_multiplier": float_record(alpha),
        "operand_multipliers": {"query": float_record(m.query), "key": float_record(m.key),
                                "post": float_record(m.post)},
        "applied_times": 1,
        "width": int(width) if float(width) ** -0.5 == alpha else None,
    }

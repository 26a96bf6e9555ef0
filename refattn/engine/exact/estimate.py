"""How long the exact backend takes: its up-front estimate, without python-flint.

Owns :func:`estimate_seconds` and its two constants, which :mod:`refattn.engine.exact.backend`
applies before any arithmetic and the golden writers use to refuse, before any work, a bundle
the exact generator would take too long to write. Imports nothing that needs python-flint, so
code that only estimates (the suites, the writers' checks, the GPU path) never loads it.
"""

from __future__ import annotations

from typing import cast

from refattn.call import AttentionCall
from refattn.call.scores import Additive, ScoreFamily

__all__ = ["DEFAULT_MAX_SECONDS", "SECONDS_PER_ELEMENT", "estimate_seconds"]

#: measured cost of one correctly rounded element (AMD EPYC, 2 cores; benchmarks/exact.py)
SECONDS_PER_ELEMENT = 4e-6
#: default limit of the estimated forward+backward time of one call
DEFAULT_MAX_SECONDS = 600.0


def estimate_seconds(call: AttentionCall) -> float:
    """Estimated forward+backward time of ``call`` on this backend.

    Four correctly rounded elements per score element (B, Hq, Q, K; times the inner width
    Da for the additive family) plus one per element of the q, k, v-shaped tensors, at
    :data:`SECONDS_PER_ELEMENT` each (measured by ``benchmarks/exact.py``).

    Examples
    --------
    >>> import numpy as np, refattn
    >>> x = np.zeros((1, 2, 128, 64))
    >>> round(estimate_seconds(refattn.AttentionCall(x, x, x)), 1)
    0.8
    """
    a = call.axes
    n = a["B"] * a["Hq"] * a["Q"] * a["K"]
    fam = cast(ScoreFamily, call.score)  # validated: never None
    width = cast(Additive, fam).b.shape[1] if fam.name == "additive" else 1
    rows = a["B"] * a["Hq"] * (a["Q"] * (a["Dk"] + a["Dv"]) + a["K"] * (a["Dk"] + a["Dv"]))
    return SECONDS_PER_ELEMENT * (4 * n * width + rows)



"""Shared inputs of the scale-placement tests (tests/call) and the scale gate's (tests/analysis).

Alpha is ``Dk ** -0.5`` with Dk = 12: not a power of two, so moving it changes rounding (Dk = 16
would not); ``D_MODEL`` is the model width a buggy caller might use instead of Dk.
"""

from __future__ import annotations

import numpy as np

B, Hq, Hkv, Q, K, Dk, Dv = 2, 4, 2, 5, 7, 12, 3
D_MODEL = 48
ALPHA = Dk ** -0.5


def qkv(seed: int = 0, dk: int = Dk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded q (B, Hq, Q, dk), k (B, Hkv, K, dk), v (B, Hkv, K, Dv)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Q, dk)), rng.standard_normal((B, Hkv, K, dk)),
            rng.standard_normal((B, Hkv, K, Dv)))

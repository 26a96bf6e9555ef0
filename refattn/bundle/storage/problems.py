"""One failure found in a bundle: which case, which tensor, at which stage, and why.

Owns :class:`Problem` and the :data:`Stage` names. The readers of this room fill problems
(a file's checksums, its header); :mod:`refattn.bundle.verification` adds its own and prints
them all. Holds no logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Problem", "Stage"]

Stage = Literal["bundle", "file", "tensor", "recompute", "manifest", "gradcheck", "certificate"]


@dataclass(frozen=True)
class Problem:
    """One failure: which case, which tensor (if any), at which stage, and why."""

    case_id: str | None
    tensor: str | None
    stage: Stage
    reason: str

    def __str__(self) -> str:
        where = f"case={self.case_id or '-'} tensor={self.tensor or '-'}"
        return f"FAIL {where} [{self.stage}]: {self.reason}"

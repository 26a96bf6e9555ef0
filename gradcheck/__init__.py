"""gradcheck: an autograd-free gradient checker for any NumPy function.

This first version provides central differences; the full checker (complex step, Richardson
extrapolation, directional mode, reports) builds on it.
"""

from __future__ import annotations

from gradcheck.finite_difference import central_difference

__all__ = ["central_difference"]

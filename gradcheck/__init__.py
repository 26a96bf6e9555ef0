"""gradcheck: an autograd-free gradient checker for any NumPy function.

``check_vjp(fn, vjp, inputs)`` compares a hand-written vector-Jacobian product with numeric
derivatives (complex step when ``fn`` is complex-safe, else Richardson central differences),
element by element (``mode="full"``) or along random signed Gaussian directions
(``mode="directional"``), with tolerances built from the numeric error estimate; it returns a
:class:`Report` that explains every failure. ``assert_gradients`` is the pytest form;
``taylor_test`` and ``attention_identities`` are second opinions; :mod:`gradcheck.attention`
exposes refattn's own forward/backward as ``fn``/``vjp``.

Two parts with one-way imports: the generic checker (``api``, ``methods``, ``directional``,
``finite_difference``, ``report``, ``taylor``, ``errors``; bad input raises
:class:`GradcheckError`) imports nothing from refattn, so refattn's ``verify`` may use it; the
attention part (``attention``, ``identities``, ``mutations``) wraps refattn's engine and sits
beside :mod:`refattn.analysis`. This ``__init__`` is the façade over both; the attention part is
imported on first use, so that importing gradcheck (or its generic checker, or
:mod:`gradcheck._boundary`, which refattn's own boundary uses) never imports refattn.

Examples
--------
>>> import numpy as np
>>> fn = lambda w, x: np.tanh(x @ w)
>>> vjp = lambda g, w, x: {"w": x.T @ (g * (1 - np.tanh(x @ w) ** 2))}
>>> rng = np.random.default_rng(0)
>>> inputs = {"w": rng.standard_normal((3, 2)), "x": rng.standard_normal((4, 3))}
>>> check_vjp(fn, vjp, inputs, wrt=["w"]).passed
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradcheck.api import GradientCheckError, assert_gradients, check_vjp
from gradcheck.errors import GradcheckError
from gradcheck.finite_difference import central_difference
from gradcheck.report import InputReport, Report, ScaleFit, Worst
from gradcheck.taylor import TaylorReport, taylor_test

if TYPE_CHECKING:  # the attention part, imported on first use (it imports refattn)
    from gradcheck.attention import attention_problem, check_attention
    from gradcheck.identities import IdentityReport, attention_identities

#: the attention part's names -> their module
_ATTENTION = {"attention_problem": "attention", "check_attention": "attention",
              "IdentityReport": "identities", "attention_identities": "identities"}

__all__ = [
    "GradcheckError",
    "GradientCheckError",
    "IdentityReport",
    "InputReport",
    "Report",
    "ScaleFit",
    "TaylorReport",
    "Worst",
    "assert_gradients",
    "attention_identities",
    "attention_problem",
    "central_difference",
    "check_attention",
    "check_vjp",
    "taylor_test",
]


def __getattr__(name: str) -> Any:
    if name not in _ATTENTION:
        raise AttributeError(f"module 'gradcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gradcheck.{_ATTENTION[name]}"), name)
    globals()[name] = value
    return value

"""Test support: one AttentionCall, with any of its differentiable inputs, as ``fn``/``vjp`` for
:func:`gradcheck.assert_gradients`.

Differentiable inputs by name: ``q``, ``k``, ``v``, ``bias``, ``sink`` and ``score_<param>``
(the score family's parameters, e.g. ``score_W``). ``fn`` runs the pure, complex-safe
:func:`refattn.engine.reference.forward_arrays` with everything else frozen from the call;
``vjp`` rebuilds a validated call and runs the hand-written ``refattn.backward``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import refattn
from gradcheck import assert_gradients
from refattn import AttentionCall
from refattn.engine.reference import forward_arrays

__all__ = ["assert_call_gradients"]

_CALL_INPUTS = ("q", "k", "v", "bias", "sink")


def _value(call: AttentionCall, name: str) -> np.ndarray:
    if name.startswith("score_"):
        return call.score.parameters()[name[len("score_"):]]
    return getattr(call, name)


def _split(over: dict) -> tuple[dict, dict]:
    direct = {n: x for n, x in over.items() if n in _CALL_INPUTS}
    params = {n[len("score_"):]: x for n, x in over.items() if n.startswith("score_")}
    return direct, params


def _fn(call: AttentionCall):
    def fn(**over: np.ndarray) -> np.ndarray:
        direct, params = _split(over)
        score = call.score.with_arrays(**params) if params else call.score
        kw = {"bias": call.bias, "sink": call.sink, **{n: direct[n] for n in ("bias", "sink")
                                                      if n in direct}}
        return forward_arrays(
            direct.get("q", call.q), direct.get("k", call.k), direct.get("v", call.v),
            head_map=call.head_map, scale=call.scale, visible=call.visible_full(),
            query_valid=call.query_valid_full(), multiplier=call.multiplier_full(),
            score=score, scale_placement=call.scale_placement, softcap=call.softcap, **kw,
        )["output"]

    return fn


def _vjp(call: AttentionCall):
    def vjp(grad_output: np.ndarray, **over: np.ndarray) -> dict[str, np.ndarray]:
        direct, params = _split(over)
        score = dataclasses.replace(call.score, **params) if params else call.score
        rebuilt = AttentionCall(
            direct.get("q", call.q), direct.get("k", call.k), direct.get("v", call.v),
            visible=call.visible, query_valid=call.query_valid,
            bias=direct.get("bias", call.bias), scale=call.scale, head_map=call.head_map,
            dropout=call.multiplier_full(), all_masked_rows=call.all_masked_rows, score=score,
            scale_placement=call.scale_placement, softcap=call.softcap,
            sink=direct.get("sink", call.sink),
        )
        grads = refattn.backward(refattn.forward(rebuilt), grad_output)
        out = {n: getattr(grads, f"grad_{n}") for n in direct}
        out.update({f"score_{n}": grads.grad_score_params[n] for n in params})
        return out

    return vjp


def assert_call_gradients(call: AttentionCall, names, *, seed: int = 0):
    """Check the call's hand-written gradients for ``names`` element by element.

    Requires the exact complex-step method for every input (the forward must stay
    complex-safe) and returns the :class:`gradcheck.Report`.
    """
    inputs = {n: np.asarray(_value(call, n)) for n in names}
    report = assert_gradients(_fn(call), _vjp(call), inputs, mode="full", seed=seed)
    for n in names:
        method = report.inputs[n].method
        assert method == "complex_step", f"{n}: checked by {method}, forward not complex-safe"
    return report

"""Quantised golden cases: a QuantSpec and the kernel's inputs beside a case's real call.

Owns :class:`QuantCase` (the :class:`~refattn.quant.spec.QuantSpec` and the call as the kernel
receives it), :func:`quant_case` (the kernel's call and its real call, the dequantised inputs
of :func:`refattn.quant.pipeline.dequantized_call`, from one set of arrays),
:func:`quant_tensors` (what a quantised case file stores beside the
canonical tensors of its real result) and :func:`kernel_inputs` (the kernel's q, k, v read back
from a case file's codes). Defers the spec, the casts and the emulated pipeline to
:mod:`refattn.quant`; the rest of a case (its real result, the file, the manifest) is
:mod:`refattn.bundle.golden.case`' and :mod:`refattn.bundle.writing.write`'s.

A quantised case file stores, beside the real call's canonical tensors (q, k, v are the
dequantised inputs; output, lse, ..., the gradients as for any case):

================================  =================================================
``quant_<t>_codes``               the codes of input ``t`` (q, k or v) whose spec source is
                                  ``"codes"``, as :func:`refattn.quant.formats.encode` writes
                                  them: uint8 (e4m3fn, e5m2, int8), uint16 (fp16, bf16)
``quant_<t>_scale``               its scale (the descale), float64, shape by granularity
                                  (absent where the kernel computes it: SageAttention)
``quant_<name>_mid``, ``_rad``    midpoint and radius of the emulated pipeline's interval
                                  ``name``: output, lse (where the kernel returns it),
                                  scores, row_max, probs_q, row_sum
================================  =================================================

and its manifest entry records ``quant: {"spec": QuantSpec.to_manifest()}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn.call import AttentionCall
from refattn.errors import RefAttnError
from refattn.quant.bounds import Interval
from refattn.quant.formats import decode, encode
from refattn.quant.pipeline import dequantized_call
from refattn.quant.spec import QuantSpec, TensorQuant, check_quant

__all__ = ["INPUTS", "PREFIX", "QuantCase", "code_dtype", "kernel_inputs", "quant_case",
           "quant_tensor_names", "quant_tensors"]

#: the prefix of every tensor a quantised case stores beside the canonical ones
PREFIX = "quant_"
#: the inputs a spec describes
INPUTS = ("q", "k", "v")


@dataclass(frozen=True, eq=False)
class QuantCase:
    """The quantised side of a golden case.

    Attributes
    ----------
    spec : QuantSpec
        The kernel's pipeline (a preset or a custom spec).
    call : AttentionCall
        The call as the kernel receives it: q, k, v decoded codes (source ``"codes"``) or the
        values the kernel casts itself (source ``"cast"``); see :mod:`refattn.quant.spec`.
    """

    spec: QuantSpec
    call: AttentionCall

    def manifest(self) -> dict[str, Any]:
        """The manifest entry's ``quant`` record."""
        return {"spec": self.spec.to_manifest()}


def quant_case(q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: QuantSpec,
               **call_options: Any) -> tuple[AttentionCall, QuantCase]:
    """The real call and the :class:`QuantCase` of the kernel's inputs ``q, k, v``.

    Parameters
    ----------
    q, k, v : float64 ndarray
        As the kernel receives them ((B, Hq, Q, Dk), (B, Hkv, K, Dk), (B, Hkv, K, Dv)).
    spec : QuantSpec
    **call_options
        The call's other keywords (``visible``, ``scale``), the same for both calls.

    Returns
    -------
    (AttentionCall, QuantCase)
        The real call (dequantised inputs) and the kernel's side.

    Examples
    --------
    >>> from refattn.quant.presets import preset
    >>> x = np.full((1, 1, 2, 4), 2.0)
    >>> real, qc = quant_case(x, x, x, preset("fa3_fp8", v_descale=0.5))
    >>> float(real.v[0, 0, 0, 0]), float(qc.call.v[0, 0, 0, 0])
    (1.0, 2.0)
    """
    kernel = AttentionCall(q, k, v, **call_options)
    check_quant(kernel, spec)
    real = dequantized_call(kernel, spec)  # codes * scale (exact), cast inputs as given
    return AttentionCall(real.q, real.k, real.v, **call_options), QuantCase(spec, kernel)


def code_dtype(fmt: str) -> np.dtype:
    """The dtype of :func:`~refattn.quant.formats.encode`'s codes of format ``fmt``.

    Examples
    --------
    >>> code_dtype("e4m3fn"), code_dtype("bf16")
    (dtype('uint8'), dtype('uint16'))
    """
    return encode(np.zeros(1), fmt).dtype


def quant_tensors(qc: QuantCase, emulated: Mapping[str, Interval]) -> dict[str, np.ndarray]:
    """Every ``quant_*`` tensor of a quantised case (see the module's table), C-contiguous.

    Parameters
    ----------
    qc : QuantCase
    emulated : dict of str to Interval
        :func:`refattn.quant.pipeline.emulate` of ``qc.call`` and ``qc.spec``.

    Examples
    --------
    >>> from refattn.quant.pipeline import emulate
    >>> from refattn.quant.presets import preset
    >>> x = np.full((1, 1, 2, 4), 0.5)
    >>> _, qc = quant_case(x, x, x, preset("fa3_fp8", k_descale=0.25))
    >>> t = quant_tensors(qc, emulate(qc.call, qc.spec))
    >>> t["quant_q_codes"].dtype, float(t["quant_k_scale"]), t["quant_output_mid"].shape
    (dtype('uint8'), 0.25, (1, 1, 2, 4))
    """
    out: dict[str, np.ndarray] = {}
    for name in INPUTS:
        tq: TensorQuant = getattr(qc.spec, name)
        if tq.source == "codes":
            out[f"{PREFIX}{name}_codes"] = encode(np.asarray(getattr(qc.call, name)), tq.format)
        if tq.scale is not None:
            out[f"{PREFIX}{name}_scale"] = np.asarray(tq.scale, dtype=np.float64)
    for name, interval in sorted(emulated.items()):
        out[f"{PREFIX}{name}_mid"] = np.asarray(interval.mid, dtype=np.float64)
        out[f"{PREFIX}{name}_rad"] = np.asarray(interval.rad, dtype=np.float64)
    return {n: np.array(t, order="C") for n, t in out.items()}  # 0-d stays 0-d


def quant_tensor_names(names: Any) -> list[str]:
    """The ``quant_*`` names among ``names``, sorted.

    Examples
    --------
    >>> quant_tensor_names(["q", "quant_q_codes", "output"])
    ['quant_q_codes']
    """
    return sorted(n for n in names if n.startswith(PREFIX))


def kernel_inputs(spec: QuantSpec, tensors: Mapping[str, np.ndarray], case_id: str
                  ) -> dict[str, np.ndarray]:
    """The kernel's q, k, v read back from a case file: a ``"codes"`` tensor decoded from
    ``quant_<t>_codes``; a ``"cast"`` tensor is the stored input itself. Every scale tensor the
    spec has must be stored and equal the spec's bit for bit; codes must have their format's
    code dtype and the input's shape.

    Raises
    ------
    RefAttnError
        Naming the case and the tensor that is missing, of the wrong dtype or shape, or (a
        scale) different from the manifest's spec, with the first differing index.
    """
    out: dict[str, np.ndarray] = {}
    for name in INPUTS:
        tq: TensorQuant = getattr(spec, name)
        if name not in tensors:
            raise RefAttnError(f"{case_id}: tensor {name!r} is missing")
        if tq.scale is not None:
            sname = f"{PREFIX}{name}_scale"
            s = tensors.get(sname)
            if s is None:
                raise RefAttnError(f"{case_id}: tensor {sname!r} is missing (the spec's "
                                   f"{name} has a scale)")
            if s.dtype != np.float64 or s.shape != tq.scale.shape:
                raise RefAttnError(f"{case_id}: tensor {sname!r}: expected float64 "
                                   f"{list(tq.scale.shape)}, got {s.dtype} {list(s.shape)}")
            differs = np.ascontiguousarray(s).view(np.uint64) != np.ascontiguousarray(
                tq.scale).view(np.uint64)
            if differs.any():
                idx = tuple(int(i) for i in np.argwhere(differs)[0])
                raise RefAttnError(f"{case_id}: tensor {sname!r} at index {idx}: "
                                   f"{float(s[idx])!r} differs from the manifest spec's "
                                   f"{float(tq.scale[idx])!r}")
        if tq.source != "codes":
            out[name] = np.asarray(tensors[name])
            continue
        cname = f"{PREFIX}{name}_codes"
        codes = tensors.get(cname)
        if codes is None:
            raise RefAttnError(f"{case_id}: tensor {cname!r} is missing (the spec's {name} is "
                               f"read as {tq.format} codes)")
        want = code_dtype(tq.format)
        if codes.dtype != want or codes.shape != tensors[name].shape:
            raise RefAttnError(f"{case_id}: tensor {cname!r}: expected {want} "
                               f"{list(tensors[name].shape)} ({tq.format} codes of {name}), "
                               f"got {codes.dtype} {list(codes.shape)}")
        out[name] = decode(codes, tq.format)
    return out

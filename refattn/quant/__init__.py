"""Quantised attention (FP8, INT8): the kernel's pipeline emulated exactly beside the real result.

Owns the quantisation description of a call (formats, scales, granularity, rounding, P's
handling, accumulation precision, output dtype; presets named for the kernels that follow them),
the bit-exact casts of each format, rigorous bounds on low-precision accumulations, and the
emulated pipeline whose output is an interval per element. Imports from :mod:`refattn.engine`,
:mod:`refattn.call` and below; never from :mod:`refattn.bundle`, :mod:`refattn.testing` or the
CLI, which use it.
"""

from refattn.quant.bounds import Interval
from refattn.quant.check import QuantReport, check_candidate
from refattn.quant.diagnosis import diagnose
from refattn.quant.formats import FORMATS, ROUNDINGS
from refattn.quant.pipeline import QuantResult, dequantized_call, quantized
from refattn.quant.presets import PRESETS, preset
from refattn.quant.spec import QuantSpec, TensorQuant, check_quant

__all__ = [
    "FORMATS",
    "PRESETS",
    "ROUNDINGS",
    "Interval",
    "QuantReport",
    "QuantResult",
    "QuantSpec",
    "TensorQuant",
    "check_candidate",
    "check_quant",
    "dequantized_call",
    "diagnose",
    "preset",
    "quantized",
]

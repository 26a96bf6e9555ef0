"""The tensor-core kernels on each architecture's code path (issue 43, deliverable 3): every
instance, forward, dq and dk/dv, built for the sm_80 path (``REFATTN_EMU_ARCH=800``: pairs of
mma.m8n8k4) and for the sm_90 one (900: one m16n8k4 per 16-row step, m8n8k4 where a warp has
8 rows), against the NumPy reference.

``tile.cuh`` (``refattn_mma_rows``) is the one place where the code paths part:
``REFATTN_MMA_ARCH >= 900`` and MR = 2 issue ``refattn_mma_m16n8k4`` (mma_m16n8k4.cuh), every
other case MR ``refattn_mma_m8n8k4`` (mma_m8n8k4.cuh) sharing the B fragment. The emulator
compiles the same sources with ``-DREFATTN_EMU_ARCH`` (gpu_backend/emulator/build.py), so an
sm_80 build runs exactly the instructions an A100 would.

:data:`CONFIGS` are eight calls whose kernel choice (``launch.plan``: feature set and the
device's shared memory) together runs every tensor-core instance of ``source.KERNELS``
(general, plain and wide): a test pins the instances each call runs and that their union is
all of them. Each call has lengths that straddle the tiles at both ends and more than one
block and tile in each direction (70 queries x 75 keys at D <= 128: blocks of 32 or 64 rows,
tiles of 16 to 32 rows; 45 x 37 at D = 256: 32-row blocks, 8- and 16-row tiles), GQA (2 query
heads on 1 kv head) and a causal mask (skipped, partial and full tiles). The general calls add
a softcap and Philox dropout (the instances compiled with every feature), the plain ones have
neither.

Tolerance: :func:`run_config` gives each direction's error over its bound (<= 1 passes): the
forward's output and lse within 1e-12 kappa of their largest element and 1e-13 kappa normwise,
each gradient within 1e-12 kappa of its natural magnitude (tests/engine_compare.py), kappa as
in tests/gpu/test_emulator.py. tests/gpu/test_arch_planted.py runs the same calls on planted
fragment bugs and shows each caught by several of these checks.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import numpy as np
import pytest

import refattn
from gpu_backend import launch
from gpu_backend.emulator.module import EmulatedModule
from gpu_backend.emulator_backend import EmulatorDevice
from gpu_backend.source import KERNEL_DIR, KERNELS
from refattn.dropout import Philox
from refattn.masks import causal
from tests.engine_compare import natural_scales

H100_SHARED = 232448  # the opt-in limit of an H100/H200 block (the wide instances fit)
A100_SHARED = 166912  # an A100's (sm_80): the general instances where a wide one would run
ARCHS = (800, 900)
DIRECTIONS = ("forward", "dq", "dkdv")
#: name -> (head width, "plain" or "general" call, the device's shared memory per block)
CONFIGS: dict[str, tuple[int, str, int]] = {
    "d32": (32, "general", H100_SHARED),
    "d64-plain": (64, "plain", H100_SHARED),
    "d64": (64, "general", H100_SHARED),
    "d128-plain": (128, "plain", H100_SHARED),
    "d128-wide": (128, "general", H100_SHARED),
    "d128": (128, "general", A100_SHARED),
    "d256-plain": (256, "plain", H100_SHARED),
    "d256": (256, "general", A100_SHARED),
}
#: the instances each config runs (forward, dq, dkdv), as launch.plan picks them
EXPECTED: dict[str, tuple[str, str, str]] = {
    "d32": ("attention_forward_d32", "attention_dq_d32", "attention_dkdv_d32"),
    "d64-plain": ("attention_forward_plain_d64", "attention_dq_plain_d64",
                  "attention_dkdv_plain_d64"),
    "d64": ("attention_forward_d64", "attention_dq_d64", "attention_dkdv_d64"),
    "d128-plain": ("attention_forward_plain_d128", "attention_dq_plain_d128",
                   "attention_dkdv_plain_d128"),
    "d128-wide": ("attention_forward_d128", "attention_dq_wide_d128", "attention_dkdv_d128"),
    "d128": ("attention_forward_d128", "attention_dq_d128", "attention_dkdv_d128"),
    "d256-plain": ("attention_forward_plain_d256", "attention_dq_plain_d256",
                   "attention_dkdv_wide_d256"),
    "d256": ("attention_forward_d256", "attention_dq_d256", "attention_dkdv_d256"),
}
NORMWISE, ELEMENTWISE = 1e-13, 1e-12
_HELPERS = ("attention_row_dot_output", "attention_trace_forward", "attention_trace_backward")


class ArchDevice(EmulatorDevice):
    """An emulated device: ``module`` (any arch, any source copy) and a shared-memory limit,
    recording the kernels it launches (a :class:`gpu_backend.launch.Device`)."""

    def __init__(self, module: EmulatedModule, max_shared_bytes: int) -> None:
        self.module, self.max_shared_bytes = module, max_shared_bytes
        self.name = f"the emulator (arch {module.arch}, {max_shared_bytes} bytes of shared)"
        self.compile_options = (module.path.name,)
        self.kernels: list[str] = []

    def get_function(self, name: str) -> Any:
        self.kernels.append(name)
        return self.module.get_function(name)

    def describe(self) -> dict[str, Any]:
        return {"kind": "cuda_emulator", "arch": self.module.arch}


def config_call(name: str) -> tuple[refattn.AttentionCall, np.ndarray]:
    """The call and the output gradient of config ``name`` (deterministic)."""
    D, features, _ = CONFIGS[name]
    Q, K = (45, 37) if D == 256 else (70, 75)
    rng = np.random.default_rng(D + (features == "plain"))
    extra: dict[str, Any] = {}
    if features == "general":
        extra = {"softcap": 3.0, "dropout": Philox(0.2, 2**33 + D)}
    call = refattn.AttentionCall(rng.standard_normal((1, 2, Q, D)),
                                 rng.standard_normal((1, 1, K, D)),
                                 rng.standard_normal((1, 1, K, D)),
                                 visible=causal(Q, K, alignment="upper_left"), **extra)
    return call, rng.standard_normal((1, 2, Q, D))


@cache
def reference(name: str) -> tuple[dict[str, np.ndarray], dict[str, float], float]:
    """The NumPy reference's tensors, natural magnitudes and kappa of config ``name``."""
    call, g_o = config_call(name)
    ref = refattn.forward(call)
    rg = refattn.backward(ref, g_o)
    s = np.abs(ref.scores[np.isfinite(ref.scores)])
    kappa = max(1.0, (s.max() if s.size else 0.0) / 16)
    want = {"output": ref.output, "lse": ref.lse, "grad_q": rg.grad_q, "grad_k": rg.grad_k,
            "grad_v": rg.grad_v}
    return want, natural_scales(call, ref, rg), kappa


def _ratio(name: str, got: np.ndarray, want: np.ndarray, natural: dict[str, float],
           kappa: float) -> float:
    """The error of one tensor over its bound (inf where the finite supports differ)."""
    fin = np.isfinite(want)
    if got.shape != want.shape or not np.array_equal(np.isfinite(got), fin):
        return float("inf")
    d = np.abs(got[fin] - want[fin])
    if name.startswith("grad_"):
        return float(d.max(initial=0.0) / (ELEMENTWISE * kappa * max(natural[name], 1e-300)))
    norm = np.linalg.norm(want[fin]) or 1.0
    scale = np.abs(want[fin]).max(initial=0.0) or 1.0
    return float(max(np.linalg.norm(d) / (NORMWISE * kappa * norm),
                     d.max(initial=0.0) / (ELEMENTWISE * kappa * scale)))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One config's run: each direction's error over its bound (inf: a launch raised, with
    ``error`` its message) and the instances launched, in order."""

    ratios: dict[str, float]
    kernels: tuple[str, ...]
    error: str = ""

    def failed(self) -> list[str]:
        """The directions whose check fails."""
        return [d for d in DIRECTIONS if not self.ratios[d] <= 1.0]


def run_config(module: EmulatedModule, name: str) -> Outcome:
    """Forward and backward of config ``name`` (streaming) on ``module``, checked."""
    call, g_o = config_call(name)
    device = ArchDevice(module, CONFIGS[name][2])
    want, natural, kappa = reference(name)
    try:
        trace = launch.forward(device, call, materialize=False)
        grads = launch.backward(device, trace, g_o)
    except refattn.RefAttnError as exc:  # a planted bug may trip the emulator's detectors
        return Outcome(dict.fromkeys(DIRECTIONS, float("inf")), tuple(device.kernels),
                       str(exc))
    got = {"output": trace.output, "lse": trace.lse, "grad_q": grads.grad_q,
           "grad_k": grads.grad_k, "grad_v": grads.grad_v}
    r = {n: _ratio(n, got[n], want[n], natural, kappa) for n in want}
    ratios = {"forward": max(r["output"], r["lse"]), "dq": r["grad_q"],
              "dkdv": max(r["grad_k"], r["grad_v"])}
    return Outcome(ratios, tuple(k for k in device.kernels if k not in _HELPERS))


def run_all(module: EmulatedModule,
            names: tuple[str, ...] = tuple(CONFIGS)) -> dict[str, Outcome]:
    """Every config (or ``names``) on ``module``."""
    return {name: run_config(module, name) for name in names}


def failures(outcomes: dict[str, Outcome]) -> list[str]:
    """The failing checks of a run of the configs, as ``"config/direction"``."""
    return [f"{name}/{d}" for name, o in outcomes.items() for d in o.failed()]


@cache
def honest(arch: int) -> dict[str, Outcome]:
    """The configs on the unmodified kernels built for ``arch`` (release build, cached)."""
    return run_all(EmulatedModule(KERNEL_DIR, arch=arch))


CASES = [(arch, name, d) for arch in ARCHS for name in CONFIGS for d in DIRECTIONS]


@pytest.mark.parametrize(("arch", "name", "direction"), CASES,
                         ids=[f"sm{a // 10}-{n}-{d}" for a, n, d in CASES])
def test_every_instance_matches_the_reference_on_each_arch_path(arch, name, direction):
    outcome = honest(arch)[name]
    assert not outcome.error, outcome.error
    assert outcome.ratios[direction] <= 1.0, (arch, name, outcome.ratios)
    # not vacuous: the tensors differ from the reference in the last bits somewhere
    assert max(outcome.ratios.values()) > 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_the_configs_run_every_tensor_core_instance(arch):
    launched = {name: o.kernels for name, o in honest(arch).items()}
    assert launched == EXPECTED
    every = {k for k in KERNELS if k not in _HELPERS}
    assert {k for ks in launched.values() for k in ks} == every

"""Planted bugs on each architecture-specific path of the fp64 tensor-core fragments, each
caught by more than one check (issue 43, deliverable 3).

A bug is planted in a copy of the kernel sources in a temporary folder (never in
gpu_backend/kernels), the emulator is built from the copy for the architecture whose path
carries the bug, and the checks of tests/gpu/test_arch_paths.py (eight calls that together run
every tensor-core instance, each checked in three directions: forward, dq, dk/dv) run on it.
Each planted bug must fail at least two of those checks, in at least two calls, while the
unmodified kernels (test_arch_paths.py) pass all of them: the same mechanism as the planted
P.V fragment bug of tests/gpu/test_emulator_mma.py (``test_a_wrong_fragment_index_is_caught``),
extended from one sm_90 forward call to every instance and both paths.

The plants (PTX ISA fragment layouts as the mma_*.cuh headers state them; g = lane >> 2,
t = lane & 3):

- ``m8n8k4-a-rows``: mma_m8n8k4.cuh takes A from lane ^ 4 (rows g and g ^ 1 of A exchanged):
  the sm_80 path everywhere, and sm_90 where a warp has 8 rows of its own (MR = 1 without a
  warp pair: the D = 256 instances; the D = 128 ones pair two 8-row warps into 16 rows and
  issue m16n8k4);
- ``m8n8k4-b-cols``: mma_m8n8k4.cuh takes B from lane ^ 4 (columns g and g ^ 1 of B);
- ``sm80-pair-rows``: tile.cuh's sm_80 branch gives each of the pair of m8n8k4 the other's A
  rows (a[MR - 1 - mr]): only the sm_80 path with 16-row warps;
- ``m16n8k4-a-rows``: mma_m16n8k4.cuh exchanges a0 and a1 (rows g and g + 8): only sm_90;
- ``m16n8k4-b-cols``: mma_m16n8k4.cuh takes B from lane ^ 4;
- ``m16n8k8-a-rows``: mma_m16n8k8.cuh exchanges a2 and a3 (rows g and g + 8 at k = t + 4).
  attention.cu issues no m16n8k8 today, so its checks are the probe kernels of
  tests/gpu/test_emulator_mma.py (random fragments against exact rationals, both roundings,
  and the one-hot layout check), plus the attention checks once a kernel calls it.

A bug on one path is invisible to the other's build: the m16n8k4 plant on the sm_80 build and
the sm_80 pair plant on the sm_90 build pass every check, which shows that the arch switch
(``REFATTN_EMU_ARCH``) selects the path. Builds are the release emulator (-O2), one per plant
and arch, cached by source hash like every other build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gpu_backend.emulator.module import EmulatedModule
from gpu_backend.source import KERNEL_DIR
from tests.gpu.test_arch_paths import CONFIGS, Outcome, failures, honest, run_all
from tests.gpu.test_emulator_mma import PROBE, SHAPES, _oracle, _run

_M8 = "    ::emu::mma_f64(8, 4, &a, &b, c);\n"
_M16 = "    ::emu::mma_f64(16, 4, a, &b, c);\n"
_M16K8 = "    ::emu::mma_f64(16, 8, a, b, c);\n"
_PAIR = "for (int mr = 0; mr < MR; ++mr) refattn_mma_m8n8k4(c + 2 * mr, a[mr], b);"
_SHFL = "    {0} = __shfl_xor_sync(0xffffffffu, {0}, 4);  // planted: lane ^ 4\n"

#: plant -> (file, text, replacement)
PLANTS: dict[str, tuple[str, str, str]] = {
    "m8n8k4-a-rows": ("mma_m8n8k4.cuh", _M8, _SHFL.format("a") + _M8),
    "m8n8k4-b-cols": ("mma_m8n8k4.cuh", _M8, _SHFL.format("b") + _M8),
    "sm80-pair-rows": ("tile.cuh", _PAIR, _PAIR.replace("a[mr]", "a[MR - 1 - mr]")),
    "m16n8k4-a-rows": ("mma_m16n8k4.cuh", _M16,
                       "    const double planted[2] = {a[1], a[0]};\n"
                       "    ::emu::mma_f64(16, 4, planted, &b, c);\n"),
    "m16n8k4-b-cols": ("mma_m16n8k4.cuh", _M16, _SHFL.format("b") + _M16),
    "m16n8k8-a-rows": ("mma_m16n8k8.cuh", _M16K8,
                       "    const double planted[4] = {a[0], a[1], a[3], a[2]};\n"
                       "    ::emu::mma_f64(16, 8, planted, b, c);\n"),
}
#: (plant, arch) -> the checks expected: "caught" (>= 2 checks in >= 2 calls) or "blind"
#: (every check passes: the plant is on the other arch's path)
CASES: dict[tuple[str, int], str] = {
    ("m8n8k4-a-rows", 800): "caught",
    ("m8n8k4-a-rows", 900): "caught",  # D = 256 (8-row warps, MR = 1, no pairs)
    ("m8n8k4-b-cols", 800): "caught",
    ("sm80-pair-rows", 800): "caught",
    ("sm80-pair-rows", 900): "blind",
    ("m16n8k4-a-rows", 900): "caught",
    ("m16n8k4-a-rows", 800): "blind",
    ("m16n8k4-b-cols", 900): "caught",
}


def planted(tmp: Path, plant: str, base: Path = KERNEL_DIR) -> Path:
    """A copy of ``base`` in ``tmp`` with ``plant`` applied (its text present exactly once: a
    plant that no longer applies to the sources fails loudly)."""
    file, old, new = PLANTS[plant]
    d = tmp / plant
    shutil.copytree(base, d)
    text = (d / file).read_text()
    assert text.count(old) == 1, f"{plant}: {old!r} is not once in {file}"
    (d / file).write_text(text.replace(old, new))
    return d


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[tuple[str, int], dict[str, Outcome]]:
    tmp = tmp_path_factory.mktemp("plants")
    dirs = {plant: planted(tmp, plant) for plant in {p for p, _ in CASES}}
    return {(plant, arch): run_all(EmulatedModule(dirs[plant], arch=arch))
            for plant, arch in CASES}


@pytest.mark.parametrize(("plant", "arch"), sorted(CASES), ids=[f"{p}-sm{a // 10}"
                                                                 for p, a in sorted(CASES)])
def test_each_planted_fragment_bug_is_caught_by_several_checks(outcomes, plant, arch):
    assert failures(honest(arch)) == []  # the same checks pass on the unmodified kernels
    failed = failures(outcomes[(plant, arch)])
    calls = {f.split("/")[0] for f in failed}
    if CASES[(plant, arch)] == "blind":
        assert failed == [], failed
    else:
        assert len(failed) >= 2 and len(calls) >= 2, failed


def test_the_sm80_path_alone_is_covered_at_every_head_width(outcomes):
    """The issue's finding: an A-row swap on the sm_80 path alone failed 1 of 313 tests. The
    sm_80 plants now fail a check at every head width, in every direction somewhere."""
    for plant in ("m8n8k4-a-rows", "sm80-pair-rows"):
        failed = failures(outcomes[(plant, 800)])
        widths = {CONFIGS[f.split("/")[0]][0] for f in failed}
        directions = {f.split("/")[1] for f in failed}
        if plant == "sm80-pair-rows":  # 16-row warps only: MR = 2 at D <= 64 and plain 128
            assert {32, 64, 128} <= widths, failed
        else:
            assert widths == {32, 64, 128, 256}, failed
        assert directions == {"forward", "dq", "dkdv"}, failed


# -- the m16n8k8 wrapper: the probe kernels (and the attention checks once a kernel uses it) --
def _probe_checks(module: EmulatedModule, rounding: str) -> list[str]:
    """The probe checks of tests/gpu/test_emulator_mma.py that fail on ``module``."""
    failed = []
    for shape, (M, K) in SHAPES.items():
        rng = np.random.default_rng(M * 100 + K)
        A, B, C = (rng.standard_normal(s) * 2.0 ** rng.integers(-30, 30, s)
                   for s in ((M, K), (K, 8), (M, 8)))
        if not np.array_equal(_run(module, shape, A, B, C), _oracle(A, B, C, rounding)):
            failed.append(f"{shape}/random-{rounding}")
        if rounding == "chain":  # the one-hot layout check (one k, n at a time)
            A = np.arange(1.0, M * K + 1).reshape(M, K)
            ok = True
            for k in range(K):
                for n in range(8):
                    B = np.zeros((K, 8))
                    B[k, n] = 1.0
                    want = np.full((M, 8), 0.5)
                    want[:, n] += A[:, k]
                    ok &= np.array_equal(_run(module, shape, A, B, np.full((M, 8), 0.5)), want)
            if not ok:
                failed.append(f"{shape}/layout")
    return failed


def _probe_dir(tmp: Path, kernels: Path) -> Path:
    d = tmp / f"probe-{kernels.name}"
    d.mkdir()
    for header in kernels.glob("*.cuh"):
        shutil.copy(header, d)
    (d / "attention.cu").write_text(PROBE)
    return d


def test_a_planted_m16n8k8_bug_is_caught_by_several_checks(tmp_path):
    plant = "m16n8k8-a-rows"
    bad = planted(tmp_path, plant)
    results = {}
    for name, kernels in (("honest", KERNEL_DIR), (plant, bad)):
        probe = _probe_dir(tmp_path, kernels)
        results[name] = [f for r in ("chain", "exact")
                         for f in _probe_checks(EmulatedModule(probe, mma=r, threads=1), r)]
    assert results["honest"] == []
    assert len(results[plant]) >= 2, results[plant]
    assert all(f.startswith("m16n8k8/") for f in results[plant])  # the other shapes untouched
    used = any("refattn_mma_m16n8k8(" in p.read_text() for p in KERNEL_DIR.glob("*.cu*")
               if p.name != "mma_m16n8k8.cuh")
    if used:  # a kernel issues m16n8k8 (sm_90): the attention checks must see the plant too
        assert failures(run_all(EmulatedModule(bad, arch=900))), plant

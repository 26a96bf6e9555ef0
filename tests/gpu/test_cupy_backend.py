"""The "cupy" backend: a clear error without CuPy or a device; on a GPU, the conformance suite
against the reference (the same checks as the emulator's, same tolerance)."""

from __future__ import annotations

import json
import os
import struct
import sys
import types
from unittest import mock

import numpy as np
import pytest

import refattn
from refattn.bundle.suites import build_suite
from tests.gpu.test_emulator import DOT_CASES, assert_matches_reference


def test_without_cupy_the_error_says_what_to_install(monkeypatch):
    from gpu_backend import cupy_backend

    monkeypatch.setitem(sys.modules, "cupy", None)  # import fails
    cupy_backend.device.cache_clear()
    x = np.ones((1, 1, 2, 4))
    with pytest.raises(refattn.RefAttnError, match=r"cupy-cuda13x.*cuda_emulator"):
        refattn.forward(refattn.AttentionCall(x, x, x), backend="cupy")
    cupy_backend.device.cache_clear()


class _FakeRawModule:  # CuPy 14: RawModule(code=None, *, path=None, options=(), ...)
    def __init__(self, code=None, *, path=None, options=()):
        assert (code is None) != (path is None)  # mutually exclusive
        self.code, self.path, self.options = code, path, options


def _fake_cupy(free: int, pooled: int) -> types.ModuleType:
    """What CupyDevice asks of CuPy 14, without a device (the names and return types of
    cupy.cuda.runtime.getDeviceProperties, memGetInfo and MemoryPool.free_bytes)."""
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, memGetInfo=lambda: (free, 10 * free),
        getDeviceProperties=lambda i: {"name": b"Fake H200", "major": 9, "minor": 0,
                                       "sharedMemPerBlock": 49152,
                                       "sharedMemPerBlockOptin": 232448})
    pool = types.SimpleNamespace(free_bytes=lambda: pooled)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda: types.SimpleNamespace(id=0))
    cupy.RawModule = _FakeRawModule
    cupy.get_default_memory_pool = lambda: pool
    return cupy


def test_the_cupy_module_text_carries_the_hash_of_every_kernel_file(monkeypatch):
    """CuPy's disk cache keys a build on the module text and options, not on the headers the
    text includes: without the hash an edited .cuh would load the stale cubin."""
    from gpu_backend import cupy_backend
    from gpu_backend.source import KERNEL_DIR, source_hash

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=1000, pooled=500))
    monkeypatch.delenv(cupy_backend.CUBIN_DIR_ENV, raising=False)  # compiled, not prebuilt
    dev = cupy_backend.CupyDevice()
    assert source_hash(KERNEL_DIR) in dev.module.code.splitlines()[0]
    assert dev.module.code.endswith((KERNEL_DIR / "attention.cu").read_text())
    assert dev.module.options == cupy_backend.COMPILE_OPTIONS == dev.compile_options
    assert dev.max_shared_bytes == 232448  # the opt-in limit, not sharedMemPerBlock
    assert dev.describe() == {"kind": "cupy", "name": "Fake H200", "compute_capability": "9.0"}


def test_free_device_memory_counts_the_pools_unused_blocks(monkeypatch):
    """memGetInfo counts the blocks CuPy's pool keeps after a call as taken; the pool hands
    them out again (and frees them before it reports out of memory)."""
    from gpu_backend import cupy_backend

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=1000, pooled=500))
    assert cupy_backend.CupyDevice().free_bytes() == 1500


def _built(tmp_path, *, source_hash=None, arch="sm_90"):
    """A cubin directory as compile_check --cubin-dir writes it (write_cubin), from a fake
    compile of the package's kernels."""
    from gpu_backend import compile_check
    from gpu_backend.source import KERNEL_DIR

    report = compile_check.CompileReport(arch, "nvcc", 0.0, {}, (), b"\x7fELF fake cubin")
    key = (arch, str(KERNEL_DIR.resolve()), compile_check.source_hash(KERNEL_DIR))
    # the fake report for this call only: a real compile already cached (the compile-check
    # tests') is put back after, so later tests do not compile the kernels again
    with mock.patch.dict(compile_check._REPORTS, {key: report}):
        cubin = compile_check.write_cubin(arch, tmp_path / "cubins")
    if source_hash is not None:  # a record of other sources
        record = json.loads(cubin.with_suffix(".json").read_text())
        record["source_hash"] = source_hash
        cubin.with_suffix(".json").write_text(json.dumps(record))
    return cubin


def test_compile_check_writes_the_cubin_and_its_record(tmp_path):
    from gpu_backend.source import KERNEL_DIR, source_hash

    cubin = _built(tmp_path)
    assert cubin.name == "attention.sm_90.cubin" and cubin.read_bytes() == b"\x7fELF fake cubin"
    assert json.loads(cubin.with_suffix(".json").read_text()) == {
        "source_hash": source_hash(KERNEL_DIR), "arch": "sm_90", "tool": "nvcc"}
    assert sorted(p.name for p in cubin.parent.iterdir()) == [
        "attention.sm_90.cubin", "attention.sm_90.json"]  # no temporary file left


def test_a_prebuilt_cubin_is_loaded_instead_of_compiling(tmp_path, monkeypatch):
    """REFATTN_CUBIN_DIR: the module is the cubin's path (CuPy loads it; NVRTC never runs)."""
    from gpu_backend import cupy_backend

    cubin = _built(tmp_path)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=1000, pooled=0))
    monkeypatch.setenv(cupy_backend.CUBIN_DIR_ENV, str(cubin.parent))
    dev = cupy_backend.CupyDevice()
    assert dev.module.path == str(cubin) and dev.module.code is None
    assert dev.compile_options == ("prebuilt cubin", str(cubin))


@pytest.mark.parametrize("problem,match", [
    ("other sources", "built from other kernel sources"),
    ("other arch", "record says arch 'sm_80', expected 'sm_90'"),
    ("missing", "no attention.sm_90.cubin with its record"),
    ("bad record", "is unreadable"),
])
def test_a_cubin_that_does_not_match_is_refused(tmp_path, monkeypatch, problem, match):
    from gpu_backend import cupy_backend

    cubin = _built(tmp_path, source_hash="0" * 64 if problem == "other sources" else None)
    if problem == "other arch":
        other = _built(tmp_path, arch="sm_80")
        other.rename(cubin)
        other.with_suffix(".json").rename(cubin.with_suffix(".json"))
    elif problem == "missing":
        cubin.unlink()
    elif problem == "bad record":
        cubin.with_suffix(".json").write_text("{not json")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=1000, pooled=0))
    monkeypatch.setenv(cupy_backend.CUBIN_DIR_ENV, str(cubin.parent))
    with pytest.raises(refattn.RefAttnError, match=match) as err:
        cupy_backend.CupyDevice()
    assert "compile_check --arch sm_90 --cubin-dir" in str(err.value)


def _cubin_sections(cubin: bytes) -> list[str]:
    """Section names of an ELF64 (cubin) image."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    strtab = headers[shstrndx][4]
    return [cubin[strtab + h[0]:cubin.index(b"\0", strtab + h[0])].decode() for h in headers]


@pytest.mark.skipif(os.environ.get("REFATTN_NVRTC_CHECK") != "1",
                    reason="set REFATTN_NVRTC_CHECK=1 (about 90 s of NVRTC, no device needed)")
def test_nvrtc_compiles_every_kernel_the_launcher_names():
    """attention.cu through CuPy 14's NVRTC pipeline as RawModule runs it (CuPy's own options
    added: C++ standard, CCCL and CUDA include paths, -ftz=true,
    --device-as-default-execution-space), for sm_90 without a device; every kernel of
    source.KERNELS is an entry point of the cubin."""
    pytest.importorskip("cupy")
    from cupy._core import core
    from cupy.cuda import compiler

    from gpu_backend import cupy_backend
    from gpu_backend.source import KERNELS

    options = core.assemble_cupy_compiler_options(cupy_backend.COMPILE_OPTIONS)
    options += ("-ftz=true", *compiler._get_extra_include_dir_opts(), "-arch=sm_90",
                "--device-as-default-execution-space")
    prog = compiler._NVRTCProgram(cupy_backend.module_source(), "", (), (), method="cubin")
    cubin, _ = prog.compile(options)
    sections = set(_cubin_sections(bytes(cubin)))
    assert not [k for k in KERNELS if f".text.{k}" not in sections]


def _gpu() -> None:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except Exception as exc:  # no driver
        pytest.skip(f"no CUDA device ({exc})")


@pytest.mark.gpu
@pytest.mark.parametrize("materialize", [True, False], ids=["trace", "streaming"])
def test_the_conformance_suite_on_the_gpu(materialize):
    _gpu()
    for case_id, case in sorted(DOT_CASES.items()):
        t = refattn.forward(case.call, backend="cupy", materialize=materialize)
        g = refattn.backward(t, case.grad_output)
        assert_matches_reference(case.call, case.grad_output, t, g, case_id)
        again = refattn.backward(refattn.forward(case.call, backend="cupy",
                                                 materialize=materialize), case.grad_output)
        assert all(np.array_equal(a, b) for a, b in zip(g.tensors().values(),
                                                        again.tensors().values(), strict=True))


@pytest.mark.gpu
def test_non_dot_families_are_refused_on_the_gpu():
    _gpu()
    case = next(c for c in build_suite("conformance") if c.call.score.name != "dot")
    with pytest.raises(refattn.RefAttnError, match="dot family only"):
        refattn.forward(case.call, backend="cupy")

"""Bad input to the GPU path is refused before any launch, with a RefAttnError naming the
limit: head widths without a kernel instance, shared memory beyond the device's per-block
limit, shapes past the kernels' 32-bit index range, kernel arguments that are not C-contiguous.
The host planning code (gpu_backend.launch) is checked directly and through the emulator."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import refattn
from gpu_backend import launch
from gpu_backend.emulator_backend import EmulatorDevice
from gpu_backend.source import INSTANCES, KERNEL_DIR, KERNELS

A100_SHARED = 166912  # sharedMemPerBlockOptin of an A100 (163 KiB)
H100_SHARED = 232448  # of an H100 / H200 (227 KiB)


def test_the_instance_table_matches_the_entry_points():
    src = (KERNEL_DIR / "attention.cu").read_text()
    entries = re.findall(r'void attention_(\w+)_d(\d+)\(REFATTN_ARGS\) \{ refattn_\1<(\d+), '
                         r'(\d+), (\d+)(?:, \w+)*>', src)
    table = {(k, int(d)): (int(mr), int(tile)) for k, d, dd, mr, tile in entries
             if int(d) == int(dd)}
    assert len(table) == len(entries)
    assert table == {(k, D): v for k, dims in INSTANCES.items() for D, v in dims.items()}
    assert {f"attention_{k}_d{D}" for k, D in table} <= set(KERNELS)


@pytest.mark.parametrize(("Dk", "Dv", "D"), [(1, 1, 32), (32, 32, 32), (33, 8, 64),
                                             (8, 100, 128), (128, 128, 128), (129, 8, 256),
                                             (200, 256, 256)])
def test_widths_pad_up_to_the_next_instance(Dk, Dv, D):
    assert launch.plan("forward", Dk, Dv, H100_SHARED).D == D


def test_every_instance_fits_an_a100_and_a_smaller_device_is_refused_naming_the_limit():
    for kind, dims in INSTANCES.items():
        for D in dims:
            assert launch.shared_bytes(kind, D) <= A100_SHARED < H100_SHARED, (kind, D)
    # the dk/dv kernel at D = 256 keeps dV and half of dK (1.5 x 32 x 256 doubles) and two
    # buffers of Q and G_O (4 x 8 x 256): 163840 bytes, by hand; a device with 99 KiB per block
    # (sm_86, sm_89) is refused before any launch
    assert launch.shared_bytes("dkdv", 256) == 8 * (32 * 256 + 16 * 256 + 4 * 8 * 256) == 163840
    with pytest.raises(refattn.RefAttnError, match=r"dkdv kernel at head width D=256 "
                                                   r"\(Dk=200, Dv=256\) needs 163840 bytes.*"
                                                   r"allows 101376"):
        launch.plan("dkdv", 200, 256, 101376, "an RTX 4090")


def test_a_width_without_an_instance_is_refused():
    with pytest.raises(refattn.RefAttnError, match=r"Dk=300, Dv=8 have no forward kernel "
                                                   r"instance.*\[32, 64, 128, 256\]"):
        launch.plan("forward", 300, 8, H100_SHARED)
    with pytest.raises(refattn.RefAttnError, match=r"Dk=8, Dv=257 have no backward kernel "
                                                   r"instance"):
        launch.plan("dkdv", 8, 257, H100_SHARED)


SMALL_SHARED = 101376  # sharedMemPerBlockOptin of an RTX 4090 / sm_89 (99 KiB)


def test_shared_memory_beyond_the_device_limit_is_refused():
    with pytest.raises(refattn.RefAttnError,
                       match=r"dkdv kernel at head width D=128 \(Dk=100, Dv=128\) needs "
                             r"163840 bytes of shared memory per block; a small GPU allows "
                             r"101376"):
        launch.plan("dkdv", 100, 128, SMALL_SHARED, "a small GPU")


class _SmallDevice(EmulatorDevice):
    max_shared_bytes = SMALL_SHARED


def test_the_emulator_refuses_what_its_device_cannot_hold_before_any_launch():
    # a softcap call runs the general instance at D = 128 (104 KiB: warp pairs, 16-key tiles,
    # the exp table);
    # a plain call's instance there (96 KiB, 8-key tiles) fits this device and runs
    x = np.random.default_rng(0).standard_normal((1, 1, 5, 100))
    call = refattn.AttentionCall(x, x, x, softcap=2.5)
    with pytest.raises(refattn.RefAttnError, match=r"needs 106496 bytes.*allows 101376"):
        launch.forward(_SmallDevice(), call, materialize=False)
    plain = launch.forward(_SmallDevice(), refattn.AttentionCall(x, x, x), materialize=False)
    assert plain.materialized["kernel"] == "attention_forward_plain_d128"


def test_a_padded_width_runs_and_matches():
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((1, 2, 20, 70)) for _ in range(2))
    v = rng.standard_normal((1, 2, 20, 3))  # Dv != Dk: both padded to 128
    call = refattn.AttentionCall(q, k, v)
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    assert t.materialized["kernel"] == "attention_forward_plain_d128" and t.output.shape[-1] == 3
    np.testing.assert_allclose(t.output, refattn.forward(call).output, rtol=1e-13, atol=1e-14)


def _fake_call(**axes):
    full = {"B": 1, "Hq": 1, "Hkv": 1, "Q": 8, "K": 8, "Dk": 4, "Dv": 4} | axes
    return SimpleNamespace(score=SimpleNamespace(name="dot"), axes=full)


@pytest.mark.parametrize(("axes", "message"), [
    ({"Q": 2**31 - 200}, r"Q = 2147483448 exceeds the kernels' 32-bit tile-local index range "
                         r"\(at most 2147483391"),
    ({"K": 2**31}, r"K = 2147483648 exceeds the kernels' 32-bit"),
    ({"B": 300, "Hq": 300}, r"B \* Hq = 90000 exceeds the kernels' grid range \(65535"),
])
def test_shapes_past_the_index_range_are_refused(axes, message):
    # a stand-in for the call: arrays of these shapes would not fit this machine's memory
    with pytest.raises(refattn.RefAttnError, match=message):
        launch._check_shapes(_fake_call(**axes), EmulatorDevice)


def test_a_non_contiguous_kernel_argument_is_refused_before_the_launch():
    dev = EmulatorDevice()
    L = launch._Launch(dev)
    L.slots["OUT"] = np.zeros((4, 6))[:, ::2]  # a strided view

    def never(*args, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("launched")

    dev.get_function = lambda name: never  # type: ignore[method-assign]
    with pytest.raises(refattn.RefAttnError, match="kernel argument OUT: not a C-contiguous"):
        L.run("attention_forward_d32", (1, 1), 128, 1024)


def test_shared_memory_past_the_device_at_launch_is_refused():
    dev = EmulatorDevice()
    L = launch._Launch(dev)
    with pytest.raises(refattn.RefAttnError, match=r"exceed cuda_emulator's limit of 232448"):
        L.run("attention_forward_d32", (1, 1), 128, 232449)


def test_the_kernels_static_shared_memory_counts_against_the_limit():
    """A CuPy function reports its __shared__ variables (RawKernel.shared_size_bytes): dynamic
    shared memory that fits alone but not beside them is refused before the launch."""
    dev = EmulatorDevice()
    L = launch._Launch(dev)
    launched = []

    class Function:  # as CuPy's RawKernel: static shared bytes, the launch a call
        shared_size_bytes = 336

        def __call__(self, *args, **kwargs):
            launched.append(args)

    dev.get_function = lambda name: Function()  # type: ignore[method-assign]
    with pytest.raises(refattn.RefAttnError,
                       match=r"232200 bytes of dynamic and 336 of static shared memory per "
                       r"block exceed cuda_emulator's limit of 232448"):
        L.run("attention_forward_d32", (1, 1), 128, 232448 - 248)
    assert launched == []

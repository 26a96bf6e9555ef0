"""BLAS providers load their library only when one of theirs runs: listing the providers (the
fingerprint, a cached calibration) must not put ``mkl_rt`` and its OpenMP runtime into the
process, where torch imported afterwards would bind its own ``dgemm_`` and ``GOMP_parallel`` to
them (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from refattn.engine.numba import providers

ROOT = Path(__file__).resolve().parents[2]


def test_address_and_threads_load_the_library_on_first_use_only():
    loads = []

    def load():
        loads.append(1)
        return providers.Library(1234, set_threads=None, get_threads=None)

    p = providers.Provider("fake", "1.0", load=load)
    q = p.with_layout("blas", 2 << 20)
    assert loads == [] and q.key == "fake/blas/2" and q.record()["version"] == "1.0"
    assert q.address == 1234 and loads == [1]  # the layout copy shares the loader
    assert p == providers.Provider("fake", "1.0", load=lambda: None)  # loader not compared


def test_openblas_provider_is_the_scipy_dgemm():
    from refattn.engine.numba.blas import dgemm_address

    assert providers.available_providers()[0].name == "openblas"
    assert providers.available_providers()[0].address == dgemm_address()


@pytest.mark.skipif(providers._find(("mkl_rt",)) is None, reason="no mkl wheel installed")
def test_listing_the_providers_leaves_mkl_unloaded():
    script = ("from pathlib import Path\n"
              "from refattn.engine.numba import providers\n"
              "names = [p.name for p in providers.available_providers()]\n"
              "providers.fingerprint()\n"
              "maps = Path('/proc/self/maps').read_text()\n"
              "print('mkl' in names, 'libmkl' in maps, 'libiomp5' in maps)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300, check=True).stdout.split()
    assert out == ["True", "False", "False"], out

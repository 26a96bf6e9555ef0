"""The CPU emulator of the CUDA execution model, for running the kernels without a GPU.

Owns the C++20 header that implements threads, blocks, barriers, shared memory, warp shuffles
and atomics on CPU fibers (``cuda_emu.h``), the build of the ``.cu`` sources into a shared
library with the system C++ compiler, cached by source hash (:mod:`~.build`), and a ctypes
launcher with CuPy's ``RawModule``/``RawKernel`` call shape (:mod:`~.module`), so one host
program drives both. It imports refattn only for its error type.
"""

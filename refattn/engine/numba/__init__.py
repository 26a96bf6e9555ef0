"""The ``numba`` backend: fused row kernels and streaming tile kernels on CPU threads.

Owns the backend module (:mod:`~refattn.engine.numba.backend`, registered as ``"numba"``) and
its ``@njit`` kernels: dense row passes (:mod:`~refattn.engine.numba.kernels`), streaming
tiles (:mod:`~refattn.engine.numba.stream`, :mod:`~refattn.engine.numba.tiles`), row
primitives, strided operand readers, the Philox port and the BLAS bridge. Kernel modules import
nothing from refattn outside this package, so :mod:`~refattn.engine.numba._jit` can key their
on-disk cache on this package's source alone; only ``backend`` reads the call and the trace.
"""

"""What a golden case is: the call, its tensors, and what its generator guarantees.

Owns :class:`~.case.GoldenCase` and :func:`~.case.compute` (forward and backward on a
generator backend), the tensors and conventions a case stores, quantised cases
(:mod:`.quantized`), :class:`~.spec.CaseSpec` (the call rebuilt from a file) and the float64
error bound a generator promises (:mod:`.guarantee`). Reads files through
:mod:`refattn.bundle.storage`; writes nothing.
"""

"""The ``"exact"`` backend: every canonical tensor the correctly rounded value of its step.

Owns the rounding-point definitions (:mod:`~refattn.engine.exact.program`), binary64 rounding
of exact values and arb balls with Ziv's loop (:mod:`~refattn.engine.exact.rounding`), ball
arithmetic on arrays (:mod:`~refattn.engine.exact.balls`) and the backend interface
(:mod:`~refattn.engine.exact.backend`). It reads the call and never imports analysis, bundle,
adapters or cli; python-flint (arb, FLINT) does the arbitrary-precision work.
"""

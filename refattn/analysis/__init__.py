"""Analysis: questions asked of the engine's results rather than new arithmetic.

Owns gradients through the input projections (:mod:`~refattn.analysis.projection`), which
source row each output row reads (:mod:`~refattn.analysis.source_identity`) and the contract's
scale-placement validation gate (:mod:`~refattn.analysis.scale_gate`). It runs the engine on a
call; it must not import bundle, adapters or cli.
"""

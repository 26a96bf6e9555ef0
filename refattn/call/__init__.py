"""The call description: what one attention call computes, validated before any arithmetic.

Owns :class:`AttentionCall` (the ``attention_call_v1`` manifest and its validation gate in
:mod:`~refattn.call.gate`), the score families (:mod:`~refattn.call.scores`), where the scale is
applied (:mod:`~refattn.call.placement`) and bias helpers such as ALiBi
(:mod:`~refattn.call.bias`). It composes the pieces below it -- visibility relations from
:mod:`refattn.masks` and dropout streams through the :class:`MultiplierSource` protocol -- and
must not import the engine, analysis, bundle, adapters or cli layers above it.
"""

from __future__ import annotations

from refattn.call.gate import AttentionCall, MultiplierSource
from refattn.records import float_record, tensor_record

__all__ = ["AttentionCall", "MultiplierSource", "float_record", "tensor_record"]

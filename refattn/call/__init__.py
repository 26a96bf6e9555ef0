"""The call description: what one attention call computes, validated before any arithmetic.

Owns :class:`AttentionCall` (the ``attention_call_v1`` manifest and its validation gate in
:mod:`~refattn.call.gate`), the score families (:mod:`~refattn.call.scores`), where the scale is
applied (:mod:`~refattn.call.placement`), bias helpers such as ALiBi
(:mod:`~refattn.call.bias`) and physical layouts that build a canonical call, such as a paged
KV cache (:mod:`~refattn.call.paged`), a kvcache call with appends and rotary embeddings
(:mod:`~refattn.call.kvcache`), multi-head latent attention's latent caches
(:mod:`~refattn.call.mla`). It composes the pieces below it -- visibility relations from
:mod:`refattn.masks` and dropout streams through the :class:`MultiplierSource` protocol -- and
must not import the engine, analysis, bundle, adapters or cli layers above it.
"""

from __future__ import annotations

from refattn.call.gate import AttentionCall, MultiplierSource
from refattn.call.kvcache import KVCacheAppend
from refattn.call.mla import (
    AbsorbedGradients,
    AbsorbedLatent,
    LatentKV,
    MlaCall,
    PagedLatentKV,
    absorbed_call,
    latent_gradient,
    mla_call,
    paged_mla_call,
)
from refattn.call.paged import PagedCall, PagedKV, paged_call
from refattn.records import float_record, tensor_record

__all__ = ["AbsorbedGradients", "AbsorbedLatent", "AttentionCall", "KVCacheAppend", "LatentKV",
           "MlaCall", "MultiplierSource", "PagedCall", "PagedKV", "PagedLatentKV",
           "absorbed_call", "float_record", "latent_gradient", "mla_call", "paged_call",
           "paged_mla_call", "tensor_record"]

"""Past one machine: golden sweeps and long calls on Dask, with the same bytes as a local run.

Owns :func:`~refattn.distributed.cluster.connect` (a ``LocalCluster`` of worker processes on
the loopback interface, a running scheduler by address with a bounded wait, or no cluster),
:func:`~refattn.distributed.sweep.run_sweep` (``refattn sweep``: the cases of a SPEC computed
on the workers, the bundle written by this process alone, resumably),
:func:`~refattn.distributed.verification.verify` (``refattn verify --workers``: the same verdicts,
the cases checked in parallel) and :func:`~refattn.distributed.shard.value_and_grad` (one
large call split by batch, kv-head group and query or key blocks, run on the numba streaming
backend on the workers and assembled bit-identical to the single-process run).

Dask (``dask.distributed``) is an optional dependency (``pip install 'refattn[distributed]'``),
imported on first use; without it every entry point raises a
:class:`~refattn.errors.RefAttnError` saying so. This package sits above
:mod:`refattn.bundle` and :mod:`refattn.engine` and below :mod:`refattn.cli`; nothing below
it imports it. Workers compute and return bytes or arrays; only the calling process writes
files. The names below are imported on first use.

Examples
--------
>>> from refattn import distributed
>>> with distributed.connect() as client:   # neither workers nor a scheduler: in-process
...     print(client)
None
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module of this package that owns it
_OWNERS: dict[str, str] = {
    "connect": "cluster", "dask_distributed": "cluster",
    "SweepResult": "sweep", "run_sweep": "sweep",
    "verify": "verification",
    "ShardPlan": "shard", "plan_shards": "shard", "value_and_grad": "shard",
    "KeySharded": "keyshard", "key_sharded": "keyshard",
}

__all__ = sorted(_OWNERS)


def __getattr__(name: str) -> Any:
    if name not in _OWNERS:
        raise AttributeError(f"module 'refattn.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"refattn.distributed.{_OWNERS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OWNERS))

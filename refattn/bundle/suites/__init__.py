"""Named golden suites: functions returning sequences of :class:`~refattn.bundle.GoldenCase`.

Owns the registry of suite names and the generator each suite is written with unless told
otherwise; each suite module owns its case definitions (``contract``: the contract's published
fixtures; ``conformance``: the 79 named cases of ``data/golden``; ``kernels``: the cases at
the shapes real kernels run, across their tile edges, with the feature suites below;
``kvcache``: FlashAttention's kvcache matrix with appends and rotary embeddings; ``mla``:
FlashMLA's decode shapes; ``sparse``: index-list sparsity, up to L = 8192 with k = 2048).
Suites build calls and GoldenCases; they must not import the readers, verify or compare.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refattn._boundary import public
from refattn.bundle.golden.case import GoldenCase
from refattn.bundle.suites import conformance, contract, kernels, kvcache, mla, sparse
from refattn.errors import RefAttnError

__all__ = ["DEFAULT_GENERATORS", "SUITES", "build_suite", "default_generator"]

#: suite name -> function returning the suite's cases (the kernel suite builds each lazily)
SUITES: dict[str, Callable[[], Sequence[GoldenCase]]] = {
    "contract": contract.cases,
    "conformance": conformance.cases,
    "kernels": kernels.cases,
    "kvcache": kvcache.cases,
    "mla": mla.cases,
    "sparse": sparse.cases,
}
#: suite name -> the generator it is written with by default: exact where that is cheap (the
#: miniatures), numba at kernel shapes (float64 within the recorded bound, in seconds)
DEFAULT_GENERATORS: dict[str, str] = {
    "contract": "exact",
    "conformance": "exact",
    "kernels": kernels.DEFAULT_GENERATOR,
    "kvcache": kvcache.DEFAULT_GENERATOR,
    "mla": mla.DEFAULT_GENERATOR,
    "sparse": sparse.DEFAULT_GENERATOR,
}


def _check(name: str) -> None:
    if name not in SUITES:
        raise RefAttnError(f"suite: unknown suite {name!r}; known suites: {sorted(SUITES)}")


@public
def build_suite(name: str) -> Sequence[GoldenCase]:
    """Build the cases of a named suite.

    Examples
    --------
    >>> [c.case_id for c in build_suite("contract")][:2]
    ['loop6_two_query_training_trace', 'loop7_cross_attention_padded_source']
    >>> build_suite("kernel")
    Traceback (most recent call last):
    refattn.errors.RefAttnError: suite: unknown suite 'kernel'; known suites: ['conformance', \
'contract', 'kernels', 'kvcache', 'mla', 'sparse']
    """
    _check(name)
    return SUITES[name]()


def default_generator(name: str) -> str:
    """The generator suite ``name`` is written with unless one is named.

    Examples
    --------
    >>> default_generator("conformance"), default_generator("kernels")
    ('exact', 'numba')
    """
    _check(name)
    return DEFAULT_GENERATORS[name]

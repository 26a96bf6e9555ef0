"""Native (C/C++) readers of golden bundles: where the header lives, and the yardsticks it reads.

Owns :func:`include_dir` (the folder of ``refattn.hpp`` and ``refattn.h``, package data of
``refattn``; ``refattn include-dir`` prints it) and :func:`yardsticks` (the lower-precision
rule's yardstick of a case, the naive algorithm's error in a dtype and each tensor's natural
magnitude, as the JSON document ``refattn::Bundle::load_yardsticks`` reads). The rule itself
is :mod:`refattn.bundle.comparison.harness`'s; the header applies it with these numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.bundle.comparison.lowp import naive_routes, natural_magnitudes
from refattn.bundle.comparison.tolerances import LOWER_PRECISIONS, Tolerances, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec
from refattn.errors import RefAttnError

__all__ = ["YARDSTICK_SCHEMA", "include_dir", "yardsticks"]

#: the ``schema`` of a yardstick document (docs/reference/cpp.md)
YARDSTICK_SCHEMA = "refattn_yardsticks"


@public
def include_dir() -> Path:
    """The folder holding ``refattn.hpp`` and ``refattn.h`` (pass it to ``-I``).

    Returns
    -------
    pathlib.Path

    Examples
    --------
    >>> sorted(p.name for p in include_dir().glob("refattn.h*"))
    ['refattn.h', 'refattn.hpp']
    """
    path = Path(str(resources.files("refattn").joinpath("include")))
    if not (path / "refattn.hpp").is_file():
        raise RefAttnError(f"{path}: refattn.hpp is missing (the package was installed without "
                           "its include folder: package data refattn/include/*)")
    return path


def _record(x: float) -> dict[str, str]:
    return {"hex": float(x).hex(), "decimal": repr(float(x))}


@public
def yardsticks(specs: Sequence[CaseSpec], dtype: str, names: Sequence[str] = ("output",)
               ) -> dict[str, Any]:
    """The yardsticks of ``names`` in ``dtype`` for each case, as a JSON-ready document.

    For each tensor: ``reference_error``, the largest ``max|naive - g|`` over the naive
    algorithm's saved-state routes run in ``dtype`` (finite elements of both), and
    ``natural_magnitude`` (0 where the case has none), exactly the numbers
    :func:`refattn.bundle.comparison.compare` uses, as hex floats.

    Parameters
    ----------
    specs : sequence of CaseSpec
    dtype : {"float32", "float16", "bfloat16"}
    names : sequence of str
        Canonical tensor names (each case's missing ones are left out).

    Returns
    -------
    dict
        ``{"schema": "refattn_yardsticks", "schema_version": "1.0", "cases": {case:
        {dtype: {name: {"reference_error": {"hex", "decimal"}, "natural_magnitude": ...}}}}}``

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> doc = yardsticks([spec], "float32")
    >>> rec = doc["cases"][spec.case_id]["float32"]["output"]
    >>> 0 < float.fromhex(rec["reference_error"]["hex"]) < 1e-5
    True
    """
    if dtype not in LOWER_PRECISIONS:
        raise RefAttnError(f"dtype: expected one of {list(LOWER_PRECISIONS)}, got {dtype!r}")
    lp = resolve_dtype(dtype)
    routes = Tolerances().naive_routes
    cases: dict[str, Any] = {}
    for spec in specs:
        present = [n for n in names if n in spec.tensors]
        naive = naive_routes(spec, lp, routes, names=present)
        natural = natural_magnitudes(spec)
        table: dict[str, Any] = {}
        for name in present:
            g = np.asarray(spec.tensors[name], dtype=np.float64)
            ref = 0.0
            for res in naive.values():
                fin = np.isfinite(res[name]) & np.isfinite(g)
                if fin.any():
                    ref = max(ref, float(np.max(np.abs(res[name][fin] - g[fin]))))
            table[name] = {"reference_error": _record(ref),
                           "natural_magnitude": _record(natural.get(name, 0.0))}
        cases[spec.case_id] = {dtype: table}
    return {"schema": YARDSTICK_SCHEMA, "schema_version": "1.0", "cases": cases}

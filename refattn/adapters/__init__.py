"""Framework adapters: run one golden case's semantic call through another stack.

Owns the adapter-neutral pieces: :class:`AdapterResult` (the candidate tensors, the path that
produced them and a manifest whose backend fields say what was requested and what was
observed) and :func:`semantic_limits`, the case features every framework's eligibility
check reads (and where the case's scalars, read from a manifest, are bounded once: a scale and
a softcap positive and finite). The framework modules (:mod:`refattn.adapters.torch`,
:mod:`refattn.adapters.jax`) import their stack lazily inside functions; importing this
package never imports torch, jax or ml_dtypes. Defers the verdict to
:mod:`refattn.bundle.comparison.harness`. Adapters read golden cases (bundle) and run the engine;
nothing below them imports an adapter, and only the cli sits above.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import bounded_float
from refattn.bundle.comparison.harness import compare
from refattn.bundle.golden.spec import CaseSpec

__all__ = ["AdapterResult", "semantic_limits"]


@public
@dataclass(frozen=True, eq=False)
class AdapterResult:
    """What one framework path produced for one case.

    Attributes
    ----------
    case_id : str
    path : str
        e.g. ``"torch.sdpa"``, ``"torch.eager"``, ``"torch.mha"``, ``"jax.dot_product_attention"``.
    precision : str
        float64, float32, float16 or bfloat16.
    tensors : dict of str to ndarray
        Candidate tensors under canonical names, in the framework's dtype (bfloat16 as
        ml_dtypes.bfloat16).
    manifest : dict
        The case's call manifest with the backend fields filled in (framework revision,
        entry point, requested and observed backend, mask encoding, is_causal, ...).
    """

    case_id: str
    path: str
    precision: str
    tensors: Mapping[str, np.ndarray]
    manifest: Mapping[str, Any] = field(default_factory=dict)

    def compare(self, golden: CaseSpec, *, tolerances: Any = None) -> Any:
        """Compare these tensors with ``golden`` at this precision (see ``bundle.compare``)."""
        return compare(self.tensors, golden, dtype=self.precision, tolerances=tolerances)


@public
def semantic_limits(spec: CaseSpec) -> dict[str, Any]:
    """The features of a case that decide which framework paths can express it.

    Raises
    ------
    RefAttnError
        When the manifest's scale or softcap is not a positive finite number (every lowering
        reads them; they are bounded here, once, before any of them does).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> lim = semantic_limits(case_spec(build_suite("contract")[0]))
    >>> lim["family"], lim["dropout"], lim["softcap"], lim["sink"]
    ('dot', True, False, False)
    """
    a = spec.axes
    bounded_float(f"{spec.case_id}: scale", spec.scale, lo=0.0, lo_open=True)
    if spec.softcap is not None:
        bounded_float(f"{spec.case_id}: softcap", spec.softcap, lo=0.0, lo_open=True)
    return {
        "family": spec.score_family_name,
        "dropout": spec.has_dropout,
        "softcap": spec.softcap is not None,
        "sink": "sink" in spec.tensors,
        "bias": "bias" in spec.tensors,
        "equal_qk_width": a.get("Dq", a["Dk"]) == a["Dk"],
        "equal_kv_width": a["Dk"] == a["Dv"],
        "grouped_heads": spec.head_map_mode == "grouped",
        "placement": spec.scale_placement,
    }

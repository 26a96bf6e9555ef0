"""Old module paths of the flat layout, kept importable with a DeprecationWarning.

Until version 0.1 refattn was a flat list of modules (``refattn.golden``, ``refattn.scores``,
``refattn.visibility`` ...). Each such path is now a shim module created on import by the
finder below: it warns once, names the new home, and resolves every attribute from the modules
that now own it. Nothing inside refattn imports an old path; the shims exist for users' code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "install"]

_NUMBA = {f"refattn.engine.numba_{m}": (f"refattn.engine.numba.{m}",)
          for m in ("backend", "blas", "kernels", "math", "operands", "philox", "stream", "tiles")}

#: refattn.bundle's flat modules before its rooms (issue 39); ``comparison`` is a room itself
_BUNDLE = {f"refattn.bundle.{old}": (f"refattn.bundle.{new}",) for old, new in (
    ("format", "storage.format"), ("fsio", "storage.fsio"),
    ("transaction", "storage.transaction"), ("manifest", "storage.manifest"),
    ("read", "storage.read"), ("cases", "golden.case"), ("quantized", "golden.quantized"),
    ("spec", "golden.spec"), ("guarantee", "golden.guarantee"), ("write", "writing.write"),
    ("sweep", "sweeps.grid"), ("diagnosis", "comparison.diagnosis"),
    ("lowp", "comparison.lowp"), ("tolerances", "comparison.tolerances"),
    ("candidates", "comparison.candidates"), ("verifier", "verification.verifier"),
    ("recompute", "verification.recompute"), ("gradients", "verification.gradients"),
    ("report", "verification.report"), ("checked", "verification.checked"))}

#: old module path -> the modules that now own its names, searched in order
MOVED: dict[str, tuple[str, ...]] = {
    "refattn._visibility_inputs": ("refattn.masks._inputs",),
    "refattn.windows": ("refattn.masks.windows",),
    "refattn.visibility_relation": ("refattn.masks.relation",),
    "refattn.packing": ("refattn.masks.packing",),
    "refattn.mask_render": ("refattn.masks.render",),
    "refattn.visibility": ("refattn.masks", "refattn.masks.relation", "refattn.masks.constructors"),
    "refattn.block_mask": ("refattn.masks.blocks",),
    "refattn.mask_adapters": ("refattn.masks.framework",),
    "refattn.philox": ("refattn.dropout.philox",),
    "refattn.dropout_moments": ("refattn.dropout.moments",),
    "refattn.dropout_variants": ("refattn.dropout.variants",),
    "refattn.scores": ("refattn.call.scores",),
    "refattn.scale_placement": ("refattn.call.placement", "refattn.analysis.scale_gate"),
    "refattn.bias": ("refattn.call.bias",),
    "refattn.trace": ("refattn.engine.trace",),
    "refattn.projection": ("refattn.analysis.projection",),
    "refattn.source_identity": ("refattn.analysis.source_identity",),
    "refattn.golden": ("refattn.bundle", "refattn.bundle.golden.case",
                       "refattn.bundle.storage.read", "refattn.bundle.writing.write",
                       "refattn.bundle.storage.format"),
    "refattn.case_spec": ("refattn.bundle.golden.spec",),
    "refattn.verify": ("refattn.bundle.verification.verifier", "refattn.bundle.storage.manifest",
                       "refattn.bundle.verification.report",
                       "refattn.bundle.verification.gradients"),
    "refattn.compare": ("refattn.bundle.comparison.harness",
                        "refattn.bundle.comparison.candidates"),
    "refattn.tolerances": ("refattn.bundle.comparison.tolerances",),
    "refattn.lowp": ("refattn.bundle.comparison.lowp",),
    "refattn.suites": ("refattn.bundle.suites",),
    "refattn.suites.contract": ("refattn.bundle.suites.contract",),
    "refattn.suites.conformance": ("refattn.bundle.suites.conformance",),
    "refattn.commands": ("refattn.cli",),
    **{f"refattn.commands.{c}": (f"refattn.cli.{c}",)
       for c in ("compare", "diagnostics", "golden", "gradcheck", "mask", "verify")},
    **_NUMBA,
    **_BUNDLE,
}


class _Shim(types.ModuleType):
    """A moved module: attributes resolve, in order, from the modules that own them now."""

    __path__: list[str]  # a package, so that old submodule paths import too
    __all__: list[str]
    _targets: tuple[str, ...]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (moved to {self._targets[0]}) has no "
                             f"attribute {name!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self._targets:
            names.update(dir(importlib.import_module(target)))
        return sorted(names)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Shim(spec.name)
        module._targets = MOVED[spec.name]
        module.__path__ = []
        module.__all__ = sorted({n for t in module._targets
                                 for n in getattr(importlib.import_module(t), "__all__", ())})
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{module.__name__} moved to {MOVED[module.__name__][0]}; the old path "
                      "will be removed in a future version", DeprecationWarning, stacklevel=3)


def install() -> None:
    """Register the finder for the old paths (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())

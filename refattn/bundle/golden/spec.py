"""CaseSpec: the semantic call of one golden case, read back from its tensors and manifest.

Owns the reconstruction of an :class:`~refattn.AttentionCall` from a golden file (inputs,
scale, head map, policies, dropout multiplier, the recorded strides of non-contiguous inputs)
so that ``refattn verify``, the comparison harness and the framework adapters all consume one
description of the call. Defers reading and checksum verification to
:mod:`refattn.bundle.storage.read`.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from refattn._boundary import public
from refattn._checks import INT64_MAX, INT64_MIN, bounded_int
from refattn.bundle.golden.case import (
    INPUT_TENSORS,
    GoldenCase,
    case_conventions,
    case_inputs,
    case_tensors,
    compute,
    emulated_tensors,
    stored_by,
)
from refattn.bundle.golden.layouts import read_layout
from refattn.bundle.golden.quantized import QuantCase, kernel_inputs
from refattn.bundle.storage.read import LoadedCase, load
from refattn.call import AttentionCall, scores
from refattn.call.gate import AllMaskedRows, ReturnedWeights
from refattn.call.placement import ScalePlacement
from refattn.dropout import from_manifest
from refattn.errors import RefAttnError
from refattn.masks import relation_from_manifest
from refattn.quant.spec import QuantSpec, check_quant

__all__ = ["CaseSpec", "case_spec", "regenerated_spec", "with_strides"]


def with_strides(x: np.ndarray, stride: list[int], name: str = "stride") -> np.ndarray:
    """A view holding ``x``'s values with the given element strides (the recorded layout).

    Non-negative, non-overlapping layouts are rebuilt exactly; anything else (a zero or
    negative stride, or a layout spanning more than 64 times the tensor's elements, which a
    hostile manifest could use to exhaust memory) returns a C-contiguous copy, and the
    rebuilt call's manifest then differs from the stored one where verify reports it. Each
    stride must be an integer in int64's range: anything else (a manifest's ``1.5`` or
    ``10**400``) is a :class:`RefAttnError` naming ``name[i]``.

    Examples
    --------
    >>> a = np.arange(6.0).reshape(2, 3)
    >>> b = with_strides(a, [1, 2])
    >>> b.strides, bool((b == a).all())
    ((8, 16), True)
    """
    x = np.asarray(x)
    if not isinstance(stride, (list, tuple)):
        raise RefAttnError(f"{name}: expected a list of element strides, got "
                           f"{type(stride).__name__}")
    stride = [bounded_int(f"{name}[{i}]", s, lo=INT64_MIN, hi=INT64_MAX)
              for i, s in enumerate(stride)]
    if len(stride) != x.ndim or any(s <= 0 for s in stride) or x.size == 0:
        return np.ascontiguousarray(x)
    span = 1 + sum((n - 1) * s for n, s in zip(x.shape, stride, strict=True))
    if span > 64 * x.size + 4096:
        return np.ascontiguousarray(x)
    buf = np.zeros(span, dtype=x.dtype)
    view = np.lib.stride_tricks.as_strided(
        buf, shape=x.shape, strides=[s * x.itemsize for s in stride], writeable=True
    )
    view[...] = x
    if not np.array_equal(view, x):  # overlapping layout: values cannot all be stored
        return np.ascontiguousarray(x)
    return view


@public
@dataclass(frozen=True, eq=False)
class CaseSpec:
    """One golden case as a semantic call: tensors, manifest fields and labels.

    Attributes
    ----------
    case_id : str
    tensors : dict of str to ndarray
        Every stored tensor under its canonical name (inputs, intermediates, gradients).
    call_manifest : dict
        The case's ``attention_call_v1`` manifest.
    conventions : dict
        Causal alignment, window convention and the other recorded conventions.
    flags : tuple of str
    comment : str
    quant : dict, optional
        A quantised case's manifest record (``{"spec": QuantSpec.to_manifest()}``), or None.
    guarantee : dict, optional
        A float64-generated case's recorded bound (its manifest entry's ``guarantee``,
        :func:`~refattn.bundle.golden.guarantee.guarantee_record`), as the file claims it:
        verify audits it and applies its own.
    """

    case_id: str
    tensors: Mapping[str, np.ndarray]
    call_manifest: Mapping[str, Any]
    conventions: Mapping[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    comment: str = ""
    quant: Mapping[str, Any] | None = None
    guarantee: Mapping[str, Any] | None = None

    @property
    def generator(self) -> str:
        """The backend the call manifest says generated the case (``exact``, ``numpy`` or
        ``numba``; a claim, which verify checks)."""
        return str(self.call_manifest.get("backend", {}).get("selected_backend", "numpy"))

    # -- scalar fields ------------------------------------------------------------------
    @property
    def scale(self) -> float:
        """The multiplier alpha, read exactly from its C99 hex record."""
        return float.fromhex(self.call_manifest["scale"]["value"]["hex"])

    @property
    def scale_is_default(self) -> bool:
        return self.call_manifest["scale"].get("source") == "default_dk_inverse_sqrt"

    @property
    def all_masked_rows(self) -> AllMaskedRows:
        return self.call_manifest["visibility"]["all_masked_row_policy"]

    @property
    def returned_weights(self) -> ReturnedWeights:
        return self.call_manifest["dropout"].get("returned_weights", "none")

    @property
    def dropout(self) -> Mapping[str, Any]:
        """The manifest's dropout section (mode ``none``, ``explicit_multiplier`` or ``stream``)."""
        return self.call_manifest["dropout"]

    @property
    def axes(self) -> dict[str, int]:
        return dict(self.call_manifest["axes"])

    @property
    def head_map_mode(self) -> str:
        return self.call_manifest["tensors"]["head_map"].get("mode", "grouped")

    def layout(self, role: str) -> Mapping[str, Any]:
        """Recorded layout (shape, stride, contiguous) of ``query``, ``key_physical``, ..."""
        return self.call_manifest["tensors"][role]

    # -- full-shape views ---------------------------------------------------------------
    @property
    def score_shape(self) -> tuple[int, int, int, int]:
        a = self.axes
        return (a["B"], a["Hq"], a["Q"], a["K"])

    def visible_full(self, *, sanitized: bool = False) -> np.ndarray:
        """(B, Hq, Q, K) bool visibility; ``sanitized=True`` adds the temporary key 0 of
        rows that Policy 3 sanitised (as the engine does before the softmax)."""
        vis = self.tensors.get("visible")
        full = np.broadcast_to(np.True_ if vis is None else vis, self.score_shape)
        if sanitized and "sanitized_rows" in self.tensors and self.tensors["sanitized_rows"].any():
            full = full.copy()
            full[..., 0] |= self.tensors["sanitized_rows"]
        return full

    def query_valid_full(self) -> np.ndarray:
        """(B, 1, Q, 1) bool query validity."""
        a = self.axes
        qv = self.tensors.get("query_valid")
        return np.broadcast_to(np.True_ if qv is None else qv, (a["B"], 1, a["Q"], 1))

    def multiplier_full(self) -> np.ndarray:
        """(B, Hq, Q, K) dropout multiplier Z (all ones without dropout): as stored, or where
        a case stores no trace of it (a saved-state case), the multiplier as given or
        regenerated from its stream."""
        z = self.tensors.get("dropout_multiplier")
        if z is None and self.has_dropout:
            source = self._dropout_argument()
            z = source if isinstance(source, np.ndarray) else source.multiplier(
                *self.score_shape)
        return np.broadcast_to(np.float64(1.0) if z is None else z, self.score_shape)

    @property
    def has_dropout(self) -> bool:
        return self.dropout.get("mode", "none") != "none"

    # -- reconstruction -----------------------------------------------------------------
    def _dropout_argument(self) -> Any:
        mode = self.dropout.get("mode", "none")
        match mode:
            case "none":
                return None
            case "explicit_multiplier":
                return self.tensors.get("dropout", self.tensors.get("dropout_multiplier"))
            case "stream":
                return _stream_from_manifest(self.dropout)
            case _:
                raise RefAttnError(f"{self.case_id}: unknown dropout mode {mode!r} in manifest")

    @property
    def scale_placement(self) -> ScalePlacement:
        """The requested placement of alpha: ``post``, ``q``, ``k`` or ``split``."""
        return self.call_manifest["scale"].get("requested_placement", "post")

    @property
    def softcap(self) -> float | None:
        record = (self.call_manifest.get("score_modifiers") or {}).get("softcap")
        return None if record is None else float.fromhex(record["hex"])

    @property
    def score_family_name(self) -> str:
        return (self.call_manifest.get("score") or {}).get("family", "dot")

    def score_family(self) -> Any:
        """The :mod:`refattn.call.scores` family of the call, parameters read from the tensors."""
        m = self.call_manifest.get("score") or {"family": "dot"}
        t = self.tensors

        def param(name: str) -> np.ndarray:
            if f"score_{name}" not in t:
                raise RefAttnError(f"{self.case_id}: tensor 'score_{name}' is missing")
            return t[f"score_{name}"]

        match m["family"]:
            case "dot":
                return scores.Dot()
            case "bilinear":
                return scores.Bilinear(param("W"))
            case "additive":
                budget = bounded_int(f"{self.case_id}: score.max_workspace_elements",
                                     m["max_workspace_elements"], lo=1, hi=INT64_MAX)
                return scores.Additive(param("Wq"), param("Wk"), param("b"), param("v"),
                                       max_workspace_elements=budget)
            case "cosine":
                return scores.Cosine(eps=float.fromhex(m["eps"]["hex"]))
            case other:
                raise RefAttnError(f"{self.case_id}: unknown score family {other!r}")

    def relation(self) -> Any:
        """The relation the call was built from (a :class:`~refattn.masks.VisibilityRelation` or
        a composition of them), or None."""
        record = self.call_manifest["visibility"].get("relation")
        if record is None:
            return None
        try:
            return relation_from_manifest(record)
        except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
            if isinstance(exc, RefAttnError):
                raise
            raise RefAttnError(f"{self.case_id}: the visibility relation in the manifest "
                               f"cannot be rebuilt ({type(exc).__name__}: "
                               f"{str(exc)[:120]})") from None

    def to_call(self, inputs: Mapping[str, np.ndarray] | None = None) -> AttentionCall:
        """Rebuild the :class:`~refattn.AttentionCall`, including the recorded input strides.

        ``inputs`` replaces the stored q, k or v (a quantised case's kernel inputs, see
        :meth:`quant_case`); everything else is the stored call's.

        Raises
        ------
        RefAttnError
            When the manifest names a feature this reader cannot rebuild.
        """
        t = {**self.tensors, **(inputs or {})}
        for name in ("q", "k", "v"):
            if name not in t:
                raise RefAttnError(f"{self.case_id}: tensor {name!r} is missing")
        where = f"{self.case_id}: manifest"
        q = with_strides(t["q"], self.layout("query")["stride"], f"{where} query.stride")
        k = with_strides(t["k"], self.layout("key_physical")["stride"],
                         f"{where} key_physical.stride")
        v = with_strides(t["v"], self.layout("value_physical")["stride"],
                         f"{where} value_physical.stride")
        bias = t.get("bias")
        bias_record = self.call_manifest.get("bias") or {}
        if bias is not None and "stride" in bias_record:
            bias = with_strides(bias, bias_record["stride"], f"{where} bias.stride")
        extra: dict[str, Any] = {}
        if self.score_family_name != "dot" or "score" in self.call_manifest:
            extra["score"] = self.score_family()
        if self.scale_placement != "post":
            extra["scale_placement"] = self.scale_placement
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if "sink" in t:
            extra["sink"] = t["sink"]
        relation = self.relation()
        return AttentionCall(
            q, k, v,
            visible=t.get("visible") if relation is None else relation,
            query_valid=t.get("query_valid"),
            bias=bias,
            scale=None if self.scale_is_default else self.scale,
            head_map=t["head_map"] if self.head_map_mode == "explicit" else None,
            dropout=self._dropout_argument(),
            all_masked_rows=self.all_masked_rows,
            returned_weights=self.returned_weights,
            **extra,
        )

    def to_golden_case(self) -> GoldenCase:
        """The :class:`~refattn.bundle.GoldenCase` that regenerates this case."""
        if "grad_output" not in self.tensors:
            raise RefAttnError(f"{self.case_id}: tensor 'grad_output' is missing")
        conv = dict(self.conventions)
        return GoldenCase(self.case_id, self.to_call(), self.tensors["grad_output"],
                          self.comment, tuple(self.flags), conv, self.input_layout(),
                          self.quant_case())

    def quant_spec(self) -> QuantSpec | None:
        """A quantised case's :class:`~refattn.quant.spec.QuantSpec`, read back from the
        manifest and checked again (:meth:`QuantSpec.from_manifest`), or None."""
        if self.quant is None:
            return None
        try:
            return QuantSpec.from_manifest(self.quant.get("spec"))
        except RefAttnError as exc:
            raise RefAttnError(f"{self.case_id}: manifest quant: {exc}") from None

    def quant_case(self) -> QuantCase | None:
        """A quantised case's :class:`~refattn.bundle.golden.quantized.QuantCase` (its spec and the
        call as the kernel receives it: q, k, v decoded from the stored codes, or the stored
        inputs where the kernel casts them), or None.

        Raises
        ------
        RefAttnError
            A spec that does not read back, a missing or malformed codes or scale tensor, a
            stored scale that differs from the spec's, or kernel inputs the spec refuses.
        """
        spec = self.quant_spec()
        if spec is None:
            return None
        kernel = self.to_call(kernel_inputs(spec, self.tensors, self.case_id))
        try:
            check_quant(kernel, spec)
        except RefAttnError as exc:
            raise RefAttnError(f"{self.case_id}: {exc}") from None
        return QuantCase(spec, kernel)

    def input_layout(self) -> Any:
        """The physical inputs the case stores as given (its ``conventions["kv_layout"]``:
        :mod:`refattn.bundle.golden.layouts`), or None."""
        return read_layout(self.tensors, self.conventions, self.case_id)


class _Regenerated(Mapping[str, np.ndarray]):
    """The tensors of a case regenerated on demand: its inputs when one of them is asked for
    (the case rebuilt, no arithmetic), everything (the generator run) for any other name. The
    last :data:`KEEP` cases of each kind stay in memory, so a suite of hundreds of kernel-sized
    cases is read one case at a time."""

    #: cases whose tensors stay in memory (per kind: inputs, everything)
    KEEP = 2
    _inputs: ClassVar[OrderedDict[int, dict[str, np.ndarray]]] = OrderedDict()
    _all: ClassVar[OrderedDict[int, dict[str, np.ndarray]]] = OrderedDict()
    _tokens: ClassVar[Iterator[int]] = itertools.count()

    def __init__(self, build: Callable[[], GoldenCase], backend: str) -> None:
        self.build, self.backend = build, backend
        self.token = next(self._tokens)  # the memos' key (never reused, unlike id())

    def _held(self, memo: OrderedDict[int, dict[str, np.ndarray]],
              make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        key = self.token
        if key in memo:
            memo.move_to_end(key)
            return memo[key]
        value = make()
        memo[key] = value
        while len(memo) > self.KEEP:
            memo.popitem(last=False)
        return value

    def inputs(self) -> dict[str, np.ndarray]:
        return self._held(self._inputs, lambda: case_inputs(self.build()))

    def everything(self) -> dict[str, np.ndarray]:
        def make() -> dict[str, np.ndarray]:
            case = self.build()
            trace, grads = compute(case, self.backend)
            return stored_by(self.backend, case_tensors(trace, grads, case.layout))

        return self._held(self._all, make)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in INPUT_TENSORS or name.startswith("score_"):
            return self.inputs()[name]
        return self.everything()[name]

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and (name in INPUT_TENSORS or name.startswith("score_")):
            return name in self.inputs()
        return name in self.everything()

    def __iter__(self) -> Iterator[str]:
        return iter(self.everything())

    def __len__(self) -> int:
        return len(self.everything())


def regenerated_spec(build: Callable[[], GoldenCase], backend: str = "numba") -> CaseSpec:
    """A :class:`CaseSpec` whose tensors are generated when first read (then kept for the
    last few cases only): what the pytest plugin runs a large suite from.

    ``build`` makes the case (the kernel suite's builders draw its tensors from a seed);
    it is called once here (the call manifest) and again whenever the case's tensors were
    let go. The manifest is the one a bundle written by ``backend`` records.

    Parameters
    ----------
    build : callable
        ``build() -> GoldenCase``, the same case on every call.
    backend : {"numba"}
        The generator (its saved-state tensors are a function of the call alone).

    Examples
    --------
    >>> from refattn.bundle.suites.kernels import SPECS, build
    >>> spec = regenerated_spec(lambda: build(SPECS[0]))
    >>> spec.generator, spec.tensors["q"].shape, spec.tensors["output"].shape
    ('numba', (1, 4, 1, 32), (1, 4, 1, 32))
    """
    if backend != "numba":
        raise RefAttnError(f"backend: a regenerated case is generated by 'numba', got "
                           f"{backend!r}; case_spec computes the others in full")
    from refattn.engine.numba.generator import materialization  # loads numba

    case = build()
    manifest = case.call.manifest(requested_backend=backend, selected_backend=backend,
                                  materialization=materialization(case.call))
    return CaseSpec(case.case_id, _Regenerated(build, backend), manifest,
                    case_conventions(case), tuple(sorted(case.flags)), case.comment)


def _stream_from_manifest(record: Mapping[str, Any]) -> Any:
    """Rebuild a replayable dropout stream from its manifest record."""
    if "philox" in str(record.get("algorithm", "")).lower():
        return from_manifest(dict(record))
    raise RefAttnError(f"dropout: cannot rebuild stream {record.get('algorithm')!r}")


@public
def case_spec(source: LoadedCase | GoldenCase | str | os.PathLike, *,
              backend: str = "exact") -> CaseSpec:
    """The :class:`CaseSpec` of a loaded case, a case file path or an in-memory GoldenCase.

    An in-memory GoldenCase is computed by the generator ``backend`` (``exact`` by default;
    :data:`~refattn.bundle.golden.case.GENERATORS`).

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> spec = case_spec(build_suite("contract")[1])
    >>> spec.case_id, spec.score_shape, round(spec.scale, 6)
    ('loop7_cross_attention_padded_source', (1, 1, 2, 3), 0.707107)
    """
    if isinstance(source, (str, os.PathLike)):
        source = load(Path(source))
    if isinstance(source, GoldenCase):
        trace, grads = compute(source, backend)
        tensors = case_tensors(trace, grads, source.layout)
        quant = None
        if source.quant is not None:
            tensors.update(emulated_tensors(source))
            quant = source.quant.manifest()
        return CaseSpec(source.case_id, tensors, trace.manifest(),
                        case_conventions(source), tuple(sorted(source.flags)), source.comment,
                        quant)
    if isinstance(source, LoadedCase):
        entry = source.manifest_entry
        if entry is None:
            raise RefAttnError(
                f"{source.case_id}: the case has no bundle manifest entry (manifest.json must "
                "sit beside cases/), so its scale and policies are unknown"
            )
        return CaseSpec(source.case_id, source.tensors, entry["call"],
                        entry.get("conventions", {}), tuple(entry.get("flags", ())),
                        entry.get("comment", ""), entry.get("quant"), entry.get("guarantee"))
    raise RefAttnError(
        f"golden: expected a LoadedCase, GoldenCase or case file path, got {type(source).__name__}"
    )

"""Sweep SPECs: a grid or list of golden cases, expanded to named cases with stable ids.

Owns what ``refattn sweep SPEC`` reads: :func:`read_spec` (TOML through the standard library's
``tomllib``, YAML through PyYAML imported on first use), :func:`check_spec` (the published
JSON Schema ``schema/sweep-v1.json``, validated with ``jsonschema``: an unknown key, an empty
grid or an empty list of values is a named error), :func:`expand` (every grid's combinations
and every listed case, normalised, deduplicated and validated by building each call),
:func:`case_budget` (a case's seconds and bytes, estimated from its shape before any tensor
exists) and :func:`build_case` (the :class:`~refattn.bundle.golden.case.GoldenCase` of one
normalised description).

A SPEC is untrusted input, bounded before it is believed: at most 4 MiB of text and
:data:`MAX_SPEC_VALUES` values nested at most :data:`MAX_SPEC_DEPTH` deep (counted on YAML's
event stream before any node is built; YAML aliases, which let a small file stand for billions
of values, are refused), an integer too long for Python to read (more than 4,300 digits) named
instead of a parser's ValueError, at most 100 schema violations collected (their messages cut
to 200 characters), every number bounded again when a case is normalised (:func:`normalize`:
each integer in its range, each float finite and in its range, so that a call built from
:func:`normalize`'s output never meets an unbounded number; the ranges are the schema's, and
:data:`MAX_SCALE` bounds an explicit scale), and every case's time and memory checked against
the limits before its tensors are drawn. All of it happens before anything is written.

A case's id is a readable slug and the first 12 hex digits of the sha256 of its normalised
description (canonical JSON), and its random tensors come from a generator seeded by the same
hash: the id and the bytes of a case depend on the case alone, never on the grid's order or
on the other cases. Writing the bundle is :mod:`refattn.bundle.writing.write`'s; running the cases
on workers is :mod:`refattn.distributed`'s.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import numpy as np

from refattn._checks import bounded_float, bounded_int
from refattn.bundle.golden.case import GoldenCase, check_generator
from refattn.bundle.golden.quantized import quant_case
from refattn.bundle.storage.fsio import read_regular
from refattn.call import AttentionCall
from refattn.call.bias import alibi, alibi_slopes
from refattn.call.scores import Additive, Bilinear, Cosine
from refattn.dropout import Philox
from refattn.engine.exact.estimate import DEFAULT_MAX_SECONDS, SECONDS_PER_ELEMENT
from refattn.engine.memory import available_bytes
from refattn.errors import RefAttnError
from refattn.masks import causal, relation, segments_from_cu_seqlens
from refattn.quant.formats import format_max, quantize
from refattn.quant.presets import PRESETS, preset
from refattn.quant.tiles import kernel_tiles

__all__ = ["DESCRIPTION_VERSION", "MAX_CASES", "MAX_CASE_SECONDS", "MAX_EXTENT", "MAX_SCALE",
           "MAX_SPEC_DEPTH", "MAX_SPEC_VALUES", "CaseBudget", "Sweep", "SweepCase", "build_case",
           "case_budget", "case_cost_order", "case_id", "check_budget", "check_spec", "cost",
           "expand", "load_sweep", "normalize", "read_spec", "spec_schema"]

#: version of the normalised case description (part of every case's hash: a change to how a
#: description becomes tensors bumps it, so old ids never name new bytes)
DESCRIPTION_VERSION = 1
#: the most cases one SPEC may expand to
MAX_CASES = 1_000_000
#: the most values (scalars, lists and tables, each occurrence counted) a SPEC may hold
MAX_SPEC_VALUES = 200_000
#: the deepest nesting of lists and tables in a SPEC (a real one nests 5 deep)
MAX_SPEC_DEPTH = 32
#: the largest axis, Da, window bound, padding, prefix length or segment count (the schema's)
MAX_EXTENT = 65536
#: the largest explicit scale: its scores, their bounds and the recorded guarantee stay
#: finite (1e200 already overflows the guarantee of a 4-wide case)
MAX_SCALE = 2.0**64
_SEED_MAX = 2**64 - 1  # a Philox key / data seed: 64 bits
_OFFSET_MAX = 2**32 - 1  # a Philox counter offset: 32 bits
#: the longest a case may take, estimated from its shape: the exact generator's own limit,
#: which the reference-error check of every case (exact or numpy) costs about as much as
MAX_CASE_SECONDS = DEFAULT_MAX_SECONDS
_MAX_SPEC_BYTES = 4 * 2**20
#: schema violations collected before the most specific one is named
_MAX_ERRORS = 100
#: peak memory of computing and checking a case (:func:`case_budget`), measured as peak RSS
#: growth of encode_case (numpy and exact generators; most of it the reference error's arb
#: balls): 998-1279 bytes per score element (b, h, i, j) with masks, bias and dropout;
#: 424-823 more per score element per additive width Da; at most 440 per element of the q,
#: k, v and output rows (cosine); the bilinear family about 550 per element of W and 230 per
#: element of W per (b, h) it is used for. Rounded up (estimates 1.3-2.4x the measured peak)
_BYTES_PER_SCORE = 1536
_BYTES_PER_SCORE_PER_DA = 1024
_BYTES_PER_ROW_ELEMENT = 640
_BYTES_PER_W = 640
_BYTES_PER_W_USE = 256
#: the emulated pipeline of a quantised case (refattn.quant.pipeline.emulate), measured at
#: (1, 2, 1, 256, 256, 64, 64) causal on a loaded 2-core AMD EPYC: 3.4-8.0 us and 289-318 bytes
#: (tracemalloc peak) per score element for fa3_fp8, flashinfer_fp8_kv, sageattention_int8;
#: rounded up
_QUANT_SECONDS_PER_SCORE = 1.2e-5
_QUANT_BYTES_PER_SCORE = 512
#: the numba generator (the fused kernel and the blocked natural magnitudes of the recorded
#: bound; no reference error in arbitrary precision): measured 1.3e-7 s per score element at
#: Dk + Dv = 256 over the kernel suite (304 cases, 2-core AMD EPYC), about 5e-10 s per score
#: element and unit of Dk + Dv; rounded up 4x. Memory: the inputs, outputs and gradients about
#: four times over, and the blocks of the natural magnitudes (16 MiB arrays) and the kernel's
#: per-thread buffers, 256 MiB in all
_NUMBA_SECONDS_PER_SCORE_WIDTH = 2e-9
_NUMBA_TENSOR_COPIES = 4
_NUMBA_FIXED_BYTES = 256 << 20
_SHAPE_AXES = ("B", "Hq", "Hkv", "Q", "K", "Dk", "Dv")
_BUILTIN_DEFAULTS: dict[str, Any] = {
    "score": "dot", "scale": "default", "mask": "none", "bias": "none", "dropout": "none",
    "seed": 0, "generator": "exact",
}


class SweepCase(NamedTuple):
    """One expanded case: its id, normalised description and where the SPEC defined it."""

    case_id: str
    description: dict[str, Any]
    origin: str


@dataclass(frozen=True)
class Sweep:
    """An expanded SPEC: its name, identity and cases (sorted by id).

    Attributes
    ----------
    name : str
    sweep_id : str
        16 hex digits: sha256 of the name and the sorted case ids. A bundle records it, and
        a directory holding another sweep is refused.
    cases : tuple of SweepCase
    duplicates : int
        Descriptions the SPEC listed more than once (kept once).
    """

    name: str
    sweep_id: str
    cases: tuple[SweepCase, ...]
    duplicates: int = 0

    @property
    def suite(self) -> str:
        """The suite name a sweep bundle records: ``sweep:<name>``."""
        return f"sweep:{self.name}"

    @property
    def generators(self) -> tuple[str, ...]:
        """The generators the cases use, sorted."""
        return tuple(sorted({c.description["generator"] for c in self.cases}))

    def record(self) -> dict[str, Any]:
        """The ``sweep`` record of the bundle manifest."""
        return {"id": self.sweep_id, "name": self.name, "cases": len(self.cases),
                "spec_schema": "sweep-v1", "description_version": DESCRIPTION_VERSION}


# -- reading and checking -------------------------------------------------------------------
@functools.cache
def spec_schema() -> dict[str, Any]:
    """The published JSON Schema of a SPEC (``refattn/bundle/schema/sweep-v1.json``).

    Examples
    --------
    >>> sorted(spec_schema()["properties"])
    ['case', 'defaults', 'description', 'grid', 'name', 'version']
    """
    text = resources.files("refattn.bundle").joinpath("schema/sweep-v1.json").read_text("utf-8")
    return json.loads(text)


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    document = spec_schema()
    cls = jsonschema.validators.validator_for(document)
    cls.check_schema(document)
    return cls(document)


def read_spec(path: str | os.PathLike) -> dict[str, Any]:
    """Read a SPEC file: ``.toml`` (``tomllib``) or ``.yaml`` / ``.yml`` (PyYAML, lazily).

    Raises
    ------
    RefAttnError
        Naming the file: unreadable, not a regular file, another suffix, not valid TOML or
        YAML, or not a table at the top level.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise RefAttnError(f"SPEC {path}: expected a .toml, .yaml or .yml file, got "
                           f"{suffix or 'no suffix'!r}")
    data = read_regular(path, max_bytes=_MAX_SPEC_BYTES, what="sweep SPEC")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RefAttnError(f"SPEC {path}: is not UTF-8 text (offset {exc.start})") from None
    if suffix == ".toml":
        doc = _parse_toml(text, path)
    else:
        doc = _parse_yaml(text, path)
    if not isinstance(doc, dict):
        raise RefAttnError(f"SPEC {path}: expected a table (mapping) at the top level, got "
                           f"{type(doc).__name__}")
    return doc


def _parse_toml(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef, unused-ignore]  # if typed
        except ImportError:
            raise RefAttnError(f"SPEC {path}: reading TOML needs Python 3.11+ or the tomli "
                               "package (pip install tomli)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RefAttnError(f"SPEC {path}: not valid TOML ({_shorten(str(exc))})") from None
    except RecursionError:
        raise RefAttnError(f"SPEC {path}: nested more than {MAX_SPEC_DEPTH} deep") from None
    except ValueError as exc:  # tomllib's int(): more digits than Python reads
        raise _unreadable_number(path, exc) from None


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError(f"SPEC {path}: reading YAML needs PyYAML (pip install pyyaml, or "
                           f"{install_hint('distributed')}); or write the SPEC in TOML"
                           ) from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it
    try:
        _scan_yaml(yaml, yaml.parse(text, Loader=loader), path)
        return yaml.load(text, Loader=loader)  # a safe loader; no alias got this far
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # PyYAML >= 6.0.4 scans ahead and stops first
            raise RefAttnError(f"SPEC {path}: nested more than {MAX_SPEC_DEPTH} deep") from None
        raise RefAttnError(f"SPEC {path}: not valid YAML ({_shorten(str(exc))})") from None
    except RecursionError:
        raise RefAttnError(f"SPEC {path}: nested more than {MAX_SPEC_DEPTH} deep") from None
    except ValueError as exc:  # PyYAML's int(): more digits than Python reads
        raise _unreadable_number(path, exc) from None


def _unreadable_number(path: Path, exc: ValueError) -> RefAttnError:
    """A parser's ValueError as one line: an integer longer than Python converts
    (``sys.get_int_max_str_digits()``, 4,300 digits by default), or another bad number."""
    if "integer string conversion" in str(exc):
        return RefAttnError(
            f"SPEC {path}: an integer of more than {sys.get_int_max_str_digits()} digits; "
            f"every SPEC integer is at most {_SEED_MAX} (20 digits)")
    return RefAttnError(f"SPEC {path}: a number that cannot be read ({_shorten(str(exc))})")


def _scan_yaml(yaml: Any, events: Any, path: Path) -> None:
    """Refuse aliases, and more than :data:`MAX_SPEC_VALUES` values or
    :data:`MAX_SPEC_DEPTH` levels, on the event stream: before any node is built."""
    depth = values = 0
    for event in events:
        if isinstance(event, yaml.AliasEvent):
            raise RefAttnError(
                f"SPEC {path}: line {event.start_mark.line + 1}: YAML alias *{event.anchor}: "
                "aliases are not allowed in a SPEC (a few of them can stand for billions of "
                "values); write the values out, or use [defaults]")
        if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            values += 1
            if values > MAX_SPEC_VALUES:
                raise RefAttnError(f"SPEC {path}: more than {MAX_SPEC_VALUES} values; split it "
                                   "into several sweeps")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                raise RefAttnError(f"SPEC {path}: line {event.start_mark.line + 1}: nested "
                                   f"more than {MAX_SPEC_DEPTH} deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def check_spec(doc: Any, shown: str = "SPEC") -> dict[str, Any]:
    """Validate a parsed SPEC against ``sweep-v1.json``; the first violation is named.

    Examples
    --------
    >>> check_spec({"name": "s", "grid": [{"shape": [[1, 1, 1, 2, 2, 4, 4]]}]})["name"]
    's'
    >>> try:
    ...     check_spec({"name": "s", "grid": [{"shapes": [[1, 1, 1, 2, 2, 4, 4]]}]})
    ... except RefAttnError as exc:
    ...     print(exc)
    SPEC: grid/0: Additional properties are not allowed ('shapes' was unexpected)
    >>> try:
    ...     check_spec({"name": "s", "grid": [{"shape": []}]})
    ... except RefAttnError as exc:
    ...     print(exc)
    SPEC: grid/0/shape: [] should be non-empty
    """
    _check_size(doc, shown)
    errors = list(itertools.islice(_validator().iter_errors(doc), _MAX_ERRORS))
    if errors:
        if any(e.validator == "anyOf" and not e.absolute_path for e in errors) and len(
                errors) == 1:
            raise RefAttnError(f"{shown}: (top level): no cases: give at least one [[grid]] "
                               "or [[case]] table")
        error = _deepest(errors)
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise RefAttnError(f"{shown}: {where}: {_shorten(error.message)}")
    return dict(doc)


def _check_size(doc: Any, shown: str) -> None:
    """Refuse a document of more than :data:`MAX_SPEC_VALUES` values (every occurrence of a
    shared or repeated object counted) or deeper than :data:`MAX_SPEC_DEPTH`; stops as soon
    as one is exceeded, so its cost is bounded whatever the document."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    values = 0
    while stack:
        obj, depth = stack.pop()
        values += 1
        if values > MAX_SPEC_VALUES:
            raise RefAttnError(f"{shown}: more than {MAX_SPEC_VALUES} values; split it into "
                               "several sweeps")
        if isinstance(obj, Mapping):
            children: Any = obj.values()
        elif isinstance(obj, (list, tuple)):
            children = obj
        else:
            continue
        if depth >= MAX_SPEC_DEPTH and children:
            raise RefAttnError(f"{shown}: nested more than {MAX_SPEC_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)


def _deepest(errors: list[Any]) -> Any:
    """The most specific error: jsonschema's best match, descending into oneOf/anyOf
    branches whose own errors are deeper (an unknown key inside one mask table, say)."""
    error = jsonschema.exceptions.best_match(errors)
    while error.context:
        best = jsonschema.exceptions.best_match(error.context)
        if len(best.absolute_path) < len(error.absolute_path):
            break
        if best.validator in ("const", "enum", "type") and error.validator in ("oneOf",
                                                                                "anyOf"):
            break  # "is not one of ..." on a branch says less than "not valid under any"
        error = best
    return error


def _shorten(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# -- normalisation --------------------------------------------------------------------------
def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _int(name: str, value: Any, *, lo: int, hi: int) -> int:
    """A SPEC's integer in ``[lo, hi]``: an int, or a float with no fraction (JSON Schema's
    integer: ``2.0`` is 2, as it always was here); anything else is refused by name."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return bounded_int(name, value, lo=lo, hi=hi)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RefAttnError(f"{name}: expected true or false, got {value!r}")
    return value


def _shape(value: Any) -> dict[str, int]:
    if isinstance(value, Mapping):
        missing = [a for a in _SHAPE_AXES if a not in value]
        if missing:
            raise RefAttnError(f"shape: missing {missing} (B, Hq, Hkv, Q, K, Dk, Dv)")
        items = [value[a] for a in _SHAPE_AXES]
    elif isinstance(value, (list, tuple)) and len(value) == len(_SHAPE_AXES):
        items = list(value)
    else:
        raise RefAttnError(f"shape: expected 7 integers B, Hq, Hkv, Q, K, Dk, Dv or a table, "
                           f"got {value!r:.80}")
    return {a: _int(f"shape {a}", x, lo=1, hi=MAX_EXTENT)
            for a, x in zip(_SHAPE_AXES, items, strict=True)}


def _score(value: Any) -> dict[str, Any]:
    family = value if isinstance(value, str) else value["family"]
    given = {} if isinstance(value, str) else dict(value)
    out: dict[str, Any] = {"family": family}
    extra = {k for k in given if k != "family"}
    allowed = {"dot": set(), "bilinear": {"shared"}, "cosine": {"eps"},
               "additive": {"da"}}[family]
    if extra - allowed:
        raise RefAttnError(f"score: {sorted(extra - allowed)} do not apply to the {family} "
                           f"family (it takes {sorted(allowed) or 'no parameters'})")
    if family == "bilinear":
        out["shared"] = _flag("score shared", given.get("shared", False))
    elif family == "cosine":
        out["eps"] = bounded_float("score eps", given.get("eps", 1e-6), lo=0.0, lo_open=True)
    elif family == "additive":
        out["da"] = _int("score da", given.get("da", 4), lo=1, hi=MAX_EXTENT)
    return out


def _mask(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        match value:
            case "none":
                return {"kind": "none"}
            case "causal_upper_left":
                return {"kind": "causal", "alignment": "upper_left"}
            case "causal_lower_right":
                return {"kind": "causal", "alignment": "lower_right"}
            case _:
                raise RefAttnError(f"mask: unknown mask {value!r}")
    kind = value["kind"]
    match kind:
        case "causal":
            return {"kind": kind, "alignment": value["alignment"]}
        case "window":  # a bound at or beyond K bounds nothing: MAX_EXTENT is enough
            return {"kind": kind,
                    "left": _int("mask left", value["left"], lo=0, hi=MAX_EXTENT),
                    "right": _int("mask right", value.get("right", 0), lo=0, hi=MAX_EXTENT),
                    "causal": _flag("mask causal", value.get("causal", False))}
        case "key_padding":
            return {"kind": kind, "pad": _int("mask pad", value["pad"], lo=1, hi=MAX_EXTENT)}
        case "prefix":
            return {"kind": kind,
                    "length": _int("mask length", value["length"], lo=0, hi=MAX_EXTENT)}
        case "segments":
            return {"kind": kind,
                    "count": _int("mask count", value["count"], lo=1, hi=MAX_EXTENT),
                    "causal": _flag("mask causal", value.get("causal", False))}
        case _:
            raise RefAttnError(f"mask: unknown mask kind {kind!r}")


def _dropout(value: Any) -> dict[str, Any] | None:
    if value == "none":
        return None
    # TOML and YAML spell inf and nan, which JSON Schema cannot refuse: bounded here
    return {"p": bounded_float("dropout p", value["p"], lo=0.0, hi=1.0, hi_open=True),
            "seed": _int("dropout seed", value["seed"], lo=0, hi=_SEED_MAX),
            "offset": _int("dropout offset", value.get("offset", 0), lo=0, hi=_OFFSET_MAX)}


def normalize(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The normalised description of one case (every field present, canonical types).

    Examples
    --------
    >>> d = normalize({"shape": [1, 2, 1, 3, 4, 8, 8], "mask": "causal_lower_right"})
    >>> d["shape"]["Hq"], d["mask"], d["score"], d["generator"]
    (2, {'kind': 'causal', 'alignment': 'lower_right'}, {'family': 'dot'}, 'exact')
    """
    merged = {**_BUILTIN_DEFAULTS, **fields}
    if "shape" not in merged:
        raise RefAttnError("shape: required (give it in the grid, the case or [defaults])")
    scale = merged["scale"]
    out = {
        "v": DESCRIPTION_VERSION,
        "shape": _shape(merged["shape"]),
        "score": _score(merged["score"]),
        "scale": "default" if scale == "default" else bounded_float(
            "scale", scale, lo=0.0, lo_open=True, hi=MAX_SCALE),
        "mask": _mask(merged["mask"]),
        "bias": str(merged["bias"]),
        "dropout": _dropout(merged["dropout"]),
        "seed": _int("seed", merged["seed"], lo=0, hi=_SEED_MAX),
        "generator": str(merged["generator"]),
    }
    quant = _quant(merged)
    if quant is not None:  # absent when not quantised: the ids of earlier sweeps stay the same
        out["quant"] = quant
    return out


def _quant(merged: Mapping[str, Any]) -> dict[str, Any] | None:
    """The normalised ``quant`` record of a case (None: not quantised)."""
    name = str(merged.get("quant", "none"))
    if name == "none":
        for key in ("quant_scale", "quant_values"):
            if key in merged:
                raise RefAttnError(f"{key}: applies to a quantised case only (give quant = "
                                   f"one of {', '.join(PRESETS)})")
        return None
    if name not in PRESETS:
        raise RefAttnError(f"quant: unknown preset {name!r}; expected none or one of "
                           f"{', '.join(PRESETS)}")
    # positive and finite here; the quant gate then wants a normal float32 value
    scale = bounded_float("quant_scale", merged.get("quant_scale", 1.0), lo=0.0, lo_open=True)
    if name == "sageattention_int8":  # it computes its q/k scales (amax / 127 per token block)
        scale = 1.0  # and casts v with scale 1: a grid's scales collapse to one case (dedup)
    values = str(merged.get("quant_values", "random"))
    if values not in _QUANT_VALUES:
        raise RefAttnError(f"quant_values: expected one of {', '.join(_QUANT_VALUES)}, got "
                           f"{values!r}")
    return {"preset": name, "scale": scale, "values": values}


def _digest(description: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(description).encode()).hexdigest()


def case_id(description: Mapping[str, Any]) -> str:
    """Stable id of a normalised description: a readable slug and 12 hex digits of its hash.

    Examples
    --------
    >>> d = normalize({"shape": [1, 2, 1, 3, 4, 8, 8], "mask": "causal_lower_right"})
    >>> case_id(d).rsplit("-", 1)[0]
    'dot-causal_lower_right-1x2x1x3x4x8x8'
    """
    s = description["shape"]
    mask = description["mask"]
    kind = mask["kind"]
    if kind == "causal":
        kind = f"causal_{mask['alignment']}"
    parts = [description["score"]["family"], kind, "x".join(str(s[a]) for a in _SHAPE_AXES)]
    if description["bias"] != "none":
        parts.append(description["bias"])
    if description["dropout"] is not None:
        parts.append("drop")
    if description["generator"] != "exact":
        parts.append(description["generator"])
    if description.get("quant") is not None:
        parts.append(description["quant"]["preset"])
    return "-".join(parts) + "-" + _digest(description)[:12]


# -- expansion --------------------------------------------------------------------------------
def expand(doc: Mapping[str, Any], *, validate: bool = True, shown: str = "SPEC",
           max_bytes: int | None = None, max_seconds: float = MAX_CASE_SECONDS,
           backend: str | None = None) -> Sweep:
    """Every case of a checked SPEC, normalised, deduplicated, sorted by id.

    Parameters
    ----------
    doc : dict
        A SPEC that passed :func:`check_spec`.
    validate : bool
        Check every case's estimated time and memory (:func:`check_budget`, from its shape
        alone), then build its call (the validation gate of :class:`~refattn.AttentionCall`),
        so that a case that cannot run is named before anything is computed.
    shown : str
        How errors name the SPEC.
    max_bytes : int, optional
        Memory one case may need (default: the memory available now, when it can be read).
    max_seconds : float
        Estimated seconds one case may take (default :data:`MAX_CASE_SECONDS`).
    backend : {"exact", "numpy", "numba"}, optional
        The generator of every case (``refattn sweep --backend``): a SPEC that names another
        one for some case is refused (say it once); None: the SPEC's, ``exact`` where it
        names none.

    Raises
    ------
    RefAttnError
        Naming the grid or case, the case's id and what is wrong (a case over the time or
        memory limit: its estimate and the limit; a call its generator does not write); or
        when the SPEC expands to more than :data:`MAX_CASES` cases.

    Examples
    --------
    >>> doc = {"name": "tiny", "grid": [{"shape": [[1, 1, 1, 2, 3, 4, 4]],
    ...                                 "mask": ["none", "causal_upper_left"], "seed": [0, 1]}]}
    >>> sweep = expand(check_spec(doc))
    >>> len(sweep.cases), sweep.suite, len(sweep.sweep_id)
    (4, 'sweep:tiny', 16)
    >>> doc["grid"][0]["seed"] = [1, 0]                  # another order, the same sweep
    >>> expand(check_spec(doc)).sweep_id == sweep.sweep_id
    True
    """
    defaults = dict(doc.get("defaults") or {})
    if validate and max_bytes is None:
        max_bytes = available_bytes()
    found: dict[str, SweepCase] = {}
    duplicates = 0
    total = 0

    def add(fields: Mapping[str, Any], origin: str) -> None:
        nonlocal duplicates
        merged = {**defaults, **fields}
        if backend is not None:
            named = merged.get("generator", backend)
            if named != backend:
                raise RefAttnError(f"{shown}: {origin}: generator: the SPEC names {named!r} "
                                   f"and --backend {backend!r}; give the generator once")
            merged["generator"] = backend
        try:
            description = normalize(merged)
        except RefAttnError as exc:
            raise RefAttnError(f"{shown}: {origin}: {exc}") from None
        cid = case_id(description)
        if cid in found:
            duplicates += 1
            return
        if validate:
            try:
                check_budget(description, cid, max_bytes=max_bytes, max_seconds=max_seconds)
            except RefAttnError as exc:
                raise RefAttnError(f"{shown}: {origin}: {exc}") from None
            try:
                built = build_case(description, cid)
                if description["generator"] == "numba":
                    check_generator(built, "numba")
            except RefAttnError as exc:
                raise RefAttnError(f"{shown}: {origin}: case {cid}: {exc}") from None
            except MemoryError:  # the estimate bounds the inputs; this is a last resort
                raise RefAttnError(f"{shown}: {origin}: case {cid}: out of memory drawing its "
                                   f"inputs (about {case_budget(description).input_bytes} "
                                   "bytes)") from None
        found[cid] = SweepCase(cid, description, origin)

    for g, grid in enumerate(doc.get("grid") or ()):
        keys = sorted(grid)
        size = math.prod(len(grid[k]) for k in keys)
        total += size
        if total > MAX_CASES:
            raise RefAttnError(f"{shown}: grid/{g}: the SPEC expands to more than {MAX_CASES} "
                               "cases; split it into several sweeps")
        for values in itertools.product(*(grid[k] for k in keys)):
            add(dict(zip(keys, values, strict=True)), f"grid/{g}")
    for n, fields in enumerate(doc.get("case") or ()):
        total += 1
        if total > MAX_CASES:
            raise RefAttnError(f"{shown}: case/{n}: the SPEC expands to more than {MAX_CASES} "
                               "cases; split it into several sweeps")
        add(fields, f"case/{n}")
    cases = tuple(found[c] for c in sorted(found))
    name = str(doc["name"])
    sweep_id = hashlib.sha256(_canonical(
        {"schema": "refattn_sweep_v1", "name": name, "cases": [c.case_id for c in cases]}
    ).encode()).hexdigest()[:16]
    return Sweep(name, sweep_id, cases, duplicates)


def load_sweep(path: str | os.PathLike, *, validate: bool = True, max_bytes: int | None = None,
               max_seconds: float = MAX_CASE_SECONDS, backend: str | None = None) -> Sweep:
    """:func:`read_spec`, :func:`check_spec` and :func:`expand` of one SPEC file.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "s.toml"
    >>> _ = p.write_text('name = "t"\\n[[grid]]\\nshape = [[1, 1, 1, 2, 2, 4, 4]]\\n'
    ...                  'score = ["dot", "cosine"]\\n')
    >>> [c.case_id.split("-")[0] for c in load_sweep(p).cases]
    ['cosine', 'dot']
    """
    shown = f"SPEC {path}"
    return expand(check_spec(read_spec(path), shown), validate=validate, shown=shown,
                  max_bytes=max_bytes, max_seconds=max_seconds, backend=backend)


# -- one case ---------------------------------------------------------------------------------
def _rng(description: Mapping[str, Any]) -> np.random.Generator:
    return np.random.default_rng(int(_digest(description)[:16], 16))


def _visibility(mask: Mapping[str, Any], B: int, Q: int, K: int) -> tuple[Any, list[str]]:
    """(visible relation or None, flags) of a normalised mask."""
    kind = mask["kind"]
    upper = np.arange(Q)[None]  # (1, Q) query coordinates aligned upper-left
    lower = (K - Q + np.arange(Q))[None]  # (1, Q) aligned lower-right (the last K rows)
    keys = np.arange(K)[None]  # (1, K)
    match kind:
        case "none":
            return None, []
        case "causal":
            flag = "UpperLeftCausal" if mask["alignment"] == "upper_left" else "LowerRightCausal"
            return causal(Q, K, alignment=mask["alignment"]), [flag]
        case "window":
            rel = relation(lower, keys, causal=mask["causal"],
                           window=(mask["left"], mask["right"]), alignment="lower_right")
            return rel, ["SlidingWindow"]
        case "key_padding":
            if mask["pad"] >= K:
                raise RefAttnError(f"mask: key_padding pad={mask['pad']} leaves no key of "
                                   f"K={K}; expected pad < K")
            valid = np.ones((B, K), dtype=bool)  # (B, K): the last batch row is padded
            valid[-1, K - mask["pad"]:] = False
            return relation(np.repeat(upper, B, 0), np.repeat(keys, B, 0), valid), [
                "KeyPadding"]
        case "prefix":
            if mask["length"] > min(Q, K):
                raise RefAttnError(f"mask: prefix length={mask['length']} exceeds "
                                   f"min(Q, K)={min(Q, K)}")
            return relation(upper, keys, prefix_length=mask["length"]), ["PrefixLM"]
        case "segments":
            if Q != K or mask["count"] > Q:
                raise RefAttnError(f"mask: segments need Q == K and count <= Q, got Q={Q}, "
                                   f"K={K}, count={mask['count']}")
            cu = np.linspace(0, Q, mask["count"] + 1).round().astype(np.int64)  # (count + 1,)
            seg = segments_from_cu_seqlens(cu)
            pos, ids = seg.positions[None], seg.segment_ids[None]  # (1, Q)
            rel = relation(pos, pos, causal=mask["causal"], q_segment=ids, k_segment=ids,
                           layout="packed")
            return rel, ["PackedSegments"]
        case _:
            raise RefAttnError(f"mask: unknown mask kind {kind!r}")


def build_case(description: Mapping[str, Any], cid: str | None = None) -> GoldenCase:
    """The golden case of a normalised description (its tensors drawn from its own hash).

    Parameters
    ----------
    description : dict
        From :func:`normalize`.
    cid : str, optional
        Its id (computed when not given).

    Raises
    ------
    RefAttnError
        When the description does not make a valid call (the gate's message, e.g. a row
        with no legal key, or Hq not a multiple of Hkv).

    Examples
    --------
    >>> d = normalize({"shape": [2, 4, 2, 3, 5, 8, 6], "dropout": {"p": 0.25, "seed": 7}})
    >>> case = build_case(d)
    >>> case.call.q.shape, case.grad_output.shape, case.flags
    ((2, 4, 3, 8), (2, 4, 3, 6), ('CrossAttention', 'DefaultScale', 'GQA', 'PhiloxDropout'))
    >>> bool((build_case(d).call.q == case.call.q).all())   # the same bytes every time
    True
    """
    cid = cid or case_id(description)
    s = description["shape"]
    B, Hq, Hkv, Q, K, Dk, Dv = (s[a] for a in _SHAPE_AXES)
    if Hq % Hkv:
        raise RefAttnError(f"shape: Hq={Hq} must be a multiple of Hkv={Hkv} (grouped heads)")
    rng = _rng(description)
    q = rng.standard_normal((B, Hq, Q, Dk))  # (B, Hq, Q, Dk)
    k = rng.standard_normal((B, Hkv, K, Dk))  # (B, Hkv, K, Dk)
    v = rng.standard_normal((B, Hkv, K, Dv))  # (B, Hkv, K, Dv)
    g_o = rng.standard_normal((B, Hq, Q, Dv))  # (B, Hq, Q, Dv)
    flags: list[str] = []
    kw: dict[str, Any] = {}
    score = description["score"]
    family = score["family"]
    match family:
        case "dot":
            pass
        case "bilinear":
            W = rng.standard_normal((Dk, Dk) if score["shared"] else (Hq, Dk, Dk))
            kw["score"] = Bilinear(W / math.sqrt(Dk))  # (Hq, Dk, Dk) or (Dk, Dk)
            flags.append("ScoreBilinear")
        case "cosine":
            kw["score"] = Cosine(eps=score["eps"])
            flags.append("ScoreCosine")
        case "additive":
            Da = score["da"]
            kw["score"] = Additive(rng.standard_normal((Hq, Da, Dk)) / math.sqrt(Dk),
                                   rng.standard_normal((Hq, Da, Dk)) / math.sqrt(Dk),
                                   rng.standard_normal((Hq, Da)), rng.standard_normal((Hq, Da)))
            flags.append("ScoreAdditive")
        case _:
            raise RefAttnError(f"score: unknown family {family!r}")
    scale = description["scale"]
    if scale == "default" and family != "dot":
        scale = Dk ** -0.5  # only the dot family has a default; the others need it explicit
    if scale != "default":
        kw["scale"] = float(scale)
    flags.append("DefaultScale" if scale == "default" else "ExplicitScale")
    visible, mask_flags = _visibility(description["mask"], B, Q, K)
    flags += mask_flags
    if visible is not None:
        kw["visible"] = visible
    match description["bias"]:
        case "none":
            pass
        case "random":
            kw["bias"] = rng.standard_normal((B, Hq, Q, K))  # (B, Hq, Q, K)
            flags.append("BiasFull")
        case "alibi":
            kw["bias"] = alibi(alibi_slopes(Hq), K - Q + np.arange(Q), np.arange(K))
            flags.append("ALiBi")
        case other:
            raise RefAttnError(f"bias: unknown bias {other!r}")
    drop = description["dropout"]
    if drop is not None:
        kw["dropout"] = Philox(drop["p"], seed=drop["seed"], offset=drop["offset"])
        flags.append("PhiloxDropout")
    if Hkv < Hq:
        flags.append("MQA" if Hkv == 1 else "GQA")
    if Q != K:
        flags.append("CrossAttention")
    quant = None
    if description.get("quant") is not None:
        q, k, v, spec = _quant_inputs(description["quant"], q, k, v)
        call, quant = quant_case(q, k, v, spec, **kw)
        flags.append("Quantized")
    else:
        call = AttentionCall(q, k, v, **kw)
    comment = (f"sweep case: {family} score, mask {_canonical(description['mask'])}, "
               f"(B,Hq,Hkv,Q,K,Dk,Dv)=({B},{Hq},{Hkv},{Q},{K},{Dk},{Dv}), bias "
               f"{description['bias']}, dropout {_canonical(drop)}, data seed "
               f"{description['seed']}, generator {description['generator']}")
    if quant is not None:
        comment += f", quantised {_canonical(description['quant'])}"
    return GoldenCase(cid, call, g_o, comment, tuple(sorted(flags)), quant=quant)


#: how a sweep draws quantised inputs (``quant_values``)
_QUANT_VALUES = ("random", "near_limit")
_EIGHT_BIT = ("e4m3fn", "e5m2", "int8")


def _quant_inputs(record: Mapping[str, Any], *draws: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
    """The kernel's q, k, v from the case's normal draws, and the preset's spec.

    An 8-bit input (e4m3fn, e5m2, int8): the draws times 16 (``random``), or magnitudes
    between 0.75 and 1.25 times the format's largest value (``near_limit``); a ``"codes"``
    input is then rounded onto the format's grid (saturating), a ``"cast"`` one (the kernel
    quantises ``x / scale``) multiplied by its scale and rounded onto its input format's grid,
    so that ``near_limit`` saturates in the kernel's own cast. A 16-bit input is the draws on
    its grid. Every scale of the spec is ``record["scale"]``, per tensor. The kv tile is the
    kernel's for the head dims; where its table has no single tile (a head dim the kernel does
    not build, or one chosen at run time), the whole row is one tile and the spec names no
    table.
    """
    name, scale, values = record["preset"], float(record["scale"]), record["values"]
    options = {"fa3_fp8": ("q_descale", "k_descale", "v_descale"),
               "flashinfer_sm90_fp8": ("q_scale", "k_scale", "v_scale"),
               "flashinfer_fp8_kv": ("k_scale", "v_scale"),
               "vllm_fp8_kv": ("q_scale", "k_scale", "v_scale"),
               "sageattention_int8": ()}[name]
    spec = preset(name, **dict.fromkeys(options, scale))
    rule = kernel_tiles(spec.tile_table, draws[0].shape[-1], draws[2].shape[-1])
    if rule.tile is None:  # a head dim the kernel has no single tile for: one tile, no table
        spec = spec.replace(tile_table="", kv_tile=None)
    out = []
    for tq, x in zip((spec.q, spec.k, spec.v), draws, strict=True):
        fmt = tq.format if tq.source == "codes" else tq.input_format
        top = format_max(tq.format)
        if tq.format in _EIGHT_BIT:
            if values == "near_limit":  # |x| in [0.75, 1.25) x the largest value, signs kept
                x = np.sign(x) * top * (0.75 + 0.5 * np.abs(np.tanh(x)))
            else:
                x = x * 16.0
            if tq.source == "cast" and tq.scale is not None:
                x = x * scale
        if fmt is None:
            out.append(x)
            continue
        rounding = "half_away_from_zero" if fmt == "int8" else "nearest_even_satfinite"
        out.append(quantize(x, fmt, rounding))
    return out[0], out[1], out[2], spec


class CaseBudget(NamedTuple):
    """What a case will cost, estimated from its shape before any tensor exists.

    Attributes
    ----------
    seconds : float
        Computing it and checking it against the exact real result: the exact generator's
        own estimate (:func:`refattn.engine.exact.backend.estimate_seconds`), which the
        reference-error check every exact or numpy case gets costs about as much as; for the
        bilinear family, plus the products with W, which that estimate leaves out. A numba
        case (no reference error): the fused kernel and its recorded bound, measured.
    bytes : int
        Peak memory of computing and checking it (an upper estimate, measured).
    input_bytes : int
        Its random inputs alone (q, k, v, grad_output, a random bias, score parameters).
    scores : int
        Its score elements, B * Hq * Q * K.
    """

    seconds: float
    bytes: int
    input_bytes: int
    scores: int


def case_budget(description: Mapping[str, Any]) -> CaseBudget:
    """The estimated time and memory of a normalised case, from its shape alone.

    Exact integer arithmetic on the seven axes: any shape the schema admits (up to 65536 on
    each) gives a number, never an overflow, and nothing is allocated.

    Examples
    --------
    >>> b = case_budget(normalize({"shape": [1, 2, 1, 128, 128, 64, 64]}))
    >>> b.scores, round(b.seconds, 2), b.bytes // 2**20
    (32768, 0.79, 88)
    >>> case_budget(normalize({"shape": [65536] * 7})).bytes > 2**74   # no overflow
    True
    >>> fast = case_budget(normalize({"shape": [1, 8, 2, 2048, 2048, 128, 128],
    ...                               "generator": "numba"}))
    >>> round(fast.seconds, 1), fast.bytes // 2**20
    (17.2, 456)
    """
    s = description["shape"]
    B, Hq, Hkv, Q, K, Dk, Dv = (int(s[a]) for a in _SHAPE_AXES)
    n = B * Hq * Q * K  # (B, Hq, Q, K) score elements
    score = description["score"]
    da = int(score["da"]) if score["family"] == "additive" else 0
    rows = B * Hq * (Q + K) * (Dk + Dv)  # q, k, v and output rows, per query head
    seconds = SECONDS_PER_ELEMENT * (4 * n * max(da, 1) + rows)
    w = 0  # elements of the bilinear W: (Dk, Dk) shared or (Hq, Dk, Dk)
    if score["family"] == "bilinear":
        w = Dk * Dk * (1 if score["shared"] else Hq)
        # q W and its gradient: measured 7.5e-6 s per element of W per head at Q + K = 8,
        # growing by 2.5e-7 s per further row (the exact generator's estimate leaves it out)
        seconds += SECONDS_PER_ELEMENT * B * Hq * Dk * Dk * (2 + (Q + K) / 8)
    inputs = B * (Hq * Q * (Dk + Dv) + Hkv * K * (Dk + Dv))  # q, grad_output; k, v
    if description["bias"] == "random":
        inputs += n  # (B, Hq, Q, K)
    inputs += w  # W
    inputs += Hq * da * (2 * Dk + 2)  # the additive family's two projections and two vectors
    peak = (_BYTES_PER_SCORE + _BYTES_PER_SCORE_PER_DA * da) * n + _BYTES_PER_ROW_ELEMENT * rows
    if w:
        peak += _BYTES_PER_W * w + _BYTES_PER_W_USE * B * Hq * Dk * Dk
    if description.get("generator") == "numba":  # saved state: no (B, Hq, Q, K) tensor
        seconds = _NUMBA_SECONDS_PER_SCORE_WIDTH * n * (Dk + Dv) + SECONDS_PER_ELEMENT * w
        peak = _NUMBA_FIXED_BYTES + _NUMBA_TENSOR_COPIES * 8 * inputs
    if description.get("quant") is not None:  # the emulated pipeline, besides the real result
        seconds += _QUANT_SECONDS_PER_SCORE * n
        peak += _QUANT_BYTES_PER_SCORE * n
    return CaseBudget(seconds, peak + 8 * inputs, 8 * inputs, n)


def check_budget(description: Mapping[str, Any], cid: str | None = None, *,
                 max_bytes: int | None, max_seconds: float = MAX_CASE_SECONDS) -> CaseBudget:
    """Refuse a case whose estimated memory or time (:func:`case_budget`) is over a limit.

    Parameters
    ----------
    description : dict
        From :func:`normalize`.
    cid : str, optional
        Its id (for the message; computed when not given).
    max_bytes : int or None
        Memory the case may need (None: not checked).
    max_seconds : float
        Estimated seconds the case may take.

    Returns
    -------
    CaseBudget

    Raises
    ------
    RefAttnError
        Naming the case, its estimate and the limit.

    Examples
    --------
    >>> d = normalize({"shape": [8, 64, 64, 2048, 2048, 64, 64]})
    >>> try:
    ...     check_budget(d, "big", max_bytes=16 * 2**30)
    ... except RefAttnError as exc:
    ...     print(str(exc)[:75])
    case big: needs about 3472481058816 bytes (3234.0 GiB) of memory to compute
    """
    budget = case_budget(description)
    where = f"case {cid or case_id(description)}: "
    if max_bytes is not None and budget.bytes > max_bytes:
        raise RefAttnError(
            f"{where}needs about {budget.bytes} bytes ({budget.bytes / 2**30:.1f} GiB) of "
            f"memory to compute and check ({budget.scores} score elements), more than the "
            f"limit of {max_bytes} bytes ({max_bytes / 2**30:.1f} GiB); use a smaller shape")
    if budget.seconds > max_seconds:
        raise RefAttnError(
            f"{where}would take about {budget.seconds:.3g} s to compute and check "
            f"({budget.scores} score elements, each correctly rounded), over the limit of "
            f"{max_seconds:g} s per case; use a smaller shape")
    return budget


def cost(description: Mapping[str, Any]) -> float:
    """A rough relative cost of computing a case (for dealing cases into tasks).

    Examples
    --------
    >>> small = normalize({"shape": [1, 1, 1, 2, 2, 4, 4]})
    >>> big = normalize({"shape": [1, 4, 4, 64, 64, 16, 16]})
    >>> cost(big) > cost(small)
    True
    """
    s = description["shape"]
    pairs = s["B"] * s["Hq"] * s["Q"] * s["K"]
    work = pairs * (s["Dk"] + s["Dv"] + 16)
    if description["score"]["family"] == "additive":
        work += pairs * description["score"]["da"] * 8
    return 2e4 + float(work)


def case_cost_order(cases: Sequence[SweepCase]) -> list[SweepCase]:
    """Cases by decreasing :func:`cost` (ties by id): dealt to tasks largest first."""
    return sorted(cases, key=lambda c: (-cost(c.description), c.case_id))

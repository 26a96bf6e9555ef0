"""ONNX adapter: one golden case as an ONNX ``Attention`` node (opset 23, and 24's additions).

Owns the lowering of a case's semantic call (:class:`~refattn.bundle.golden.spec.CaseSpec`) to the
``Attention`` operator, running it with the ONNX reference evaluator
(``onnx.reference.ReferenceEvaluator``) or onnxruntime, and exporting it in ONNX's backend-test
layout (``model.onnx`` plus ``test_data_set_0/input_*.pb`` and ``output_*.pb``), so runtime
authors can drop refattn goldens into their node tests. The operator's conventions, from its
schema (``onnx.defs.get_schema("Attention", 23 / 24)``) and the reference implementation
(``onnx/reference/ops/op_attention.py``):

- ``scale`` is the multiplier alpha (default ``1/sqrt(head_size)``), applied as ``sqrt(scale)``
  to Q and to K before the product: refattn's ``split`` placement, whatever the case's own
  placement (the same real-number model; the float32 comparison absorbs the rounding). The
  attribute is a 32-bit float and onnx's reference evaluator takes its square root in float32,
  so a float64 node gets ``scale=1.0`` with alpha folded into Q on the host;
- ``softcap`` caps the scaled product before the mask is added (refattn's order);
- ``attn_mask``: bool with True = takes part (refattn's polarity), or float added to the
  scores (here: the case's finite bias with -inf where not visible);
- ``is_causal=1`` is bottom-right aligned with ``offset`` = the past length (``past_key``), or
  ``nonpad_kv_seqlen - Q`` (opset 24's external cache), else 0 (upper-left);
- ``past_key`` / ``past_value`` are concatenated in front of K / V (``present_key`` is the
  concatenation); grouped heads repeat each kv head (query head h reads kv head h // G);
- a row with no attendable key gives a zero output row (refattn: the row is unused under
  ``sanitize_then_zero_invalid_query`` and so also zero);
- ``qk_matmul_output_mode`` 0 / 1 / 2 / 3 exposes the product, the softcapped product, the
  scores with the mask added, and the probabilities (refattn's ``softcap_input`` or
  ``scores``, ``scores``, ``masked_scores``, ``probs``).

Not expressible (:func:`ineligible`): other score families, dropout (the operator has none),
sinks (no sink input in opsets 23/24), and query rows that are unused (``query_valid`` False)
but have legal keys (the operator computes every row). An explicit head map other than the
grouped one is lowered by expanding K/V to the query heads. onnx and onnxruntime are imported
inside functions only; the lowering decisions (:func:`lowering`, :func:`ineligible`) are pure
numpy. Defers the verdict to :mod:`refattn.bundle.comparison.harness`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import bounded_int
from refattn.adapters import AdapterResult, semantic_limits
from refattn.bundle.golden.spec import CaseSpec
from refattn.engine.reduce import gather_heads
from refattn.errors import RefAttnError

__all__ = ["OPSETS", "QK_OUTPUT", "OnnxLowering", "OnnxNode", "build", "export_backend_test",
           "ineligible", "lowering", "run"]

#: opsets whose Attention schema this adapter targets (24 adds ``nonpad_kv_seqlen``)
OPSETS = (23, 24)
#: qk_matmul_output_mode -> the canonical tensor it exposes (mode 0 with a softcap: the input
#: of the cap)
QK_OUTPUT = {0: "scores", 1: "scores", 2: "masked_scores", 3: "probs"}
Runtime = Literal["reference", "onnxruntime"]
_DTYPES = {"float32": np.float32, "float64": np.float64}


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError(f"onnx adapter: onnx is not installed ({install_hint('test')} "
                           "or pip install onnx)") from None
    return onnx


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise RefAttnError("onnx adapter: onnxruntime is not installed (pip install "
                           "onnxruntime)") from None
    return onnxruntime


def _check_opset(opset: int) -> int:
    """``opset`` as one of :data:`OPSETS` (consecutive: a range) as an int; ``23.0`` and
    ``True`` are refused."""
    return bounded_int("opset", opset, lo=min(OPSETS), hi=max(OPSETS))


def _check_qk_mode(qk_mode: int | None) -> int | None:
    """``qk_mode`` as a key of :data:`QK_OUTPUT` or None (``True`` is not mode 1)."""
    return None if qk_mode is None else bounded_int("qk_mode", qk_mode, lo=min(QK_OUTPUT),
                                                     hi=max(QK_OUTPUT))


@public
def ineligible(spec: CaseSpec) -> str | None:
    """Why the ONNX ``Attention`` operator cannot express ``spec``, or None when it can.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> ineligible(case_spec(build_suite("contract")[0]))
    'dropout multiplier (the Attention operator has no dropout)'
    >>> ineligible(case_spec(build_suite("contract")[1])) is None
    True
    """
    lim = semantic_limits(spec)
    if lim["family"] != "dot":
        return f"score family {lim['family']!r} (the Attention operator computes dot products)"
    if lim["dropout"]:
        return "dropout multiplier (the Attention operator has no dropout)"
    if lim["sink"]:
        return "sink logit (no sink input in Attention opsets 23 and 24)"
    has_key = spec.visible_full().any(axis=-1)  # (B, Hq, Q)
    unused = ~spec.query_valid_full()[:, 0, :, 0]  # (B, Q)
    rows = np.argwhere(unused[:, None, :] & has_key)
    if rows.size:
        b, h, i = (int(x) for x in rows[0])
        return (f"query_valid is False on row (b={b}, h={h}, i={i}), which has legal keys (the "
                "Attention operator computes every row; refattn zeroes unused rows)")
    return None


@public
@dataclass(frozen=True)
class OnnxLowering:
    """How a case becomes one ``Attention`` node (pure decisions; no onnx needed).

    Attributes
    ----------
    opset : int
    dtype : {"float32", "float64"}
    mask : {"none", "bool", "float"}
        ``bool``: the visibility (True takes part); ``float``: bias with -inf off the support.
    is_causal : bool
    past : int
        Keys passed as ``past_key`` / ``past_value`` (0: none); with ``is_causal`` this is the
        bottom-right offset.
    nonpad_kv_seqlen : tuple of int or None
        Opset 24's per-batch valid key count (a key-padding relation).
    expand_kv : bool
        K/V expanded to the query heads by ``head_map`` (not the grouped map).
    scale : float
        The ``scale`` attribute: alpha (float32 nodes), or 1.0 (float64 nodes).
    query_multiplier : float
        1.0, or alpha folded into Q on the host for a float64 node: an ONNX float attribute
        is 32-bit, and the reference evaluator takes ``sqrt(scale)`` of it in float32, which
        would round alpha's square root to float32 inside a float64 node.
    softcap : float or None
    qk_mode : int or None
        ``qk_matmul_output_mode`` when the ``qk_matmul_output`` output is requested.
    """

    opset: int
    dtype: str
    mask: Literal["none", "bool", "float"]
    is_causal: bool
    past: int
    nonpad_kv_seqlen: tuple[int, ...] | None
    expand_kv: bool
    scale: float
    query_multiplier: float
    softcap: float | None
    qk_mode: int | None


def _prefix_lengths(vis: np.ndarray) -> np.ndarray | None:
    """Per batch row n with ``vis[b, h, i, j] == (j < n)`` everywhere, or None."""
    K = vis.shape[3]
    n = vis[:, 0, 0, :].sum(axis=-1)  # (B,)
    want = np.arange(K)[None, None, None, :] < n[:, None, None, None]
    return n if (n >= 1).all() and np.array_equal(vis, np.broadcast_to(want, vis.shape)) else None


@public
def lowering(spec: CaseSpec, *, opset: int = 23, qk_mode: int | None = None,
             dtype: str = "float32") -> OnnxLowering:
    """The ``Attention`` node that expresses ``spec`` (refuses an ineligible case).

    Visibility: every edge legal needs no mask; the upper-left triangle is ``is_causal=1``;
    the lower-right triangle (K > Q) is ``is_causal=1`` with the first ``K - Q`` keys as
    ``past_key`` / ``past_value`` (the operator's internal cache: offset = past length);
    with opset 24 a key-padding relation is ``nonpad_kv_seqlen``; anything else (and any
    case with a bias) is an explicit mask.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> low = lowering(case_spec(CASES["causal_lower_right_q3_k7"]()))
    >>> low.is_causal, low.past, low.mask
    (True, 4, 'none')
    >>> lowering(case_spec(CASES["key_padding_lengths_7_5_2"]()), opset=24).nonpad_kv_seqlen
    (7, 5, 2)
    """
    opset = _check_opset(opset)
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise RefAttnError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    qk_mode = _check_qk_mode(qk_mode)
    why = ineligible(spec)
    if why is not None:
        raise RefAttnError(f"{spec.case_id}: not expressible as an ONNX Attention node: {why}")
    a = spec.axes
    Q, K = a["Q"], a["K"]
    vis = spec.visible_full()  # (B, Hq, Q, K)
    has_bias = "bias" in spec.tensors
    upper_left = np.array_equal(vis, np.broadcast_to(np.tri(Q, K, dtype=bool), vis.shape))
    lower_right = K > Q and np.array_equal(
        vis, np.broadcast_to(np.tri(Q, K, K - Q, dtype=bool), vis.shape))
    mask: Literal["none", "bool", "float"] = "none"
    is_causal, past, nonpad = False, 0, None
    if has_bias:
        mask = "float"
    elif vis.all():
        pass
    elif upper_left:
        is_causal = True
    elif lower_right:
        is_causal, past = True, K - Q
    elif opset >= 24 and (lengths := _prefix_lengths(vis)) is not None:
        nonpad = tuple(int(n) for n in lengths)
    else:
        mask = "bool"
    grouped = spec.head_map_mode == "grouped"
    scale, fold = float(spec.scale), 1.0
    if dtype == "float64":  # a 32-bit attribute cannot carry alpha: fold it into Q
        scale, fold = 1.0, float(spec.scale)
        cap = spec.softcap
        if cap is not None and float(np.float32(cap)) != cap:
            raise RefAttnError(f"{spec.case_id}: softcap {cap!r} is not a float32 value; the "
                               "softcap attribute is 32-bit, so a float64 node would cap at "
                               "another value (use dtype='float32')")
    return OnnxLowering(opset, dtype, mask, is_causal, past, nonpad, not grouped,
                        scale, fold, spec.softcap, qk_mode)


@public
@dataclass(frozen=True, eq=False)
class OnnxNode:
    """One case as an ONNX model: the model, its feeds and what each output is."""

    model: Any
    """onnx.ModelProto with one Attention node."""
    feeds: dict[str, np.ndarray]
    """Graph input name -> array, in graph input order."""
    outputs: dict[str, str]
    """Graph output name -> canonical refattn tensor name."""
    expected: dict[str, np.ndarray]
    """Graph output name -> the golden value in the node's dtype."""
    lowering: OnnxLowering


@public
def build(spec: CaseSpec, *, opset: int = 23, qk_mode: int | None = None,
          dtype: str = "float32") -> OnnxNode:
    """The ONNX model, feeds and golden expectations of ``spec``.

    Examples
    --------
    >>> import pytest; _ = pytest.importorskip("onnx")
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> node = build(case_spec(CASES["causal_lower_right_q3_k7"]()))
    >>> list(node.feeds)
    ['Q', 'K', 'V', 'past_key', 'past_value']
    >>> node.outputs
    {'Y': 'output', 'present_key': 'k', 'present_value': 'v'}
    """
    onnx = _onnx()
    from onnx import TensorProto, helper

    low = lowering(spec, opset=opset, qk_mode=qk_mode, dtype=dtype)
    opset, np_dtype = low.opset, _DTYPES[dtype]  # the opset as bounded
    elem = TensorProto.FLOAT if dtype == "float32" else TensorProto.DOUBLE
    t = spec.tensors
    q, k, v = (np.asarray(t[n]) for n in ("q", "k", "v"))
    if low.expand_kv:  # an explicit head map: K/V per query head (the operator groups only)
        k, v = gather_heads(k, t["head_map"]), gather_heads(v, t["head_map"])
    if low.query_multiplier != 1.0:
        q = q * low.query_multiplier  # alpha on the host: the q placement, one product each
    feeds: dict[str, np.ndarray] = {"Q": q.astype(np_dtype)}
    past = low.past
    feeds["K"] = k[:, :, past:].astype(np_dtype)
    feeds["V"] = v[:, :, past:].astype(np_dtype)
    vis = spec.visible_full()
    if low.mask == "bool":
        feeds["attn_mask"] = np.ascontiguousarray(vis)  # True takes part: refattn's polarity
    elif low.mask == "float":  # the finite bias where visible, -inf elsewhere
        bias = np.broadcast_to(t["bias"], vis.shape)
        feeds["attn_mask"] = np.where(vis, bias, -np.inf).astype(np_dtype)
    if past:
        feeds["past_key"] = k[:, :, :past].astype(np_dtype)
        feeds["past_value"] = v[:, :, :past].astype(np_dtype)
    if low.nonpad_kv_seqlen is not None:
        feeds["nonpad_kv_seqlen"] = np.array(low.nonpad_kv_seqlen, dtype=np.int64)
    slots = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
    node_inputs = [n if n in feeds else "" for n in slots]
    while node_inputs[-1] == "":
        node_inputs.pop()
    outputs = {"Y": "output"}
    node_outputs = ["Y"]
    if past or low.qk_mode is not None:
        node_outputs += ["present_key", "present_value"]
        if not low.expand_kv:
            outputs |= {"present_key": "k", "present_value": "v"}
    if low.qk_mode is not None:
        node_outputs.append("qk_matmul_output")
        name = QK_OUTPUT[low.qk_mode]
        if low.qk_mode == 0 and spec.softcap is not None:
            name = "softcap_input"
        outputs["qk_matmul_output"] = name
    attrs: dict[str, Any] = {"scale": low.scale}
    if low.is_causal:
        attrs["is_causal"] = 1
    if low.softcap is not None:
        attrs["softcap"] = low.softcap
    if low.qk_mode is not None:
        attrs["qk_matmul_output_mode"] = low.qk_mode

    def info(name: str, arr: np.ndarray) -> Any:
        kind = (TensorProto.BOOL if arr.dtype == np.bool_ else
                TensorProto.INT64 if arr.dtype == np.int64 else elem)
        return helper.make_tensor_value_info(name, kind, list(arr.shape))

    expected: dict[str, np.ndarray] = {}
    out_infos = []
    for name in node_outputs:
        if name in outputs:
            gold = np.asarray(t[outputs[name]]).astype(np_dtype)
        elif name == "present_key":
            gold = k.astype(np_dtype)
        else:
            gold = v.astype(np_dtype)
        expected[name] = gold
        out_infos.append(info(name, gold))
    node = helper.make_node("Attention", node_inputs, node_outputs, **attrs)
    graph = helper.make_graph([node], f"refattn_{spec.case_id}",
                              [info(n, a) for n, a in feeds.items()], out_infos)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="refattn")
    onnx.checker.check_model(model)
    return OnnxNode(model, feeds, outputs, expected, low)


@public
def run(spec: CaseSpec, *, runtime: Runtime = "reference", opset: int = 23,
        qk_mode: int | None = None, dtype: str = "float32") -> AdapterResult:
    """Run ``spec`` as an ONNX ``Attention`` node; candidate tensors under canonical names.

    Parameters
    ----------
    spec : CaseSpec
    runtime : {"reference", "onnxruntime"}
        ``onnx.reference.ReferenceEvaluator`` or an onnxruntime CPU session (one thread).
    opset : {23, 24}
    qk_mode : {0, 1, 2, 3}, optional
        Also request ``qk_matmul_output`` in that mode.
    dtype : {"float32", "float64"}
        The node's T1/T2 (onnxruntime's CPU kernel takes float32).

    Returns
    -------
    AdapterResult
        ``tensors``: ``output``, ``k`` / ``v`` when the node returns the present cache, and
        the ``qk_matmul_output`` tensor under its canonical name; ``.compare(spec)`` applies
        the precision's rule.

    Examples
    --------
    >>> import pytest; _ = pytest.importorskip("onnx")
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> spec = case_spec(build_suite("contract")[1])
    >>> res = run(spec)
    >>> res.path, res.precision, res.compare(spec).passed
    ('onnx.reference', 'float32', True)
    """
    node = build(spec, opset=opset, qk_mode=qk_mode, dtype=dtype)
    opset = node.lowering.opset
    names = [o.name for o in node.model.graph.output]
    match runtime:
        case "reference":
            from onnx.reference import ReferenceEvaluator

            values = ReferenceEvaluator(node.model).run(None, node.feeds)
            version = f"onnx {_onnx().__version__} ReferenceEvaluator"
        case "onnxruntime":
            ort = _ort()
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1  # a fixed reduction order
            session = ort.InferenceSession(node.model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
            values = session.run(names, node.feeds)
            version = f"onnxruntime {ort.__version__} CPUExecutionProvider"
        case _:
            raise RefAttnError(f"runtime: expected 'reference' or 'onnxruntime', got {runtime!r}")
    tensors = {node.outputs[n]: np.asarray(x) for n, x in zip(names, values, strict=True)
               if n in node.outputs}
    manifest = copy.deepcopy(dict(spec.call_manifest))
    low = node.lowering
    manifest["backend"] = {
        **manifest.get("backend", {}), "framework_revision": version,
        "entrypoint": f"ai.onnx Attention (opset {opset})", "requested_backend": runtime,
        "selected_backend": runtime, "is_causal": low.is_causal,
        "external_mask_kind": {"none": "none", "bool": "bool_true_means_attend",
                               "float": "additive_float_minus_inf"}[low.mask],
        "scale_applied": ("sqrt(scale) on Q and on K (the split placement)" if dtype ==
                          "float32" else "alpha folded into Q on the host, scale=1.0"),
        "past_key_length": low.past, "nonpad_kv_seqlen": low.nonpad_kv_seqlen,
        "kv_expanded": low.expand_kv, "qk_matmul_output_mode": low.qk_mode,
    }
    path = "onnx.reference" if runtime == "reference" else "onnx.onnxruntime"
    return AdapterResult(spec.case_id, path, dtype, tensors, manifest)


@public
def export_backend_test(spec: CaseSpec, directory: str | Path, *, opset: int = 23,
                        qk_mode: int | None = None, dtype: str = "float32") -> Path:
    """Write ``spec`` in ONNX's backend-test layout (a node test).

    ``DIR/test_refattn_<case_id>/model.onnx`` and ``test_data_set_0/input_<n>.pb`` (the
    graph inputs in order) and ``output_<n>.pb`` (the golden values rounded to ``dtype``),
    each a TensorProto named after its graph input or output, as in
    ``onnx/backend/test/data/node``.

    Returns
    -------
    Path
        The test directory.

    Examples
    --------
    >>> import pytest, tempfile; _ = pytest.importorskip("onnx")
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites import build_suite
    >>> out = export_backend_test(case_spec(build_suite("contract")[1]), tempfile.mkdtemp())
    >>> sorted(p.name for p in (out / "test_data_set_0").iterdir())
    ['input_0.pb', 'input_1.pb', 'input_2.pb', 'input_3.pb', 'output_0.pb']
    """
    onnx = _onnx()
    from onnx import numpy_helper

    node = build(spec, opset=opset, qk_mode=qk_mode, dtype=dtype)
    root = Path(directory) / f"test_refattn_{spec.case_id}"
    data = root / "test_data_set_0"
    data.mkdir(parents=True, exist_ok=True)
    onnx.save(node.model, root / "model.onnx")
    for n, (name, arr) in enumerate(node.feeds.items()):
        (data / f"input_{n}.pb").write_bytes(
            numpy_helper.from_array(arr, name).SerializeToString())
    for n, out in enumerate(node.model.graph.output):
        (data / f"output_{n}.pb").write_bytes(
            numpy_helper.from_array(node.expected[out.name], out.name).SerializeToString())
    return root

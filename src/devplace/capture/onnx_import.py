"""Import an ONNX model as a training-step `CompGraph` by mirroring its forward graph.

An ONNX file holds a forward (inference) graph only. `load_onnx` reads it, runs ONNX shape inference to
size every tensor, turns each ONNX node into a forward op, and then builds the rest of the training step
by **mirroring**: one backward op per forward op that needs a gradient (2x its FLOPs, reading the forward
op's inputs and sending gradients along the reversed edges), one optimizer op per trainable initializer
and one loss op at the end of the forward pass. That is an approximation of the real backward pass, and
the graph's metadata says so (`meta["capture"]["approximation"]`). The formulas are in docs/onnx.md;
the node and edge keys follow docs/capture-format.md.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devplace.errors import DevplaceError, FormatError
from devplace.files import read_limited
from devplace.graph.compgraph import CompGraph

OPTIMIZERS = {"adam": 2, "sgd": 0, "none": 0}  # optimizer states per parameter element
OPTIMIZER_FLOPS = {"adam": 12, "sgd": 2}  # FLOPs per parameter element of one update
OPTIMIZER_ACCESS = {"adam": 7, "sgd": 3}  # tensors of parameter size read + written by one update

APPROXIMATION = (
    "backward mirrored: one op per forward op with 2x its FLOPs (only forward ops that need a gradient, i.e. "
    "that depend on a trainable initializer and lead to an output), reading the forward op's inputs and "
    "sending gradients of the tensors' exact sizes along the reversed edges, with 2x the forward op's memory "
    "traffic; one optimizer op per trainable initializer (floating point, rank >= 1, read by a "
    "differentiable input of an op); one loss op reading every floating-point graph output; "
    "FLOPs of forward ops by devplace's per-op formulas (docs/onnx.md), 0 for ops without one"
)

# Element sizes in bits, by the name of the TensorProto data type (names a given onnx version lacks are skipped).
_BITS_BY_NAME = {
    "FLOAT": 32, "UINT8": 8, "INT8": 8, "UINT16": 16, "INT16": 16, "INT32": 32, "INT64": 64, "BOOL": 8,
    "FLOAT16": 16, "DOUBLE": 64, "UINT32": 32, "UINT64": 64, "COMPLEX64": 64, "COMPLEX128": 128,
    "BFLOAT16": 16, "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8,
    "FLOAT8E8M0": 8, "UINT4": 4, "INT4": 4, "FLOAT4E2M1": 4, "UINT2": 2, "INT2": 2, "FLOAT6E2M3": 6,
    "FLOAT6E3M2": 6,
}
_TRAINABLE_TYPES = ("FLOAT", "FLOAT16", "DOUBLE", "BFLOAT16")
_DTYPE_NAMES = {"FLOAT": "float32", "DOUBLE": "float64", "FLOAT16": "float16", "BFLOAT16": "bfloat16"}

# Input slots that never carry a gradient (shapes, indices, axes, running statistics, masks, bounds).
_NONDIFF_SLOTS: dict[str, frozenset[int]] = {
    "BatchNormalization": frozenset({3, 4}),
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}), "Split": frozenset({1}), "Slice": frozenset({1, 2, 3, 4}),
    "Pad": frozenset({1, 2, 3}), "Resize": frozenset({1, 2, 3}), "Upsample": frozenset({1}),
    "Gather": frozenset({1}), "GatherElements": frozenset({1}), "GatherND": frozenset({1}),
    "Scatter": frozenset({1}), "ScatterElements": frozenset({1}), "ScatterND": frozenset({1}),
    "TopK": frozenset({1}), "CumSum": frozenset({1}), "Trilu": frozenset({1}), "Clip": frozenset({1, 2}),
    "Dropout": frozenset({1, 2}), "Where": frozenset({0}), "Attention": frozenset({3, 4, 5, 6}),
    "ReduceSum": frozenset({1}), "ReduceMean": frozenset({1}), "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}), "ReduceProd": frozenset({1}), "ReduceL1": frozenset({1}),
    "ReduceL2": frozenset({1}), "ReduceLogSum": frozenset({1}), "ReduceLogSumExp": frozenset({1}),
    "ReduceSumSquare": frozenset({1}), "LSTM": frozenset({4}), "GRU": frozenset({4}), "RNN": frozenset({4}),
    "OneHot": frozenset({0, 1, 2}), "ConstantOfShape": frozenset({0}), "Range": frozenset({0, 1, 2}),
}
# Ops that change only the view of a tensor: their outputs allocate nothing (docs/capture-format.md).
_VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# Ops that move or describe data and compute nothing: 0 FLOPs by definition (not "without a formula").
_ZERO_FLOP_OPS = frozenset({
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Concat", "Split", "Slice",
    "Gather", "GatherElements", "GatherND", "Scatter", "ScatterElements", "ScatterND", "Expand", "Tile", "Pad",
    "Shape", "Size", "Constant", "ConstantOfShape", "Cast", "CastLike", "DepthToSpace", "SpaceToDepth",
    "Compress", "ReverseSequence", "Trilu", "EyeLike", "OneHot", "Range", "NonZero", "SequenceConstruct",
    "SplitToSequence", "SequenceAt", "ConcatFromSequence",
})
_UNARY_OPS = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Clip", "Cos", "Cosh", "Dropout",
    "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu", "Log",
    "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh",
    "Softplus", "Softsign", "Sqrt", "Swish", "Tan", "Tanh", "ThresholdedRelu",
})
_BINARY_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "PRelu", "Equal", "Greater", "GreaterOrEqual", "Less",
    "LessOrEqual", "And", "Or", "Xor", "Where", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitShift",
})
_VARIADIC_OPS = frozenset({"Sum", "Max", "Min", "Mean"})
_REDUCE_OPS = frozenset({
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin", "CumSum",
})
_NORM_OPS = frozenset({
    "BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "RMSNormalization", "LpNormalization", "MeanVarianceNormalization",
})
_WINDOW_POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool"})
_GLOBAL_POOL_OPS = frozenset({"GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
_RNN_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


class OnnxImportError(FormatError):
    """An ONNX file cannot be imported: missing, not ONNX, or shapes that inference cannot determine."""


Shape = tuple[int, ...]


def load_onnx(
    path: str | Path,
    *,
    optimizer: str = "adam",
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    name: str | None = None,
) -> CompGraph:
    """Import the ONNX model at `path` as the `CompGraph` of one training step (forward graph + mirrored
    backward + optimizer).

    optimizer: "adam" (2 states per parameter), "sgd" (no state) or "none" (no optimizer ops; each
        trainable initializer's weight bytes sit on its first forward consumer).
    batch: the size of a symbolic batch dimension (axis 0 of a graph input, and every other dimension of
        the same name); required when the model has one.
    dims: sizes of other symbolic dimensions by name, e.g. {"sequence": 128}.
    name: the graph's name (default: the file's stem, with "-b<batch>" when `batch` is given).

    Raises OnnxImportError (a FormatError) for a missing or unreadable file, a file that is not an ONNX
    model, a symbolic dimension without a size, or a tensor whose shape inference cannot determine.
    """
    path = Path(path)
    if optimizer not in OPTIMIZERS:
        raise DevplaceError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise DevplaceError(f"batch must be a positive integer, got {batch!r}")
    for k, v in (dims or {}).items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DevplaceError(f"dims[{k!r}] must be a positive integer, got {v!r}")

    import onnx

    model = _read_model(path)
    if len(model.functions):
        model = _inline(model, path)
    used = _fix_symbolic_dims(model, path, batch, dict(dims or {}))
    _drop_weight_data(model)
    inferred = _infer_shapes(model, path)
    builder = _Builder(model, inferred, path, optimizer)
    nodes, edges, onnx_meta = builder.build()

    gname = name or (f"{path.stem}-b{batch}" if batch is not None else path.stem)
    producer = " ".join(x for x in (model.producer_name, model.producer_version) if x)
    meta = {
        "capture": {
            "frontend": "onnx",
            "onnx": onnx.__version__,
            "model": path.name,
            "batch": used["batch"],
            "dims": used["dims"],
            "optimizer": optimizer,
            "dtype": builder.param_dtype(),
            "approximation": APPROXIMATION,
        },
        "onnx": {
            "producer": producer,
            "ir_version": int(model.ir_version),
            "opset": {(imp.domain or "ai.onnx"): int(imp.version) for imp in model.opset_import},
            **onnx_meta,
        },
    }
    return CompGraph.build(gname, nodes, edges, meta=meta)


# --------------------------------------------------------------------------------------------- reading
def _read_model(path: Path) -> Any:
    import onnx
    from google.protobuf.message import DecodeError

    try:
        data = read_limited(path)
    except FormatError as exc:
        raise OnnxImportError(str(exc)) from None
    hint = ""
    if data.lstrip()[:1] in (b"{", b"["):
        hint = " (it looks like JSON; a devplace graph file is read with load_graph, not as ONNX)"
    not_onnx = f"{path}: not an ONNX model{hint}; give a file written by onnx.save or torch.onnx.export"
    if not data:
        raise OnnxImportError(f"{path}: empty file, not an ONNX model")
    try:
        # Weights in external data files are not loaded: only their shapes are needed, and those are here.
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError, TypeError):
        raise OnnxImportError(not_onnx) from None
    if model.ir_version <= 0 or not model.HasField("graph") or not len(model.graph.node):
        raise OnnxImportError(not_onnx + " (no graph with nodes found)")
    return model


def _inline(model: Any, path: Path) -> Any:
    """Inline the model's local functions, so that every node is a primitive op with a FLOP formula."""
    try:
        import onnx.inliner

        return onnx.inliner.inline_local_functions(model)
    except Exception as exc:
        raise OnnxImportError(f"{path}: cannot inline the model's local functions: {exc}") from None


def _fix_symbolic_dims(model: Any, path: Path, batch: int | None, dims: dict[str, int]) -> dict[str, Any]:
    """Give every symbolic dimension of the graph inputs a size: `dims[name]`, else `batch` for axis 0 (and
    every dimension of the same name). Declared output and value_info shapes are updated or dropped, so that
    shape inference recomputes them from the inputs. Returns the batch and the other sizes used."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    for inp in inputs:
        if not inp.type.HasField("tensor_type"):
            raise OnnxImportError(f"{path}: graph input {inp.name!r} is not a tensor; only tensor inputs are "
                                  "supported")
        if not inp.type.tensor_type.HasField("shape"):
            raise OnnxImportError(f"{path}: graph input {inp.name!r} has no shape (not even a rank); export the "
                                  "model with input shapes")
    sizes = dict(dims)
    batch_names: set[str] = set()
    if batch is not None:  # first pass: the names of symbolic axis-0 dimensions are the batch
        for inp in inputs:
            shape = inp.type.tensor_type.shape
            if len(shape.dim) and not shape.dim[0].HasField("dim_value") and shape.dim[0].dim_param:
                p = shape.dim[0].dim_param
                if p not in sizes:
                    sizes[p] = batch
                    batch_names.add(p)
    applied: dict[str, int] = {}
    batch_used = False
    for inp in inputs:
        for axis, d in enumerate(inp.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                continue
            p = d.dim_param
            if p in sizes:
                d.dim_value = applied[p] = sizes[p]
                batch_used |= p in batch_names
            elif axis == 0 and batch is not None:
                d.dim_value = batch
                batch_used = True
            elif axis == 0:
                what = f"a symbolic batch dimension {p!r}" if p else "an unknown batch dimension"
                raise OnnxImportError(f"{path}: graph input {inp.name!r} has {what} (axis 0); give the batch "
                                      "size with --batch N (load_onnx(..., batch=N))")
            else:
                what = f"symbolic dimension {p!r}" if p else "an unnamed unknown dimension"
                fix = f"give its size with dims={{{p!r}: N}}" if p else "export the model with a fixed size there"
                raise OnnxImportError(f"{path}: graph input {inp.name!r} has {what} at axis {axis}; {fix}")
    shapes = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in inputs]
    if batch is not None and not batch_used and (not shapes or not shapes[0] or shapes[0][0] != batch):
        raise OnnxImportError(
            f"{path}: the model has a fixed batch size (input shapes {shapes}); batch {batch} cannot change it; "
            "leave --batch out or re-export the model with a dynamic batch axis"
        )
    # Declared shapes elsewhere: substitute the known names; drop a shape that stays symbolic.
    for vi in [*graph.output, *graph.value_info]:
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        shape = vi.type.tensor_type.shape
        for d in shape.dim:
            if not d.HasField("dim_value") and d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]
        if any(not d.HasField("dim_value") for d in shape.dim):
            vi.type.tensor_type.ClearField("shape")
    first = shapes[0][0] if shapes and shapes[0] else None
    return {"batch": batch if batch is not None else first,
            "dims": {k: v for k, v in applied.items() if k not in batch_names}}


def _drop_weight_data(model: Any) -> None:
    """Clear the values of large floating-point initializers: shape inference needs only their dims (small
    integer initializers, which hold shapes, keep their values for data propagation)."""
    import onnx

    floating = {getattr(onnx.TensorProto, n) for n in _TRAINABLE_TYPES}
    for t in model.graph.initializer:
        if t.data_type in floating and math.prod(t.dims) > 4096:
            for f in ("raw_data", "float_data", "double_data", "int32_data", "external_data"):
                t.ClearField(f)
            t.ClearField("data_location")


def _infer_shapes(model: Any, path: Path) -> Any:
    """ONNX shape inference; where it leaves shapes unknown, fold the shape computations (Shape, Gather, Concat,
    ... of now-static shapes, as a dynamic-axes export has them) into constants and infer again, until nothing
    changes. Returns the inferred model (the nodes of `model` itself are not changed)."""
    import onnx

    work = model
    for _ in range(len(model.graph.node) + 1):
        try:
            inferred = onnx.shape_inference.infer_shapes(work, check_type=False, strict_mode=False, data_prop=True)
        except Exception as exc:  # onnx raises InferenceError, ValidationError or RuntimeError
            raise OnnxImportError(f"{path}: ONNX shape inference failed: {exc}") from None
        known = {vi.name for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
                 if _shape_of(vi)[0] is not None}
        if all(o in known for n in inferred.graph.node for o in n.output if o):
            return inferred
        folded = _fold_constants(inferred)
        if folded is None:
            return inferred
        work = folded
    return inferred


_NO_FOLD = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                      "Bernoulli", "Dropout", "Constant"})
_FOLD_LIMIT = 1 << 16  # elements: fold only small (shape-sized) tensors


def _fold_constants(model: Any) -> Any | None:
    """A copy of `model` whose nodes computing small values from constants and static shapes are replaced by
    Constant nodes with the same outputs, or None when no node can be folded."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    g = model.graph
    opsets = {imp.domain: imp.version for imp in model.opset_import}
    shapes = {vi.name: _shape_of(vi)[0] for vi in [*g.input, *g.value_info, *g.output]}
    value: dict[str, Any] = {}
    for t in g.initializer:
        if math.prod(t.dims) <= _FOLD_LIMIT and t.data_location != onnx.TensorProto.EXTERNAL:
            with contextlib.suppress(Exception):  # data cleared or unreadable: not a constant we can use
                value[t.name] = numpy_helper.to_array(t)
    graph_types = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    replace: dict[int, list[Any]] = {}
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx") or any(a.type in graph_types for a in n.attribute):
            continue
        outs: list[Any] | None = None
        try:
            if n.op_type == "Constant":
                outs = ReferenceEvaluator(n, opsets=opsets).run(None, {})
            elif n.op_type in ("Shape", "Size") and shapes.get(n.input[0]) is not None:
                shape = shapes[n.input[0]]
                if n.op_type == "Size":
                    outs = [np.array(math.prod(shape), dtype=np.int64)]
                else:
                    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                    outs = [np.array(shape[attrs.get("start", 0):attrs.get("end", len(shape))], dtype=np.int64)]
            elif n.op_type not in _NO_FOLD and all(t in value for t in n.input if t):
                feeds = {t: value[t] for t in n.input if t}
                outs = ReferenceEvaluator(n, opsets=opsets).run(None, feeds)
        except Exception:  # an op the reference evaluator cannot run here: leave it to shape inference
            outs = None
        if outs is None or any(np.asarray(o).size > _FOLD_LIMIT for o in outs):
            continue
        for o, v in zip(n.output, outs, strict=False):
            if o:
                value[o] = np.asarray(v)
        if n.op_type != "Constant":
            replace[i] = [onnx.helper.make_node("Constant", [], [o], value=numpy_helper.from_array(value[o], o))
                          for o in n.output if o]
    if not replace:
        return None
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    del folded.graph.node[:]
    for i, n in enumerate(g.node):
        folded.graph.node.extend(replace.get(i, [n]))
    return folded


# --------------------------------------------------------------------------------------------- building
class _Builder:
    """Turns an inferred ONNX ModelProto into node and edge records."""

    def __init__(self, model: Any, inferred: Any, path: Path, optimizer: str) -> None:
        """`model`: the graph to import; `inferred`: the same graph with inferred shapes (shape computations
        possibly folded into constants), where the types of the tensors are read."""
        import onnx

        self.path = path
        self.optimizer = optimizer
        self.graph = model.graph
        self.bits = {getattr(onnx.TensorProto, n): b for n, b in _BITS_BY_NAME.items()
                     if hasattr(onnx.TensorProto, n)}
        self.type_name = {getattr(onnx.TensorProto, n): _DTYPE_NAMES.get(n, n.lower()) for n in _BITS_BY_NAME
                          if hasattr(onnx.TensorProto, n)}
        self.trainable_types = {getattr(onnx.TensorProto, n) for n in _TRAINABLE_TYPES}
        self.graph_type = onnx.AttributeProto.GRAPH
        self.graphs_type = onnx.AttributeProto.GRAPHS
        self.attr_value = onnx.helper.get_attribute_value
        g = self.graph
        self.inits = {t.name: t for t in g.initializer}
        self.inputs = [i for i in g.input if i.name not in self.inits]
        # name -> (shape or None, elem_type)
        self.types: dict[str, tuple[Shape | None, int]] = {}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            self.types[vi.name] = _shape_of(vi)
        for t in g.initializer:
            self.types[t.name] = (tuple(int(d) for d in t.dims), int(t.data_type))
        self.param_types: Counter[str] = Counter()

    # ------------------------------------------------------------------ tensors
    def shape(self, tensor: str) -> Shape:
        shape = self.types.get(tensor, (None, 0))[0]
        assert shape is not None, tensor  # checked by _check_shapes
        return shape

    def nbytes(self, tensor: str) -> int:
        shape, elem = self.types[tensor]
        assert shape is not None
        return -(-math.prod(shape) * self.bits[elem] // 8)

    def floating(self, tensor: str) -> bool:
        return self.types.get(tensor, (None, 0))[1] in self.trainable_types

    def param_dtype(self) -> str | None:
        return self.param_types.most_common(1)[0][0] if self.param_types else None

    def _check_tensor(self, tensor: str, what: str) -> None:
        shape, elem = self.types.get(tensor, (None, 0))
        if shape is None:
            unknown = [o for n in self.graph.node for o in n.output if o and self.types.get(o, (None,))[0] is None]
            raise OnnxImportError(
                f"{self.path}: shape inference could not determine the shape of tensor {tensor!r} ({what}); "
                f"{len(unknown)} tensor(s) have unknown shapes (e.g. {unknown[:3]}). Common causes: a custom or "
                "contrib op ONNX cannot infer, or a size computed from data at run time; export the model with "
                "static shapes (pass --batch N if only the batch is symbolic)"
            )
        if elem not in self.bits:
            raise OnnxImportError(f"{self.path}: tensor {tensor!r} ({what}) has element type {elem}, whose size "
                                  "devplace does not know (string and unknown types are not supported)")

    # ------------------------------------------------------------------ the graph
    def build(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
        g = self.graph
        onodes = list(g.node)
        ids = _Ids()

        # Input nodes, then forward nodes in file order.
        producer: dict[str, tuple[str, int]] = {}  # tensor -> (node id, output index)
        records: list[dict[str, Any]] = []
        for inp in self.inputs:
            self._check_tensor(inp.name, f"graph input {inp.name!r}")
            nid = ids.take(f"input/{inp.name}")
            producer[inp.name] = (nid, 0)
            records.append({"id": nid, "op": "input", "kind": "forward", "group": nid,
                            "output_bytes": self.nbytes(inp.name), "flops": 0, "mem_access_bytes": 0,
                            "module": ""})
        per_type: Counter[str] = Counter()
        fids: list[str] = []
        for n in onodes:
            k = per_type[n.op_type]
            per_type[n.op_type] += 1
            fid = ids.take(n.name or f"{n.op_type}#{k}")
            fids.append(fid)
            for j, o in enumerate(n.output):
                if o:
                    if o in producer or o in self.inits:
                        raise OnnxImportError(f"{self.path}: tensor {o!r} is produced twice (node {fid!r}); "
                                              "an ONNX graph assigns each tensor once")
                    producer[o] = (fid, j)
        # Each node's inputs: explicit ones, then outer-scope names its subgraphs read (If, Loop, Scan).
        node_inputs = [[*n.input, *self._outer_names(n)] for n in onodes]
        for i, n in enumerate(onodes):
            for t in node_inputs[i]:
                if t and t not in producer and t not in self.inits:
                    raise OnnxImportError(f"{self.path}: node {fids[i]!r} ({n.op_type}) reads tensor {t!r}, which "
                                          "no node, graph input or initializer produces")
                if t in self.inits:
                    self._check_tensor(t, f"initializer read by node {fids[i]!r}")
            for o in n.output:
                if o:
                    self._check_tensor(o, f"output of {n.op_type} node {fids[i]!r}")
        for i, n in enumerate(onodes):  # ONNX does not check that a Reshape keeps the number of elements
            if n.op_type == "Reshape" and n.input and n.input[0] and n.output and n.output[0]:
                a, b = math.prod(self.shape(n.input[0])), math.prod(self.shape(n.output[0]))
                if a != b:
                    raise OnnxImportError(
                        f"{self.path}: Reshape node {fids[i]!r} turns {list(self.shape(n.input[0]))} ({a} elements) "
                        f"into {list(self.shape(n.output[0]))} ({b}); the model does not run at these sizes (the "
                        "exporter fixed a size that the input's dimensions change); use the sizes it was exported "
                        "with, or re-export it with those sizes as dynamic axes or fixed"
                    )
        index_of = {fid: i for i, fid in enumerate(fids)}
        order = self._topo(onodes, node_inputs, producer, index_of, fids)

        def diff_slots(i: int) -> list[int]:
            nondiff = _NONDIFF_SLOTS.get(onodes[i].op_type, frozenset())
            return [s for s, t in enumerate(node_inputs[i]) if t and s not in nondiff]

        # Which initializers could be trained, which ops require a gradient, which need a backward op.
        candidate = {t for i in range(len(onodes)) for s in diff_slots(i)
                     if (t := node_inputs[i][s]) in self.inits and self.floating(t) and len(self.shape(t)) >= 1}
        requires = [False] * len(onodes)
        for i in order:
            has_float_out = any(o and self.floating(o) for o in onodes[i].output)
            requires[i] = has_float_out and any(
                (t := node_inputs[i][s]) in candidate or (t in producer and producer[t][0] in index_of
                                                          and requires[index_of[producer[t][0]]])
                for s in diff_slots(i))
        outputs = [o.name for o in g.output]
        consumers: dict[str, list[tuple[int, int]]] = {}  # tensor -> [(node index, slot)]
        for i in range(len(onodes)):
            for s, t in enumerate(node_inputs[i]):
                if t:
                    consumers.setdefault(t, []).append((i, s))
        needs = [False] * len(onodes)
        for i in reversed(order):
            if not requires[i]:
                continue
            outs = [o for o in onodes[i].output if o and self.floating(o)]
            needs[i] = any(o in outputs for o in outs) or any(
                needs[c] and s in set(diff_slots(c)) for o in outs for c, s in consumers.get(o, []))
        trainable = [t for t in self.inits if t in candidate and any(
            needs[c] and s in set(diff_slots(c)) for c, s in consumers.get(t, []))]
        trainable_set = set(trainable)

        def grad_slots(i: int) -> list[int]:
            """Input slots of node i whose gradient its backward op computes."""
            out = []
            for s in diff_slots(i):
                t = node_inputs[i][s]
                if t in trainable_set or (t in producer and producer[t][0] in index_of
                                          and needs[index_of[producer[t][0]]]):
                    out.append(s)
            return out

        # Persistent bytes: frozen initializers (and, with optimizer "none", trainable ones) on the first
        # consumer in file order.
        first_consumer: dict[str, int] = {}
        for t, cs in consumers.items():
            if t in self.inits:
                first_consumer[t] = min(c for c, _ in cs)
        fwd_param = [0] * len(onodes)
        for t, c in first_consumer.items():
            if t not in trainable_set or self.optimizer == "none":
                fwd_param[c] += self.nbytes(t)

        # Forward records and edges.
        edges: list[dict[str, Any]] = []
        seen: set[tuple[str, str, int]] = set()

        def edge(src: str, dst: str, nbytes: int, tensor: int) -> None:
            key = (src, dst, tensor)
            if key not in seen:
                seen.add(key)
                rec: dict[str, Any] = {"src": src, "dst": dst, "bytes": nbytes}
                if tensor:
                    rec["tensor"] = tensor
                edges.append(rec)

        no_formula: set[str] = set()
        fwd_flops = [0] * len(onodes)
        fwd_access = [0] * len(onodes)
        for i, n in enumerate(onodes):
            out_bytes = sum(self.nbytes(o) for o in n.output if o)
            in_bytes = sum(self.nbytes(t) for t in dict.fromkeys(node_inputs[i]) if t)
            flops = self._flops(n) if not n.domain or n.domain == "ai.onnx" else None
            if flops is None:
                no_formula.add(n.op_type if not n.domain or n.domain == "ai.onnx" else f"{n.domain}.{n.op_type}")
                flops = 0
            fwd_flops[i], fwd_access[i] = flops, in_bytes + out_bytes
            rec = {"id": fids[i], "op": _op_name(n), "kind": "forward", "group": fids[i],
                   "output_bytes": 0 if n.op_type in _VIEW_OPS else out_bytes, "flops": flops,
                   "mem_access_bytes": in_bytes + out_bytes, "module": _module_of(n.name)}
            if fwd_param[i]:
                rec["param_bytes"] = fwd_param[i]
            records.append(rec)
            for t in node_inputs[i]:
                if t in producer:
                    src, j = producer[t]
                    edge(src, fids[i], self.nbytes(t), j)

        # Loss: reads every floating-point graph output; sends each one's gradient back (tensor = output index).
        loss = ids.take("loss")
        loss_in = [o for o in outputs if o in producer and self.floating(o)]
        grad_out = [(k, o) for k, o in enumerate(outputs) if o in loss_in and producer[o][0] in index_of
                    and needs[index_of[producer[o][0]]]]
        records.append({"id": loss, "op": "loss", "kind": "forward", "group": loss,
                        "output_bytes": sum(self.nbytes(o) for _, o in grad_out),
                        "flops": sum(math.prod(self.shape(o)) for o in dict.fromkeys(loss_in)),
                        "mem_access_bytes": sum(self.nbytes(o) for o in dict.fromkeys(loss_in))
                        + sum(self.nbytes(o) for _, o in grad_out),
                        "module": ""})
        for o in dict.fromkeys(loss_in):
            src, j = producer[o]
            edge(src, loss, self.nbytes(o), j)

        # Backward ops in reverse topological order; output tensor s = the gradient of input slot s.
        bids: dict[int, str] = {}
        for i in reversed(order):
            if needs[i]:
                bids[i] = ids.take(f"{fids[i]}/backward")
        grad_edges: dict[int, list[tuple[str, int, int]]] = {i: [] for i in bids}  # i -> (src, bytes, tensor)
        for k, o in grad_out:
            grad_edges[index_of[producer[o][0]]].append((loss, self.nbytes(o), k))
        for i in reversed(order):
            if i not in bids:
                continue
            n = onodes[i]
            gslots = grad_slots(i)
            records.append({"id": bids[i], "op": _op_name(n) + ".backward", "kind": "backward", "group": fids[i],
                            "output_bytes": 0 if n.op_type in _VIEW_OPS else sum(
                                self.nbytes(node_inputs[i][s]) for s in gslots),
                            "flops": 2 * fwd_flops[i], "mem_access_bytes": 2 * fwd_access[i],
                            "module": _module_of(n.name)})
            for src, nbytes, tensor in grad_edges[i]:  # incoming gradients
                edge(src, bids[i], nbytes, tensor)
            for s in diff_slots(i):  # saved inputs of the forward op
                t = node_inputs[i][s]
                if t in producer:
                    src, j = producer[t]
                    edge(src, bids[i], self.nbytes(t), j)
            for s in gslots:  # gradients this op sends to the backward ops of its inputs
                t = node_inputs[i][s]
                if t in producer and producer[t][0] in index_of:
                    grad_edges[index_of[producer[t][0]]].append((bids[i], self.nbytes(t), s))

        # Optimizer ops, one per trainable initializer, in the order of their first forward consumer.
        n_param_elems = 0
        init_pos = {t: k for k, t in enumerate(self.inits)}
        for t in sorted(trainable, key=lambda t: (first_consumer[t], init_pos[t])):
            numel, nb = math.prod(self.shape(t)), self.nbytes(t)
            n_param_elems += numel
            self.param_types[self.type_name[self.types[t][1]]] += numel
            if self.optimizer == "none":
                continue
            oid = ids.take(f"optimizer/{t}")
            records.append({"id": oid, "op": f"optimizer.{self.optimizer}", "kind": "optimizer",
                            "group": fids[first_consumer[t]], "output_bytes": 0,
                            "param_bytes": nb * (2 + OPTIMIZERS[self.optimizer]),
                            "flops": OPTIMIZER_FLOPS[self.optimizer] * numel,
                            "mem_access_bytes": OPTIMIZER_ACCESS[self.optimizer] * nb,
                            "module": _module_of(onodes[first_consumer[t]].name)})
            for c, s in consumers[t]:
                if c in bids and s in grad_slots(c):
                    edge(bids[c], oid, nb, s)

        meta = {
            "ops_without_flops": sorted(no_formula),
            "trainable_initializers": len(trainable),
            "frozen_initializers": len([t for t in first_consumer if t not in trainable_set]),
            # floating-point tensors read but not trained (running statistics, masks): worth a look
            "frozen_float_tensors": sorted(t for t in first_consumer if t not in trainable_set
                                           and self.floating(t) and len(self.shape(t)) >= 1),
            "unused_initializers": len([t for t in self.inits if t not in first_consumer]),
            "parameters": n_param_elems,
        }
        return records, edges, meta

    def _outer_names(self, node: Any) -> list[str]:
        """Tensors of the enclosing scope that a node's subgraphs (If, Loop, Scan bodies) read."""
        names: list[str] = []
        for attr in node.attribute:
            graphs = [attr.g] if attr.type == self.graph_type else list(attr.graphs) \
                if attr.type == self.graphs_type else []
            for sub in graphs:
                local = {i.name for i in sub.input} | {t.name for t in sub.initializer} | {
                    o for n in sub.node for o in n.output}
                for n in sub.node:
                    names += [t for t in [*n.input, *self._outer_names(n)] if t and t not in local]
        return list(dict.fromkeys(names))

    def _topo(self, onodes: Sequence[Any], node_inputs: list[list[str]], producer: dict[str, tuple[str, int]],
              index_of: dict[str, int], fids: list[str]) -> list[int]:
        """Forward nodes in topological order (Kahn, file order); ONNX requires it but not every file obeys."""
        preds = [{index_of[producer[t][0]] for t in ins if t in producer and producer[t][0] in index_of}
                 for ins in node_inputs]
        succ: list[list[int]] = [[] for _ in onodes]
        for i, ps in enumerate(preds):
            for p in sorted(ps):
                succ[p].append(i)
        deg = [len(p) for p in preds]
        order = [i for i in range(len(onodes)) if deg[i] == 0]
        for i in order:  # grows while iterating
            for j in succ[i]:
                deg[j] -= 1
                if deg[j] == 0:
                    order.append(j)
        if len(order) < len(onodes):
            stuck = [fids[i] for i in range(len(onodes)) if deg[i]][:5]
            raise OnnxImportError(f"{self.path}: the ONNX graph has a cycle through {stuck}; a model must be a DAG")
        return order

    # ------------------------------------------------------------------ FLOPs
    def _attr(self, node: Any, key: str, default: Any = None) -> Any:
        for a in node.attribute:
            if a.name == key:
                return self.attr_value(a)
        return default

    def _in(self, node: Any, slot: int) -> Shape | None:
        return self.shape(node.input[slot]) if len(node.input) > slot and node.input[slot] else None

    def _flops(self, node: Any) -> int | None:
        """Forward FLOPs of one node (a multiply-add counts 2), or None when devplace has no formula for it."""
        op = node.op_type
        out = self.shape(node.output[0]) if node.output and node.output[0] else ()
        n_out = math.prod(out)
        x = self._in(node, 0)
        if op in _ZERO_FLOP_OPS:
            return 0
        if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
            a = x
            if a is None:
                return None
            return 2 * n_out * a[-1]
        if op == "Gemm":
            a = x
            if a is None:
                return None
            k = a[0] if self._attr(node, "transA", 0) else a[-1]
            return 2 * n_out * k + (n_out if self._in(node, 2) is not None else 0)
        if op in ("Conv", "ConvInteger", "QLinearConv"):
            w, b = (self._in(node, 3), self._in(node, 8)) if op == "QLinearConv" else (self._in(node, 1),
                                                                                       self._in(node, 2))
            if w is None:
                return None
            return 2 * n_out * math.prod(w[1:]) + (n_out if b is not None else 0)
        if op == "ConvTranspose":
            w = self._in(node, 1)
            if w is None or x is None:
                return None
            return 2 * math.prod(x) * math.prod(w[1:]) + (n_out if self._in(node, 2) is not None else 0)
        if op in _NORM_OPS or op in ("Softmax", "LogSoftmax"):
            return 5 * math.prod(x) if x is not None else None
        if op in _UNARY_OPS or op in _BINARY_OPS:
            return n_out
        if op in _VARIADIC_OPS:
            k = sum(1 for t in node.input if t)
            return n_out * (k - 1 + (1 if op == "Mean" else 0))
        if op in _REDUCE_OPS or op in _GLOBAL_POOL_OPS:
            return math.prod(x) if x is not None else None
        if op in _WINDOW_POOL_OPS:
            return n_out * math.prod(self._attr(node, "kernel_shape", []))
        if op == "Einsum":
            eq = self._attr(node, "equation", "")
            return _einsum_flops(eq.decode() if isinstance(eq, bytes) else eq,
                                 [self.shape(t) for t in node.input if t])
        if op == "Attention":
            return self._attention_flops(node)
        if op in _RNN_GATES:
            w = self._in(node, 1)
            if w is None or x is None or len(x) != 3:
                return None
            gates = _RNN_GATES[op]
            steps, batch, width = (x[1], x[0], x[2]) if self._attr(node, "layout", 0) else x
            directions, hidden = w[0], w[1] // gates
            return directions * steps * batch * gates * hidden * (2 * (width + hidden) + 4)
        return None

    def _attention_flops(self, node: Any) -> int | None:
        """ONNX Attention (opset 23): Q·Kᵀ and P·V as matmuls, softmax 5 per score."""
        q, k = self._in(node, 0), self._in(node, 1)
        y = self.shape(node.output[0])
        if q is None or k is None:
            return None
        if len(q) == 4:
            heads, kv_len, head_dim = q[1], k[2], q[3]
        else:
            heads = int(self._attr(node, "q_num_heads", 0))
            if not heads:
                return None
            kv_len, head_dim = k[1], q[2] // heads
        scores = math.prod(q) // head_dim * kv_len
        return 2 * math.prod(q) * kv_len + 2 * math.prod(y) * kv_len + 5 * scores


# --------------------------------------------------------------------------------------------- helpers
class _Ids:
    """Unique node ids: a taken id gets "#2", "#3", ... appended."""

    def __init__(self) -> None:
        self.taken: set[str] = set()

    def take(self, want: str) -> str:
        nid, k = want, 1
        while nid in self.taken:
            k += 1
            nid = f"{want}#{k}"
        self.taken.add(nid)
        return nid


def _shape_of(vi: Any) -> tuple[Shape | None, int]:
    """(static shape or None, element type) of a ValueInfoProto."""
    if not vi.type.HasField("tensor_type"):
        return None, 0
    tt = vi.type.tensor_type
    if not tt.HasField("shape") or any(not d.HasField("dim_value") or d.dim_value < 0 for d in tt.shape.dim):
        return None, int(tt.elem_type)
    return tuple(int(d.dim_value) for d in tt.shape.dim), int(tt.elem_type)


def _op_name(node: Any) -> str:
    """"onnx.<OpType>", with the domain for ops outside the default one: "onnx.com.microsoft.Attention"."""
    return f"onnx.{node.op_type}" if node.domain in ("", "ai.onnx") else f"onnx.{node.domain}.{node.op_type}"


def _module_of(node_name: str) -> str:
    """The module path in a torch.onnx node name: "/layers/layers.0/conv/Conv" -> "layers.0.conv"."""
    if "/" not in node_name:
        return ""
    path = ""
    for part in node_name.strip("/").split("/")[:-1]:
        path = part if not path or part.startswith(path + ".") else f"{path}.{part}"
    return path


def _einsum_flops(equation: str, shapes: Sequence[Shape]) -> int | None:
    """Naive evaluation of an einsum: prod(sizes of all labels) x (operands - 1 + [some label is summed])."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return None
    size: dict[str, int] = {}
    count: Counter[str] = Counter()
    ell: list[str] = []
    for term, shape in zip(terms, shapes, strict=True):
        head, dots, tail = term.partition("...")
        n_ell = len(shape) - len(head) - len(tail) if dots else 0
        if n_ell < 0 or (not dots and len(term) != len(shape)):
            return None
        labels = [*head, *(f"...{n_ell - 1 - j}" for j in range(n_ell)), *tail]
        for lab, d in zip(labels, shape, strict=True):
            size[lab] = max(size.get(lab, 1), d)
            if lab.startswith("..."):
                ell.append(lab)
            else:
                count[lab] += 1
    if arrow:
        kept = set(rhs.replace("...", "")) | (set(ell) if "..." in rhs else set())
    else:
        kept = {lab for lab, c in count.items() if c == 1} | set(ell)
    summed = any(lab not in kept for lab in size)
    factor = len(terms) - 1 + (1 if summed else 0)
    return math.prod(size.values()) * factor



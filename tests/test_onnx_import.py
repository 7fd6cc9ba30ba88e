"""ONNX import (`devplace.capture.onnx_import`): forward graph from the file, mirrored training step."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from devplace.capture.onnx_import import OnnxImportError, load_onnx
from devplace.errors import DevplaceError, FormatError
from devplace.graph.io import load_graph, save_graph

F32 = TensorProto.FLOAT


def init(name: str, *shape: int, dtype: type = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.zeros(shape, dtype=dtype), name)


def save(tmp_path, nodes, inputs, outputs, inits=(), name="m", opset=20, **kw):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kw)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return path


def vi(name: str, shape, dtype: int = F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def mlp(tmp_path):
    """x[N,16] -> Gemm(W1[32,16]ᵀ, b1) -> Relu -> Gemm(W2[4,32]ᵀ, b2) -> y[N,4]."""
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["a"], name="act"),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["y"], name="fc2", transB=1)]
    inits = [init("W1", 32, 16), init("b1", 32), init("W2", 4, 32), init("b2", 4)]
    return save(tmp_path, nodes, [vi("x", ["N", 16])], [vi("y", ["N", 4])], inits, name="mlp")


def cnn(tmp_path):
    """x[2,3,8,8] -> Conv(8, 3x3, bias) -> BatchNorm -> Relu -> grouped Conv(groups 4, no bias) -> GAP -> Flatten
    -> Gemm(10)."""
    nodes = [helper.make_node("Conv", ["x", "cw", "cb"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "g", "beta", "mean", "var"], ["n1"], name="bn1"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "gw"], ["c2"], name="conv2", group=4, pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    inits = [init("cw", 8, 3, 3, 3), init("cb", 8), init("g", 8), init("beta", 8), init("mean", 8), init("var", 8),
             init("gw", 8, 2, 3, 3), init("fw", 10, 8), init("fb", 10)]
    return save(tmp_path, nodes, [vi("x", [2, 3, 8, 8])], [vi("y", [2, 10])], inits, name="cnn")


def records(g):
    d = g.to_dict()
    return {n["id"]: n for n in d["nodes"]}, d["edges"]


def check_contract(g):
    """Kinds, groups, acyclicity and edge consistency of docs/capture-format.md."""
    nodes, edges = records(g)
    assert len(g.topo_order) == g.num_nodes  # acyclic (CompGraph.build also refuses cycles)
    for nid, n in nodes.items():
        assert n["kind"] in ("forward", "backward", "optimizer")
        assert n["group"] in nodes and nodes[n["group"]]["kind"] == "forward"
        if n["kind"] == "forward":
            assert n["group"] == nid
        if n["kind"] == "backward":
            assert nid == n["group"] + "/backward" and n["flops"] == 2 * nodes[n["group"]]["flops"]
        assert isinstance(n["flops"], int) and isinstance(n["mem_access_bytes"], int) and "module" in n
    for e in edges:  # gradients and saved tensors flow forward -> backward -> optimizer, never back
        rank = {"forward": 0, "backward": 1, "optimizer": 2}
        assert rank[nodes[e["src"]]["kind"]] <= rank[nodes[e["dst"]]["kind"]]
    return nodes, edges


# ------------------------------------------------------------------------------------------------- MLP
def test_mlp_nodes_flops_params_edges(tmp_path):
    g = load_onnx(mlp(tmp_path), batch=8)
    nodes, edges = check_contract(g)
    kinds = Counter(n["kind"] for n in nodes.values())
    assert kinds == {"forward": 5, "backward": 3, "optimizer": 4}  # input, 3 ops, loss; 3 mirrored; 4 initializers
    assert g.name == "mlp-b8"
    assert nodes["fc1"]["flops"] == 2 * 8 * 32 * 16 + 8 * 32  # 2MNK + bias
    assert nodes["act"]["flops"] == 8 * 32
    assert nodes["fc2"]["flops"] == 2 * 8 * 4 * 32 + 8 * 4
    assert nodes["fc1/backward"]["flops"] == 2 * nodes["fc1"]["flops"]
    assert nodes["fc1"]["output_bytes"] == 8 * 32 * 4 and nodes["input/x"]["output_bytes"] == 8 * 16 * 4
    assert nodes["fc1"]["mem_access_bytes"] == (8 * 16 + 32 * 16 + 32 + 8 * 32) * 4
    assert nodes["fc1"]["module"] == "" and nodes["fc1"]["op"] == "onnx.Gemm"
    # adam: weights + grads + 2 states
    assert nodes["optimizer/W1"]["param_bytes"] == 4 * 32 * 16 * 4
    assert nodes["optimizer/W1"]["group"] == "fc1" and nodes["optimizer/b2"]["group"] == "fc2"
    assert nodes["optimizer/W1"]["flops"] == 12 * 32 * 16
    assert g.param_bytes.sum() == 4 * 4 * (32 * 16 + 32 + 4 * 32 + 4)
    assert nodes["fc2/backward"]["output_bytes"] == (8 * 32 + 4 * 32 + 4) * 4  # grads of a, W2, b2
    assert nodes["fc1/backward"]["output_bytes"] == (32 * 16 + 32) * 4  # x needs no gradient
    got = {(e["src"], e["dst"], e.get("tensor", 0)): e["bytes"] for e in edges}
    assert got == {
        ("input/x", "fc1", 0): 512, ("fc1", "act", 0): 1024, ("act", "fc2", 0): 1024, ("fc2", "loss", 0): 128,
        ("loss", "fc2/backward", 0): 128,  # dL/dy
        ("act", "fc2/backward", 0): 1024,  # saved input of fc2
        ("fc2/backward", "act/backward", 0): 1024,  # dL/da
        ("fc1", "act/backward", 0): 1024,  # saved input of relu
        ("act/backward", "fc1/backward", 0): 1024,  # dL/dh
        ("input/x", "fc1/backward", 0): 512,  # saved input of fc1
        ("fc1/backward", "optimizer/W1", 1): 2048, ("fc1/backward", "optimizer/b1", 2): 128,
        ("fc2/backward", "optimizer/W2", 1): 512, ("fc2/backward", "optimizer/b2", 2): 16,
    }
    cap = g.meta["capture"]
    assert cap["frontend"] == "onnx" and cap["optimizer"] == "adam" and cap["batch"] == 8
    assert cap["dtype"] == "float32" and "mirrored" in cap["approximation"] and "2x" in cap["approximation"]
    assert g.meta["onnx"]["ops_without_flops"] == [] and g.meta["onnx"]["parameters"] == 32 * 16 + 32 + 128 + 4


def test_mlp_needs_batch(tmp_path):
    with pytest.raises(OnnxImportError, match=r"symbolic batch dimension 'N'.*--batch"):
        load_onnx(mlp(tmp_path))


@pytest.mark.parametrize(("optimizer", "factor", "n_opt"), [("adam", 4, 4), ("sgd", 2, 4), ("none", 1, 0)])
def test_optimizers(tmp_path, optimizer, factor, n_opt):
    g = load_onnx(mlp(tmp_path), batch=2, optimizer=optimizer)
    nodes, _ = check_contract(g)
    weights = 4 * (32 * 16 + 32 + 4 * 32 + 4)
    assert g.param_bytes.sum() == factor * weights
    assert sum(n["kind"] == "optimizer" for n in nodes.values()) == n_opt
    if optimizer == "none":  # weights on the first forward consumer
        assert nodes["fc1"]["param_bytes"] == 4 * (32 * 16 + 32)
    else:
        assert "param_bytes" not in nodes["fc1"]


def test_save_load_roundtrip(tmp_path):
    g = load_onnx(mlp(tmp_path), batch=4)
    save_graph(g, tmp_path / "g.json")
    h = load_graph(tmp_path / "g.json")
    assert h.to_dict() == g.to_dict()


# ------------------------------------------------------------------------------------------------- CNN
def test_cnn_grouped_conv_batchnorm(tmp_path):
    g = load_onnx(cnn(tmp_path))
    nodes, edges = check_contract(g)
    kinds = Counter(n["kind"] for n in nodes.values())
    # input + 7 ops + loss; 7 mirrored; conv1 w/b, bn scale/bias, conv2 w, fc w/b (running stats are frozen)
    assert kinds == {"forward": 9, "backward": 7, "optimizer": 7}
    out = 2 * 8 * 8 * 8
    assert nodes["conv1"]["flops"] == 2 * out * 3 * 3 * 3 + out
    assert nodes["conv2"]["flops"] == 2 * out * (8 // 4) * 3 * 3  # group 4: each output reads 2 channels
    assert nodes["bn1"]["flops"] == 5 * out
    assert nodes["gap"]["flops"] == out and nodes["flat"]["flops"] == 0
    assert nodes["fc"]["flops"] == 2 * 2 * 10 * 8 + 2 * 10
    assert nodes["bn1"]["param_bytes"] == 2 * 8 * 4  # running mean and var: weights only, on the op
    assert g.meta["onnx"]["frozen_initializers"] == 2 and g.meta["onnx"]["frozen_float_tensors"] == ["mean", "var"]
    assert nodes["optimizer/g"]["group"] == "bn1" and nodes["optimizer/gw"]["param_bytes"] == 4 * 8 * 2 * 9 * 4
    trainable = 8 * 27 + 8 + 8 + 8 + 8 * 18 + 80 + 10
    assert g.param_bytes.sum() == 4 * 4 * trainable + 2 * 8 * 4
    assert "output_bytes" not in nodes["flat"]  # a view allocates nothing ...
    assert {e["bytes"] for e in edges if e["src"] == "flat"} == {2 * 8 * 4}  # ... but its edges carry the tensor
    assert nodes["bn1/backward"]["output_bytes"] == (out + 8 + 8) * 4  # grads of x, scale, bias (not of the stats)


def test_every_edge_has_its_tensor_bytes(tmp_path):
    path = cnn(tmp_path)
    g = load_onnx(path, optimizer="sgd")
    inferred = onnx.shape_inference.infer_shapes(onnx.load(path))
    size = {v.name: 4 * math.prod(d.dim_value for d in v.type.tensor_type.shape.dim)
            for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
    size |= {t.name: 4 * math.prod(t.dims) for t in inferred.graph.initializer}
    produced = {n.name: list(n.output) for n in inferred.graph.node} | {"input/x": ["x"]}
    reads = {n.name: list(n.input) for n in inferred.graph.node}
    for e in g.to_dict()["edges"]:
        src, t = e["src"], e.get("tensor", 0)
        if src in produced:  # a forward tensor (to its consumer, the loss, or a backward op as saved input)
            assert e["bytes"] == size[produced[src][t]]
        else:  # a gradient: output t of a backward op is the gradient of input slot t of its forward op
            fwd = src.removesuffix("/backward")
            assert src.endswith("/backward") or src == "loss"
            assert e["bytes"] == (size[reads[fwd][t]] if src != "loss" else size["y"])


# ------------------------------------------------------------------------------------------------- FLOP formulas
@pytest.mark.parametrize(("op", "inputs", "attrs", "expected"), [
    ("MatMul", [[2, 4, 8, 16], [2, 4, 16, 8]], {}, 2 * (2 * 4 * 8 * 8) * 16),  # attention scores Q·Kᵀ
    ("MatMul", [[16], [16, 5]], {}, 2 * 5 * 16),
    ("Softmax", [[2, 4, 8, 8]], {}, 5 * 512),
    ("LayerNormalization", [[2, 6, 8], [8], [8]], {"axis": -1}, 5 * 96),
    ("MaxPool", [[1, 2, 8, 8]], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1 * 2 * 4 * 4 * 4),
    ("AveragePool", [[1, 2, 8, 8]], {"kernel_shape": [3, 3]}, 1 * 2 * 6 * 6 * 9),
    ("Add", [[4, 8], [8]], {}, 32),
    ("Sum", [[4, 8], [4, 8], [4, 8]], {}, 2 * 32),
    ("Gelu", [[4, 8]], {}, 32),
    ("ReduceMean", [[4, 8]], {}, 32),
    ("ConvTranspose", [[1, 4, 5, 5], [4, 3, 2, 2]], {"strides": [2, 2]}, 2 * (4 * 25) * 3 * 2 * 2),
    ("Conv", [[1, 8, 6, 6], [8, 1, 3, 3]], {"group": 8}, 2 * (8 * 4 * 4) * 9),  # depthwise
    ("Einsum", [[2, 3, 4], [2, 4, 5]], {"equation": "bij,bjk->bik"}, 2 * 2 * 3 * 4 * 5),
    ("Einsum", [[2, 3, 4]], {"equation": "...ij->...ji"}, 0),
    ("Attention", [[2, 4, 8, 16], [2, 4, 10, 16], [2, 4, 10, 16]], {},
     2 * (2 * 4 * 8 * 16) * 10 * 2 + 5 * 2 * 4 * 8 * 10),
])
def test_flop_formulas(tmp_path, op, inputs, attrs, expected):
    node = helper.make_node(op, [f"i{k}" for k in range(len(inputs))], ["y"], name="op", **attrs)
    graph = helper.make_graph([node], op, [vi(f"i{k}", s) for k, s in enumerate(inputs)],
                              [helper.make_tensor_value_info("y", F32, None)])
    path = tmp_path / "op.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
    g = load_onnx(path)
    nodes, _ = check_contract(g)
    assert nodes["op"]["flops"] == expected
    assert g.meta["onnx"]["ops_without_flops"] == []


def test_lstm_flops(tmp_path):
    t, b, i, h = 5, 3, 6, 7
    node = helper.make_node("LSTM", ["x", "W", "R"], ["y"], name="lstm", hidden_size=h)
    path = save(tmp_path, [node], [vi("x", [t, b, i])], [helper.make_tensor_value_info("y", F32, None)],
                [init("W", 1, 4 * h, i), init("R", 1, 4 * h, h)], name="lstm")
    nodes, _ = check_contract(load_onnx(path))
    assert nodes["lstm"]["flops"] == t * b * 4 * h * (2 * (i + h) + 4)
    assert "optimizer/W" in nodes and "optimizer/R" in nodes


def test_op_without_formula_is_listed(tmp_path):
    node = helper.make_node("Hardmax", ["x"], ["y"], name="hm")
    path = save(tmp_path, [node], [vi("x", [2, 3])], [vi("y", [2, 3])])
    g = load_onnx(path)
    nodes, _ = records(g)
    assert nodes["hm"]["flops"] == 0 and g.meta["onnx"]["ops_without_flops"] == ["Hardmax"]


# ------------------------------------------------------------------------------------------------- mirroring rules
def test_tied_weights_constants_and_ops_without_gradient(tmp_path):
    """A shared weight gets one optimizer op fed by both consumers; scalars and integer initializers are
    frozen; an op before any parameter (input scaling) and shape ops get no backward op."""
    nodes = [helper.make_node("Mul", ["x", "scale"], ["xs"], name="scale_in"),
             helper.make_node("MatMul", ["xs", "W"], ["h"], name="mm1"),
             helper.make_node("Reshape", ["h", "shape"], ["hr"], name="reshape"),
             helper.make_node("MatMul", ["hr", "W"], ["y"], name="mm2")]
    inits = [init("W", 8, 8), numpy_helper.from_array(np.array(0.5, dtype=np.float32), "scale"),
             numpy_helper.from_array(np.array([4, 8], dtype=np.int64), "shape")]
    path = save(tmp_path, nodes, [vi("x", [4, 8])], [vi("y", [4, 8])], inits, name="tied")
    g = load_onnx(path)
    recs, edges = check_contract(g)
    assert "scale_in/backward" not in recs and "reshape/backward" in recs
    assert [n for n in recs if recs[n]["kind"] == "optimizer"] == ["optimizer/W"]
    assert recs["optimizer/W"]["group"] == "mm1"
    assert {e["src"] for e in edges if e["dst"] == "optimizer/W"} == {"mm1/backward", "mm2/backward"}
    assert recs["scale_in"]["param_bytes"] == 4 and recs["reshape"]["param_bytes"] == 16  # frozen constants
    assert "output_bytes" not in recs["reshape"] and "output_bytes" not in recs["reshape/backward"]  # views
    assert g.meta["onnx"]["frozen_initializers"] == 2 and g.meta["onnx"]["frozen_float_tensors"] == []
    assert not any(e["src"] == "reshape/backward" and e.get("tensor") == 1 for e in edges)  # no grad of a shape


def test_duplicate_and_missing_names(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"], name="r"),
             helper.make_node("Relu", ["b"], ["c"], name="r"), helper.make_node("Relu", ["c"], ["y"])]
    path = save(tmp_path, nodes, [vi("x", [2])], [vi("y", [2])])
    ids = load_onnx(path).ids
    assert ids[:6] == ("input/x", "Relu#0", "r", "r#2", "Relu#3", "loss")


def test_symbolic_dims(tmp_path):
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    path = save(tmp_path, [node], [vi("x", ["batch", "seq", 8])], [vi("y", ["batch", "seq", 4])],
                [init("W", 8, 4)], name="seq")
    with pytest.raises(OnnxImportError, match=r"symbolic dimension 'seq' at axis 1.*dims=\{'seq': N\}"):
        load_onnx(path, batch=2)
    g = load_onnx(path, batch=2, dims={"seq": 5})
    assert records(g)[0]["mm"]["flops"] == 2 * (2 * 5 * 4) * 8
    assert g.meta["capture"]["batch"] == 2 and g.meta["capture"]["dims"] == {"seq": 5}


def test_fixed_batch_cannot_change(tmp_path):
    with pytest.raises(OnnxImportError, match="fixed batch size"):
        load_onnx(cnn(tmp_path), batch=4)
    assert load_onnx(cnn(tmp_path), batch=2).meta["capture"]["batch"] == 2  # the same size is fine


def test_external_data_is_not_read(tmp_path):
    path = mlp(tmp_path)
    model = onnx.load(path)
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
                    size_threshold=0)
    (tmp_path / "w.bin").unlink()  # shapes are in the model file; the weights themselves are not needed
    g = load_onnx(path, batch=8)
    assert g.param_bytes.sum() == 4 * 4 * (32 * 16 + 32 + 4 * 32 + 4)


def test_subgraph_reads_outer_tensor(tmp_path):
    then_g = helper.make_graph([helper.make_node("Relu", ["h"], ["t"])], "then", [], [vi("t", [2, 4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e"])], "else", [], [vi("e", [2, 4])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)]
    path = save(tmp_path, nodes, [vi("x", [2, 3]), vi("cond", [], TensorProto.BOOL)], [vi("y", [2, 4])],
                [init("W", 3, 4)], name="ifm")
    g = load_onnx(path)
    recs, edges = check_contract(g)
    assert ("mm", "branch") in {(e["src"], e["dst"]) for e in edges}
    assert "mm/backward" in recs and g.meta["onnx"]["ops_without_flops"] == ["If"]


# ------------------------------------------------------------------------------------------------- errors
def test_errors_for_bad_files(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        load_onnx(tmp_path / "missing.onnx")
    with pytest.raises(FormatError, match="is a folder"):
        load_onnx(tmp_path)
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(FormatError, match="empty file"):
        load_onnx(tmp_path / "empty.onnx")
    (tmp_path / "g.json").write_text('{"format": "devplace.graph/1", "nodes": []}')
    with pytest.raises(FormatError, match=r"not an ONNX model.*JSON"):
        load_onnx(tmp_path / "g.json")
    (tmp_path / "junk.onnx").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(FormatError, match="not an ONNX model"):
        load_onnx(tmp_path / "junk.onnx")
    (tmp_path / "text.onnx").write_text("hello\n")
    with pytest.raises(FormatError, match="not an ONNX model"):
        load_onnx(tmp_path / "text.onnx")


def test_error_for_unknown_shapes(tmp_path):
    node = helper.make_node("Mystery", ["x"], ["y"], name="custom", domain="my.ops")
    graph = helper.make_graph([node], "m", [vi("x", [2, 3])], [helper.make_tensor_value_info("y", F32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("my.ops", 1)])
    onnx.save(model, tmp_path / "custom.onnx")
    with pytest.raises(OnnxImportError, match=r"could not determine the shape of tensor 'y'.*custom"):
        load_onnx(tmp_path / "custom.onnx")


def test_errors_for_bad_arguments(tmp_path):
    path = mlp(tmp_path)
    with pytest.raises(DevplaceError, match="unknown optimizer 'rmsprop'"):
        load_onnx(path, batch=2, optimizer="rmsprop")
    with pytest.raises(DevplaceError, match="positive integer"):
        load_onnx(path, batch=0)


# ------------------------------------------------------------------------------------------------- from torch
def test_torch_export(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 8, 3, groups=2)
            self.head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))

        def forward(self, x):
            return self.head(self.conv(x))

    net = Net().eval()
    path = tmp_path / "net.onnx"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the TorchScript exporter works offline; the default (dynamo) one needs onnxscript
            torch.onnx.export(net, (torch.randn(2, 4, 6, 6),), str(path), dynamo=False, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    except Exception as exc:  # pragma: no cover - depends on the installed exporter
        pytest.skip(f"torch.onnx.export does not work offline in this torch version: {exc}")
    g = load_onnx(path, batch=3)
    nodes, _ = check_contract(g)
    n_params = sum(p.numel() for p in net.parameters())
    assert g.meta["onnx"]["parameters"] == n_params
    assert g.param_bytes.sum() == 4 * 4 * n_params  # float32 x (weights + grads + 2 adam states)
    assert sum(n["kind"] == "optimizer" for n in nodes.values()) == len(list(net.parameters()))
    # matmul-class FLOPs equal PyTorch's flop counter, which does not count bias adds
    with FlopCounterMode(display=False) as counter:
        net(torch.randn(3, 4, 6, 6))
    ours = sum(n["flops"] - (8 * 4 * 4 * 3 if n["op"] == "onnx.Conv" else 3 * 5)
               for n in nodes.values() if n["kind"] == "forward" and n["op"] in ("onnx.Conv", "onnx.Gemm"))
    assert ours == counter.get_total_flops()
    assert {n["module"] for n in nodes.values() if n["op"] == "onnx.Conv"} == {"conv"}
    assert {n["module"] for n in nodes.values() if n["op"] == "onnx.Gemm"} == {"head.2"}


def test_torch_export_dynamic_axes_attention(tmp_path):
    """A dynamic-axes export computes reshapes from Shape ops; the importer folds them once the sizes are fixed."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(16)
            self.att = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.out = torch.nn.Linear(16, 3)

        def forward(self, x):
            h = self.ln(x)
            return self.out(x + self.att(h, h, h, need_weights=False)[0])

    net = Block().eval()
    with torch.no_grad():  # distinct values: the exporter merges initializers that are equal (zero biases)
        for p in net.parameters():
            p.normal_()
    path = tmp_path / "block.onnx"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (torch.randn(2, 7, 16),), str(path), dynamo=False, input_names=["x"],
                              dynamic_axes={"x": {0: "batch", 1: "seq"}})
    except Exception as exc:  # pragma: no cover - depends on the installed exporter
        pytest.skip(f"torch.onnx.export does not work offline in this torch version: {exc}")
    with pytest.raises(OnnxImportError, match="'seq'"):
        load_onnx(path, batch=3)
    # MultiheadAttention's trace fixes the key length at the example's 7: a Reshape of the keys breaks at 5
    with pytest.raises(OnnxImportError, match=r"Reshape node '/att/Reshape_\d'.*does not run at these sizes"):
        load_onnx(path, batch=3, dims={"seq": 5})
    g = load_onnx(path, batch=3, dims={"seq": 7})
    nodes, _ = check_contract(g)
    assert g.meta["onnx"]["parameters"] == sum(p.numel() for p in net.parameters())
    assert g.meta["capture"]["dims"] == {"seq": 7} and g.meta["capture"]["batch"] == 3
    # the two attention matmuls, Q·Kᵀ and P·V: [3, 2, 7, 8] x [3, 2, 8, 7] and [3, 2, 7, 7] x [3, 2, 7, 8]
    mm = [n["flops"] for n in nodes.values() if n["kind"] == "forward" and n["op"] == "onnx.MatMul"]
    assert mm.count(2 * (3 * 2 * 7 * 7) * 8) == 2
    assert g.meta["onnx"]["ops_without_flops"] == []

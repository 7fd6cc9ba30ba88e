"""Cost models: op signatures, analytic roofline, cost tables, apply_costs, profiling and calibration."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from devplace.capture.profile import (
    calibrate,
    format_calibration,
    local_cpu_device,
    local_cpu_roofline,
    profile_graph,
)
from devplace.capture.signature import SignatureError, decode_signature, encode_signature, signature_key
from devplace.errors import FormatError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Device
from devplace.hardware.cost import (
    CPU_ROOFLINE,
    GPU_ROOFLINE,
    OP_CLASSES,
    CostError,
    CostTable,
    Overheads,
    analytic_node_time,
    apply_costs,
    apply_overheads,
    node_traffic_bytes,
    op_class,
    roofline_for,
    roofline_time,
)
from devplace.hardware.presets import V100_PEAK_FLOPS

aten = torch.ops.aten


# ============================================================================================ signatures
def _calls(mk):
    """(op, args, kwargs) of a handful of ATen calls, tensors made by `mk(*shape, dtype=...)`."""
    x, w = mk(8, 16), mk(16, 4)
    adam_kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
               "maximize": False}
    pl = [[mk(10), mk(3, 3)] for _ in range(4)]
    return {
        "mm": (aten.mm.default, (x, w), {}),
        "conv-groups": (aten.convolution.default,
                        (mk(2, 8, 9, 9), mk(8, 2, 3, 3), mk(8), [1, 1], [1, 1], [1, 1], False, [0, 0], 4), {}),
        "add-alpha": (aten.add.Tensor, (x, x), {"alpha": 2.5}),
        "cat-list": (aten.cat.default, ([x, x, mk(2, 16)], 0), {}),
        "embedding": (aten.embedding.default, (mk(100, 8), mk(4, 5, dtype=torch.int64)), {}),
        "layer-norm": (aten.native_layer_norm.default, (mk(4, 8), [8], mk(8), mk(8), 1e-5), {}),
        "fused-adam": (aten._fused_adam_.default, (*pl, [], [mk(), mk()]), adam_kw),
        "addcdiv_": (aten.addcdiv_.default, (mk(5), mk(5), mk(5)), {"value": -0.1}),
        "to-copy": (aten._to_copy.default, (x,), {"dtype": torch.float16, "device": torch.device("cpu")}),
        "expand": (aten.expand.default, (mk(1, 4), [3, 4]), {}),
        "transposed": (aten.mm.default, (x.t(), x), {}),
    }


def _real(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype) if not dtype.is_floating_point else torch.randn(shape, dtype=dtype)


REAL = _calls(_real)


@pytest.mark.parametrize("name", list(REAL))
def test_signature_round_trip(name):
    func, args, kwargs = REAL[name]
    sig = encode_signature(func, args, kwargs)
    assert sig["target"] == str(func)
    text = json.dumps(sig, allow_nan=False)  # plain JSON
    key = signature_key(sig)
    assert " " not in key and json.loads(key) == sig and key == json.dumps(sig, sort_keys=True, separators=(",", ":"))
    f2, a2, k2 = decode_signature(json.loads(text), "cpu")
    assert f2 is func
    f2(*a2, **k2)  # runs
    assert encode_signature(f2, a2, k2) == sig  # same shapes, dtypes, strides, other values


def test_signature_of_fake_tensors_equals_real():
    with FakeTensorMode():
        fake = _calls(lambda *s, dtype=torch.float32: torch.empty(s, dtype=dtype))
    for name, (func, args, kwargs) in fake.items():
        assert encode_signature(func, args, kwargs) == encode_signature(*REAL[name]), name


def test_signature_contract_shapes():
    sig = encode_signature(*REAL["cat-list"])
    assert sig["args"][0][0] == {"tensor": [8, 16], "dtype": "float32", "stride": [16, 1]}
    assert sig["args"][1] == 0
    sig = encode_signature(*REAL["to-copy"])
    assert sig["kwargs"] == {"dtype": {"py": "torch.float16"}, "device": {"py": "device(type='cpu')"}}
    assert encode_signature(*REAL["add-alpha"])["kwargs"] == {"alpha": 2.5}
    inf_alpha = encode_signature(aten.add.Tensor, (torch.ones(2),), {"alpha": math.inf})
    assert inf_alpha["kwargs"] == {"alpha": {"py": "inf"}}
    assert encode_signature(*REAL["expand"])["args"][0]["stride"] == [4, 1]
    assert encode_signature(*REAL["transposed"])["args"][0]["stride"] == [1, 16]


def test_decode_values_valid_and_seeded():
    sig = encode_signature(*REAL["embedding"])
    _, (weight, idx), _ = decode_signature(sig, "cpu")
    assert idx.dtype == torch.int64 and int(idx.min()) >= 0 and int(idx.max()) < weight.shape[0]
    assert len(set(idx.flatten().tolist())) > 1  # random in range, not all one row
    assert float(weight.min()) >= 0.5 and float(weight.max()) < 1.5
    _, (w2, idx2), _ = decode_signature(sig, "cpu")
    assert torch.equal(weight, w2) and torch.equal(idx, idx2)  # same seed, same values
    _, (w3, _), _ = decode_signature(sig, "cpu", seed=1)
    assert not torch.equal(weight, w3)
    # a device of the capture (meta) becomes the profiling device; other integer tensors are zeros
    sig = {"target": "aten.zeros_like.default", "args": [{"tensor": [3], "dtype": "int32", "stride": [1]}],
           "kwargs": {"device": {"py": "device(type='meta')"}}}
    _, (t,), kw = decode_signature(sig, "cpu")
    assert kw["device"] == torch.device("cpu") and t.tolist() == [0, 0, 0]
    # an expanded (0-stride) tensor keeps its strides
    _, (e, _), _ = decode_signature({"target": "aten.add.Tensor", "args": [
        {"tensor": [3, 4], "dtype": "float32", "stride": [0, 1]}, 1.0], "kwargs": {}}, "cpu")
    assert e.stride() == (0, 1) and torch.equal(e[0], e[2])


@pytest.mark.parametrize("sig, match", [
    ({"target": "aten.no_such_op.default", "args": [], "kwargs": {}}, "not an operator"),
    ({"target": "mm", "args": [], "kwargs": {}}, "namespace.op"),
    ({"target": "aten.mm.default", "args": [{"py": "<object at 0x1>"}], "kwargs": {}}, "cannot rebuild"),
    ({"target": "aten.mm.default", "args": [{"tensor": [2], "dtype": "float99", "stride": [1]}]}, "dtype"),
    ({"target": "aten.mm.default", "args": [{"tensor": [2, 2], "dtype": "float32", "stride": [1]}]}, "one length"),
])
def test_decode_errors(sig, match):
    with pytest.raises(SignatureError, match=match):
        decode_signature(sig, "cpu")


# ============================================================================================ op classes
@pytest.mark.parametrize("op, cls", [
    ("aten.mm.default", "gemm"), ("aten.addmm.default", "gemm"), ("aten.bmm.default", "gemm"),
    ("aten.convolution.default", "convolution"), ("aten.convolution_backward.default", "convolution"),
    ("aten.cudnn_convolution.default", "convolution"),
    ("aten._scaled_dot_product_flash_attention.default", "attention"),
    ("aten._scaled_dot_product_efficient_attention_backward.default", "attention"),
    ("aten.add.Tensor", "elementwise"), ("aten.add_.Tensor", "elementwise"), ("aten.relu.default", "elementwise"),
    ("aten.gelu_backward.default", "elementwise"), ("aten.threshold_backward.default", "elementwise"),
    ("aten.native_dropout.default", "elementwise"),
    ("aten.sum.dim_IntList", "reduction"), ("aten.native_layer_norm.default", "reduction"),
    ("aten.native_layer_norm_backward.default", "reduction"), ("aten._softmax.default", "reduction"),
    ("aten._log_softmax_backward_data.default", "reduction"), ("aten.native_batch_norm.default", "reduction"),
    ("aten.max_pool2d_with_indices_backward.default", "reduction"), ("aten.nll_loss_forward.default", "reduction"),
    ("aten.embedding.default", "embedding"), ("aten.embedding_dense_backward.default", "embedding"),
    ("aten.index_select.default", "embedding"), ("aten.gather.default", "embedding"),
    ("aten._fused_adam_.default", "optimizer"), ("aten._foreach_mul_.Scalar", "optimizer"),
    ("aten.copy_.default", "copy"), ("aten._to_copy.default", "copy"), ("aten.cat.default", "copy"),
    ("aten.clone.default", "copy"), ("aten.permute_copy.default", "copy"), ("aten.slice_scatter.default", "copy"),
    ("aten.select_backward.default", "copy"), ("aten.constant_pad_nd.default", "copy"),
    ("aten.view.default", "view"), ("aten.t.default", "view"), ("aten._unsafe_view.default", "view"),
    ("aten.expand.default", "view"), ("aten.empty.memory_format", "view"), ("aten.detach.default", "view"),
    ("aten::mm", "gemm"), ("aten.no_such_op.default", "other"), ("", "other"),
])
def test_op_class(op, cls):
    assert op_class(op) == cls
    assert cls in OP_CLASSES


def test_op_class_of_optimizer_nodes():
    assert op_class("aten.addcdiv_.default", "optimizer") == "optimizer"  # an unfused Adam's arithmetic
    assert op_class("aten.addcdiv_.default", "forward") == "elementwise"
    assert op_class("aten.mm.default", "optimizer") == "gemm"
    assert op_class("aten.sqrt.default", "optimizer") == "optimizer"


# ============================================================================================ roofline
DEV = Device("g", 16e9, speed=0.8, peak_flops=100e12, mem_bandwidth_Bps=1e12, kind="TestGPU")


def test_roofline_compute_bound():
    flops, nbytes = 6e12, 1e6
    t = roofline_time(flops, nbytes, "gemm", DEV)
    assert t == pytest.approx(flops / (100e12 * 0.6) + 5e-6)
    assert GPU_ROOFLINE.efficiency["gemm"] == 0.6 and GPU_ROOFLINE.launch_overhead_s == 5e-6


def test_roofline_memory_bound():
    t = roofline_time(1e6, 8e9, "elementwise", DEV)
    assert t == pytest.approx(8e9 / (1e12 * 0.8) + 5e-6)
    # the slower of the two terms wins, per class
    assert roofline_time(0, 4e9, "embedding", DEV) == pytest.approx(4e9 / (1e12 * 0.4) + 5e-6)


def test_roofline_launch_overhead_and_views():
    assert roofline_time(0, 0, "elementwise", DEV) == pytest.approx(5e-6)
    assert roofline_time(10, 10, "other", DEV) == pytest.approx(5e-6, rel=1e-3)
    assert roofline_time(1e12, 1e12, "view", DEV) == 0.0  # no kernel
    # multi-tensor optimizer kernels: one launch per 36 tensors on a GPU (a one-tensor update pays its share),
    # one per tensor on a CPU
    assert roofline_time(0, 0, "optimizer", DEV, tensors=72) == pytest.approx(2 * 5e-6)
    assert roofline_time(0, 0, "optimizer", DEV) == pytest.approx(5e-6 / 36)
    assert roofline_time(0, 0, "elementwise", DEV) == pytest.approx(5e-6)
    cpu = Device("c", 1e9, peak_flops=1e11, mem_bandwidth_Bps=1e10, kind="cpu: test")
    assert roofline_for(cpu) is CPU_ROOFLINE
    assert roofline_time(0, 0, "optimizer", cpu, tensors=100) == pytest.approx(100 * CPU_ROOFLINE.launch_overhead_s)


def test_analytic_node_time_uses_node_fields():
    sig = {"target": "aten._fused_adam_.default", "args": [[{"tensor": [4], "dtype": "float32", "stride": [1]}] * 40]}
    rec = {"id": "a", "op": "aten._fused_adam_.default", "kind": "optimizer", "mem_access_bytes": 7e9, "sig": sig}
    assert analytic_node_time(rec, DEV) == pytest.approx(7e9 / (1e12 * 0.7) + 40 / 36 * 5e-6)
    # an unfused Adam's per-parameter arithmetic is optimizer work too
    rec = {"id": "b", "op": "aten.addcdiv_.default", "kind": "optimizer", "mem_access_bytes": 1e9}
    assert analytic_node_time(rec, DEV) == pytest.approx(1e9 / (1e12 * 0.7) + 5e-6 / 36)
    # a gather reads the rows it returns, not its whole table
    emb = {"id": "e", "op": "aten.embedding.default", "mem_access_bytes": 1e9, "output_bytes": 1e6}
    assert node_traffic_bytes(emb) == 2e6
    with pytest.raises(CostError, match="flops"):
        analytic_node_time({"id": "x", "op": "aten.mm.default", "flops": "many"}, DEV)


def test_roofline_needs_device_figures():
    with pytest.raises(CostError, match="peak_flops"):
        roofline_time(1, 1, "gemm", Device("plain", 1e9))
    assert roofline_time(1, 1, "view", Device("plain", 1e9)) == 0.0


# ============================================================================================ apply_costs
def _graph(nodes, name="g"):
    edges = [{"src": a["id"], "dst": b["id"], "bytes": 4} for a, b in itertools.pairwise(nodes)]
    return CompGraph.build(name, nodes, edges, {"capture": {"frontend": "test"}})


NODES = [
    {"id": "mm", "op": "aten.mm.default", "kind": "forward", "flops": 6e12, "mem_access_bytes": 1e6},
    {"id": "add", "op": "aten.add.Tensor", "kind": "forward", "mem_access_bytes": 8e9, "output_bytes": 4e9},
    {"id": "view", "op": "aten.view.default", "kind": "forward", "mem_access_bytes": 8e9},
    {"id": "adam", "op": "aten._fused_adam_.default", "kind": "optimizer", "mem_access_bytes": 7e9,
     "param_bytes": 1e9},
]


@pytest.mark.parametrize("speed", [1.0, 0.8, 2.5])
def test_apply_costs_scales_by_speed(speed):
    dev = Device("g", 16e9, speed=speed, peak_flops=100e12, mem_bandwidth_Bps=1e12, kind="TestGPU")
    g = _graph(NODES)
    out, report = apply_costs(g, dev)
    for v in range(g.num_nodes):
        t_dev = analytic_node_time(g.node_record(v), dev)
        assert out.compute_s[v] == pytest.approx(t_dev * speed)  # compute_s = t_device * speed
        assert out.compute_s[v] / dev.speed == pytest.approx(t_dev)  # what the simulator runs on dev
    assert out.compute_s[2] == 0.0
    # everything else is kept: structure, memory fields, extra keys, meta
    assert out.ids == g.ids and out.num_edges == g.num_edges and list(out.param_bytes) == list(g.param_bytes)
    assert out.node_extra[0]["flops"] == 6e12 and out.meta["capture"] == {"frontend": "test"}
    assert out.meta["cost"] == {"model": "analytic", "device_kind": "TestGPU", "speed": speed, "profiled_nodes": 0,
                                "nodes": 4, "tf32": {"matmul": False, "convolution": True}}
    assert report.model == "analytic" and report.nodes == 4 and report.analytic_nodes == 4
    assert {c: r.count for c, r in report.rows.items()} == {"gemm": 1, "elementwise": 1, "view": 1, "optimizer": 1}
    assert sum(r.share for r in report.rows.values()) == pytest.approx(1.0)
    assert report.total_s == pytest.approx(sum(out.compute_s) / speed)
    text = report.format()
    assert "gemm" in text and "optimizer" in text and json.dumps(report.to_dict())


def test_apply_costs_same_op_on_faster_device_takes_less_compute_s_only_via_speed():
    slow = Device("a", 16e9, speed=1.0, peak_flops=125e12, mem_bandwidth_Bps=900e9, kind="A")
    fast = Device("b", 16e9, speed=2.0, peak_flops=250e12, mem_bandwidth_Bps=900e9, kind="B")
    g = _graph(NODES[:1])
    a, _ = apply_costs(g, slow)
    b, _ = apply_costs(g, fast)
    # a compute-bound op twice as fast on a device of twice the peak: same speed-1.0 seconds (up to overhead)
    assert b.compute_s[0] / fast.speed == pytest.approx(a.compute_s[0] / slow.speed / 2, rel=1e-3)


def test_apply_costs_with_table_and_coverage():
    sig = {"target": "aten.mm.default", "args": [], "kwargs": {}}
    nodes = [dict(NODES[0], sig=sig), dict(NODES[1], id="add2", sig={"target": "aten.add.Tensor"}), NODES[2]]
    table = CostTable(device_kind="TestGPU", entries={signature_key(sig): 0.25})
    out, report = apply_costs(_graph(nodes), DEV, table)
    assert out.compute_s[0] == pytest.approx(0.25 * DEV.speed)  # measured
    assert out.compute_s[1] == pytest.approx(analytic_node_time(nodes[1], DEV) * DEV.speed)  # fallback
    assert report.model == "profiled" and report.profiled_nodes == 1 and report.analytic_nodes == 2
    assert report.coverage == pytest.approx(1 / 3) and 0 < report.profiled_share < 1
    assert "profiled: 1/3" in report.format()
    with pytest.raises(CostError, match="measured on"):
        apply_costs(_graph(nodes), Device("x", 1e9, peak_flops=1, mem_bandwidth_Bps=1, kind="OtherGPU"), table)
    with pytest.raises(CostError, match="unknown cost model"):
        apply_costs(_graph(nodes), DEV, "magic")


# ============================================================================================ cost tables
def test_cost_table_round_trip(tmp_path):
    table = CostTable(device_kind="cpu: X x2", entries={'{"target":"aten.mm.default"}': 1.5e-4, "k2": 0.0},
                      torch="2.14.1", warmup=3, repeats=10, skipped={"k3": "RuntimeError: boom"},
                      device=Device("cpu0", 8e9, 0.001, 1.25e11, 2e10, "cpu: X x2"), meta={"threads": 2})
    path = tmp_path / "costs.json"
    table.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "devplace.costs/1" and doc["device_kind"] == "cpu: X x2" and doc["repeats"] == 10
    back = CostTable.load(path)
    assert back == table
    assert back.lookup({"target": "aten.mm.default"}) == 1.5e-4 and back.lookup({"target": "x"}) is None


# the overheads a profile measures beyond the ops (issue 30 item 5): in the table, on the cluster, in the simulator
OVERHEADS = Overheads(op_s=2e-5, action_s=3e-3, transfer_latency_s=4e-4)
PIPE_NODES = [  # two layers' forward, backward and optimizer ops, and an input (a view: no kernel, no overhead)
    {"id": "x", "op": "input", "kind": "forward", "output_bytes": 8},
    {"id": "f0", "op": "aten.mm.default", "kind": "forward", "flops": 1e12, "mem_access_bytes": 1e6},
    {"id": "f1", "op": "aten.relu.default", "kind": "forward", "mem_access_bytes": 1e6},
    {"id": "b1", "op": "aten.threshold_backward.default", "kind": "backward", "mem_access_bytes": 1e6},
    {"id": "b0", "op": "aten.mm.default", "kind": "backward", "flops": 1e12, "mem_access_bytes": 1e6},
    {"id": "o0", "op": "aten.add_.Tensor", "kind": "optimizer", "mem_access_bytes": 1e5},
]


def test_cost_table_overheads_round_trip_and_charge_every_op_but_views(tmp_path):
    from devplace.hardware.cluster import Cluster, Link
    from devplace.sim import Schedule, simulate

    table = CostTable(device_kind="TestGPU", overheads=OVERHEADS)
    table.save(tmp_path / "t.json")
    back = CostTable.load(tmp_path / "t.json")
    assert back == table and back.overheads == OVERHEADS
    g = _graph(PIPE_NODES)
    plain, _ = apply_costs(g, DEV, CostTable(device_kind="TestGPU"))
    charged, report = apply_costs(g, DEV, back)
    # every op but the input: op_s more on the device (compute_s in speed-1.0 units)
    extra = (charged.compute_s - plain.compute_s) / DEV.speed
    assert extra.tolist() == pytest.approx([0.0] + [OVERHEADS.op_s] * 5, rel=1e-9, abs=1e-15)
    assert report.op_overhead_s == OVERHEADS.op_s and charged.meta["cost"]["op_overhead_s"] == OVERHEADS.op_s
    assert "20.0 us more" in report.format()
    one = Cluster("one", (DEV,), Link(1e9))
    step = {name: simulate(graph, one, [0] * g.num_nodes).step_time_s
            for name, graph in (("plain", plain), ("charged", charged))}
    assert step["charged"] - step["plain"] == pytest.approx(5 * OVERHEADS.op_s, rel=1e-9)  # n ops x overhead
    # the cluster: devices of the table's kind get action_s, links between two of them the transfer latency
    other = Device("h", 16e9, kind="OtherGPU")
    c = apply_overheads(Cluster("c", (DEV, DEV, other), Link(1e9, 1e-6), {(0, 2): Link(5e8, 2e-6)}), back)
    assert [d.action_s for d in c.devices] == [OVERHEADS.action_s, OVERHEADS.action_s, 0.0]
    assert c.latency.tolist() == [[0.0, 4e-4, 2e-6], [4e-4, 0.0, 1e-6], [1e-6, 1e-6, 0.0]]
    assert c.bandwidth[0, 2] == 5e8 and c.bandwidth[0, 1] == 1e9
    again = Cluster.from_dict(c.to_dict())
    assert [d.action_s for d in again.devices] == [d.action_s for d in c.devices]
    assert again.latency.tolist() == c.latency.tolist()
    # a pipelined step on one device: 2M actions (M forwards, M backwards), each followed by a barrier that
    # charges action_s, the last one before the optimizer; one device runs all of it one op at a time
    m = 3
    pipe = Schedule("gpipe", m)
    base = Cluster("one", (DEV,), Link(1e9))
    with_action = apply_overheads(base, back)
    steps = [simulate(plain, cl, [0] * g.num_nodes, schedule=pipe).step_time_s for cl in (base, with_action)]
    assert steps[1] - steps[0] == pytest.approx(2 * m * OVERHEADS.action_s, rel=1e-9)


@pytest.mark.parametrize("doc, match", [
    ({"format": "devplace.costs/1", "device_kind": "x", "overheads": {"op": 1e-6}}, "overheads"),
    ({"format": "devplace.costs/1", "device_kind": "x", "overheads": {"op_s": -1}}, "overheads.op_s"),
    ({"format": "devplace.costs/2", "device_kind": "x", "entries": {}}, "unknown version"),
    ({"format": "devplace.graph/1", "device_kind": "x"}, "expected 'devplace.costs/1'"),
    ({"device_kind": "x"}, "missing \"format\""),
    ({"format": "devplace.costs/1", "entries": {}}, "device_kind"),
    ({"format": "devplace.costs/1", "device_kind": "x", "entries": {"k": -1}}, "seconds"),
    ({"format": "devplace.costs/1", "device_kind": "x", "entries": [1]}, "entries"),
    ({"format": "devplace.costs/1", "device_kind": "x", "repeats": 1.5}, "repeats"),
    ({"format": "devplace.costs/1", "device_kind": "x", "device": {"sped": 1}}, "unknown key"),
])
def test_cost_table_rejects_bad_files(tmp_path, doc, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=match):
        CostTable.load(path)


# ============================================================================================ profiling
def _tensor(*shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.insert(0, acc)
        acc *= s
    return {"tensor": list(shape), "dtype": "float32", "stride": stride}


def _profiled_graph():
    mm = {"target": "aten.mm.default", "args": [_tensor(64, 64), _tensor(64, 64)], "kwargs": {}}
    add = {"target": "aten.add.Tensor", "args": [_tensor(64, 64), _tensor(64, 64)], "kwargs": {"alpha": 2}}
    relu = {"target": "aten.relu.default", "args": [_tensor(64, 64)], "kwargs": {}}
    bad_shapes = {"target": "aten.mm.default", "args": [_tensor(3, 5), _tensor(4, 6)], "kwargs": {}}
    unknown = {"target": "aten.no_such_op.default", "args": [], "kwargs": {}}
    b = 64 * 64 * 4
    nodes = [
        {"id": "input/x", "op": "input", "kind": "forward", "output_bytes": b},
        {"id": "mm#0", "op": mm["target"], "kind": "forward", "flops": 2 * 64**3, "mem_access_bytes": 3 * b,
         "output_bytes": b, "sig": mm},
        {"id": "add#0", "op": add["target"], "kind": "forward", "mem_access_bytes": 3 * b, "output_bytes": b,
         "sig": add},
        {"id": "relu#0", "op": relu["target"], "kind": "forward", "mem_access_bytes": 2 * b, "output_bytes": b,
         "sig": relu},
        {"id": "mm#1", "op": mm["target"], "kind": "backward", "flops": 2 * 64**3, "mem_access_bytes": 3 * b,
         "output_bytes": b, "sig": mm},  # same signature as mm#0: profiled once
        {"id": "bad#0", "op": "aten.mm.default", "kind": "backward", "sig": bad_shapes},
        {"id": "unknown#0", "op": "aten.no_such_op.default", "kind": "backward", "sig": unknown},
    ]
    return _graph(nodes, "tiny"), (mm, add, relu, bad_shapes, unknown)


@pytest.fixture(scope="module")
def cpu():
    return local_cpu_device()


def test_local_cpu_device_is_measured(cpu):
    assert cpu.kind.startswith("cpu: ") and cpu.kind.endswith(f"x{torch.get_num_threads()}")
    assert 1e8 < cpu.peak_flops < 1e15 and 1e8 < cpu.mem_bandwidth_Bps < 1e13 and cpu.memory_bytes > 0
    assert cpu.speed == pytest.approx(cpu.peak_flops / V100_PEAK_FLOPS)
    rl = local_cpu_roofline()
    assert 0 < rl.launch_overhead_s < 1e-3 and 0 < rl.view_s < 1e-3


def test_profile_graph_on_cpu(cpu, tmp_path):
    g, (mm, add, relu, bad, unknown) = _profiled_graph()
    calls = []
    table = profile_graph(g, "cpu", warmup=1, repeats=3, progress=lambda *a: calls.append(a), device_spec=cpu)
    assert set(table.entries) == {signature_key(s) for s in (mm, add, relu)}  # deduped; failures not timed
    assert all(t > 0 for t in table.entries.values())
    assert set(table.skipped) == {signature_key(bad), signature_key(unknown)}  # reported, with the reason
    assert table.skipped[signature_key(bad)].startswith("RuntimeError")
    assert "not an operator" in table.skipped[signature_key(unknown)]
    assert [c[:2] for c in calls] == [(i, 5) for i in range(1, 6)] and calls[0][2] == "aten.mm.default"
    assert table.device_kind == cpu.kind and table.device == cpu and table.repeats == 3 and table.warmup == 1
    assert table.torch == torch.__version__ and table.meta["signatures"] == 5 and table.meta["not_profiled"] == 0
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == table
    # the profiled table costs the graph: measured nodes get their measured time
    out, report = apply_costs(g, cpu, table)
    assert out.compute_s[1] == pytest.approx(table.entries[signature_key(mm)] * cpu.speed)
    assert report.profiled_nodes == 4 and report.analytic_nodes == 3

    limited = profile_graph(g, "cpu", warmup=0, repeats=2, max_ops=2, device_spec=cpu, statistic="min")
    assert len(limited.entries) == 2 and limited.meta["not_profiled"] == 3 and not limited.skipped
    assert limited.meta["statistic"] == "min" and table.meta["statistic"] == "median"
    with pytest.raises(CostError, match="can profile on"):
        profile_graph(g, "meta", device_spec=cpu)


def test_profile_takes_a_custom_model_and_a_thread_count(python_package, tmp_path, capsys, monkeypatch):
    """Issue 23 item 4: `devplace profile --model package.module:factory --threads N` (it took zoo names only, and
    profiled at torch's default thread count, which `devplace run --threads` could not match); the table's
    device kind and meta say the count; a run record has each step's CPU seconds beside its wall seconds."""
    from conftest import run_cli
    from devplace.runtime.run import run_record, run_steps

    pkg = python_package("profiled", """
        import torch
        def factory(batch=4):
            return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()), (torch.randn(batch, 8),)
        """)
    before = torch.get_num_threads()
    try:
        code, _, err = run_cli(["profile", "--model", f"{pkg}:factory", "--threads", "1", "--repeats", "2", "-o",
                                  str(tmp_path / "c.json"), "--no-overheads"], capsys, monkeypatch)
        assert code == 0, err
        doc = json.loads((tmp_path / "c.json").read_text())
        assert doc["device_kind"].endswith(" x1") and doc["threads"] == 1 and doc["entries"]
        assert doc["overheads"] == {"op_s": 0.0, "action_s": 0.0, "transfer_latency_s": 0.0}  # not measured
        # measured (by default on the CPU): the profile writes what the measurement gave, and it reads back
        from devplace.app import overheads as measuring

        fake = measuring.OverheadRun(OVERHEADS, 3e-3, 1e-3, 100, 8e-4, 0.02, 0.03, 0.02, 16, 1.0)
        monkeypatch.setattr(measuring, "measure_overheads", lambda **_: fake)
        code, out, err = run_cli(["profile", "--model", f"{pkg}:factory", "--threads", "1", "--repeats", "2", "-o",
                                  str(tmp_path / "m.json")], capsys, monkeypatch)
        assert code == 0, err
        assert "20.0 us per op, 3.00 ms per pipeline action, 400 us per transfer" in " ".join((out + err).split())
        back = CostTable.load(tmp_path / "m.json")
        assert back.overheads == OVERHEADS and back.meta["overheads_measured"]["actions"] == 16
        code, _, err = run_cli(["profile", "--model", f"{pkg}:factory", "--threads", "0", "-o",
                                str(tmp_path / "d.json")], capsys, monkeypatch)
        assert code == 2 and "--threads" in err
    finally:
        torch.set_num_threads(before)
    model = torch.nn.Linear(8, 1)
    run = run_steps(model, (torch.randn(4, 8),), steps=2, warmup=0, optimizer="sgd")
    assert len(run.cpu_times_s) == 2 and all(t >= 0 for t in run.cpu_times_s) and run.cores_busy is not None
    rec = run_record(run, graph="g", cluster=None, devices=["cpu"], simulated_step_s=1.0)
    assert rec["measured_cpu_steps_s"] == run.cpu_times_s


def test_cost_module_does_not_import_torch():
    code = "import sys, devplace.hardware.cost; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_calibrate_rows(cpu):
    g, _ = _profiled_graph()
    table = profile_graph(g, "cpu", warmup=1, repeats=3, device_spec=cpu)
    cal = calibrate(g, table)
    assert cal["device"] == cpu.kind and cal["covered"] == 4 and cal["uncovered"] == 3 and cal["skipped"] == 2
    assert list(cal["classes"]) == ["gemm", "elementwise"]
    gemm = cal["classes"]["gemm"]
    assert gemm["count"] == 2 and gemm["signatures"] == 1
    for row in [*cal["classes"].values(), cal["all"]]:
        assert row["profiled_s"] > 0 and row["analytic_s"] > 0
        assert row["ratio"] == pytest.approx(row["analytic_s"] / row["profiled_s"])
        assert math.isfinite(row["median_rel_error"]) and row["median_abs_rel_error"] >= 0
    assert cal["all"]["count"] == 4
    text = format_calibration(cal)
    assert "gemm" in text and "elementwise" in text and "all" in text
    json.dumps(cal)
    with pytest.raises(CostError, match="device_spec"):
        calibrate(g, CostTable(device_kind="x"))

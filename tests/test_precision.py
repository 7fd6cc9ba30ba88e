"""Precision-aware costs: node dtypes, per-precision device peaks, capture(dtype=, amp=), mixed-precision
memory, and the FLOPs of grouped/batched matrix products (mixture-of-experts layers)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from devplace.capture import CaptureError, capture
from devplace.capture.flops import grouped_mm_flop, op_flops
from devplace.graph import CompGraph, load_graph, save_graph
from devplace.hardware.cluster import PRECISION_PEAK_KEYS, Cluster, Device, Link
from devplace.hardware.cost import (
    GPU_ROOFLINE,
    TF32_DEFAULTS,
    CostError,
    CostTable,
    analytic_node_time,
    apply_costs,
    dtype_class,
    peak_flops_for,
)
from devplace.hardware.presets import A100_SXM4_40GB, H100_SXM5_80GB, K80_GK210, V100_SXM2_32GB, device_kind, gpus

os.environ.setdefault("HF_HUB_OFFLINE", "1")
A100 = gpus(A100_SXM4_40GB, 1)[0]
LAUNCH = GPU_ROOFLINE.launch_overhead_s


class MatMul(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Block(nn.Module):
    """A transformer MLP block: what autocast runs in bf16 (linears) and what it leaves alone."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _nodes(g: CompGraph, op: str) -> list[dict]:
    return [g.node_record(v) for v in range(g.num_nodes) if g.op[v] == op]


# ------------------------------------------------------------------------------------------- node dtypes
def test_capture_records_each_ops_compute_dtype(tmp_path: Path) -> None:
    g = capture(MatMul(8), torch.randn(4, 8), optimizer="none")
    assert {r["dtype"] for r in _nodes(g, "aten.mm.default")} == {"float32"}
    gb = capture(MatMul(8), torch.randn(4, 8), optimizer="none", dtype="bf16")
    assert {r["dtype"] for r in _nodes(gb, "aten.mm.default")} == {"bfloat16"}
    assert gb.node_record(gb.index["input/x"])["dtype"] == "bfloat16"
    # integer ops have no floating dtype: token ids are int64, the embedding computes in its table's dtype
    emb = capture(nn.Embedding(10, 4), torch.tensor([[1, 2, 3]]), optimizer="none", dtype="fp16")
    assert emb.node_record(emb.index["input/input"])["dtype"] == "int64"
    assert {r["dtype"] for r in _nodes(emb, "aten.embedding.default")} == {"float16"}
    # the key survives the graph file format
    save_graph(gb, tmp_path / "g.json")
    back = load_graph(tmp_path / "g.json")
    assert back.node_record(back.index["input/x"])["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------------- device peaks
def test_presets_carry_datasheet_peaks_per_precision() -> None:
    t = 1e12
    a100, v100, h100, k80 = (gpus(s, 1)[0] for s in (A100_SXM4_40GB, V100_SXM2_32GB, H100_SXM5_80GB, K80_GK210))
    assert (a100.peak_flops_fp32, a100.peak_flops_tf32, a100.peak_flops_bf16, a100.peak_flops_fp16) == \
        (19.5 * t, 156 * t, 312 * t, 312 * t)
    # Volta: FP16 tensor cores only; TF32 and BF16 run on the CUDA cores at the FP32 rate
    assert (v100.peak_flops_fp32, v100.peak_flops_tf32, v100.peak_flops_bf16, v100.peak_flops_fp16) == \
        (15.7 * t, 15.7 * t, 15.7 * t, 125 * t)
    assert h100.peak_flops_bf16 == pytest.approx(2 * h100.peak_flops_tf32, rel=1e-3) and h100.peak_flops_fp32 == 67 * t
    assert {getattr(k80, k) for k in PRECISION_PEAK_KEYS} == {k80.peak_flops}  # Kepler: FP32 for everything
    for d in (a100, v100, h100, k80):  # the speed convention is unchanged: the mixed-precision peak
        assert d.peak_flops == max(getattr(d, k) for k in PRECISION_PEAK_KEYS)


def test_peak_flops_for_chooses_by_class_dtype_and_tf32() -> None:
    assert peak_flops_for(A100, "gemm", "bfloat16") == 312e12
    assert peak_flops_for(A100, "gemm", "float16") == 312e12
    assert peak_flops_for(A100, "gemm", "float32") == 19.5e12  # PyTorch default: fp32 matmuls without TF32
    assert peak_flops_for(A100, "convolution", "float32") == 156e12  # ... but cuDNN convolutions with TF32
    assert peak_flops_for(A100, "attention", "float32", {"matmul": True, "convolution": False}) == 156e12
    assert peak_flops_for(A100, "convolution", "float32", {"matmul": True, "convolution": False}) == 19.5e12
    assert peak_flops_for(A100, "elementwise", "float32") == A100.peak_flops  # no matrix FLOPs: unchanged
    assert peak_flops_for(A100, "gemm", "int64") == A100.peak_flops  # no precision class: peak_flops
    assert peak_flops_for(A100, "gemm", "") == A100.peak_flops
    old = Device("old", 16e9, peak_flops=100e12, mem_bandwidth_Bps=1e12)  # a device without per-precision peaks
    assert peak_flops_for(old, "gemm", "float32") == 100e12
    assert dtype_class("float64") == "fp32" and dtype_class("float8_e4m3fn") == "" and dtype_class("bf16") == "bf16"
    assert TF32_DEFAULTS == {"matmul": False, "convolution": True}


def test_fp32_matmul_costs_the_datasheet_ratio_more_than_bf16_on_a100() -> None:
    n = 4096  # big enough to be compute-bound at both precisions
    times = {}
    for dt in ("fp32", "bf16"):
        g = capture(MatMul(n), torch.empty(n, n, device="meta"), optimizer="none", dtype=dt)
        _, report = apply_costs(g, A100)
        (mm,) = [r for r in _nodes(g, "aten.mm.default") if r["kind"] == "forward"]
        times[dt] = analytic_node_time(mm, A100, tf32=TF32_DEFAULTS) - LAUNCH
        assert mm["flops"] == 2 * n**3
        assert report.rows["gemm"].total_s > 0
    assert times["fp32"] / times["bf16"] == pytest.approx(312 / 19.5, rel=1e-9)  # A100 datasheet: 16x
    assert times["bf16"] == pytest.approx(2 * n**3 / (312e12 * GPU_ROOFLINE.efficiency["gemm"]), rel=1e-9)


def test_tf32_flags_of_the_capture_decide_fp32_convolutions() -> None:
    g = capture(nn.Conv2d(64, 64, 3), torch.empty(64, 64, 56, 56, device="meta"), optimizer="none")
    assert g.meta["capture"]["tf32"] == {"matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                                         "convolution": bool(torch.backends.cudnn.allow_tf32)}

    def conv_s(flags: dict) -> float:
        meta = {**g.meta, "capture": {**g.meta["capture"], "tf32": flags}}
        gg = CompGraph.build(g.name, [g.node_record(v) for v in range(g.num_nodes)],
                             [g.edge_record(e) for e in range(g.num_edges)], meta)
        out, report = apply_costs(gg, A100)
        assert out.meta["cost"]["tf32"] == flags
        return report.rows["convolution"].total_s

    tf32, strict = conv_s({"matmul": False, "convolution": True}), conv_s({"matmul": False, "convolution": False})
    assert 1.5 < strict / tf32 <= 156 / 19.5  # 8x where compute-bound; the memory term caps some ops


def test_autocast_is_not_costed_slower_than_fp32() -> None:
    x = torch.empty(8, 512, 1024, device="meta")
    with torch.device("meta"):
        block = Block(1024)
    fp32 = capture(block, x)
    amp = capture(block, x, amp=True)
    assert amp.meta["capture"]["amp"] == "bfloat16" and amp.meta["capture"]["dtype"] == "float32"
    assert {r["dtype"] for r in _nodes(amp, "aten.mm.default") + _nodes(amp, "aten.addmm.default")} == {"bfloat16"}
    # autocast keeps fp32 parameters (their own master weights): the persistent memory is fp32's
    assert amp.meta["capture"]["param_bytes"] == fp32.meta["capture"]["param_bytes"]
    assert amp.meta["capture"]["master_weight_bytes"] == 0
    for dev in (A100, device_kind("H100")):
        assert apply_costs(amp, dev)[1].total_s < apply_costs(fp32, dev)[1].total_s, dev.kind
    # a V100 has no bf16 tensor cores (bf16 runs at the fp32 rate there), but fp16 ones: amp trains in fp16
    v100 = device_kind("V100")
    amp16 = capture(block, x, amp=True, dtype="fp16")
    assert apply_costs(amp16, v100)[1].total_s < apply_costs(fp32, v100)[1].total_s
    assert apply_costs(amp, v100)[1].total_s == pytest.approx(apply_costs(fp32, v100)[1].total_s, rel=0.05)


# ------------------------------------------------------------------------------------------- capture dtype
def test_dtype_casts_parameters_and_inputs_and_counts_optimizer_state_in_it() -> None:
    model = Block(16)
    fp32 = capture(model, torch.randn(2, 16))
    bf16 = capture(model, torch.randn(2, 16), dtype="bf16")
    n = sum(p.numel() for p in model.parameters())
    assert model.up.weight.dtype == torch.float32  # the model is left as it was
    assert fp32.meta["capture"]["param_bytes"] == n * (4 + 4 + 8)  # weight, grad, Adam's two moments
    assert bf16.meta["capture"]["param_bytes"] == n * (2 + 2 + 4)  # pure bf16: torch.optim keeps bf16 state
    assert bf16.meta["capture"]["dtype"] == "bfloat16" and bf16.meta["capture"]["amp"] is None
    assert {r["dtype"] for r in _nodes(bf16, "aten.addmm.default")} == {"bfloat16"}
    assert sum(bf16.param_bytes) == bf16.meta["capture"]["param_bytes"]


def test_amp_with_low_precision_parameters_counts_fp32_master_weights() -> None:
    model = Block(16).to(torch.bfloat16)
    g = capture(model, torch.randn(2, 16, dtype=torch.bfloat16), amp=True)
    n = sum(p.numel() for p in model.parameters())
    # bf16 weight + bf16 grad + fp32 master copy + Adam's two moments in fp32 (ZeRO's 16 bytes per parameter)
    assert g.meta["capture"]["param_bytes"] == n * (2 + 2 + 4 + 8)
    assert g.meta["capture"]["master_weight_bytes"] == 4 * n
    assert sum(g.param_bytes) == g.meta["capture"]["param_bytes"]
    # the recorded step is that of a master-weight optimizer: grad cast to fp32, fp32 update, cast back
    opt = [g.node_record(v) for v in range(g.num_nodes) if g.kind[v] == "optimizer"]
    n_tensors = len(list(model.parameters()))
    assert sum(r["op"] == "aten._to_copy.default" for r in opt) == n_tensors
    assert sum(r["op"] == "aten.copy_.default" for r in opt) == n_tensors
    assert {r["dtype"] for r in opt if r["op"].startswith("aten.addcdiv_")} == {"float32"}
    sgd = capture(model, torch.randn(2, 16, dtype=torch.bfloat16), amp=True, optimizer="sgd")
    assert sgd.meta["capture"]["param_bytes"] == n * (2 + 2 + 4)  # plain SGD has no state; the master copy stays


@pytest.mark.parametrize(("dtype", "amp", "match"), [("fp8", False, "unknown dtype 'fp8'"),
                                                      ("float32", False, "unknown dtype"),
                                                      ("fp32", True, "amp .autocast. needs a low precision")])
def test_bad_precision_is_a_clear_error(dtype: str, amp: bool, match: str) -> None:
    with pytest.raises(CaptureError, match=match):
        capture(MatMul(4), torch.randn(2, 4), dtype=dtype, amp=amp)


def test_a_model_that_fails_is_one_clear_line_without_torch_logs(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) @ torch.ones(4, 2)  # 3 != 4: the shape check fails on the fake tensors

    with caplog.at_level(logging.DEBUG), pytest.raises(CaptureError) as err:
        capture(Broken(), torch.randn(2, 4))
    msg = str(err.value)
    assert "\n" not in msg and "forward step at aten.mm.default" in msg and "dtype=None" in msg
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_apply_costs_dtype_is_the_default_for_nodes_without_one() -> None:
    nodes = [{"id": "mm", "op": "aten.mm.default", "flops": 1e12, "mem_access_bytes": 1e6}]
    g = CompGraph.build("g", nodes, [], {})
    t = {d: apply_costs(g, A100, dtype=d)[0].compute_s[0] for d in ("fp32", "bf16")}
    assert apply_costs(g, A100)[0].compute_s[0] == pytest.approx(t["bf16"])  # None: peak_flops, as before
    assert (t["fp32"] / A100.speed - LAUNCH) / (t["bf16"] / A100.speed - LAUNCH) == pytest.approx(16)
    with pytest.raises(CostError, match="unknown dtype 'int8'"):
        apply_costs(g, A100, dtype="int8")


def test_cluster_json_keeps_peaks_and_reads_old_files() -> None:
    c = Cluster("c", gpus(A100_SXM4_40GB, 2), Link(1e10))
    doc = json.loads(json.dumps(c.to_dict()))
    assert doc["devices"][0]["peak_flops_tf32"] == 156e12
    assert Cluster.from_dict(doc).devices == c.devices
    for rec in doc["devices"]:  # a file written before the per-precision peaks
        for k in PRECISION_PEAK_KEYS:
            del rec[k]
    old = Cluster.from_dict(doc).devices[0]
    assert old == replace(c.devices[0], **dict.fromkeys(PRECISION_PEAK_KEYS, 0.0))
    assert peak_flops_for(old, "gemm", "float32") == old.peak_flops
    table = CostTable("A100-SXM4-40GB", {}, device=A100)  # cost tables carry the device with its peaks
    assert CostTable.from_dict(json.loads(json.dumps(table.to_dict()))).device == A100


@pytest.mark.parametrize(("dtype", "amp", "suffix"), [("bf16", False, "-bf16"), (None, True, "-amp-bf16")])
def test_zoo_pipeline_takes_the_precision(dtype: str | None, amp: bool, suffix: str) -> None:
    from devplace.capture.pipeline import zoo_prepared

    prepared = zoo_prepared("mobilenet_v3_large", batch=2, max_nodes=40, device=A100, dtype=dtype, amp=amp)
    full = prepared.full
    assert full.name.endswith(suffix) and full.meta["capture"]["amp"] == ("bfloat16" if amp else None)
    convs = [full.node_record(v) for v in range(full.num_nodes) if full.op[v] == "aten.convolution.default"]
    assert convs and {r["dtype"] for r in convs} == {"bfloat16"}
    assert prepared.report.rows["convolution"].total_s > 0 and prepared.graph.num_nodes <= 40


# ------------------------------------------------------------------------------------------- MoE FLOPs
@pytest.mark.parametrize(("a", "b", "out", "flops"), [
    ((12, 8), (3, 8, 5), (12, 5), 2 * 12 * 8 * 5),  # tokens sorted by expert, one weight per expert
    ((6, 12), (12, 5), (3, 6, 5), 2 * 6 * 12 * 5),  # weight gradient: groups along the contraction
    ((3, 4, 8), (3, 8, 5), (3, 4, 5), 2 * 3 * 4 * 8 * 5),  # batched
    ((4, 8), (8, 15), (4, 15), 2 * 4 * 8 * 15),  # 3-d x 2-d in torch's docs: groups along N
])
def test_grouped_mm_flops_from_shapes(a: tuple, b: tuple, out: tuple, flops: int) -> None:
    assert grouped_mm_flop(a, b, out_shape=out) == flops


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda s: sum(s) > 0),
       k=st.sampled_from([8, 16]), n=st.sampled_from([8, 24]))
def test_grouped_mm_flops_equal_the_sum_over_groups_of_a_real_run(sizes: list[int], k: int, n: int) -> None:
    # a real CPU run of the op (bf16: its strides must be multiples of 16 bytes) with tokens routed to experts
    x = torch.randn(sum(sizes), k, dtype=torch.bfloat16)  # experts may get no token (a size 0)
    w = torch.randn(len(sizes), k, n, dtype=torch.bfloat16)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.ops.aten._grouped_mm.default(x, w, offs)
    assert out.shape == (x.shape[0], n)
    assert op_flops(torch.ops.aten._grouped_mm.default, (x, w, offs), {}, out) == sum(2 * m * k * n for m in sizes)


@pytest.mark.parametrize(("op", "args", "flops"), [
    ("addbmm", (torch.randn(4, 6), torch.randn(3, 4, 5), torch.randn(3, 5, 6)), 2 * 3 * 4 * 5 * 6),
    ("mv", (torch.randn(4, 5), torch.randn(5)), 2 * 4 * 5),
    ("addmv", (torch.randn(4), torch.randn(4, 5), torch.randn(5)), 2 * 4 * 5),
    ("dot", (torch.randn(7), torch.randn(7)), 2 * 7),
    ("_addmm_activation", (torch.randn(6), torch.randn(4, 5), torch.randn(5, 6)), 2 * 4 * 5 * 6),
])
def test_matrix_products_without_a_torch_formula_are_counted(op: str, args: tuple, flops: int) -> None:
    func = getattr(torch.ops.aten, op).default
    assert op_flops(func, args, {}, func(*args)) == flops


def _tiny_moe(kind: str) -> tuple[nn.Module, dict[str, int]]:
    transformers = pytest.importorskip("transformers")
    dims = {"vocab": 64, "hidden": 32, "inter": 16, "experts": 4, "top_k": 2, "layers": 2}
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=dims["inter"],
            num_hidden_layers=dims["layers"], num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=dims["experts"], num_experts_per_tok=dims["top_k"], max_position_embeddings=64)
        return transformers.MixtralForCausalLM(cfg), dims
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=48,
        moe_intermediate_size=dims["inter"], shared_expert_intermediate_size=32, num_hidden_layers=dims["layers"],
        num_attention_heads=4, num_key_value_heads=2, num_experts=dims["experts"],
        num_experts_per_tok=dims["top_k"], max_position_embeddings=64)
    return transformers.Qwen2MoeForCausalLM(cfg), dims


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_captures_in_fp32_and_bf16_with_expert_flops(kind: str, dtype: str) -> None:
    model, d = _tiny_moe(kind)
    batch, seq = 2, 8
    ids = torch.randint(0, d["vocab"], (batch, seq))
    g = capture(model, {"input_ids": ids, "labels": ids}, dtype=dtype)
    experts = _nodes(g, "aten._grouped_mm.default")
    assert experts and {r["dtype"] for r in experts} == {"float32" if dtype == "fp32" else "bfloat16"}
    # every token goes to top_k experts: S rows through gate+up (hidden -> 2 * inter) and down (inter -> hidden);
    # forward once, backward twice (input and weight gradients)
    s = batch * seq * d["top_k"]
    forward = 2 * s * d["hidden"] * 2 * d["inter"] + 2 * s * d["inter"] * d["hidden"]
    assert sum(r["flops"] for r in experts) == d["layers"] * 3 * forward
    _, report = apply_costs(g, A100)
    assert report.rows["gemm"].total_s > 0


def test_placed_fp32_moe_runs_the_experts_in_fp32_as_captured() -> None:
    """The capture takes a float32 `_grouped_mm`'s shape from the bf16 meta kernel; under the runtime's trace
    (make_fx) those casts must not become ops: the placed step runs the float32 kernel the graph recorded, so
    its loss and gradients are the eager model's exactly (with the casts traced, the experts ran in bf16)."""
    from devplace.graph.placement import Placement
    from devplace.runtime.apply import apply_placement

    torch.manual_seed(0)
    model, d = _tiny_moe("mixtral")
    ids = torch.randint(0, d["vocab"], (2, 8))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    eager = model(**inputs).loss
    eager.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    g = capture(model, inputs)
    placed = apply_placement(model, g, Placement.from_array(g, [0] * g.num_nodes), ["cpu"], inputs)
    traced = placed._trace_for((), inputs)[0].gm.graph.nodes
    assert placed.granularity == "op"
    assert not [n for n in traced if n.op == "call_function" and n.kwargs.get("dtype") == torch.bfloat16]
    loss = placed(**inputs).loss
    loss.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), eager_grads, strict=True))

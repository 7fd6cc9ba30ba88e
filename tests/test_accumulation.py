"""Gradient accumulation over micro-batches (`devplace.graph.phases`, "gradient accumulation"): the capture records
the add of each parameter gradient into `.grad` on the op that makes it, the cost model costs it as any op, and the
pipelined step pays it on every micro-batch after the first, on the device that makes the gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import cluster
from devplace.capture.profile import profile_graph
from devplace.capture.torch_capture import capture
from devplace.errors import GraphError
from devplace.graph import CompGraph
from devplace.graph.coarsen import coarsen
from devplace.graph.phases import ACCUMULATE_BYTES_KEY, ACCUMULATE_KEY, ACCUMULATES_KEY, SCALE_KEY, accumulation
from devplace.graph.ties import fold
from devplace.hardware.cluster import Device
from devplace.hardware.cost import CPU_ROOFLINE, CostError, CostTable, apply_costs, node_signatures, signature_key
from devplace.sim import Schedule, simulate_schedule


def two_stage(acc0: float = 0.0, acc1: float = 0.0, nbytes: float = 0.0, scale: float = 0.0,
              loss: str = "sum") -> tuple[CompGraph, np.ndarray]:
    """f0 (device 0) -> f1 (device 1) -> loss gradient b1 -> b0, each op 1 s; b0 and b1 make the gradients of their
    layer's weight (updated by o0, o1), whose adds into .grad take acc0 and acc1 seconds and whose division by M
    (a loss that is a mean, `loss`) `scale` seconds."""
    nodes = [{"id": "f0", "kind": "forward", "compute_s": 1.0, "output_bytes": 1},
             {"id": "f1", "kind": "forward", "compute_s": 1.0, "output_bytes": 1},
             {"id": "b1", "kind": "backward", "group": "f1", "compute_s": 1.0, "output_bytes": 1,
              ACCUMULATE_KEY: acc1, ACCUMULATE_BYTES_KEY: nbytes, SCALE_KEY: scale},
             {"id": "b0", "kind": "backward", "group": "f0", "compute_s": 1.0, ACCUMULATE_KEY: acc0,
              ACCUMULATE_BYTES_KEY: nbytes, SCALE_KEY: scale},
             {"id": "o0", "kind": "optimizer", "group": "f0", "compute_s": 0.5, "param_bytes": 100},
             {"id": "o1", "kind": "optimizer", "group": "f1", "compute_s": 0.5, "param_bytes": 100}]
    edges = [{"src": "f0", "dst": "f1", "bytes": 0}, {"src": "f1", "dst": "b1", "bytes": 0},
             {"src": "b1", "dst": "b0", "bytes": 0}, {"src": "f0", "dst": "b0", "bytes": 0},
             {"src": "b0", "dst": "o0", "bytes": 0, "tensor": 1}, {"src": "b1", "dst": "o1", "bytes": 0, "tensor": 1}]
    g = CompGraph.build("two", nodes, edges, {"capture": {"loss_reduction": loss}})
    return g, np.array([0, 1, 1, 0, 0, 1])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_the_pipelined_step_grows_by_exactly_the_adds_of_later_microbatches(kind, m):
    """Every run of a micro-batch after the first is longer by its adds (the first micro-batch's gradient becomes
    .grad: no add). On one device every run is on the critical path: the step grows by (M - 1) times all adds."""
    c = cluster(2, bw=1e9)
    base, devs = two_stage()
    g, _ = two_stage(acc0=0.25, acc1=0.125)
    got = simulate_schedule(g, c, devs, Schedule(kind, m, microbatch_graph=True))
    runs = got.microbatch_finish_s - got.microbatch_start_s
    b0, b1 = g.index["b0"], g.index["b1"]
    assert runs[:, b0].tolist() == [1.0] + [1.25] * (m - 1) and runs[:, b1].tolist() == [1.0] + [1.125] * (m - 1)
    one = np.zeros(6, dtype=np.int64)
    single = simulate_schedule(g, c, one, Schedule(kind, m, microbatch_graph=True))
    alone = simulate_schedule(base, c, one, Schedule(kind, m, microbatch_graph=True))
    assert single.step_time_s == alone.step_time_s + (m - 1) * (0.25 + 0.125)
    assert single.device_busy_s.sum() == alone.device_busy_s.sum() + (m - 1) * (0.25 + 0.125)
    if kind == "gpipe":  # two stages: b0(1) waits for b1(1) (one add late), then device 0's backwards run back to back
        plain = simulate_schedule(base, c, devs, Schedule(kind, m, microbatch_graph=True))
        assert got.step_time_s == plain.step_time_s + (m > 1) * (0.125 + (m - 1) * 0.25)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_a_mean_losss_gradients_are_divided_by_m_once_per_step_after_the_flush(kind, m):
    """torch's pipelining divides a mean loss's gradients by M after each stage's last backward (`scale_grads`),
    not with M = 1 and not for a summed loss: once per step, on the gradient's device, before its update."""
    c = cluster(2, bw=1e9)
    base, devs = two_stage()
    plain = simulate_schedule(base, c, devs, Schedule(kind, m, microbatch_graph=True))
    for loss in ("mean", "sum"):
        g, _ = two_stage(scale=0.5, loss=loss)
        got = simulate_schedule(g, c, devs, Schedule(kind, m, microbatch_graph=True))
        divided = loss == "mean" and m > 1
        # device 0's b0 ends the step's backward; its division runs after the flush, with the update o0
        assert got.step_time_s == plain.step_time_s + 0.5 * divided
        assert (got.device_busy_s - plain.device_busy_s).tolist() == [0.5 * divided] * 2
        b0 = g.index["b0"]
        assert got.finish_s[b0] - got.microbatch_finish_s[-1, b0] == 0.5 * divided + 0.5 * divided  # after o0


def test_the_new_gradient_is_held_while_it_is_added():
    """A later micro-batch's gradient is a new tensor until it is added into .grad (the first's is .grad, counted in
    param_bytes): held while its op runs, so a device's peak grows by it where that op sets the peak."""
    c = cluster(2, bw=1e9)
    for m in (1, 3):
        plain, devs = two_stage()
        held, _ = two_stage(nbytes=1000.0)
        a = simulate_schedule(plain, c, devs, Schedule("1f1b", m, microbatch_graph=True))
        b = simulate_schedule(held, c, devs, Schedule("1f1b", m, microbatch_graph=True))
        assert (b.peak_memory_bytes - a.peak_memory_bytes).tolist() == ([1000.0, 1000.0] if m > 1 else [0.0, 0.0])


def test_a_bad_accumulation_value_is_named():
    g = CompGraph.build("bad", [{"id": "b", "kind": "backward", "compute_s": 1.0, ACCUMULATE_KEY: -1}], [])
    with pytest.raises(GraphError, match="'b' has accumulate_s=-1"):
        accumulation(g)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.b(torch.relu(self.a(x))))


@pytest.fixture(scope="module")
def net_graph() -> CompGraph:
    torch.manual_seed(0)
    return capture(_Net(), (torch.randn(8, 16),))


def test_the_capture_records_one_add_per_trainable_parameter_on_the_op_that_makes_its_gradient(net_graph):
    g = net_graph
    made = {g.ids[v]: g.node_extra[v][ACCUMULATES_KEY] for v in range(g.num_nodes)
            if ACCUMULATES_KEY in g.node_extra[v]}
    shapes = sorted(tuple(a["sig"]["args"][0]["tensor"]) for accs in made.values() for a in accs)
    assert shapes == sorted([(32, 16), (32,), (4, 32), (4,)])  # the frozen layer's weights get none
    for nid, accs in made.items():
        v = g.index[nid]
        assert g.kind[v] == "backward"
        for a in accs:
            assert a["sig"]["target"] == "aten.add_.Tensor" and a["sig"]["args"][0] == a["sig"]["args"][1]
            assert a["scale_sig"]["target"] == "aten.div_.Tensor" and a["scale_sig"]["args"][0] == a["sig"]["args"][0]
            assert a["bytes"] == 4 * int(np.prod(a["sig"]["args"][0]["tensor"]))
        assert g.node_extra[v][ACCUMULATE_BYTES_KEY] == sum(a["bytes"] for a in accs)
    assert accumulation(g).nbytes.sum() == 4 * (32 * 16 + 32 + 4 * 32 + 4)
    # the summed outputs (the default loss) are no mean: torch's pipelining does not divide their gradients
    assert g.meta["capture"]["loss_reduction"] == "sum"
    meaned = capture(_Net(), (torch.randn(8, 16),), loss_fn=lambda y: y.mean())
    assert meaned.meta["capture"]["loss_reduction"] == "mean"


def test_the_cost_model_costs_each_add_as_an_elementwise_op(net_graph):
    dev = Device("cpu0", 1e9, 2.0, kind="cpu-x", peak_flops=1e11, mem_bandwidth_Bps=1e10)
    out, _ = apply_costs(net_graph, dev)
    acc = accumulation(out)
    for v in np.flatnonzero(acc.nbytes > 0).tolist():
        adds = net_graph.node_extra[v][ACCUMULATES_KEY]
        want = sum(3 * a["bytes"] / (dev.mem_bandwidth_Bps * CPU_ROOFLINE.bw_efficiency["elementwise"])
                   + CPU_ROOFLINE.launch_overhead_s for a in adds)
        assert acc.compute_s[v] == pytest.approx(want * dev.speed)  # compute_s units: seconds at speed 1
        divide = sum(2 * a["bytes"] / (dev.mem_bandwidth_Bps * CPU_ROOFLINE.bw_efficiency["elementwise"])
                     + CPU_ROOFLINE.launch_overhead_s for a in adds)
        assert acc.scale_s[v] == pytest.approx(divide * dev.speed)
    # a table that measured an add gives its time (plus the table's per-op overhead)
    add = net_graph.node_extra[int(np.flatnonzero(acc.nbytes > 0)[0])][ACCUMULATES_KEY][0]["sig"]
    table = CostTable(device_kind="cpu-x", entries={signature_key(add): 0.5}, device=dev)
    costed = accumulation(apply_costs(net_graph, dev, table)[0])
    assert costed.compute_s.max() == pytest.approx(0.5 * dev.speed)
    # the adds are among the signatures profiling times
    sigs = {signature_key(s) for v in range(net_graph.num_nodes) for s in node_signatures(net_graph.node_extra[v])}
    assert signature_key(add) in sigs
    bad = CompGraph.build("bad", [{"id": "b", "kind": "backward", ACCUMULATES_KEY: [1]}], [])
    with pytest.raises(CostError, match="must be a list of objects"):
        apply_costs(bad, dev)


def test_profiling_times_the_adds(net_graph):
    small = CompGraph.build("s", [net_graph.node_record(v) for v in range(net_graph.num_nodes)
                                  if ACCUMULATES_KEY in net_graph.node_extra[v]], [])
    dev = Device("cpu0", 1e9, 1.0, kind="cpu-x", peak_flops=1e11, mem_bandwidth_Bps=1e10)
    table = profile_graph(small, "cpu", warmup=0, repeats=1, device_spec=dev)
    adds = [a[k] for v in range(small.num_nodes) for a in small.node_extra[v][ACCUMULATES_KEY]
            for k in ("sig", "scale_sig")]
    assert {signature_key(s) for s in adds} <= set(table.entries)


def test_coarse_groups_and_folded_classes_sum_their_members_adds(net_graph):
    dev = Device("cpu0", 1e9, 1.0, kind="cpu-x", peak_flops=1e11, mem_bandwidth_Bps=1e10)
    g, _ = apply_costs(net_graph, dev)
    acc = accumulation(g)
    for merged in (fold(g).graph, coarsen(g, max_nodes=4).graph):
        got = accumulation(merged)
        assert got.compute_s.sum() == pytest.approx(acc.compute_s.sum())
        assert got.nbytes.sum() == acc.nbytes.sum()


@pytest.mark.parametrize("p", [2, 3])
def test_a_tied_parameters_stages_each_add_and_divide_their_own_copy(p):
    """A tied weight's gradient is one sum in the capture (its add into .grad and division recorded there), but
    the runtime keeps a copy per stage that uses it, each accumulated and divided by its stage: the sum's adds
    move to the embedding's (stage 0) and the head's (stage p - 1) contributions, and nothing is left on the sum,
    which runs once per step."""
    from test_sim_schedule import tied_lm

    g, devs = tied_lm(p)
    recs = [{**g.node_record(v), **({ACCUMULATE_KEY: 0.25, SCALE_KEY: 0.125} if g.ids[v] == "sum" else {})}
            for v in range(g.num_nodes)]
    tied = CompGraph.build("tied", recs, [g.edge_record(e) for e in range(g.num_edges)],
                           {"capture": {"loss_reduction": "mean"}})
    c = cluster(p, bw=1e9)
    plain = simulate_schedule(g, c, devs, Schedule("1f1b", 4, microbatch_graph=True))
    got = simulate_schedule(tied, c, devs, Schedule("1f1b", 4, microbatch_graph=True))
    runs = got.microbatch_finish_s - got.microbatch_start_s
    for nid in ("bemb", "bhw"):
        v = g.index[nid]
        assert runs[:, v].tolist() == [1.0] + [1.25] * 3
    # every stage's busy time grows by its adds and its division; stages between hold nothing of the parameter
    grown = (got.device_busy_s - plain.device_busy_s).tolist()
    assert grown == [3 * 0.25 + 0.125] + [0.0] * (p - 2) + [3 * 0.25 + 0.125]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_parallel_plans_replicas_pay_the_adds_as_a_pipeline_does(zero):
    """`simulate_parallel` simulates each replica's pipeline as `simulate_schedule` does: under pure data
    parallelism with 2 micro-batches per replica (GPipe's order), every ZeRO stage, the second micro-batch's
    backward ops each add their gradient into .grad (0.25 s), one after the other on the replica's device."""
    from devplace.graph.parallel import ParallelPlan
    from devplace.sim.parallel import simulate_parallel
    from test_sim_parallel import model

    base = model(2, meta={"microbatches": 2})
    recs = [{**base.node_record(v), **({ACCUMULATE_KEY: 0.25} if base.ids[v].startswith("b") else {})}
            for v in range(base.num_nodes)]
    g = CompGraph.build("m", recs, [base.edge_record(e) for e in range(base.num_edges)], base.meta)
    plan = ParallelPlan(dp=2, pp=1, microbatches=2, batch=4, schedule="none", zero=zero)
    stage = np.zeros(g.num_nodes, dtype=np.int64)
    c = cluster(2, bw=1e9)
    assert simulate_parallel(g, c, stage, plan).step_time_s == simulate_parallel(base, c, stage, plan).step_time_s + 0.5

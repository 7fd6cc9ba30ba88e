"""Simulation of dp x pp plans (DESIGN.md section 9b): agreement with the pipeline simulator at dp=1, gradient
sync in buckets, ZeRO traffic and memory, recomputation, memory by category -- on hand-computed figures."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from conftest import cluster
from devplace.graph import CompGraph
from devplace.graph.parallel import ParallelPlan, ParallelPlanError
from devplace.graph.phases import STEP_COMPUTE_KEY
from devplace.hardware.collectives import collective_s
from devplace.sim.parallel import (
    RECOMPUTE_SUFFIX,
    ParamShares,
    param_shares,
    recompute_graph,
    recompute_units,
    simulate_parallel,
)
from devplace.sim.schedule import BACKWARD, Schedule, ScheduleError, op_phases, simulate_schedule
from test_sim_schedule import pipelines


def model(layers: int, *, f: float = 1.0, b: float = 2.0, act: float = 10.0, inp: float = 1.0,
          param: float = 0.0, meta: dict | None = None) -> CompGraph:
    """x -> f0 -> ... -> f{L-1}; b{L-1} -> ... -> b0, each b_l reading f_l's output; an optimizer update o_l
    (no compute) holding `param` bytes after b_l."""
    nodes = [{"id": "x", "op": "input", "kind": "forward", "output_bytes": inp}]
    nodes += [{"id": f"f{i}", "compute_s": f, "kind": "forward", "output_bytes": act} for i in range(layers)]
    nodes += [{"id": f"b{i}", "compute_s": b, "kind": "backward", "group": f"f{i}"} for i in range(layers)]
    nodes += [{"id": f"o{i}", "kind": "optimizer", "param_bytes": param} for i in range(layers)]
    edges = [{"src": "x", "dst": "f0", "bytes": inp}]
    edges += [{"src": f"f{i}", "dst": f"f{i + 1}", "bytes": act} for i in range(layers - 1)]
    edges += [{"src": f"f{i}", "dst": f"b{i}", "bytes": act} for i in range(layers)]
    edges += [{"src": f"b{i + 1}", "dst": f"b{i}", "bytes": 0} for i in range(layers - 1)]
    edges += [{"src": f"b{i}", "dst": f"o{i}", "bytes": 0} for i in range(layers)]
    return CompGraph.build("m", nodes, edges, meta)


def stages_of(g: CompGraph, pp: int) -> np.ndarray:
    """Layer l (its f, b and o) on stage l * pp // L; the input with layer 0."""
    layers = sum(1 for i in g.ids if i.startswith("f"))
    return np.array([0 if i == "x" else int(i[1:]) * pp // layers for i in g.ids], dtype=np.int64)


def test_dp1_zero0_agrees_with_the_pipeline_simulator() -> None:
    g, c = model(4, param=8.0, meta={"microbatches": 4}), cluster(2, bw=100.0)
    plan = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4)
    r = simulate_parallel(g, c, stages_of(g, 2), plan)
    ref = simulate_schedule(g, c, stages_of(g, 2), Schedule("1f1b", 4, microbatch_graph=True))
    assert r.step_time_s == ref.step_time_s
    assert [m.total for m in r.memory] == pytest.approx(ref.peak_memory_bytes.tolist())
    # graphs without capture metadata: Adam without master weights, weights : grads : states = 1 : 1 : 2
    assert [(m.parameters, m.gradients, m.optimizer_state) for m in r.memory] == [(4.0, 4.0, 8.0)] * 2
    # 1F1B: stage 0 holds its two layers' activations for pp - 0 = 2 micro-batches in flight (x is freed
    # once f0 has read it)
    assert r.memory[0].stash == 2 * 2 * 10.0
    doc = r.to_dict()
    assert r.feasible and doc["parallel"]["pp"] == 2 and doc["step_time_s"] == r.step_time_s
    assert doc["memory"][0] == {"device": 0, "stage": 0, "parameters": 4.0, "gradients": 4.0, "optimizer_state": 8.0,
                                "stash": 40.0, "temporaries": r.memory[0].temporaries, "total": r.memory[0].total,
                                "capacity": 1e12}


def test_gradient_buckets_overlap_the_backward() -> None:
    # one device per replica, two layers: b1 ends at 4 s, b0 at 6 s; each layer's gradients are 1e9 bytes
    # (param_bytes 4e9, a quarter of it gradients), all-reduced over 2 devices at 1 GB/s: 1 s per layer
    g, c = model(2, param=4e9), cluster(2, bw=1e9)
    plan = ParallelPlan(dp=2, pp=1, microbatches=1, batch=2, schedule="none")
    stage = np.zeros(g.num_nodes, dtype=np.int64)
    assert collective_s(c, (0, 1), "all-reduce", 1e9) == pytest.approx(1.0)
    per_layer = simulate_parallel(g, c, stage, plan, bucket_bytes=1e9)
    assert per_layer.pipelines[0].step_time_s == pytest.approx(6.0)
    assert per_layer.sync[0].sync_end_s == pytest.approx(7.0)  # layer 1's bucket ran 4..5, under b0
    assert per_layer.step_time_s == pytest.approx(7.0)
    one_bucket = simulate_parallel(g, c, stage, plan, bucket_bytes=1e12)
    assert one_bucket.step_time_s == pytest.approx(8.0)  # 2e9 bytes after the backward: 2 s exposed
    assert len(per_layer.pipelines) == 2 and per_layer.pipelines[0] is per_layer.pipelines[1]  # alike: one run


def test_zero_stages_traffic_and_memory() -> None:
    g, c = model(2, param=4e9), cluster(2, bw=1e9)
    stage = np.zeros(g.num_nodes, dtype=np.int64)

    def run(zero: int):
        plan = ParallelPlan(dp=2, pp=1, microbatches=1, batch=2, schedule="none", zero=zero)
        return simulate_parallel(g, c, stage, plan, bucket_bytes=1e9)
    z1, z2, z3 = run(1), run(2), run(3)
    # ZeRO-1: reduce-scatter per bucket (0.5 s: 4..4.5, 6..6.5), then all-gather 2e9 bytes of weights (1 s)
    assert z1.step_time_s == pytest.approx(7.5)
    assert z2.step_time_s == pytest.approx(7.5)
    # ZeRO-3: 2 M = 2 all-gathers of the weights (1 s each): the first bucket's (1e9 bytes, 0.5 s) before
    # any compute, the rest under 6 s of compute; no gather after the update
    assert z3.step_time_s == pytest.approx(7.0)
    per_device = [(m.parameters, m.gradients, m.optimizer_state) for m in (z1.memory[0], z2.memory[0], z3.memory[0])]
    assert per_device == [(2e9, 2e9, 2e9), (2e9, 1e9, 2e9), (1e9, 1e9, 2e9)]
    assert z3.memory[0].temporaries - z2.memory[0].temporaries == pytest.approx(1e9)  # one gathered bucket
    # replica 1 shares replica 0's simulation (alike devices) and reports its own device
    assert z3.memory[1].device == 1 and z3.memory[1].to_dict()["total"] == z3.memory[0].total


def test_zero_shards_the_optimizer_updates_scratch() -> None:
    # each replica updates its 1/dp shard under ZeRO 1-3, so the update's outputs and scratch are 1/dp too
    # (before: the whole stage's, 26.9 GB of Adam's sqrt and div on a llama-13b stage at dp=8, ZeRO-3)
    g = model(2, param=4e9)
    records = [{**g.node_record(v), **({"temp_bytes": 6e9, "compute_s": 1.0} if g.kind[v] == "optimizer" else {})}
               for v in range(g.num_nodes)]
    g = CompGraph.build("m", records, [g.edge_record(e) for e in range(g.num_edges)])
    stage = np.zeros(g.num_nodes, dtype=np.int64)
    runs = {zero: simulate_parallel(g, cluster(4, bw=1e9), stage, ParallelPlan(dp=4, pp=1, microbatches=1, batch=4,
                                                                                schedule="none", zero=zero))
            for zero in range(4)}
    base = runs[0].memory[0].temporaries
    assert base >= 6e9
    assert runs[1].memory[0].temporaries == pytest.approx(base - 6e9 * 3 / 4)
    assert runs[2].memory[0].temporaries == pytest.approx(base - 6e9 * 3 / 4)
    assert runs[1].step_time_s == runs[2].step_time_s  # the bytes only: the update's time was sharded already


def test_hierarchical_sync_on_two_nodes() -> None:
    from devplace.hardware.presets import PRESETS

    c = PRESETS["2x8xA100-IB"]()
    g = model(1, f=0.0, b=0.0, param=4e9)  # no compute: the step is the sync
    plan = ParallelPlan(dp=16, pp=1, microbatches=1, batch=16, schedule="none", devices=tuple(range(16)))
    r = simulate_parallel(g, c, np.zeros(g.num_nodes, dtype=np.int64), plan, bucket_bytes=1e12)
    assert r.step_time_s == pytest.approx(collective_s(c, range(16), "all-reduce", 1e9))
    assert r.step_time_s == pytest.approx(0.0130634848, rel=1e-7)


def test_recomputation_keeps_inputs_and_reruns_the_forward() -> None:
    g, c = model(4, act=100.0, meta={"microbatches": 4}), cluster(2, bw=1e3)
    st = stages_of(g, 2)
    base = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4)
    rec = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4, recompute=("full", "none"))
    r0, r1 = simulate_parallel(g, c, st, base), simulate_parallel(g, c, st, rec)
    # stage 0 reruns its two forward ops once per micro-batch: 4 x 2 x 1 s more work on device 0
    assert r1.pipelines[0].device_busy_s[0] - r0.pipelines[0].device_busy_s[0] == pytest.approx(8.0)
    assert r1.pipelines[0].device_busy_s[1] == r0.pipelines[0].device_busy_s[1]
    assert r1.memory[0].stash < r0.memory[0].stash
    assert r1.memory[1].stash == r0.memory[1].stash
    assert r1.step_time_s > r0.step_time_s


def test_recomputation_is_on_the_critical_path_of_a_uniform_chain() -> None:
    # one layer per stage, F = 1, B = 2: 1F1B takes (M + p - 1)(F + B); rerunning F before B, (M + p - 1)(2F + B)
    g, c = model(4, meta={"microbatches": 8}), cluster(4, bw=1e9)
    for recompute, expect in (("none", 11 * 3), ("full", 11 * 4)):
        plan = ParallelPlan(dp=1, pp=4, microbatches=8, batch=8, recompute=recompute)
        assert simulate_parallel(g, c, stages_of(g, 4), plan).step_time_s == pytest.approx(expect)


def test_recompute_graph_reads_other_stages_originals_and_waits_for_the_gradient() -> None:
    g = model(2)
    out = recompute_graph(g, np.array([0 if i in ("x", "f0", "b0", "o0") else 1 for i in g.ids]), (0, 1))
    assert {out.ids[u] for u in out.predecessors(out.index["f1#recompute"])} == {"f0"}  # stage 0's, as received
    assert {out.ids[u] for u in out.predecessors(out.index["f0#recompute"])} == {"x", "b1"}  # b1: the gradient


def blocks(layers: int, act: float = 100.0) -> CompGraph:
    """x -> m.layers.i/a -> m.layers.i/b -> ... (1 s each, `act` bytes out); each op's backward (2 s) reads its
    output, the backward chain in reverse."""
    nodes = [{"id": "x", "op": "input", "kind": "forward", "output_bytes": 1.0}]
    edges, prev, back = [], "x", None
    for i in range(layers):
        for j in "ab":
            nodes.append({"id": f"m.layers.{i}/{j}", "kind": "forward", "compute_s": 1.0, "output_bytes": act})
            edges.append({"src": prev, "dst": f"m.layers.{i}/{j}", "bytes": act})
            prev = f"m.layers.{i}/{j}"
    for i in reversed(range(layers)):
        for j in "ba":
            f = f"m.layers.{i}/{j}"
            nodes.append({"id": f + "#bw", "kind": "backward", "group": f, "compute_s": 2.0})
            edges += [{"src": f, "dst": f + "#bw", "bytes": act}] + ([{"src": back, "dst": f + "#bw", "bytes": 0}]
                                                                      if back else [])
            back = f + "#bw"
    return CompGraph.build("blocks", nodes, edges)


def test_full_recomputation_checkpoints_each_numbered_block() -> None:
    g = blocks(4)
    one = np.zeros(g.num_nodes, dtype=np.int64)
    assert recompute_units(g, one).tolist()[:9] == [1, 1, 1, 2, 2, 3, 3, 4, 4]  # the input with block 0
    plain, rerun = (simulate_parallel(g, cluster(1), one, ParallelPlan(1, 1, 1, 1, "none", recompute=r))
                    for r in ("none", "full"))
    assert plain.memory[0].stash == 8 * 100.0
    # kept: the input and the inputs of blocks 1-3; live: the block being run (forward) or rerun (backward)
    assert rerun.memory[0].total == 1.0 + 3 * 100.0 + 2 * 100.0
    assert rerun.step_time_s - plain.step_time_s == pytest.approx(8 * 1.0)  # every forward op once more


@pytest.mark.parametrize("pp", [1, 2])
def test_recomputing_k_blocks_spans_none_to_full_monotonically(pp: int) -> None:
    g = blocks(6)
    per_stage = 6 // pp
    stage = np.array([int(i.split(".")[2].split("/")[0]) // per_stage if "/" in i else 0 for i in g.ids])

    def run(recompute: object) -> dict:
        plan = ParallelPlan(1, pp, 2, 2, "none" if pp == 1 else "1f1b", recompute=recompute)
        return simulate_parallel(g, cluster(pp), stage, plan).to_dict()

    full, none = run("full"), run("none")
    assert run(per_stage)["memory"] == full["memory"] and run(per_stage)["step_time_s"] == full["step_time_s"]
    assert run(0) == none
    steps = [run(k)["step_time_s"] for k in range(per_stage + 1)]
    peaks = [max(m["total"] for m in run(k)["memory"]) for k in range(per_stage + 1)]
    # each block more reruns its forward (2 ops of 1 s) and keeps only its input; recomputing the last block too
    # saves nothing here (its backward reads only its outputs, which a rerun makes again at once) and keeps its
    # input: one activation more (measured: 601 -> 701 bytes at M=1), so memory is monotone up to all but one
    assert np.all(np.diff(steps) > 0) and np.all(np.diff(peaks[:-1]) < 0)
    with pytest.raises(ParallelPlanError, match=f"recomputes {per_stage + 1} blocks but holds {per_stage}"):
        run(per_stage + 1)


def test_recomputing_k_blocks_reruns_the_first_k() -> None:
    g = blocks(4)
    r = simulate_parallel(g, cluster(1), np.zeros(g.num_nodes, dtype=np.int64),
                          ParallelPlan(1, 1, 1, 1, "none", recompute=2))
    rerun = sorted(i.removesuffix(RECOMPUTE_SUFFIX) for i in r.run_graph.ids if i.endswith(RECOMPUTE_SUFFIX))
    assert rerun == ["m.layers.0/a", "m.layers.0/b", "m.layers.1/a", "m.layers.1/b"]


@pytest.mark.parametrize("layers", [2, 5])
def test_a_once_per_step_part_holds_no_recomputed_block(layers: int) -> None:
    # a coarse op that merges its optimizer update (a once-per-step part, as colocation makes of a weight's cast
    # with its update) runs that part after the device's last action; its last micro-batch's output must not be
    # held until then: with the blocks recomputed nothing reads it after its forward (before the fix every
    # block's output was held to the step's end, 2 x 100 more bytes per block)
    g = blocks(layers)
    merged = CompGraph.build("merged", [{**g.node_record(v), **({STEP_COMPUTE_KEY: 0.5} if g.kind[v] == "forward"
                                                                 and v else {})} for v in range(g.num_nodes)],
                             [g.edge_record(e) for e in range(g.num_edges)])
    plan = ParallelPlan(1, 1, 2, 2, "none", recompute="full")
    one = np.zeros(g.num_nodes, dtype=np.int64)
    plain, with_update = (simulate_parallel(x, cluster(1), one, plan) for x in (g, merged))
    assert with_update.memory[0].to_dict() == plain.memory[0].to_dict()


def split_blocks(layers: int, act: float = 100.0) -> CompGraph:
    """`blocks` with each backward split as a captured one is: B (the input gradient, on the chain) and W (the
    weight gradient, reading the op's output and the gradient flowing in, feeding the op's optimizer update)."""
    g = blocks(layers, act)
    nodes = [g.node_record(v) for v in range(g.num_nodes)]
    edges = [g.edge_record(e) for e in range(g.num_edges)]
    for v in np.flatnonzero(np.array(g.kind) == "backward").tolist():
        f = g.group[v]
        nodes += [{"id": f + "#w", "kind": "backward", "group": f, "compute_s": 1.0},
                  {"id": f + "#o", "kind": "optimizer", "group": f, "compute_s": 0.5}]
        edges += [{"src": f, "dst": f + "#w", "bytes": act}, {"src": f + "#w", "dst": f + "#o", "bytes": 0}]
        edges += [{"src": g.ids[u], "dst": f + "#w", "bytes": 0} for u in g.predecessors(v)
                  if g.kind[u] == "backward"]
    return CompGraph.build("split-blocks", nodes, edges)


def test_a_recomputing_chain_holds_one_blocks_activations_whatever_its_length() -> None:
    # autograd runs a block's weight gradients with its input gradients, before the next block's rerun; a
    # schedule that left the W ops for later would hold every block's rerun (2 x 100 more bytes per block)
    peaks = []
    for layers in (2, 3, 4, 5):
        g = split_blocks(layers)
        r = simulate_parallel(g, cluster(1), np.zeros(g.num_nodes, dtype=np.int64),
                              ParallelPlan(1, 1, 1, 1, "none", recompute="full"))
        peaks.append(r.memory[0].total)
    assert np.diff(peaks).tolist() == [100.0] * 3  # one more kept block input per block, nothing else


def test_recompute_graph_waits_only_for_gradients_that_do_not_wait_for_it() -> None:
    # a coarse backward group of stage 0 (q) feeds stage 1's backward (m), which feeds stage 0's b0: the
    # rerun of stage 0 may not wait for m, which needs q, which needs the rerun
    nodes = [{"id": "x", "op": "input", "kind": "forward"}, {"id": "f0", "kind": "forward"},
             {"id": "f1", "kind": "forward"},
             {"id": "q", "kind": "backward", "group": "f0"}, {"id": "m", "kind": "backward", "group": "f1"},
             {"id": "b0", "kind": "backward", "group": "f0"}]
    edges = [{"src": "x", "dst": "f0", "bytes": 1}, {"src": "f0", "dst": "f1", "bytes": 1},
             {"src": "f0", "dst": "q", "bytes": 1},
             {"src": "f1", "dst": "m", "bytes": 1}, {"src": "q", "dst": "m", "bytes": 1},
             {"src": "m", "dst": "b0", "bytes": 1}]
    g = CompGraph.build("c", nodes, edges)
    stage = np.array([0, 0, 1, 0, 1, 0])
    out = recompute_graph(g, stage, (0,))
    assert {out.ids[u] for u in out.predecessors(out.index["f0#recompute"])} == {"x"}  # not m
    out = recompute_graph(g, stage, (1,))
    assert {out.ids[u] for u in out.predecessors(out.index["f1#recompute"])} == {"f0", "q"}  # q: what m receives


def test_recompute_graph_rewires_the_backward_to_copies() -> None:
    g = model(2)
    out = recompute_graph(g, np.zeros(g.num_nodes, dtype=np.int64), (0,))
    copies = [i for i in out.ids if i.endswith(RECOMPUTE_SUFFIX)]
    assert copies == ["f0#recompute", "f1#recompute"]  # not the input x, a source
    b0 = out.index["b0"]
    assert {out.ids[u] for u in out.predecessors(b0)} == {"f0#recompute", "b1"}
    assert {out.ids[u] for u in out.predecessors(out.index["f1#recompute"])} == {"f0#recompute"}
    assert {out.ids[u] for u in out.predecessors(out.index["f0#recompute"])} == {"x"}
    assert out.kind[out.index["f0#recompute"]] == "backward" and out.param_bytes[g.num_nodes:].sum() == 0
    assert recompute_graph(g, np.zeros(g.num_nodes, dtype=np.int64), ()) is g


def test_recompute_graph_reruns_a_weight_cast_source() -> None:
    # under autocast a layer reads its weight's fp16 copy, made by a source op (it reads only a parameter):
    # checkpointing reruns it with the layer instead of keeping it from the forward to the backward
    g0 = model(2)
    nodes = [g0.node_record(v) for v in range(g0.num_nodes)]
    nodes.append({"id": "w1", "op": "aten._to_copy.default", "kind": "forward", "compute_s": 0.5, "output_bytes": 50})
    edges = [g0.edge_record(e) for e in range(g0.num_edges)]
    edges += [{"src": "w1", "dst": "f1", "bytes": 50}, {"src": "w1", "dst": "b1", "bytes": 50}]
    g = CompGraph.build("m", nodes, edges)
    out = recompute_graph(g, np.zeros(g.num_nodes, dtype=np.int64), (0,))
    assert sorted(i for i in out.ids if i.endswith(RECOMPUTE_SUFFIX)) == ["f0#recompute", "f1#recompute",
                                                                          "w1#recompute"]
    assert {out.ids[u] for u in out.predecessors(out.index["b1"])} == {"f1#recompute", "w1#recompute"}
    assert {out.ids[u] for u in out.predecessors(out.index["f1#recompute"])} == {"f0#recompute", "w1#recompute"}
    assert out.compute_s[out.index["w1#recompute"]] == 0.5
    # with no gradient to wait for (one stage), the cast's rerun waits for the forward's end, not for nothing
    assert {out.ids[u] for u in out.predecessors(out.index["w1#recompute"])} == {"f1"}


def test_param_shares_from_capture_metadata() -> None:
    def shares(**cap: object) -> ParamShares:
        return param_shares(model(1, meta={"capture": cap}))
    assert shares(param_bytes=16, optimizer="adam") == ParamShares(0.25, 0.25, 0.5)
    assert shares(param_bytes=16, optimizer="sgd") == ParamShares(0.5, 0.5, 0.0)
    # bf16 weights and grads (2 + 2 bytes), fp32 master (4) and two fp32 Adam states (8): 16 bytes per element
    assert shares(param_bytes=16, optimizer="adam", master_weight_bytes=4) == ParamShares(2 / 16, 2 / 16, 12 / 16)
    assert shares(param_bytes=12, optimizer="adam", buffer_bytes=4) == ParamShares(7 / 16, 3 / 16, 6 / 16)
    assert shares(optimizer="lion") == ParamShares(0.25, 0.25, 0.5)


def test_bad_inputs_say_what_is_wrong() -> None:
    g, c = model(2), cluster(2)
    plan = ParallelPlan(dp=1, pp=2, microbatches=2, batch=2)
    with pytest.raises(ParallelPlanError, match="one integer stage per op"):
        simulate_parallel(g, c, np.zeros(3, dtype=np.int64), plan)
    with pytest.raises(ParallelPlanError, match=r"stage must be 0\.\.1"):
        simulate_parallel(g, c, np.full(g.num_nodes, 2), plan)
    with pytest.raises(ParallelPlanError, match=r"forward op 'f0' \(stage 1\) feeds 'f1' \(stage 0\)"):
        simulate_parallel(g, c, 1 - stages_of(g, 2), plan)
    with pytest.raises(ParallelPlanError, match="has 2 devices"):
        simulate_parallel(g, c, stages_of(g, 2), ParallelPlan(dp=2, pp=2, microbatches=1, batch=2))
    mb = model(2, meta={"microbatches": 4})
    with pytest.raises(ParallelPlanError, match="one of 4 micro-batches"):
        simulate_parallel(mb, c, stages_of(mb, 2), plan)
    captured = model(2, meta={"capture": {"batch": 8}})
    with pytest.raises(ParallelPlanError, match="runs batch 2 / dp 1 = 2"):
        simulate_parallel(captured, c, stages_of(captured, 2), plan)


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_one_replica_without_sharding_is_the_pipeline_simulation(case: tuple) -> None:
    # dp = 1, ZeRO-0, no recomputation: the same step and, by category, the same peaks as simulate_schedule
    nodes, edges, p, placement, kind, m, _, bw, lat, micro = case
    if kind == "interleaved-1f1b":
        return  # its stages are not the devices; the V-chunk mapping is tested in test_zero_bubble.py
    g = CompGraph.build("p", nodes, edges, {"microbatches": m} if micro else None)
    devices = np.array([placement[i] for i in g.ids], dtype=np.int64)
    c = cluster(p, bw=bw, lat=lat)
    plan = ParallelPlan(dp=1, pp=p, microbatches=m, batch=m, schedule=kind if p > 1 else "none")
    try:
        ref = simulate_schedule(g, c, devices, plan.pipeline_schedule(microbatch_graph=micro))
    except ScheduleError:
        with pytest.raises((ScheduleError, ParallelPlanError)):
            simulate_parallel(g, c, devices, plan)
        return
    r = simulate_parallel(g, c, devices, plan)
    assert r.step_time_s == ref.step_time_s
    assert [m.total for m in r.memory] == pytest.approx(ref.peak_memory_bytes.tolist())


def test_a_tied_parameters_copy_counts_in_its_stages_persistent_memory() -> None:
    """The head's stage holds its own copy of the embedding tied with it (`tied_copies`): weights, gradient and
    optimizer state by category, as stage 0 does; the stage between holds none of it."""
    from test_sim_schedule import tied_lm

    g, stage = tied_lm(3, grad=100.0, params=400.0)
    r = simulate_parallel(g, cluster(3, bw=1e9, mem=1e9), stage, ParallelPlan(dp=1, pp=3, microbatches=4, batch=4))
    assert [(m.parameters, m.gradients, m.optimizer_state) for m in r.memory] == \
        [(100.0, 100.0, 200.0), (0.0, 0.0, 0.0), (100.0, 100.0, 200.0)]
    assert [m.total for m in r.memory] == pytest.approx(r.pipelines[0].peak_memory_bytes.tolist())


@pytest.mark.parametrize("layers, stages", [(4, (0,)), (4, (1, 2)), (6, (0, 1, 2)), (6, (2,))])
def test_recompute_graph_rewires_every_edge_in_order_as_edge_by_edge(layers, stages) -> None:
    """The graph's edges come first, in edge order, each rewired to the copy where a copied op's backward reader
    reads it, and each edge into a copied op followed by the same edge into its copy: as built edge by edge."""
    g = blocks(layers)
    stage = np.array([min(int(i.split(".")[2].split("/")[0]) * 3 // layers, 2) if ".layers." in i else 0
                      for i in g.ids])
    out = recompute_graph(g, stage, stages)
    phase = op_phases(g)
    copy = {v: out.index[g.ids[v] + "#recompute"] for v in range(g.num_nodes) if g.ids[v] + "#recompute" in out.index}
    want = []
    for e in range(g.num_edges):
        u, w = int(g.edge_src[e]), int(g.edge_dst[e])
        to_copy = u in copy and phase[w] == BACKWARD and stage[w] == stage[u]
        want.append((copy[u] if to_copy else u, w, e))
        if w in copy:
            want.append((copy[u] if u in copy and stage[u] == stage[w] else u, copy[w], e))
    assert copy  # the case copies ops
    got = list(zip(out.edge_src.tolist(), out.edge_dst.tolist(), strict=True))[:len(want)]
    assert got == [(a, b) for a, b, _ in want]
    assert out.edge_bytes[:len(want)].tolist() == [float(g.edge_bytes[e]) for _, _, e in want]
    assert out.edge_tensor[:len(want)].tolist() == [int(g.edge_tensor[e]) for _, _, e in want]

"""Pipeline schedules in the simulator (docs/simulation.md, "Pipeline schedules"): the bubble formula on a
uniform chain, memory in flight per schedule, Schedule's checks, and the code against the plain-Python
reference in reference_pipeline.py on random pipelines."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import devplace
from conftest import cluster
from devplace.graph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.sim import Schedule, ScheduledResult, ScheduleError, any_schedule_bound, lower_bound, simulate
from devplace.sim.schedule import actions
from reference_pipeline import RefScheduleError, reference_schedule


def chain(stages: int, f: float, b: float, act: float = 10.0) -> CompGraph:
    """f0 -> ... -> f{s-1} -> b{s-1} -> ... -> b0, each b tied to its f, f's output consumed by its b."""
    nodes = [{"id": f"f{s}", "compute_s": f, "kind": "forward", "output_bytes": act} for s in range(stages)]
    nodes += [{"id": f"b{s}", "compute_s": b, "kind": "backward", "group": f"f{s}"} for s in range(stages)]
    edges = [{"src": f"f{s}", "dst": f"f{s + 1}", "bytes": 0} for s in range(stages - 1)]
    edges += [{"src": f"f{s}", "dst": f"b{s}", "bytes": 0} for s in range(stages)]
    edges += [{"src": f"b{s + 1}", "dst": f"b{s}", "bytes": 0} for s in range(stages - 1)]
    return CompGraph.build("chain", nodes, edges)


def on_stages(stages: int, p: int) -> np.ndarray:
    """f_s and b_s on device s mod p."""
    return np.array([s % p for s in range(stages)] * 2)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_uniform_chain_has_the_bubble_formula(kind, p, m):
    f, b = 1.0, 2.0
    r = simulate(chain(p, f, b), cluster(p, bw=1e9), on_stages(p, p), schedule=Schedule(kind, m, microbatch_graph=True))
    ideal = m * (f + b)  # one device's work
    assert r.step_time_s == pytest.approx((m + p - 1) * (f + b))
    assert (r.step_time_s - ideal) / r.step_time_s == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 2), (3, 2, 6)])
def test_interleaved_chain_divides_the_bubble_by_the_chunks(p, v, m):
    f, b = 1.0, 2.0  # per device and micro-batch, split over v chunks
    g = chain(p * v, f / v, b / v)
    r = simulate(g, cluster(p, bw=1e9), on_stages(p * v, p),
                 schedule=Schedule("interleaved-1f1b", m, chunks=v, microbatch_graph=True))
    assert r.step_time_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


def test_activations_in_flight_gpipe_all_1f1b_the_depth():
    p, m, act = 4, 8, 10.0
    g, c, devs = chain(p, 1.0, 2.0, act), cluster(p, bw=1e9), on_stages(p, p)
    gpipe = simulate(g, c, devs, schedule=Schedule("gpipe", m, microbatch_graph=True))
    ofb = simulate(g, c, devs, schedule=Schedule("1f1b", m, microbatch_graph=True))
    assert gpipe.peak_memory_bytes.tolist() == [m * act] * p
    assert ofb.peak_memory_bytes.tolist() == [(p - r) * act for r in range(p)]


def test_scaling_by_the_microbatches_divides_compute_and_bytes():
    g, c, devs = chain(2, 4.0, 8.0, act=40.0), cluster(2, bw=1e9), on_stages(2, 2)
    scaled = simulate(g, c, devs, schedule=Schedule("gpipe", 4))
    exact = simulate(chain(2, 1.0, 2.0, act=10.0), c, devs, schedule=Schedule("gpipe", 4, microbatch_graph=True))
    assert scaled.step_time_s == pytest.approx(exact.step_time_s)
    assert scaled.peak_memory_bytes.tolist() == pytest.approx(exact.peak_memory_bytes.tolist())


def test_transfers_between_stages_once_per_microbatch_and_optimizer_once_per_step():
    nodes = [{"id": "f0", "compute_s": 1.0}, {"id": "f1", "compute_s": 1.0},
             {"id": "b1", "compute_s": 1.0, "kind": "backward", "group": "f1"},
             {"id": "b0", "compute_s": 1.0, "kind": "backward", "group": "f0"},
             {"id": "opt0", "compute_s": 1.0, "kind": "optimizer", "group": "f0", "param_bytes": 7}]
    edges = [{"src": "f0", "dst": "f1", "bytes": 8}, {"src": "f1", "dst": "b1", "bytes": 8},
             {"src": "b1", "dst": "b0", "bytes": 8}, {"src": "b0", "dst": "opt0", "bytes": 4}]
    g = CompGraph.build("t", nodes, edges)
    m = 3
    r = simulate(g, cluster(2, bw=8.0), np.array([0, 1, 1, 0, 0]), schedule=Schedule("1f1b", m))
    assert isinstance(r, ScheduledResult)
    assert len(r.transfers) == 2 * m  # f0 -> f1 and b1 -> b0, each micro-batch
    assert sorted(r.transfer_microbatch.tolist()) == sorted(list(range(m)) * 2)
    assert r.comm_bytes == pytest.approx(2 * m * 8 / m)
    opt = g.index["opt0"]
    assert r.device_busy_s.tolist() == pytest.approx([2.0 + 1.0, 2.0])  # forward+backward scaled, optimizer once
    assert r.start_s[opt] >= r.finish_s[g.index["b0"]]  # after the flush
    assert r.stage.tolist() == [0, 1, 1, 0, -1]
    doc = r.to_dict()
    assert doc["schedule"] == {"kind": "1f1b", "microbatches": 3, "chunks": 1, "microbatch_graph": False}
    assert doc["num_stages"] == 2 and doc["step_time_s"] == r.step_time_s
    assert devplace.simulate(g, cluster(2, bw=8.0), [0, 1, 1, 0, 0], schedule=Schedule("1f1b", m)).step_time_s == \
        r.step_time_s


def test_a_value_read_two_stages_on_is_passed_on_by_the_stage_between():
    """Issue 30: torch's pipelining sends only to the next stage, so a value stage 0 makes and stage 2 reads (Llama's
    rotary tables, BART's encoder output) goes 0 -> 1 -> 2, and its gradient 2 -> 1 -> 0, as the runtime relays
    them: two hops each way on the links, never the 0 -> 2 link, and only once however many ops read it."""
    nodes = [{"id": f"f{s}", "compute_s": 1.0, "kind": "forward"} for s in range(3)]
    nodes += [{"id": "g2", "compute_s": 1.0, "kind": "forward"}]  # a second reader of f0's value on stage 2
    nodes += [{"id": f"b{s}", "compute_s": 1.0, "kind": "backward", "group": f"f{s}"} for s in (2, 1, 0)]
    edges = [{"src": "f0", "dst": "f1", "bytes": 8}, {"src": "f1", "dst": "f2", "bytes": 8},
             {"src": "f0", "dst": "f2", "bytes": 80, "tensor": 1}, {"src": "f0", "dst": "g2", "bytes": 80, "tensor": 1},
             {"src": "f2", "dst": "g2", "bytes": 0, "tensor": 5}, {"src": "g2", "dst": "b2", "bytes": 0, "tensor": 5},
             {"src": "b2", "dst": "b1", "bytes": 8}, {"src": "b1", "dst": "b0", "bytes": 8},
             {"src": "b2", "dst": "b0", "bytes": 80, "tensor": 1}]
    g = CompGraph.build("skip", nodes, edges)
    devs = np.array([0, 1, 2, 2, 2, 1, 0])
    r = simulate(g, cluster(3, bw=8.0), devs, schedule=Schedule("gpipe", 1, microbatch_graph=True))
    hops = sorted((g.ids[int(n)], int(a), int(b), float(x)) for n, a, b, x in
                  zip(r.transfers.node, r.transfers.src_dev, r.transfers.dst_dev, r.transfers.nbytes, strict=True))
    assert hops == [("b1", 1, 0, 8.0), ("b2", 1, 0, 80.0), ("b2", 2, 1, 8.0), ("b2", 2, 1, 80.0),
                    ("f0", 0, 1, 8.0), ("f0", 0, 1, 80.0), ("f0", 1, 2, 80.0), ("f1", 1, 2, 8.0)]
    assert r.comm_bytes == pytest.approx(4 * 8 + 4 * 80)
    # f0 ends at 1; on link 0 -> 1 its 8 bytes go first (1 s), then the 80 (10 s); the relay sends them on at 12
    # (10 s more), then f2 (1 s) and g2, which both read them
    assert r.start_s[g.index["g2"]] == pytest.approx(1.0 + 1.0 + 10.0 + 10.0 + 1.0)


def test_one_f_one_b_action_order():
    assert actions(Schedule("1f1b", 4), 3, 0) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0), (0, 0, 3), (1, 0, 1),
                                                    (1, 0, 2), (1, 0, 3)]
    assert actions(Schedule("1f1b", 4), 3, 2) == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 0, 2), (1, 0, 2),
                                                    (0, 0, 3), (1, 0, 3)]


def test_schedule_none_is_the_step_model():
    g, c, devs = chain(3, 1.0, 2.0), cluster(3, bw=1e9), on_stages(3, 3)
    a, b = simulate(g, c, devs), simulate(g, c, devs, schedule=None)
    assert not isinstance(b, ScheduledResult) and a.step_time_s == b.step_time_s


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "zigzag"}, "unknown schedule kind 'zigzag'; choose one of: gpipe, 1f1b"),
    ({"microbatches": 0}, "microbatches must be an integer >= 1, got 0"),
    ({"microbatches": 2.5}, "microbatches must be an integer >= 1"),
    ({"kind": "1f1b", "chunks": 2}, "use kind='interleaved-1f1b'"),
    ({"kind": "interleaved-1f1b", "chunks": 1}, "needs chunks >= 2"),
    ({"microbatch_graph": "yes"}, "microbatch_graph must be True or False"),
])
def test_schedule_checks_its_arguments(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Schedule(**kwargs)
    assert Schedule("interleaved-1f1b").chunks == 2 and Schedule("gpipe").chunks == 1


def test_an_input_tied_to_the_loss_leaves_the_loss_gradient_in_the_last_stage():
    base = chain(4, 1.0, 2.0)
    nodes = [{"id": "labels", "op": "input", "kind": "forward"}] + [base.node_record(v) for v in range(8)]
    edges = [{"src": "labels", "dst": "f3", "bytes": 0}] + [base.edge_record(e) for e in range(base.num_edges)]
    g = CompGraph.build("labelled", nodes, edges)
    r = simulate(g, cluster(2, bw=1e9), np.array([1] + [0, 1, 0, 1] * 2),
                 schedule=Schedule("interleaved-1f1b", 2, microbatch_graph=True))
    assert r.stage[g.index["b3"]] == r.stage[g.index["f3"]] == 3
    assert r.step_time_s == pytest.approx(2 * 6.0 + (2 - 1) * 3.0)


def test_a_forward_kind_op_that_reads_a_gradient_runs_in_the_backward_pass():
    # a captured mobilenet_v3_large has forward-kind clones fed by backward ops; as forward ops they made every
    # pipeline deadlock (the forward action waited for its own backward one)
    base = chain(2, 1.0, 2.0)
    nodes = [base.node_record(v) for v in range(base.num_nodes)] + [
        {"id": "c1", "compute_s": 0.5, "kind": "forward", "group": "f1"}]
    edges = [base.edge_record(e) for e in range(base.num_edges)] + [
        {"src": "b1", "dst": "c1", "bytes": 4.0, "tensor": 1}, {"src": "c1", "dst": "b0", "bytes": 4.0}]
    g, c = CompGraph.build("clone", nodes, edges), cluster(2, bw=1e12)
    devs = np.array([0, 1, 0, 1, 1])
    r = simulate(g, c, devs, schedule=Schedule("1f1b", 4))
    ref, _, _ = reference_schedule(nodes, edges, [1.0, 1.0], {(0, 1): (1e12, 0.0), (1, 0): (1e12, 0.0)},
                                   dict(zip(g.ids, devs.tolist(), strict=True)), "1f1b", 4, 1)
    assert r.step_time_s == ref.step_time_s
    assert r.stage[g.index["c1"]] == r.stage[g.index["b1"]]  # runs with the stage's backward actions


def test_placements_that_are_not_pipelines_are_rejected():
    g, c = chain(2, 1.0, 1.0), cluster(2, bw=1e9)
    with pytest.raises(ScheduleError, match="along its device order only"):
        simulate(g, c, np.array([1, 0, 1, 0]), schedule=Schedule("1f1b", 2))
    with pytest.raises(ScheduleError, match="multiple of the pipeline's 2 devices"):
        simulate(chain(4, 1.0, 1.0), c, on_stages(4, 2), schedule=Schedule("interleaved-1f1b", 3))
    with pytest.raises(ScheduleError, match="with the devplace model only"):
        simulate(g, c, on_stages(2, 2), model="placeto", schedule=Schedule())


def test_a_device_order_lets_any_device_run_any_stage():
    g, c = chain(3, 1.0, 2.0), cluster(3, bw=1e9)
    forward = simulate(g, c, on_stages(3, 3), schedule=Schedule("1f1b", 4))
    backwards = [2 - d for d in on_stages(3, 3).tolist()]  # stage 0 on device 2, stage 2 on device 0
    s = Schedule("1f1b", 4, device_order=(2, 1, 0))
    r = simulate(g, c, np.array(backwards), schedule=s)
    assert r.step_time_s == forward.step_time_s and r.feasible  # identical devices: only the labels move
    assert Schedule.from_dict(s.to_dict()) == s and s.to_dict()["device_order"] == [2, 1, 0]
    assert "device_order" not in Schedule("1f1b", 4).to_dict()
    with pytest.raises(ScheduleError, match="distinct device indices"):
        Schedule("1f1b", 4, device_order=(0, 0))


# ----------------------------------------------------------------------------- random pipelines


@st.composite
def pipelines(draw):
    n = draw(st.integers(1, 6))
    p = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    v = draw(st.integers(2, 3)) if kind == "interleaved-1f1b" else 1
    m = draw(st.integers(1, 4))
    nums = st.sampled_from([0, 0.5, 1, 2])
    nodes, edges = [], []
    for i in range(n):
        nodes.append({"id": f"f{i}", "kind": "forward", "compute_s": draw(nums),
                      "output_bytes": draw(st.sampled_from([0, 4, 8])), "temp_bytes": draw(st.sampled_from([0, 2])),
                      "param_bytes": draw(st.sampled_from([0, 5]))})
    fwd = sorted({tuple(sorted(draw(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)))))
                  for _ in range(draw(st.integers(0, 2 * n)))})
    fwd = [(i, j) for i, j in fwd if i != j]
    for i in reversed(range(n)):
        nodes.append({"id": f"b{i}", "kind": "backward", "group": f"f{i}", "compute_s": draw(nums),
                      "output_bytes": draw(st.sampled_from([0, 4]))})
        if draw(st.booleans()):  # it makes a parameter gradient: added into .grad on later micro-batches
            nodes[-1].update(accumulate_s=draw(nums), accumulate_bytes=draw(st.sampled_from([0, 3])))
    sizes = {i: draw(st.sampled_from([0, 4, 10])) for i in range(n)}
    if draw(st.booleans()):  # a backward op tied to no forward op (the loss gradient, say)
        nodes.append({"id": "seed", "kind": "backward", "compute_s": 0.5})
        edges.append({"src": f"f{n - 1}", "dst": "seed", "bytes": sizes[n - 1]})
        edges.append({"src": "seed", "dst": f"b{n - 1}", "bytes": 2})
    for i in range(n):
        if draw(st.booleans()):
            nodes.append({"id": f"o{i}", "kind": "optimizer", "group": f"f{i}", "compute_s": 1.0, "param_bytes": 3})
            edges.append({"src": f"b{i}", "dst": f"o{i}", "bytes": 5, "tensor": 1})
    if n >= 2 and draw(st.booleans()):  # a weight tied between f0 and f{n-1}: its gradient summed, then updated
        g = draw(st.sampled_from([0, 6]))
        nodes += [{"id": "tsum", "kind": "backward", "group": "f0", "compute_s": draw(nums),
                   "accumulate_s": draw(nums), "accumulate_bytes": g},
                  {"id": "topt", "kind": "optimizer", "group": "f0", "compute_s": 1.0, "param_bytes": 7}]
        edges += [{"src": "b0", "dst": "tsum", "bytes": g, "tensor": 2},
                  {"src": f"b{n - 1}", "dst": "tsum", "bytes": g, "tensor": 2},
                  {"src": "tsum", "dst": "topt", "bytes": g}]
    for i, j in fwd:
        edges.append({"src": f"f{i}", "dst": f"f{j}", "bytes": sizes[i]})
        edges.append({"src": f"b{j}", "dst": f"b{i}", "bytes": 3})
    for i in range(n):
        edges.append({"src": f"f{i}", "dst": f"b{i}", "bytes": sizes[i]})
    stage = sorted(draw(st.integers(0, p * v - 1)) for _ in range(n))  # non-decreasing along f0..f{n-1}
    placement = {f"f{i}": stage[i] % p for i in range(n)}
    if draw(st.booleans()):  # an input tied to the last layer (its first consumer), as labels to the loss
        nodes.insert(0, {"id": "labels", "op": "input", "kind": "forward", "output_bytes": 1})
        edges.insert(0, {"src": "labels", "dst": f"f{n - 1}", "bytes": 1})
        placement["labels"] = placement[f"f{n - 1}"]
    for node in nodes:
        if node["id"] not in placement:
            tied = node.get("group")
            placement[node["id"]] = placement[tied] if tied else draw(st.integers(0, p - 1))
    if draw(st.integers(0, 4)) == 0:  # now and then a backward op off its forward op's device
        i = draw(st.integers(0, n - 1))
        placement[f"b{i}"] = draw(st.integers(0, p - 1))
    bw = draw(st.sampled_from([4.0, 10.0]))
    lat = draw(st.sampled_from([0.0, 0.25]))
    return nodes, edges, p, placement, kind, m, v, bw, lat, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(pipelines(), st.sampled_from([0.0, 0.125]))
def test_schedule_simulation_matches_plain_python_reference(case, action_s):
    nodes, edges, p, placement, kind, m, v, bw, lat, micro = case
    g = CompGraph.build("t", nodes, edges)
    c = cluster(p, bw=bw, lat=lat)
    # the pipelining runtime's cost per action (Device.action_s), charged by the barrier after each action
    c = Cluster(c.name, tuple(dataclasses.replace(d, action_s=action_s) for d in c.devices), c.link, c.links)
    devs = np.array([placement[nid] for nid in g.ids])
    link = {(a, b): (bw, lat) for a in range(p) for b in range(p) if a != b}
    try:
        ref, _, stage = reference_schedule(nodes, edges, [1.0] * p, link, placement, kind, m, v, micro,
                                           action_s=[action_s] * p)
    except RefScheduleError:
        with pytest.raises(ScheduleError):
            simulate(g, c, devs, schedule=Schedule(kind, m, chunks=v, microbatch_graph=micro))
        return
    r = simulate(g, c, devs, schedule=Schedule(kind, m, chunks=v, microbatch_graph=micro))
    assert r.step_time_s == ref.step_time_s
    # byte sums of scaled sizes: equal up to the order of float additions
    assert r.peak_memory_bytes.tolist() == pytest.approx(ref.peak, rel=1e-12)
    assert r.comm_bytes == pytest.approx(ref.comm_bytes, rel=1e-12)
    assert r.stage.tolist() == [stage.get(nid, -1) for nid in g.ids]
    for nid in g.ids:
        runs = [f"{nid}|{k}" for k in range(m)] if f"{nid}|0" in ref.start else [f"{nid}|step"] * m
        v_ = g.index[nid]
        assert r.microbatch_start_s[:, v_].tolist() == [ref.start[x] for x in runs]
        assert r.microbatch_finish_s[:, v_].tolist() == [ref.finish[x] for x in runs]


# a tied gradient's sum (tsum reads b0 on device 0 and b5 on device 1) runs once per step under tied copies,
# where the bound counted it once per micro-batch: 18.0 s simulated against a bound of 18.5 s
def _op(nid: str, kind: str, compute: float, group: str | None = None, params: int = 0) -> dict:
    return {"id": nid, "kind": kind, "compute_s": compute, "output_bytes": 0, "temp_bytes": 0, "param_bytes": params,
            **({"group": group} if group else {})}


_TIED_SUM_CASE = (
    [_op(f"f{k}", "forward", int(k == 5)) for k in range(6)]
    + [_op(f"b{k}", "backward", c, f"f{k}") for k, c in ((5, 1), (4, 2), (3, 0), (2, 0), (1, 2), (0, 2))]
    + [_op("tsum", "backward", 1, "f0"), _op("topt", "optimizer", 1.0, "f0", 7)],
    [{"src": "b0", "dst": "tsum", "bytes": 0, "tensor": 2}, {"src": "b5", "dst": "tsum", "bytes": 0, "tensor": 2},
     {"src": "tsum", "dst": "topt", "bytes": 0}] + [{"src": f"f{k}", "dst": f"b{k}", "bytes": 0} for k in range(6)],
    2, {**{f"f{k}": int(k >= 4) for k in range(6)}, **{f"b{k}": int(k >= 4) for k in range(6)}, "tsum": 0, "topt": 0},
    "gpipe", 4, 1, 4.0, 0.0, True)


@settings(max_examples=100, deadline=None)
@given(pipelines())
@example(_TIED_SUM_CASE)
def test_no_pipelined_step_beats_the_lower_bound_under_its_schedule(case):
    nodes, edges, p, placement, kind, m, v, bw, lat, micro = case
    g = CompGraph.build("t", nodes, edges)
    c = cluster(p, bw=bw, lat=lat)
    s = Schedule(kind, m, chunks=v, microbatch_graph=micro)
    try:
        r = simulate(g, c, np.array([placement[nid] for nid in g.ids]), schedule=s)
    except ScheduleError:
        return
    bound = lower_bound(g, c, schedule=s).value_s
    assert r.step_time_s >= bound * (1 - 1e-12)
    if not micro:  # the bound `devplace bound` leads with holds for every schedule of the whole batch's step
        assert any_schedule_bound(g, c).value_s <= bound * (1 + 1e-12)


def test_lower_bound_under_a_schedule_counts_one_microbatch_on_the_path():
    p, m, f, b = 4, 8, 1.0, 2.0
    g, c = chain(p, f * m, b * m), cluster(p, bw=1e9)
    whole = lower_bound(g, c)
    piped = lower_bound(g, c, schedule=Schedule("1f1b", m))
    assert whole.critical_path_s == pytest.approx(p * m * (f + b))  # the whole batch through every stage
    assert piped.critical_path_s == pytest.approx(p * (f + b))  # one micro-batch through every stage
    assert piped.work_s == pytest.approx(whole.work_s)
    exact = lower_bound(chain(p, f, b), c, schedule=Schedule("1f1b", m, microbatch_graph=True))
    assert (exact.work_s, exact.critical_path_s) == pytest.approx((piped.work_s, piped.critical_path_s))
    r = simulate(g, c, on_stages(p, p), schedule=Schedule("1f1b", m))
    assert r.step_time_s >= piped.value_s  # and the whole-batch path would claim more than the step takes
    assert r.step_time_s < whole.critical_path_s


def tied_lm(p: int, grad: float = 1000.0, params: float = 4000.0) -> tuple[CompGraph, np.ndarray]:
    """A tiny language model on p stages, its embedding `emb` (stage 0) tied with its head `head` (stage p-1),
    as captured: the tied weight's gradient is `sum`, adding the embedding's (`bemb`) and the head's (`bhw`), in
    the embedding's tie class, read only by the update `opt`, which holds the parameter (weights, gradient,
    Adam's states: `params` bytes). Layers l1..l{p-2} in between; activations 10 bytes, the gradient `grad`."""
    mid = [f"l{s}" for s in range(1, p - 1)]
    fwd = ["emb", *mid, "head"]
    nodes = [{"id": f, "compute_s": 1.0, "kind": "forward", "output_bytes": 10} for f in fwd]
    nodes += [{"id": f"b{f}", "compute_s": 1.0, "kind": "backward", "group": f, "output_bytes": 10}
              for f in reversed(fwd)]
    nodes += [{"id": "bhw", "compute_s": 1.0, "kind": "backward", "group": "head", "output_bytes": grad},
              {"id": "sum", "compute_s": 0.5, "kind": "backward", "group": "emb"},
              {"id": "opt", "compute_s": 2.0, "kind": "optimizer", "group": "emb", "param_bytes": params}]
    edges = [{"src": a, "dst": b, "bytes": 10} for a, b in pairwise(fwd)]
    edges += [{"src": "head", "dst": "bhead", "bytes": 10}]
    edges += [{"src": f"b{b}", "dst": f"b{a}", "bytes": 10} for a, b in pairwise(fwd)]
    edges += [{"src": "bhead", "dst": "bhw", "bytes": 10}, {"src": fwd[-2], "dst": "bhw", "bytes": 10, "tensor": 0},
              {"src": "bemb", "dst": "sum", "bytes": grad, "tensor": 1}, {"src": "bhw", "dst": "sum", "bytes": grad},
              {"src": "sum", "dst": "opt", "bytes": grad}]
    g = CompGraph.build("tied", nodes, edges)
    stage = {"emb": 0, "head": p - 1, **{f"l{s}": s for s in range(1, p - 1)}}
    devs = np.array([stage[nid.removeprefix("b")] if nid.removeprefix("b") in stage else
                     {"bhw": p - 1, "sum": 0, "opt": 0}[nid] for nid in g.ids])
    return g, devs


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_tied_parameter_has_a_copy_per_stage_that_uses_it_summed_once_per_step(p, kind):
    """As the runtime runs it (pipeline_run: a copy per stage, gradients summed once per step over gloo): the
    head's gradient of the tied embedding is accumulated on the head's stage and exchanged with stage 0 once per
    step (one transfer each way, full size), never per micro-batch nor relayed through the stages between,
    which hold nothing of it; the head's stage holds its own copy (weights, gradient, optimizer state) and
    updates it."""
    m, grad, params = 4, 1000.0, 4000.0
    g, devs = tied_lm(p, grad, params)
    r = simulate(g, cluster(p, bw=1e9, mem=1e9), devs, schedule=Schedule(kind, m, microbatch_graph=True))
    sums = [(g.ids[int(x)], int(a), int(b), float(nb), int(k)) for x, a, b, nb, k in
            zip(r.transfers.node, r.transfers.src_dev, r.transfers.dst_dev, r.transfers.nbytes,
                r.transfer_microbatch, strict=True) if nb == grad]
    # each sent once, with the last micro-batch (the accumulated gradient)
    assert sorted(sums) == [("bemb", 0, p - 1, grad, m - 1), ("bhw", p - 1, 0, grad, m - 1)]
    assert r.stage[g.index["sum"]] == -1 and r.stage[g.index["bhw"]] == p - 1
    for d in range(1, p - 1):  # a middle stage: its activations only
        assert r.peak_memory_bytes[d] < 100
    assert r.peak_memory_bytes[0] >= params and r.peak_memory_bytes[p - 1] >= params + grad
    # the update runs once on each copy, after the exchange
    assert r.device_busy_s[p - 1] == pytest.approx(m * 3.0 + 0.5 + 2.0)
    assert r.start_s[g.index["sum"]] >= r.microbatch_finish_s[:, g.index["bhw"]].max() + grad / 1e9

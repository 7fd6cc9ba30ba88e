"""Zero-bubble schedules (arXiv 2401.10241) compiled into pipeline actions: B/W classes of backward ops, the
action orders torch runs, and the step on a uniform chain against the paper's bubble."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import cluster
from devplace.graph import CompGraph
from devplace.graph.parallel import ParallelPlan
from devplace.sim.parallel import simulate_parallel, stage_layout
from devplace.sim.schedule import (
    BACKWARD,
    FORWARD,
    FULL,
    WEIGHT,
    Schedule,
    ScheduleError,
    actions,
    simulate_schedule,
    weight_grad_ops,
)


def zchain(layers: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, microbatches: int | None = None) -> CompGraph:
    """f_l -> f_{l+1}; g_l (input gradient, B) reads f_l and g_{l+1}; w_l (weight gradient, W) reads f_l and
    g_{l+1} and feeds the update o_l."""
    nodes = [{"id": f"f{i}", "compute_s": f, "kind": "forward", "output_bytes": 1} for i in range(layers)]
    nodes += [{"id": f"g{i}", "compute_s": b, "kind": "backward", "group": f"f{i}"} for i in range(layers)]
    nodes += [{"id": f"w{i}", "compute_s": w, "kind": "backward", "group": f"f{i}"} for i in range(layers)]
    nodes += [{"id": f"o{i}", "kind": "optimizer", "group": f"f{i}"} for i in range(layers)]
    edges = [{"src": f"f{i}", "dst": f"f{i + 1}", "bytes": 0} for i in range(layers - 1)]
    edges += [{"src": f"f{i}", "dst": f"{x}{i}", "bytes": 0} for i in range(layers) for x in "gw"]
    edges += [{"src": f"g{i + 1}", "dst": f"{x}{i}", "bytes": 0} for i in range(layers - 1) for x in "gw"]
    edges += [{"src": f"w{i}", "dst": f"o{i}", "bytes": 0} for i in range(layers)]
    return CompGraph.build("z", nodes, edges, {"microbatches": microbatches} if microbatches else None)


def layer(g: CompGraph) -> np.ndarray:
    return np.array([int(i[1:]) for i in g.ids], dtype=np.int64)


def test_backward_ops_are_b_or_w_by_what_they_produce() -> None:
    g = zchain(3)
    assert [g.ids[v] for v in np.flatnonzero(weight_grad_ops(g))] == ["w0", "w1", "w2"]
    # an op whose only successor is a W op is W too; one that also feeds an input gradient is B
    extra = CompGraph.build("e", [{"id": "f", "kind": "forward"}, {"id": "t", "kind": "backward"},
                                  {"id": "mm", "kind": "backward"}, {"id": "gi", "kind": "backward"},
                                  {"id": "o", "kind": "optimizer"}],
                            [{"src": "f", "dst": "t", "bytes": 0}, {"src": "t", "dst": "mm", "bytes": 0},
                             {"src": "t", "dst": "gi", "bytes": 0}, {"src": "mm", "dst": "o", "bytes": 0}])
    assert weight_grad_ops(extra).tolist() == [False, False, True, False, False]
    # the first layer computes no input gradient, so every gradient ends in an update; what flows into the
    # first layer's backward from the second's is still B
    two = CompGraph.build("two", [{"id": "l0", "kind": "forward"}, {"id": "l1", "kind": "forward"},
                                  {"id": "gx1", "kind": "backward", "group": "l1"},
                                  {"id": "gw1", "kind": "backward", "group": "l1"},
                                  {"id": "gw0", "kind": "backward", "group": "l0"},
                                  {"id": "o0", "kind": "optimizer", "group": "l0"},
                                  {"id": "o1", "kind": "optimizer", "group": "l1"}],
                          [{"src": "l0", "dst": "l1", "bytes": 0}, {"src": "l1", "dst": "gx1", "bytes": 0},
                           {"src": "l1", "dst": "gw1", "bytes": 0}, {"src": "gx1", "dst": "gw0", "bytes": 0},
                           {"src": "gw0", "dst": "o0", "bytes": 0}, {"src": "gw1", "dst": "o1", "bytes": 0}])
    assert [two.ids[v] for v in np.flatnonzero(weight_grad_ops(two))] == ["gw1", "gw0"]


def test_action_orders_are_torchs() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {"F": FORWARD, "I": BACKWARD, "W": WEIGHT}
    for p in (1, 2, 4):
        for m in (1, 2, 3, 4, 5, 8):
            rounds = max(1, m // p)
            # what torch's ScheduleInterleavedZeroBubble refuses (M not a multiple of its rounds), export and run do
            assert all((Schedule("zero-bubble", m, chunks=v).unrunnable(p) is None) == (m % rounds == 0)
                       for v in (1, 2)), (p, m)
            for v in (1, 2) if m % rounds == 0 else ():
                fake = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                                       microbatches_per_round=m // rounds)
                for r in range(p):
                    torch_ops = schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, r)
                    expect = [(kinds[a.computation_type.value], a.stage_index // p, a.microbatch_index)
                              for a in torch_ops if a is not None]
                    assert actions(Schedule("zero-bubble", m, chunks=v), p, r) == expect, (p, m, v, r)
            fake = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
            for r in range(p):
                torch_ops = schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r)
                expect = [(kinds[a.computation_type.value], 0 if a.stage_index == r else 1, a.microbatch_index)
                          for a in torch_ops if a is not None]
                assert actions(Schedule("zbv", m), p, r) == expect, (p, m, r)
            if m < 2 * p:  # what torch's DualPipeV refuses, export and run do
                assert Schedule("dualpipev", m).unrunnable(p) is not None
                continue
            for r in range(p):  # an overlapped action (OVERLAP_F_B) is its forward and whole backward in a row
                torch_ops = schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
                flat = [x for a in torch_ops for x in (a.sub_actions or (a,))]
                expect = [({**kinds, "B": FULL}[a.computation_type.value], 0 if a.stage_index == r else 1,
                           a.microbatch_index) for a in flat]
                assert actions(Schedule("dualpipev", m), p, r) == expect, (p, m, r)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8)])
def test_zb_h1_bubble_is_the_papers(p: int, m: int) -> None:
    # F = B = W = 1 per stage: ZB-H1's bubble is (p - 1)(F + B - W) = p - 1 (arXiv 2401.10241, section 3)
    g, c = zchain(p), cluster(p, bw=1e9)
    zb = simulate_schedule(g, c, layer(g), Schedule("zero-bubble", m, chunks=1, microbatch_graph=True))
    one_f_one_b = simulate_schedule(g, c, layer(g), Schedule("1f1b", m, microbatch_graph=True))
    assert zb.step_time_s == pytest.approx(3 * m + (p - 1))
    assert zb.step_time_s < one_f_one_b.step_time_s


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_v_schedules_reach_the_bound_of_their_last_device(p: int, m: int, kind: str) -> None:
    # 2p half stages in a V: device p-1 starts after p-1 half forwards and then works 3m without a gap (DualPipeV
    # too: its whole backwards and overlapped pairs run back to back there)
    g = zchain(2 * p, 0.5, 0.5, 0.5, microbatches=m)  # one micro-batch's graph: nothing scaled
    plan = ParallelPlan(dp=1, pp=p, microbatches=m, batch=m, schedule=kind)
    pos, chunk = stage_layout(plan, layer(g))
    assert pos.tolist()[:2 * p] == [*range(p), *reversed(range(p))] and chunk.tolist()[p] == 1
    r = simulate_parallel(g, cluster(p, bw=1e9), layer(g), plan)
    assert r.step_time_s == pytest.approx(3 * m + (p - 1) * 0.5)
    with pytest.raises(ScheduleError, match="give chunk_of"):
        simulate_schedule(g, cluster(p, bw=1e9), pos, Schedule(kind, m, microbatch_graph=True))


def test_interleaved_zero_bubble_through_a_plan() -> None:
    p, m = 2, 4
    g = zchain(2 * p, 0.5, 0.5, 0.5, microbatches=m)
    zb = ParallelPlan(dp=1, pp=p, microbatches=m, batch=m, schedule="zero-bubble", chunks=2)
    il = ParallelPlan(dp=1, pp=p, microbatches=m, batch=m, schedule="interleaved-1f1b", chunks=2)
    r_zb, r_il = (simulate_parallel(g, cluster(p, bw=1e9), layer(g), plan) for plan in (zb, il))
    assert r_zb.step_time_s < r_il.step_time_s
    assert r_zb.step_time_s >= 3 * m  # one device's work


def test_schedule_checks_the_zero_bubble_kinds() -> None:
    with pytest.raises(ScheduleError, match="two model chunks"):
        Schedule("zbv", 4, chunks=3)
    assert Schedule("zero-bubble", 4).chunks == 2 and Schedule("zero-bubble", 4, chunks=1).chunks == 1
    with pytest.raises(ScheduleError, match="equal rounds"):
        actions(Schedule("zero-bubble", 5, chunks=1), 2, 0)


def test_the_pipeline_plan_cuts_for_zero_bubble_and_a_v_but_the_placer_not_for_a_v() -> None:
    from devplace.placers.pipeline import pipeline, pipeline_plan
    from devplace.placers.registry import PlacerError

    g, c = zchain(8, microbatches=4), cluster(2, bw=1e9)
    zb = pipeline_plan(g, c, g.topo_order, schedule="zero-bubble", microbatches=4, cuts="ops")
    il = pipeline_plan(g, c, g.topo_order, schedule="interleaved-1f1b", microbatches=4, cuts="ops")
    assert zb.schedule.kind == "zero-bubble" and zb.step_time_s < il.step_time_s
    # a V: 4 stages of 2 layers, out along the devices and back (device 1 holds stages 1 and 2 back to back), each
    # op's stage in the plan, as the simulator judged it; as fast as the V's bound (test above): a device's work,
    # 2 stages x 3 actions of 2 s x m, then (p - 1) forwards of a stage
    v = pipeline_plan(g, c, g.topo_order, schedule="zbv", microbatches=4, cuts="ops")
    forward = [int(v.stage[g.index[f"f{i}"]]) for i in range(8)]
    assert forward == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [int(v.devices[g.index[f"f{i}"]]) for i in range(0, 8, 2)] == [0, 1, 1, 0]
    assert v.step_time_s == pytest.approx(2 * 3 * 2 * 4 + 2) and v.step_time_s <= zb.step_time_s
    plan = ParallelPlan(dp=1, pp=2, microbatches=4, batch=4, schedule="zbv")
    assert simulate_parallel(g, c, v.stage, plan).step_time_s == v.step_time_s
    # the placer's placements run without a stage per op: no V there
    with pytest.raises(PlacerError, match=r"setting 'schedule' must be one of .*zero-bubble, got 'zbv'"):
        pipeline(g, c, order=g.topo_order, seed=0, schedule="zbv", microbatches=4)


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_v_schedules_relay_along_the_v(kind: str) -> None:
    # f0 (stage 0, device 0) also feeds f3 (stage 3, device 0 again): torch's runtime passes it on through stages 1
    # and 2 (both on device 1), so the simulator sends it 0 -> 1 and back 1 -> 0, not nowhere
    p, m = 2, 4
    g = zchain(2 * p, microbatches=m)
    extra = {"src": "f0", "dst": "f3", "bytes": 8, "tensor": 1}
    skip = CompGraph.build("skip", [g.node_record(v) for v in range(g.num_nodes)],
                           [*(g.edge_record(e) for e in range(g.num_edges)), extra], g.meta)
    plan = ParallelPlan(dp=1, pp=p, microbatches=m, batch=m, schedule=kind)
    r = simulate_parallel(skip, cluster(p, bw=1e9), layer(skip), plan).pipelines[0]
    t = r.transfers
    hops = sorted((int(a), int(b)) for a, b, x, n in zip(t.src_dev, t.dst_dev, t.node, t.nbytes, strict=True)
                  if skip.ids[x] == "f0" and n == 8)
    assert hops == [(0, 1)] * m + [(1, 0)] * m
    # and each device runs its actions in the schedule's order: the relayed graph kept each op's stage along the
    # data (0..2p-1) where its actions are numbered chunk * p + position, so under a V chunk 1's actions held none
    # of their ops, which ran in no order (fixed)
    pos, chunk = stage_layout(plan, layer(skip))
    w = weight_grad_ops(skip)
    role = np.array([FORWARD if i[0] == "f" else WEIGHT if w[v] else BACKWARD if i[0] == "g" else -1
                     for v, i in enumerate(skip.ids)])
    for at in range(p):
        spans = []
        for phase, c, k in actions(plan.pipeline_schedule(), p, at):
            ops = np.flatnonzero((pos == at) & (chunk == c) & (np.isin(role, (BACKWARD, WEIGHT)) if phase == FULL
                                                                 else role == phase))
            spans.append((r.microbatch_start_s[k, ops].min(), r.microbatch_finish_s[k, ops].max()))
        assert all(a[1] <= b[0] + 1e-9 for a, b in pairwise(spans)), (at, spans)

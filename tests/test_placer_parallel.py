"""The nested search over parallel plans (placers/parallel.py) on a small model: it judges every (dp, ZeRO,
recompute) it should and answers the fastest plan that fits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cluster
from devplace.errors import DevplaceError
from devplace.graph import CompGraph
from devplace.graph.parallel import ParallelPlan, ParallelPlanError
from devplace.graph.phases import _step_column, step_compute
from devplace.graph.ties import _tie_classes, tie_classes
from devplace.placers.parallel import _replicas_bound, as_microbatch, fewest_blocks, search_parallel
from devplace.sim.parallel import sharded_updates, simulate_parallel
from devplace.sim.schedule import ScheduleError
from test_sim_parallel import blocks, model
from test_sim_schedule import pipelines, tied_lm


def test_the_search_answers_the_fastest_plan_that_fits() -> None:
    # 4 layers holding 8 GB each (2 GB weights), 20 GB per device: a whole replica (32 GB) fits only sharded
    g, c = model(4, param=8e9, meta={"capture": {"batch": 1}}), cluster(4, bw=1e10, mem=2e10)
    found = search_parallel(g, c, batch=8, microbatch_size=1)
    plans = [x.plan for x in found.candidates if x.plan is not None]
    shapes = {(p.dp, p.pp, p.microbatches) for p in plans}
    assert shapes == {(1, 4, 8), (2, 2, 4), (4, 1, 2)}
    # per pipeline: 4 schedules (1f1b, zero-bubble, zbv, dualpipev) x ZeRO stages (0 only at dp=1) x 2 recompute
    # choices; 4 layers make no V of 8 stages (dp=1): one candidate says so, without a plan
    assert [sum(p.dp == dp for p in plans) for dp in (1, 2, 4)] == [2 * 1 * 2, 4 * 4 * 2, 1 * 4 * 2]
    assert {p.schedule for p in plans if p.dp == 2} == {"1f1b", "zero-bubble", "zbv", "dualpipev"}
    assert [(x.label(8), x.note[:31]) for x in found.candidates if x.plan is None] == [
        ("dp=1 M=8 zbv", "no pipeline of 8 stages in a V:")]
    pure_dp = {(x.plan.zero[0], x.plan.recompute[0]): x.feasible for x in found.candidates if x.dp == 4}
    assert not pure_dp[(0, "none")] and not pure_dp[(1, "none")] and pure_dp[(3, "none")]
    best = min(x.step_time_s for x in found.candidates if x.feasible)
    assert found.best.step_time_s == best and found.best.feasible
    assert found.best.plan.dp == 4 and found.best.plan.zero == (3,)
    one_of_two = model(4, param=8e9, meta={"capture": {"batch": 1}, "microbatches": 2})  # the winner's M
    again = simulate_parallel(one_of_two, c, found.stage, found.best.plan)
    assert again.step_time_s == found.best.step_time_s
    # what the default asks: only plans devplace run runs; ZeRO-3 under zero bubble is a candidate not judged
    runs = search_parallel(g, c, batch=8, microbatch_size=1, dps=(2,), runnable=True)
    left = [x for x in runs.candidates if x.plan.schedule in ("zero-bubble", "zbv", "dualpipev") and 3 in x.plan.zero]
    assert len(left) == 6 and all(x.step_time_s is None and not x.feasible and "does not run ZeRO-3" in x.note
                                  for x in left)
    # and recomputation is not simulated where the same plan fits without it (it only adds work)
    skipped = [x for x in runs.candidates if x.note.startswith("skipped: the same plan fits without")]
    assert skipped and all(x.plan.recompute[0] == "full" and x.step_time_s is None for x in skipped)
    for x in skipped:
        twin = next(y for y in runs.candidates if y.plan == replace(x.plan, recompute="none"))
        assert twin.feasible
    assert all(x.step_time_s is not None for x in runs.candidates if x not in left and x not in skipped)


def test_the_search_says_what_is_wrong() -> None:
    g, c = model(2, param=8e9, meta={"capture": {"batch": 2}}), cluster(2, mem=1e9)
    with pytest.raises(DevplaceError, match="captured at batch 2, not at the micro-batch size 1"):
        search_parallel(g, c, batch=8, microbatch_size=1)
    with pytest.raises(DevplaceError, match="not a whole number of micro-batches of 2"):
        search_parallel(g, c, batch=7, microbatch_size=2)
    with pytest.raises(DevplaceError, match=r"degrees \[3\] do not divide the 2 devices .* use some of 1, 2"):
        search_parallel(g, c, batch=8, microbatch_size=2, dps=(1, 3))
    with pytest.raises(DevplaceError, match="no parallel plan of 'm' at batch 8 fits"):
        search_parallel(g, c, batch=8, microbatch_size=2)


def test_where_only_full_recomputation_fits_a_stage_recomputes_the_fewest_blocks_that_fit() -> None:
    # 6 blocks of 2 x 100 bytes per micro-batch on one device: 1200 bytes without recomputation, 701 with all
    # (each block's input kept), 601 to 1001 with 5 to 1 (test_sim_parallel); 950 bytes of memory
    g = blocks(6)
    found = search_parallel(g, cluster(1, mem=950.0), batch=2, microbatch_size=1)
    by = {x.plan.recompute[0]: x for x in found.candidates}
    assert not by["none"].feasible and by["full"].feasible
    k = found.best.plan.recompute[0]
    assert isinstance(k, int) and 0 < k < 6 and found.best.feasible
    assert found.best.step_time_s < by["full"].step_time_s and by[k].step_time_s == found.best.step_time_s


def test_the_fewest_blocks_per_stage_of_a_pipeline() -> None:
    # two stages of 3 blocks under 1F1B, M=4: stage 0 holds more micro-batches' activations (300 bytes without
    # recomputation, 175.5 with) than stage 1 (175, fits): only stage 0 recomputes, some of its blocks
    g = blocks(6)
    stage = np.array([int(i.split(".")[2].split("/")[0]) // 3 if "/" in i else 0 for i in g.ids])
    c = cluster(2, mem=250.0)
    none, full = (simulate_parallel(g, c, stage, ParallelPlan(1, 2, 4, 4, "1f1b", recompute=r))
                  for r in ("none", "full"))
    assert [m.total for m in none.memory] == [300.0, 175.0] and full.feasible
    partial = fewest_blocks(g, c, stage, none, full)
    assert partial is not None and partial.feasible
    k = partial.plan.recompute
    assert isinstance(k[0], int) and 0 < k[0] < 3 and k[1] == "none"
    assert partial.step_time_s < full.step_time_s
    roomy = cluster(2)
    none, full = (simulate_parallel(g, roomy, stage, ParallelPlan(1, 2, 4, 4, "1f1b", recompute=r))
                  for r in ("none", "full"))
    assert fewest_blocks(g, roomy, stage, none, full) is None  # nothing over memory: nothing to recompute


def test_a_graph_marked_as_a_micro_batch_is_the_one_built_from_its_records() -> None:
    """`as_microbatch` builds from the graph's columns: every column, record and derived array as `CompGraph.build`
    of its records with the count in its meta gives."""
    g, _ = tied_lm(3)
    nodes = [{**g.node_record(v), "extra": v, "compute_s_by_kind": {"T4": 2.0 * v}} for v in range(g.num_nodes)]
    g = CompGraph.build(g.name, nodes, [g.edge_record(e) for e in range(g.num_edges)], {"note": 1})
    got = as_microbatch(g, 4)
    ref = CompGraph.build(g.name, [g.node_record(v) for v in range(g.num_nodes)],
                          [g.edge_record(e) for e in range(g.num_edges)], {**g.meta, "microbatches": 4})
    assert got.to_dict() == ref.to_dict()
    for k in ("compute_s", "output_bytes", "param_bytes", "temp_bytes", "edge_src", "edge_dst", "edge_bytes",
              "edge_tensor", "succ_ptr", "succ_edges", "pred_ptr", "pred_edges", "topo_order"):
        assert getattr(got, k).tobytes() == getattr(ref, k).tobytes(), k
    assert tie_classes(got).tolist() == _tie_classes(ref).tolist()
    assert step_compute(got).compute_s.tolist() == _step_column(ref).tolist()
    assert step_compute(got).by_kind["T4"].tolist() == _step_column(ref, "T4").tolist()


def test_sharded_updates_keep_the_graphs_classes_and_once_per_step_parts() -> None:
    """`sharded_updates` divides the updates' bytes by dp and keeps the tie classes and once-per-step seconds it
    stores from the graph's: those computed afresh on its nodes."""
    g, stage = tied_lm(3)
    plan = ParallelPlan(dp=2, pp=3, microbatches=4, batch=8, zero=(1, 1, 1))
    got = sharded_updates(g, stage, plan)
    assert got is not g  # a graph of its own: the updates are sharded
    fresh = CompGraph.from_arrays(got.name, got.ids, got.op, got.kind, got.group, got.compute_s, got.output_bytes,
                                  got.param_bytes, got.temp_bytes, got.edge_src, got.edge_dst, got.edge_bytes,
                                  got.edge_tensor, meta=got.meta, node_extra=got.node_extra)
    assert tie_classes(got).tolist() == _tie_classes(fresh).tolist()
    assert step_compute(got).compute_s.tolist() == _step_column(fresh).tolist()


@settings(max_examples=40, deadline=None)
@given(pipelines(), st.sampled_from([1, 2]), st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=6, max_size=6),
       st.sampled_from([0, 3]), st.sampled_from(["none", "full"]))
def test_no_plan_is_faster_than_its_replicas_bound(case: tuple, dp: int, speeds: list[float], zero: int,
                                                   recompute: str) -> None:
    """The bound a parallel search skips a data-parallel degree by (`_replicas_bound`) is below the simulated step
    of every plan of that degree: random pipelines on devices of unequal speeds, ZeRO, recomputation."""
    nodes, edges, p, placement, kind, m, _, bw, lat, _ = case
    if kind == "interleaved-1f1b" or (dp == 1 and zero):
        return
    g = CompGraph.build("p", nodes, edges, {"microbatches": m})
    stage = np.array([placement[i] for i in g.ids], dtype=np.int64)
    c = cluster(dp * p, bw=bw, lat=lat, speeds=speeds[:dp * p])
    plan = ParallelPlan(dp, p, m, dp * m, kind if p > 1 else "none", zero=zero, recompute=recompute)
    try:
        r = simulate_parallel(g, c, stage, plan)
    except (ScheduleError, ParallelPlanError):
        return
    assert r.step_time_s >= _replicas_bound(g, c, plan)


def test_a_degree_skipped_by_its_bound_has_no_faster_plan() -> None:
    """With `beat`, a degree whose bound is not below it (or the fastest plan before it) is skipped unjudged; every
    plan of a skipped degree, judged without `beat`, is no faster than the plan kept, and the answer is the
    same wherever one is found."""
    g, c = model(4, param=8e9, meta={"capture": {"batch": 1}}), cluster(4, bw=1e10, mem=2e10, speeds=[2, 2, 1, 1])
    full = search_parallel(g, c, batch=8, microbatch_size=1)
    assert full.best is not None
    steps = sorted({x.step_time_s for x in full.candidates if x.feasible})
    skips = 0
    for beat in (steps[0] * 0.5, *steps, steps[-1] * 2):
        found = search_parallel(g, c, batch=8, microbatch_size=1, beat=beat)
        skipped = {x.dp for x in found.candidates if x.note.startswith("skipped: no plan beats")}
        skips += len(skipped)
        kept = found.best.step_time_s if found.best is not None else beat
        for x in full.candidates:
            if x.dp in skipped and x.feasible:
                assert x.step_time_s >= min(kept, beat)
        if full.best.step_time_s < beat:
            assert found.best is not None and found.best.plan == full.best.plan
            assert found.best.step_time_s == full.best.step_time_s
        else:
            assert found.best is None or found.best.step_time_s >= full.best.step_time_s
    assert skips  # the bound skipped something

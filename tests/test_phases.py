"""A node that merges per-micro-batch and once-per-step compute (a coarse group or folded tie class holding a
layer's backward ops and its optimizer update) runs the per-step part once per step under a schedule, not
once per micro-batch (`devplace.graph.phases`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cluster
from devplace.errors import GraphError
from devplace.graph import CompGraph
from devplace.graph.coarsen import coarsen
from devplace.graph.phases import STEP_COMPUTE_BY_KIND_KEY, STEP_COMPUTE_KEY, step_compute
from devplace.graph.ties import fold
from devplace.hardware.cluster import Cluster, Device, Link, step_times
from devplace.placers.pipeline import pipeline_plan
from devplace.sim import Schedule, lower_bound, simulate


def layers(n: int, opt_s: float = 5.0) -> CompGraph:
    """n layers: forward f_i, backward b_i (colocated with f_i), optimizer o_i of f_i's weights (kind optimizer,
    colocated with f_i); every op 1 s but the optimizer updates, `opt_s`."""
    nodes, edges = [], []
    for i in range(n):
        nodes += [{"id": f"f{i}", "compute_s": 1.0, "kind": "forward", "param_bytes": 4},
                  {"id": f"b{i}", "compute_s": 1.0, "kind": "backward", "group": f"f{i}"},
                  {"id": f"o{i}", "compute_s": opt_s, "kind": "optimizer", "group": f"f{i}"}]
        if i:
            edges.append({"src": f"f{i - 1}", "dst": f"f{i}", "bytes": 8})
            edges.append({"src": f"b{i}", "dst": f"b{i - 1}", "bytes": 8})
        edges.append({"src": f"b{i}", "dst": f"o{i}", "bytes": 4, "tensor": 1})
    edges.append({"src": f"f{n - 1}", "dst": f"b{n - 1}", "bytes": 8})
    return CompGraph.build("layers", nodes, edges, meta={"microbatches": 4})


def test_a_coarse_group_with_an_optimizer_update_runs_it_once_per_step():
    g = layers(2)
    coarse = coarsen(g, 2).graph
    assert coarse.num_nodes == 2 and "optimizer" not in coarse.kind  # the updates merged into groups
    assert step_compute(coarse).compute_s.sum() == pytest.approx(10.0)
    c = cluster(1)
    s = Schedule("1f1b", 4, microbatch_graph=True)
    full = simulate(g, c, np.zeros(g.num_nodes, dtype=np.int64), schedule=s)
    merged = simulate(coarse, c, np.zeros(2, dtype=np.int64), schedule=s)
    # 4 micro-batches of 2 forward + 2 backward seconds, and 2 updates of 5 s once: 26 s (not 4 x 14 = 56 s)
    assert full.step_time_s == pytest.approx(26.0)
    assert merged.step_time_s == pytest.approx(26.0)
    assert lower_bound(coarse, c, s).work_s == pytest.approx(lower_bound(g, c, s).work_s) == pytest.approx(26.0)


def test_a_folded_tie_class_keeps_its_optimizer_update_once_per_step():
    g = layers(3)
    folded = fold(g).graph
    assert folded.num_nodes == 3
    assert step_compute(folded).compute_s.tolist() == [5.0, 5.0, 5.0]
    s = Schedule("gpipe", 4, microbatch_graph=True)
    c = cluster(1)
    assert simulate(folded, c, np.zeros(3, dtype=np.int64), schedule=s).step_time_s == pytest.approx(4 * 6 + 15)


def test_per_kind_costs_of_the_once_per_step_part():
    g = layers(2)
    kinds = {"fast": g.compute_s / 2, "slow": g.compute_s * 3}
    g = CompGraph.from_arrays(g.name, g.ids, g.op, g.kind, g.group, g.compute_s, g.output_bytes, g.param_bytes,
                              g.temp_bytes, g.edge_src, g.edge_dst, g.edge_bytes, g.edge_tensor, kind_compute=kinds,
                              meta=dict(g.meta))
    coarse = coarsen(g, 2).graph
    c = Cluster("two", (Device("a", 1e12, 1.0, kind="fast"), Device("b", 1e12, 1.0, kind="slow")), Link(10.0, 0.0))
    assert step_times(coarse, c).sum(axis=0).tolist() == pytest.approx([5.0, 30.0])  # 2 updates of 5 s


def test_the_pipeline_placer_counts_optimizer_updates_once_on_a_coarse_graph():
    """Four layers whose updates take 20 s each on 2 devices: with the updates counted per micro-batch, the
    model saw 4 x 22 s per micro-batch on each device whatever the split; counted once, the split balances
    the per-micro-batch work and the step is what the full graph runs."""
    g = layers(4, opt_s=20.0)
    coarsening = coarsen(g, 4)
    coarse = coarsening.graph
    assert "optimizer" not in coarse.kind
    c = cluster(2, bw=1e12)
    plan = pipeline_plan(coarse, c, coarse.topo_order, schedule="1f1b", microbatches=4)
    ran = simulate(g, c, coarsening.expand(plan.devices).to_array(g, 2), schedule=plan.schedule)
    assert plan.step_time_s == pytest.approx(ran.step_time_s)


def test_a_bad_once_per_step_part_is_a_clear_error():
    nodes = [{"id": "x", "compute_s": 1.0, "kind": "backward", STEP_COMPUTE_KEY: 2.0}]
    g = CompGraph.build("bad", nodes, [])
    with pytest.raises(GraphError, match=r"step_compute_s=2\.0"):
        step_compute(g)


def _step_by_node(g: CompGraph, kind: str | None) -> list[float]:
    """The once-per-step seconds by the rule of `devplace.graph.phases`, node by node."""
    total = g.compute_s if kind is None else g.kind_compute[kind]
    out = []
    for v, extra in enumerate(g.node_extra):
        if g.kind[v] not in ("", "forward", "backward"):
            out.append(float(total[v]))
        elif STEP_COMPUTE_KEY not in extra:
            out.append(0.0)
        elif kind is None:
            out.append(min(float(extra[STEP_COMPUTE_KEY]), float(g.compute_s[v])))
        elif kind in extra.get(STEP_COMPUTE_BY_KIND_KEY, {}):
            out.append(min(float(extra[STEP_COMPUTE_BY_KIND_KEY][kind]), float(total[v])))
        else:
            ref = min(float(extra[STEP_COMPUTE_KEY]), float(g.compute_s[v]))
            out.append(float(total[v]) * (ref / float(g.compute_s[v])) if g.compute_s[v] > 0 else 0.0)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["forward", "backward", "optimizer", ""]), st.integers(0, 3),
                          st.sampled_from(["none", "int", "float", "numpy", "edge"]), st.booleans()),
                min_size=1, max_size=12))
def test_once_per_step_parts_read_as_one_array_are_those_of_the_rule_node_by_node(nodes) -> None:
    """Plain ints and floats are checked as one array, anything else (a numpy float) node by node; both give
    the rule's values, a value a hair above the node's compute cut to it."""
    recs = []
    for i, (kind, c, how, by_kind) in enumerate(nodes):
        compute = float(c)
        rec: dict = {"id": f"n{i}", "kind": kind, "compute_s": compute, "compute_s_by_kind": {"T4": 2 * compute}}
        value = {"none": None, "int": c // 2, "float": compute / 3, "numpy": np.float64(compute / 4),
                 "edge": compute * (1 + 1e-10)}[how]
        if value is not None:
            rec[STEP_COMPUTE_KEY] = value
            if by_kind:
                rec[STEP_COMPUTE_BY_KIND_KEY] = {"T4": compute / 2}
        recs.append(rec)
    g = CompGraph.build("g", recs, [])
    step = step_compute(g)
    assert step.compute_s.tolist() == _step_by_node(g, None)
    assert step.by_kind["T4"].tolist() == _step_by_node(g, "T4")


@pytest.mark.parametrize("bad", [True, 2, float("inf"), -0.5, "0.1"])
def test_the_first_bad_once_per_step_part_is_named(bad) -> None:
    nodes = [{"id": "a", "compute_s": 1.0, "kind": "backward", STEP_COMPUTE_KEY: 0.5},
             {"id": "b", "compute_s": 1.0, "kind": "backward", STEP_COMPUTE_KEY: bad},
             {"id": "c", "compute_s": 1.0, "kind": "backward", STEP_COMPUTE_KEY: 3.0}]
    with pytest.raises(GraphError, match=f"node 'b' has {STEP_COMPUTE_KEY}="):
        step_compute(CompGraph.build("bad", nodes, []))

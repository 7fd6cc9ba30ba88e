"""The autograd rule (issue 11): every placer places tie classes as one decision, so what devplace reports is
what autograd runs, and a plan is never over memory as run on the full graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import cluster, graph
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.graph.coarsen import Coarsening, coarsen
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import runtime_placement
from devplace.graph.ties import OP_FOLDED, fold, is_tied, tie_classes, violations
from devplace.orders import traversal_indices
from devplace.placers import NoFitError, get_placer, place, place_expanded, placer_names
from devplace.runtime.plan import plan_from_prepared
from devplace.sim import simulate
from devplace.zoo import layered_graph


@pytest.fixture(scope="module")
def mlp():
    """A tiny MLP's Adam training step, captured, costed and coarsened to 12 groups (several tie classes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
                          nn.ReLU(), nn.Linear(64, 8))
    return prepare(capture(model, (torch.randn(16, 32),), optimizer="adam"), max_nodes=12)


def _fast_cluster(n: int = 3):
    # links fast and compute slow enough that spreading ops over devices pays for the list schedulers
    return cluster(n, bw=1e12, lat=1e-9, mem=1e12)


# ---------------------------------------------------------------------------------------------- fold


def test_fold_of_a_cyclic_quotient_is_a_dag_with_the_classes_costs():
    # a -> b -> c -> d with {a, d} and {b, c} tied: the quotient a/d <-> b/c is a cycle (a layer and its
    # backward op sandwich the rest); the fold keeps only the edge forward in the representatives' rank
    g = graph([{"id": "a", "compute_s": 1.0, "param_bytes": 5.0, "output_bytes": 2.0, "temp_bytes": 3.0, "tie": "x"},
               {"id": "b", "compute_s": 2.0, "output_bytes": 4.0, "temp_bytes": 1.0, "tie": "y"},
               {"id": "c", "compute_s": 3.0, "output_bytes": 1.0, "temp_bytes": 7.0, "tie": "y"},
               {"id": "d", "compute_s": 4.0, "param_bytes": 1.0, "temp_bytes": 2.0, "tie": "x"}],
              [("a", "b", 2.0), ("b", "c", 4.0), ("c", "d", 1.0)])
    f = fold(g)
    h = f.graph
    assert h.ids == ("a", "b") and h.op == (OP_FOLDED, OP_FOLDED)
    assert h.compute_s.tolist() == [5.0, 5.0]
    assert h.param_bytes.tolist() == [6.0, 0.0]
    assert h.output_bytes.tolist() == [2.0, 5.0]
    assert h.temp_bytes.tolist() == [3.0, 7.0]  # temporaries live only while their op runs: the largest
    assert [(h.ids[s], h.ids[t]) for s, t in zip(h.edge_src, h.edge_dst, strict=True)] == [("a", "b")]
    assert not is_tied(h)
    assert f.expand(np.array([1, 0])).tolist() == [1, 0, 0, 1]


def test_fold_sends_each_tensor_once_per_consumer_class():
    # p's tensor 0 goes to q and r (one class) and to s: two folded edges, both tensor 0 of p's class
    g = graph([("p", 1.0), {"id": "q", "tie": "k"}, {"id": "r", "tie": "k"}, ("s", 1.0)],
              [("p", "q", 3.0), ("p", "r", 3.0), ("p", "s", 3.0), ("p", "s", 9.0, 1)])
    h = fold(g).graph
    edges = sorted((h.ids[int(s)], h.ids[int(t)], float(b), int(x))
                   for s, t, b, x in zip(h.edge_src, h.edge_dst, h.edge_bytes, h.edge_tensor, strict=True))
    assert edges == [("p", "q", 3.0, 0), ("p", "s", 3.0, 0), ("p", "s", 9.0, 1)]


def test_fold_of_a_training_graph_keeps_the_totals(mlp):
    f = fold(mlp.graph)
    assert f.graph.num_nodes == int(tie_classes(mlp.graph).max()) + 1 < mlp.graph.num_nodes
    for attr in ("compute_s", "param_bytes", "output_bytes"):
        assert np.isclose(getattr(f.graph, attr).sum(), getattr(mlp.graph, attr).sum())


def _random_ties(n: int, labels: list[int], seed: int) -> CompGraph:
    g = layered_graph(n, width=4, fan_in=2, seed=seed)
    nodes = [{**g.node_record(v), "tie": f"t{labels[v]}"} if labels[v] >= 0 else g.node_record(v)
             for v in range(n)]
    return CompGraph.build(g.name, nodes, [g.edge_record(e) for e in range(g.num_edges)])


@settings(max_examples=15, deadline=None)
@given(st.integers(8, 24).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(-1, 4), min_size=n,
                                                                             max_size=n))),
       st.integers(0, 3))
def test_fold_of_any_tie_labels_is_a_dag_whose_placements_keep_the_classes(case, seed):
    n, labels = case
    g = _random_ties(n, labels, seed)
    f = fold(g)  # CompGraph.build raises on a cycle: the fold is a DAG whatever the classes
    assert f.graph.num_nodes == int(tie_classes(g).max()) + 1
    assert np.isclose(f.graph.compute_s.sum(), g.compute_s.sum())
    assert np.isclose(f.graph.output_bytes.sum(), g.output_bytes.sum())
    devices = f.expand(np.arange(f.graph.num_nodes) % 3)
    assert violations(g, devices, tie_classes(g)) == []
    p = place(g, cluster(3, bw=12e9, lat=1e-5), placer="round-robin", order="topo", semantics="autograd")
    assert violations(g, p.to_array(g, 3), tie_classes(g)) == []


# ---------------------------------------------------------------------------------------------- every placer


@pytest.mark.parametrize("name", placer_names())
def test_every_placer_keeps_tie_classes_and_reports_the_as_run_step(name, mlp):
    c = _fast_cluster()
    p = plan_from_prepared(mlp, c, placer=name, order="topo", seed=1)
    devices = p.placement.to_array(mlp.full, c.num_devices)
    assert violations(mlp.full, devices, tie_classes(mlp.full)) == []
    assert p.runtime_placement.assignment == p.placement.assignment
    assert p.result.step_time_s == p.runtime_result.step_time_s
    assert p.result.feasible
    assert p.placement.made_by.semantics == "autograd"
    assert p.placement.meta["ties"] == ("native" if get_placer(name).handles_ties else "folded")


def test_without_the_rule_placers_split_classes(mlp):
    # the rule is what keeps classes together: round_robin cycles devices over nodes, so it splits them
    c = _fast_cluster()
    free = place(mlp.graph, c, placer="round-robin", order="topo", semantics="op-by-op")
    assert violations(mlp.graph, free.to_array(mlp.graph, 3), tie_classes(mlp.graph))
    ruled = place(mlp.graph, c, placer="round-robin", order="topo")
    assert violations(mlp.graph, ruled.to_array(mlp.graph, 3), tie_classes(mlp.graph)) == []


@pytest.mark.parametrize("name", ["m-etf", "m-sct", "greedy", "m-topo", "contiguous", "round-robin"])
def test_rule_off_is_the_placers_own_placement(name, mlp):
    c = _fast_cluster()
    spec = get_placer(name)
    g = mlp.graph
    direct = spec.func(g, c, order=traversal_indices(g, "topo", 0, cluster=c), seed=0)
    off = place(g, c, placer=name, order="topo", semantics="op-by-op")
    assert off.to_array(g, 3).tolist() == np.asarray(direct).tolist()
    assert off.made_by.semantics == "op-by-op" and "ties" not in off.meta


@pytest.mark.parametrize("name", ["m-etf", "heft", "greedy", "m-topo"])
def test_a_graph_without_ties_is_placed_the_same_either_way(name):
    g = layered_graph(40, width=4, fan_in=2, seed=2)
    assert not is_tied(g)
    c = _fast_cluster()
    on = place(g, c, placer=name, order="topo", semantics="autograd")
    off = place(g, c, placer=name, order="topo", semantics="op-by-op")
    assert on.assignment == off.assignment and on.meta["step_time_s"] == off.meta["step_time_s"]


# ---------------------------------------------------------------------------------------------- as run, full graph


def _understated():
    """A full graph a -> b (10 bytes of params each) and a coarse view of it that counts 1 byte each: the view
    fits on one 15-byte device, the full graph does not."""
    full = graph([{"id": "a", "compute_s": 1.0, "param_bytes": 10.0, "output_bytes": 0.1},
                  {"id": "b", "compute_s": 1.0, "param_bytes": 10.0}], [("a", "b", 0.1)], name="full")
    coarse = graph([{"id": "A", "compute_s": 1.0, "param_bytes": 1.0, "output_bytes": 0.1},
                    {"id": "B", "compute_s": 1.0, "param_bytes": 1.0}], [("A", "B", 0.1)], name="coarse")
    # slow links: m-etf keeps A and B together unless memory forbids it
    return full, Coarsening(coarse, "full", {"A": ("a",), "B": ("b",)}), cluster(2, bw=1e-3, mem=15.0)


def test_a_placement_over_memory_as_run_is_placed_again_to_fit():
    full, coarsening, c = _understated()
    # what plan_from_prepared did before: place the coarse view, expand, simulate -- over memory as run
    old = coarsening.expand(place(coarsening.graph, c, placer="m-etf", order="topo"))
    assert not simulate(full, c, old).feasible
    new = place_expanded(coarsening, full, c, placer="m-etf", order="topo")
    assert new.result.feasible and simulate(full, c, new.placement).feasible
    assert new.cap_retries >= 1
    assert new.placement.assignment != old.assignment


def test_nothing_fits_as_run_raises_no_fit_error_with_sizes():
    full, coarsening, _ = _understated()
    tight = cluster(2, bw=1e-3, mem=9.0)  # each op alone holds 10 bytes of params
    with pytest.raises(NoFitError, match=r"as run.*needs about .* the cluster has"):
        place_expanded(coarsening, full, tight, placer="m-etf", order="topo")


def test_plan_from_prepared_is_feasible_as_run_on_a_tight_cluster(mlp):
    # memory for 70% of the step per device: the plan must spread and still fit as run (or say why not)
    from devplace.placers import memory_needs

    need = memory_needs(mlp.full).total_bytes
    c = cluster(3, bw=1e12, lat=1e-9, mem=0.7 * need)
    placed = 0
    for name in ("m-etf", "m-topo", "contiguous"):
        try:
            p = plan_from_prepared(mlp, c, placer=name, order="topo")
        except NoFitError:
            continue
        placed += 1
        assert p.result.feasible and p.runtime_result.feasible
        assert len(set(p.placement.assignment.values())) > 1
        assert runtime_placement(mlp.full, p.placement).assignment == p.placement.assignment
    assert placed


def test_a_coarsening_that_merged_its_tie_classes_is_refined_to_fit(mlp):
    # 2 groups of a training step mix forward and backward ops of several layers: their tie labels join every
    # class into one, so the coarse graph is one decision and cannot be split over devices
    full = mlp.full
    coarse = coarsen(full, 2)
    assert int(tie_classes(coarse.graph).max()) == 0
    peak = float(simulate(full, _fast_cluster(1), np.zeros(full.num_nodes, dtype=np.int64)).peak_memory_bytes[0])
    c = cluster(3, bw=1e12, lat=1e-9, mem=0.7 * peak)  # the step fits three devices, not one
    with pytest.raises(NoFitError):
        place(coarse.graph, c, placer="m-etf", order="topo")
    out = place_expanded(coarse, full, c, placer="m-etf", order="topo")
    assert out.coarsening.num_groups > 2 and out.placement.meta["refined_groups"] == out.coarsening.num_groups
    assert out.result.feasible
    as_run = simulate(full, c, runtime_placement(full, out.placement))
    assert as_run.feasible and as_run.step_time_s == out.result.step_time_s

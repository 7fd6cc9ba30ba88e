"""Tie classes (devplace.graph.ties): what autograd runs on one device, on full and coarse graphs."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import graph
from devplace.capture.pipeline import prepare
from devplace.capture.torch_capture import capture
from devplace.graph.coarsen import coarsen
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import Placement, runtime_placement
from devplace.graph.ties import is_tied, tie_classes, untied, violations


def _mlp_prepared(max_nodes: int | None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    g = capture(model, (torch.randn(2, 8),), optimizer="adam")
    return prepare(g, max_nodes=max_nodes)


def test_plain_graph_has_no_ties():
    g = graph([("a", 1.0), ("b", 1.0), {"id": "c", "tie": "x"}, {"id": "d", "tie": "x"}],
              [("a", "b", 1.0), ("b", "c", 1.0), ("c", "d", 1.0)])
    classes = tie_classes(g)
    assert classes.tolist() == [0, 1, 2, 2]
    assert is_tied(g)
    assert untied(g).tolist() == [0, 1, 2, 3]
    assert violations(g, np.array([0, 1, 1, 0]), classes) == [3]


def test_full_graph_classes_are_what_the_runtime_runs():
    prep = _mlp_prepared(None)
    full = prep.full
    classes = tie_classes(full)
    assert int(classes.max()) + 1 < full.num_nodes  # backward ops are tied to forward ops
    # a placement constant on classes is left as it is by runtime_placement
    devs = classes % 3
    p = Placement.from_array(full, devs)
    assert runtime_placement(full, p).assignment == p.assignment


def test_coarse_classes_expand_to_runtime_placements():
    for max_nodes in (None, 12, 5):
        prep = _mlp_prepared(max_nodes)
        coarse_classes = tie_classes(prep.graph)
        devs = coarse_classes % 2
        expanded = prep.coarsening.expand(devs)
        assert runtime_placement(prep.full, expanded).assignment == expanded.assignment
        assert violations(prep.full, expanded.to_array(prep.full, 2), tie_classes(prep.full)) == []


def test_coarse_labels_survive_recoarsening():
    prep = _mlp_prepared(None)
    again = coarsen(prep.graph, 4)
    devs = tie_classes(again.graph) % 2
    fine = again.expand(devs).to_array(prep.graph, 2)
    assert violations(prep.graph, fine, tie_classes(prep.graph)) == []


def _classes_by_node(g: CompGraph) -> list[int]:
    """Tie classes by the module docstring's rules, node by node: a union-find in Python, numbered by first node."""
    parent = list(range(g.num_nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    def union(x: int, y: int) -> None:
        rx, ry = find(x), find(y)
        parent[max(rx, ry)] = min(rx, ry)
    first: dict[str, int] = {}
    for v in range(g.num_nodes):
        label = g.node_extra[v].get("tie") if g.node_extra else None
        if isinstance(label, str) and label:
            union(first.setdefault(label, v), v)
        if g.kind[v] and g.kind[v] != "forward" and g.group[v] in g.index:
            u = g.index[g.group[v]]
            if u != v and g.kind[u] == "forward":
                union(v, u)
        if g.op[v] == "input" and g.successors(v):
            union(v, g.successors(v)[0])
    roots = [find(v) for v in range(g.num_nodes)]
    return [sorted(set(roots)).index(r) for r in roots]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: st.tuples(
    st.lists(st.tuples(st.sampled_from(["forward", "backward", "optimizer", ""]), st.integers(-1, n - 1),
                       st.sampled_from(["", "a", "b"]), st.booleans()), min_size=n, max_size=n),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=15))))
def test_tie_classes_are_those_of_a_union_find_node_by_node(case) -> None:
    nodes, pairs = case
    recs = [{"id": f"n{i}", "kind": kind, "group": f"n{grp}" if grp >= 0 else "",
             **({"tie": label} if label else {}), **({"op": "input"} if inp else {})}
            for i, (kind, grp, label, inp) in enumerate(nodes)]
    edges = [{"src": f"n{a}", "dst": f"n{b}", "bytes": 1} for a, b in dict.fromkeys(
        (min(a, b), max(a, b)) for a, b in pairs if a != b)]
    g = CompGraph.build("t", recs, edges)
    assert tie_classes(g).tolist() == _classes_by_node(g)

"""Colocation and coarsening (issue 4 item 2): the coarse graph is a DAG, totals are preserved, every op is in
exactly one group, a coarse placement expands to the whole graph, and simulating the expansion works."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from importlib import resources
from typing import Any

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cluster, graph
from devplace.errors import GraphError, PlacementError
from devplace.graph import CompGraph, Placement, canonical_topo_order, load_graph, save_graph
from devplace.graph.coarsen import Coarsening, coarsen, colocate
from devplace.graph.modules import SEGMENTS_KEY, segment_spans
from devplace.graph.ties import tie_classes
from devplace.sim import simulate
from devplace.zoo import layered_graph

LABELS = ["", "", "A", "B", "C", "n0", "n1", "A#1"]
KINDS = ["forward", "backward", "optimizer", ""]


def example_mlp() -> CompGraph:
    return load_graph(resources.files("devplace") / "data" / "example_mlp.json")


def with_groups(g: CompGraph, groups: list[str]) -> CompGraph:
    doc = g.to_dict()
    for rec, grp in zip(doc["nodes"], groups, strict=True):
        rec["group"] = grp
    return CompGraph.build(g.name, doc["nodes"], doc["edges"])


def training_graph(fwd: CompGraph) -> CompGraph:
    """Mirror a forward DAG into a training step: a loss after the sinks and, per forward op f, a backward op
    `f.grad` (group f, twice f's compute) that reads f's output, f's inputs and the input gradients that f's
    consumers' backward ops produce (one output per input)."""
    nodes = [{**fwd.node_record(v), "group": fwd.ids[v], "kind": "forward", "param_bytes": 0}
             for v in range(fwd.num_nodes)]
    nodes.append({"id": "loss", "compute_s": 1e-5, "output_bytes": 4, "kind": "forward"})
    nodes += [{"id": f"{fwd.ids[v]}.grad", "kind": "backward", "group": fwd.ids[v],
               "compute_s": 2 * float(fwd.compute_s[v]), "output_bytes": float(fwd.output_bytes[v]),
               "param_bytes": float(fwd.param_bytes[v])} for v in range(fwd.num_nodes)]
    edges = [fwd.edge_record(e) for e in range(fwd.num_edges)]
    for v in range(fwd.num_nodes):
        f, out = fwd.ids[v], float(fwd.output_bytes[v])
        if not fwd.out_edges(v).size:
            edges += [{"src": f, "dst": "loss", "bytes": out}, {"src": "loss", "dst": f"{f}.grad", "bytes": 4}]
        edges.append({"src": f, "dst": f"{f}.grad", "bytes": out})
        edges += [{"src": fwd.ids[fwd.edge_src[e]], "dst": f"{f}.grad", "bytes": float(fwd.edge_bytes[e])}
                  for e in fwd.in_edges(v)]
        for e in fwd.out_edges(v):
            w = int(fwd.edge_dst[e])
            edges.append({"src": f"{fwd.ids[w]}.grad", "dst": f"{f}.grad", "bytes": out,
                          "tensor": fwd.in_edges(w).tolist().index(e)})
    return CompGraph.build(f"{fwd.name}-train", nodes, edges)


@st.composite
def grouped_dags(draw: Any, max_nodes: int = 14) -> CompGraph:
    """A random DAG: nodes listed in a random insertion order, random group labels (some naming node ids, one
    looking like a split part's name), dyadic compute times (so sums are exact), several tensors per node."""
    n = draw(st.integers(1, max_nodes))
    listed = draw(st.permutations(range(n)))
    labels = draw(st.lists(st.sampled_from(LABELS), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    nums = draw(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
                         min_size=n, max_size=n))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 2)),
                          max_size=3 * n))
    tensor_bytes = draw(st.lists(st.integers(0, 50), min_size=3 * n, max_size=3 * n))
    nodes = []
    for v in listed:
        c, o, p, t = nums[v]
        nodes.append({"id": f"n{v}", "group": labels[v], "kind": kinds[v], "compute_s": c / 64,
                      "output_bytes": o * 100, "param_bytes": p * 1000, "temp_bytes": t * 10})
    edges, seen = [], set()
    for u, v, t in pairs:
        if u == v:
            continue
        u, v = min(u, v), max(u, v)
        if (u, v, t) not in seen:
            seen.add((u, v, t))
            edges.append({"src": f"n{u}", "dst": f"n{v}", "bytes": tensor_bytes[3 * u + t], "tensor": t})
    return CompGraph.build("rand", nodes, edges)


# --------------------------------------------------------------------------- invariants


def check_coarsening(g: CompGraph, c: Coarsening, *, exact: bool = True) -> None:
    """Every invariant that holds for any coarsening of any graph."""
    cg = c.graph
    assert len(canonical_topo_order(cg)) == cg.num_nodes  # acyclic (CompGraph.build checked it too)
    assert c.original == g.name and list(c.members) == list(cg.ids)
    # tie classes: ops that autograd runs together stay together, and coarse nodes are tied only through them
    full_ties, coarse_ties = tie_classes(g), tie_classes(cg)
    gof_index = {op: cg.index[gid] for gid, ops in c.members.items() for op in ops}
    linked = nx.Graph()
    linked.add_nodes_from(range(cg.num_nodes))
    by_class: dict[int, int] = {}
    for v, op in enumerate(g.ids):
        first = by_class.setdefault(int(full_ties[v]), gof_index[op])
        linked.add_edge(first, gof_index[op])
    expected = {frozenset(comp) for comp in nx.connected_components(linked)}
    got: dict[int, set[int]] = defaultdict(set)
    for x in range(cg.num_nodes):
        got[int(coarse_ties[x])].add(x)
    assert {frozenset(xs) for xs in got.values()} == expected
    # every original op in exactly one group; members listed in insertion order
    flat = [op for ops in c.members.values() for op in ops]
    assert sorted(flat) == sorted(g.ids) and len(flat) == len(set(flat))
    for ops in c.members.values():
        assert [g.index[o] for o in ops] == sorted(g.index[o] for o in ops)
    # totals
    if exact:
        assert math.fsum(cg.compute_s.tolist()) == math.fsum(g.compute_s.tolist())
    else:
        assert math.isclose(math.fsum(cg.compute_s.tolist()), math.fsum(g.compute_s.tolist()), rel_tol=1e-12)
    assert math.fsum(cg.param_bytes.tolist()) == math.fsum(g.param_bytes.tolist())
    gof = c.group_of
    # coarse node attributes
    consumers = defaultdict(set)
    for e in range(g.num_edges):
        consumers[g.ids[g.edge_src[e]]].add(gof[g.ids[g.edge_dst[e]]])
    for x, gid in enumerate(cg.ids):
        ops = c.members[gid]
        idx = [g.index[o] for o in ops]
        if len(ops) == 1:
            rec = cg.node_record(x)
            rec.pop("tie", None)  # checked below, with the tie classes
            assert rec == {**g.node_record(idx[0]), "id": gid}
            continue
        ext = [v for v, o in zip(idx, ops, strict=True) if not consumers[o] or consumers[o] - {gid}]
        assert cg.output_bytes[x] == sum(g.output_bytes[v] for v in ext)
        assert cg.temp_bytes[x] >= max(g.temp_bytes[v] for v in idx)
        kinds = {g.kind[v] for v in idx}
        want = next((k for k in ("forward", "backward", "optimizer") if k in kinds), g.kind[idx[0]])
        assert cg.kind[x] == want and cg.op[x] == "group"
    # edges: one per (coarse src, coarse dst, original tensor) that crosses groups, with that tensor's bytes
    want_edges: dict[tuple[str, str], Counter] = defaultdict(Counter)
    tensor_dsts: dict[tuple[str, int], set[str]] = defaultdict(set)
    tensor_bytes: dict[tuple[str, int], float] = {}
    for e in range(g.num_edges):
        u, v, t = g.ids[g.edge_src[e]], g.ids[g.edge_dst[e]], int(g.edge_tensor[e])
        if gof[u] != gof[v]:
            if gof[v] not in tensor_dsts[u, t]:
                want_edges[gof[u], gof[v]][float(g.edge_bytes[e])] += 1
            tensor_dsts[u, t].add(gof[v])
            tensor_bytes[u, t] = float(g.edge_bytes[e])
    got_edges: dict[tuple[str, str], Counter] = defaultdict(Counter)
    got_dsts: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in range(cg.num_edges):
        x, y = cg.ids[cg.edge_src[e]], cg.ids[cg.edge_dst[e]]
        got_edges[x, y][float(cg.edge_bytes[e])] += 1
        got_dsts[x, int(cg.edge_tensor[e])].add(y)
    if not c.bundle_tensors:
        assert got_edges == want_edges
    else:  # per producer and set of consumer groups, the same bytes in one tensor
        want: dict[tuple[str, frozenset], float] = defaultdict(float)
        for (u, t), dsts in tensor_dsts.items():
            want[gof[u], frozenset(dsts)] += tensor_bytes[u, t]
        got: dict[tuple[str, frozenset], float] = {}
        for (x, t), dsts in got_dsts.items():
            e = next(e for e in range(cg.num_edges) if cg.ids[cg.edge_src[e]] == x and cg.edge_tensor[e] == t)
            assert (x, frozenset(dsts)) not in got
            got[x, frozenset(dsts)] = float(cg.edge_bytes[e])
        assert got == want
    # the mapping survives the graph's meta
    assert cg.meta["coarsening"] == json.loads(json.dumps(c.to_dict()))
    again = Coarsening.from_graph(cg)
    assert again.members == c.members and again.max_nodes == c.max_nodes


def check_colocation(g: CompGraph, c: Coarsening, pairs: bool = True) -> None:
    """Each group holds ops of one label; two parts of one label cannot be merged without a cycle (checked by
    contracting each pair with networkx when `pairs`)."""
    label = {g.ids[v]: g.group[v] or g.ids[v] for v in range(g.num_nodes)}
    parts: dict[str, list[str]] = defaultdict(list)
    for gid, ops in c.members.items():
        labs = {label[o] for o in ops}
        assert len(labs) == 1
        parts[labs.pop()].append(gid)
    assert c.stats["labels"] == len(parts)
    assert c.stats["groups_split"] == sum(len(p) > 1 for p in parts.values())
    q = nx.DiGraph()
    q.add_nodes_from(c.graph.ids)
    q.add_edges_from((c.graph.ids[s], c.graph.ids[d]) for s, d in zip(c.graph.edge_src, c.graph.edge_dst,
                                                                        strict=True))
    for lab, gids in parts.items():
        if len(gids) > 1:
            assert lab in gids  # the first part keeps the label's name
        for i, x in enumerate(gids if pairs else []):
            for y in gids[i + 1:]:
                merged = nx.contracted_nodes(q, x, y, self_loops=False)
                assert not nx.is_directed_acyclic_graph(merged), (lab, x, y)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_dags(), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_random_dags(g: CompGraph, max_nodes: int, seed: int) -> None:
    c0 = colocate(g)
    check_coarsening(g, c0)
    check_colocation(g, c0)
    for m in (None, max_nodes):
        c = coarsen(g, m)
        check_coarsening(g, c)
        bundled = coarsen(g, m, bundle_tensors=True)
        check_coarsening(g, bundled)
        assert bundled.members == c.members and bundled.graph.num_edges <= c.graph.num_edges
        assert c.stats["colocate"] == c0.num_groups and c.num_groups <= c0.num_groups
        if m is not None:
            assert c.num_groups <= m and c.reached  # always reachable: any DAG merges down to one group
        # coarsening only merges colocation parts, never splits one
        for gid, ops in c0.members.items():
            assert len({c.group_of[o] for o in ops}) == 1, gid
    # expand a random coarse placement and simulate the expansion (the ground truth)
    rng = np.random.default_rng(seed)
    devs = rng.integers(0, 3, c.num_groups)
    p = c.expand(devs)
    assert set(p.assignment) == set(g.ids) and p.graph == g.name
    for gid, d in zip(c.graph.ids, devs.tolist(), strict=True):
        assert all(p.assignment[o] == d for o in c.members[gid])
    res = simulate(g, cluster(3), p)
    assert res.step_time_s >= 0 and math.isfinite(res.step_time_s)
    assert simulate(c.graph, cluster(3), devs).comm_bytes == res.comm_bytes  # the same tensors cross devices
    # bundling moves the same bytes under every placement
    assert simulate(bundled.graph, cluster(3), devs).comm_bytes == simulate(c.graph, cluster(3), devs).comm_bytes


@settings(max_examples=30, deadline=None)
@given(grouped_dags(max_nodes=10), st.integers(1, 10))
def test_deterministic(g: CompGraph, max_nodes: int) -> None:
    a, b = coarsen(g, max_nodes), coarsen(g, max_nodes)
    assert json.dumps(a.graph.to_dict()) == json.dumps(b.graph.to_dict())
    assert a.to_dict() == b.to_dict()


@settings(max_examples=40, deadline=None)
@given(grouped_dags())
def test_no_groups_and_room_change_nothing(g: CompGraph) -> None:
    g = with_groups(g, [""] * g.num_nodes)
    for c in (colocate(g), coarsen(g, g.num_nodes), coarsen(g, g.num_nodes + 5)):
        doc, orig = c.graph.to_dict(), g.to_dict()
        assert doc["nodes"] == orig["nodes"] and doc["edges"] == orig["edges"]
        assert all(ops == (gid,) for gid, ops in c.members.items())


# --------------------------------------------------------------------------- rules on small graphs


def test_backward_op_needing_a_later_forward_op_splits_its_group() -> None:
    g = graph([{"id": "f", "compute_s": 1}, {"id": "g", "compute_s": 1},
               {"id": "b", "compute_s": 2, "group": "f", "kind": "backward"}],
              [("f", "g", 4), ("g", "b", 4), ("f", "b", 4)])
    c = colocate(g)
    assert c.members == {"f": ("f",), "g": ("g",), "f#1": ("b",)}
    assert c.stats["groups_split"] == 1 and c.graph.group == ("", "", "f")  # "" = own id: both parts say "f"
    assert "1 of 2 colocation groups split" in c.summary()


def test_two_convex_groups_that_cross_each_other_are_split() -> None:
    # a1 -> b1 and b2 -> a2: merging both groups would give A -> B -> A
    g = graph([{"id": "a1", "group": "A"}, {"id": "b1", "group": "B"}, {"id": "b2", "group": "B"},
               {"id": "a2", "group": "A"}], [("a1", "b1", 1), ("b1", "b2", 1), ("b2", "a2", 1)])
    c = colocate(g)
    assert c.num_groups == 3 and c.stats["groups_split"] == 1
    check_colocation(g, c)


def test_empty_group_means_own_id_and_split_names_stay_unique() -> None:
    g = graph([{"id": "x"}, {"id": "y", "group": "x"}, {"id": "z"}, {"id": "w", "group": "x"},
               {"id": "v", "group": "x#1"}],
              [("x", "z", 1), ("z", "w", 1), ("x", "w", 1), ("x", "y", 1)])
    c = colocate(g)
    assert c.members["x"] == ("x", "y")  # y names x as its group
    assert c.members["x#2"] == ("w",)  # "x#1" is another group's label
    assert c.members["x#1"] == ("v",)


def test_chains_fuse_and_reduce_the_count() -> None:
    g = graph([(f"c{i}", 1.0) for i in range(6)] + [("x", 1.0), ("y", 1.0)],
              [(f"c{i}", f"c{i + 1}", 8) for i in range(5)] + [("x", "y", 8)])
    c = coarsen(g)
    assert c.members == {"c0": tuple(f"c{i}" for i in range(6)), "x": ("x", "y")}
    assert c.stats["chains"] == 2 < g.num_nodes
    c3 = coarsen(graph([(f"c{i}", 1.0) for i in range(6)], [(f"c{i}", f"c{i + 1}", 8) for i in range(5)]), 3)
    assert list(c3.members.values()) == [("c0", "c1"), ("c2", "c3"), ("c4", "c5")]  # balanced by the cap


def test_single_consumer_and_pairwise_merges() -> None:
    # a diamond with a tail: s -> {l, r} -> j -> t
    g = graph([("s", 1.0), ("l", 1.0), ("r", 1.0), ("j", 1.0), ("t", 1.0)],
              [("s", "l", 1), ("s", "r", 1), ("l", "j", 1), ("r", "j", 1), ("j", "t", 1)])
    assert coarsen(g).members == {"s": ("s",), "l": ("l",), "r": ("r",), "j": ("j", "t")}  # the chain j -> t
    for m in (4, 3, 2, 1):
        c = coarsen(g, m)
        assert c.num_groups == m
        check_coarsening(g, c)
    assert coarsen(g, 1).members == {"s": ("s", "l", "r", "j", "t")}
    # two light ops with one consumer each are merged into it (under the cap W / max_nodes), then pairwise
    g = graph([("x1", 0.1), ("x2", 0.1), ("j", 1.0), ("k1", 1.0), ("k2", 1.0)],
              [("x1", "j", 1), ("x2", "j", 1), ("j", "k1", 1), ("j", "k2", 1)])
    c = coarsen(g, 2)
    assert c.stats["chains"] == 5 and c.stats["single_consumer"] == 3 and c.stats["pairwise"] == 2
    assert c.members == {"x1": ("x1", "x2", "j", "k1"), "k2": ("k2",)}


def test_isolated_groups_merge_with_the_next_lightest() -> None:
    g = graph([("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 1.0)], [("a", "b", 1)])
    c = coarsen(g, 2)
    assert c.num_groups == 2 and c.stats["pairwise"] == 2
    assert c.members == {"a": ("a", "b"), "c": ("c", "d")}  # b joins its neighbour a; d (isolated) joins c
    # many isolated ops (a capture's stray in-place counters) do not make the rest collapse into one group
    chain = [(f"c{i}", 1.0) for i in range(20)]
    stray = [(f"s{i}", 0.01) for i in range(30)]
    g = graph(chain + stray, [(f"c{i}", f"c{i + 1}", 1) for i in range(19)])
    c = coarsen(g, 10)
    assert c.num_groups == 10 and list(c.graph.compute_s) == pytest.approx([2.3] + [2.0] * 9)


def test_group_memory_attributes() -> None:
    # u -> v inside the group, v -> w outside; s has no consumer (its output is the group's output too)
    g = graph([{"id": "u", "group": "G", "output_bytes": 100, "temp_bytes": 7, "param_bytes": 5},
               {"id": "v", "group": "G", "output_bytes": 30, "temp_bytes": 9, "param_bytes": 6},
               {"id": "s", "group": "G", "output_bytes": 2, "temp_bytes": 1},
               {"id": "w", "output_bytes": 1}],
              [("u", "v", 100), ("v", "w", 30), ("u", "s", 100)])
    c = colocate(g)
    x = c.graph.index["G"]
    assert c.graph.output_bytes[x] == 30 + 2  # outputs consumed outside the group, and sink outputs
    assert c.graph.param_bytes[x] == 11
    assert c.graph.temp_bytes[x] == 100 + 9  # u's output lives while v runs with its 9 bytes of scratch


def test_bundled_tensors() -> None:
    # G = {u1, u2} sends u1 and u2 to y only (one bundle), and u2's second output to y and z (another)
    g = graph([{"id": "u1", "group": "G"}, {"id": "u2", "group": "G"}, {"id": "y"}, {"id": "z"}],
              [("u1", "y", 10), ("u2", "y", 20), ("u2", "y", 5, 1), ("u2", "z", 5, 1), ("u1", "u2", 10)])
    exact = colocate(g)
    assert [(e["src"], e["dst"], e["bytes"], e.get("tensor", 0)) for e in exact.graph.to_dict()["edges"]] == [
        ("G", "y", 10, 0), ("G", "y", 20, 1), ("G", "y", 5, 2), ("G", "z", 5, 2)]
    bundled = colocate(g, bundle_tensors=True)
    assert [(e["src"], e["dst"], e["bytes"], e.get("tensor", 0)) for e in bundled.graph.to_dict()["edges"]] == [
        ("G", "y", 30, 0), ("G", "y", 5, 1), ("G", "z", 5, 1)]
    assert bundled.graph.meta["coarsening"]["bundle_tensors"] is True
    assert Coarsening.from_graph(bundled.graph).bundle_tensors


def test_expand_placements_and_errors() -> None:
    g = example_mlp()
    c = coarsen(g, 6)
    p = Placement.from_array(c.graph, list(range(6)), cluster="4xV100")
    full = c.expand(p)
    assert full.cluster == "4xV100" and full.graph == g.name and len(full.assignment) == g.num_nodes
    assert c.expand(dict(p.assignment)).assignment == full.assignment
    with pytest.raises(PlacementError, match="not in coarse graph"):
        c.expand({**p.assignment, "nope": 0})
    with pytest.raises(PlacementError, match="no device for 1 group"):
        c.expand({k: v for k, v in list(p.assignment.items())[1:]})
    with pytest.raises(PlacementError, match="integers"):
        c.expand({k: -1 for k in p.assignment})
    with pytest.raises(PlacementError):
        c.expand([0, 1])


def test_bad_arguments() -> None:
    g = example_mlp()
    for bad in (0, -3, 2.5, True, "10"):
        with pytest.raises(GraphError, match="max_nodes"):
            coarsen(g, bad)  # type: ignore[arg-type]
    with pytest.raises(GraphError, match="no \"coarsening\" mapping"):
        Coarsening.from_graph(g)
    c = coarsen(g, 5)
    doc = c.graph.to_dict()
    doc["coarsening"]["groups"][doc["nodes"][0]["id"]].append(doc["coarsening"]["groups"][doc["nodes"][1]["id"]][0])
    broken = CompGraph.build(c.graph.name, doc["nodes"], doc["edges"], meta={"coarsening": doc["coarsening"]})
    with pytest.raises(GraphError, match="two groups"):
        Coarsening.from_graph(broken)


def test_empty_graph() -> None:
    g = CompGraph.build("empty", [], [])
    assert coarsen(g, 3).num_groups == 0 and colocate(g).members == {}


# --------------------------------------------------------------------------- the example MLP training step


def test_mlp_colocation_splits_forward_from_backward() -> None:
    g = example_mlp()
    c = colocate(g)
    check_coarsening(g, c)
    check_colocation(g, c)
    # 16 layers: forward part + backward/optimizer part each; loss and loss.grad stay together
    assert c.num_groups == 34 and c.stats["groups_split"] == 16
    assert c.members["loss"] == ("loss", "loss.grad")
    assert c.members["layer07"] == ("layer07.fc", "layer07.relu")
    assert c.members["layer07#1"] == ("layer07.relu.grad", "layer07.fc.grad_weight", "layer07.adam",
                                      "layer07.fc.grad_input")
    assert c.graph.group[c.graph.index["layer07#1"]] == "layer07"  # parts of one group share `group`
    assert c.graph.kind[c.graph.index["layer07#1"]] == "backward"


@pytest.mark.parametrize("max_nodes", [None, 24, 12, 6, 3, 1])
def test_mlp_coarsen_invariants_and_save_load(max_nodes: int | None, tmp_path: Any) -> None:
    g = example_mlp()
    c = coarsen(g, max_nodes)
    check_coarsening(g, c, exact=False)
    if max_nodes is not None:
        assert c.num_groups == max_nodes
    path = tmp_path / "coarse.json"
    c.save(path)
    again = Coarsening.load(path)
    assert again.members == c.members and again.original == g.name and again.stats == c.stats
    save_graph(again.graph, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()
    devs = np.arange(c.num_groups) % 4
    assert again.expand(devs).assignment == c.expand(devs).assignment


def test_mlp_coarse_simulation_approximates_the_expanded_one() -> None:
    """Simulate coarse placements and their expansions (the ground truth) on 4 GPUs; print the difference.
    Measured (see docs/coarsen.md): the coarse step time is within a few percent, usually above."""
    g = example_mlp()
    cl = cluster(4, bw=1.2e10, lat=1e-5)
    rows = []
    for max_nodes, bundle in ((None, False), (16, False), (8, False), (4, False), (8, True)):
        c = coarsen(g, max_nodes, bundle_tensors=bundle)
        n = c.num_groups
        contiguous = np.empty(n, dtype=np.int64)
        contiguous[c.graph.topo_order] = np.arange(n) * 4 // n
        placements = {"single": np.zeros(n, dtype=np.int64), "round-robin": np.arange(n) % 4,
                      "contiguous": contiguous, "random": np.random.default_rng(0).integers(0, 4, n)}
        for name, devs in placements.items():
            coarse = simulate(c.graph, cl, devs)
            full = simulate(g, cl, c.expand(devs))
            diff = coarse.step_time_s / full.step_time_s - 1
            rows.append((f"{max_nodes}{'b' if bundle else ''}", name, coarse.step_time_s, full.step_time_s, diff))
            assert abs(diff) < 0.15  # a sanity bound, not a claim of equality
            assert np.all(coarse.peak_memory_bytes >= full.peak_memory_bytes * 0.95)
    for m, name, coarse_s, full_s, diff in rows:  # "8b": max_nodes=8 with bundle_tensors
        print(f"max_nodes={m:5} {name:12} coarse {coarse_s:.4f} s  expanded {full_s:.4f} s  {100 * diff:+.1f}%")


def test_mirrored_training_graph_splits_every_group_in_two() -> None:
    g = training_graph(layered_graph(1000, width=40, seed=5))
    c = colocate(g)
    assert c.stats["groups_split"] == 1000 and c.num_groups == g.num_nodes  # forward op | its backward op
    check_colocation(g, c, pairs=False)
    assert c.members["op7"] == ("op7",) and c.members["op7#1"] == ("op7.grad",)
    for m in (300, 30):
        check_coarsening(g, coarsen(g, m), exact=False)


def test_layered_graph_with_local_labels() -> None:
    """A 20k-op synthetic graph with colocation labels: the invariants at scale (and it runs in about a second)."""
    g = layered_graph(20000, width=100, seed=3)
    rng = np.random.default_rng(1)
    g = with_groups(g, [f"g{(v + int(rng.integers(0, 200))) // 4}" for v in range(g.num_nodes)])
    c = coarsen(g, 200)
    assert c.num_groups == 200 and c.stats["groups_split"] > 0
    check_coarsening(g, c, exact=False)


def test_stored_segment_spans_are_read_as_one_array_and_a_bad_one_is_named():
    """A coarse node's "segments" ([first, last]) are read as one array where all are well formed, and node by
    node otherwise, naming the first bad one."""
    spans = [[0, 0], None, [1, 3], [2, 2]]
    nodes = [{"id": f"n{i}", **({SEGMENTS_KEY: s} if s is not None else {})} for i, s in enumerate(spans)]
    assert segment_spans(CompGraph.build("g", nodes, [])).tolist() == [[0, 0], [-1, -1], [1, 3], [2, 2]]
    for bad in ([2, 1], [1], [-1, 0], [True, 1], [0, 2**70], [0.0, 1], "0-1", (0, 1)):
        wrong = [*nodes[:2], {"id": "n2", SEGMENTS_KEY: bad}, {"id": "n3", SEGMENTS_KEY: [5, 4]}]
        with pytest.raises(GraphError, match=r"node 'n2': \"segments\" must be"):
            segment_spans(CompGraph.build("g", wrong, []))

"""The graph model (DESIGN.md section 3, issue 2 item 2): CompGraph arrays and CSR, canonical order, the
`devplace.graph/1` and `devplace.placement/1` formats, networkx export, and every validation error."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import deque
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devplace.errors import DevplaceError, FormatError, GraphError, PlacementError
from devplace.graph import (
    CompGraph,
    Placement,
    canonical_topo_order,
    load_graph,
    load_placement,
    save_graph,
    save_placement,
)
from devplace.graph.placement import MadeBy
from devplace.graph.schedule import Schedule

NUMERIC = ("compute_s", "output_bytes", "param_bytes", "temp_bytes")
BAD_NUMBERS = [-1, -0.5, math.nan, math.inf, -math.inf, "5", True, False, None, [1], {"x": 1}]


def build(nodes: list[dict[str, Any]], edges: list[dict[str, Any]], name: str = "t", **meta: Any) -> CompGraph:
    return CompGraph.build(name, nodes, edges, meta=meta)


def nodes_of(*ids: str) -> list[dict[str, Any]]:
    return [{"id": i} for i in ids]


def edge(src: str, dst: str, nbytes: float = 0, tensor: int | None = None, **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"src": src, "dst": dst, "bytes": nbytes, **extra}
    if tensor is not None:
        rec["tensor"] = tensor
    return rec


def write_doc(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def graph_doc(nodes: list[dict[str, Any]], edges: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {"format": "devplace.graph/1", "name": "g", **top, "nodes": nodes, "edges": edges}


def ids_of(g: CompGraph, idx: Any) -> list[str]:
    return [g.ids[int(i)] for i in idx]


# ----------------------------------------------------------------------------- random DAGs


@st.composite
def dags(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 12) -> tuple[list[dict], list[dict]]:
    """A random DAG as records: nodes in a random insertion order, edges (with parallel tensors, 0-byte
    control edges and extra keys) in a random edge order. Edges go forward in a hidden topological order."""
    n = draw(st.integers(min_nodes, max_nodes))
    ids = [f"n{i}" for i in range(n)]
    hidden = draw(st.permutations(ids))  # edges go from earlier to later in `hidden`
    nodes = []
    for nid in draw(st.permutations(ids)):
        rec: dict[str, Any] = {"id": nid}
        for k in NUMERIC:
            val = draw(st.one_of(st.none(), st.integers(0, 2**40), st.floats(0, 1e3, allow_nan=False)))
            if val is not None:
                rec[k] = val
        if draw(st.booleans()):
            rec["op"] = draw(st.sampled_from(["aten.mm", "aten.relu", ""]))
        if draw(st.booleans()):
            rec["flops"] = draw(st.integers(0, 2**50))
        nodes.append(rec)
    pairs = [(hidden[i], hidden[j]) for i in range(n) for j in range(i + 1, n)]
    edges: list[dict] = []
    if pairs:
        chosen = draw(st.lists(st.sampled_from(pairs), max_size=3 * n))
        size: dict[tuple[str, int], int] = {}
        seen: set[tuple[str, str, int]] = set()
        for u, v in chosen:
            t = draw(st.integers(0, 2))
            if (u, v, t) in seen:
                continue
            seen.add((u, v, t))
            b = size.setdefault((u, t), draw(st.sampled_from([0, 8, 4096, 10**9])))
            rec = {"src": u, "dst": v, "bytes": b}
            if t or draw(st.booleans()):
                rec["tensor"] = t
            if draw(st.booleans()):
                rec["note"] = draw(st.text(max_size=5))
            edges.append(rec)
    return nodes, edges


def reference_topo(nodes: list[dict], edges: list[dict]) -> list[str]:
    """DESIGN.md sections 4 and 6 written out: Kahn, FIFO, sources in insertion order, each distinct
    successor once at the position of its first edge."""
    ids = [n["id"] for n in nodes]
    succ: dict[str, list[str]] = {i: [] for i in ids}
    for e in edges:
        if e["dst"] not in succ[e["src"]]:
            succ[e["src"]].append(e["dst"])
    indeg = {i: sum(i in s for s in succ.values()) for i in ids}
    queue = deque(i for i in ids if indeg[i] == 0)
    out = []
    while queue:
        u = queue.popleft()
        out.append(u)
        for w in succ[u]:
            indeg[w] -= 1
            if indeg[w] == 0:
                queue.append(w)
    return out


# ----------------------------------------------------------------------------- building


def test_build_from_records_keeps_every_field() -> None:
    nodes = [
        {"id": "conv1", "op": "aten.convolution", "compute_s": 0.00123, "output_bytes": 102760448,
         "param_bytes": 37632, "temp_bytes": 5, "group": "conv1", "kind": "forward", "flops": 118013952,
         "module": "model.conv1"},
        {"id": "bn1"},
    ]
    edges = [edge("conv1", "bn1", 102760448, mem_access_bytes=7)]
    g = build(nodes, edges, name="resnet", source="torch.fx")
    assert g.name == "resnet" and g.num_nodes == 2 and g.num_edges == 1
    assert g.ids == ("conv1", "bn1")
    assert g.index == {"conv1": 0, "bn1": 1}
    assert g.op == ("aten.convolution", "") and g.group == ("conv1", "") and g.kind == ("forward", "")
    assert g.compute_s.tolist() == [0.00123, 0.0]
    assert g.output_bytes.tolist() == [102760448, 0]
    assert g.param_bytes.tolist() == [37632, 0]
    assert g.temp_bytes.tolist() == [5, 0]
    assert g.node_extra == ({"flops": 118013952, "module": "model.conv1"}, {})
    assert g.edge_src.tolist() == [0] and g.edge_dst.tolist() == [1]
    assert g.edge_bytes.tolist() == [102760448] and g.edge_tensor.tolist() == [0]
    assert g.edge_extra == ({"mem_access_bytes": 7},)
    assert g.meta == {"source": "torch.fx"}
    for arr, dtype in ((g.compute_s, np.float64), (g.output_bytes, np.float64), (g.edge_bytes, np.float64),
                       (g.edge_src, np.int64), (g.edge_dst, np.int64), (g.edge_tensor, np.int64),
                       (g.succ_ptr, np.int64), (g.succ_edges, np.int64), (g.pred_ptr, np.int64),
                       (g.pred_edges, np.int64)):
        assert arr.dtype == dtype
        assert not arr.flags.writeable  # the graph is immutable
    assert "resnet" in repr(g)


def test_defaults_missing_bytes_and_tensor_are_zero() -> None:
    g = build(nodes_of("a", "b"), [{"src": "a", "dst": "b"}])
    assert g.edge_bytes.tolist() == [0.0] and g.edge_tensor.tolist() == [0]
    assert g.compute_s.tolist() == [0.0, 0.0]


def test_empty_graph() -> None:
    g = build([], [])
    assert g.num_nodes == 0 and g.num_edges == 0
    assert g.topo_order.tolist() == [] and g.succ_ptr.tolist() == [0]


def test_numpy_scalars_are_numbers() -> None:
    g = build([{"id": "a", "compute_s": np.float32(0.5), "output_bytes": np.int64(8)}, {"id": "b"}],
              [edge("a", "b", np.int64(8), np.int64(1))])
    assert g.compute_s[0] == 0.5 and g.output_bytes[0] == 8 and g.edge_tensor.tolist() == [1]


def test_insertion_order_and_edge_order_are_kept() -> None:
    # ids deliberately not sorted, edges deliberately not grouped by src or dst
    g = build(nodes_of("z", "a", "m", "b"),
              [edge("a", "b", 1), edge("z", "m", 2), edge("a", "m", 3, 1), edge("z", "b", 4, 1), edge("m", "b", 5)])
    assert g.ids == ("z", "a", "m", "b")
    assert ids_of(g, g.edge_src) == ["a", "z", "a", "z", "m"]
    assert ids_of(g, g.edge_dst) == ["b", "m", "m", "b", "b"]
    assert g.edge_bytes.tolist() == [1, 2, 3, 4, 5]
    assert g.out_edges(g.index["z"]).tolist() == [1, 3]
    assert g.out_edges(g.index["a"]).tolist() == [0, 2]
    assert g.out_edges(g.index["b"]).tolist() == []
    assert g.in_edges(g.index["b"]).tolist() == [0, 3, 4]
    assert g.in_edges(g.index["m"]).tolist() == [1, 2]
    assert g.succ_ptr.tolist() == [0, 2, 4, 5, 5]
    assert g.pred_ptr.tolist() == [0, 0, 0, 2, 5]


def test_parallel_edges_successors_and_predecessors_distinct_in_first_edge_order() -> None:
    # u -> v carries two tensors; the second v edge comes after u -> w
    g = build(nodes_of("u", "v", "w", "x"),
              [edge("u", "v", 10, 0), edge("u", "w", 5, 2), edge("u", "v", 20, 1), edge("x", "v", 1),
               edge("w", "v", 0, 3)])
    u, v, w, x = (g.index[k] for k in "uvwx")
    assert g.out_edges(u).tolist() == [0, 1, 2]  # edges keep their multiplicity
    assert g.in_edges(v).tolist() == [0, 2, 3, 4]
    assert g.successors(u) == [v, w]
    assert g.predecessors(v) == [u, x, w]
    assert g.successors(v) == [] and g.predecessors(u) == []
    assert g.successors(w) == [v] and g.successors(x) == [v]


@settings(max_examples=150, deadline=None)
@given(dags())
def test_csr_slices_are_the_edges_in_edge_order(recs: tuple[list[dict], list[dict]]) -> None:
    nodes, edges = recs
    g = build(nodes, edges)
    assert list(g.ids) == [n["id"] for n in nodes]
    assert ids_of(g, g.edge_src) == [e["src"] for e in edges]
    assert ids_of(g, g.edge_dst) == [e["dst"] for e in edges]
    assert g.edge_tensor.tolist() == [e.get("tensor", 0) for e in edges]
    assert g.edge_bytes.tolist() == [e["bytes"] for e in edges]
    for v, nid in enumerate(g.ids):
        assert g.out_edges(v).tolist() == [k for k, e in enumerate(edges) if e["src"] == nid]
        assert g.in_edges(v).tolist() == [k for k, e in enumerate(edges) if e["dst"] == nid]
        assert ids_of(g, g.successors(v)) == list(dict.fromkeys(e["dst"] for e in edges if e["src"] == nid))
        assert ids_of(g, g.predecessors(v)) == list(dict.fromkeys(e["src"] for e in edges if e["dst"] == nid))


# ----------------------------------------------------------------------------- canonical order


def test_topo_order_diamond_follows_edge_order_not_ids() -> None:
    g = build(nodes_of("a", "b", "c", "d"), [edge("a", "c"), edge("a", "b"), edge("b", "d"), edge("c", "d")])
    assert ids_of(g, g.topo_order) == ["a", "c", "b", "d"]


def test_topo_order_sources_in_insertion_order_fifo() -> None:
    # insertion order: c q p b a z; sources q and p; c is not a source although it is inserted first
    g = build(nodes_of("c", "q", "p", "b", "a", "z"),
              [edge("p", "b"), edge("p", "c"), edge("b", "a"), edge("q", "a"), edge("c", "z"), edge("a", "z")])
    # queue [q p]; q: a 2->1; p: b, c ready; b: a ready; c: z 2->1; a: z ready
    assert ids_of(g, g.topo_order) == ["q", "p", "b", "c", "a", "z"]
    assert ids_of(g, canonical_topo_order(g)) == ["q", "p", "b", "c", "a", "z"]


def test_topo_order_fifo_not_lifo() -> None:
    # a LIFO stack would give s x y a b; FIFO gives breadth first among ready nodes
    g = build(nodes_of("s", "a", "b", "x", "y"), [edge("s", "a"), edge("s", "x"), edge("a", "b"), edge("x", "y")])
    assert ids_of(g, g.topo_order) == ["s", "a", "x", "b", "y"]


def test_topo_order_parallel_edges_count_once_at_first_edge() -> None:
    # u -> w (t0), u -> x, u -> w (t1): w is u's first distinct successor, so it comes before x
    g = build(nodes_of("u", "x", "w"), [edge("u", "w", 1, 0), edge("u", "x", 1), edge("u", "w", 2, 1)])
    assert ids_of(g, g.topo_order) == ["u", "w", "x"]
    # with another predecessor: w needs u and y; its in-degree is 2 distinct predecessors, not 3 edges
    g = build(nodes_of("u", "y", "w", "x"),
              [edge("u", "w", 1, 0), edge("u", "w", 2, 1), edge("y", "w", 3), edge("u", "x", 4, 2)])
    assert ids_of(g, g.topo_order) == ["u", "y", "x", "w"]


def test_topo_rank_is_the_inverse_permutation() -> None:
    g = build(nodes_of("c", "b", "a"), [edge("a", "b"), edge("b", "c")])
    assert ids_of(g, g.topo_order) == ["a", "b", "c"]
    assert g.topo_rank.tolist() == [2, 1, 0]
    assert not g.topo_rank.flags.writeable


@settings(max_examples=200, deadline=None)
@given(dags())
def test_topo_order_matches_the_definition(recs: tuple[list[dict], list[dict]]) -> None:
    nodes, edges = recs
    g = build(nodes, edges)
    order = g.topo_order.tolist()
    assert sorted(order) == list(range(g.num_nodes))
    assert ids_of(g, order) == reference_topo(nodes, edges)
    rank = g.topo_rank
    assert all(rank[s] < rank[d] for s, d in zip(g.edge_src.tolist(), g.edge_dst.tolist(), strict=True))


def test_long_chain_builds_without_recursion() -> None:
    n = 100_000
    nodes = [{"id": f"op{i}", "compute_s": 1e-6, "output_bytes": 4} for i in range(n)]
    edges = [{"src": f"op{i}", "dst": f"op{i + 1}", "bytes": 4} for i in range(n - 1)]
    g = build(nodes, edges)
    assert g.num_nodes == n and g.num_edges == n - 1
    assert np.array_equal(g.topo_order, np.arange(n))
    assert g.successors(n - 2) == [n - 1]
    # the same chain closed into one big cycle: the error still comes back, naming the cycle
    edges.append({"src": f"op{n - 1}", "dst": "op0", "bytes": 4})
    with pytest.raises(GraphError, match="cycle") as info:
        build(nodes, edges)
    assert_is_cycle(cycle_in(str(info.value)), edges)
    assert len(cycle_in(str(info.value))) == n + 1


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_keeps_every_field(tmp_path: Path) -> None:
    nodes = [
        {"id": "conv1", "op": "aten.convolution", "compute_s": 0.00123, "output_bytes": 102760448,
         "param_bytes": 37632, "temp_bytes": 7, "group": "conv1", "kind": "forward", "flops": 118013952,
         "module": "model.conv1", "shape": [32, 64, 112, 112]},
        {"id": "bn1", "compute_s": 2.5e-4, "output_bytes": 102760448, "kind": "forward"},
        {"id": "loss", "mem_access_bytes": 12.5},
    ]
    edges = [edge("conv1", "bn1", 102760448), edge("conv1", "loss", 16, 1, dtype="float32"),
             edge("bn1", "loss", 0, 2)]
    path = write_doc(tmp_path / "in.json", graph_doc(nodes, edges, producer={"tool": "fx", "version": 2},
                                                     batch=32))
    g = load_graph(path)
    assert g.name == "g" and g.meta == {"producer": {"tool": "fx", "version": 2}, "batch": 32}
    out = tmp_path / "out.json"
    save_graph(g, out)
    doc = json.loads(out.read_text())
    assert doc["format"] == "devplace.graph/1" and doc["name"] == "g"
    assert doc["producer"] == {"tool": "fx", "version": 2} and doc["batch"] == 32
    assert doc["nodes"] == nodes  # every key and value, in node order
    assert doc["edges"] == [{**e, "tensor": e.get("tensor", 0)} if e.get("tensor") else e for e in edges]
    # integers stay integers in the file (no 102760448.0), floats stay floats
    n0 = doc["nodes"][0]
    for key in ("output_bytes", "param_bytes", "temp_bytes", "flops"):
        assert type(n0[key]) is int
    assert type(n0["compute_s"]) is float
    assert all(type(e["bytes"]) is int for e in doc["edges"])
    assert type(doc["edges"][1]["tensor"]) is int
    assert '"output_bytes": 102760448,' in out.read_text()
    # and loading the saved file gives the same graph
    h = load_graph(out)
    assert_same_graph(g, h)
    # saving is stable: the same graph gives the same bytes
    out2 = tmp_path / "out2.json"
    save_graph(h, out2)
    assert out2.read_bytes() == out.read_bytes()


def test_name_defaults_to_file_stem(tmp_path: Path) -> None:
    doc = graph_doc(nodes_of("a"), [])
    del doc["name"]
    assert load_graph(write_doc(tmp_path / "mlp.json", doc)).name == "mlp"
    assert load_graph(write_doc(tmp_path / "x.json", {"format": "devplace.graph/1", "nodes": []})).num_edges == 0


def assert_same_graph(g: CompGraph, h: CompGraph) -> None:
    assert (g.name, g.ids, g.op, g.kind, g.group) == (h.name, h.ids, h.op, h.kind, h.group)
    for k in ("compute_s", "output_bytes", "param_bytes", "temp_bytes", "edge_src", "edge_dst", "edge_bytes",
              "edge_tensor", "succ_ptr", "succ_edges", "pred_ptr", "pred_edges", "topo_order"):
        assert np.array_equal(getattr(g, k), getattr(h, k)), k
    assert g.node_extra == h.node_extra and g.edge_extra == h.edge_extra and g.meta == h.meta
    assert g.to_dict() == h.to_dict()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dags(min_nodes=0))
def test_round_trip_random_graphs(tmp_path: Path, recs: tuple[list[dict], list[dict]]) -> None:
    nodes, edges = recs
    g = build(nodes, edges, name="rand", seed=3)
    path = tmp_path / "rand.json"
    save_graph(g, path)
    h = load_graph(path)
    assert_same_graph(g, h)
    # every extra key of every record survives with its value and type
    doc = json.loads(path.read_text())
    for rec, saved in zip(nodes, doc["nodes"], strict=True):
        for k, val in rec.items():
            if k in NUMERIC:
                assert saved.get(k, 0) == val
                if isinstance(val, int):
                    assert type(saved.get(k, 0)) is int
            elif val != "":
                assert saved[k] == val and type(saved[k]) is type(val)
    for rec, saved in zip(edges, doc["edges"], strict=True):
        assert {**rec, "tensor": rec.get("tensor", 0)} == {**saved, "tensor": saved.get("tensor", 0)}


# ----------------------------------------------------------------------------- networkx


def test_to_networkx_is_a_multidigraph_with_every_attribute() -> None:
    g = build([{"id": "a", "op": "aten.mm", "compute_s": 0.5, "output_bytes": 64, "flops": 10},
               {"id": "b", "module": "m.b"}, {"id": "c"}],
              [edge("a", "b", 64, 0), edge("a", "b", 32, 1, note="x"), edge("b", "c", 0)], name="nx", seed=1)
    x = g.to_networkx()
    assert isinstance(x, nx.MultiDiGraph)
    assert x.graph == {"name": "nx", "seed": 1}
    assert list(x.nodes) == ["a", "b", "c"]  # insertion order
    assert x.nodes["a"] == {"op": "aten.mm", "kind": "", "group": "", "compute_s": 0.5, "output_bytes": 64,
                            "param_bytes": 0, "temp_bytes": 0, "flops": 10}
    assert x.nodes["b"]["module"] == "m.b" and x.nodes["b"]["compute_s"] == 0
    assert list(x.edges(keys=True, data=True)) == [
        ("a", "b", 0, {"bytes": 64, "tensor": 0}),
        ("a", "b", 1, {"bytes": 32, "tensor": 1, "note": "x"}),
        ("b", "c", 0, {"bytes": 0, "tensor": 0}),
    ]
    assert x.number_of_edges("a", "b") == 2


@settings(max_examples=80, deadline=None)
@given(dags(min_nodes=0))
def test_to_networkx_same_nodes_and_edges(recs: tuple[list[dict], list[dict]]) -> None:
    nodes, edges = recs
    g = build(nodes, edges)
    x = g.to_networkx()
    assert list(x.nodes) == list(g.ids)
    assert x.number_of_edges() == g.num_edges
    got = sorted((u, v, k, d["bytes"]) for u, v, k, d in x.edges(keys=True, data=True))
    want = sorted((e["src"], e["dst"], e.get("tensor", 0), e["bytes"]) for e in edges)
    assert got == want
    for rec in nodes:
        for k, val in rec.items():
            if k != "id":
                assert x.nodes[rec["id"]][k] == val
    assert nx.is_directed_acyclic_graph(x)


# ----------------------------------------------------------------------------- validation errors


def raises(exc: type[DevplaceError], nodes: list, edges: list) -> str:
    with pytest.raises(exc) as info:
        build(nodes, edges)
    assert isinstance(info.value, DevplaceError)
    return str(info.value)


def cycle_in(message: str) -> list[str]:
    m = re.search(r"cycle: (.*?); ", message)
    assert m, message
    return m.group(1).split(" -> ")


def assert_is_cycle(cyc: list[str], edges: list[dict]) -> None:
    pairs = {(e["src"], e["dst"]) for e in edges}
    assert len(cyc) >= 3 and cyc[0] == cyc[-1]
    assert len(set(cyc[:-1])) == len(cyc) - 1  # a simple cycle
    for a, b in itertools.pairwise(cyc):
        assert (a, b) in pairs, (a, b, cyc)


def test_cycle_names_its_nodes_in_order() -> None:
    nodes = nodes_of("s", "a", "b", "c", "t")
    edges = [edge("s", "a"), edge("a", "b"), edge("b", "c"), edge("c", "a"), edge("c", "t")]
    msg = raises(GraphError, nodes, edges)
    assert "cycle" in msg and "'t'" in msg  # the graph's name
    cyc = cycle_in(msg)
    assert_is_cycle(cyc, edges)
    assert sorted(cyc[:-1]) == ["a", "b", "c"]


def test_two_node_cycle_through_parallel_edges() -> None:
    edges = [edge("a", "b", 1, 0), edge("a", "b", 2, 1), edge("b", "a", 3)]
    cyc = cycle_in(raises(GraphError, nodes_of("a", "b"), edges))
    assert_is_cycle(cyc, edges)
    assert sorted(cyc[:-1]) == ["a", "b"]


@settings(max_examples=200, deadline=None)
@given(dags(min_nodes=2), st.data())
def test_injected_back_edge_reports_a_real_cycle(recs: tuple[list[dict], list[dict]], data: st.DataObject) -> None:
    nodes, edges = recs
    x = nx.MultiDiGraph()
    x.add_nodes_from(n["id"] for n in nodes)
    x.add_edges_from((e["src"], e["dst"]) for e in edges)
    reach = [(a, b) for a in x for b in nx.descendants(x, a)]
    if not reach:  # no path to close: add one first
        a, b = nodes[0]["id"], nodes[1]["id"]
        edges = [*edges, {"src": a, "dst": b, "bytes": 0, "tensor": 97}]
        reach = [(a, b)]
    a, b = data.draw(st.sampled_from(reach))
    pos = data.draw(st.integers(0, len(edges)))
    bad = [*edges[:pos], {"src": b, "dst": a, "bytes": 0, "tensor": 98}, *edges[pos:]]
    msg = raises(GraphError, nodes, bad)
    assert_is_cycle(cycle_in(msg), bad)


def test_self_loop() -> None:
    msg = raises(GraphError, nodes_of("a", "b"), [edge("a", "b"), edge("b", "b")])
    assert "self-loop" in msg and "edge #1" in msg and "'b' -> 'b'" in msg


def test_duplicate_ids() -> None:
    msg = raises(GraphError, nodes_of("a", "b", "a"), [])
    assert "duplicate node id 'a'" in msg and "#0" in msg and "#2" in msg


@pytest.mark.parametrize("end", ["src", "dst"])
def test_edge_to_unknown_node(end: str) -> None:
    rec = edge("a", "b")
    rec[end] = "ghost"
    msg = raises(GraphError, nodes_of("a", "b"), [edge("a", "b", 0, 1), rec])
    assert "edge #1" in msg and "unknown node 'ghost'" in msg and f'"{end}"' in msg


@pytest.mark.parametrize("end", ["src", "dst"])
@pytest.mark.parametrize("value", [None, 3, ["a"], {"id": "a"}])
def test_edge_end_missing_or_not_a_string(end: str, value: Any) -> None:
    rec = edge("a", "b")
    if value is None:
        del rec[end]
    else:
        rec[end] = value
    msg = raises(GraphError, nodes_of("a", "b"), [rec])
    assert "edge #0" in msg and f'"{end}"' in msg
    if value is None:
        assert "missing" in msg


@pytest.mark.parametrize("bad_id", [None, "", 7, ["x"]])
def test_missing_or_bad_node_id(bad_id: Any) -> None:
    rec: dict[str, Any] = {"compute_s": 1} if bad_id is None else {"id": bad_id}
    msg = raises(GraphError, [{"id": "a"}, rec], [])
    assert "node #1" in msg and '"id"' in msg


def test_node_not_an_object() -> None:
    assert "node #1" in raises(GraphError, [{"id": "a"}, "b"], [])
    assert "edge #0" in raises(GraphError, nodes_of("a", "b"), [["a", "b"]])


@pytest.mark.parametrize("field", ["op", "group", "kind"])
def test_text_field_must_be_a_string(field: str) -> None:
    msg = raises(GraphError, [{"id": "a"}, {"id": "b", field: 3}], [])
    assert "'b'" in msg and f'"{field}"' in msg


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_bad_node_number(field: str, value: Any) -> None:
    msg = raises(GraphError, [{"id": "a"}, {"id": "b", field: value}], [])
    assert "node 'b'" in msg and f'"{field}"' in msg


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_bad_edge_bytes(value: Any) -> None:
    msg = raises(GraphError, nodes_of("a", "b", "c"), [edge("a", "b", 1), edge("b", "c", value)])
    assert "edge #1" in msg and "'b' -> 'c'" in msg and '"bytes"' in msg


def test_number_messages_say_what_is_wrong() -> None:
    assert ">= 0" in raises(GraphError, [{"id": "a", "compute_s": -1}], [])
    assert "finite" in raises(GraphError, [{"id": "a", "compute_s": math.nan}], [])
    assert "finite" in raises(GraphError, [{"id": "a", "compute_s": math.inf}], [])
    assert "must be a number" in raises(GraphError, [{"id": "a", "compute_s": "1"}], [])
    assert "must be a number" in raises(GraphError, [{"id": "a", "compute_s": True}], [])
    assert "too large" in raises(GraphError, [{"id": "a", "output_bytes": 10**400}], [])


@pytest.mark.parametrize("tensor", [-1, 1.5, 1.0, "0", True, None, 2**63])
def test_bad_tensor(tensor: Any) -> None:
    msg = raises(GraphError, nodes_of("a", "b"), [{"src": "a", "dst": "b", "bytes": 1, "tensor": tensor}])
    assert "edge #0" in msg and '"tensor"' in msg and "integer" in msg


def test_one_tensor_one_size() -> None:
    edges = [edge("a", "b", 100, 1), edge("a", "c", 100, 0), edge("a", "c", 8, 1)]
    msg = raises(GraphError, nodes_of("a", "b", "c"), edges)
    assert "edge #2" in msg and "tensor 1 of 'a'" in msg and "8" in msg and "100" in msg and "edge #0" in msg
    # a 0-byte control edge on a data tensor is the same mistake
    assert "tensor 0" in raises(GraphError, nodes_of("a", "b", "c"), [edge("a", "b", 64), edge("a", "c", 0)])
    # different tensors, or the same tensor index of different sources, may differ
    build(nodes_of("a", "b", "c"), [edge("a", "b", 64), edge("a", "c", 0, 1), edge("b", "c", 5)])


def test_duplicate_edge() -> None:
    msg = raises(GraphError, nodes_of("a", "b"), [edge("a", "b", 4, 2), edge("a", "b", 4, 2)])
    assert "edge #1" in msg and "duplicate of edge #0" in msg and "tensor 2" in msg
    # the default tensor is 0, written or not
    assert "duplicate" in raises(GraphError, nodes_of("a", "b"), [edge("a", "b", 4), edge("a", "b", 4, 0)])


def test_meta_may_not_shadow_document_keys() -> None:
    with pytest.raises(GraphError, match="format"):
        CompGraph.build("g", [], [], meta={"format": "x"})


# ----------------------------------------------------------------------------- file errors


def load_error(path: Path, exc: type[DevplaceError] = GraphError) -> str:
    with pytest.raises(exc) as info:
        load_graph(path)
    assert isinstance(info.value, DevplaceError)
    msg = str(info.value)
    assert str(path) in msg  # every load error names the file
    return msg


def test_build_errors_name_the_file(tmp_path: Path) -> None:
    msg = load_error(write_doc(tmp_path / "g.json", graph_doc(nodes_of("a", "a"), [])))
    assert "duplicate node id 'a'" in msg
    doc = graph_doc(nodes_of("a", "b"), [edge("a", "b"), edge("b", "a", 0, 1)])
    msg = load_error(write_doc(tmp_path / "c.json", doc))
    assert "cycle" in msg


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("where", ["compute_s", "output_bytes", "bytes"])
def test_nan_and_infinity_literals_are_rejected(tmp_path: Path, literal: str, where: str) -> None:
    # strict JSON cannot hold them, but Python's json module reads them: load_graph must still refuse
    node_b = f'"{where}": {literal}, ' if where != "bytes" else ""
    edge_bytes = literal if where == "bytes" else "4"
    text = ('{"format": "devplace.graph/1", "nodes": [{"id": "a"}, {' + node_b + '"id": "b"}],\n'
            ' "edges": [{"src": "a", "dst": "b", "bytes": ' + edge_bytes + '}]}\n')
    path = tmp_path / "nan.json"
    path.write_text(text)
    msg = load_error(path)
    assert f'"{where}"' in msg and ("'b'" in msg)


@pytest.mark.parametrize("fmt", ["devplace.graph/2", "devplace.graph/1.1", "devplace.graph/0"])
def test_unknown_format_version(tmp_path: Path, fmt: str) -> None:
    doc = {**graph_doc(nodes_of("a"), []), "format": fmt}
    msg = load_error(write_doc(tmp_path / "v.json", doc), FormatError)
    assert "unknown version" in msg and fmt in msg and "reads 'devplace.graph/1'" in msg


@pytest.mark.parametrize("fmt", ["devplace.cluster/1", "devplace.placement/1", "onnx", 1])
def test_wrong_format_family(tmp_path: Path, fmt: Any) -> None:
    doc = {**graph_doc(nodes_of("a"), []), "format": fmt}
    msg = load_error(write_doc(tmp_path / "f.json", doc), FormatError)
    assert repr(fmt) in msg and "devplace.graph/1" in msg


def test_missing_format(tmp_path: Path) -> None:
    msg = load_error(write_doc(tmp_path / "m.json", {"nodes": [], "edges": []}), FormatError)
    assert 'missing "format"' in msg and "devplace.graph/1" in msg


@pytest.mark.parametrize("doc", [[], "graph", 3, None])
def test_top_level_not_an_object(tmp_path: Path, doc: Any) -> None:
    msg = load_error(write_doc(tmp_path / "top.json", doc), FormatError)
    assert "JSON object" in msg


@pytest.mark.parametrize(("text", "line", "col"), [
    ('{"format": "devplace.graph/1",\n "nodes": [,]\n}\n', 2, 12),
    ('{"format": "devplace.graph/1",\n "nodes": [{"id": "a"}]\n "edges": []}\n', 3, 2),
    ('{"format": "devplace.graph/1", "nodes": [\n', 2, 1),
    ("", 1, 1),
])
def test_malformed_json_names_file_line_and_column(tmp_path: Path, text: str, line: int, col: int) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    msg = load_error(path, FormatError)
    assert msg.startswith(f"{path}:{line}:{col}: malformed JSON")


def test_duplicate_json_key_is_not_silently_dropped(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"format": "devplace.graph/1", "nodes": [{"id": "a", "compute_s": 1, "compute_s": 2}]}')
    msg = load_error(path, FormatError)
    assert "'compute_s'" in msg and "twice" in msg and "'a'" in msg


def test_json_edge_cases_are_format_errors(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    load_error(path, FormatError)
    path = tmp_path / "digits.json"
    path.write_text('{"format": "devplace.graph/1", "nodes": [{"id": "a", "output_bytes": ' + "9" * 5000 + "}]}")
    load_error(path, FormatError)
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"format": "devplace.graph/1", "name": "\xe9", "nodes": []}')
    load_error(path, FormatError)


def test_file_not_found(tmp_path: Path) -> None:
    msg = load_error(tmp_path / "nope.json", FormatError)
    assert "no such file" in msg
    load_error(tmp_path, FormatError)  # a directory


@pytest.mark.parametrize(("key", "value"), [("nodes", {"a": {}}), ("nodes", None), ("nodes", "a"),
                                            ("edges", {}), ("edges", None), ("edges", 3)])
def test_nodes_and_edges_must_be_lists(tmp_path: Path, key: str, value: Any) -> None:
    doc = graph_doc(nodes_of("a"), [])
    doc[key] = value
    msg = load_error(write_doc(tmp_path / "l.json", doc))
    assert f'"{key}"' in msg and "list" in msg


def test_missing_nodes(tmp_path: Path) -> None:
    msg = load_error(write_doc(tmp_path / "n.json", {"format": "devplace.graph/1", "edges": []}))
    assert '"nodes"' in msg and "missing" in msg


def test_name_must_be_a_string(tmp_path: Path) -> None:
    assert '"name"' in load_error(write_doc(tmp_path / "n.json", graph_doc([], [], name=5)))


# ----------------------------------------------------------------------------- placement


def small_graph() -> CompGraph:
    return build(nodes_of("a", "b", "c"), [edge("a", "b"), edge("b", "c")], name="small")


def test_placement_round_trip(tmp_path: Path) -> None:
    p = Placement({"a": 0, "b": 1, "c": 1}, graph="small", cluster="2xK80", meta={"step_time_s": 1.5},
                  schedule=Schedule("gpipe", 2), made_by=MadeBy("greedy", "topo", 3))
    path = tmp_path / "p.json"
    save_placement(p, path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "devplace.placement/1"
    assert doc["assignment"] == {"a": 0, "b": 1, "c": 1}
    assert (doc["placer"], doc["order"], doc["seed"], doc["step_time_s"]) == ("greedy", "topo", 3, 1.5)
    assert doc["schedule"] == Schedule("gpipe", 2).to_dict()
    q = load_placement(path)
    assert q == p
    assert q.to_array(small_graph(), 2).tolist() == [0, 1, 1]


def test_placement_from_array() -> None:
    g = small_graph()
    p = Placement.from_array(g, np.array([1, 0, 1]), cluster="c")
    assert p.assignment == {"a": 1, "b": 0, "c": 1} and p.graph == "small" and p.cluster == "c"
    assert Placement.from_array(g, [0, 0, 1]).to_array(g, 2).tolist() == [0, 0, 1]
    with pytest.raises(PlacementError, match="expected 3 device indices"):
        Placement.from_array(g, [0, 1])
    for bad in ([0, 1.5, 1], [True, False, True], np.array([0.0, 1.0, 1.0]), ["0", "1", "1"]):
        with pytest.raises(PlacementError, match="integers"):
            Placement.from_array(g, bad)


def test_placement_to_array_errors() -> None:
    g = small_graph()
    with pytest.raises(PlacementError) as info:
        Placement({"a": 0, "c": 1}).to_array(g, 2)
    assert "'b'" in str(info.value) and "1 node" in str(info.value)
    with pytest.raises(PlacementError) as info:
        Placement({"a": 0, "b": 0, "c": 0, "zz": 1}).to_array(g, 2)
    assert "'zz'" in str(info.value) and "'small'" in str(info.value)
    for d in (2, -1, 7):
        with pytest.raises(PlacementError) as info:
            Placement({"a": 0, "b": d, "c": 1}).to_array(g, 2)
        assert "'b'" in str(info.value) and str(d) in str(info.value) and "0..1" in str(info.value)
    for d in (True, 1.0, "1"):
        with pytest.raises(PlacementError, match="'b'"):
            Placement({"a": 0, "b": d, "c": 1}).to_array(g, 2)  # type: ignore[dict-item]
    assert Placement({"a": np.int64(1), "b": 0, "c": 0}).to_array(g, 2).tolist() == [1, 0, 0]  # type: ignore[dict-item]


@pytest.mark.parametrize("device", [1.0, 1.5, "1", True, None, [1]])
def test_load_placement_rejects_non_integer_devices(tmp_path: Path, device: Any) -> None:
    path = write_doc(tmp_path / "p.json", {"format": "devplace.placement/1", "assignment": {"a": 0, "b": device}})
    with pytest.raises(PlacementError) as info:
        load_placement(path)
    assert str(path) in str(info.value) and "'b'" in str(info.value) and "integer" in str(info.value)


def test_load_placement_format_errors(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "p.json", {"format": "devplace.placement/2", "assignment": {}})
    with pytest.raises(FormatError, match=r"devplace\.placement/1"):
        load_placement(path)
    path = write_doc(tmp_path / "q.json", {"format": "devplace.placement/1", "assignment": [0, 1]})
    with pytest.raises(PlacementError, match="assignment"):
        load_placement(path)
    with pytest.raises(FormatError, match="no such file"):
        load_placement(tmp_path / "missing.json")


def test_runtime_placement_moves_backward_and_optimizer_ops_to_their_forward_op() -> None:
    from devplace.graph.placement import Placement, runtime_placement

    nodes = [{"id": "x", "op": "input", "kind": "forward"},
             {"id": "f", "compute_s": 1.0, "group": "f", "kind": "forward"},
             {"id": "loss", "compute_s": 1.0, "group": "loss", "kind": "forward"},
             {"id": "f.bwd", "compute_s": 1.0, "group": "f", "kind": "backward"},
             {"id": "f.adam", "compute_s": 1.0, "group": "f", "kind": "optimizer"},
             {"id": "free", "compute_s": 1.0, "kind": "backward"}]
    edges = [{"src": "x", "dst": "f", "bytes": 4}, {"src": "f", "dst": "loss", "bytes": 4},
             {"src": "loss", "dst": "f.bwd", "bytes": 4}, {"src": "f.bwd", "dst": "f.adam", "bytes": 4},
             {"src": "f.adam", "dst": "free", "bytes": 4}]
    g = CompGraph.build("rt", nodes, edges)
    p = Placement({"x": 0, "f": 1, "loss": 0, "f.bwd": 2, "f.adam": 0, "free": 2}, graph="rt")
    rp = runtime_placement(g, p)
    # backward/optimizer follow their group's forward op; the input goes with its consumer; no group: unchanged
    assert rp.assignment == {"x": 1, "f": 1, "loss": 0, "f.bwd": 1, "f.adam": 1, "free": 2}


def test_from_arrays_is_the_graph_build_makes_and_refuses_a_cycle() -> None:
    from devplace.zoo import layered_graph

    g = layered_graph(30, width=4, fan_in=2, seed=1)
    cols = dict(ids=g.ids, op=g.op, kind=g.kind, group=g.group, compute_s=g.compute_s, output_bytes=g.output_bytes,
                param_bytes=g.param_bytes, temp_bytes=g.temp_bytes, edge_src=g.edge_src, edge_dst=g.edge_dst,
                edge_bytes=g.edge_bytes, edge_tensor=g.edge_tensor)
    h = CompGraph.from_arrays(g.name, **cols)
    assert h.to_dict() == g.to_dict()
    for name in ("succ_ptr", "succ_edges", "pred_ptr", "pred_edges", "topo_order"):
        assert getattr(h, name).tolist() == getattr(g, name).tolist()
    back = dict(cols)  # plus an edge from the first edge's head back to its tail
    back["edge_src"] = np.concatenate([g.edge_src, [g.edge_dst[0]]])
    back["edge_dst"] = np.concatenate([g.edge_dst, [g.edge_src[0]]])
    back["edge_bytes"] = np.concatenate([g.edge_bytes, [0.0]])
    back["edge_tensor"] = np.concatenate([g.edge_tensor, [7]])
    with pytest.raises(GraphError, match="has a cycle"):
        CompGraph.from_arrays("cyclic", **back)
    with pytest.raises(GraphError, match="node columns must all have"):
        CompGraph.from_arrays("short", **{**cols, "op": g.op[:-1]})
    # extra edge keys are kept as build keeps them (a recomputed graph's edges carry the captured ones)
    extra = [{"dtype": "float32"} if e % 2 else {} for e in range(g.num_edges)]
    edges = [{**g.edge_record(e), **extra[e]} for e in range(g.num_edges)]
    built = CompGraph.build(g.name, [g.node_record(v) for v in range(g.num_nodes)], edges)
    assert CompGraph.from_arrays(g.name, **cols, edge_extra=extra).to_dict() == built.to_dict()
    with pytest.raises(GraphError, match="edge columns"):
        CompGraph.from_arrays("short", **cols, edge_extra=extra[:-1])

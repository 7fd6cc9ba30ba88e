"""Traversal orders (DESIGN.md section 6): hand examples, properties on random DAGs, networkx agreement."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.errors import DevplaceError
from devplace.graph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.orders import (
    ORDER_DEFINITIONS,
    ORDERS,
    TOPOLOGICAL_ORDERS,
    OrderError,
    OrderInput,
    bottom_levels,
    check_order,
    order_label,
    register_order,
    traversal_indices,
    traversal_order,
)
from devplace.orders import traversal as traversal

# ----------------------------------------------------------------------------- hand graphs


def two_source_graph() -> CompGraph:
    """Two sources (q, p), a non-source inserted first (c), parallel edges p -> b (tensors 0 and 1).

    Nodes in insertion order: c q p b a z.  Edges in order:
        e0 p->b (t0)  e1 p->c  e2 p->b (t1)  e3 b->a  e4 q->a  e5 c->z  e6 a->z
    Distinct successors: p [b, c]  b [a]  q [a]  c [z]  a [z]  z [].
    """
    nodes = [{"id": "c", "compute_s": 1}, {"id": "q", "compute_s": 2}, {"id": "p", "compute_s": 1},
             {"id": "b", "compute_s": 2}, {"id": "a", "compute_s": 3}, {"id": "z", "compute_s": 1}]
    edges = [{"src": "p", "dst": "b", "bytes": 10},
             {"src": "p", "dst": "c", "bytes": 10},
             {"src": "p", "dst": "b", "bytes": 40, "tensor": 1},
             {"src": "b", "dst": "a", "bytes": 20},
             {"src": "q", "dst": "a", "bytes": 0},
             {"src": "c", "dst": "z", "bytes": 100},
             {"src": "a", "dst": "z", "bytes": 0}]
    return CompGraph.build("two-source", nodes, edges)


# Derived on paper from the definitions (see the docstring above for the adjacency).
TWO_SOURCE_EXPECTED = {
    # queue [q p]; q: a 2->1; p: b, c ready; b: a ready; c: z 2->1; a: z ready
    "topo": ["q", "p", "b", "c", "a", "z"],
    # stack [q p]; pop p, push b c; pop c (z 2->1); pop b (a 2->1); pop q, push a; pop a, push z
    "topo-lifo": ["p", "c", "b", "q", "a", "z"],
    "reversed-topo": ["z", "a", "c", "b", "p", "q"],
    # from q: q a z; from p: p b (a seen) c (z seen)
    "dfs-preorder": ["q", "a", "z", "p", "b", "c"],
    "dfs-postorder": ["z", "a", "q", "b", "c", "p"],
    "reversed-dfs-postorder": ["p", "c", "b", "q", "a", "z"],
    # queue [q p]; q discovers a; p discovers b c; a discovers z
    "bfs": ["q", "p", "a", "b", "c", "z"],
    "lexicographic": ["a", "b", "c", "p", "q", "z"],
    # ready {p q} -> p; {b c q} -> b; {c q} -> c; {q} -> q; a; z
    "lexico-topo": ["p", "b", "c", "q", "a", "z"],
    # bottom levels (compute only): z 1, a 4, c 2, b 6, q 6, p 7; q and b tie -> topo puts q first
    "critical-path": ["p", "q", "b", "a", "c", "z"],
    # numpy Generator(PCG64(0)).permutation(6) = [3 2 5 4 0 1]
    "random": ["b", "p", "z", "a", "c", "q"],
}


def diamond_graph() -> CompGraph:
    """s -> {l, r} -> t, edges in order: s->l (t0), s->r, s->l (t1), r->t, l->t; inserted s r l t."""
    nodes = [{"id": "s", "compute_s": 1}, {"id": "r", "compute_s": 2}, {"id": "l", "compute_s": 1},
             {"id": "t", "compute_s": 1}]
    edges = [{"src": "s", "dst": "l", "bytes": 4}, {"src": "s", "dst": "r", "bytes": 4},
             {"src": "s", "dst": "l", "bytes": 8, "tensor": 1}, {"src": "r", "dst": "t", "bytes": 4},
             {"src": "l", "dst": "t", "bytes": 4}]
    return CompGraph.build("diamond", nodes, edges)


DIAMOND_EXPECTED = {
    "topo": ["s", "l", "r", "t"],  # l is at its first edge, before r
    "topo-lifo": ["s", "r", "l", "t"],  # push l, r; pop r (t 2->1); pop l (t ready)
    "reversed-topo": ["t", "r", "l", "s"],
    "dfs-preorder": ["s", "l", "t", "r"],
    "dfs-postorder": ["t", "l", "r", "s"],
    "reversed-dfs-postorder": ["s", "r", "l", "t"],
    "bfs": ["s", "l", "r", "t"],
    "lexicographic": ["l", "r", "s", "t"],
    "lexico-topo": ["s", "l", "r", "t"],
    "critical-path": ["s", "r", "l", "t"],  # bottom levels s 4, r 3, l 2, t 1
    "random": ["l", "s", "r", "t"],  # numpy Generator(PCG64(0)).permutation(4) = [2 0 1 3]
}


@pytest.mark.parametrize("name", ORDERS)
def test_two_source_hand_example(name: str) -> None:
    assert traversal_order(two_source_graph(), name) == TWO_SOURCE_EXPECTED[name]


@pytest.mark.parametrize("name", ORDERS)
def test_diamond_hand_example(name: str) -> None:
    assert traversal_order(diamond_graph(), name) == DIAMOND_EXPECTED[name]


def test_orders_tuple_is_designs_table() -> None:
    assert ORDERS == ("topo", "topo-lifo", "reversed-topo", "dfs-preorder", "dfs-postorder",
                      "reversed-dfs-postorder", "bfs", "lexicographic", "lexico-topo", "critical-path", "random")
    assert set(ORDER_DEFINITIONS) == set(ORDERS)
    assert set(TWO_SOURCE_EXPECTED) == set(DIAMOND_EXPECTED) == set(ORDERS)


def test_bottom_levels_compute_only() -> None:
    g = two_source_graph()
    got = dict(zip(g.ids, bottom_levels(g).tolist(), strict=True))
    assert got == {"c": 2.0, "q": 6.0, "p": 7.0, "b": 6.0, "a": 4.0, "z": 1.0}


def two_device_cluster() -> Cluster:
    """Speeds 1 and 3; 0->1: 10 B/s + 0.5 s; 1->0: 5 B/s + 1.5 s.

    HEFT averages: mean_d(1/speed) = 2/3; mean latency 1.0; mean 1/bandwidth = 0.15 s/B.
    """
    devs = (Device("g0", 1e9, 1.0), Device("g1", 1e9, 3.0))
    return Cluster("two", devs, Link(10.0, 0.5), {(1, 0): Link(5.0, 1.5)})


def test_critical_path_with_cluster_by_hand() -> None:
    g = two_source_graph()
    # t = compute * 2/3; c(e) = 1 + 0.15 * bytes; c(p, b) = (1 + 1.5) + (1 + 6) = 9.5 (both tensors)
    # z = 2/3; a = 2 + 1 + 2/3 = 11/3; c = 2/3 + 16 + 2/3 = 52/3; b = 4/3 + 4 + 11/3 = 9
    # q = 4/3 + 1 + 11/3 = 6; p = 2/3 + max(9.5 + 9, 2.5 + 52/3) = 20.5
    bl = dict(zip(g.ids, bottom_levels(g, two_device_cluster()).tolist(), strict=True))
    assert bl == pytest.approx({"c": 52 / 3, "q": 6.0, "p": 20.5, "b": 9.0, "a": 11 / 3, "z": 2 / 3})
    assert traversal_order(g, "critical-path", cluster=two_device_cluster()) == ["p", "c", "b", "q", "a", "z"]


def test_single_device_cluster_has_no_communication() -> None:
    g = two_source_graph()
    one = Cluster("one", (Device("g0", 1e9, 2.0),), Link(1.0, 100.0))
    assert bottom_levels(g, one) == pytest.approx(bottom_levels(g) / 2.0)
    assert traversal_order(g, "critical-path", cluster=one) == TWO_SOURCE_EXPECTED["critical-path"]


def test_cluster_and_seed_only_matter_where_documented() -> None:
    g = two_source_graph()
    for name in ORDERS:
        if name not in ("critical-path", "random"):
            assert traversal_order(g, name, 7, cluster=two_device_cluster()) == TWO_SOURCE_EXPECTED[name]


def test_topo_is_the_graphs_canonical_order_with_parallel_edges() -> None:
    g = diamond_graph()
    assert traversal_indices(g, "topo").tolist() == g.topo_order.tolist()


def test_empty_graph() -> None:
    g = CompGraph.build("empty", [], [])
    for name in ORDERS:
        assert traversal_order(g, name) == []
        assert traversal_indices(g, name).dtype == np.int64


# ----------------------------------------------------------------------------- errors


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(OrderError) as info:
        traversal_order(diamond_graph(), "depth-first")
    assert isinstance(info.value, DevplaceError)
    for name in ORDERS:
        assert name in str(info.value)


def test_near_miss_and_auto_messages() -> None:
    with pytest.raises(OrderError, match="did you mean 'reversed-topo'"):
        traversal_order(diamond_graph(), "reversed_topo")
    with pytest.raises(OrderError, match="not an order"):
        traversal_order(diamond_graph(), "auto")


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_random_rejects_bad_seed(seed: object) -> None:
    with pytest.raises(OrderError, match="seed"):
        traversal_order(diamond_graph(), "random", seed)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- random


def test_random_is_seed_deterministic_and_differs_across_seeds() -> None:
    g = chain(40)
    a = traversal_order(g, "random", 3)
    assert a == traversal_order(g, "random", 3)
    assert sorted(a) == sorted(g.ids)
    perms = {tuple(traversal_order(g, "random", s)) for s in range(10)}
    assert len(perms) == 10
    assert traversal_indices(g, "random", 5).tolist() == np.random.Generator(
        np.random.PCG64(5)).permutation(40).tolist()


# ----------------------------------------------------------------------------- 100k chain


def chain(n: int, reverse_insertion: bool = True) -> CompGraph:
    """v0 -> v1 -> ... -> v{n-1}; nodes inserted last-first so insertion order is anti-topological."""
    ids = [f"v{i}" for i in range(n)]
    nodes = [{"id": i, "compute_s": 1.0} for i in (reversed(ids) if reverse_insertion else ids)]
    return CompGraph.build("chain", nodes, [{"src": ids[i], "dst": ids[i + 1]} for i in range(n - 1)])


def test_100k_chain_without_recursion() -> None:
    n = 100_000
    g = chain(n)
    forward = [n - 1 - i for i in range(n)]  # node index of v0, v1, ... (inserted reversed)
    for name in ORDERS:
        idx = traversal_indices(g, name)
        assert sorted(idx.tolist()) == list(range(n)), name
        if name in TOPOLOGICAL_ORDERS or name in ("dfs-preorder", "bfs"):
            assert idx.tolist() == forward, name
        elif name in ("reversed-topo", "dfs-postorder"):
            assert idx.tolist() == forward[::-1], name


# ----------------------------------------------------------------------------- random DAGs


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 18) -> CompGraph:
    """A random DAG whose insertion order is not topological, with shuffled ids and parallel edges."""
    n = draw(st.integers(0, max_nodes))
    labels = draw(st.lists(st.integers(0, 999), min_size=n, max_size=n, unique=True))
    ids = [f"n{k}" for k in labels]  # string order differs from numeric and from insertion order
    hidden = draw(st.permutations(range(n)))  # hidden topological position of each node
    pairs = draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, max(n - 1, 0))),
                          max_size=3 * n)) if n > 1 else []
    edges = []
    tensors: dict[tuple[int, int], int] = {}
    for a, b in pairs:
        if a == b:
            continue
        u, v = (a, b) if hidden[a] < hidden[b] else (b, a)
        t = tensors.get((u, v), 0)  # a repeated pair becomes a parallel edge carrying another tensor
        tensors[(u, v)] = t + 1
        edges.append({"src": ids[u], "dst": ids[v], "tensor": t, "bytes": 8.0 * (u + 1) * (t + 1)})
    compute = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=n, max_size=n))
    nodes = [{"id": ids[i], "compute_s": compute[i]} for i in range(n)]
    return CompGraph.build("random", nodes, edges)


def positions(order: list[int]) -> dict[int, int]:
    return {v: i for i, v in enumerate(order)}


def is_topological(g: CompGraph, order: list[int]) -> bool:
    pos = positions(order)
    return all(pos[int(u)] < pos[int(v)] for u, v in zip(g.edge_src, g.edge_dst, strict=True))


def to_digraph(g: CompGraph, root: object | None = None) -> nx.DiGraph:
    """networkx DiGraph with nodes and edges inserted in the graph's order (parallel edges collapse, so
    each successor sits at its first edge). With `root`, a super-source with an edge to every source in
    insertion order, so that one walk from it visits the sources in insertion order."""
    d = nx.DiGraph()
    if root is not None:
        d.add_node(root)
    d.add_nodes_from(range(g.num_nodes))
    if root is not None:
        d.add_edges_from((root, v) for v in range(g.num_nodes) if g.pred_ptr[v] == g.pred_ptr[v + 1])
    d.add_edges_from(zip(g.edge_src.tolist(), g.edge_dst.tolist(), strict=True))
    return d


def nx23_topological_sort(d: nx.DiGraph) -> list[int]:
    """networkx 2.3's `topological_sort`, transcribed: Kahn with a list used as a stack."""
    indegree_map = {v: deg for v, deg in d.in_degree() if deg > 0}
    zero_indegree = [v for v, deg in d.in_degree() if deg == 0]
    out = []
    while zero_indegree:
        node = zero_indegree.pop()
        for _, child in d.edges(node):
            indegree_map[child] -= 1
            if indegree_map[child] == 0:
                zero_indegree.append(child)
                del indegree_map[child]
        out.append(node)
    return out


ROOT = ("root",)


@settings(max_examples=300, deadline=None)
@given(dags())
def test_every_order_is_a_permutation(g: CompGraph) -> None:
    for name in ORDERS:
        for seed in (0, 1):
            idx = traversal_indices(g, name, seed)
            assert idx.dtype == np.int64
            assert sorted(idx.tolist()) == list(range(g.num_nodes)), name
            assert traversal_order(g, name, seed) == [g.ids[v] for v in idx.tolist()]


@settings(max_examples=300, deadline=None)
@given(dags())
def test_topological_orders_are_topological(g: CompGraph) -> None:
    for name in TOPOLOGICAL_ORDERS:
        assert is_topological(g, traversal_indices(g, name).tolist()), name
    assert is_topological(g, traversal_indices(g, "reversed-topo").tolist()[::-1])
    assert {"topo", "topo-lifo", "reversed-dfs-postorder", "lexico-topo", "critical-path"} == TOPOLOGICAL_ORDERS


@settings(max_examples=300, deadline=None)
@given(dags())
def test_orders_match_networkx(g: CompGraph) -> None:
    d = to_digraph(g)
    r = to_digraph(g, ROOT)

    def idx(name: str) -> list[int]:
        return traversal_indices(g, name).tolist()  # type: ignore[no-any-return]

    # networkx 3's topological_sort is Kahn by generations = FIFO Kahn
    assert idx("topo") == list(nx.topological_sort(d))
    assert idx("reversed-topo") == idx("topo")[::-1]
    assert idx("topo-lifo") == nx23_topological_sort(d)
    assert idx("dfs-preorder") == list(nx.dfs_preorder_nodes(r, ROOT))[1:]
    assert idx("dfs-postorder") == list(nx.dfs_postorder_nodes(r, ROOT))[:-1]
    assert idx("reversed-dfs-postorder") == idx("dfs-postorder")[::-1]
    assert idx("bfs") == [v for _, v in nx.bfs_edges(r, ROOT)]
    ids = g.ids
    assert idx("lexicographic") == sorted(range(g.num_nodes), key=ids.__getitem__)
    assert idx("lexico-topo") == list(nx.lexicographical_topological_sort(d, key=ids.__getitem__))


@settings(max_examples=300, deadline=None)
@given(dags())
def test_dfs_matches_networkx_with_sources_inserted_first(g: CompGraph) -> None:
    """The other way to make networkx start at sources only: insert the sources first."""
    srcs = [v for v in range(g.num_nodes) if g.pred_ptr[v] == g.pred_ptr[v + 1]]
    d = nx.DiGraph()
    d.add_nodes_from(srcs)
    d.add_nodes_from(range(g.num_nodes))
    d.add_edges_from(zip(g.edge_src.tolist(), g.edge_dst.tolist(), strict=True))
    assert traversal_indices(g, "dfs-preorder").tolist() == list(nx.dfs_preorder_nodes(d))
    assert traversal_indices(g, "dfs-postorder").tolist() == list(nx.dfs_postorder_nodes(d))


def brute_bottom_levels(g: CompGraph, cluster: Cluster | None) -> list[float]:
    """Bottom levels straight from the definition, with per-device and per-pair averages taken naively."""
    n = g.num_nodes
    if cluster is None:
        t = [float(x) for x in g.compute_s]

        def comm(nbytes: float) -> float:
            return 0.0
    else:
        sp = [d.speed for d in cluster.devices]
        t = [sum(float(x) / s for s in sp) / len(sp) for x in g.compute_s]
        pairs = [(a, b) for a in range(len(sp)) for b in range(len(sp)) if a != b]

        def comm(nbytes: float) -> float:
            if not pairs:
                return 0.0
            return sum(cluster.pair(a, b).transfer_s(nbytes) for a, b in pairs) / len(pairs)

    bl = [0.0] * n
    for v in reversed(list(nx.topological_sort(to_digraph(g)))):
        pair_cost: dict[int, float] = {}
        for e in g.out_edges(v).tolist():
            w = int(g.edge_dst[e])
            pair_cost[w] = pair_cost.get(w, 0.0) + comm(float(g.edge_bytes[e]))
        bl[v] = t[v] + max((c + bl[w] for w, c in pair_cost.items()), default=0.0)
    return bl


@settings(max_examples=200, deadline=None)
@given(dags(), st.booleans())
def test_critical_path_is_descending_bottom_level_ties_by_topo(g: CompGraph, with_cluster: bool) -> None:
    cluster = two_device_cluster() if with_cluster else None
    bl = bottom_levels(g, cluster)
    assert bl.tolist() == pytest.approx(brute_bottom_levels(g, cluster))
    rank = positions(traversal_indices(g, "topo").tolist())
    order = traversal_indices(g, "critical-path", cluster=cluster).tolist()
    assert order == sorted(range(g.num_nodes), key=lambda v: (-bl[v], rank[v]))
    assert is_topological(g, order)


@settings(max_examples=200, deadline=None)
@given(dags())
def test_topo_is_the_graphs_canonical_order_without_parallel_edges(g: CompGraph) -> None:
    if len(set(zip(g.edge_src.tolist(), g.edge_dst.tolist(), strict=True))) == g.num_edges:
        assert traversal_indices(g, "topo").tolist() == g.topo_order.tolist()


# ----------------------------------------------------------------------------- the registry and custom orders


def test_registry_views_agree() -> None:
    specs = traversal._REGISTRY
    assert tuple(specs) == ORDERS
    assert {n: s.definition for n, s in specs.items()} == ORDER_DEFINITIONS
    assert {n for n, s in specs.items() if s.topological} == TOPOLOGICAL_ORDERS
    assert len({s.func for s in specs.values()}) == len(ORDERS)  # one function per order


def test_registering_an_order_is_one_decorated_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traversal, "_REGISTRY", dict(traversal._REGISTRY))

    @register_order("reversed-bfs", "bfs reversed")
    def _reversed_bfs(inp: OrderInput) -> list[int]:
        return traversal_indices(inp.graph, "bfs").tolist()[::-1]

    assert traversal_order(diamond_graph(), "reversed-bfs") == DIAMOND_EXPECTED["bfs"][::-1]
    with pytest.raises(RuntimeError, match="registered twice"):
        register_order("bfs", "again")(_reversed_bfs)


@settings(max_examples=100, deadline=None)
@given(dags(), st.randoms(use_true_random=False))
def test_explicit_and_callable_orders_are_taken_as_given(g: CompGraph, rnd: object) -> None:
    ids = list(g.ids)
    rnd.shuffle(ids)  # type: ignore[attr-defined]
    assert traversal_order(g, ids) == ids
    assert traversal_order(g, iter(ids)) == ids  # any iterable, read once
    assert traversal_order(g, lambda graph: ids[:]) == ids
    assert traversal_indices(g, tuple(ids)).tolist() == [g.index[i] for i in ids]


def test_explicit_order_errors_name_the_bad_ids() -> None:
    g = diamond_graph()
    ids = traversal_order(g, "topo")
    with pytest.raises(OrderError, match=rf"missing {ids[-1]!r}"):
        traversal_order(g, ids[:-1])
    with pytest.raises(OrderError, match=rf"repeated {ids[0]!r}"):
        traversal_order(g, [*ids, ids[0]])
    with pytest.raises(OrderError, match=r"unknown 'nope'"):
        traversal_order(g, [*ids, "nope"])
    with pytest.raises(OrderError, match="not node indices"):
        traversal_order(g, list(range(g.num_nodes)))
    with pytest.raises(OrderError, match=r"returned by my_order\(\)"):
        traversal_order(g, lambda_named("my_order", ids[1:]))
    with pytest.raises(OrderError, match="must be a sequence of node ids, got str"):
        traversal_order(g, lambda graph: "topo")
    for bad in (3, {"a"}, b"ab"):
        with pytest.raises(OrderError, match="an order is an order name"):
            traversal_order(g, bad)  # type: ignore[arg-type]


def lambda_named(name: str, result: list[str]):  # type: ignore[no-untyped-def]
    def f(graph: CompGraph) -> list[str]:
        return result
    f.__name__ = name
    return f


def test_order_label_records_names_and_custom() -> None:
    assert order_label("bfs") == "bfs"
    assert order_label(("a", "b")) == order_label(lambda graph: []) == "custom"
    assert check_order(iter(["a"])) == ("a",)
    assert check_order("auto", allow_auto=True) == "auto"

"""`tensor_groups`: a graph's out-edges grouped by (producer, tensor index)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.graph import CompGraph
from devplace.graph.tensors import tensor_groups


@st.composite
def graphs(draw: st.DrawFn) -> CompGraph:
    """Random DAGs (edges from lower to higher index) with several tensors per producer and parallel edges."""
    n = draw(st.integers(0, 10))
    triples = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 2)), max_size=30))
    edges = {(a, b, t): None for a, b, t in triples if a < b < n}  # unique (src, dst, tensor)
    # one size per (src, tensor), as CompGraph requires
    recs = [{"src": f"v{a}", "dst": f"v{b}", "tensor": t, "bytes": float(1 + 10 * a + t)} for a, b, t in edges]
    order = draw(st.permutations(range(len(recs))))
    return CompGraph.build("g", [{"id": f"v{i}"} for i in range(n)], [recs[i] for i in order])


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_groups_are_the_producer_tensor_pairs_in_order(g: CompGraph) -> None:
    tg = tensor_groups(g)
    pairs = sorted({(int(g.edge_src[e]), int(g.edge_tensor[e])) for e in range(g.num_edges)})
    assert tg.num_groups == len(pairs)
    for e in range(g.num_edges):  # each edge in the group of its (producer, tensor), numbered in sorted order
        assert pairs[tg.edge_group[e]] == (g.edge_src[e], g.edge_tensor[e])
    for k, f in enumerate(tg.first_edge.tolist()):  # a group's first edge is its earliest
        assert f == min(e for e in range(g.num_edges) if tg.edge_group[e] == k)
    for v in range(g.num_nodes):
        assert [pairs[k][0] for k in range(tg.ptr[v], tg.ptr[v + 1])] == [v] * int(tg.ptr[v + 1] - tg.ptr[v])
        out = tg.edges[g.succ_ptr[v]:g.succ_ptr[v + 1]].tolist()
        assert sorted(out) == sorted(g.succ_edges[g.succ_ptr[v]:g.succ_ptr[v + 1]].tolist())
        assert out == sorted(out, key=lambda e: (g.edge_tensor[e], e))  # by tensor, then edge order

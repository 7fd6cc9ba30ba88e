"""`tensor_groups`: a graph's out-edges grouped by (producer, tensor index); `sorted_within`, which sorts them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from devplace.graph import CompGraph
from devplace.graph.kahn import csr
from devplace.graph.tensors import sorted_within, tensor_groups
from devplace.sim.bounds import op_holds


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


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 2)), max_size=120))
def test_sorted_within_sorts_each_slice_as_lexsort_does(n: int, recs: list[tuple[int, int, int]]) -> None:
    """Each CSR slice sorted by (major, minor, position), short slices by insertion and long ones (over
    `SHORT`: here up to 120 items of one node) by merge sort, as np.lexsort sorts the whole."""
    node = np.array([min(r[0], n - 1) for r in recs], dtype=np.int64)
    major = np.array([r[1] for r in recs], dtype=np.int64)
    minor = np.array([r[2] for r in recs], dtype=np.int64)
    ptr, items = csr(node, n)
    assert sorted_within(ptr, items, major, minor).tolist() == np.lexsort((minor, major, node)).tolist()


def _op_holds_by_lexsort(g: CompGraph) -> np.ndarray:
    """`op_holds` as it was computed before `sorted_within`: one stable sort of every edge by (dst, src, tensor)."""
    read = np.zeros(g.num_nodes)
    if g.num_edges:
        order = np.lexsort((g.edge_tensor, g.edge_src, g.edge_dst))
        d, s, t = g.edge_dst[order], g.edge_src[order], g.edge_tensor[order]
        new = np.ones(order.size, dtype=bool)
        new[1:] = (d[1:] != d[:-1]) | (s[1:] != s[:-1]) | (t[1:] != t[:-1])
        first, d, s = order[new], d[new], s[new]
        pair = np.ones(first.size, dtype=bool)
        pair[1:] = (d[1:] != d[:-1]) | (s[1:] != s[:-1])
        per_pair = np.bincount(np.cumsum(pair) - 1, weights=g.edge_bytes[first])
        np.add.at(read, d[pair], np.minimum(per_pair, g.output_bytes[s[pair]]))
    return read + g.output_bytes + g.temp_bytes


@settings(max_examples=200, deadline=None)
@given(graphs(), st.lists(st.floats(0, 1e3), min_size=10, max_size=10))
def test_op_holds_is_bit_identical_to_the_lexsort_rule(g: CompGraph, out: list[float]) -> None:
    sized = CompGraph.from_arrays(g.name, g.ids, g.op, g.kind, g.group, g.compute_s, np.array(out[:g.num_nodes]),
                                  g.param_bytes, np.arange(g.num_nodes) * 0.5, g.edge_src, g.edge_dst, g.edge_bytes,
                                  g.edge_tensor)
    assert op_holds(sized).tobytes() == _op_holds_by_lexsort(sized).tobytes()

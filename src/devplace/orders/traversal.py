"""The traversal orders of DESIGN.md section 6, computed by devplace's own code.

Every order is a permutation of all node indices, computed over the graph's insertion order (nodes) and
edge insertion order (edges) so that it never depends on a library's version. Common rules:

- *sources* are the nodes without predecessors, taken in insertion order;
- walks use each **distinct** successor once, at the position of its **first** edge in edge insertion
  order (parallel edges, e.g. two tensors from u to v, count once);
- in-degrees count distinct predecessors;
- every walk is iterative (no recursion), O(V + E); `lexicographic` and `lexico-topo` are
  O(V log V + E) because they compare ids.
"""

from __future__ import annotations

import difflib
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph

if TYPE_CHECKING:
    from devplace.hardware.cluster import Cluster


class OrderError(DevplaceError):
    """An unknown traversal order name, or an invalid seed for `random`."""


# ----------------------------------------------------------------------------- shared structure
class _Adjacency:
    """Distinct successors of every node as CSR Python lists, plus distinct in-degrees and sources."""

    __slots__ = ("indeg", "n", "ptr", "sources", "succ")

    def __init__(self, graph: CompGraph) -> None:
        n = graph.num_nodes
        ptr = graph.succ_ptr.tolist()
        dst = graph.edge_dst[graph.succ_edges].tolist()  # successors of every node, in edge order
        mark = [-1] * n
        out_ptr = [0] * (n + 1)
        succ: list[int] = []
        indeg = [0] * n
        for u in range(n):
            for k in range(ptr[u], ptr[u + 1]):
                w = dst[k]
                if mark[w] != u:  # first edge u -> w: keep w here; later parallel edges are skipped
                    mark[w] = u
                    succ.append(w)
                    indeg[w] += 1
            out_ptr[u + 1] = len(succ)
        self.n = n
        self.ptr = out_ptr
        self.succ = succ
        self.indeg = indeg
        self.sources = [v for v in range(n) if indeg[v] == 0]


# ----------------------------------------------------------------------------- the orders
def _topo(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`topo`: Kahn's algorithm with a FIFO queue, seeded with the sources in insertion order; a popped
    node's distinct successors are visited in first-edge order and each one whose last remaining
    predecessor this was joins the back of the queue. The canonical order of DESIGN.md, which the graph
    computes once when it is built (`CompGraph.topo_order`, also the simulator's rank)."""
    return graph.topo_order.tolist()


def _topo_lifo(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`topo-lifo`: Kahn's algorithm with a LIFO stack (networkx <= 2.3's `topological_sort`, which
    Placeto's released code visited). The stack starts as the sources pushed in insertion order (so the
    *last* source is popped first); a popped node is emitted and its distinct successors, in first-edge
    order, are pushed as they become ready (so the last one to become ready is popped next)."""
    ptr, succ = adj.ptr, adj.succ
    deg = adj.indeg.copy()
    stack = adj.sources.copy()
    order: list[int] = []
    while stack:
        u = stack.pop()
        order.append(u)
        for k in range(ptr[u], ptr[u + 1]):
            w = succ[k]
            deg[w] -= 1
            if deg[w] == 0:
                stack.append(w)
    return order


def _reversed_topo(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`reversed-topo`: `topo` reversed (every node after all its successors)."""
    return _topo(graph, adj)[::-1]


def _dfs(adj: _Adjacency) -> tuple[list[int], list[int]]:
    """Depth-first walk from each not-yet-visited source in insertion order, distinct successors in
    first-edge order. Iterative with an explicit stack of (node, next successor position), so it visits
    exactly as the recursive DFS would. Returns (preorder, postorder)."""
    ptr, succ = adj.ptr, adj.succ
    visited = bytearray(adj.n)
    pre: list[int] = []
    post: list[int] = []
    for s in adj.sources:
        if visited[s]:
            continue
        visited[s] = 1
        pre.append(s)
        stack = [s]
        pos = [ptr[s]]
        while stack:
            u = stack[-1]
            i, end = pos[-1], ptr[u + 1]
            while i < end and visited[succ[i]]:
                i += 1
            if i < end:
                w = succ[i]
                pos[-1] = i + 1
                visited[w] = 1
                pre.append(w)
                stack.append(w)
                pos.append(ptr[w])
            else:
                stack.pop()
                pos.pop()
                post.append(u)
    return pre, post


def _dfs_preorder(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`dfs-preorder`: depth-first from each not-yet-visited source in insertion order, successors in
    first-edge order; a node is emitted when it is first reached."""
    return _dfs(adj)[0]


def _dfs_postorder(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`dfs-postorder`: the `dfs-preorder` walk; a node is emitted when all its successors are done."""
    return _dfs(adj)[1]


def _reversed_dfs_postorder(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`reversed-dfs-postorder`: `dfs-postorder` reversed (a topological order)."""
    return _dfs(adj)[1][::-1]


def _bfs(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`bfs`: one breadth-first walk from all sources at once: a FIFO queue seeded with every source in
    insertion order; a popped node's distinct successors, in first-edge order, join the back of the queue
    when first discovered. Nodes are emitted at their first discovery (= queue order). Not always
    topological: a node can be discovered before all its predecessors are."""
    ptr, succ = adj.ptr, adj.succ
    seen = bytearray(adj.n)
    order = adj.sources.copy()
    for s in order:
        seen[s] = 1
    head = 0
    while head < len(order):
        u = order[head]
        head += 1
        for k in range(ptr[u], ptr[u + 1]):
            w = succ[k]
            if not seen[w]:
                seen[w] = 1
                order.append(w)
    return order


def _lexicographic(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`lexicographic`: nodes sorted by id, comparing Python strings (Unicode code points, so "n10" comes
    before "n2"). What the seed study's code calls `alpha`. Ids are unique, so there are no ties."""
    ids = graph.ids
    return sorted(range(adj.n), key=ids.__getitem__)


def _lexico_topo(graph: CompGraph, adj: _Adjacency) -> list[int]:
    """`lexico-topo`: Kahn's algorithm that always takes the ready node with the smallest id (string
    order as in `lexicographic`); networkx's `lexicographical_topological_sort`."""
    ids = graph.ids
    ptr, succ = adj.ptr, adj.succ
    deg = adj.indeg.copy()
    heap = [(ids[v], v) for v in adj.sources]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for k in range(ptr[u], ptr[u + 1]):
            w = succ[k]
            deg[w] -= 1
            if deg[w] == 0:
                heapq.heappush(heap, (ids[w], w))
    return order


def bottom_levels(graph: CompGraph, cluster: Cluster | None = None) -> np.ndarray:
    """Bottom level of every node (HEFT's upward rank): the longest compute + communication path from the
    node to a sink, the node's own time included.

        blevel(v) = t(v) + max over distinct successors w of (c(v, w) + blevel(w))   (0 if v is a sink)

    Without a cluster: t(v) = compute_s(v) and c = 0 (pure compute critical path).
    With a cluster of D devices of speeds s_d (HEFT's averages over devices and device pairs):
      t(v)    = mean over devices d of compute_s(v) / s_d  = compute_s(v) * mean_d(1 / s_d)
      c(e)    = mean over ordered pairs (a, b), a != b, of latency[a, b] + bytes(e) / bandwidth[a, b]
              = mean_lat + bytes(e) * mean_inv_bw                         (0 when D == 1)
      c(v, w) = sum of c(e) over the edges e from v to w (each tensor is its own transfer, as in the
                simulator), added in edge order.
    Returns float64[V] indexed by node.
    """
    n = graph.num_nodes
    if cluster is None:
        t = graph.compute_s.astype(np.float64)
        ce = np.zeros(graph.num_edges, dtype=np.float64)
    else:
        speeds = np.asarray(cluster.speeds, dtype=np.float64)
        t = graph.compute_s * float(np.mean(1.0 / speeds))
        d = speeds.shape[0]
        if d > 1:
            off = ~np.eye(d, dtype=bool)
            mean_lat = float(np.mean(np.asarray(cluster.latency)[off]))
            mean_inv_bw = float(np.mean(1.0 / np.asarray(cluster.bandwidth)[off]))
            ce = mean_lat + graph.edge_bytes * mean_inv_bw
        else:
            ce = np.zeros(graph.num_edges, dtype=np.float64)
    tl = t.tolist()
    ptr = graph.succ_ptr.tolist()
    dst = graph.edge_dst[graph.succ_edges].tolist()
    cost = ce[graph.succ_edges].tolist()
    bl = [0.0] * n
    acc = [0.0] * n
    mark = [-1] * n
    for v in reversed(_topo(graph, _Adjacency(graph))):
        lo, hi = ptr[v], ptr[v + 1]
        for k in range(lo, hi):  # c(v, w): sum over parallel edges, in edge order
            w = dst[k]
            if mark[w] != v:
                mark[w] = v
                acc[w] = cost[k]
            else:
                acc[w] += cost[k]
        best = 0.0
        for k in range(lo, hi):
            w = dst[k]
            x = acc[w] + bl[w]
            if x > best:
                best = x
        bl[v] = tl[v] + best
    return np.array(bl, dtype=np.float64)


def _critical_path(graph: CompGraph, adj: _Adjacency, cluster: Cluster | None = None) -> list[int]:
    """`critical-path`: nodes by descending bottom level (see `bottom_levels`: longest compute + comm path
    to a sink, HEFT's upward rank), ties by position in `topo`. A topological order, since every time and
    communication cost is >= 0 (a node's bottom level is >= its successors', and equal ones go by `topo`)."""
    topo = _topo(graph, adj)
    rank = np.empty(adj.n, dtype=np.int64)
    rank[np.asarray(topo, dtype=np.int64)] = np.arange(adj.n, dtype=np.int64)
    bl = bottom_levels(graph, cluster)
    return np.lexsort((rank, -bl)).tolist()  # type: ignore[no-any-return]


def _random(n: int, seed: int) -> np.ndarray:
    """`random`: `numpy.random.Generator(PCG64(seed)).permutation(V)` of the node indices: the same for the
    same seed and V on every platform and numpy version with the PCG64 stream; `seed` an integer >= 0."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise OrderError(f"the seed of the random order must be an integer >= 0, got {seed!r}")
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    return rng.permutation(n).astype(np.int64)


_OrderFn = Callable[[CompGraph, _Adjacency], list[int]]

_FUNCS: dict[str, _OrderFn] = {
    "topo": _topo,
    "topo-lifo": _topo_lifo,
    "reversed-topo": _reversed_topo,
    "dfs-preorder": _dfs_preorder,
    "dfs-postorder": _dfs_postorder,
    "reversed-dfs-postorder": _reversed_dfs_postorder,
    "bfs": _bfs,
    "lexicographic": _lexicographic,
    "lexico-topo": _lexico_topo,
}

#: Valid order names, in the order of DESIGN.md section 6's table.
ORDERS: tuple[str, ...] = (
    "topo", "topo-lifo", "reversed-topo", "dfs-preorder", "dfs-postorder", "reversed-dfs-postorder",
    "bfs", "lexicographic", "lexico-topo", "critical-path", "random",
)

#: One-line definition of every order (for `devplace order --help` and listings).
ORDER_DEFINITIONS: dict[str, str] = {
    "topo": "Kahn, FIFO queue, sources in insertion order, successors in edge order (the canonical order)",
    "topo-lifo": "Kahn with a LIFO stack (networkx <= 2.3 behaviour, what Placeto's released code visited)",
    "reversed-topo": "topo reversed",
    "dfs-preorder": "depth-first from each not-yet-visited source in insertion order, successors in edge "
                    "order; node emitted when first reached",
    "dfs-postorder": "same walk as dfs-preorder, node emitted when all its successors are done",
    "reversed-dfs-postorder": "dfs-postorder reversed (a topological order)",
    "bfs": "breadth-first from all sources (insertion order), each node at its first discovery",
    "lexicographic": "sort by node id (the seed study's `alpha`)",
    "lexico-topo": "Kahn choosing the smallest id among the ready nodes",
    "critical-path": "descending bottom level (longest compute+comm path to a sink, HEFT's upward rank), "
                     "ties by topo",
    "random": "seeded permutation: numpy Generator(PCG64(seed)).permutation(V)",
}

TOPOLOGICAL_ORDERS: frozenset[str] = frozenset(
    {"topo", "topo-lifo", "reversed-dfs-postorder", "lexico-topo", "critical-path"})
"""Orders that are always topological (every node after all its predecessors)."""


def check_order_name(name: str, *, allow_auto: bool = False) -> str:
    """Return `name` if it is a valid order, else raise OrderError listing the valid names.

    `allow_auto=True` also accepts "auto", where a placer front end (`devplace.place`) resolves it."""
    if name in ORDERS or (allow_auto and name == "auto"):
        return name
    valid = ", ".join(ORDERS)
    if name == "auto":
        raise OrderError(f"'auto' is not an order but a decision made by the placer front end; "
                         f"traversal_order needs one of: {valid}")
    close = difflib.get_close_matches(str(name), ORDERS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise OrderError(f"unknown traversal order {name!r}{hint}; valid orders: {valid}")


def traversal_indices(graph: CompGraph, name: str, seed: int = 0, *,
                      cluster: Cluster | None = None) -> np.ndarray:
    """The traversal order `name` of `graph` as node indices (int64[V], a permutation of 0..V-1).

    `seed` is used only by `random`; `cluster` only by `critical-path` (average device speed and link
    costs; without it the bottom level is pure compute). Raises OrderError for an unknown name or a
    bad seed.
    """
    check_order_name(name)
    n = graph.num_nodes
    if name == "random":
        return _random(n, seed)
    adj = _Adjacency(graph)
    order = _critical_path(graph, adj, cluster) if name == "critical-path" else _FUNCS[name](graph, adj)
    return np.asarray(order, dtype=np.int64).reshape(n)


def traversal_order(graph: CompGraph, name: str, seed: int = 0, *,
                    cluster: Cluster | None = None) -> list[str]:
    """The traversal order `name` of `graph` as node ids; see `traversal_indices` and DESIGN.md section 6.

    >>> from devplace.graph import CompGraph
    >>> g = CompGraph.build("g", [{"id": "b"}, {"id": "a"}], [{"src": "b", "dst": "a"}])
    >>> traversal_order(g, "topo"), traversal_order(g, "lexicographic")
    (['b', 'a'], ['a', 'b'])
    """
    ids = graph.ids
    return [ids[v] for v in traversal_indices(graph, name, seed, cluster=cluster).tolist()]

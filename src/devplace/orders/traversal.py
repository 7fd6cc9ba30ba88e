"""The traversal orders of DESIGN.md section 6, computed by devplace's own code.

Every order is a permutation of all node indices, computed over the graph's insertion order (nodes) and
edge insertion order (edges) so that it never depends on a library's version. Common rules:

- *sources* are the nodes without predecessors, taken in insertion order;
- walks use each **distinct** successor once, at the position of its **first** edge in edge insertion
  order (parallel edges, e.g. two tensors from u to v, count once);
- in-degrees count distinct predecessors;
- every walk is iterative (no recursion), O(V + E); `lexicographic` and `lexico-topo` are
  O(V log V + E) because they compare ids.

Each order is one function registered with `@register_order` (name, definition, topological or not); the
name lists and `traversal_indices` read the registry. `traversal_indices` also takes a caller's own order: a
sequence of node ids or a callable graph -> node ids, checked to be a permutation of the node ids.
"""

from __future__ import annotations

import difflib
import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import op_times

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


# ----------------------------------------------------------------------------- the registry
@dataclass
class OrderInput:
    """What an order function may read: the graph, the seed (only `random` uses it), the cluster (only
    `critical-path`), and the distinct-successor adjacency, built on first use (`topo` and `random` skip it)."""

    graph: CompGraph
    seed: int = 0
    cluster: Cluster | None = None

    @cached_property
    def adj(self) -> _Adjacency:
        """The graph's distinct successors, in-degrees and sources (see `_Adjacency`)."""
        return _Adjacency(self.graph)


#: An order function: node indices (a permutation of 0..V-1) from an `OrderInput`.
OrderFn = Callable[[OrderInput], Sequence[int] | np.ndarray]
#: A caller's own order: graph -> every node id once.
CustomOrderFn = Callable[[CompGraph], Iterable[str]]
#: What `traversal_indices` and `devplace.place(order=)` take: a registered order name, a sequence listing every
#: node id once, or a `CustomOrderFn`.
Order = str | Sequence[str] | CustomOrderFn


@dataclass(frozen=True)
class OrderSpec:
    """A registered order: its function, its one-line definition, and whether it is always topological."""

    name: str
    func: OrderFn
    definition: str
    topological: bool


_REGISTRY: dict[str, OrderSpec] = {}


def register_order(name: str, definition: str, *, topological: bool = False) -> Callable[[OrderFn], OrderFn]:
    """Register the decorated function as order `name`: adding an order is one function with this decorator
    in this module (`ORDERS`, `ORDER_DEFINITIONS` and `TOPOLOGICAL_ORDERS` are read from the registry at the
    end of the module; the order of registration is the order of DESIGN.md section 6's table).
    `tests/test_orders.py` checks every registered order is a permutation of the node indices."""
    def deco(func: OrderFn) -> OrderFn:
        if name in _REGISTRY:
            raise RuntimeError(f"order {name!r} registered twice")
        _REGISTRY[name] = OrderSpec(name, func, definition, topological)
        return func
    return deco


# ----------------------------------------------------------------------------- the orders
@register_order("topo", "Kahn, FIFO queue, sources in insertion order, successors in edge order (the canonical "
                "order)", topological=True)
def _topo(inp: OrderInput) -> list[int]:
    """`topo`: Kahn's algorithm with a FIFO queue, seeded with the sources in insertion order; a popped
    node's distinct successors are visited in first-edge order and each one whose last remaining
    predecessor this was joins the back of the queue. The canonical order of DESIGN.md, which the graph
    computes once when it is built (`CompGraph.topo_order`, also the simulator's rank)."""
    return inp.graph.topo_order.tolist()


@register_order("topo-lifo", "Kahn with a LIFO stack (networkx <= 2.3 behaviour, what Placeto's released code "
                "visited)", topological=True)
def _topo_lifo(inp: OrderInput) -> list[int]:
    """`topo-lifo`: Kahn's algorithm with a LIFO stack (networkx <= 2.3's `topological_sort`, which
    Placeto's released code visited). The stack starts as the sources pushed in insertion order (so the
    *last* source is popped first); a popped node is emitted and its distinct successors, in first-edge
    order, are pushed as they become ready (so the last one to become ready is popped next)."""
    adj = inp.adj
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


@register_order("reversed-topo", "topo reversed")
def _reversed_topo(inp: OrderInput) -> list[int]:
    """`reversed-topo`: `topo` reversed (every node after all its successors)."""
    return _topo(inp)[::-1]


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


@register_order("dfs-preorder", "depth-first from each not-yet-visited source in insertion order, successors in edge "
                    "order; node emitted when first reached")
def _dfs_preorder(inp: OrderInput) -> list[int]:
    """`dfs-preorder`: depth-first from each not-yet-visited source in insertion order, successors in
    first-edge order; a node is emitted when it is first reached."""
    return _dfs(inp.adj)[0]


@register_order("dfs-postorder", "same walk as dfs-preorder, node emitted when all its successors are done")
def _dfs_postorder(inp: OrderInput) -> list[int]:
    """`dfs-postorder`: the `dfs-preorder` walk; a node is emitted when all its successors are done."""
    return _dfs(inp.adj)[1]


@register_order("reversed-dfs-postorder", "dfs-postorder reversed (a topological order)", topological=True)
def _reversed_dfs_postorder(inp: OrderInput) -> list[int]:
    """`reversed-dfs-postorder`: `dfs-postorder` reversed (a topological order)."""
    return _dfs(inp.adj)[1][::-1]


@register_order("bfs", "breadth-first from all sources (insertion order), each node at its first discovery")
def _bfs(inp: OrderInput) -> list[int]:
    """`bfs`: one breadth-first walk from all sources at once: a FIFO queue seeded with every source in
    insertion order; a popped node's distinct successors, in first-edge order, join the back of the queue
    when first discovered. Nodes are emitted at their first discovery (= queue order). Not always
    topological: a node can be discovered before all its predecessors are."""
    adj = inp.adj
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


@register_order("lexicographic", "sort by node id (the seed study's `alpha`)")
def _lexicographic(inp: OrderInput) -> list[int]:
    """`lexicographic`: nodes sorted by id, comparing Python strings (Unicode code points, so "n10" comes
    before "n2"). What the seed study's code calls `alpha`. Ids are unique, so there are no ties."""
    ids = inp.graph.ids
    return sorted(range(len(ids)), key=ids.__getitem__)


@register_order("lexico-topo", "Kahn choosing the smallest id among the ready nodes", topological=True)
def _lexico_topo(inp: OrderInput) -> list[int]:
    """`lexico-topo`: Kahn's algorithm that always takes the ready node with the smallest id (string
    order as in `lexicographic`); networkx's `lexicographical_topological_sort`."""
    ids, adj = inp.graph.ids, inp.adj
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
        t = op_times(graph, cluster).mean(axis=1)
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
    for v in reversed(graph.topo_order.tolist()):
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


@register_order("critical-path", "descending bottom level (longest compute+comm path to a sink, HEFT's upward "
                "rank), ties by topo", topological=True)
def _critical_path(inp: OrderInput) -> list[int]:
    """`critical-path`: nodes by descending bottom level (see `bottom_levels`: longest compute + comm path
    to a sink, HEFT's upward rank), ties by position in `topo`. A topological order, since every time and
    communication cost is >= 0 (a node's bottom level is >= its successors', and equal ones go by `topo`)."""
    graph = inp.graph
    n = graph.num_nodes
    rank = np.empty(n, dtype=np.int64)
    rank[graph.topo_order] = np.arange(n, dtype=np.int64)
    bl = bottom_levels(graph, inp.cluster)
    return np.lexsort((rank, -bl)).tolist()  # type: ignore[no-any-return]


@register_order("random", "seeded permutation: numpy Generator(PCG64(seed)).permutation(V)")
def _random(inp: OrderInput) -> np.ndarray:
    """`random`: `numpy.random.Generator(PCG64(seed)).permutation(V)` of the node indices: the same for the
    same seed and V on every platform and numpy version with the PCG64 stream; `seed` an integer >= 0."""
    seed = inp.seed
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise OrderError(f"the seed of the random order must be an integer >= 0, got {seed!r}")
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    return rng.permutation(inp.graph.num_nodes).astype(np.int64)


# ----------------------------------------------------------------------------- views of the registry
# Read once the orders above are registered, so they list exactly the registered orders, in DESIGN.md's table order.

#: Valid order names, in the order of DESIGN.md section 6's table.
ORDERS: tuple[str, ...] = tuple(_REGISTRY)

#: One-line definition of every order (for `devplace order --help` and listings).
ORDER_DEFINITIONS: dict[str, str] = {name: spec.definition for name, spec in _REGISTRY.items()}

TOPOLOGICAL_ORDERS: frozenset[str] = frozenset(name for name, spec in _REGISTRY.items() if spec.topological)
"""Orders that are always topological (every node after all its predecessors)."""


def check_order_name(name: str, *, allow_auto: bool = False) -> str:
    """Return `name` if it is a valid order, else raise OrderError listing the valid names.

    `allow_auto=True` also accepts "auto", where a placer front end (`devplace.place`) resolves it."""
    if name in _REGISTRY or (allow_auto and name == "auto"):
        return name
    valid = ", ".join(ORDERS)
    if name == "auto":
        raise OrderError(f"'auto' is not an order but a decision made by the placer front end; "
                         f"traversal_order needs one of: {valid}")
    close = difflib.get_close_matches(str(name), ORDERS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise OrderError(f"unknown traversal order {name!r}{hint}; valid orders: {valid}")


def check_order(order: Order, *, allow_auto: bool = False) -> str | tuple[str, ...] | CustomOrderFn:
    """`order` checked as far as it can be without a graph: a valid name (see `check_order_name`), a callable
    (returned as is), or an explicit sequence of node ids (returned as a tuple, so a generator is read once and
    `== "auto"` compares plainly). Raises OrderError for anything else. Whether a sequence lists every node of
    a graph once is checked by `traversal_indices`."""
    if isinstance(order, str):
        return check_order_name(order, allow_auto=allow_auto)
    if callable(order):
        return order
    if isinstance(order, bytes | dict | set | frozenset) or not isinstance(order, Iterable):
        raise OrderError(f"an order is an order name ({', '.join(ORDERS)}), a sequence listing every node id "
                         f"once, or a function graph -> such a sequence; got {type(order).__name__}")
    return tuple(order)


def order_label(order: Order) -> str:
    """How a placement's metadata records `order`: its name, or "custom" for a sequence or a callable."""
    return order if isinstance(order, str) else "custom"


def _few(items: list[Any], k: int = 5) -> str:
    shown = ", ".join(repr(x) for x in items[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def _custom_indices(graph: CompGraph, ids: Any, what: str) -> np.ndarray:
    """The node indices of a custom order `ids` (node ids), or an OrderError naming the unknown, repeated and
    missing ids: a custom order must be a permutation of all node ids, like every named order."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise OrderError(f"{what} must be a sequence of node ids, got {type(ids).__name__}")
    index = graph.index
    idx: list[int] = []
    unknown: list[Any] = []
    for x in ids:
        v = index.get(x) if isinstance(x, str) else None
        if v is None:
            unknown.append(x)
        else:
            idx.append(v)
    n = graph.num_nodes
    counts = np.bincount(np.asarray(idx, dtype=np.int64), minlength=n)
    repeated = [graph.ids[v] for v in np.flatnonzero(counts > 1).tolist()]
    missing = [graph.ids[v] for v in np.flatnonzero(counts == 0).tolist()]
    if unknown or repeated or missing:
        problems = []
        if unknown:
            ints = any(isinstance(x, int | np.integer) for x in unknown)
            problems.append(f"unknown {_few(unknown)}" + (" (list node ids, not node indices)" if ints else ""))
        if repeated:
            problems.append(f"repeated {_few(repeated)}")
        if missing:
            problems.append(f"missing {_few(missing)}")
        raise OrderError(f"{what} must list every node id of graph {graph.name!r} exactly once ({n} ids, got "
                         f"{len(idx) + len(unknown)}): {'; '.join(problems)}")
    return np.asarray(idx, dtype=np.int64)


def traversal_indices(graph: CompGraph, order: Order, seed: int = 0, *,
                      cluster: Cluster | None = None) -> np.ndarray:
    """The traversal `order` of `graph` as node indices (int64[V], a permutation of 0..V-1).

    `order` is an order name, a sequence listing every node id once, or a callable `graph -> such a sequence`
    (see `Order`). `seed` is used only by `random`; `cluster` only by `critical-path` (average device speed
    and link costs; without it the bottom level is pure compute). Raises OrderError for an unknown name, a
    bad seed, or a custom order that is not a permutation of the node ids.
    """
    order = check_order(order)
    if isinstance(order, str):
        found = _REGISTRY[order].func(OrderInput(graph, seed, cluster))
        return np.asarray(found, dtype=np.int64).reshape(graph.num_nodes)
    if callable(order):
        name = getattr(order, "__name__", type(order).__name__)
        return _custom_indices(graph, order(graph), f"the order returned by {name}()")
    return _custom_indices(graph, order, "an explicit order")


def traversal_order(graph: CompGraph, order: Order, seed: int = 0, *,
                    cluster: Cluster | None = None) -> list[str]:
    """The traversal `order` of `graph` as node ids; see `traversal_indices` and DESIGN.md section 6.

    >>> from devplace.graph import CompGraph
    >>> g = CompGraph.build("g", [{"id": "b"}, {"id": "a"}], [{"src": "b", "dst": "a"}])
    >>> traversal_order(g, "topo"), traversal_order(g, "lexicographic"), traversal_order(g, ["a", "b"])
    (['b', 'a'], ['a', 'b'], ['a', 'b'])
    """
    ids = graph.ids
    return [ids[v] for v in traversal_indices(graph, order, seed, cluster=cluster).tolist()]

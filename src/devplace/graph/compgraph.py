"""`CompGraph`: a training-step computation graph held as arrays.

Nodes are numbered 0..V-1 in insertion order (the order of the file), edges 0..E-1 in edge insertion
order. Successor and predecessor lists are CSR arrays of *edge indices*, each node's slice in edge order,
so every walk over the graph can reproduce the deterministic tie-breaks of DESIGN.md sections 4 and 6.
The graph is immutable after construction; build one with `CompGraph.build` or `load_graph`.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from devplace.errors import GraphError
from devplace.graph.jsonio import dump_number

FORMAT = "devplace.graph/1"

# Node keys with a meaning for devplace; every other key is kept verbatim in `node_extra`.
NODE_NUMERIC = ("compute_s", "output_bytes", "param_bytes", "temp_bytes")
NODE_TEXT = ("op", "group", "kind")
EDGE_KEYS = ("src", "dst", "bytes", "tensor")
# A node's time on each device kind it was costed for ({kind: seconds on a device of that kind}); absent: every
# device takes compute_s / speed (DESIGN.md section 4)
KIND_COMPUTE_KEY = "compute_s_by_kind"
DOC_KEYS = ("format", "name", "nodes", "edges")  # graph-level keys with a meaning; every other one is `meta`
# Limits that keep every derived number finite. A step time is at most a sum of graph totals divided by
# cluster rates; with totals <= MAX_TOTAL and rates >= 1 / MAX_TOTAL (hardware.cluster) it stays below
# about 1e200, far from float overflow (1.8e308). Real graphs are below 1e7 seconds and 1e16 bytes.
MAX_TOTAL = 1e100
# Names are printed in every report and error; a megabyte name only makes terminals slow to wrap it.
MAX_NAME_CHARS = 1000


def _short(value: Any) -> str:
    """`value`'s repr cut to 40 characters: a 400-digit integer in an error message says no more than its start."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text):,} characters)"


def _number(value: Any, where: str) -> float:
    """A finite, non-negative number, or a GraphError naming `where`."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise GraphError(f"{where} must be a number, got {_short(value)}")
    try:
        x = float(value)
    except OverflowError:
        raise GraphError(f"{where} is {_short(value)}; it is too large for a float") from None
    if math.isnan(x) or math.isinf(x):
        raise GraphError(f"{where} is {value!r}; it must be a finite number")
    if x < 0:
        raise GraphError(f"{where} is {_short(value)}; it must be >= 0")
    return x


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_name(name: Any, what: str, error: type[Exception] = GraphError, noun: str = "name") -> None:
    """Refuse a `what` name (or other `noun`: "id", "kind") that is not a string of at most MAX_NAME_CHARS
    characters."""
    if not isinstance(name, str):
        raise error(f"the {what} {noun} must be a string, got {type(name).__name__}")
    if len(name) > MAX_NAME_CHARS:
        raise error(f"the {what} {noun} is {len(name):,} characters long ({name[:40]!r}...); give a {noun} of at "
                    f"most {MAX_NAME_CHARS} characters")
    lone = _SURROGATE.search(name)
    if lone is not None:  # JSON's \ud800 escapes decode to these; no file (trace, plot, CSV) can hold them
        raise error(f"the {what} {noun} {name[:40]!a} holds {lone.group()!a}, half of a UTF-16 surrogate pair and "
                    "not a character; fix the name")


def _check_totals(name: str, numeric: np.ndarray, edge_bytes: np.ndarray,
                  kind_compute: Mapping[str, np.ndarray]) -> None:
    """Each of the graph's totals (sums over nodes or edges) must be at most MAX_TOTAL: a larger one overflows
    sums, features and step times to infinity (four ops of 1e308 s already sum to inf)."""
    totals = [(f"\"{k}\" over all nodes", numeric[j]) for j, k in enumerate(NODE_NUMERIC)]
    totals += [(f"\"{KIND_COMPUTE_KEY}\" {k!r} over all nodes", col) for k, col in kind_compute.items()]
    totals.append(("memory (output_bytes + param_bytes + temp_bytes) over all nodes", numeric[1:].ravel()))
    totals.append(("edge \"bytes\" over all edges", edge_bytes))
    for what, values in totals:
        # every value is finite and >= 0: scale by the largest, so the sum itself cannot overflow
        top = float(values.max()) if values.size else 0.0
        total = top * float(np.sum(values / top)) if top > 0 else 0.0
        if total > MAX_TOTAL:
            shown = f"{total:.3g}" if math.isfinite(total) else "too large for a float"
            raise GraphError(f"graph {name!r}: the sum of {what} is {shown}, above the limit of "
                             f"{MAX_TOTAL:.0e}; check the units (seconds, bytes) of the numbers")


@dataclass(frozen=True, eq=False)
class CompGraph:
    """A DAG of ops. Arrays are indexed by node index (insertion order) or edge index (edge order)."""

    name: str
    ids: tuple[str, ...]
    op: tuple[str, ...]
    kind: tuple[str, ...]
    group: tuple[str, ...]
    compute_s: np.ndarray  # float64[V], time on a device of speed 1.0
    output_bytes: np.ndarray  # float64[V]
    param_bytes: np.ndarray  # float64[V]
    temp_bytes: np.ndarray  # float64[V]
    edge_src: np.ndarray  # int64[E]
    edge_dst: np.ndarray  # int64[E]
    edge_bytes: np.ndarray  # float64[E]
    edge_tensor: np.ndarray  # int64[E]
    succ_ptr: np.ndarray  # int64[V+1]; out-edges of v are succ_edges[succ_ptr[v]:succ_ptr[v+1]]
    succ_edges: np.ndarray  # int64[E], edge indices in edge order
    pred_ptr: np.ndarray  # int64[V+1]
    pred_edges: np.ndarray  # int64[E]
    node_extra: tuple[dict[str, Any], ...] = ()
    edge_extra: tuple[dict[str, Any], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    # id -> node index: `build` passes the one it checks ids with; `from_arrays` leaves it to the first use
    # (`index`): a graph derived in bulk (a pipeline's unrolled step, on every simulation) is rarely looked up
    _index: dict[str, int] | None = field(default=None, repr=False)
    # device kind -> float64[V], every node's seconds on a device of that kind (`compute_s_by_kind` in JSON); a
    # device of a kind listed here takes these times, any other compute_s / speed (`hardware.op_times`)
    kind_compute: Mapping[str, np.ndarray] = field(default_factory=dict)

    # ----------------------------------------------------------------- construction
    @classmethod
    def build(
        cls,
        name: str,
        nodes: Sequence[Mapping[str, Any]],
        edges: Sequence[Mapping[str, Any]],
        meta: Mapping[str, Any] | None = None,
    ) -> CompGraph:
        """Validate node and edge records (the JSON shapes of DESIGN.md section 3) and build the graph.

        Raises GraphError for a duplicate id, an edge to an unknown node, a negative/NaN/inf number, a
        duplicate edge, edges of one (src, tensor) with different bytes, a cycle (naming its nodes), a total
        (compute_s, a byte column, memory or edge bytes summed over the graph) above MAX_TOTAL, or a name
        longer than MAX_NAME_CHARS (the graph's, a node's id, op, group or kind).
        """
        check_name(name, "graph")
        reserved = [k for k in (meta or {}) if k in DOC_KEYS]
        if reserved:
            raise GraphError(f"graph {name!r}: meta may not contain the document key(s) {reserved}")
        ids: list[str] = []
        index: dict[str, int] = {}
        text: dict[str, list[str]] = {k: [] for k in NODE_TEXT}
        numeric = np.zeros((len(NODE_NUMERIC), len(nodes)), dtype=np.float64)
        node_extra: list[dict[str, Any]] = []
        by_kind: list[Mapping[str, Any]] = []
        for i, rec in enumerate(nodes):
            if not isinstance(rec, Mapping):
                raise GraphError(f"node #{i} must be a JSON object, got {rec!r}")
            nid = rec.get("id")
            if not isinstance(nid, str) or not nid:
                raise GraphError(f"node #{i} needs a non-empty string \"id\", got {_short(nid)}")
            check_name(nid, f"node #{i}", noun="id")
            if nid in index:
                raise GraphError(f"duplicate node id {nid!r} (nodes #{index[nid]} and #{i}); ids must be unique")
            index[nid] = i
            ids.append(nid)
            for k in NODE_TEXT:
                v = rec.get(k, "")
                if not isinstance(v, str):
                    raise GraphError(f"node {nid!r}: \"{k}\" must be a string, got {_short(v)}")
                check_name(v, f"node {nid!r}", noun=f"\"{k}\"")
                text[k].append(v)
            for j, k in enumerate(NODE_NUMERIC):
                if k in rec:
                    numeric[j, i] = _number(rec[k], f"node {nid!r}: \"{k}\"")
            by_kind.append(_kind_times(rec.get(KIND_COMPUTE_KEY, {}), nid))
            node_extra.append({k: v for k, v in rec.items() if k != "id" and k not in NODE_TEXT
                               and k not in NODE_NUMERIC and k != KIND_COMPUTE_KEY})
        kind_compute = _kind_columns(by_kind, ids)

        n_e = len(edges)
        src = np.empty(n_e, dtype=np.int64)
        dst = np.empty(n_e, dtype=np.int64)
        ebytes = np.zeros(n_e, dtype=np.float64)
        tensor = np.zeros(n_e, dtype=np.int64)
        edge_extra: list[dict[str, Any]] = []
        seen_edge: dict[tuple[int, int, int], int] = {}
        tensor_bytes: dict[tuple[int, int], int] = {}
        for e, rec in enumerate(edges):
            if not isinstance(rec, Mapping):
                raise GraphError(f"edge #{e} must be a JSON object, got {rec!r}")
            ends = []
            for k in ("src", "dst"):
                nid = rec.get(k)
                if not isinstance(nid, str) or nid not in index:
                    what = ("missing" if nid is None else f"unknown node {nid!r}" if isinstance(nid, str)
                            else f"{nid!r}, not a node id string")
                    raise GraphError(f"edge #{e} ({rec.get('src')!r} -> {rec.get('dst')!r}): \"{k}\" is {what}; "
                                     "every edge must join two nodes listed in \"nodes\"")
                ends.append(index[nid])
            u, v = ends
            label = f"edge #{e} ({ids[u]!r} -> {ids[v]!r})"
            if u == v:
                raise GraphError(f"{label} is a self-loop, a cycle of one node; a graph must be acyclic")
            b = _number(rec.get("bytes", 0), f"{label}: \"bytes\"")
            t = rec.get("tensor", 0)
            if isinstance(t, bool | np.bool_) or not isinstance(t, numbers.Integral) or not 0 <= t < 2**63:
                raise GraphError(f"{label}: \"tensor\" must be an integer >= 0 (an output index), got {t!r}")
            t = int(t)
            key = (u, v, t)
            if key in seen_edge:
                raise GraphError(f"{label}: duplicate of edge #{seen_edge[key]} (same src, dst and tensor {t}); "
                                 "list each tensor a node consumes once")
            seen_edge[key] = e
            first = tensor_bytes.setdefault((u, t), e)
            if ebytes[first] != b and first != e:
                raise GraphError(
                    f"{label}: tensor {t} of {ids[u]!r} has {rec.get('bytes', 0)!r} bytes here but "
                    f"{dump_number(ebytes[first])} on edge #{first}; one output has one size (give a 0-byte "
                    "control edge a tensor index of its own)"
                )
            src[e], dst[e], ebytes[e], tensor[e] = u, v, b, t
            edge_extra.append({k: val for k, val in rec.items() if k not in EDGE_KEYS})

        _check_totals(name, numeric, ebytes, kind_compute)
        n = len(ids)
        succ_ptr, succ_edges = _csr(src, n)
        pred_ptr, pred_edges = _csr(dst, n)
        graph = cls(
            name=name, ids=tuple(ids), op=tuple(text["op"]), kind=tuple(text["kind"]),
            group=tuple(text["group"]),
            compute_s=numeric[0].copy(), output_bytes=numeric[1].copy(), param_bytes=numeric[2].copy(),
            temp_bytes=numeric[3].copy(),
            edge_src=src, edge_dst=dst, edge_bytes=ebytes, edge_tensor=tensor,
            succ_ptr=succ_ptr, succ_edges=succ_edges, pred_ptr=pred_ptr, pred_edges=pred_edges,
            node_extra=tuple(node_extra), edge_extra=tuple(edge_extra), meta=dict(meta or {}), _index=index,
            kind_compute=kind_compute,
        )
        return _finish(graph)

    @classmethod
    def from_arrays(
        cls, name: str, ids: Sequence[str], op: Sequence[str], kind: Sequence[str], group: Sequence[str],
        compute_s: np.ndarray, output_bytes: np.ndarray, param_bytes: np.ndarray, temp_bytes: np.ndarray,
        edge_src: np.ndarray, edge_dst: np.ndarray, edge_bytes: np.ndarray, edge_tensor: np.ndarray,
        meta: Mapping[str, Any] | None = None, kind_compute: Mapping[str, np.ndarray] | None = None,
        node_extra: Sequence[dict[str, Any]] = (), edge_extra: Sequence[dict[str, Any]] = (),
    ) -> CompGraph:
        """Build a graph from columns that are valid already -- what code that derives a graph from another
        one (the unrolled step of a schedule) has -- without `build`'s per-record checks: the caller guarantees
        unique ids, finite non-negative numbers, edges between existing nodes without duplicates or self-loops,
        and one size per (src, tensor). Only the shapes, the edges' node indices and acyclicity are checked
        (GraphError naming a cycle); the id index is built on first use (`index`). The graph is the one `build`
        makes from the same records."""
        n, n_e = len(ids), int(np.shape(edge_src)[0])
        cols = [np.array(x, dtype=np.float64) for x in (compute_s, output_bytes, param_bytes, temp_bytes)]
        ecols = [np.array(edge_src, dtype=np.int64), np.array(edge_dst, dtype=np.int64),
                 np.array(edge_bytes, dtype=np.float64), np.array(edge_tensor, dtype=np.int64)]
        kcols = {k: np.array(x, dtype=np.float64) for k, x in (kind_compute or {}).items()}
        lengths = (op, kind, group, *cols, *kcols.values(), *([node_extra] if node_extra else []))
        if (any(len(x) != n for x in lengths) or any(x.shape != (n_e,) for x in ecols)
                or (edge_extra and len(edge_extra) != n_e)):
            raise GraphError(f"graph {name!r}: node columns must all have {n} entries and edge columns {n_e}")
        src, dst, ebytes, tensor = ecols
        # the compiled CSR (`kahn.csr`) indexes arrays by them: checked, not trusted
        if n_e and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
            raise GraphError(f"graph {name!r}: an edge names a node index outside 0..{n - 1}")
        ids_t = tuple(ids)
        succ_ptr, succ_edges = _csr(src, n)
        pred_ptr, pred_edges = _csr(dst, n)
        graph = cls(
            name=name, ids=ids_t, op=tuple(op), kind=tuple(kind), group=tuple(group),
            compute_s=cols[0], output_bytes=cols[1], param_bytes=cols[2], temp_bytes=cols[3],
            edge_src=src, edge_dst=dst, edge_bytes=ebytes, edge_tensor=tensor,
            succ_ptr=succ_ptr, succ_edges=succ_edges, pred_ptr=pred_ptr, pred_edges=pred_edges,
            meta=dict(meta or {}), kind_compute=kcols,
            node_extra=tuple(node_extra), edge_extra=tuple(edge_extra),
        )
        return _finish(graph)

    # ----------------------------------------------------------------- queries
    @property
    def index(self) -> dict[str, int]:
        """Node id -> node index (built once, on first use)."""
        index = self._index
        if index is None:
            index = dict(zip(self.ids, range(len(self.ids)), strict=True))
            object.__setattr__(self, "_index", index)
        return index

    @property
    def num_nodes(self) -> int:
        return len(self.ids)

    @property
    def num_edges(self) -> int:
        return int(self.edge_src.shape[0])

    def out_edges(self, v: int) -> np.ndarray:
        """Edge indices leaving node v, in edge insertion order."""
        return self.succ_edges[self.succ_ptr[v]:self.succ_ptr[v + 1]]

    def in_edges(self, v: int) -> np.ndarray:
        """Edge indices entering node v, in edge insertion order."""
        return self.pred_edges[self.pred_ptr[v]:self.pred_ptr[v + 1]]

    def successors(self, v: int) -> list[int]:
        """Distinct successors of v, each at the position of its first edge (parallel edges count once)."""
        return list(dict.fromkeys(self.edge_dst[self.out_edges(v)].tolist()))

    def predecessors(self, v: int) -> list[int]:
        """Distinct predecessors of v, each at the position of its first edge."""
        return list(dict.fromkeys(self.edge_src[self.in_edges(v)].tolist()))

    @property
    def topo_order(self) -> np.ndarray:
        """The canonical topological order (DESIGN.md section 4 rule 5), computed once at build time."""
        return self._topo  # type: ignore[attr-defined,no-any-return]

    def derived(self, key: str, make: Callable[[CompGraph], np.ndarray]) -> np.ndarray:
        """`make(self)`, computed once per graph and kept read-only: a graph never changes, so an array a pass
        derives from the graph alone (tie classes, op phases) is shared by every later call, e.g. the thousand
        simulations of one pipeline search. `key` names it (one key per function)."""
        cache: dict[str, np.ndarray] | None = getattr(self, "_derived", None)
        if cache is None:
            cache = {}
            object.__setattr__(self, "_derived", cache)
        value = cache.get(key)
        if value is None:
            value = make(self)
            value.setflags(write=False)
            cache[key] = value
        return value

    @property
    def topo_rank(self) -> np.ndarray:
        """rank[v] = position of v in the canonical topological order."""
        return self.derived("topo_rank", _topo_rank)

    def node_record(self, v: int) -> dict[str, Any]:
        """Node v as its `devplace.graph/1` JSON object (extra keys included, zero numbers omitted)."""
        rec: dict[str, Any] = {"id": self.ids[v]}
        for k in NODE_TEXT:
            val = getattr(self, k)[v]
            if val:
                rec[k] = val
        for k in NODE_NUMERIC:
            x = float(getattr(self, k)[v])
            if x:
                rec[k] = dump_number(x)
        rec.update(self.node_extra[v] if self.node_extra else {})
        if self.kind_compute:
            rec[KIND_COMPUTE_KEY] = {k: dump_number(float(t[v])) for k, t in self.kind_compute.items()}
        return rec

    def edge_record(self, e: int) -> dict[str, Any]:
        """Edge e as its `devplace.graph/1` JSON object."""
        rec: dict[str, Any] = {"src": self.ids[self.edge_src[e]], "dst": self.ids[self.edge_dst[e]],
                               "bytes": dump_number(float(self.edge_bytes[e]))}
        if self.edge_tensor[e]:
            rec["tensor"] = int(self.edge_tensor[e])
        rec.update(self.edge_extra[e] if self.edge_extra else {})
        return rec

    def to_dict(self) -> dict[str, Any]:
        """The whole graph as a `devplace.graph/1` document."""
        doc: dict[str, Any] = {"format": FORMAT, "name": self.name}
        doc.update(self.meta)
        doc["nodes"] = [self.node_record(v) for v in range(self.num_nodes)]
        doc["edges"] = [self.edge_record(e) for e in range(self.num_edges)]
        return doc

    def to_networkx(self) -> Any:
        """A networkx MultiDiGraph keyed by node id, with every node and edge attribute (key = tensor).

        Unlike the JSON records, every node carries all of `op`, `kind`, `group` and the numeric fields, and
        every edge `bytes` and `tensor`, even when empty or zero; extra keys are kept; graph-level `meta` goes
        into `g.graph`.
        """
        import networkx as nx

        g = nx.MultiDiGraph(name=self.name, **self.meta)
        for v in range(self.num_nodes):
            attrs: dict[str, Any] = {k: getattr(self, k)[v] for k in NODE_TEXT}
            attrs.update({k: dump_number(float(getattr(self, k)[v])) for k in NODE_NUMERIC})
            attrs.update(self.node_extra[v] if self.node_extra else {})
            g.add_node(self.ids[v], **attrs)
        for e in range(self.num_edges):
            rec = self.edge_record(e)
            rec["tensor"] = int(self.edge_tensor[e])
            g.add_edge(rec.pop("src"), rec.pop("dst"), key=rec["tensor"], **rec)
        return g

    def __repr__(self) -> str:
        return f"CompGraph({self.name!r}, {self.num_nodes} nodes, {self.num_edges} edges)"


def _finish(graph: CompGraph) -> CompGraph:
    """Freeze the arrays and store the canonical topological order, or GraphError naming a cycle."""
    for arr in (graph.compute_s, graph.output_bytes, graph.param_bytes, graph.temp_bytes, graph.edge_src,
                graph.edge_dst, graph.edge_bytes, graph.edge_tensor, graph.succ_ptr, graph.succ_edges,
                graph.pred_ptr, graph.pred_edges, *graph.kind_compute.values()):
        arr.setflags(write=False)
    object.__setattr__(graph, "kind_compute", dict(graph.kind_compute))  # a plain dict: graphs are pickled to workers
    topo = canonical_topo_order(graph)
    if len(topo) < graph.num_nodes:
        raise GraphError(f"graph {graph.name!r} has a cycle: {' -> '.join(find_cycle(graph, topo))}; "
                         "a training step must be a DAG")
    object.__setattr__(graph, "_topo", topo)
    return graph


def _kind_times(value: Any, nid: str) -> Mapping[str, Any]:
    """A node's `compute_s_by_kind`: an object of device kind -> seconds."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
        raise GraphError(f"node {nid!r}: \"{KIND_COMPUTE_KEY}\" must be an object of device kind -> seconds on a "
                         f"device of that kind, got {_short(value)}")
    return value


def _kind_columns(by_kind: list[Mapping[str, Any]], ids: list[str]) -> dict[str, np.ndarray]:
    """The per-kind time columns of `build`: every node lists the same kinds, or none does."""
    if not by_kind or not by_kind[0]:
        if any(by_kind):
            i = next(i for i, d in enumerate(by_kind) if d)
            raise GraphError(f"node {ids[i]!r} has \"{KIND_COMPUTE_KEY}\" but node {ids[0]!r} has none; give every "
                             "node the same device kinds, or none")
        return {}
    kinds = list(by_kind[0])
    cols = {k: np.zeros(len(ids)) for k in kinds}
    for i, d in enumerate(by_kind):
        if set(d) != set(kinds):
            raise GraphError(f"node {ids[i]!r}: \"{KIND_COMPUTE_KEY}\" lists {sorted(d)}, node {ids[0]!r} "
                             f"{sorted(kinds)}; give every node the same device kinds")
        for k in kinds:
            cols[k][i] = _number(d[k], f"node {ids[i]!r}: \"{KIND_COMPUTE_KEY}\" {k!r}")
    return cols


def _csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR grouping of edge indices by `keys` (src or dst), stable so each slice keeps edge order."""
    from devplace.graph.kahn import csr  # compiled, imported when a graph is built (see canonical_topo_order)

    return csr(np.ascontiguousarray(keys, dtype=np.int64), n)


def canonical_topo_order(graph: CompGraph) -> np.ndarray:
    """Kahn's algorithm with a FIFO queue, sources in insertion order, successors in edge order; parallel
    edges count once, so a successor is released at the position of its first edge (DESIGN.md section 6).

    Returns fewer than V nodes when the graph has a cycle (the nodes on or after a cycle are missing).
    """
    from devplace.graph.kahn import kahn_fifo  # compiled; imported here so that importing a graph costs no numba

    return kahn_fifo(graph.num_nodes, graph.edge_dst, graph.succ_ptr, graph.succ_edges, _first_of_parallel(graph))


def _first_of_parallel(graph: CompGraph) -> np.ndarray:
    """first[e] is False when an earlier edge has the same (src, dst): parallel edges count once."""
    from devplace.graph.kahn import first_of_parallel

    return first_of_parallel(graph.edge_dst, graph.num_nodes, graph.succ_ptr, graph.succ_edges)


def find_cycle(graph: CompGraph, partial_topo: Iterable[int]) -> list[str]:
    """Ids of one cycle (first node repeated at the end), given Kahn's output that stopped short of V."""
    done = np.zeros(graph.num_nodes, dtype=bool)
    done[np.fromiter(partial_topo, dtype=np.int64)] = True
    # Every node Kahn left behind has a left-behind predecessor: walk predecessors until one repeats.
    v = int(np.flatnonzero(~done)[0])
    seen: dict[int, int] = {}
    path: list[int] = []
    while v not in seen:
        seen[v] = len(path)
        path.append(v)
        v = next(int(graph.edge_src[e]) for e in graph.in_edges(v) if not done[graph.edge_src[e]])
    cycle = path[seen[v]:][::-1]  # walked backwards; reverse to follow the edges
    return [graph.ids[x] for x in [*cycle, cycle[0]]]


def _topo_rank(graph: CompGraph) -> np.ndarray:
    rank = np.empty(graph.num_nodes, dtype=np.int64)
    rank[graph.topo_order] = np.arange(graph.num_nodes, dtype=np.int64)
    return rank

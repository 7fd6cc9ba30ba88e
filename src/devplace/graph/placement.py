"""`Placement`: which device index runs each node, and the `devplace.placement/1` format."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from devplace.errors import PlacementError
from devplace.graph.compgraph import CompGraph
from devplace.graph.jsonio import read_json, write_json

FORMAT = "devplace.placement/1"


@dataclass(frozen=True)
class Placement:
    """A node id -> device index mapping, with the names of the graph and cluster it was made for."""

    assignment: dict[str, int]
    graph: str = ""
    cluster: str = ""
    meta: dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_array(cls, graph: CompGraph, devices: np.ndarray | list[int], cluster: str = "") -> Placement:
        """Placement of `graph` from a device index per node (node index order)."""
        arr = np.asarray(devices)
        if arr.shape != (graph.num_nodes,):
            raise PlacementError(f"expected {graph.num_nodes} device indices, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":  # no silent float truncation or bool -> int
            vals = arr.tolist()
            bad = next((x for x in vals if isinstance(x, bool) or not isinstance(x, int)), None)
            if bad is not None:
                raise PlacementError(f"device indices must be integers, got {bad!r} (dtype {arr.dtype})")
            if any(not -(2**63) <= x < 2**63 for x in vals):
                raise PlacementError(f"device index out of range in {vals!r}"[:200])
        devs = arr.astype(np.int64)
        return cls(dict(zip(graph.ids, devs.tolist(), strict=True)), graph=graph.name, cluster=cluster)

    def to_array(self, graph: CompGraph, num_devices: int) -> np.ndarray:
        """Device index per node of `graph` (node index order), checking that the placement covers exactly
        the graph's nodes and uses only devices 0..num_devices-1."""
        extra = [k for k in self.assignment if k not in graph.index]
        if extra:
            raise PlacementError(f"placement names {len(extra)} node(s) not in graph {graph.name!r}, e.g. "
                                 f"{extra[0]!r}; was it made for another graph?")
        devs = np.empty(graph.num_nodes, dtype=np.int64)
        for v, nid in enumerate(graph.ids):
            d = self.assignment.get(nid)
            if d is None:
                missing = sum(1 for x in graph.ids if x not in self.assignment)
                raise PlacementError(f"placement gives no device for {missing} node(s) of graph {graph.name!r}, "
                                     f"e.g. {nid!r}; every node needs one")
            if isinstance(d, bool) or not isinstance(d, int | np.integer) or not 0 <= d < num_devices:
                raise PlacementError(f"node {nid!r} is placed on device {d!r}, but the cluster has devices "
                                     f"0..{num_devices - 1}")
            devs[v] = d
        return devs

    def with_meta(self, **meta: object) -> Placement:
        """The same placement with `meta` added to (or replacing keys of) its meta."""
        return Placement(self.assignment, graph=self.graph, cluster=self.cluster, meta={**self.meta, **meta})

    def to_dict(self) -> dict[str, object]:
        return {"format": FORMAT, "graph": self.graph, "cluster": self.cluster, **self.meta,
                "assignment": dict(self.assignment)}


def load_placement(path: str | Path) -> Placement:
    """Read a `devplace.placement/1` file."""
    doc = read_json(path, FORMAT)
    assignment = doc.get("assignment")
    if not isinstance(assignment, dict):
        raise PlacementError(f"{path}: \"assignment\" must be an object of node id -> device index")
    for nid, d in assignment.items():
        if isinstance(d, bool) or not isinstance(d, int):
            raise PlacementError(f"{path}: node {nid!r} has device {d!r}; device indices are integers")
    meta = {k: v for k, v in doc.items() if k not in ("format", "graph", "cluster", "assignment")}
    return Placement(dict(assignment), graph=str(doc.get("graph", "")), cluster=str(doc.get("cluster", "")),
                     meta=meta)


def save_placement(placement: Placement, path: str | Path) -> None:
    """Write `placement` as `devplace.placement/1`."""
    write_json(path, placement.to_dict())


def runtime_placement(graph: CompGraph, placement: Placement) -> Placement:
    """The placement as the runtime realises it: forward ops where placed; every backward and optimizer op on
    the device of its colocation group's forward op (autograd runs a backward op where its forward op's
    tensors are; a parameter, and so its update, lives with its first consumer, which is the group the
    capture gives optimizer ops); an input with its first consumer.

    Colocation splits a forward op's group from its backward ops whenever joining them would make the coarse
    graph cyclic, so a placer may put backward ops elsewhere than their forward op; the simulator can run that,
    plain autograd cannot, and this placement is what `devplace.runtime` actually runs. Graphs without colocation
    groups (no `group`/`kind`) come back unchanged.
    """
    devs = placement.to_array(graph, max(placement.assignment.values(), default=0) + 1).copy()
    index = graph.index
    for v in range(graph.num_nodes):
        if graph.kind[v] != "forward":
            g = graph.group[v]
            u = index.get(g) if g else None
            if u is not None and graph.kind[u] == "forward":
                devs[v] = devs[u]
    for v in range(graph.num_nodes):
        if graph.op[v] == "input":
            succ = graph.successors(v)
            if succ:
                devs[v] = devs[succ[0]]
    return Placement(dict(zip(graph.ids, devs.tolist(), strict=True)), graph=placement.graph or graph.name,
                     cluster=placement.cluster, meta=dict(placement.meta))

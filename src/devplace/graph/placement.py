"""`Placement`: which device index runs each node, and the `devplace.placement/1` format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from devplace.errors import PlacementError
from devplace.graph.compgraph import CompGraph
from devplace.graph.jsonio import read_json, write_json
from devplace.graph.schedule import Schedule

FORMAT = "devplace.placement/1"


@dataclass(frozen=True)
class MadeBy:
    """How a placement was made, the one record of it (the search makes it once; reports, result objects and plan
    files read it): `placer` (the one kept, when placer "auto" chose; "parallel" for a parallel plan, which the
    nested search makes, no registered placer), `order` (the order it walked; None for a placer that ignores
    orders; "custom" for a caller's own), `seed`, its `settings` (only ones `placer` takes) and the `semantics`
    placed under ("op-by-op" or "autograd", `devplace.graph.semantics`); `request`, what was asked (placer, order,
    seed, settings, and where given try_orders, try_with and the parallel plans asked for: placing it again gives
    this placement); `groups`, the nodes the placer placed (a coarsening's groups, else the graph's ops); the
    search's wall `seconds` and `simulations`. A placement file records all but `seconds` (wall time is not a
    property of the answer: a loaded placement's is None)."""

    placer: str
    order: str | None = None
    seed: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    semantics: str | None = None
    request: dict[str, Any] | None = None
    groups: int | None = None
    seconds: float | None = field(default=None, compare=False)  # a file does not keep it: not compared either
    simulations: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The keys a placement file records it under (`MADE_KEYS`; request, groups and simulations where known)."""
        doc: dict[str, Any] = {"placer": self.placer, "order": self.order, "seed": self.seed,
                               "settings": dict(self.settings), "semantics": self.semantics}
        for key, value in (("request", self.request), ("placed_groups", self.groups),
                           ("simulations", self.simulations)):
            if value is not None:
                doc[key] = dict(value) if isinstance(value, Mapping) else value
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str) -> MadeBy:
        """The record of a placement document that names its "placer"; PlacementError naming `where` for fields of
        the wrong type."""
        settings, request = doc.get("settings") or {}, doc.get("request")
        counts = [doc.get(k) for k in ("placed_groups", "simulations")]
        if (not isinstance(doc["placer"], str) or not isinstance(settings, Mapping)
                or not isinstance(request, Mapping | None)
                or any(c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0) for c in counts)):
            raise PlacementError(f"{where}: \"placer\" must be a name, \"settings\" and \"request\" objects, "
                                 f"\"placed_groups\" and \"simulations\" counts; got {doc['placer']!r:.40}, "
                                 f"{settings!r:.40}, {request!r:.40}, {counts[0]!r:.20}, {counts[1]!r:.20}")
        return cls(doc["placer"], doc.get("order"), doc.get("seed"), dict(settings), doc.get("semantics"),
                   None if request is None else dict(request), counts[0], None, counts[1])


# the keys of a placement file that are not meta: its own, the schedule's and MadeBy's
MADE_KEYS = ("placer", "order", "seed", "settings", "semantics", "request", "placed_groups", "simulations")
_FIELDS = ("format", "graph", "cluster", "assignment", "schedule", *MADE_KEYS)


@dataclass(frozen=True)
class Placement:
    """A node id -> device index mapping, with the names of the graph and cluster it was made for, the
    `schedule` it runs under (None: one step without micro-batches), how it was made (`made_by`; None for a
    hand-made one) and `meta`, what the search that made it records (step time, what it tried)."""

    assignment: dict[str, int]
    graph: str = ""
    cluster: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    schedule: Schedule | None = None
    made_by: MadeBy | None = None

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
        index = graph.index  # a property: read once, not per node
        extra = [k for k in self.assignment if k not in index]
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
        return replace(self, meta={**self.meta, **meta})

    def to_dict(self) -> dict[str, object]:
        """The `devplace.placement/1` document: the schedule and how it was made under their own keys
        ("schedule"; "placer", "order", "seed", "settings", "semantics"), then the meta."""
        doc: dict[str, object] = {"format": FORMAT, "graph": self.graph, "cluster": self.cluster}
        if self.made_by is not None:
            doc.update(self.made_by.to_dict())
        if self.schedule is not None:
            doc["schedule"] = self.schedule.to_dict()
        return {**doc, **self.meta, "assignment": dict(self.assignment)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str) -> Placement:
        """The placement of a `to_dict()` document (its "format" checked by the caller); PlacementError naming
        `where` for an assignment that is not node id -> device index, or a placer that is not a name (a bad
        schedule: ScheduleError)."""
        assignment = doc.get("assignment")
        if not isinstance(assignment, Mapping):
            raise PlacementError(f"{where}: \"assignment\" must be an object of node id -> device index")
        for nid, d in assignment.items():
            if isinstance(d, bool) or not isinstance(d, int):
                raise PlacementError(f"{where}: node {nid!r} has device {d!r}; device indices are integers")
        made_by = MadeBy.from_dict(doc, where) if doc.get("placer") is not None else None
        schedule = Schedule.from_dict(doc["schedule"]) if doc.get("schedule") is not None else None
        meta = {k: v for k, v in doc.items() if k not in _FIELDS}
        return cls(dict(assignment), graph=str(doc.get("graph", "")), cluster=str(doc.get("cluster", "")),
                   meta=meta, schedule=schedule, made_by=made_by)


def load_placement(path: str | Path) -> Placement:
    """Read a `devplace.placement/1` file."""
    return Placement.from_dict(read_json(path, FORMAT), str(path))


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
    return replace(placement, assignment=dict(zip(graph.ids, devs.tolist(), strict=True)),
                   graph=placement.graph or graph.name, meta=dict(placement.meta))

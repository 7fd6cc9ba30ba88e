"""A placement in the formats other tools read (docs/runtime.md): `torch.distributed.pipelining` split points,
a Hugging Face style `device_map`, and plain JSON.

Both exports work on the *forward* ops of the captured graph in program (capture) order, with their module
paths; backward and optimizer ops follow their forward op (their colocation group), as they do at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from devplace.errors import PlacementError
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import Placement
from devplace.hardware.cluster import Cluster
from devplace.sim import simulate

__all__ = ["DeviceMap", "ExportError", "PipelineSplit", "device_map", "export_json", "pipeline_split",
           "placement_from_module_map"]


class ExportError(PlacementError):
    """A placement cannot be expressed in the asked format (the message says why)."""


def _module(graph: CompGraph, v: int) -> str:
    return str(graph.node_extra[v].get("module", "")) if graph.node_extra else ""


def _forward_ops(graph: CompGraph) -> list[int]:
    """Forward op nodes (not inputs), in program order (the capture records them in execution order)."""
    return [v for v in range(graph.num_nodes) if graph.kind[v] == "forward" and graph.op[v] != "input"]


def _devices(graph: CompGraph, placement: Placement) -> np.ndarray:
    if placement.graph and graph.name and placement.graph != graph.name:
        raise ExportError(f"the placement is for graph {placement.graph!r}, not {graph.name!r}")
    return placement.to_array(graph, max(placement.assignment.values(), default=0) + 1)


# ------------------------------------------------------------------------------------------ pipeline
@dataclass(frozen=True)
class PipelineSplit:
    """Stages in program order: `devices[i]` runs stage i; stage i > 0 begins at module `split_points[i-1]`."""

    devices: tuple[int, ...]
    split_points: tuple[str, ...]
    first_ops: tuple[str, ...]  # the first captured op of each stage

    def split_spec(self) -> dict[str, Any]:
        """`{module name: SplitPoint.BEGINNING}` for `torch.distributed.pipelining.pipeline(split_spec=...)`."""
        from torch.distributed.pipelining import SplitPoint

        return {name: SplitPoint.BEGINNING for name in self.split_points}

    def to_dict(self) -> dict[str, Any]:
        return {"format": "devplace.pipeline/1", "stage_devices": list(self.devices),
                "split_points": [{"module": m, "point": "beginning"} for m in self.split_points],
                "stage_first_ops": list(self.first_ops)}


def pipeline_split(graph: CompGraph, placement: Placement) -> PipelineSplit:
    """The placement as pipeline stages split at module boundaries, or an `ExportError` saying why it is not one.

    A pipeline stage is one device running a contiguous run of the forward program; so every device must own
    one contiguous run of forward ops, and each stage after the first must begin where a submodule's call
    begins (torch.distributed.pipelining splits the traced program at module calls).
    """
    devs = _devices(graph, placement)
    fwd = _forward_ops(graph)
    # trailing ops of the root module are the loss the capture added after the model's forward (or the root's
    # own last ops): a pipeline computes the loss in its last stage, wherever the placement put them
    while len(fwd) > 1 and not _module(graph, fwd[-1]):
        fwd.pop()
    if not fwd:
        raise ExportError(f"graph {graph.name!r} has no forward ops to split")
    runs: list[tuple[int, int]] = []  # (device, index into fwd where the run starts)
    for i, v in enumerate(fwd):
        if not runs or runs[-1][0] != int(devs[v]):
            runs.append((int(devs[v]), i))
    seen: dict[int, int] = {}
    for k, (d, i) in enumerate(runs):
        if d in seen:
            prev = runs[seen[d]]
            raise ExportError(
                f"device {d} runs two separate stretches of the forward program (from {graph.ids[fwd[prev[1]]]!r} "
                f"and again from {graph.ids[fwd[i]]!r}, with device {runs[k - 1][0]} in between), so the placement "
                "is not contiguous along the program's topological order and is no pipeline; place it with "
                "`--placer contiguous` for a pipeline export")
        seen[d] = k
    first_of: dict[str, int] = {}  # module -> index of its first forward op (program order)
    last_of: dict[str, int] = {}
    for i, v in enumerate(fwd):
        m = _module(graph, v)
        parts = m.split(".") if m else []
        for j in range(1, len(parts) + 1):
            name = ".".join(parts[:j])
            first_of.setdefault(name, i)
            last_of[name] = i
    points: list[str] = []
    for d, i in runs[1:]:
        m = _module(graph, fwd[i])
        parts = m.split(".") if m else []
        # the outermost module whose first op opens the stage and whose ops all lie in this stage or later
        name = next((".".join(parts[:j]) for j in range(1, len(parts) + 1)
                     if first_of[".".join(parts[:j])] == i), None)
        if name is None:
            prev = graph.ids[fwd[i - 1]]
            raise ExportError(f"the stage of device {d} begins at op {graph.ids[fwd[i]]!r}, inside module "
                              f"{m or '(root)'!r} right after {prev!r}: not at the start of a module call, where "
                              "torch.distributed.pipelining splits; coarsen to module boundaries or use a device_map")
        points.append(name)
    return PipelineSplit(tuple(d for d, _ in runs), tuple(points), tuple(graph.ids[fwd[i]] for _, i in runs))


# ------------------------------------------------------------------------------------------ device map
@dataclass(frozen=True)
class DeviceMap:
    """Module name -> logical device, the coarsest map that keeps every mapped module on one device, the
    op-level placement it implies, and the simulated step time of both."""

    mapping: dict[str, int]
    placement: Placement
    step_time_s: float
    op_level_step_time_s: float  # the op-level placement as the runtime runs it (backward with forward)

    @property
    def slowdown(self) -> float:
        """Step time of the module-level placement over the op-level one (1.0 = no loss)."""
        return self.step_time_s / self.op_level_step_time_s if self.op_level_step_time_s > 0 else float("nan")

    def named(self, devices: Sequence[str] | None = None) -> dict[str, Any]:
        """The map with real device names (`devices[i]` for logical i); integers (GPU indices) without."""
        return {m: (devices[d] if devices is not None else d) for m, d in self.mapping.items()}


def device_map(graph: CompGraph, placement: Placement, cluster: Cluster) -> DeviceMap:
    """A Hugging Face style device_map (module name -> device) for `placement`, at module granularity.

    A module maps to a device when all its forward ops run there; a module split across devices is not
    mapped, its submodules are. Ops of a split module's own code (not in any mapped submodule) run, as under
    accelerate's hooks, where their input is: here, on the device of the previous forward op. Each module
    is mapped to where the placement runs most of its forward compute when a parent must be split below
    module granularity (a leaf module whose ops span devices). The implied op placement (backward and
    optimizer ops with their group's forward op) is simulated, so the loss in step time is shown.
    """
    devs = _devices(graph, placement)
    fwd = _forward_ops(graph)
    module_devs: dict[str, set[int]] = {}
    children: dict[str, set[str]] = {}
    compute: dict[tuple[str, int], float] = {}
    for v in fwd:
        m = _module(graph, v)
        parts = m.split(".") if m else []
        names = [""] + [".".join(parts[:j]) for j in range(1, len(parts) + 1)]
        for j, name in enumerate(names):
            module_devs.setdefault(name, set()).add(int(devs[v]))
            compute[(name, int(devs[v]))] = compute.get((name, int(devs[v])), 0.0) + float(graph.compute_s[v])
            if j + 1 < len(names):
                children.setdefault(name, set()).add(names[j + 1])
    mapping: dict[str, int] = {}

    def visit(name: str) -> None:
        kids = children.get(name, set())
        if len(module_devs[name]) == 1 or not kids:
            mapping[name] = max(module_devs[name], key=lambda d: (compute.get((name, d), 0.0), -d))
            return
        for kid in sorted(kids, key=lambda k: _first_index(graph, fwd, k)):
            visit(kid)

    visit("")
    coarse = placement_from_module_map(graph, mapping)
    result = simulate(graph, cluster, coarse)
    from devplace.runtime.apply import runtime_placement

    base = simulate(graph, cluster, runtime_placement(graph, placement))
    return DeviceMap(mapping, coarse, result.step_time_s, base.step_time_s)


def _first_index(graph: CompGraph, fwd: list[int], name: str) -> int:
    for i, v in enumerate(fwd):
        m = _module(graph, v)
        if m == name or m.startswith(name + "."):
            return i
    return len(fwd)


def placement_from_module_map(graph: CompGraph, mapping: Mapping[str, int]) -> Placement:
    """The op placement a module map (a device_map with logical device indices) implies: each forward op on its
    innermost mapped module's device (an op of no mapped module: where the previous forward op runs), backward
    and optimizer ops with their group's forward op, inputs with their first consumer."""
    if not mapping:
        raise ExportError("the module map is empty; map at least the root module \"\" to a device")
    fwd = _forward_ops(graph)
    out = np.zeros(graph.num_nodes, dtype=np.int64)
    prev = next(iter(mapping.values()), 0)
    for v in fwd:
        m = _module(graph, v)
        parts = m.split(".") if m else []
        names = [".".join(parts[:j]) for j in range(len(parts), 0, -1)] + [""]
        d = next((mapping[n] for n in names if n in mapping), prev)
        out[v] = d
        prev = d
    index = graph.index
    for v in range(graph.num_nodes):
        if graph.kind[v] != "forward":
            g = graph.group[v]
            if g and g in index and graph.kind[index[g]] == "forward":
                out[v] = out[index[g]]
    for v in range(graph.num_nodes):  # an input lives where its first consumer runs
        if graph.op[v] == "input":
            succ = graph.successors(v)
            if succ:
                out[v] = out[succ[0]]
    return Placement.from_array(graph, out)


# ------------------------------------------------------------------------------------------ JSON
def export_json(graph: CompGraph, placement: Placement, devices: Sequence[str] | None = None) -> dict[str, Any]:
    """Plain JSON: the op-level placement (`devplace.placement/1`), each op's module and kind, and the real
    device of each logical index when `devices` is given."""
    devs = _devices(graph, placement)
    doc = placement.to_dict()
    doc["ops"] = {graph.ids[v]: {"device": int(devs[v]), "module": _module(graph, v), "kind": graph.kind[v]}
                  for v in range(graph.num_nodes)}
    if devices is not None:
        doc["devices"] = list(devices)
    return doc

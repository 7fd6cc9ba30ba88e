"""Hand-made module maps: a Hugging Face style device_map or a list of split points, as a `Placement`.

`placement_from_module_map(graph, cluster, module_map)` is what `devplace place --model M --map map.json`
evaluates, so a user's own split is simulated (and compared) exactly like a placer's output.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from devplace.errors import FormatError, PlacementError
from devplace.files import parse_json, read_limited
from devplace.graph.compgraph import CompGraph
from devplace.graph.modules import ancestors, forward_ops, module_of
from devplace.graph.placement import Placement, runtime_placement
from devplace.hardware.cluster import Cluster

__all__ = ["ModuleMapError", "placement_from_module_map", "read_module_map", "resolve_device"]

ModuleMap = Mapping[str, Any] | Sequence[str]


class ModuleMapError(PlacementError):
    """A module map names an unknown module or device, or leaves ops unmapped."""


def resolve_device(value: Any, cluster: Cluster, where: str) -> int:
    """A device_map value as a logical device index of `cluster`: an int i (a GPU index, as in HF maps),
    "cuda:i", or a device name of the cluster ("gpu1")."""
    names = [d.name for d in cluster.devices]
    d: int | None = None
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        d = int(value)
    elif isinstance(value, str):
        if value in names:
            d = names.index(value)
        elif value.startswith("cuda:") and value[5:].isdigit():
            d = int(value[5:])
    elif type(value).__name__ == "device" and getattr(value, "type", None) == "cuda":  # a torch.device
        d = int(value.index or 0)
    if d is None or not 0 <= d < cluster.num_devices:
        raise ModuleMapError(f"{where}: device {value!r} is not a device of cluster {cluster.name!r}; use an index "
                             f"0..{cluster.num_devices - 1}, cuda:i or one of {', '.join(names)}")
    return d


def _modules(graph: CompGraph, fwd: list[int]) -> list[str]:
    return [module_of(graph, v) or "" for v in fwd]


def _unknown(graph: CompGraph, key: str, known: Collection[str], what: str) -> ModuleMapError:
    close = difflib.get_close_matches(key, list(known), n=3)
    shown = sorted(k for k in known if k)[:5]
    hint = (f"did you mean {', '.join(map(repr, close))}?" if close else
            f"its modules include {', '.join(map(repr, shown))}" if shown else "it has no submodules")
    return ModuleMapError(f"the module map names {what} {key!r}, which runs no op of graph {graph.name!r}; {hint}")


def _split_list(graph: CompGraph, cluster: Cluster, fwd: list[int], mods: list[str],
                points: Sequence[str]) -> dict[int, int]:
    """Split points (module names, in program order) -> forward op position -> stage device."""
    first: dict[str, int] = {}
    for i, m in enumerate(mods):
        for name in ancestors(m):
            first.setdefault(name, i)
    if len(points) + 1 > cluster.num_devices:
        raise ModuleMapError(f"{len(points)} split points make {len(points) + 1} stages, but cluster "
                             f"{cluster.name!r} has {cluster.num_devices} devices")
    starts = []
    for p in points:
        if not isinstance(p, str) or p not in first or p == "":
            raise _unknown(graph, str(p), first, "split point")
        starts.append(first[p])
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise ModuleMapError(f"split points {list(points)} are not in program order (each must begin after the "
                             "previous one); list them as the forward pass calls them")
    return {i: sum(1 for s in starts if s <= i) for i in range(len(fwd))}


def _device_map(graph: CompGraph, cluster: Cluster, fwd: list[int], mods: list[str], mapping: Mapping[str, Any],
                tensors: Collection[str]) -> dict[int, int]:
    """A device_map -> forward op position -> device (see `placement_from_module_map`)."""
    known = {name for m in mods for name in ancestors(m)}
    resolved: dict[str, int] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ModuleMapError(f"module map keys are module names (strings), got {key!r}")
        if key not in known:
            if key in tensors:
                continue  # a parameter or buffer entry (a split module's own tensor): it places no op
            raise _unknown(graph, key, known, "module")
        resolved[key] = resolve_device(value, cluster, f"module map entry {key!r}")
    if not resolved:
        raise ModuleMapError("the module map maps no module of the graph; map at least the root module \"\"")
    # a module is split when one of its strict descendants is mapped: its own code (ops outside the mapped
    # children) runs where its input is, as under accelerate's hooks; any other unmapped op is an error
    split = {a for key in resolved for a in ancestors(key)[:-1]}
    out: dict[int, int] = {}
    orphans: dict[str, int] = {}
    for i, m in enumerate(mods):
        chain = ancestors(m)
        d = next((resolved[n] for n in reversed(chain) if n in resolved), None)
        if d is not None:
            out[i] = d
        elif m not in split:
            top = next(n for n in chain if n not in split)
            orphans.setdefault(top, i)
    if orphans:
        names = sorted(orphans, key=orphans.get)  # type: ignore[arg-type]
        raise ModuleMapError(f"the module map leaves the ops of {len(names)} module(s) unmapped, e.g. "
                             f"{', '.join(map(repr, names[:5]))} (first op {graph.ids[fwd[orphans[names[0]]]]!r}); "
                             "map them (or an enclosing module) to a device")
    # glue ops of split modules follow the previous op (the first ones: the first mapped op)
    prev = next(iter(out.values()))
    for i in range(len(fwd)):
        if i in out:
            prev = out[i]
        else:
            out[i] = prev
    return out


def placement_from_module_map(graph: CompGraph, cluster: Cluster, module_map: ModuleMap, *,
                              tensors: Collection[str] = ()) -> Placement:
    """The op placement of a hand-made module map of `graph` (a captured graph, module paths as the captured
    module's `named_modules()`), on `cluster`.

    `module_map` is either a Hugging Face style device_map, module name -> device (an int, "cuda:i" or a
    cluster device name; "" is the whole model), or a list of split points, module names in program order:
    stage 0 runs until the first split point's module begins, stage i on device i. Each forward op runs on
    its innermost mapped module's device; ops of a split module's own code (outside its mapped submodules)
    run where the previous op ran, as accelerate's hooks run them; backward and optimizer ops run with their
    forward op (their colocation group), inputs with their first consumer. `tensors`: parameter and buffer
    names that may appear as keys (accelerate maps a split module's own tensors by name); they place no op.

    Raises ModuleMapError for an unknown module or device and for ops of modules the map leaves unmapped.
    """
    fwd = forward_ops(graph)
    if not fwd:
        raise ModuleMapError(f"graph {graph.name!r} has no forward ops to map")
    mods = _modules(graph, fwd)
    if isinstance(module_map, Mapping):
        pos = _device_map(graph, cluster, fwd, mods, module_map, tensors)
    elif isinstance(module_map, Sequence) and not isinstance(module_map, str):
        pos = _split_list(graph, cluster, fwd, mods, module_map)
    else:
        raise ModuleMapError(f"a module map is a device_map (module -> device) or a list of split points, got "
                             f"{type(module_map).__name__}")
    out = np.zeros(graph.num_nodes, dtype=np.int64)
    for i, v in enumerate(fwd):
        out[v] = pos[i]
    # the rest as autograd runs it: backward and optimizer ops with their forward op, inputs with their consumer
    return runtime_placement(graph, Placement.from_array(graph, out, cluster=cluster.name))


def read_module_map(path: str | Path) -> dict[str, Any] | list[str]:
    """A module map from a JSON file: an object module -> device, a list of split points, or what
    `devplace export` writes (`devplace.device_map/1`'s "device_map", its names under the wrapped model its
    "module" names put back under it; `devplace.pipeline/1` or `/2`'s split points)."""
    try:
        text = read_limited(path).decode("utf-8")
    except FormatError as exc:  # missing, not a regular file, too large
        raise ModuleMapError(f"cannot read module map {exc}") from None
    except UnicodeDecodeError as exc:
        raise ModuleMapError(f"{path}: not UTF-8 text; a module map is a JSON file") from exc
    try:
        doc = parse_json(text, str(path), "a module map is a JSON object module -> device or a list of split points")
    except FormatError as exc:
        raise ModuleMapError(str(exc)) from None
    if isinstance(doc, dict) and doc.get("format") == "devplace.device_map/1":
        inner = doc.get("module") or ""
        if not isinstance(inner, str):
            raise ModuleMapError(f"{path}: \"module\" (the wrapped model the map's names are relative to) must be "
                                 f"a module name, got {inner!r}; export the plan again")
        doc = doc.get("device_map")
        if inner and isinstance(doc, dict):  # back to the captured (wrapper's) names
            doc = {(f"{inner}.{k}" if k else inner): d for k, d in doc.items()}
    elif isinstance(doc, dict) and doc.get("format") in [f"devplace.pipeline/{v}" for v in (1, 2, 3)]:
        points = doc.get("split_points")
        doc = [p.get("module") if isinstance(p, dict) else p for p in points] if isinstance(points, list) else None
    if isinstance(doc, dict) and "format" not in doc:
        return doc
    if isinstance(doc, list) and all(isinstance(p, str) for p in doc):
        return doc
    raise ModuleMapError(f"{path}: a module map is a JSON object module -> device (a Hugging Face device_map), a "
                         "list of split-point module names, or a devplace.device_map/1 or devplace.pipeline export")

"""A placement in the formats other tools read (docs/runtime.md): `torch.distributed.pipelining` split points,
a Hugging Face style `device_map`, and plain JSON.

Both exports work on the *forward* ops of the captured graph in program (capture) order, with their module
paths; backward and optimizer ops follow their forward op (their colocation group), as they do at run time.
Any placement exports: where a format cannot express it exactly (a pipeline is one contiguous run of module
calls per device; a device_map one device per module), the export is the nearest placement it can express,
and its simulated step time is reported next to the placement's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from devplace.errors import FormatError, PlacementError
from devplace.graph.compgraph import CompGraph
from devplace.graph.jsonio import read_json
from devplace.graph.modules import ancestors, forward_ops, has_modules, module_of, module_starts
from devplace.graph.placement import Placement, runtime_placement
from devplace.hardware.cluster import Cluster
from devplace.runtime.module_map import placement_from_module_map
from devplace.sim import simulate
from devplace.sim.schedule import V_SHAPED, Schedule, ScheduleError
from devplace.units import fmt_time

__all__ = ["PIPELINE_FORMAT", "PRECISIONS", "DeviceMap", "ExportError", "PipelineExport", "PipelineSplit",
           "callable_modules", "default_schedule", "device_map", "export_json", "pipeline_split", "read_export_doc",
           "read_pipeline", "read_precision", "wrapped_module"]

PIPELINE_FORMAT = "devplace.pipeline/3"  # /3 may carry "precision" (an older devplace would run it in fp32)
PIPELINE_OLDER = ("devplace.pipeline/2",)  # read too: the same document, in fp32 where it records no precision


class ExportError(PlacementError):
    """A placement cannot be expressed in the asked format (the message says why)."""


def _module(graph: CompGraph, v: int) -> str:
    return module_of(graph, v) or ""


def _devices(graph: CompGraph, placement: Placement) -> np.ndarray:
    if placement.graph and graph.name and placement.graph != graph.name:
        raise ExportError(f"the placement is for graph {placement.graph!r}, not {graph.name!r}")
    return placement.to_array(graph, max(placement.assignment.values(), default=0) + 1)


def _module_devices(graph: CompGraph, placement: Placement) -> np.ndarray:
    """`_devices`, for the exports that need module paths."""
    if not has_modules(graph):
        raise ExportError(f"graph {graph.name!r} has no module paths (it is not a PyTorch capture), so there are no "
                          "modules to split or map; export it as json")
    return _devices(graph, placement)


def _forward_work(graph: CompGraph) -> np.ndarray:
    """Per node: for a forward op, the compute of everything that runs with it (its colocation group's backward
    and optimizer ops); 0 for the others. What a device gains or loses when the op moves."""
    work = np.zeros(graph.num_nodes, dtype=np.float64)
    index = graph.index
    for v in range(graph.num_nodes):
        u = index.get(graph.group[v], v) if graph.group[v] else v
        work[u if graph.kind[u] == "forward" else v] += float(graph.compute_s[v])
    return work


def _costs(graph: CompGraph, cluster: Cluster | None, placement: Placement,
           exported: Placement) -> tuple[float | None, float | None, bool | None]:
    """Simulated step time of the exported placement, of the placement as the runtime runs it, and whether the
    exported one fits memory (all None without a cluster)."""
    if cluster is None:
        return None, None, None
    base = runtime_placement(graph, placement)
    exp = simulate(graph, cluster, exported)
    same = base.assignment == exported.assignment
    return exp.step_time_s, exp.step_time_s if same else simulate(graph, cluster, base).step_time_s, exp.feasible


# ------------------------------------------------------------------------------------------ pipeline
@dataclass(frozen=True)
class PipelineSplit:
    """Stages in program order: `devices[i]` runs stage i; stage i > 0 begins at module `split_points[i-1]`.

    `placement` is the op placement the stages run (forward ops by stage, the rest with their forward op);
    `moved_fraction` the share of the forward work (with its backward and optimizer ops) that it runs on
    another device than the exported placement did; `step_time_s` and `op_level_step_time_s` the simulated
    (unpipelined) step of the stages and of the exported placement as the runtime runs it, `feasible` whether
    the stages fit memory (None without a cluster: moving work between devices can overfill one). `schedule`
    is the micro-batch schedule the stages run; `pipelined_step_time_s` their step simulated under it (None
    without a cluster, or when the stages do not run along the device indices, as the simulator requires)."""

    devices: tuple[int, ...]
    split_points: tuple[str, ...]
    first_ops: tuple[str, ...]  # the first captured op of each stage
    placement: Placement
    moved_fraction: float
    step_time_s: float | None = None
    op_level_step_time_s: float | None = None
    feasible: bool | None = None
    schedule: Schedule | None = None
    pipelined_step_time_s: float | None = None
    unsimulated: str | None = None  # why the stages were not simulated pipelined (with a cluster)

    @property
    def slowdown(self) -> float | None:
        """Step time of the stages over the op-level placement's (1.0 = no loss); None without a cluster."""
        if self.step_time_s is None or not self.op_level_step_time_s:
            return None
        return self.step_time_s / self.op_level_step_time_s

    def split_spec(self) -> dict[str, Any]:
        """`{module name: SplitPoint.BEGINNING}` for `torch.distributed.pipelining.pipeline(split_spec=...)`."""
        return _split_spec(self.split_points)

    def summary(self) -> str:
        """One line (`devplace export`): the stages and schedule, their simulated pipelined step, and how much
        forward work the split moved off the placement to cut where the runtime can (with the unpipelined
        steps of both), so that a moved cut never goes unsaid."""
        s = self.schedule or default_schedule(len(self.devices))
        text = (f"{len(self.devices)} pipeline stage(s), split at {', '.join(self.split_points) or 'nothing'}; "
                f"{s.kind} schedule, {s.microbatches} micro-batch(es)")
        if self.pipelined_step_time_s is not None:
            text += f"; simulated pipelined step {fmt_time(self.pipelined_step_time_s)}"
        elif self.step_time_s is not None:
            text += f"; not simulated pipelined ({self.unsimulated})"
        if self.moved_fraction > 0:
            text += f"; moved {100 * self.moved_fraction:.1f}% of the forward work to cut at module starts"
            if self.step_time_s is not None and self.op_level_step_time_s is not None:
                text += (f" (unpipelined step {fmt_time(self.step_time_s)} vs {fmt_time(self.op_level_step_time_s)} "
                         f"as placed, {self.slowdown:.3f}x)")
        return text

    def to_dict(self) -> dict[str, Any]:
        """The `devplace.pipeline/3` document (`read_pipeline` reads it back)."""
        schedule = self.schedule or default_schedule(len(self.devices))
        return {"format": PIPELINE_FORMAT, "stage_devices": list(self.devices),
                "split_points": [{"module": m, "point": "beginning"} for m in self.split_points],
                "schedule": schedule.to_dict(),
                "stage_first_ops": list(self.first_ops), "moved_fraction": self.moved_fraction,
                "step_time_s": self.step_time_s, "op_level_step_time_s": self.op_level_step_time_s,
                "pipelined_step_time_s": self.pipelined_step_time_s, "feasible": self.feasible}


def _split_spec(points: Sequence[str]) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint

    return {name: SplitPoint.BEGINNING for name in points}


def default_schedule(stages: int) -> Schedule:
    """The schedule an export gets when its placement was made without one: 1F1B with one micro-batch per
    stage, the fewest that let every stage work at once."""
    return Schedule("1f1b", microbatches=max(stages, 1))


@dataclass(frozen=True)
class PipelineExport:
    """A `devplace.pipeline/3` (or /2) document read back and checked: the split points (stage i > 0 begins at module
    `split_points[i-1]`), the logical device of each stage, the schedule, the model `source` of the plan it
    came from (a zoo name with batch and sequence length, as in `devplace.plan/1` settings; None when unknown)
    with its model's parameter count (`source_params`, checked against the model before it is built), and the
    whole document."""

    split_points: tuple[str, ...]
    stage_devices: tuple[int, ...]
    schedule: Schedule
    source: dict[str, Any] | None
    doc: dict[str, Any]

    @property
    def source_params(self) -> int | None:
        """The parameter count of the model the export was made for (None: not recorded, an older export)."""
        params = self.doc.get("source_params")
        return params if isinstance(params, int) else None

    @property
    def precision(self) -> dict[str, str]:
        """The precision the plan's steps run in (`read_precision`; empty: fp32)."""
        return read_precision(self.doc, "the pipeline export")

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def processes(self) -> int:
        """One per device: the stages are laid out round the devices, V per device under interleaved-1f1b."""
        return len(set(self.stage_devices))

    def split_spec(self) -> dict[str, Any]:
        """`{module name: SplitPoint.BEGINNING}` for `torch.distributed.pipelining.pipeline(split_spec=...)`."""
        return _split_spec(self.split_points)


PRECISIONS = {"dtype": ("fp32", "bf16", "fp16"), "autocast": ("bfloat16", "float16")}


def read_precision(doc: Mapping[str, Any], where: str) -> dict[str, str]:
    """An export's "precision" (written from `runtime.run.precision_record`: "dtype", the precision a plan made
    with `dtype=` casts the model and inputs to; "autocast", the torch dtype an amp plan's forward and loss run
    under autocast to), checked; {} where the export records none (fp32). ExportError when it is malformed."""
    rec = doc.get("precision", {})
    if not isinstance(rec, Mapping) or any(k not in PRECISIONS or rec[k] not in PRECISIONS[k] for k in rec):
        allowed = "; ".join(f"{k}: {', '.join(v)}" for k, v in PRECISIONS.items())
        raise ExportError(f"{where}: precision must be an object with \"dtype\" and/or \"autocast\" ({allowed}), got "
                          f"{rec!r:.80}; re-export the plan")
    return dict(rec)


def read_export_doc(source: str | Path | Mapping[str, Any], fmt: str, kind: str, *, note: str = "",
                    older: Sequence[str] = ()) -> tuple[dict[str, Any], str]:
    """The document of an export `source` (a file or its parsed document) of format `fmt` or one of its `older`
    versions still read, written by `devplace export PLAN --format KIND`, and the name messages give it; an
    ExportError (with `note` after the formats it wants) when it is not one."""
    where = str(source) if not isinstance(source, Mapping) else f"{kind} export"
    fix = f"re-export the plan with `devplace export PLAN --format {kind}`"
    try:
        doc = dict(source) if isinstance(source, Mapping) else read_json(source, fmt, older=older)
    except FormatError as exc:
        raise ExportError(f"{exc}; {fix}") from None
    if doc.get("format") != fmt and doc.get("format") not in older:
        wanted = " or ".join(repr(f) for f in (fmt, *older))
        raise ExportError(f"{where}: format {doc.get('format')!r} is not {wanted}{note}; {fix}")
    return doc, where


def read_pipeline(source: str | Path | Mapping[str, Any]) -> PipelineExport:
    """A pipeline export (a `devplace.pipeline/3` or /2 file or its parsed document), checked: split points are
    distinct module names, one fewer than the stages, and the schedule is a valid `Schedule` with one model
    chunk per device (interleaved schedules are not exported). An ExportError says what is wrong."""
    doc, where = read_export_doc(source, PIPELINE_FORMAT, "pipeline", older=PIPELINE_OLDER,
                                 note=" (the versions that carry the schedule)")
    points = doc.get("split_points")
    names: list[str] = []
    if isinstance(points, list):
        for pt in points:
            if not isinstance(pt, dict) or not isinstance(pt.get("module"), str) or pt.get("point") != "beginning":
                raise ExportError(f"{where}: each split point is {{\"module\": NAME, \"point\": \"beginning\"}}, "
                                  f"got {pt!r}")
            names.append(pt["module"])
    else:
        raise ExportError(f"{where}: split_points must be a list, got {points!r}")
    if len(set(names)) != len(names):
        raise ExportError(f"{where}: split points repeat a module: {names}")
    devices = doc.get("stage_devices")
    if (not isinstance(devices, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                 for d in devices) or len(devices) != len(names) + 1):
        raise ExportError(f"{where}: stage_devices must list one device index >= 0 per stage ({len(names) + 1} "
                          f"for {len(names)} split point(s)), got {devices!r}")
    try:
        schedule = Schedule.from_dict(doc.get("schedule"))
    except ScheduleError as exc:
        raise ExportError(f"{where}: {exc}") from None
    chunks = int(schedule.chunks or 1)
    p = len(devices) // chunks
    if schedule.kind in V_SHAPED:  # stage s and stage 2p - 1 - s on one device
        if len(devices) % 2 or len(set(devices)) != p or devices != devices[:p] + devices[:p][::-1]:
            raise ExportError(f"{where}: a {schedule.kind} schedule runs 2p stages on p devices in a V (stages s and "
                              f"2p - 1 - s on one device, the first p on distinct devices), got stage_devices "
                              f"{devices}")
    elif len(devices) % chunks or len(set(devices)) != p or any(d != devices[i % p] for i, d in enumerate(devices)):
        raise ExportError(f"{where}: a {schedule.kind} schedule with {chunks} chunk(s) per device runs stage s on "
                          f"the device of stage s mod p ({chunks} stages per device, the devices distinct within "
                          f"each round), got stage_devices {devices}")
    source_doc = doc.get("source")
    if source_doc is not None and not isinstance(source_doc, dict):
        raise ExportError(f"{where}: source must be an object (the plan's model source), got {source_doc!r}")
    read_precision(doc, where)
    params = doc.get("source_params")
    if params is not None and (isinstance(params, bool) or not isinstance(params, int) or params < 0):
        raise ExportError(f"{where}: source_params must be the model's parameter count (an integer >= 0), got "
                          f"{params!r:.60}")
    return PipelineExport(tuple(names), tuple(devices), schedule, source_doc, doc)


def _monotone_stages(cost: np.ndarray) -> list[int]:
    """Stage (row of `cost`, non-decreasing along the units) of each unit minimising the summed cost[stage, unit];
    a stage may be skipped. Dynamic programming, O(stages x units); ties go to the earlier stage."""
    s, n = cost.shape
    best = np.zeros((n + 1, s), dtype=np.float64)
    choice = np.zeros((n, s), dtype=np.int64)
    for u in range(n):
        run = np.minimum.accumulate(best[u])  # the best of stages <= j so far
        arg = np.zeros(s, dtype=np.int64)
        for j in range(1, s):
            arg[j] = arg[j - 1] if best[u][arg[j - 1]] <= best[u][j] else j
        best[u + 1] = run + cost[:, u]
        choice[u] = arg
    stages = [0] * n
    j = int(np.argmin(best[n]))
    for u in range(n - 1, -1, -1):
        stages[u] = j
        j = int(choice[u][j])
    return stages


def _round_stages(fdev: np.ndarray, fwork: np.ndarray, bounds: list[int], chunks: int) -> tuple[list[int], list[int]]:
    """Stages of an interleaved placement (`chunks` per device): each unit (a run of forward ops from one module
    start to the next) goes where most of its forward work is placed, and a stage is a run of units on one device.
    Returns (the device of each stage, the stage of each unit), or an ExportError unless the stages go round the
    devices `chunks` times in one order, as torch's interleaved schedules run them."""
    unit_dev: list[int] = []
    for a, b in itertools.pairwise(bounds):
        share: dict[int, float] = {}
        for d, w in zip(fdev[a:b].tolist(), fwork[a:b].tolist(), strict=True):
            share[d] = share.get(d, 0.0) + w
        unit_dev.append(max(share, key=lambda d: (share[d], -d)))
    order: list[int] = []
    stage_of: list[int] = []
    for d in unit_dev:
        if not order or order[-1] != d:
            order.append(d)
        stage_of.append(len(order) - 1)
    p = len(set(order))
    if len(order) != p * chunks or any(d != order[i % p] for i, d in enumerate(order)):
        raise ExportError(f"the placement's stages run on devices {order}, not {chunks} rounds of the same {p} "
                          f"devices, as an interleaved schedule with {chunks} chunks per device runs them; export "
                          "a placement made for that schedule, or export with --schedule 1f1b")
    return order, stage_of


def callable_modules(model: Any) -> set[str]:
    """Names of the modules of `model` that can be called (have a forward; not ModuleList/ModuleDict)."""
    from torch import nn

    return {n for n, m in model.named_modules() if type(m).forward is not nn.Module.forward}


def pipeline_split(graph: CompGraph, placement: Placement, cluster: Cluster | None = None,
                   model: Any = None, schedule: Schedule | None = None) -> PipelineSplit:
    """Pipeline stages for any placement of a captured graph: one contiguous run of whole module calls per
    device, in program order, as near the placement as such a split gets.

    A pipeline stage is one device running a contiguous run of the forward program, and each stage after the
    first begins where a module call begins (torch.distributed.pipelining splits the traced program there).
    So the forward program is cut into units at every module call's beginning (`module_starts`); the stage
    order is the devices' order along the program (the point where half of each device's forward work is done); and each
    unit goes to a stage, stages non-decreasing along the program, such that the least forward work (with its
    backward and optimizer ops) moves off its placed device (exact, by dynamic programming). Ops without
    compute (`arange`, `empty`, views) have no say: they go with their unit. The `pipeline` placer cuts a
    captured model only at these points (its `cuts="modules"`), so its placements export as placed: nothing
    moves and the exported stages are the ones its search simulated. The trailing ops of the root
    module (the loss the capture added) run in the last stage. With `cluster`, the stages' step time is
    simulated next to the placement's own (as the runtime runs it), so the loss of the approximation shows.
    With `model` (the captured module), a split point may be a module without ops of its own (an
    `nn.Sequential`); without it, the innermost module that begins there and has ops of its own is named.
    `schedule` is the micro-batch schedule the export carries: by default the one the placement was made for
    (`placement.schedule`), else `default_schedule`. Under an interleaved schedule (V chunks per device) the stages
    are the placement's own runs of units on one device (`_round_stages`: each unit where most of its work is),
    which must go round the devices V times in one order.
    """
    schedule = schedule or placement.schedule
    if schedule is not None and schedule.kind in V_SHAPED:
        raise ExportError(f"a placement cannot be exported as a pipeline under {schedule.kind}: its V runs stages "
                          "p - 1 and p on one device, which a placement does not tell apart; export a plan placed "
                          f"with --chunks 2 as --format parallel --schedule {schedule.kind} (its 2p stages laid out "
                          "as a V), or as a pipeline under zero-bubble or 1f1b")
    devs = _module_devices(graph, placement)
    fwd = forward_ops(graph)
    if not fwd:
        raise ExportError(f"graph {graph.name!r} has no forward ops to split")
    body = len(fwd)
    while body > 1 and not _module(graph, fwd[body - 1]):
        body -= 1
    mods = [_module(graph, v) for v in fwd[:body]]
    starts = module_starts(mods, callable_modules(model) if model is not None else None)
    bounds = [0, *sorted(starts), body]
    work = _forward_work(graph)
    fdev = devs[np.asarray(fwd[:body], dtype=np.int64)]
    fwork = work[np.asarray(fwd[:body], dtype=np.int64)]
    # stage order: where each device's forward work is half done ("forward order decides")
    used = sorted({int(d) for d, w in zip(fdev, fwork, strict=True) if w > 0}) or [int(fdev[0])]
    middle: dict[int, float] = {}
    for d in used:
        mine = np.cumsum(np.where(fdev == d, fwork, 0.0))
        middle[d] = float(np.searchsorted(mine, mine[-1] / 2.0)) if mine[-1] > 0 else 0.0
    order = sorted(used, key=lambda d: (middle[d], d))
    units = len(bounds) - 1
    if schedule is not None and int(schedule.chunks or 1) > 1:
        order, stage_of = _round_stages(fdev, fwork, bounds, int(schedule.chunks or 1))
    else:
        cost = np.zeros((len(order), units), dtype=np.float64)
        for u in range(units):
            a, b = bounds[u], bounds[u + 1]
            unit_total = float(fwork[a:b].sum())
            for j, d in enumerate(order):
                cost[j, u] = unit_total - float(fwork[a:b][fdev[a:b] == d].sum())
        stage_of = _monotone_stages(cost)
    out = devs.copy()
    moved = 0.0
    for u in range(units):
        d = order[stage_of[u]]
        for i in range(bounds[u], bounds[u + 1]):
            moved += float(fwork[i]) if int(fdev[i]) != d else 0.0
            out[fwd[i]] = d
    last = order[stage_of[-1]]
    for v in fwd[body:]:
        out[v] = last
    exported = runtime_placement(graph, Placement.from_array(graph, out, cluster=placement.cluster))
    stage_devices: list[int] = []
    points: list[str] = []
    first_ops: list[str] = []
    for u in range(units):
        d = order[stage_of[u]]
        if not stage_devices or stage_devices[-1] != d:
            if stage_devices:
                points.append(starts[bounds[u]])
            stage_devices.append(d)
            first_ops.append(graph.ids[fwd[bounds[u]]])
    fw_total = float(fwork.sum())
    step, base, feasible = _costs(graph, cluster, placement, exported)
    schedule = schedule or default_schedule(len(stage_devices))
    pipelined, why = None, None
    if cluster is not None:
        try:  # stages out of device order, or a graph of one micro-batch of another M: not timed as a pipeline
            pipelined = simulate(graph, cluster, exported, schedule=schedule).step_time_s
        except ScheduleError as exc:
            why = str(exc)
    return PipelineSplit(tuple(stage_devices), tuple(points), tuple(first_ops), exported,
                         moved / fw_total if fw_total > 0 else 0.0, step, base, feasible, schedule, pipelined, why)


# ------------------------------------------------------------------------------------------ device map
@dataclass(frozen=True)
class DeviceMap:
    """Module (or, for a split module's own tensors, parameter/buffer) name -> logical device, the op-level
    placement it implies, and the simulated step time of both."""

    mapping: dict[str, int]
    placement: Placement
    step_time_s: float
    op_level_step_time_s: float  # the op-level placement as the runtime runs it (backward with forward)
    feasible: bool = True  # whether the implied placement fits memory (moving modules can overfill a device)
    module: str = ""  # the submodule holding all the model's tensors when the captured one wraps it (`wrapped_module`)

    @property
    def slowdown(self) -> float:
        """Step time of the module-level placement over the op-level one (1.0 = no loss)."""
        return self.step_time_s / self.op_level_step_time_s if self.op_level_step_time_s > 0 else float("nan")

    def named(self, devices: Sequence[str] | None = None) -> dict[str, Any]:
        """The map with real device names (`devices[i]` for logical i); integers (GPU indices) without."""
        return {m: (devices[d] if devices is not None else d) for m, d in self.mapping.items()}

    def own(self, devices: Sequence[str] | None = None) -> dict[str, Any]:
        """`named(devices)` in the names of the model itself: relative to `module` (a loss wrapper's model, e.g.
        the Hugging Face model that `from_pretrained` builds), entries outside it dropped (they hold no tensor:
        `wrapped_module` found them all inside)."""
        if not self.module:
            return self.named(devices)
        prefix = self.module + "."
        return {("" if m == self.module else m[len(prefix):]): d for m, d in self.named(devices).items()
                if m in ("", self.module) or m.startswith(prefix)}


def _module_mapping(graph: CompGraph, devs: np.ndarray, work: np.ndarray, model: Any) -> dict[str, int]:
    """The coarsest called modules whose forward ops all run on one device; a leaf split across devices goes
    where most of its work runs."""
    module_devs: dict[str, set[int]] = {}
    children: dict[str, list[str]] = {}
    share: dict[tuple[str, int], float] = {}
    for v in forward_ops(graph):
        names = ancestors(_module(graph, v))
        d = int(devs[v])
        for j, name in enumerate(names):
            module_devs.setdefault(name, set()).add(d)
            share[(name, d)] = share.get((name, d), 0.0) + float(work[v])
            if j + 1 < len(names) and names[j + 1] not in children.setdefault(name, []):
                children[name].append(names[j + 1])  # in program order of first op
    mapping: dict[str, int] = {}
    called = {_module(graph, v) for v in forward_ops(graph)} | (callable_modules(model) if model is not None else set())

    def visit(name: str) -> None:
        kids = children.get(name, [])
        # a container that is never called (a ModuleList) has no hook of its own: map its children
        if not kids or (len(module_devs[name]) == 1 and (name in called or name == "")):
            mapping[name] = max(module_devs[name], key=lambda d: (share.get((name, d), 0.0), -d))
            return
        for kid in kids:
            visit(kid)

    if module_devs:
        visit("")
    return mapping


def _covering(mapping: dict[str, int], name: str) -> str | None:
    """The innermost key of `mapping` that is `name` or a module enclosing it."""
    parts = name.split(".")
    for j in range(len(parts), 0, -1):
        key = ".".join(parts[:j])
        if key in mapping:
            return key
    return "" if "" in mapping else None


class _StateMap:
    """Completing a module map over a model's `state_dict()` (see `device_map`)."""

    def __init__(self, mapping: dict[str, int], model: Any) -> None:
        self.mapping = dict(mapping)
        self.modules = dict(model.named_modules())
        self.canonical: dict[int, str] = {}  # tensor -> its first name (named_parameters/buffers order)
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            self.canonical.setdefault(id(t), n)
        self.state = model.state_dict(keep_vars=True)

    def base(self, name: str) -> str:
        return self.canonical.get(id(self.state[name]), name)

    def _split(self, key: str) -> None:
        """Replace entry `key` by its children and its own tensors (by name), on the same device."""
        d = self.mapping.pop(key)
        mod = self.modules[key]
        prefix = f"{key}." if key else ""
        for child, _ in mod.named_children():
            self.mapping[prefix + child] = d
        for n, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if prefix + n in self.state:
                self.mapping[prefix + n] = d

    def tie(self, target: dict[str, int]) -> None:
        """Put every name of a tied tensor (`target`: base name -> device) under an entry on that device: an
        entry elsewhere is split down to the name's own module, which then maps to the device."""
        for name in self.state:
            d = target.get(self.base(name))
            if d is None:
                continue
            owner = name.rpartition(".")[0]
            while (key := _covering(self.mapping, name)) is not None and self.mapping[key] != d:
                if key in (name, owner):
                    self.mapping[key] = d
                else:
                    self._split(key)

    def cover(self, homes: dict[str, int]) -> None:
        """Map every tensor under no entry where its first consumer runs (`homes`: base name -> device): the
        outermost enclosing module that is not split (a module that ran no op) or else the tensor by name."""
        fallback = next(iter(self.mapping.values()), 0)
        for name in self.state:
            if _covering(self.mapping, name) is not None:
                continue
            is_split = {a for k in self.mapping for a in ancestors(k)[:-1]}
            free = next((a for a in ancestors(name.rpartition(".")[0]) if a and a not in is_split), None)
            self.mapping[free if free is not None else name] = homes.get(self.base(name), fallback)


def wrapped_module(model: Any) -> str:
    """The name of the one child of `model` that holds all its parameters and buffers when `model` holds none of
    its own (a loss wrapper such as the zoo's around a Hugging Face or torchvision model: its tensors are named
    `model.*`); "" when `model` is not such a wrapper. One level only: the wrapped model's names are its own."""
    from torch import nn

    if any(True for _ in model.parameters(recurse=False)) or any(True for _ in model.buffers(recurse=False)):
        return ""

    def holds(m: nn.Module) -> bool:
        return any(True for _ in m.parameters()) or any(True for _ in m.buffers())

    holders = [name for name, child in model.named_children() if holds(child)]
    return holders[0] if len(holders) == 1 else ""


def device_map(graph: CompGraph, placement: Placement, cluster: Cluster, model: Any = None,
               example_inputs: Any = None) -> DeviceMap:
    """A Hugging Face style device_map (module name -> device) for `placement`, at module granularity.

    A module maps to a device when all its forward ops run there; a module split across devices is not
    mapped, its submodules are (a leaf whose ops span devices goes where most of its work runs). Ops of a
    split module's own code (not in any mapped submodule) run, as under accelerate's hooks, where their input
    is: here, on the device of the previous forward op.

    With `model` and `example_inputs` (the captured module and its inputs), the map covers every entry of
    `model.state_dict()`, as accelerate requires. Each tensor's first consumer op is found by tracing (the
    capture's own op ids). A tied tensor (several names) goes where its first consumer runs under the
    module map, and every entry holding one of its names is moved there (an enclosing entry is split down
    to the name's own module). Then a tensor under no entry (a split module's own, as ViT's class_token; a
    buffer such as BART's final_logits_bias; the weights of a child module its parent reads without calling
    it) maps where its first consumer runs under the resulting map: its outermost enclosing module that ran
    no op, or else the tensor by name, as accelerate's own `infer_auto_device_map` does. The implied op
    placement (backward and optimizer ops with their forward op) is simulated, so the loss in step time
    against the placement as the runtime runs it is shown. `DeviceMap.module` names the wrapped model when
    `model` is a loss wrapper (`wrapped_module`), so that `DeviceMap.own()` gives the map in its own names.
    """
    devs = _module_devices(graph, placement)
    mapping = _module_mapping(graph, devs, _forward_work(graph), model)
    if not mapping:
        raise ExportError(f"graph {graph.name!r} has no forward ops to map")
    known = {a for v in forward_ops(graph) for a in ancestors(_module(graph, v))}

    def implied(m: dict[str, int]) -> Placement:
        return placement_from_module_map(graph, cluster, m, tensors=[k for k in m if k not in known])

    coarse = implied(mapping)
    if model is not None:
        if example_inputs is None:
            raise ExportError("a complete device_map needs the model's example inputs as well (to find where each "
                              "parameter is first used); pass example_inputs=")
        from devplace.runtime.apply import state_first_ops

        first = state_first_ops(model, example_inputs)
        strangers = sorted(op for op in first.values() if op not in graph.index)
        if strangers:
            raise ExportError(f"the model's forward reads its parameters in ops the graph {graph.name!r} does not "
                              f"have (e.g. {strangers[0]!r}): the model or its inputs are not the ones captured; "
                              "map the model the plan was made for")
        sm = _StateMap(mapping, model)
        names: dict[str, int] = {}
        for name in sm.state:
            names[sm.base(name)] = names.get(sm.base(name), 0) + 1
        sm.tie({b: coarse.assignment[first[b]] for b, k in names.items() if k > 1 and b in first})
        coarse = implied(sm.mapping)
        sm.cover({b: coarse.assignment[op] for b, op in first.items()})
        mapping = sm.mapping  # the entries cover() adds place no op: `coarse` stays the implied placement
    step, base, feasible = _costs(graph, cluster, placement, coarse)
    assert step is not None and base is not None and feasible is not None
    return DeviceMap(mapping, coarse, step, base, feasible, wrapped_module(model) if model is not None else "")


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

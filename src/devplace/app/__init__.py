"""The application layer: one function per user task, each returning a result object that summarises itself
(rich renderable via `__rich__`, plain `text()`, and `to_dict()` for `--json`).

The CLI (`devplace.cli`) parses arguments, calls one of these and prints what it returns; it holds no
pipeline logic. Tasks that need only graphs, clusters, placers and the simulator live here; the ones that
need torch (capturing models, running them, the learned placers, studies) or the study report's plotting
stack live in `devplace.app.with_torch`, reached through `torch_tasks()`: the one lazy import boundary, so
that `devplace --help` and the commands that do not place (simulate, bound, info, clusters, order, orders,
features) start without loading torch (`tests/test_layers.py` checks `--help`). A command that places does load
it: the placer registry imports every placer module, the learned ones (torch) included. Both sit above
`runtime/` and `study/`; the pure "plan a graph" stitching they share is `devplace.planning`, below those.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Group
from rich.text import Text

from devplace.defaults import (
    AUTO_PLACER,
    DEFAULT_ORDER,
    DEFAULT_PLACER,
    DEFAULT_SEED,
    DEFAULT_SIM_MODEL,
    RECOMMEND_PLACER,
)
from devplace.errors import DevplaceError
from devplace.files import (
    CSV_CURVE,
    JSON_LINES_RUN,
    PNG,
    TRACE,
    Kind,
    OutputPathError,
    check_output,
    json_kind,
    output_folder,
    protect,
)
from devplace.graph import load_graph, load_placement
from devplace.graph.compgraph import CompGraph
from devplace.graph.parallel import ParallelAsk
from devplace.graph.schedule import V_SHAPED
from devplace.hardware.cluster import Cluster, load_cluster
from devplace.hardware.cost import CostTable, apply_overheads, check_table_fits
from devplace.orders.auto import Recommendation, load_order_model, recommend_order
from devplace.placers import SearchProgress, get_placer, placer_names
from devplace.placers.pipeline import pipeline_schedules
from devplace.placers.registry import PlacerSpec
from devplace.placers.search import check_auto_placer
from devplace.planning import Placed, Progress, Simulated, json_safe, place_graph, render_text, simulate_placement
from devplace.sim import LowerBound, Schedule, ScheduleError, any_schedule_bound, lower_bound
from devplace.units import fmt_time

__all__ = ["GRAPH_FILE", "OUTPUT_KINDS", "PLACEMENT_FILE", "Bounded", "OutputPathError", "Recommended",
           "SearchProgress", "bound", "check_outputs", "check_pipeline_settings", "check_placer", "graph_file",
           "load_graph_arg", "log_setting", "output_folder", "place_task", "placer_specs", "plan_graph", "recommend",
           "simulate_file", "torch_tasks"]


def placer_specs() -> list[PlacerSpec]:
    """`devplace placers`: every registered placer's spec (name, whether it walks an order, settings, summary);
    the CLI reaches the placers only through the application layer."""
    return [get_placer(n) for n in placer_names()]


def check_placer(name: str) -> None:
    """A PlacerError (a DevplaceError naming the placers) unless `name` is a registered placer: what a command
    checks before a capture."""
    get_placer(name)


def torch_tasks() -> ModuleType:
    """`devplace.app.with_torch`, imported on first use: the tasks that need torch (capture, profile, run,
    export, train, studies: their workers capture graphs) or the study report's plotting stack. The one place
    the application layer defers an import, so that commands that do not need them start fast."""
    return importlib.import_module("devplace.app.with_torch")


# the kind of devplace file each output option writes (`devplace.files.Kind`): an existing file of another kind is
# replaced only with --force
OUTPUT_KINDS: dict[str, Kind] = {"trace": TRACE, "plot": PNG, "log": CSV_CURVE, "record": JSON_LINES_RUN,
                                 "save_plan": json_kind("devplace.plan"), "full": json_kind("devplace.graph")}
PLACEMENT_FILE = json_kind("devplace.placement")
GRAPH_FILE = json_kind("devplace.graph")


def check_outputs(kinds: Mapping[str, Kind] | None = None, *, inputs: Sequence[Path | None] = (),
                  **paths: Path | None) -> None:
    """Refuse, before any work, output files that cannot or must not be written (keyword: the option, e.g.
    `trace=...`; `devplace.files.check_output`): a folder, a file in a missing or read-only folder, one of the
    command's `inputs` or of the files it read so far, a symbolic link or a file devplace did not write (those
    two unless --force). `kinds` gives the kind of the outputs OUTPUT_KINDS does not know (e.g. `output`).
    Two options naming one file are refused too. Nothing is created or changed."""
    for path in inputs:
        if path is not None:
            protect(path)
    known = {**OUTPUT_KINDS, **(kinds or {})}
    named: dict[Path, str] = {}  # resolved output -> its option: two outputs in one file would replace each other
    for what, path in paths.items():
        if path is not None:
            option = "--" + what.replace("_", "-")
            check_output(path, option, known.get(what))
            other = named.setdefault(Path(path).resolve(), option)
            if other != option:
                raise OutputPathError(f"{option} {path}: is also the file of {other}; two outputs cannot share "
                                      "one file, give each its own name")


def log_setting(settings: dict[str, Any] | None) -> Path | None:
    """The learning-curve file a learned placer's `log` setting names (checked with the other outputs)."""
    log = (settings or {}).get("log")
    return Path(log) if isinstance(log, str | Path) else None


def graph_file(path: str | Path) -> Path:
    """The graph file `path` names: `example` is the bundled example graph (unless a file of that name exists)."""
    path = Path(path)
    if str(path) == "example" and not path.exists():
        return Path(str(resources.files("devplace") / "data" / "example_mlp.json"))
    return path


def load_graph_arg(path: str | Path) -> CompGraph:
    """Load the graph a command-line argument names (`example` included)."""
    return load_graph(graph_file(path))


PIPELINE_SETTINGS = ("schedule", "microbatches", "chunks")  # the placer settings --schedule etc. give


def check_pipeline_settings(placer: str, cluster: Cluster, settings: dict[str, Any], *,
                            batch: int | None = None) -> None:
    """Refuse, before any work (a model's capture takes a while), the placer's settings when it has no such
    setting or a value is of the wrong type, out of range or above its limit (`PlacerSpec.validate`), and
    pipeline settings (`schedule`, `microbatches`, `chunks`) given to a placer that has none, or invalid for the
    `pipeline` placer on `cluster` (bad kind, M < 1, chunks for a one-chunk schedule, interleaved M not a
    multiple of the devices, M that does not divide `batch` when it is known)."""
    kind = settings.get("schedule")
    if kind in V_SHAPED and placer != AUTO_PLACER:  # before the placer's own check, which lists the kinds it cuts for
        raise DevplaceError(f"no placer cuts for {kind}: its V runs stages p - 1 and p on one device, which a "
                            f"placement cannot hold; a parallel plan records its stages: drop --placer (placer auto "
                            f"searches parallel plans under --schedule {kind})")
    given = [k for k in PIPELINE_SETTINGS if k in settings]
    if placer != AUTO_PLACER and not (given and any(k not in get_placer(placer).settings for k in given)):
        get_placer(placer).validate(settings)  # (pipeline settings to another placer: the message below)
    if not given:
        return
    if placer == AUTO_PLACER and given == ["schedule"]:  # "none", or the kind auto's pipelines run under
        check_auto_placer({"schedule": settings["schedule"]})
        return
    accepted = get_placer(placer).settings if placer != AUTO_PLACER else {}
    if any(k not in accepted for k in given):
        raise DevplaceError(f"--{given[0]} is a setting of the pipeline placer; add --placer pipeline (got --placer "
                            f"{placer})")
    pipeline_schedules(settings.get("schedule", accepted["schedule"]), settings.get("microbatches"),
                       settings.get("chunks"), cluster.num_devices, batch=batch)


def plan_graph(graph: str | Path | CompGraph, cluster: str | Cluster, *, placer: str = DEFAULT_PLACER,
               order: str = DEFAULT_ORDER, seed: int = DEFAULT_SEED, settings: dict[str, Any] | None = None,
               try_orders: int | None = None, try_with: str | None = None, progress: Progress | None = None,
               output: Path | None = None, trace: Path | None = None, plot: Path | None = None,
               semantics: str | None = None, parallel: ParallelAsk | None = None) -> Placed:
    """`devplace place GRAPH`: place a graph (file, `example`, or CompGraph) on a cluster (preset, file or
    Cluster), simulate it, and write the placement, trace and timeline asked for (checked before placing);
    `semantics` overrides the graph's placement semantics (`devplace.graph.semantics`)."""
    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    g = graph if isinstance(graph, CompGraph) else load_graph_arg(graph)
    # after reading the inputs (quick), so that an output naming one of them is refused before placing
    check_outputs({"output": PLACEMENT_FILE}, output=output, trace=trace, plot=plot, log=log_setting(settings))
    placed = place_graph(g, c, placer=placer, order=order, seed=seed, progress=progress, try_orders=try_orders,
                         try_with=try_with, semantics=semantics, parallel=parallel, **(settings or {}))
    placed.write(output=output, trace=trace, plot=plot)
    return placed


def _quiet(_: str) -> AbstractContextManager[Any]:
    return nullcontext()


def place_task(cluster: Cluster, *, graph: Path | None = None, model: str | None = None, batch: int | None = None,
               seq_len: int | None = None, max_nodes: int | None = None, optimizer: str = "adam",
               placer: str = DEFAULT_PLACER, order: str = DEFAULT_ORDER, try_orders: int | None = None,
               try_with: str | None = None, seed: int = DEFAULT_SEED, semantics: str | None = None,
               settings: dict[str, Any] | None = None, module_map: Path | None = None, output: Path | None = None,
               trace: Path | None = None, plot: Path | None = None, save_plan: Path | None = None,
               dtype: str | None = None, amp: bool = False, costs: Path | None = None,
               parallel: ParallelAsk | None = None, busy: Callable[[str], AbstractContextManager[Any]] = _quiet,
               progress: Callable[[str], AbstractContextManager[Progress | None]] = _quiet) -> Placed:
    """`devplace place`: a GRAPH file (or `example`), or a zoo or custom `model` captured here, placed on
    `cluster` by `placer` (`plan_graph`, `place_prepared`) or by a hand-made `module_map` (`place_by_map`),
    simulated, and the files asked for written (the plan with `save_plan`). Every check of the arguments runs
    before any work. `busy(message)` is shown while the model is captured, `progress(what)` gives the progress
    callback while it is placed (context managers; by default nothing is shown). `costs`: a cost table of
    `devplace profile` for the model's ops and the machine's overheads (`hardware.cost.apply_overheads`), measured
    on the kind of the cluster's devices. `parallel`: search parallel plans (data-parallel replicas, ZeRO,
    recomputation, zero-bubble schedules: `ParallelAsk` says which dimensions are fixed) instead of placements of
    one replica; off by default (devplace run runs them under GPipe, 1F1B or zero bubble, not ZeRO-3 under zero
    bubble: `graph.parallel.runtime_gap`).
    """
    settings = dict(settings or {})
    if costs is not None:
        if model is None:
            raise DevplaceError("--costs is for --model (captured and costed here); a GRAPH file was costed when it "
                                "was captured: capture it with `devplace capture --costs`")
        check_outputs(inputs=[costs])
        table = CostTable.load(costs)
        check_table_fits(cluster, table)
        cluster = apply_overheads(cluster, table)
    # a hand-made map is judged under the schedule given (its stages are the map's), not placed by `pipeline`
    map_schedule = ({k: settings.pop(k) for k in PIPELINE_SETTINGS if k in settings} if module_map is not None
                    else {})
    check_pipeline_settings(placer, cluster, settings, batch=batch)
    if parallel is not None:
        parallel.check_devices(cluster.num_devices)
    if (graph is None) == (model is None):
        raise DevplaceError("give either a GRAPH file or --model NAME (see `devplace zoo list`, or "
                            "package.module:factory)")
    if graph is not None and (dtype is not None or amp):
        raise DevplaceError("--dtype/--amp are for --model (captured here); a GRAPH file was captured (and costed) "
                            "already: capture it with `devplace capture --dtype/--amp`")
    if module_map is not None:
        placer_flags = [flag for flag, given in (
            ("--placer", placer != DEFAULT_PLACER), ("--order", order != DEFAULT_ORDER),
            ("--try", try_orders is not None), ("--try-with", try_with is not None),
            ("--set/--episodes/--policy/--log", bool(settings)), ("--semantics", semantics is not None)) if given]
        if parallel is not None:
            placer_flags.append("--dp/--pp/--zero/--recompute/--parallel")
        if placer_flags:
            raise DevplaceError(f"--map places by the map, not by a placer; drop {', '.join(placer_flags)}")
    placing: dict[str, Any] = dict(placer=placer, order=order, seed=seed, settings=settings, try_orders=try_orders,
                                   try_with=try_with, output=output, trace=trace, plot=plot, semantics=semantics,
                                   parallel=parallel)
    mapped = dict(output=output, trace=trace, plot=plot, **map_schedule)
    check_outputs(save_plan=save_plan)
    if model is not None:
        # before the capture, not only before placing
        check_outputs({"output": PLACEMENT_FILE}, inputs=[module_map], output=output, trace=trace, plot=plot,
                      log=log_setting(settings))
        with busy(f"capturing the training step of {model}"):
            prepared = torch_tasks().prepare_model(model, batch=batch, seq_len=seq_len, max_nodes=max_nodes,
                                                   optimizer=optimizer, cluster=cluster, dtype=dtype, amp=amp,
                                                   costs=table if costs is not None else None)
        if module_map is not None:
            tensors = torch_tasks().model_tensor_names(model, batch=batch, seq_len=seq_len)
            placed = torch_tasks().place_by_map(prepared.full, cluster, module_map, coarsening=prepared.coarsening,
                                                tensors=tensors, **mapped)
        else:
            with progress(f"{prepared.graph.name} with {placer}") as callback:
                placed = torch_tasks().place_prepared(prepared, cluster, progress=callback, **placing)
    else:
        assert graph is not None
        g = load_graph_arg(graph)
        if module_map is not None:
            placed = torch_tasks().place_by_map(g, cluster, module_map, **mapped)
        else:
            with progress(f"{g.name} with {placer}") as callback:
                placed = plan_graph(g, cluster, progress=callback, **placing)
    if save_plan is not None:
        torch_tasks().save_placed_plan(placed, save_plan, model=model, batch=batch, seq_len=seq_len,
                                       optimizer=optimizer, max_nodes=max_nodes, dtype=dtype, amp=amp)
    return placed


def simulate_file(graph: str | Path, cluster: str | Cluster | None = None, placement: str | Path | None = None, *,
                  model: str = DEFAULT_SIM_MODEL, trace: Path | None = None, plot: Path | None = None) -> Simulated:
    """`devplace simulate`: simulate a placement file of a graph file on a cluster under simulation `model`.
    A placement made for another graph or cluster (by the names it records), or replica 0 of a parallel plan, is
    simulated with a warning. With neither `cluster` nor `placement`, `graph` is a saved plan (`devplace.plan/1`),
    which holds all three: its step replayed as it was judged (`runtime.plan.load_plan`: a parallel plan's with
    its replicas, sync, ZeRO and recomputation), read through `torch_tasks()`."""
    if cluster is None and placement is None:
        return torch_tasks().simulate_plan(Path(graph), model=model, trace=trace, plot=plot)
    if cluster is None or placement is None:
        raise DevplaceError("give GRAPH CLUSTER PLACEMENT, or a saved plan (devplace place --save-plan) alone")
    g = load_graph_arg(graph)
    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    p = load_placement(placement)
    check_outputs(trace=trace, plot=plot)
    sim = simulate_placement(g, c, p, model=model)
    for what, recorded, given in (("graph", p.graph, g.name), ("cluster", p.cluster, c.name)):
        if recorded and recorded != given:
            sim.warnings.append(f"{placement} was made for {what} {recorded!r}, simulated on {what} {given!r}")
    if isinstance(p.meta.get("parallel"), dict):
        sim.warnings.append(f"{placement} is replica 0 of a parallel plan (its \"parallel\"), simulated here as that "
                            "one pipeline, without the other replicas' gradient sync, ZeRO or recomputation; `devplace "
                            "place --model ... --dp/--pp/--zero/--recompute` reports the plan's step")
    sim.write(trace=trace, plot=plot)
    return sim


@dataclass(frozen=True)
class Bounded:
    """The lower bound of a graph on a cluster: what `devplace bound` reports. Without `schedule`, `bound` holds
    for every placement, unpipelined or under any micro-batch schedule (`any_schedule_bound`), so no step a
    report gives for this graph is below it, and `unpipelined` is the (higher) bound of the step run as one
    batch; with `schedule`, `bound` is that schedule's (`lower_bound(..., schedule)`) and `unpipelined` None."""

    graph: CompGraph
    cluster: Cluster
    bound: LowerBound
    unpipelined: LowerBound | None
    schedule: Schedule | None = None

    @property
    def scope(self) -> str:
        """Which placements and schedules `bound` holds for, in words."""
        if self.schedule is None:
            return ("every placement, run as one batch or under any micro-batch schedule (gpipe, 1f1b, interleaved; "
                    "any number of equal micro-batches)")
        return (f"every placement run under {self.schedule.label} (the whole batch in "
                f"{self.schedule.microbatches} equal micro-batches)")

    def to_dict(self) -> dict[str, Any]:
        """The `devplace bound --json` document."""
        lb = self.bound
        doc = {"graph": self.graph.name, "cluster": self.cluster.name, "lower_bound_s": lb.value_s,
               "scope": self.scope, "schedule": self.schedule.to_dict() if self.schedule else None,
               "work_s": lb.work_s, "critical_path_s": lb.critical_path_s, "limited_by": lb.limited_by,
               "critical_path": [self.graph.ids[v] for v in lb.critical_path]}
        if self.unpipelined is not None:
            one = self.unpipelined
            doc["unpipelined"] = {"lower_bound_s": one.value_s, "scope": UNPIPELINED_SCOPE,
                                  "critical_path_s": one.critical_path_s, "limited_by": one.limited_by,
                                  "critical_path": [self.graph.ids[v] for v in one.critical_path]}
        return json_safe(doc)

    def __rich__(self) -> Group:
        lb = self.bound
        head = Text.assemble((self.graph.name, "bold"), " on ", (self.cluster.name, "bold"), ": lower bound ",
                             (fmt_time(lb.value_s), "bold"), f" ({lb.limited_by})")
        lines = [head, Text(f"  valid for {self.scope}"),
                 Text(f"  total work / total speed : {fmt_time(lb.work_s)}"),
                 Text(f"  critical path (fastest device, no communication"
                      f"{'' if self.schedule is not None else ', per-step ops only'}): "
                      f"{fmt_time(lb.critical_path_s)}, {len(lb.critical_path)} ops")]
        if self.unpipelined is not None:
            lines.append(Text.assemble("  without micro-batches: ", (fmt_time(self.unpipelined.value_s), "bold"),
                                       f" ({self.unpipelined.limited_by}), valid for {UNPIPELINED_SCOPE}"))
        return Group(*lines)

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


UNPIPELINED_SCOPE = ("every placement run as one batch per step (every placer but `pipeline`); a pipelined step can "
                     "be shorter (bound one with --schedule and --microbatches)")


def bound(graph: str | Path, cluster: str | Cluster, *, schedule: str | None = None, microbatches: int | None = None,
          chunks: int | None = None) -> Bounded:
    """`devplace bound`: the lower bound on the step time of a graph file on a cluster, run as one batch or
    under the micro-batch schedule `schedule` (a kind) with `microbatches` (and `chunks`), and the bound for any
    schedule."""
    if schedule is None and (microbatches is not None or chunks is not None):
        raise ScheduleError("--microbatches and --chunks size a micro-batch schedule; give --schedule KIND too "
                            "(gpipe, 1f1b or interleaved-1f1b)")
    if schedule is not None and microbatches is None:
        raise ScheduleError(f"the bound under schedule {schedule!r} depends on the number of micro-batches; give "
                            "--microbatches M (without --schedule: the bound for one batch and for any schedule)")
    sched = None if schedule is None else Schedule(schedule, microbatches or 1, chunks)
    g = load_graph_arg(graph)
    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    if sched is not None:
        return Bounded(g, c, lower_bound(g, c, sched), None, sched)
    return Bounded(g, c, any_schedule_bound(g, c), lower_bound(g, c))


@dataclass(frozen=True)
class Recommended:
    """The traversal order recommended for a graph and placer: what `devplace recommend` reports."""

    graph: CompGraph
    cluster: Cluster | None
    placer: str
    recommendation: Recommendation
    model_source: str
    fitted_on: Any

    def to_dict(self) -> dict[str, Any]:
        """The `devplace recommend --json` document."""
        return json_safe({"graph": self.graph.name, "cluster": self.cluster.name if self.cluster else None,
                          **self.recommendation.to_dict(), "model": self.model_source, "fitted_on": self.fitted_on})

    def __rich__(self) -> Group:
        rec = self.recommendation
        where = self.cluster.name if self.cluster else "no cluster"
        return Group(
            Text.assemble((self.graph.name, "bold"), f" with {self.placer} on {where}: order ", (rec.order, "bold")),
            Text(f"  rule: {rec.rule}"),
            Text(f"  expected gain over topo: {rec.expected_gain:+.2%} (mean over {rec.graphs} study graphs "
                 f"the rule covers); next best: {', '.join(rec.ranking[1:4]) or '-'}"))

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def recommend(graph: str | Path | None, *, model: str | None = None, batch: int | None = None,
              seq_len: int | None = None, max_nodes: int | None = None, cluster: str | None = None,
              placer: str = RECOMMEND_PLACER, order_model: Path | None = None) -> Recommended:
    """`devplace recommend`: the order `--order auto` picks for a graph file or a zoo model (captured), placer
    and cluster (default: the one the order model was fitted on)."""
    spec = get_placer(placer)
    om = load_order_model(order_model)
    c = load_cluster(cluster) if cluster else (load_cluster(om.cluster) if om.cluster else None)
    if (graph is None) == (model is None):
        raise DevplaceError("give either a GRAPH file or --model NAME (see `devplace zoo list`)")
    if model is not None:
        g = torch_tasks().prepare_model(model, batch=batch, seq_len=seq_len, max_nodes=max_nodes,
                                        cluster=c).graph
    else:
        assert graph is not None
        g = load_graph_arg(graph)
    rec = recommend_order(g, c, placer=placer, model=om, uses_order=spec.uses_order)
    return Recommended(g, c, placer, rec, om.source, om.doc.get("fitted_on"))

"""The tasks of the application layer that need torch (capture, profile, run, export, train, studies) or the
study report's plotting stack. Reached through `devplace.app.torch_tasks()` (imported on first use) so that the
commands that do not need them start without loading torch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from devplace.app import (
    GRAPH_FILE,
    PLACEMENT_FILE,
    check_outputs,
    check_pipeline_settings,
    load_graph_arg,
    log_setting,
)
from devplace.capture.custom import (
    build_named_model,
    capture_named_model,
    microbatch_graphs,
    model_code,
    named_prepared,
)
from devplace.capture.onnx_import import load_onnx
from devplace.capture.pipeline import Prepared, family_graph, prepare
from devplace.capture.profile import (
    calibrate,
    fold_runs,
    format_calibration,
    format_runs,
    local_cpu_device,
    local_cpu_roofline,
    profile_graph,
    read_runs,
)
from devplace.capture.torch_capture import default_loss, loss_reduction
from devplace.defaults import (
    AUTO_PLACER,
    CANONICAL_ORDER,
    DEFAULT_ORDER,
    DEFAULT_PLACER,
    DEFAULT_SEED,
    DEFAULT_SIM_MODEL,
    FAMILY_MAX_NODES,
    LEARNED_PLACER,
    SIM_DEVPLACE,
    TRAIN_FAMILY_GRAPHS,
    cpu_cores,
    sim_model_name,
)
from devplace.errors import DevplaceError, FormatError
from devplace.files import CHECKPOINT, PNG, json_kind
from devplace.graph import save_graph
from devplace.graph.batch import divisors_text, graph_batch, graph_microbatches
from devplace.graph.coarsen import Coarsening
from devplace.graph.compgraph import CompGraph
from devplace.graph.parallel import RUN_SCHEDULES, V_SHAPED, ParallelAsk, ParallelPlan, runtime_gap
from devplace.graph.placement import MadeBy
from devplace.hardware.cluster import Cluster, Device, load_cluster
from devplace.hardware.cost import CostTable, apply_overheads, check_table_fits, cost_devices
from devplace.hardware.presets import device_kind as kind_device
from devplace.placers import NoFitError, get_placer
from devplace.placers.rl.curve import plot_curve, read_curve
from devplace.placers.rl.placeto import PlacetoHyper, check_settings
from devplace.placers.rl.trainer import TrainResult, mean_best_ratio, parse_indices, train
from devplace.planning import (
    MAP_PLACER,
    Placed,
    Progress,
    Simulated,
    baselines,
    even_split_devices,
    json_safe,
    place_graph,
    render_text,
    simulate_placement,
)
from devplace.runtime.apply import normalize_devices
from devplace.runtime.export import (
    PipelineExport,
    default_schedule,
    device_map,
    export_json,
    pipeline_split,
    read_pipeline,
)
from devplace.runtime.in_step import merge_tables, profile_in_step
from devplace.runtime.module_map import placement_from_module_map, read_module_map
from devplace.runtime.parallel_export import (
    ParallelExport,
    parallel_export,
    read_parallel,
    recorded_split,
    torchtitan_config,
)
from devplace.runtime.parallel_run import ParallelRun, run_parallel
from devplace.runtime.pipeline_run import PipelineRun, run_pipeline
from devplace.runtime.plan import (
    Plan,
    build_source,
    load_plan,
    named_source,
    plan_from_placed,
    rebuild_zoo_model,
    source_params,
    zoo_plan,
)
from devplace.runtime.run import (
    NOISY_SPREAD,
    RunResult,
    append_record,
    apply_precision,
    check_steps,
    cpu_autocast,
    local_cluster,
    measure_plan,
    plan_precision,
    precision_record,
)
from devplace.sim import DevplaceModel, Schedule, ScheduleError, SimResult, simulate
from devplace.study.report import write_report
from devplace.study.runner import Rerun, StudySummary, run_study, verify_study
from devplace.study.spec import StudyError, load_study
from devplace.units import fmt_bytes, fmt_time
from devplace.zoo.families import FAMILIES, FAMILY_SIZE
from devplace.zoo.models import MODELS, ModelSpec

__all__ = [
    "Compared",
    "Demo",
    "Measured",
    "ParallelRan",
    "PipelineRan",
    "StudyRan",
    "capture_graph",
    "check_learned_placer",
    "check_threads",
    "cost_device",
    "demo",
    "export_device_map",
    "export_parallel_plan",
    "export_plan",
    "fold_run_records",
    "format_calibration",
    "format_runs",
    "is_parallel",
    "is_pipelined",
    "load_plan_file",
    "mean_best_ratio",
    "model_calibration",
    "model_tensor_names",
    "place_by_map",
    "place_prepared",
    "plan_for_run",
    "plot_learning_curve",
    "prepare_model",
    "profile_model",
    "run_model",
    "run_parallel_export",
    "run_pipeline_export",
    "run_plan_parallel",
    "run_plan_pipelined",
    "save_placed_plan",
    "save_prepared",
    "set_threads",
    "simulate_plan",
    "study_report",
    "study_run",
    "study_verify",
    "train_policy",
    "training_graphs",
    "zoo_catalogue",
    "zoo_family_graph",
]


def prepare_model(model: str, *, batch: int | None = None, seq_len: int | None = None, max_nodes: int | None = None,
                  optimizer: str = "adam", device: Device | None = None, cluster: Cluster | None = None,
                  costs: CostTable | None = None, dtype: str | None = None, amp: bool = False) -> Prepared:
    """Capture the training step of zoo model `model` (or a custom `package.module:factory` one) in precision
    `dtype` / `amp`, cost it for `device` or for every device kind of `cluster` (`cost_devices`), colocate it
    (and coarsen it)."""
    kinds: tuple[Device, ...] = ()
    if cluster is not None:
        device, kinds = cost_devices(cluster)
    return named_prepared(model, batch=batch, seq_len=seq_len, optimizer=optimizer, dtype=dtype, amp=amp,
                          max_nodes=max_nodes, device=device, costs=costs, kinds=kinds)


def place_prepared(prepared: Prepared, cluster: Cluster, *, placer: str = DEFAULT_PLACER,
                   order: str = DEFAULT_ORDER, seed: int = DEFAULT_SEED, settings: dict[str, Any] | None = None,
                   try_orders: int | None = None, try_with: str | None = None, progress: Progress | None = None,
                   output: Path | None = None, trace: Path | None = None, plot: Path | None = None,
                   semantics: str | None = None, parallel: ParallelAsk | None = None) -> Placed:
    """Place a prepared model's coarse graph, expand the placement to every op, simulate and write files
    (checked before placing); `semantics` overrides the graph's ("autograd" for a captured model). A captured
    model's pipelines are placed on micro-batches captured at their own size (`microbatch_graphs`); `parallel`
    searches parallel plans on them instead (`devplace.placers.search.search_parallel_plans`)."""
    check_outputs({"output": PLACEMENT_FILE}, output=output, trace=trace, plot=plot, log=log_setting(settings))
    placed = place_graph(prepared.graph, cluster, placer=placer, order=order, seed=seed, progress=progress,
                         try_orders=try_orders, try_with=try_with, semantics=semantics, coarsening=prepared.coarsening,
                         full=prepared.full, microbatch_graph=microbatch_graphs(prepared), parallel=parallel,
                         **(settings or {}))
    placed.write(output=output, trace=trace, plot=plot)
    return placed


def simulate_plan(path: Path, *, model: str = DEFAULT_SIM_MODEL, trace: Path | None = None,
                  plot: Path | None = None) -> Simulated:
    """`devplace simulate PLAN`: a saved plan's step, replayed as its search judged it (`load_plan`; a parallel
    plan's whole step), or under another simulation `model` (`simulate_placement`: replica 0 alone for a parallel
    plan, with a warning)."""
    check_outputs(inputs=[path], trace=trace, plot=plot)
    p = load_plan_file(path)
    if sim_model_name(model) == SIM_DEVPLACE:
        sim = Simulated(p.graph, p.cluster, p.placement, p.result, p.placed.bound)
    else:
        sim = simulate_placement(p.graph, p.cluster, p.placement, model=model)
        if "parallel" in p.placement.meta:
            sim.warnings.append(f"{path} is a parallel plan; under the {model} model only its replica 0 is "
                                f"simulated, without the other replicas' gradient sync, ZeRO or recomputation")
    sim.write(trace=trace, plot=plot)
    return sim


def save_placed_plan(placed: Placed, path: Path, *, model: str | None = None, batch: int | None = None,
                     seq_len: int | None = None, optimizer: str = "adam", max_nodes: int | None = None,
                     dtype: str | None = None, amp: bool = False) -> None:
    """`devplace place --save-plan`: write `placed` as a `devplace.plan/1` file (placement, its schedule, the
    graph, the cluster) with the model it was captured from (`model`, zoo or custom, at the batch the graph
    records) and its precision, so that `devplace export` and `devplace run --plan` take it; a graph file's
    plan has no model (export takes it, run cannot rebuild it)."""
    whole = graph_batch(placed.graph)
    micro = placed.placement.schedule
    if placed.parallel is not None:  # `graph` is one replica's micro-batch: the model runs the plan's whole batch
        whole = placed.parallel.plan.batch
    elif whole is not None and micro is not None and micro.microbatch_graph:
        whole *= micro.microbatches  # a pipeline placed on one micro-batch's capture: the model runs the batch
    source = named_source(model, whole if whole is not None else batch, seq_len, 0) if model is not None else None
    settings = {"optimizer": optimizer, "max_nodes": max_nodes, "dtype": dtype, "amp": amp}
    plan_from_placed(placed, settings=settings, source=source).save(path)
    placed.written.append(("plan", path))


def place_by_map(graph: CompGraph, cluster: Cluster, module_map: Path, *, coarsening: Coarsening | None = None,
                 tensors: Sequence[str] = (), output: Path | None = None, trace: Path | None = None,
                 plot: Path | None = None, schedule: str | None = None, microbatches: int | None = None,
                 chunks: int | None = None) -> Placed:
    """`devplace place --map FILE`: `graph` (a captured graph, every op) placed by a hand-made module map
    (`devplace.runtime.module_map`), as autograd runs it, simulated and reported like a placer's output,
    baselines included; `tensors`: parameter/buffer names the map may name; files written as `place_prepared`.
    With `schedule` (a kind) and `microbatches`, the map's stages are judged as that pipeline (its `schedule`,
    so a saved plan exports and runs it so); a map that is no pipeline under it is a ScheduleError saying why."""
    check_outputs({"output": PLACEMENT_FILE}, inputs=[module_map], output=output, trace=trace, plot=plot)
    if (schedule is None) != (microbatches is None) or (chunks is not None and schedule is None):
        raise ScheduleError("a map is judged as a pipeline under --schedule KIND (gpipe, 1f1b or interleaved-1f1b) "
                            "with --microbatches M (and --chunks V for interleaved-1f1b); give both")
    sched = None if schedule is None or microbatches is None else Schedule(schedule, microbatches, chunks)
    t0 = time.perf_counter()
    placement = placement_from_module_map(graph, cluster, read_module_map(module_map), tensors=tensors)
    if sched is not None:
        placement = replace(placement, schedule=sched)
    made = MadeBy(MAP_PLACER, None, DEFAULT_SEED, {"module_map": str(module_map)}, groups=graph.num_nodes,
                  seconds=time.perf_counter() - t0)
    placement = replace(placement, made_by=made)
    result = simulate(graph, cluster, placement, schedule=sched)
    placed = Placed(graph, cluster, placement, result, coarsening)
    placed.write(output=output, trace=trace, plot=plot)
    return placed


def model_tensor_names(model: str, *, batch: int | None = None, seq_len: int | None = None) -> list[str]:
    """The parameter and buffer names of zoo or custom model `model` (built on the meta device: no memory), and
    the names of its modules that hold any, which a Hugging Face device_map may name beside the modules that run
    ops (`devplace export` maps a module that runs no op, as BART's `shared` embedding, whole)."""
    with torch.device("meta"):
        module, _, _ = build_named_model(model, batch, seq_len)
    holders = [n for n, m in module.named_modules()
               if n and (any(True for _ in m.parameters()) or any(True for _ in m.buffers()))]
    return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()] + holders


@dataclass(frozen=True)
class Compared:
    """One row of `devplace demo`'s comparison: a placement, the schedule it runs under ("none": one step
    without micro-batches) and its simulation (None when no placement fits; `note` says why)."""

    label: str
    schedule: str
    result: SimResult | None
    note: str = ""


@dataclass(eq=False)
class Demo:
    """What `devplace demo` reports: devplace's answer for a model that needs several devices (`answer`: the
    default search, placer auto: pipelines, the parallel plans devplace runs, placements without micro-batches),
    against the `pipeline` placer at the demo's schedule (`placed`), the even split under that schedule, a
    placement without micro-batches and the best single device (`compared`, the answer's row last), with the
    bound of the step."""

    answer: Placed
    placed: Placed
    compared: list[Compared]

    @property
    def schedule(self) -> Schedule:
        s = self.placed.placement.schedule
        assert s is not None  # the pipeline placer always returns one
        return s

    @property
    def estimate_s(self) -> float:
        """The work per device times the slots of an even pipeline, (V M + p - 1) / (V M): its step when every
        stage takes the same time and nothing waits for a transfer. An estimate, not a bound: a split of unequal
        stages can be faster (its slowest stage's device idles less than the bubble of equal ones)."""
        s, p = self.schedule, self.placed.cluster.num_devices
        vm = s.microbatches * int(s.chunks or 1)
        return self.placed.bound.work_s * (vm + p - 1) / vm

    def to_dict(self) -> dict[str, Any]:
        """The comparison as a JSON object (the answer itself: `devplace place --json`)."""
        return json_safe({
            "graph": self.answer.graph.name, "cluster": self.answer.cluster.name,
            "schedule": self.schedule.to_dict(), "work_per_device_s": self.placed.bound.work_s,
            "even_stage_estimate_s": self.estimate_s,
            "compared": [{"placement": r.label, "schedule": r.schedule,
                          "step_time_s": r.result.step_time_s if r.result else None,
                          "feasible": bool(r.result.feasible) if r.result else False,
                          "peak_memory_bytes": float(r.result.peak_memory_bytes.max()) if r.result else None,
                          "note": r.note} for r in self.compared]})

    def __rich__(self) -> Group:
        ours = self.answer.result.step_time_s
        # the smaller of the two work bounds (the answer's micro-batches and the pipeline's cost differently)
        work = min(self.placed.bound.work_s, self.answer.bound.work_s)
        table = Table(header_style="bold", show_edge=False)
        for col, justify in (("placement", "left"), ("schedule", "left"), ("step", "right"), ("/ answer", "right"),
                             ("peak", "right"), ("memory", "left")):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for r in self.compared:
            if r.result is None:
                table.add_row(Text(r.label), r.schedule, "-", "-", "-", Text("no fit", style="red"))
                continue
            fits = (Text("fits") if r.result.feasible
                    else Text(f"over by {fmt_bytes(max(r.result.oom.values()))}", style="red"))
            table.add_row(Text(r.label), r.schedule, fmt_time(r.result.step_time_s),
                          f"{r.result.step_time_s / ours:.3f}x", fmt_bytes(float(r.result.peak_memory_bytes.max())),
                          fits)
        s, p = self.schedule, self.placed.cluster.num_devices
        table.add_row(f"work / {p} devices", "", fmt_time(work), f"{work / ours:.3f}x", "", "")
        table.add_row(f"even-stage estimate {s.kind}", s.label, fmt_time(self.estimate_s),
                      f"{self.estimate_s / ours:.3f}x", "", "")
        vm = "VM" if (s.chunks or 1) > 1 else "M"
        notes = Text("; ".join(f"{r.label}: {r.note}" for r in self.compared if r.note)
                     + f"; work / {p} devices: no schedule beats it; even-stage estimate {s.kind}: that x "
                     f"({vm}+p-1)/{vm}, every stage equal and no wait for a transfer (an estimate, not a bound: "
                     "unequal stages can beat it). Peak: the largest device's. Steps simulated on the full graph "
                     "with the devplace model.")
        return Group(self.answer, Text(""), table, notes)

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def demo(prepared: Prepared, cluster: Cluster, *, schedule: str = "1f1b", microbatches: int | None = 8,
         chunks: int | None = None, baseline: str = "contiguous", out: Path | None = None,
         name: str = "demo") -> Demo:
    """`devplace demo`: devplace's default answer for a prepared model (placer auto, `place_prepared`) against
    the `pipeline` placer under `schedule` with `microbatches` (None: the placer chooses), the even split
    (`placers.even`: equal compute at module boundaries) under the same schedule, the non-pipelined placement
    `baseline` makes, and the best single device, all on the full graph. Writes `<name>.placement.json`,
    `<name>-trace.json` and `<name>-timeline.png` (the answer's) into `out` if given."""
    settings: dict[str, Any] = {"schedule": schedule, "microbatches": microbatches}
    if chunks is not None:
        settings["chunks"] = chunks
    check_pipeline_settings("pipeline", cluster, settings)
    spec = None if baseline == AUTO_PLACER else get_placer(baseline)
    if spec is not None and "schedule" in spec.settings:
        raise DevplaceError(f"the baseline is a placement without micro-batches, but placer {baseline!r} makes "
                            "pipelines; choose another --baseline, e.g. contiguous or m-etf")
    files = ({"output": out / f"{name}.placement.json", "trace": out / f"{name}-trace.json",
              "plot": out / f"{name}-timeline.png"} if out is not None else {})
    answer = place_prepared(prepared, cluster, **files)
    placed = place_prepared(prepared, cluster, placer="pipeline", settings=settings)
    sched = placed.placement.schedule
    assert sched is not None
    full, p = placed.graph, cluster.num_devices
    label = sched.label
    rows = []
    whole = prepared.full  # the whole batch's step (the pipeline's graph may be one micro-batch of it)
    device = baselines(whole, cluster)[0].device  # the best single device (its only device, whether or not it fits)
    single = DevplaceModel(whole, cluster).run(np.full(whole.num_nodes, device, dtype=np.int64))
    rows.append(Compared(f"single {cluster.devices[device].name}", "none", single,
                         "the whole step on the best device" + ("" if single.feasible else ", which cannot hold it")))
    walked = f" in the {placed.order} order" if spec is None or spec.uses_order else ""
    try:
        flat = place_prepared(prepared, cluster, placer=baseline, order=placed.order or CANONICAL_ORDER)
        if flat.placement.schedule is not None or flat.parallel is not None:  # placer auto: where nothing else fits
            raise NoFitError("no placement without micro-batches fits")
        rows.append(Compared(baseline, "none", flat.result, f"its placement without micro-batches{walked}"))
    except NoFitError:
        rows.append(Compared(baseline, "none", None, f"no placement without micro-batches{walked} fits memory"))
    even_label = "even split"
    try:
        even = simulate(full, cluster, even_split_devices(full, cluster), schedule=sched)
        rows.append(Compared(even_label, label, even, f"equal compute in {p} parts at module boundaries"))
    except ScheduleError as exc:
        rows.append(Compared(even_label, label, None, f"not a pipeline: {exc}"))
    rows.append(Compared("pipeline placer", label, placed.result, f"order {placed.order}"))
    rows.append(Compared("devplace (default)", *_answer_row(answer)))
    return Demo(answer, placed, rows)


def _answer_row(answer: Placed) -> tuple[str, SimResult, str]:
    """(schedule, result, note) of the default's answer in `devplace demo`'s table."""
    if answer.parallel is not None:
        plan = answer.parallel.plan
        return plan.schedule, answer.result, f"placer auto: the parallel plan {plan.label}"
    sched = answer.placement.schedule
    return (sched.label if sched is not None else "none"), answer.result, f"placer auto: {answer.kept}"


def cost_device(kind: str) -> Device:
    """The device to cost ops for: a preset kind (K80, V100, ...) or `cpu` (this machine's, measured)."""
    return local_cpu_device() if kind == "cpu" else kind_device(kind)


def capture_graph(*, model: str | None = None, onnx: Path | None = None, batch: int | None = None,
                  seq_len: int | None = None, max_nodes: int | None = None, optimizer: str = "adam",
                  costs: Path | None = None, device_kind: str = "V100", dtype: str | None = None,
                  amp: bool = False) -> Prepared:
    """`devplace capture`: a zoo or custom model's training step in precision `dtype` / `amp`, or an ONNX
    forward graph's (costed in `dtype` where its ops carry none), costed and colocated."""
    if (model is None) == (onnx is None):
        raise DevplaceError("give either --model NAME (see `devplace zoo list`, or package.module:factory) or "
                            "--onnx FILE")
    device = cost_device(device_kind)
    table = CostTable.load(costs) if costs is not None else None
    if model is not None:
        return prepare_model(model, batch=batch, seq_len=seq_len, optimizer=optimizer, max_nodes=max_nodes,
                             device=device, costs=table, dtype=dtype, amp=amp)
    assert onnx is not None
    if amp:
        raise DevplaceError("--amp needs a PyTorch model (--model): an ONNX graph is not run under autocast; give "
                            "--dtype for the precision its ops are costed in")
    dims = {"seq": seq_len} if seq_len else None
    return prepare(load_onnx(onnx, optimizer=optimizer, batch=batch, dims=dims), device=device, costs=table,
                   max_nodes=max_nodes, dtype=dtype)


def save_prepared(prepared: Prepared, output: Path, full: Path | None = None) -> None:
    """Write a prepared model's coarse graph to `output` (and the full costed graph to `full`)."""
    save_graph(prepared.graph, output)
    if full is not None:
        save_graph(prepared.full, full)


def zoo_catalogue() -> tuple[dict[str, ModelSpec], tuple[str, ...], int]:
    """`devplace zoo list`: the zoo's named models, the study's families and the graphs in each family."""
    return dict(MODELS), tuple(FAMILIES), FAMILY_SIZE


def zoo_family_graph(name: str, index: int, *, max_nodes: int | None, output: Path | None = None) -> CompGraph:
    """`devplace zoo family`: graph `index` of a study family, coarsened; saved to `output` if given."""
    check_outputs({"output": GRAPH_FILE}, output=output)
    g = family_graph(name, index, max_nodes=max_nodes)
    if output is not None:
        save_graph(g, output)
    return g


def profile_model(model: str, output: Path, *, batch: int | None = None, seq_len: int | None = None,
                  device: str = "cpu", repeats: int = 10, max_ops: int | None = None, threads: int | None = None,
                  progress: Callable[[int, int, Any], None] | None = None,
                  overheads: bool = True, in_step: bool = False) -> tuple[CompGraph, CostTable]:
    """`devplace profile`: time every distinct op of a zoo or custom (package.module:factory) model's step for
    real, with `threads` CPU threads when given (`torch.set_num_threads`: the table's device kind and its meta
    record the count, and `devplace run --threads` the same count runs steps its times fit); with `in_step` (on
    the CPU) each op is then timed again inside real training steps of the model on one device
    (`runtime.in_step.profile_in_step`), and those times replace the isolated ones (meta "timer": "in-step");
    with `overheads` (on the CPU) also this machine's per-op, per-action and per-transfer overheads
    (`app.overheads`, on a probe model, about half a minute, its ops timed the same way; the table's meta keeps
    the figures they came from); the table is saved."""
    check_outputs({"output": json_kind("devplace.costs")}, output=output)
    cpu = torch.device(device).type == "cpu"
    if in_step and not cpu:
        raise DevplaceError(f"--in-step times ops by the CPU clock inside steps on the CPU, not on {device}; "
                            "profile a GPU without --in-step")
    set_threads(threads)
    graph = capture_named_model(model, batch=batch, seq_len=seq_len)
    table = profile_graph(graph, device, repeats=repeats, max_ops=max_ops, progress=progress)
    if in_step:
        module, inputs, loss_fn = build_named_model(model, batch, seq_len)
        with model_code("the in-step profile"):
            table = merge_tables([table, profile_in_step(graph, module, inputs, table.device or local_cpu_device(),
                                                         loss_fn=loss_fn)])
    if overheads and cpu:
        from devplace.app.overheads import measure_overheads

        measured = measure_overheads(repeats=repeats, in_step=in_step)
        table.overheads = measured.overheads
        table.meta["overheads_measured"] = measured.to_dict()
    table.save(output)
    return graph, table


def fold_run_records(runs: Path) -> dict[str, Any]:
    """`devplace calibrate --runs`: measured/simulated ratios of `devplace run` records."""
    return fold_runs(read_runs(runs))


def model_calibration(costs: Path, model: str, *, batch: int | None = None,
                      seq_len: int | None = None) -> dict[str, Any]:
    """`devplace calibrate --costs`: the analytic cost model against a profiled table, per op class."""
    table = CostTable.load(costs)
    graph = capture_named_model(model, batch=batch, seq_len=seq_len)
    roofline = local_cpu_roofline() if table.device is not None and table.device.name.startswith("cpu") else None
    return calibrate(graph, table, roofline=roofline)


def training_graphs(graphs: Sequence[Path], *, family: str | None = None, indices: str = TRAIN_FAMILY_GRAPHS,
                    max_nodes: int = FAMILY_MAX_NODES) -> list[CompGraph]:
    """The graphs `devplace train` trains on: graph files, or the members `indices` of a study family
    (captured and coarsened to `max_nodes`)."""
    if (family is None) == (not graphs):
        raise DevplaceError("give either GRAPH files or --family NAME (cifar10, ptb, nmt)")
    if family is not None:
        return [family_graph(family, i, max_nodes=max_nodes) for i in parse_indices(indices, FAMILY_SIZE)]
    return [load_graph_arg(p) for p in graphs]


def train_policy(graphs: list[CompGraph], cluster: str | Cluster, **settings: Any) -> TrainResult:
    """`devplace train`: one placeto policy trained over `graphs` (`settings`: those of
    `devplace.placers.rl.trainer.train`; a setting given as None takes that function's default, which is
    `PlacetoHyper`'s). The checkpoint and log files are checked before training."""
    check_outputs({"output": CHECKPOINT}, output=settings.get("output"), log=settings.get("log"))
    given = {k: v for k, v in settings.items() if v is not None}
    return train(graphs, cluster if isinstance(cluster, Cluster) else load_cluster(cluster), **given)


def check_training_settings(**settings: Any) -> None:
    """Refuse bad hyperparameters of `devplace train` (episodes, rounds, hidden, lr, ...; None: the default)
    before its graphs are captured, not only before training."""
    check_settings(replace(PlacetoHyper(), **{k: v for k, v in settings.items() if v is not None}))


def check_learned_placer(placer: str) -> None:
    """`devplace train` trains the learned placer only."""
    if placer != LEARNED_PLACER:
        raise DevplaceError(f"devplace train trains {LEARNED_PLACER} only (got --placer {placer}); seq2seq trains "
                            "per graph inside `devplace place --placer seq2seq`")


def plot_learning_curve(curve: Path, output: Path) -> int:
    """`devplace plot-curve`: draw a learning curve CSV; returns its row count."""
    check_outputs({"output": PNG}, output=output)
    rows = read_curve(curve)
    plot_curve(rows, output, title=curve.stem)
    return len(rows)


def study_report(db: Path, out: Path) -> list[Path]:
    """`devplace study report`: write a study's report files into `out`."""
    return write_report(db, out, command=f"devplace study report {db} -o {out}")


@dataclass(eq=False)
class Measured:
    """Real training steps of a placed model against their simulation: what `devplace run` reports."""

    plan: Plan
    run: RunResult
    record: dict[str, Any]
    devices: list[Any]
    granularity: str
    crossings: int
    steps: int
    record_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The calibration record (`devplace run --json`)."""
        return json_safe(self.record)

    def __rich__(self) -> Group:
        p, run, rec = self.plan, self.run, self.record
        shared = (" (logical devices that share a real device simulated on it, one op at a time; on separate "
                  f"devices {fmt_time(rec['settings']['as_run_on_separate_devices_s'])})"
                  if rec["settings"].get("shared_devices") else "")
        line = Text(f"measured step {fmt_time(run.step_time_s)} (median of {self.steps}, spread "
                    f"{run.spread:.0%} of it, {run.timer}, {rec['threads']} thread(s)"
                    + (f", {run.cores_busy:.2f} cores busy" if run.cores_busy is not None and run.timer != "cuda-events"
                       else "") + ") vs simulated "
                    f"{fmt_time(rec['simulated_step_s'])} as run{shared}: measured/simulated = "
                    f"{rec['ratio']:.2f}; placed at {self.granularity} granularity, {self.crossings} device "
                    "crossings per forward")
        if run.spread > NOISY_SPREAD:
            line.append(f"\nwarning: the timed steps vary by {run.spread:.0%} of their median (more than "
                        f"{NOISY_SPREAD:.0%}): something else shares the machine, or the steps are too short; the "
                        "ratio is not to be trusted (run more --steps, on an idle machine, or with --threads N)",
                        style="yellow")
        table = Table(header_style="bold", show_edge=False)
        for col in ("real device", "logical devices", "simulated peak", "measured peak"):
            table.add_column(col)
        peaks = rec["simulated_peak_memory_bytes"]
        for r, dev in enumerate(dict.fromkeys(self.devices)):
            logical = [i for i, d in enumerate(self.devices) if d == dev and i < p.cluster.num_devices]
            sim = (float(peaks[r]) if rec["settings"].get("shared_devices")
                   else sum(float(peaks[i]) for i in logical))
            meas = run.peak_memory_bytes.get(str(dev))
            table.add_row(str(dev), ",".join(map(str, logical)), fmt_bytes(sim),
                          fmt_bytes(meas) if meas is not None else "not measured (CPU)")
        tail = [Text(f"appended the calibration record to {self.record_path} (fold it with `devplace calibrate "
                     "--runs`)")] if self.record_path is not None else []
        return Group(p.summary(), line, table, *tail)

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def plan_for_run(*, model: str | None = None, plan_file: Path | None = None, devices: str = "cpu",
                 cluster: str | None = None, batch: int | None = None, seq_len: int | None = None,
                 max_nodes: int | None = None, placer: str = DEFAULT_PLACER, order: str = DEFAULT_ORDER,
                 seed: int = DEFAULT_SEED, save_plan: Path | None = None, dtype: str | None = None,
                 amp: bool = False, trust_model: bool = False, record: Path | None = None,
                 settings: dict[str, Any] | None = None, costs: Path | None = None) -> tuple[Plan, Any, Any]:
    """The plan `devplace run` runs, with its module and inputs: a saved plan file's zoo (or custom) model
    rebuilt, or model `model` (a zoo name or package.module:factory) captured in precision `dtype` / `amp` and
    placed on `cluster` (default: the `devices`, speeds measured). A custom model a plan file names is imported
    only with `trust_model` or when `model` repeats it. The `save_plan` and `record` outputs are checked first.
    `settings`: the pipeline placer's schedule, microbatches and chunks for `model`, checked as `devplace place`
    checks them. `costs`: a `devplace profile` table for `model`'s ops and the cluster's overheads
    (`apply_overheads`); the default cluster's CPUs are then the table's measured device.
    The plan is the one `devplace place --model` finds for the same request (`zoo_plan`): placer
    auto's answer may be a pipeline, which `devplace run` runs in one process per stage (`run_plan_pipelined`)."""
    if model is None and plan_file is None:
        raise DevplaceError("give either --model NAME (see `devplace zoo list`, or package.module:factory) or "
                            "--plan FILE")
    check_outputs(inputs=[plan_file, costs], save_plan=save_plan, record=record)
    real = normalize_devices(devices)
    settings = dict(settings or {})
    if plan_file is not None:
        if dtype is not None or amp or settings or costs is not None:
            raise DevplaceError("--dtype/--amp/--schedule/--microbatches/--chunks/--costs are for --model: a plan "
                                "file runs in the precision it was made in, under its own schedule, costed when it "
                                "was made")
        p = load_plan_file(plan_file)
        check_runs(p, plan_file)
        module, inputs = rebuild_zoo_model(p, trust_model=trust_model or (model or False), where=str(plan_file))
        return p, module, inputs
    assert model is not None
    table = CostTable.load(costs) if costs is not None else None
    specs = {d: table.device for d in real if d.type == "cpu"} if table is not None and table.device else None
    c = load_cluster(cluster) if cluster else local_cluster(real, specs=specs)
    if table is not None:
        check_table_fits(c, table)
        c = apply_overheads(c, table)
    check_pipeline_settings(placer, c, settings, batch=batch)
    p, module, inputs = zoo_plan(model, c, batch=batch, seq_len=seq_len, placer=placer, order=order,
                                 max_nodes=max_nodes, seed=seed, dtype=dtype, amp=amp, costs=table, **settings)
    if save_plan is not None:
        p.save(save_plan)
    return p, module, inputs


def check_runs(p: Plan, where: Path) -> None:
    """A DevplaceError for a plan devplace's runtime does not run (`graph.parallel.runtime_gap`: a parallel plan
    with data-parallel replicas, ZeRO, recomputation or a schedule the runtime lacks), rather than running
    something else (its replica 0 alone)."""
    doc = p.placement.meta.get("parallel")
    if doc is None:
        return
    plan = ParallelPlan.from_dict(doc)
    gap = runtime_gap(plan)
    if gap is not None:
        raise DevplaceError(f"{where} holds the parallel plan {plan.label}, and devplace run does not run {gap} yet "
                            f"(it runs {', '.join(RUN_SCHEDULES)}); place it again with one of them, or run it "
                            "with torch (`devplace export --format parallel` writes its configuration)")


def is_parallel(p: Plan) -> bool:
    """True when plan `p` holds a parallel plan with data-parallel replicas, ZeRO, recomputation or a V-shaped
    schedule (two stages per device): `devplace run` runs it in dp * pp processes (`run_plan_parallel`)."""
    doc = p.placement.meta.get("parallel")
    if doc is None:
        return False
    plan = ParallelPlan.from_dict(doc)
    return plan.dp > 1 or max(plan.zero) > 0 or plan.recomputes or plan.schedule in V_SHAPED


def is_pipelined(p: Plan) -> bool:
    """True when plan `p` was made for a micro-batch schedule: `devplace run` runs it pipelined."""
    return p.placement.schedule is not None


def load_plan_file(path: Path) -> Plan:
    """`load_plan`, with the way to a plan where `path` holds a placement (what `devplace place -o` writes)."""
    try:
        return load_plan(path)
    except FormatError as exc:
        if "devplace.placement/1" not in str(exc):
            raise
        raise FormatError(f"{path} is a placement (devplace.placement/1), without the graph and model a plan keeps; "
                          "write the plan with `devplace place ... --save-plan plan.json` and give that") from None


def check_threads(threads: int | None) -> None:
    """Refuse, before any work, a `--threads` that is not None or a whole number from 1 to the CPU cores."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= cpu_cores()):
        raise DevplaceError(f"--threads must be an integer from 1 to {cpu_cores()} (the CPU cores of this machine), "
                            f"got {threads!r}")


def set_threads(threads: int | None) -> None:
    """`torch.set_num_threads(threads)` when given (`--threads` of `devplace run` and `devplace profile`)."""
    check_threads(threads)
    if threads is not None:
        torch.set_num_threads(threads)


def run_model(p: Plan, module: Any, inputs: Any, devices: str, *, steps: int = 5, warmup: int = 2,
              record: Path | None = None, threads: int | None = None) -> Measured:
    """`devplace run`: run and time real training steps of plan `p` on `devices` (with `threads` CPU threads
    when given: `torch.set_num_threads`) and append the calibration record to `record` (JSON lines) if given."""
    set_threads(threads)
    with model_code("the training steps"):
        placed, run, rec = measure_plan(p, module, inputs, normalize_devices(devices), steps=steps, warmup=warmup)
    if record is not None:
        append_record(record, rec)
    return Measured(p, run, rec, list(placed.devices), placed.granularity, placed.crossings, steps, record)


def export_plan(plan_file: Path, fmt: str = "json", devices: str | None = None, *, schedule: str | None = None,
                microbatches: int | None = None, trust_model: bool | str = False,
                parallel: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """`devplace export`: (the JSON document, a one-line note) of a plan's placement as pipeline split points
    with their schedule, a device_map or plain JSON, or of a dp x pp plan made of its pipeline as a torch program
    configuration ("parallel") or torchtitan config sections ("torchtitan"; `export_parallel_plan`, with
    `parallel`: dp, zero, recompute). `schedule`/`microbatches` (pipeline, parallel, torchtitan) replace the kind
    and micro-batch count of the schedule the placement was made for (or of `default_schedule`). A device_map
    rebuilds the plan's model (`export_device_map`); a custom model only with `trust_model` (True or its name)."""
    if fmt not in PIPELINED_FORMATS and (schedule is not None or microbatches is not None):
        raise DevplaceError(f"--schedule and --microbatches belong to --format {', '.join(PIPELINED_FORMATS)}")
    if fmt not in ("parallel", "torchtitan") and parallel:
        raise DevplaceError("--dp, --zero and --recompute belong to --format parallel or torchtitan")
    if fmt in ("parallel", "torchtitan") and devices is not None:
        raise DevplaceError(f"--devices names devices for --format pipeline, device-map or json; a {fmt} export "
                            "runs one process per replica and stage (its mesh is in the file): drop --devices")
    if fmt != "device-map" and trust_model:
        raise DevplaceError("--model/--trust-model belong to --format device-map (the only export that rebuilds "
                            "the model)")
    p = load_plan_file(plan_file)
    if fmt not in ("parallel", "torchtitan") and is_parallel(p):
        # a pipeline, a device_map or a placement would be replica 0 alone: the replicas, ZeRO and recomputation lost
        label = ParallelPlan.from_dict(p.placement.meta["parallel"]).label
        raise DevplaceError(f"{plan_file} holds the parallel plan {label}, which --format {fmt} cannot express; "
                            "export it with --format parallel (devplace run --parallel runs it) or torchtitan, or "
                            "run the plan file itself (devplace run --plan)")
    names = [d.strip() for d in devices.split(",")] if devices else None
    if names is not None and len(names) < p.num_devices_used:
        raise DevplaceError(f"--devices names {len(names)} device(s), but the placement uses {p.num_devices_used} "
                            "logical devices: give one real device name per logical device, e.g. "
                            + ",".join(f"cuda:{i}" for i in range(p.num_devices_used)))
    if fmt in ("parallel", "torchtitan"):
        return export_parallel_plan(p, fmt, schedule=schedule, microbatches=microbatches, **(parallel or {}))
    if fmt == "pipeline":
        split = pipeline_split(p.graph, p.placement, p.cluster, schedule=_export_schedule(p, schedule, microbatches))
        why = split.schedule.unrunnable(len(set(split.devices))) if split.schedule is not None else None
        if why is not None:  # e.g. a hand split judged under 1f1b with too few micro-batches (place --map)
            raise DevplaceError(f"devplace run would refuse this export: {why} (--microbatches, --schedule)")
        doc = split.to_dict()
        if names is not None:
            doc["stage_device_names"] = [names[d] for d in split.devices]
        precision = precision_record(p)  # an amp plan's stages run under autocast (`devplace run --pipeline`)
        if precision:
            doc["precision"] = precision
        if isinstance(p.settings.get("source"), dict):
            doc["source"] = p.settings["source"]  # so that `devplace run --pipeline` can rebuild a zoo model
            doc["source_params"] = source_params(p.graph)  # and check that it is the model the file describes
        return doc, split.summary()
    if fmt == "device-map":
        return export_device_map(p, names, trust_model=trust_model, where=str(plan_file))
    if fmt == "json":
        return export_json(p.graph, p.placement, names), f"{len(p.placement.assignment)} ops placed"
    raise DevplaceError(f"unknown export format {fmt!r}; choose pipeline, device-map, json, parallel or torchtitan")


PIPELINED_FORMATS = ("pipeline", "parallel", "torchtitan")  # the exports that take --schedule/--microbatches


def _export_schedule(p: Plan, schedule: str | None, microbatches: int | None) -> Schedule | None:
    """The schedule a pipelined export of plan `p` carries: the placement's (None: `pipeline_split`'s default),
    its kind and micro-batch count replaced by `schedule` and `microbatches` where given."""
    sched = p.placement.schedule
    if schedule is None and microbatches is None:
        return sched
    base = sched or default_schedule(len(pipeline_split(p.graph, p.placement).devices))
    kind = schedule or base.kind
    sched = Schedule(kind, base.microbatches if microbatches is None else microbatches,
                     base.chunks if kind == base.kind else None)
    _check_step_batch(p.graph, sched.microbatches)
    return sched


def export_parallel_plan(p: Plan, fmt: str = "parallel", *, dp: int | None = None, zero: int | None = None,
                         recompute: str | None = None, schedule: str | None = None,
                         microbatches: int | None = None) -> tuple[dict[str, Any], str]:
    """`devplace export --format parallel|torchtitan`: (the document, a one-line note) of plan `p`'s dp x pp plan
    (`parallel_plan_doc`). "parallel" is the torch program configuration that `devplace run --parallel` runs
    (`parallel_export`), "torchtitan" the job config sections (`torchtitan_config`)."""
    doc, plan, made = parallel_plan_doc(p, dp=dp, zero=zero, recompute=recompute, schedule=schedule,
                                        microbatches=microbatches)
    if fmt == "torchtitan":
        titan = torchtitan_config(read_parallel(doc))
        return titan, f"{plan.label}: torchtitan config sections" + "".join(f"; {n}" for n in titan["notes"])
    cuts = ", ".join(pt["module"] for pt in doc["split_points"]) or "nothing"
    return doc, f"{plan.label}: {plan.num_devices} processes, stages cut at {cuts}; {made}"


def parallel_plan_doc(p: Plan, *, dp: int | None = None, zero: int | None = None, recompute: str | None = None,
                      schedule: str | None = None, microbatches: int | None = None,
                      ) -> tuple[dict[str, Any], ParallelPlan, str]:
    """The `devplace.parallel/2` document of plan `p`'s dp x pp plan, the plan, and a note on where it comes
    from. A plan placed with --dp/--pp/--zero/--recompute/--parallel records the parallel plan its search chose
    (simulated there): that one, cut where its replica's placement cuts (as `--format pipeline` cuts), and any
    of the arguments is an error. Otherwise the plan made of `p`'s pipeline: its stages and schedule
    (`schedule`/`microbatches` replace them), `dp` replicas of it sharing the plan's batch (each runs
    batch / dp in the schedule's M micro-batches), ZeRO stage `zero` and recomputation `recompute` on every
    stage (defaults 1, 0, "none"); that plan is not simulated here. `schedule` zbv or dualpipev lays a pipeline
    placed with 2 chunks per device (interleaved-1f1b or zero-bubble, `--chunks 2`) out as a V: the same 2p stages,
    stage s on device position s and 2p - 1 - s (a placement cannot hold the V itself: the turn's two stages
    would share a device)."""
    src = p.settings.get("source")
    source = src if isinstance(src, dict) and src else None
    recorded = p.placement.meta.get("parallel")
    if recorded is not None:
        given = [f"--{k}" for k, v in (("dp", dp), ("zero", zero), ("recompute", recompute), ("schedule", schedule),
                                       ("microbatches", microbatches)) if v is not None]
        plan = ParallelPlan.from_dict(recorded)
        if given:
            raise DevplaceError(f"the plan holds the parallel plan its search chose ({plan.label}); drop "
                                f"{', '.join(given)}, or place again with them")
        plan, points = recorded_split(p.graph, p.placement)  # its stages as recorded, a V's two per device apart
        return (parallel_export(plan, points, source=source, precision=precision_record(p)), plan,
                f"simulated step {fmt_time(p.result.step_time_s)} (the search's)")
    sched = _export_schedule(p, schedule, microbatches)
    v_shaped = sched is not None and sched.kind in V_SHAPED
    placed = p.placement.schedule
    if v_shaped and (placed is None or int(placed.chunks or 1) != 2):
        raise DevplaceError(f"--schedule {schedule} lays the 2p stages of a pipeline placed with 2 chunks per device "
                            "out as a V; place the plan with --schedule interleaved-1f1b (or zero-bubble) --chunks 2 "
                            "and export that")
    # a V's stages are those of its 2-chunk placement, laid out again
    split = pipeline_split(p.graph, p.placement, p.cluster, schedule=placed if v_shaped else sched)
    if v_shaped:
        split = replace(split, schedule=sched)
    batch = source.get("batch") if source is not None else None
    if not isinstance(batch, int):  # the step's batch: the graph's, times M where it is one micro-batch of it
        batch = graph_batch(p.graph)
        batch = batch * (graph_microbatches(p.graph) or 1) if batch is not None else None
    if batch is None:
        raise DevplaceError("the plan does not record its batch size, which a parallel plan splits over its "
                            "replicas; save the plan of a --model (`devplace place --model ... --save-plan`)")
    pp = len(set(split.devices)) if v_shaped else len(split.devices)
    assert split.schedule is not None  # pipeline_split always sets one
    plan = ParallelPlan(dp=1 if dp is None else dp, pp=pp, microbatches=split.schedule.microbatches, batch=batch,
                        schedule=split.schedule.kind if pp > 1 else "none",
                        chunks=int(split.schedule.chunks or 1) if pp > 1 else None,  # ZB-H1 keeps its one chunk
                        zero=0 if zero is None else zero,
                        recompute="none" if recompute is None else recompute)
    return (parallel_export(plan, split.split_points, source=source, precision=precision_record(p)), plan,
            "not simulated here (place with --dp/--zero/--recompute for a simulated plan)")


def export_device_map(p: Plan, names: list[str] | None = None, *, trust_model: bool | str = False,
                      where: str = "the plan") -> tuple[dict[str, Any], str]:
    """`devplace export --format device-map`: (the `devplace.device_map/1` document, a one-line note) of plan `p`.

    A plan of a zoo or custom model (its `source`) rebuilds the model, in the plan's precision, as `devplace run
    --plan` does (a custom model is code: imported only with `trust_model` True or equal to its name), so the map
    covers every parameter and buffer, tied ones on one device (`device_map` with the model); its names are the
    model's own (`DeviceMap.own`: a loss wrapper's prefix dropped, the file's "module" says which), as
    `from_pretrained(device_map=...)` and accelerate's `dispatch_model` take them. A plan without a model to
    rebuild (from a graph file or a Python module) maps modules only: "complete" is false, and the note says
    that accelerate needs the tensors outside mapped modules as well."""
    src = p.settings.get("source")
    if isinstance(src, dict) and ("zoo" in src or "custom" in src):
        module, inputs = rebuild_zoo_model(p, trust_model=trust_model, where=where)
        inputs, autocast = plan_precision(p, module, inputs)
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else nullcontext():
            dm = device_map(p.graph, p.placement, p.cluster, module, inputs)
        mapping, complete = dm.own(names), True
        what = (f"{len(mapping)} entries cover every parameter and buffer of "
                + (f"the wrapped model {dm.module!r} (names are its own)" if dm.module else "the model"))
    else:
        if trust_model:
            raise DevplaceError(f"{where} names no zoo or custom model to rebuild, so --model/--trust-model have "
                                "nothing to do; drop them")
        dm = device_map(p.graph, p.placement, p.cluster)
        mapping, complete = dm.named(names), False
        what = (f"{len(mapping)} modules mapped (modules only: the plan names no model to rebuild, and accelerate "
                "needs every parameter and buffer mapped; place a --model and save that plan for a complete map)")
    doc = {"format": "devplace.device_map/1", "device_map": mapping, "module": dm.module, "complete": complete,
           "step_time_s": dm.step_time_s, "op_level_step_time_s": dm.op_level_step_time_s, "slowdown": dm.slowdown,
           "feasible": dm.feasible}
    return doc, (f"{what}; simulated step {fmt_time(dm.step_time_s)} vs {fmt_time(dm.op_level_step_time_s)} at op "
                 f"granularity ({dm.slowdown:.3f}x)" + ("" if dm.feasible else "; the map does NOT fit memory"))


def _check_step_batch(graph: CompGraph, microbatches: int) -> None:
    """A DevplaceError unless `microbatches` splits the batch of the step `graph` is (or is one micro-batch of)
    into equal micro-batches: what `devplace run` needs, checked when exporting instead of when running."""
    batch = graph_batch(graph)
    if batch is None:
        return
    batch *= graph_microbatches(graph) or 1
    if batch % microbatches:
        raise DevplaceError(f"--microbatches {microbatches} does not split the plan's batch of {batch} into equal "
                            f"micro-batches; use one of {divisors_text(batch)}")


@dataclass(frozen=True)
class PipelineRan:
    """What `devplace run --pipeline` did: the pipelined steps and the unpipelined loss of the same batch."""

    export: PipelineExport
    run: PipelineRun
    warmup: int
    reference_loss: float
    batch_statistics: bool = False  # the model has training-mode BatchNorm: micro-batching changes its loss
    dropout: bool = False  # the model has active dropout: each process draws its own masks

    @property
    def timed_s(self) -> list[float]:
        """The timed steps' seconds (after the warm-up)."""
        return self.run.step_times_s[self.warmup:]

    @property
    def cores_busy(self) -> float | None:
        """CPU seconds of all the processes per wall-clock second of the timed steps (at most the process count:
        one thread each)."""
        return RunResult(self.timed_s, "wall clock", cpu_times_s=self.run.cpu_times_s[self.warmup:]).cores_busy

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (`devplace run --pipeline --json`)."""
        return json_safe({"format": "devplace.pipeline-run/1", "source": self.export.source,
                          "split_points": list(self.export.split_points), "schedule": self.export.schedule.to_dict(),
                          "processes": self.run.processes, "backend": "gloo", "losses": self.run.losses,
                          "reference_loss": self.reference_loss, "measured_steps_s": self.timed_s,
                          "microbatching_changes_result": self.batch_statistics, "dropout_masks_differ": self.dropout,
                          "measured_step_s": statistics.median(self.timed_s),
                          "measured_spread": RunResult(self.timed_s, "wall clock").spread,
                          "measured_cpu_steps_s": self.run.cpu_times_s[self.warmup:],
                          "cores_busy": self.cores_busy,
                          "simulated_step_s": self.export.doc.get("pipelined_step_time_s"),
                          # per process, per timed step: [what, start s, end s, CPU s] (`PipelineRun.timelines`)
                          "timelines": [[[list(span) for span in step] for step in t[self.warmup:]]
                                        for t in self.run.timelines]})

    def __rich__(self) -> Text:
        s, r = self.export.schedule, self.run
        sim = self.export.doc.get("pipelined_step_time_s")
        spread = RunResult(self.timed_s, "wall clock").spread
        return Text(f"{self.export.num_stages} stages in {r.processes} CPU processes (gloo), {s.kind} schedule, "
                    f"{s.microbatches} "
                    f"micro-batches: measured step {fmt_time(statistics.median(self.timed_s))} (median of "
                    f"{len(self.timed_s)}, spread {spread:.0%} of it, wall clock, 1 thread per process"
                    + (f", {self.cores_busy:.2f} of {r.processes} cores busy" if self.cores_busy is not None else "")
                    + ")"
                    + (f" [warning: steps vary by more than {NOISY_SPREAD:.0%}; not to be trusted]"
                       if spread > NOISY_SPREAD else "")
                    + (f", simulated {fmt_time(float(sim))} on the plan's cluster" if sim is not None else "")
                    + f"; first step's loss {r.losses[0]:.6g}, unpipelined {self.reference_loss:.6g}"
                    + _why_losses_differ(self.batch_statistics, self.dropout, "micro-batch"))

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def run_pipeline_export(pipeline_file: Path, *, processes: int | None = None, steps: int = 5, warmup: int = 2,
                        optimizer: str = "adam", trust_model: bool | str = False) -> PipelineRan:
    """`devplace run --pipeline`: rebuild the export's zoo model and run `warmup` + `steps` pipelined training
    steps in one CPU process per stage (gloo); also the unpipelined loss of the same batch, for comparison. A
    custom model the export names is imported only when `trust_model` is True or its name."""
    check_steps(steps, warmup)
    ex = read_pipeline(pipeline_file)
    module, inputs, loss_fn = build_source(ex.source, trust_model=trust_model, where=str(pipeline_file),
                                           params=ex.source_params)
    inputs, autocast = apply_precision(ex.precision, module, inputs, str(pipeline_file))
    return _run_pipelined(ex, module, inputs, loss_fn, processes=processes, steps=steps, warmup=warmup,
                          optimizer=optimizer, autocast=autocast)


def run_plan_pipelined(p: Plan, module: Any, inputs: Any, *, steps: int = 5, warmup: int = 2,
                       optimizer: str = "adam") -> PipelineRan:
    """`devplace run` of a plan made for a micro-batch schedule (`--schedule`, or a saved pipelined plan): its
    placement exported as pipeline stages under its schedule (as `devplace export --format pipeline` writes them)
    and run as `devplace run --pipeline` runs an export, so that the measured step is the pipelined one the
    simulation predicts, not the placement run unpipelined."""
    inputs, autocast = plan_precision(p, module, inputs)  # an amp plan's stages run under autocast
    doc = pipeline_split(p.graph, p.placement, p.cluster, schedule=p.placement.schedule).to_dict()
    if isinstance(p.settings.get("source"), dict):
        doc["source"] = p.settings["source"]
    return _run_pipelined(read_pipeline(doc), module, inputs, p.loss_fn, steps=steps, warmup=warmup,
                          optimizer=optimizer, autocast=autocast)


def _run_pipelined(ex: PipelineExport, module: Any, inputs: Any, loss_fn: Any, *, processes: int | None = None,
                   steps: int, warmup: int, optimizer: str, autocast: torch.dtype | None = None) -> PipelineRan:
    """Run export `ex` of `module` (`run_pipeline`, with the model's own `loss_fn` where it has one) and the
    unpipelined loss of the same batch, computed as the capture computes it (under `autocast` for an amp plan)."""
    check_steps(steps, warmup)
    reference, reduction = _reference(module, inputs, loss_fn, autocast)
    ran = run_pipeline(module, inputs, ex, processes=processes, steps=warmup + steps, optimizer=optimizer,
                       loss_fn=loss_fn, loss_reduction=reduction, autocast=autocast)
    return PipelineRan(ex, ran, warmup, reference, *_random_or_batched(module))


def _random_or_batched(module: Any) -> tuple[bool, bool]:
    """Whether `module` has training-mode BatchNorm (a micro-batch or replica is normalised by its own
    statistics) and active dropout (each process draws its own masks): either makes a pipelined or parallel
    step's loss differ from the one-process step's."""
    training = [m for m in module.modules() if m.training]
    return (any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in training),
            any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in training))


def _why_losses_differ(batch_statistics: bool, dropout: bool, part: str) -> str:
    """The report's note on why its loss may differ from the one-process step's (empty where it should not)."""
    why = ([f"the model's BatchNorm normalises each {part} by its own statistics"] if batch_statistics else []) + (
        ["the model's dropout draws its own masks in each process"] if dropout else [])
    return f" (they differ: {'; '.join(why)})" if why else ""


def _reference(module: Any, inputs: Any, loss_fn: Any, autocast: torch.dtype | None = None) -> tuple[float, str]:
    """The one-process loss of the whole batch, computed as the capture computes it (the model's own
    `loss_fn`, else `default_loss`; under the CPU's `autocast` for an amp plan), and how a step's loss combines
    its micro-batches' (and replicas'), read from the same forward: "mean" for a loss function or the model's
    own loss (a mean over the batch), "sum" where `default_loss` sums the outputs."""
    with torch.enable_grad(), cpu_autocast(autocast):  # the default loss looks for a trainable parameter's output
        out = module(*inputs)
        loss = float((loss_fn(out) if loss_fn is not None else default_loss(out)).detach())
    return loss, loss_reduction(out, loss_fn is not None)


@dataclass(frozen=True)
class ParallelRan:
    """What `devplace run --parallel` did: the parallel steps and the one-process loss of the same batch."""

    export: ParallelExport
    run: ParallelRun
    warmup: int
    reference_loss: float
    batch_statistics: bool = False  # the model has training-mode BatchNorm: each replica's statistics its own
    dropout: bool = False  # the model has active dropout: each process draws its own masks

    @property
    def timed_s(self) -> list[float]:
        """The timed steps' seconds (after the warm-up)."""
        return self.run.step_times_s[self.warmup:]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (`devplace run --parallel --json`)."""
        return json_safe({"format": "devplace.parallel-run/1", "source": self.export.source,
                          "parallel": self.export.plan.to_dict(), "split_points": list(self.export.split_points),
                          "processes": self.run.processes, "backend": "gloo", "losses": self.run.losses,
                          "replica_losses": self.run.replica_losses, "reference_loss": self.reference_loss,
                          "processes_setup": self.run.setups, "measured_steps_s": self.timed_s,
                          "batching_changes_result": self.batch_statistics, "dropout_masks_differ": self.dropout,
                          "measured_step_s": statistics.median(self.timed_s)})

    def __rich__(self) -> Text:
        plan, r = self.export.plan, self.run
        return Text(f"{plan.label}: {r.processes} CPU processes (gloo), measured step "
                    f"{fmt_time(statistics.median(self.timed_s))} (median of {len(self.timed_s)}, wall clock, 1 "
                    f"thread per process); first step's loss {r.losses[0]:.6g} (replicas "
                    f"{', '.join(f'{v:.6g}' for v in r.replica_losses)}), one process {self.reference_loss:.6g}"
                    + _why_losses_differ(self.batch_statistics, self.dropout, "replica's micro-batch"))

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def run_parallel_export(parallel_file: Path, *, steps: int = 5, warmup: int = 2, optimizer: str = "adam",
                        trust_model: bool | str = False) -> ParallelRan:
    """`devplace run --parallel`: rebuild the export's zoo model and run `warmup` + `steps` training steps of its
    dp x pp plan in dp * pp CPU processes (gloo, `run_parallel`); also the one-process loss of the same batch.
    A custom model the export names is imported only when `trust_model` is True or its name."""
    check_steps(steps, warmup)
    ex = read_parallel(parallel_file)
    module, inputs, loss_fn = build_source(ex.source, trust_model=trust_model, where=str(parallel_file))
    inputs, autocast = apply_precision(ex.precision, module, inputs, str(parallel_file))
    return _run_parallel(ex, module, inputs, loss_fn, steps=steps, warmup=warmup, optimizer=optimizer,
                         autocast=autocast)


def run_plan_parallel(p: Plan, module: Any, inputs: Any, *, steps: int = 5, warmup: int = 2,
                      optimizer: str = "adam") -> ParallelRan:
    """`devplace run --plan` of a plan that holds a parallel plan (`is_parallel`): its export
    (`parallel_plan_doc`) run as `devplace run --parallel` runs one."""
    check_steps(steps, warmup)
    inputs, autocast = plan_precision(p, module, inputs)  # an amp plan's stages run under autocast
    doc, _, _ = parallel_plan_doc(p)
    return _run_parallel(read_parallel(doc), module, inputs, p.loss_fn, steps=steps, warmup=warmup,
                         optimizer=optimizer, autocast=autocast)


def _run_parallel(ex: ParallelExport, module: Any, inputs: Any, loss_fn: Any, *, steps: int, warmup: int,
                  optimizer: str, autocast: torch.dtype | None = None) -> ParallelRan:
    """Run export `ex` of `module` (`run_parallel`) and the one-process loss of the same batch (under `autocast`
    for an amp plan); a model without its own loss runs with its outputs' sum as the loss, as the capture takes
    it (`default_loss`)."""
    reference, reduction = _reference(module, inputs, loss_fn, autocast)
    ran = run_parallel(module, inputs, ex, steps=warmup + steps, optimizer=optimizer, loss_fn=loss_fn,
                       loss_reduction=reduction, autocast=autocast)
    return ParallelRan(ex, ran, warmup, reference, *_random_or_batched(module))


@dataclass(frozen=True)
class StudyRan:
    """What `devplace study run` did."""

    summary: StudySummary

    def to_dict(self) -> dict[str, Any]:
        """The summary as a JSON object."""
        s = self.summary
        return {"study": s.study, "cells": s.cells, "skipped": s.skipped, "ran": s.ran, "failed": s.failed,
                "wall_s": s.wall_s, "db": s.db}

    def __rich__(self) -> Text:
        s = self.summary
        return Text(f"{s.study}: {s.ran} cells run ({s.failed} failed), {s.skipped} already done; {s.wall_s:.1f} s; "
                    f"results in {s.db}"
                    + ("; see the error column, rerun failed cells with --retry-failed" if s.failed else ""))

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def study_run(study: Path | None, *, preset: str | None = None, db: Path = Path("study.sqlite"),
              backend: str = "local", workers: int = 1, address: str | None = None, retry_failed: bool = False,
              progress: bool = True, max_cells: int | None = None) -> StudyRan:
    """`devplace study run`: run every unfinished cell of a study file or preset into `db` (a grid of more
    than `max_cells` cells, default DEVPLACE_MAX_CELLS or 1,000,000, is refused before any cell is made)."""
    if (study is None) == (preset is None):
        raise StudyError("give a study TOML file or --preset NAME (one of the two)")
    spec = load_study(study if study is not None else preset, preset=preset is not None, max_cells=max_cells)
    return StudyRan(run_study(spec, db, backend=backend, workers=workers, address=address,
                              retry_failed=retry_failed, progress=progress, max_cells=max_cells))


@dataclass(frozen=True)
class StudyVerified:
    """What `devplace study verify` found: each stored cell rerun against its row."""

    study: str
    db: str
    reruns: tuple[Rerun, ...]

    @property
    def same(self) -> bool:
        return all(r.same for r in self.reruns)

    def to_dict(self) -> dict[str, Any]:
        """The reruns as a JSON object."""
        return {"study": self.study, "db": self.db, "same": self.same,
                "cells": [{"key": r.key, "cell": r.what, "stored": list(r.stored), "now": list(r.now),
                           "curve_parts_at": r.curve_parts_at, "same": r.same} for r in self.reruns]}

    def __rich__(self) -> Group:
        table = Table(title=f"{self.study}: {len(self.reruns)} stored cells rerun ({self.db})")
        for col in ("key", "cell", "stored", "now", "result"):
            table.add_column(col)
        for r in self.reruns:
            result = "same" if r.same else ("differs" + (f": the curve parts at episode {r.curve_parts_at}"
                                                         if r.curve_parts_at is not None else ""))
            table.add_row(r.key, r.what, *(f"{st} {t!r}" for st, t in (r.stored, r.now)), result)
        verdict = ("every cell rerun gives its stored row bit for bit" if self.same else
                   f"{sum(not r.same for r in self.reruns)} of {len(self.reruns)} cells differ from their stored rows "
                   f"(other code, or nondeterminism)")
        return Group(table, Text(verdict))

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def study_verify(study: Path | None, *, preset: str | None = None, db: Path = Path("study.sqlite"), cells: int = 3,
                 seed: int = 0, keys: Sequence[str] = ()) -> StudyVerified:
    """`devplace study verify`: rerun `keys`, or `cells` stored cells drawn with `seed`, of a study file or preset
    whose rows are in `db`, and compare each with its row."""
    if (study is None) == (preset is None):
        raise StudyError("give a study TOML file or --preset NAME (one of the two)")
    if cells < 1:
        raise StudyError(f"--cells {cells}: give at least 1 cell to rerun")
    spec = load_study(study if study is not None else preset, preset=preset is not None)
    return StudyVerified(spec.name, str(db), tuple(verify_study(spec, db, cells=cells, seed=seed, keys=tuple(keys))))

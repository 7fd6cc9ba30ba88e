"""`devplace.plan(...)`: capture, cost, coarsen, place and simulate a module's training step in one call, and the
`devplace.plan/1` file that keeps the result (docs/runtime.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Group
from rich.text import Text
from torch import nn

from devplace.defaults import AUTO_PLACER, DEFAULT_ORDER, DEFAULT_PLACER, DEFAULT_SEED, PARALLEL_PLACER
from devplace.errors import DevplaceError, FormatError
from devplace.graph.batch import graph_batch
from devplace.graph.coarsen import Coarsening
from devplace.graph.compgraph import CompGraph
from devplace.graph.jsonio import read_json, write_json
from devplace.graph.parallel import STAGES_KEY, ParallelPlan, ParallelPlanError, recorded_stages
from devplace.graph.placement import MadeBy, Placement
from devplace.hardware.cluster import Cluster, load_cluster
from devplace.hardware.cost import CostTable, cost_devices
from devplace.placers import get_placer
from devplace.placers.search import MicrobatchGraph, Tried
from devplace.planning import (
    MAP_PLACER,
    AsRun,
    Baseline,
    Placed,
    baselines_line,
    check_seed,
    how_made,
    place_graph,
    precision_text,
    render_text,
)
from devplace.sim import SimResult, simulate
from devplace.sim.parallel import simulate_parallel
from devplace.sim.summary import result_view
from devplace.units import fmt_time

__all__ = ["FORMAT", "Plan", "build_source", "load_plan", "named_source", "plan", "plan_from_placed",
           "plan_from_prepared", "rebuild_zoo_model", "zoo_plan"]

FORMAT = "devplace.plan/1"


@dataclass(eq=False)
class Plan:
    """A placement of a model's full training graph on a cluster, with its simulated result: a `Placed` (graph,
    cluster, placement, result, coarsening) plus what running it needs.

    `graph` is the captured, costed graph (every op); `placement` places each of its ops; `result` is the
    `devplace`-model simulation of that placement; `build` records how the graph was made (optimizer, max_nodes,
    precision, model source) and `settings` adds how the placement was made (`MADE_SETTINGS`, read from the
    placement's record `placement.made_by`, never copied). `coarse` (the coarsening the placer saw),
    `example_inputs` and `loss_fn` are kept in memory only.
    """

    placed: Placed
    build: dict[str, Any] = field(default_factory=dict)
    example_inputs: Any = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """What the file's "settings" holds: how the placement was made ("placer", "order", "seed",
        "placer_settings", "request": the placement's record, `made_settings`) and how the graph was (`build`)."""
        return {**made_settings(self.placed.made_by), **self.build}

    @property
    def graph(self) -> CompGraph:
        return self.placed.graph

    @property
    def cluster(self) -> Cluster:
        return self.placed.cluster

    @property
    def placement(self) -> Placement:
        return self.placed.placement

    @property
    def result(self) -> SimResult:
        return self.placed.result

    @property
    def coarse(self) -> Coarsening | None:
        return self.placed.coarsening

    @property
    def as_run(self) -> AsRun:
        """The placement as `apply` runs it and its simulation (`devplace.planning.as_run`)."""
        return self.placed.as_run

    @property
    def runtime_placement(self) -> Placement:
        """The placement as `apply` runs it: backward and optimizer ops with their forward op (see
        `devplace.runtime.apply.runtime_placement`); equal to `placement` when the placer kept them together."""
        return self.as_run.placement

    @property
    def runtime_result(self) -> SimResult:
        """The simulation of `runtime_placement`: the step time to compare with a measured run."""
        return self.as_run.result

    @property
    def baselines(self) -> tuple[Baseline, Baseline]:
        """The best single device and the even split of this graph (`devplace.planning.baselines`; the even
        split under the placement's schedule if it has one)."""
        return self.placed.baselines

    @property
    def num_devices_used(self) -> int:
        """How many logical devices (0..n-1) the placement needs."""
        return max(self.placement.assignment.values(), default=0) + 1

    def summary(self, text: bool = False) -> Any:
        """The table `devplace place` prints (a rich renderable), or with `text=True` the same as plain text."""
        rt = self.runtime_result
        moved = self.as_run.moved
        groups = self.placed.placed_groups
        line = Text(how_made(self.placed.made_by)
                    + (f"; {groups} groups of {self.graph.num_nodes} ops" if groups != self.graph.num_nodes else "")
                    + precision_text(self.graph)
                    + (f"; as run by devplace.runtime ({moved} backward/optimizer ops follow their forward op): "
                       f"step time {fmt_time(rt.step_time_s)}, {'feasible' if rt.feasible else 'INFEASIBLE'}"
                       if moved else "; devplace.runtime runs this placement as simulated"))
        view = Group(result_view(self.graph, self.cluster, self.result, self.placed.bound), line,
                     baselines_line(self.cluster, self.baselines, rt.step_time_s))
        return render_text(view) if text else view

    def to_dict(self) -> dict[str, Any]:
        """The `devplace.plan/1` document (with the search's log, from which a loaded plan reports how it was found)."""
        return {"format": FORMAT, "settings": dict(self.settings), "cluster": self.cluster.to_dict(),
                "result": self.result.to_dict(), "placement": self.placement.to_dict(),
                "search_log": [t.to_dict() for t in self.placed.log], "graph": self.graph.to_dict()}

    def save(self, path: str | Path) -> None:
        """Write the plan as `devplace.plan/1` JSON (graph, cluster, placement, settings, simulated result)."""
        write_json(path, self.to_dict())

    def apply(self, model: nn.Module, devices: Sequence[str | torch.device] | str, example_inputs: Any = None) -> Any:
        """`model` placed on `devices` (real device per logical index): a `devplace.runtime.PlacedModule`."""
        from devplace.runtime.apply import apply_placement

        inputs = example_inputs if example_inputs is not None else self.example_inputs
        return apply_placement(model, self.graph, self.placement, devices, inputs)


def plan_from_prepared(prepared: Any, cluster: Cluster, *, placer: str = DEFAULT_PLACER, order: str = DEFAULT_ORDER,
                       seed: int = DEFAULT_SEED, settings: Mapping[str, Any] | None = None,
                       source: Mapping[str, Any] | None = None, microbatch_graph: MicrobatchGraph | None = None,
                       **placer_settings: Any) -> Plan:
    """Place a `capture.pipeline.Prepared` model on `cluster` and simulate the expanded placement
    (`devplace.planning.place_graph`; `microbatch_graph`: where a micro-batch count's graph comes from)."""
    placed = place_graph(prepared.graph, cluster, placer=placer, order=order, seed=seed,
                         coarsening=prepared.coarsening, full=prepared.full, microbatch_graph=microbatch_graph,
                         **placer_settings)
    return plan_from_placed(placed, settings=settings, source=source)


def plan_from_placed(placed: Placed, *, settings: Mapping[str, Any] | None = None,
                     source: Mapping[str, Any] | None = None) -> Plan:
    """The plan of a placement made by `place_graph` (what `devplace place --save-plan` writes): its graph,
    cluster, placement (with its schedule, if any, and its record of how it was made) and simulated result;
    `settings` adds how the graph was made (optimizer, max_nodes, precision) and `source` the model to rebuild
    (`named_source`; empty for a graph file, which `devplace export` takes but `devplace run --plan` cannot
    rebuild)."""
    return Plan(placed, {**(settings or {}), "source": dict(source or {})})


# the keys of a plan's "settings" that say how its placement was made, each read from the placement's record
MADE_SETTINGS = ("placer", "order", "seed", "placer_settings", "request")


def made_settings(made: MadeBy) -> dict[str, Any]:
    """A plan file's `MADE_SETTINGS` of the record `made`: "placer", "order", "seed" and "placer_settings" are the
    search's answer (the placer kept and the settings it took: placing them again gives the same placement),
    "request" what was asked (placer "auto", order "auto", ...; asking it again gives the same answer)."""
    return {"placer": made.placer, "order": made.order, "seed": made.seed, "placer_settings": dict(made.settings),
            "request": dict(made.request or {})}


def named_source(name: str, batch: int | None, seq_len: int | None, build_seed: int) -> dict[str, Any]:
    """A plan's `source` setting for zoo model or custom `package.module:factory` `name`: what
    `rebuild_zoo_model` and a pipeline export's runner build again (a zoo model's default batch and sequence
    length written out, so the file does not depend on the zoo's defaults later)."""
    from devplace.capture.custom import is_custom
    from devplace.zoo.models import get_spec

    if is_custom(name):
        return {"custom": name, "batch": batch, "seq_len": seq_len, "build_seed": build_seed}
    spec = get_spec(name)
    return {"zoo": name, "batch": spec.batch if batch is None else batch,
            "seq_len": spec.seq_len if seq_len is None else seq_len, "build_seed": build_seed}


def plan(model: nn.Module, example_inputs: Any, cluster: Cluster | str, *, placer: str = DEFAULT_PLACER,
         order: str = DEFAULT_ORDER, optimizer: str = "adam", max_nodes: int | None = None, seed: int = DEFAULT_SEED,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, dtype: str | None = None, amp: bool = False,
         costs: CostTable | None = None, **placer_settings: Any) -> Plan:
    """Capture `model`'s training step on `example_inputs`, cost it for the cluster's first device, coarsen it
    (to `max_nodes` groups if given), place it with `placer` walking `order`, and simulate the placement.

    `cluster` is a `Cluster`, a preset name or a cluster JSON file. `order` is any order `devplace.place`
    accepts (when `"auto"` lands there, it works here unchanged). `loss_fn`, `optimizer` and the precision
    (`dtype` "fp32"/"bf16"/"fp16", `amp` for autocast) as for `devplace.capture.capture`; the plan records the
    precision, and `devplace.runtime.run.measure_plan` runs the steps in it. Extra keyword arguments are
    placer settings: with `placer="pipeline"`, `schedule="1f1b"`, `microbatches=8` (and `chunks` for
    interleaved-1f1b) make a pipeline, whose `result` is the step under that schedule
    (`plan.placement.schedule`). `semantics="op-by-op"` overrides the captured graph's
    "autograd" (`devplace.graph.semantics`): a placement that `apply` cannot run as placed. `costs`: a profiled
    cost table (`devplace profile`) for the ops, with its per-op overhead, instead of the analytic model (its
    pipelining overheads belong on `cluster`: `hardware.cost.apply_overheads`).

    The search is `devplace place --model`'s: placer "auto" and `pipeline` place each micro-batch count's pipeline
    on the step captured again at batch / M (`capture.pipeline.module_microbatch_graphs`).
    """
    from devplace.capture.pipeline import module_microbatch_graphs, prepare
    from devplace.capture.torch_capture import capture

    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    graph = capture(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, dtype=dtype, amp=amp)
    device, kinds = cost_devices(c)
    prepared = prepare(graph, device=device, kinds=kinds, max_nodes=max_nodes, costs=costs)
    batch = graph_batch(graph)
    micro = None if batch is None else module_microbatch_graphs(
        model, example_inputs, batch, loss_fn=loss_fn, optimizer=optimizer, dtype=dtype, amp=amp, device=device,
        kinds=kinds, max_nodes=max_nodes, costs=costs)
    p = plan_from_prepared(prepared, c, placer=placer, order=order, seed=seed,
                           settings={"optimizer": optimizer, "max_nodes": max_nodes, "dtype": dtype, "amp": amp},
                           source={"module": type(model).__name__}, microbatch_graph=micro, **placer_settings)
    p.example_inputs = example_inputs
    p.loss_fn = loss_fn
    return p


def _check_settings(settings: Mapping[str, Any], path: str | Path) -> None:
    """A plan's record of how it was placed: `placer` a name, `seed` a seed, `placer_settings` an object that the
    placer (when registered) accepts, as `--set` would be checked (`PlacerSpec.validate`: types, ranges,
    limits); FormatError naming the file and the field."""
    placer, seed, given = settings.get("placer"), settings.get("seed"), settings.get("placer_settings")
    if placer is not None and not isinstance(placer, str):
        raise FormatError(f"{path}: settings.placer must be a placer name, got {placer!r:.60}; the file was edited "
                          "or damaged: make the plan again")
    if seed is not None:
        try:
            check_seed(seed)
        except DevplaceError as exc:
            raise FormatError(f"{path}: settings.seed: {exc}") from None
    if given is None:
        return
    if not isinstance(given, Mapping):
        raise FormatError(f"{path}: settings.placer_settings must be a JSON object (setting -> value), got "
                          f"{given!r:.60}; the file was edited or damaged: make the plan again")
    if placer in (None, "", AUTO_PLACER, MAP_PLACER, PARALLEL_PLACER):
        return  # no one placer's settings to check them against
    try:
        get_placer(placer).validate(given)
    except DevplaceError as exc:
        raise FormatError(f"{path}: settings.placer_settings: {exc}") from None


def replay(graph: CompGraph, cluster: Cluster, placement: Placement, where: str | Path = "the plan") -> SimResult:
    """The step of a saved placement, simulated again: a parallel plan's (its "parallel", on the stages its
    "stages" record, `graph.parallel.recorded_stages`) as its search simulated it (`simulate_parallel`: replicas,
    sync, ZeRO, recomputation; a V's two stages per device), so that an automatic choice replays as it was judged;
    any other placement under its own schedule. FormatError naming `where` for a record that does not match."""
    doc = placement.meta.get("parallel")
    if doc is None:
        return simulate(graph, cluster, placement, schedule=placement.schedule)
    try:
        plan = ParallelPlan.from_dict(doc)
        stage = recorded_stages(plan, graph.ids, placement.assignment, placement.meta.get(STAGES_KEY))
    except ParallelPlanError as exc:
        raise FormatError(f"{where}: {exc}") from None
    return simulate_parallel(graph, cluster, np.asarray(stage, dtype=np.int64), plan).as_sim_result()


def load_plan(path: str | Path) -> Plan:
    """Read a `devplace.plan/1` file (unknown versions are rejected) and re-simulate its placement."""
    doc = read_json(path, FORMAT)
    for key in ("graph", "cluster", "placement"):
        if not isinstance(doc.get(key), Mapping):
            raise FormatError(f"{path}: \"{key}\" must be a JSON object; is this a devplace plan file?")
    gdoc = doc["graph"]
    meta = {k: v for k, v in gdoc.items() if k not in ("format", "name", "nodes", "edges")}
    graph = CompGraph.build(str(gdoc.get("name", "")), gdoc.get("nodes", []), gdoc.get("edges", []), meta=meta)
    cluster = Cluster.from_dict(doc["cluster"], where=f"{path}: cluster")
    placement = Placement.from_dict(doc["placement"], f"{path}: placement")
    settings = doc.get("settings", {})
    if not isinstance(settings, Mapping) or not isinstance(settings.get("source", {}), Mapping | None):
        raise FormatError(f"{path}: \"settings\" must be a JSON object (and its \"source\" too); is this a devplace "
                          "plan file?")
    _check_settings(settings, path)
    placement = replace(placement, made_by=_record(settings, placement.made_by, path))
    entries = doc.get("search_log", [])
    try:
        if not isinstance(entries, list):
            raise ValueError(f"a list of entries, got {entries!r:.60}")
        log = tuple(Tried.from_dict(e) for e in entries)
    except ValueError as exc:
        raise FormatError(f"{path}: \"search_log\": {exc}; the file was edited or damaged: make the plan "
                          "again") from None
    result = replay(graph, cluster, placement, path)
    # how it was placed is the placement's record and the search's log; the search's wall time is not in the file
    placed = Placed(graph, cluster, placement, result, log=log)
    return Plan(placed, {k: v for k, v in settings.items() if k not in MADE_SETTINGS})


def _record(settings: Mapping[str, Any], made: MadeBy | None, path: str | Path) -> MadeBy:
    """The record of how a saved plan's placement was made: the placement's own (`made`), each part it lacks
    (a file written before the placement recorded it) from the plan's `MADE_SETTINGS`; FormatError naming `path`
    where the two disagree (an edited file: which of them would replay?)."""
    if made is None:
        made = MadeBy(str(settings.get("placer") or ""), settings.get("order"), settings.get("seed", DEFAULT_SEED),
                      dict(settings.get("placer_settings") or {}))
    filled = replace(made, request=made.request if made.request is not None else settings.get("request"))
    mine = made_settings(filled)
    differ = [k for k in MADE_SETTINGS if k in settings and settings[k] != mine[k]]
    if differ:
        k = differ[0]
        raise FormatError(f"{path}: settings.{k} is {settings[k]!r:.80} but the placement records {mine[k]!r:.80}; "
                          "the file was edited or damaged: make the plan again")
    return filled


def zoo_plan(name: str, cluster: Cluster | str, *, batch: int | None = None, seq_len: int | None = None,
             placer: str = DEFAULT_PLACER, order: str = DEFAULT_ORDER, optimizer: str = "adam",
             max_nodes: int | None = None, seed: int = DEFAULT_SEED, dtype: str | None = None, amp: bool = False,
             costs: CostTable | None = None, **placer_settings: Any
             ) -> tuple[Plan, nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model `name`, or a custom `package.module:factory` one (`devplace.capture.custom`), for real
    (seeded, on the CPU) and plan it in precision `dtype` / `amp`; returns (plan, module, inputs).

    The plan records the model's name, batch and sequence length, so `rebuild_zoo_model(plan)` makes the same
    module and inputs again (what `devplace run --plan` does). The step is captured and placed as `devplace place
    --model` does it (`capture.custom.named_prepared`, micro-batches by `microbatch_graphs`), so `devplace run
    --model` runs the placement `devplace place --model` reports for the same request."""
    from devplace.capture.custom import build_named_model, microbatch_graphs, named_prepared

    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    device, kinds = cost_devices(c)
    prepared = named_prepared(name, batch=batch, seq_len=seq_len, optimizer=optimizer, dtype=dtype, amp=amp,
                              max_nodes=max_nodes, device=device, kinds=kinds, costs=costs)
    p = plan_from_prepared(prepared, c, placer=placer, order=order, seed=seed,
                           settings={"optimizer": optimizer, "max_nodes": max_nodes, "dtype": dtype, "amp": amp},
                           source=named_source(name, batch, seq_len, seed),
                           microbatch_graph=microbatch_graphs(prepared), **placer_settings)
    module, inputs, p.loss_fn = build_named_model(name, batch, seq_len, seed=seed)
    p.example_inputs = inputs
    return p, module, inputs


def rebuild_zoo_model(p: Plan, *, trust_model: bool | str = False, where: str = "the plan"
                      ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo (or custom `package.module:factory`) module and inputs a plan made by `zoo_plan` was made for
    (and `p.loss_fn` set to the factory's loss); an error for other plans. A custom model is code, imported only
    when `trust_model` is True or equal to its name (`devplace.capture.custom.check_trusted`); `where` names the
    plan in messages. A source whose model has another parameter count than the plan's graph records is refused
    before it is built (`build_source`'s `params`)."""
    module, inputs, p.loss_fn = _build_named_source(p.settings.get("source"), trust_model, where,
                                                    source_params(p.graph))
    return module, inputs


def source_params(graph: CompGraph) -> int | None:
    """The parameter count of the model `graph` was captured from, as its capture recorded it (None: not
    recorded); what a pipeline export keeps beside the model source ("source_params")."""
    cap = graph.meta.get("capture") if isinstance(graph.meta, Mapping) else None
    params = cap.get("params") if isinstance(cap, Mapping) else None
    return params if isinstance(params, int) and not isinstance(params, bool) else None


def build_source(src: Any, *, trust_model: bool | str = False, where: str = "the pipeline file",
                 params: int | None = None,
                 ) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor] | None]:
    """The zoo (or custom) module, inputs and loss function (None: the capture's default) of a plan's `source`
    setting (model name, batch, seq_len, build_seed; also what a pipeline export made from the plan keeps); an
    error when the plan was made from a Python module. A custom model is imported only when trusted, as for
    `rebuild_zoo_model`. `params` (the parameter count the file records for its model): a zoo model is first built
    on the meta device (no memory, no weights) and refused when its count differs, so that a source edited to
    name another model does not build, let alone train, a model the file does not describe."""
    return _build_named_source(src, trust_model, where, params)


def _build_named_source(src: Any, trust_model: bool | str, where: str, params: int | None,
                        ) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    from devplace.capture.custom import build_named_model, check_trusted, is_custom
    from devplace.errors import DevplaceError

    name = (src.get("zoo", src.get("custom")) if isinstance(src, Mapping) else None)
    if not isinstance(name, str):
        raise DevplaceError("this plan was made from a Python module, not a zoo model, so the command line cannot "
                            "rebuild it; in Python, use plan.apply(model, devices) and devplace.runtime.run_steps "
                            "(or devplace.runtime.run_pipeline for a pipeline export)")
    assert isinstance(src, Mapping)
    # a zoo name has no colon: a "zoo" entry holding one names code as much as a "custom" entry does
    if is_custom(name):
        check_trusted(name, trust_model, where)
    elif isinstance(trust_model, str) and trust_model != name:
        raise DevplaceError(f"--model {trust_model} differs from the model {where} names ({name}); drop --model")
    sizes = [_source_int(src, key, where, 1, 2**31 - 1) for key in ("batch", "seq_len")]
    seed = _source_int(src, "build_seed", where, 0, 2**63 - 1)
    if params is not None and not is_custom(name):  # (a custom model is code the user vouched for)
        with torch.device("meta"):
            shape = build_named_model(name, sizes[0], sizes[1], seed=0 if seed is None else seed)[0]
        built = sum(p.numel() for p in shape.parameters())
        if built != params:
            raise FormatError(f"{where}: its model source names {name!r}, a model of {built:,} parameters, but the "
                              f"file was made for a model of {params:,}; the file was edited or damaged: make it "
                              "again from the model you mean to run")
    return build_named_model(name, sizes[0], sizes[1], seed=0 if seed is None else seed)


def _source_int(src: Mapping[str, Any], key: str, where: str, low: int, high: int) -> int | None:
    """Field `key` of a model source: absent/null, or a whole number in [low, high]; FormatError naming it."""
    value = src.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
        raise FormatError(f"{where}: the model source's {key!r} must be a whole number from {low} to {high}, got "
                          f"{value!r}; the file is damaged or was edited: make it again")
    return value

"""`devplace.plan(...)`: capture, cost, coarsen, place and simulate a module's training step in one call, and the
`devplace.plan/1` file that keeps the result (docs/runtime.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Group
from rich.text import Text
from torch import nn

from devplace.defaults import DEFAULT_ORDER, DEFAULT_PLACER, DEFAULT_SEED
from devplace.errors import FormatError
from devplace.graph.coarsen import Coarsening
from devplace.graph.compgraph import CompGraph
from devplace.graph.jsonio import read_json, write_json
from devplace.graph.placement import Placement
from devplace.hardware.cluster import Cluster, load_cluster
from devplace.hardware.cost import cost_devices
from devplace.placers import schedule_of
from devplace.planning import (
    AsRun,
    Baseline,
    as_run,
    baselines,
    baselines_line,
    place_graph,
    precision_text,
    render_text,
)
from devplace.sim import SimResult, lower_bound, simulate
from devplace.sim.summary import result_view
from devplace.units import fmt_time

__all__ = ["FORMAT", "Plan", "build_source", "load_plan", "plan", "plan_from_prepared", "rebuild_zoo_model",
           "zoo_plan"]

FORMAT = "devplace.plan/1"


@dataclass(eq=False)
class Plan:
    """A placement of a model's full training graph on a cluster, with its simulated result.

    `graph` is the captured, costed graph (every op); `placement` places each of its ops; `result` is the
    `devplace`-model simulation of that placement; `settings` records how it was made (placer, order, seed,
    optimizer, max_nodes, precision, model source). `coarse` (the coarsening the placer saw), `example_inputs`
    and `loss_fn` are kept in memory only.
    """

    graph: CompGraph
    cluster: Cluster
    placement: Placement
    result: SimResult
    settings: dict[str, Any] = field(default_factory=dict)
    coarse: Coarsening | None = None
    example_inputs: Any = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    _runtime: AsRun | None = field(default=None, repr=False)
    _baselines: tuple[Baseline, Baseline] | None = field(default=None, repr=False)

    @property
    def as_run(self) -> AsRun:
        """The placement as `apply` runs it and its simulation (`devplace.planning.as_run`)."""
        if self._runtime is None:
            self._runtime = as_run(self.graph, self.cluster, self.placement, self.result)
        return self._runtime

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
        if self._baselines is None:
            self._baselines = baselines(self.graph, self.cluster, schedule_of(self.placement))
        return self._baselines

    @property
    def num_devices_used(self) -> int:
        """How many logical devices (0..n-1) the placement needs."""
        return max(self.placement.assignment.values(), default=0) + 1

    def summary(self, text: bool = False) -> Any:
        """The table `devplace place` prints (a rich renderable), or with `text=True` the same as plain text."""
        s = self.settings
        rt = self.runtime_result
        moved = self.as_run.moved
        line = Text(f"placer {s.get('placer')}, order {s.get('order')}, seed {s.get('seed')}"
                    + (f"; {self.coarse.num_groups} groups of {self.graph.num_nodes} ops" if self.coarse else "")
                    + precision_text(self.graph)
                    + (f"; as run by devplace.runtime ({moved} backward/optimizer ops follow their forward op): "
                       f"step time {fmt_time(rt.step_time_s)}, {'feasible' if rt.feasible else 'INFEASIBLE'}"
                       if moved else "; devplace.runtime runs this placement as simulated"))
        bound = lower_bound(self.graph, self.cluster, schedule_of(self.placement))
        view = Group(result_view(self.graph, self.cluster, self.result, bound), line,
                     baselines_line(self.cluster, self.baselines, rt.step_time_s))
        return render_text(view) if text else view

    def to_dict(self) -> dict[str, Any]:
        """The `devplace.plan/1` document."""
        return {"format": FORMAT, "settings": dict(self.settings), "cluster": self.cluster.to_dict(),
                "result": self.result.to_dict(), "placement": self.placement.to_dict(), "graph": self.graph.to_dict()}

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
                       source: Mapping[str, Any] | None = None, **placer_settings: Any) -> Plan:
    """Place a `capture.pipeline.Prepared` model on `cluster` and simulate the expanded placement
    (`devplace.planning.place_graph`)."""
    placed = place_graph(prepared.graph, cluster, placer=placer, order=order, seed=seed,
                         coarsening=prepared.coarsening, full=prepared.full, **placer_settings)
    s = {"placer": placed.placer, "order": placed.placement.meta.get("order", order), "seed": seed,
         "placer_settings": dict(placer_settings),
         **(settings or {}), "source": dict(source or {})}
    return Plan(placed.graph, cluster, placed.placement, placed.result, s, prepared.coarsening)


def plan(model: nn.Module, example_inputs: Any, cluster: Cluster | str, *, placer: str = DEFAULT_PLACER,
         order: str = DEFAULT_ORDER, optimizer: str = "adam", max_nodes: int | None = None, seed: int = DEFAULT_SEED,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, dtype: str | None = None, amp: bool = False,
         **placer_settings: Any) -> Plan:
    """Capture `model`'s training step on `example_inputs`, cost it for the cluster's first device, coarsen it
    (to `max_nodes` groups if given), place it with `placer` walking `order`, and simulate the placement.

    `cluster` is a `Cluster`, a preset name or a cluster JSON file. `order` is any order `devplace.place`
    accepts (when `"auto"` lands there, it works here unchanged). `loss_fn`, `optimizer` and the precision
    (`dtype` "fp32"/"bf16"/"fp16", `amp` for autocast) as for `devplace.capture.capture`; the plan records the
    precision, and `devplace.runtime.run.measure_plan` runs the steps in it. Extra keyword arguments are
    placer settings: with `placer="pipeline"`, `schedule="1f1b"`, `microbatches=8` (and `chunks` for
    interleaved-1f1b) make a pipeline, whose `result` is the step under that schedule
    (`devplace.placers.schedule_of(plan.placement)`). `semantics="op-by-op"` overrides the captured graph's
    "autograd" (`devplace.graph.semantics`): a placement that `apply` cannot run as placed.
    """
    from devplace.capture.pipeline import prepare
    from devplace.capture.torch_capture import capture

    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    graph = capture(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, dtype=dtype, amp=amp)
    device, kinds = cost_devices(c)
    prepared = prepare(graph, device=device, kinds=kinds, max_nodes=max_nodes)
    p = plan_from_prepared(prepared, c, placer=placer, order=order, seed=seed,
                           settings={"optimizer": optimizer, "max_nodes": max_nodes, "dtype": dtype, "amp": amp},
                           source={"module": type(model).__name__}, **placer_settings)
    p.example_inputs = example_inputs
    p.loss_fn = loss_fn
    return p


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
    pdoc = doc["placement"]
    assignment = pdoc.get("assignment")
    if not isinstance(assignment, Mapping):
        raise FormatError(f"{path}: placement.\"assignment\" must map op ids to device indices")
    extra = {k: v for k, v in pdoc.items() if k not in ("format", "graph", "cluster", "assignment")}
    placement = Placement(dict(assignment), graph=str(pdoc.get("graph", "")), cluster=str(pdoc.get("cluster", "")),
                          meta=extra)
    result = simulate(graph, cluster, placement, schedule=schedule_of(placement))
    return Plan(graph, cluster, placement, result, dict(doc.get("settings") or {}))


def zoo_plan(name: str, cluster: Cluster | str, *, batch: int | None = None, seq_len: int | None = None,
             placer: str = DEFAULT_PLACER, order: str = DEFAULT_ORDER, optimizer: str = "adam",
             max_nodes: int | None = None, seed: int = DEFAULT_SEED, dtype: str | None = None, amp: bool = False,
             **placer_settings: Any) -> tuple[Plan, nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model `name`, or a custom `package.module:factory` one (`devplace.capture.custom`), for real
    (seeded, on the CPU) and plan it in precision `dtype` / `amp`; returns (plan, module, inputs).

    The plan records the model's name, batch and sequence length, so `rebuild_zoo_model(plan)` makes the same
    module and inputs again (what `devplace run --plan` does)."""
    from devplace.capture.custom import build_named_model, is_custom
    from devplace.zoo.models import get_spec

    module, inputs, loss_fn = build_named_model(name, batch, seq_len, seed=seed)
    p = plan(module, inputs, cluster, placer=placer, order=order, optimizer=optimizer, max_nodes=max_nodes,
             seed=seed, loss_fn=loss_fn, dtype=dtype, amp=amp, **placer_settings)
    if is_custom(name):
        p.settings["source"] = {"custom": name, "batch": batch, "seq_len": seq_len, "build_seed": seed}
    else:
        spec = get_spec(name)
        p.settings["source"] = {"zoo": name, "batch": spec.batch if batch is None else batch,
                                "seq_len": spec.seq_len if seq_len is None else seq_len, "build_seed": seed}
    return p, module, inputs


def rebuild_zoo_model(p: Plan) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo (or custom `package.module:factory`) module and inputs a plan made by `zoo_plan` was made for
    (and `p.loss_fn` set to the factory's loss); an error for other plans."""
    module, inputs, p.loss_fn = _build_named_source(p.settings.get("source"))
    return module, inputs


def build_source(src: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The zoo (or custom) module and inputs of a plan's `source` setting (model name, batch, seq_len,
    build_seed; also what a pipeline export made from the plan keeps); an error when the plan was made from a
    Python module."""
    module, inputs, _ = _build_named_source(src)
    return module, inputs


def _build_named_source(src: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    from devplace.capture.custom import build_named_model
    from devplace.errors import DevplaceError

    name = (src.get("zoo", src.get("custom")) if isinstance(src, Mapping) else None)
    if not isinstance(name, str):
        raise DevplaceError("this plan was made from a Python module, not a zoo model, so the command line cannot "
                            "rebuild it; in Python, use plan.apply(model, devices) and devplace.runtime.run_steps "
                            "(or devplace.runtime.run_pipeline for a pipeline export)")
    return build_named_model(name, src.get("batch"), src.get("seq_len"), seed=int(src.get("build_seed", 0)))

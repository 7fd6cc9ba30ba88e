"""Plan a graph: place -> expand -> simulate -> as-run view -> baselines, stitched once.

This is the pure part of the application layer (DEVELOPERS.md, "Layout"): it sits right above `placers/`
and `sim/`, so `runtime/` (`devplace.plan`), `study/` (the runner) and the task functions of `devplace.app`
(which the CLI calls) all go through it. Its result objects know how to summarise themselves: a rich
renderable (`__rich__`), plain text (`text()`) and a JSON-ready `to_dict()` (what `--json` prints).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from devplace.defaults import (
    AUTO_PIPELINE,
    AUTO_PLACER,
    AUTO_PLACERS,
    DEFAULT_ORDER,
    DEFAULT_PLACER,
    DEFAULT_SEED,
    DEFAULT_SIM_MODEL,
    SIM_DEVPLACE,
    sim_model_name,
)
from devplace.errors import DevplaceError
from devplace.files import json_safe
from devplace.graph.batch import graph_batch, microbatching_note
from devplace.graph.compgraph import CompGraph
from devplace.graph.parallel import STAGES_KEY, ParallelAsk, ParallelPlan, recorded_stages, runtime_gap
from devplace.graph.placement import MadeBy, Placement, runtime_placement, save_placement
from devplace.graph.semantics import Semantics
from devplace.hardware.cluster import Cluster, canonical_order, reordered
from devplace.placers import Tried, search_placement
from devplace.placers.even import even_devices
from devplace.placers.search import ORDER_AUTO, UNPIPELINED, MicrobatchGraph
from devplace.sim import LowerBound, Schedule, ScheduleError, SimResult, lower_bound, simulate
from devplace.sim.parallel import CATEGORIES, ParallelResult
from devplace.sim.schedule import V_SHAPED, simulate_schedule
from devplace.sim.summary import result_view
from devplace.sim.timeline import plot_timeline, write_trace
from devplace.units import fmt_bytes, fmt_time

if TYPE_CHECKING:  # only a type here; importing graph.coarsen costs `devplace --help` its numba set-up
    from devplace.graph.coarsen import Coarsening

__all__ = [
    "MAP_PLACER",
    "AsRun",
    "Baseline",
    "Placed",
    "SeedError",
    "Simulated",
    "as_run",
    "baselines",
    "baselines_line",
    "check_seed",
    "even_split_devices",
    "how_made",
    "json_safe",
    "place_graph",
    "precision_of",
    "precision_text",
    "render_text",
    "simulate_placement",
]

Progress = Callable[[int, int], None]

# `Placed.placer` of a placement made by a hand-made module map (`devplace place --map`), not by a placer
MAP_PLACER = "module map"


MAX_SEED = 2**63 - 1


class SeedError(DevplaceError):
    """A seed that is not an integer from 0 to 2**63-1."""


def check_seed(seed: Any) -> int:
    """`seed` if it is an integer from 0 to 2**63-1 (what every random choice accepts), else a SeedError."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SeedError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}; e.g. --seed 0")
    return seed


def render_text(renderable: RenderableType, width: int = 120) -> str:
    """What `renderable` prints as plain text (no colours) at `width` columns."""
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@dataclass(frozen=True)
class AsRun:
    """A placement as devplace.runtime runs it (backward and optimizer ops with their forward op, as autograd
    does; see `devplace.graph.placement.runtime_placement`) and its simulation; `moved` ops differ."""

    placement: Placement
    result: SimResult
    moved: int


def as_run(graph: CompGraph, cluster: Cluster, placement: Placement, result: SimResult) -> AsRun:
    """The as-run view of `placement` (whose simulation is `result`): simulated again, under the placement's
    schedule if it has one, only when ops move."""
    rp = runtime_placement(graph, placement)
    moved = sum(1 for k, d in rp.assignment.items() if placement.assignment[k] != d)
    return AsRun(rp, simulate(graph, cluster, rp, schedule=placement.schedule) if moved else result, moved)


def _write_timelines(graph: CompGraph, cluster: Cluster, result: SimResult, bound_s: float, trace: Path | None,
                     plot: Path | None, title: str | None = None) -> list[tuple[str, Path]]:
    written = []
    if trace is not None:
        write_trace(graph, cluster, result, trace)
        written.append(("trace", trace))
    if plot is not None:
        plot_timeline(graph, cluster, result, plot, lower_bound_s=bound_s, title=title)
        written.append(("timeline", plot))
    return written


def _wrote(written: list[tuple[str, Path]]) -> list[Text]:
    return [Text(f"wrote {what} to {path}") for what, path in written]


def _outcome(tried: Any) -> str:
    """A search entry's outcome in a report line: its step time, "skipped" (left out before it was placed: a
    bound or a budget ruled it out) or "no fit"."""
    if isinstance(tried, float):
        return fmt_time(tried)
    return "skipped" if str(tried).startswith("skipped") else "no fit"


def _over_bound(step_s: float, bound: LowerBound) -> float | None:
    return step_s / bound.value_s if bound.value_s else None


@dataclass(frozen=True)
class Baseline:
    """A reference placement every report compares with (the best single device, the `even` split), simulated
    with the devplace model. When it does not fit, `device` is its most overfilled device, which needs
    `needs_bytes` and has `has_bytes`; when it fits, `device` is the single device (-1 for a split)."""

    name: str
    step_time_s: float
    fits: bool
    device: int
    needs_bytes: float
    has_bytes: float

    def speedup(self, step_s: float) -> float | None:
        """This baseline's step time over `step_s`; None when it does not fit (no speed-up over a step that
        cannot run) or `step_s` is not positive."""
        return self.step_time_s / step_s if self.fits and step_s > 0 else None

    def describe(self, cluster: Cluster, step_s: float) -> str:
        """One phrase: "even split 230.1 ms, speed-up 1.16x" or "... does not fit (needs X, has Y on gpu1)"."""
        where = f" ({cluster.devices[self.device].name})" if self.device >= 0 and self.fits else ""
        if math.isnan(self.step_time_s):
            return self.name
        if not self.fits:
            return (f"{self.name} does not fit (needs {fmt_bytes(self.needs_bytes)}, has "
                    f"{fmt_bytes(self.has_bytes)} on {cluster.devices[self.device].name})")
        up = self.speedup(step_s)
        return f"{self.name}{where} {fmt_time(self.step_time_s)}" + (f", speed-up {up:.2f}x" if up is not None else "")

    def to_dict(self, cluster: Cluster, step_s: float) -> dict[str, Any]:
        """The JSON form: step time and speed-up, or (when it does not fit) the memory needed and available."""
        doc: dict[str, Any] = {"name": self.name, "fits": self.fits, "step_time_s": self.step_time_s,
                               "speedup": self.speedup(step_s)}
        if self.device >= 0:
            doc["device"] = self.device
            doc["device_name"] = cluster.devices[self.device].name
        if not self.fits and not math.isnan(self.step_time_s):
            doc.update(needs_bytes=self.needs_bytes, has_bytes=self.has_bytes)
        return doc


def _baseline(name: str, result: SimResult, single: int) -> Baseline:
    over = result.peak_memory_bytes - result.memory_bytes
    worst = int(np.argmax(over))
    if result.feasible:
        return Baseline(name, float(result.step_time_s), True, single, 0.0, 0.0)
    return Baseline(name, float(result.step_time_s), False, worst, float(result.peak_memory_bytes[worst]),
                    float(result.memory_bytes[worst]))


def precision_of(graph: CompGraph) -> dict[str, Any] | None:
    """The precision a captured graph's step trains in, from its capture meta: {"dtype": the parameters'
    dtype, "amp": the autocast dtype or None}; None for a graph that was not captured from PyTorch."""
    cap = graph.meta.get("capture") if isinstance(graph.meta, Mapping) else None
    if not isinstance(cap, Mapping) or cap.get("dtype") is None:
        return None
    return {"dtype": cap.get("dtype"), "amp": cap.get("amp")}


def precision_text(graph: CompGraph) -> str:
    """"; precision bfloat16" or "; precision autocast to bfloat16 (float32 parameters)" (empty when unknown),
    for a report's line."""
    prec = precision_of(graph)
    if prec is None:
        return ""
    return (f"; precision autocast to {prec['amp']} ({prec['dtype']} parameters)" if prec["amp"]
            else f"; precision {prec['dtype']}")


def baselines_line(cluster: Cluster, pair: tuple[Baseline, Baseline], step_s: float) -> Text:
    """The report's line "baselines: best single device (...) ...; even split ..." for a step of `step_s`."""
    return Text("baselines: " + "; ".join(b.describe(cluster, step_s) for b in pair))


def even_split_devices(graph: CompGraph, cluster: Cluster) -> np.ndarray:
    """The even split's device per node (`placers.even.even_devices`), its parts on the cluster's devices in
    their canonical order (`canonical_order`: fastest first), so that the split does not depend on the order a
    cluster file lists its devices in."""
    perm = canonical_order(graph, cluster)
    return perm[even_devices(graph, reordered(cluster, perm))]


def baselines(graph: CompGraph, cluster: Cluster, schedule: Schedule | None = None,
              whole: CompGraph | None = None) -> tuple[Baseline, Baseline]:
    """(best single device, even split) on `cluster` of the full step: the baselines every place/plan report
    shows, each a whole training step whatever the device order.

    The step is `graph`, or `whole` where `graph` is one micro-batch of it (captured at batch / M, run M times
    under `schedule`). The best single device runs the whole batch: the fastest device that holds it, else the
    fastest one (ties: lowest index). Where no device holds the whole batch but one holds it as M micro-batches
    in turn (or only one micro-batch's graph is known, as in a plan file), that is the reference, and its name
    says so. The even split (`even_split_devices`) is simulated whether or not it fits -- under `schedule` when
    the placement compared with it runs one (a pipeline is compared with the even split pipelined alike); where
    that split is no pipeline under it, the even split of the whole batch without micro-batches, and its name
    says so."""
    micro = schedule is not None and schedule.microbatch_graph
    step = whole if whole is not None and micro else graph
    name = "best single device"
    single, d = _best_single(step, cluster, None)
    if micro and (not single.feasible or step is graph):
        assert schedule is not None
        accumulated, da = _best_single(graph, cluster, schedule)
        if accumulated.feasible or step is graph:
            why = "" if step is graph else "; the whole batch fits no single device"
            single, d = accumulated, da
            name = f"best single device ({schedule.microbatches} micro-batches in turn{why})"
    even = even_split_devices(graph, cluster)
    if schedule is None:
        return _baseline(name, single, d), _baseline("even split", simulate(graph, cluster, even), -1)
    # the split's stages in its order along the pipeline: its parts on the devices fastest first
    along = replace(schedule, device_order=tuple(int(p) for p in canonical_order(graph, cluster)))
    try:
        split, label = simulate(graph, cluster, even, schedule=along), f"even split ({schedule.label})"
    except ScheduleError:
        label = f"even split (no {schedule.kind} pipeline: without micro-batches)"
        if micro and step is graph:  # one micro-batch's graph alone cannot show the whole step unpipelined
            return _baseline(name, single, d), Baseline(f"{label}: the whole batch's graph is not known here",
                                                        math.nan, False, -1, math.nan, math.nan)
        split = simulate(step, cluster, even_split_devices(step, cluster))
    return _baseline(name, single, d), _baseline(label, split, -1)


def _best_single(graph: CompGraph, cluster: Cluster, schedule: Schedule | None) -> tuple[SimResult, int]:
    """The step of `graph` (under `schedule`: its micro-batches in turn) on its best single device: the fastest
    that holds it, else the fastest (ties: lowest index); (its simulation, the device)."""
    runs = [(simulate(graph, cluster, np.full(graph.num_nodes, d, dtype=np.int64), schedule=schedule), d)
            for d in range(cluster.num_devices)]
    return min(runs, key=lambda rd: (not rd[0].feasible, rd[0].step_time_s, rd[1]))


@dataclass(eq=False)
class Placed:
    """A graph placed on a cluster and simulated, the one result type for it: what `devplace place` reports and
    what `devplace.runtime.Plan` composes.

    `graph` is what was simulated and `placement` places each of its nodes: for a coarsened model
    (`coarsening` given) the full graph, with every op on its group's device. How it was made is
    `placement.made_by`, the search's one record, which `placer`, `order`, `seed`, `settings`, `request`,
    `placed_groups`, `placement_time_s` and `simulations` read (a saved plan keeps it); `log` is what the search
    tried. The lower bound, the best single device and the as-run view are computed when first asked for.
    """

    graph: CompGraph
    cluster: Cluster
    placement: Placement
    result: SimResult
    coarsening: Coarsening | None = None
    written: list[tuple[str, Path]] = field(default_factory=list)
    log: tuple[Tried, ...] = ()  # what the search tried: each candidate's step or why it was dropped, its seconds
    whole: CompGraph | None = None  # the whole batch's step where `graph` is one micro-batch of it
    parallel: ParallelResult | None = None  # a parallel plan (`--dp/--pp/...`): `placement` is its replica 0

    def __post_init__(self) -> None:
        if self.placement.made_by is None:
            raise ValueError("Placed: the placement must record how it was made (placement.made_by)")

    @property
    def made_by(self) -> MadeBy:
        """How it was made: the placement's record (`devplace.graph.placement.MadeBy`)."""
        assert self.placement.made_by is not None  # __post_init__
        return self.placement.made_by

    @property
    def placer(self) -> str:
        """The placer kept (placer "auto" resolved; `MAP_PLACER` for a module map, "parallel" for a parallel plan)."""
        return self.made_by.placer

    @property
    def seed(self) -> int:
        return DEFAULT_SEED if self.made_by.seed is None else self.made_by.seed

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the kept placer took (only ones it takes; placer "auto"'s `schedule` is the request's)."""
        return dict(self.made_by.settings)

    @property
    def request(self) -> dict[str, Any]:
        """What was asked (`placers.search.request_record`; empty for a module map): placing it again
        (`placers.search.replay_request`) gives this placement."""
        return dict(self.made_by.request or {})

    @property
    def placed_groups(self) -> int:
        """The nodes the placer placed: the coarsening's groups (a finer one where the search refined it), else
        the graph's ops."""
        return self.graph.num_nodes if self.made_by.groups is None else self.made_by.groups

    @property
    def placement_time_s(self) -> float:
        """The whole search's wall time, captures of micro-batches included (NaN where not known: a loaded plan)."""
        return math.nan if self.made_by.seconds is None else self.made_by.seconds

    @property
    def simulations(self) -> int | None:
        """The steps simulated to find it (`devplace.sim.count`), the final one included."""
        return self.made_by.simulations

    @property
    def order(self) -> str | None:
        """The traversal order the placer walked (after `auto` was resolved); None when it ignores orders."""
        return self.made_by.order

    @property
    def semantics(self) -> str | None:
        """The placement semantics placed under ("op-by-op" or "autograd", `devplace.graph.semantics`); None
        for a placement not made by `devplace.place` (a module map)."""
        return self.made_by.semantics

    @cached_property
    def bound(self) -> LowerBound:
        """The lower bound of the graph on the cluster (DESIGN.md section 8), of the pipelined step for a
        placement made for a schedule; of a parallel plan, the whole batch's work on every device alone (its
        replicas split the batch, so the whole batch's critical path bounds nothing, and ZeRO shards the
        optimizer ops a micro-batch's path would count whole)."""
        if self.parallel is not None:
            work = lower_bound(self.whole if self.whole is not None else self.graph, self.cluster).work_s
            return LowerBound(work, work, 0.0, ())
        return lower_bound(self.graph, self.cluster, self.placement.schedule)

    @cached_property
    def baselines(self) -> tuple[Baseline, Baseline]:
        """The best single device and the even split of the whole step (`baselines`; the even split under the
        placement's schedule if any; of a parallel plan, both of the whole batch without micro-batches)."""
        if self.parallel is not None:
            return baselines(self.whole if self.whole is not None else self.graph, self.cluster)
        return baselines(self.graph, self.cluster, self.placement.schedule, self.whole)

    @cached_property
    def as_run(self) -> AsRun:
        """The placement as devplace.runtime runs it, and its simulation."""
        return as_run(self.graph, self.cluster, self.placement, self.result)

    def write(self, *, output: Path | None = None, trace: Path | None = None, plot: Path | None = None) -> None:
        """Write the placement JSON, a Chrome trace and a timeline PNG where asked; `written` lists them."""
        if output is not None:
            save_placement(self.placement, output)
            self.written.append(("placement", output))
        # a parallel plan's replica 0 ran its graph with the recomputed forward ops
        ran, title = self.graph, None
        if self.parallel is not None:
            ran, plan = self.parallel.run_graph, self.parallel.plan
            title = f"{ran.name}: replica 0 of {plan.label} (the other replicas alike; gradient sync not drawn)"
        self.written += _write_timelines(ran, self.cluster, self.result, self.bound.value_s, trace, plot, title)

    def to_dict(self) -> dict[str, Any]:
        """The `devplace place --json` document (non-finite numbers as null)."""
        single, even = self.baselines
        step = self.result.step_time_s
        doc = self.result.to_dict()
        doc.update(graph=self.graph.name, cluster=self.cluster.name, placer=self.placer, order=self.order,
                   seed=self.seed, settings=self.settings, request=self.request, semantics=self.semantics,
                   placement_time_s=self.placement_time_s, simulations=self.simulations,
                   lower_bound_s=self.bound.value_s,
                   step_over_lower_bound=_over_bound(self.result.step_time_s, self.bound),
                   best_single_device=single.to_dict(self.cluster, step), even_split=even.to_dict(self.cluster, step),
                   speedup_over_single_device=single.speedup(step), placed_groups=self.placed_groups,
                   precision=precision_of(self.graph), search_log=[t.to_dict() for t in self.log],
                   assignment=self.placement.assignment)
        if self.placement.schedule is not None:  # how its micro-batches were costed (docs/simulation.md)
            doc["microbatch_costs"] = ("captured at the micro-batch size" if self.placement.schedule.microbatch_graph
                                       else "the whole batch's / M")
            doc["microbatching_changes_result"] = microbatching_note(self.graph)
        for key in ("order_auto", "placer_auto", "microbatch_search", STAGES_KEY):  # stages: a parallel plan's cut
            if key in self.placement.meta:
                doc[key] = self.placement.meta[key]
        if self.parallel is not None:
            doc["parallel"] = parallel_doc(self.parallel, self.placement.meta.get("parallel_search"))
        if self.coarsening is not None:
            doc["as_run"] = {"ops_moved": self.as_run.moved, "step_time_s": self.as_run.result.step_time_s,
                             "feasible": self.as_run.result.feasible}
        return json_safe(doc)

    def lines(self) -> list[RenderableType]:
        """The lines under the table: a parallel plan and its memory by category, the order `auto` chose, how it
        was placed, the as-run view, files."""
        out: list[RenderableType] = parallel_lines(self.parallel) if self.parallel is not None else []
        tried, _ = self._auto_search()
        if tried:
            listed = ", ".join(f"{p} {_outcome(t)}" for p, t in tried.items())
            out.append(Text(f"placer {AUTO_PLACER} -> {self.kept} ({listed})"))
            out += [Text(f"  {t.placer} {t.note}") for t in self.log if t.level == "placer" and t.note]
        sched = self.placement.schedule
        counts = [e for e in self._kept_entries() if e.level == "microbatches"]
        if counts and sched is not None:
            tried = ", ".join(f"M={e.microbatches} {_outcome(e.outcome)}" for e in counts)
            # with order auto, the orders were compared at the first count that fitted (`search_microbatches`)
            at = next((e.microbatches for e in counts if e.step_time_s is not None), None) \
                if self.request.get("order") == "auto" else None
            batch = graph_batch(self.whole if self.whole is not None else self.graph)
            out.append(Text(f"micro-batches: batch {batch} split into M={sched.microbatches} ({tried}); each "
                            "micro-batch captured and costed at its own size"
                            + (f"; orders compared at M={at}, the order kept there walked the others" if at else "")))
        changes = microbatching_note(self.graph) if sched is not None else None
        if changes is not None:
            out.append(Text(f"note: {changes}; place without --schedule/--placer pipeline for the unpipelined step"))
        if sched is not None and not sched.microbatch_graph and sched.microbatches > 1:
            out.append(Text(f"micro-batches: {sched.label}, each micro-batch's forward and backward ops costed as "
                            f"the whole batch's / {sched.microbatches} (this graph is the whole step, not one "
                            "micro-batch captured at its own size; small micro-batches cost more than that on a "
                            "GPU: place with --model to capture them)"))
        decided, orders = self._order_search()
        if decided is not None:
            out.append(Text(f"order auto -> {decided.order} ({decided.note})" if decided.order is not None else
                            f"order auto: no order walked ({decided.note})"))
            # an order that placed nothing (no fit, or no pipeline stages) was skipped: say which and why
            out += [Text(f"  order {e.order} skipped: {e.dropped}") for e in orders if e.dropped is not None]
        groups = (f" ({self.placed_groups} groups of {self.graph.num_nodes} ops)"
                  if self.placed_groups != self.graph.num_nodes else "")
        out.append(Text(f"{how_made(self.made_by)}: placed{groups}{self._search_time()}" + precision_text(self.graph)))
        out.append(baselines_line(self.cluster, self.baselines, self.result.step_time_s))
        if self.coarsening is not None and self.as_run.moved:
            rt = self.as_run.result
            out.append(Text(f"as devplace.runtime runs it ({self.as_run.moved} backward/optimizer ops with their "
                            f"forward op, as autograd does): step time {fmt_time(rt.step_time_s)}, "
                            f"{'feasible' if rt.feasible else 'OVER MEMORY'}"))
        return out + _wrote(self.written)

    def _search_time(self) -> str:
        """" in 12.30 s wall time (410 simulations)", or for a search over candidates (placer auto, order auto)
        the whole search's wall time (micro-batch captures included) and each candidate's: the time is never one
        candidate's alone, nor a sum of them."""
        sims = f", {self.simulations:,} simulations" if self.simulations is not None else ""
        known = self.made_by.seconds is not None  # not in a loaded plan: a file does not record wall time
        took = f"took {self.placement_time_s:.2f} s wall time" if known else "took a wall time not recorded"
        _, times = self._auto_search()
        if times:
            each = ", ".join(f"{p} {t:.2f} s" for p, t in times.items())
            return f"; the whole search (placer {AUTO_PLACER}) {took}{sims} ({each})"
        _, orders = self._order_search()
        if orders:
            return (f"; the whole search over {len({e.order for e in orders})} orders {took}{sims} (each order's "
                    "time: --json, order_auto.time_s)")
        if not known:
            return f" (wall time not recorded{sims})"
        return f" in {self.placement_time_s:.2f} s wall time{sims and f' ({sims[2:]})'}"

    def _kept_entries(self) -> list[Tried]:
        """The log's entries of the search that made the answer: all of them, but on a captured model under placer
        auto only those of the candidate kept (`kept`; `Tried.candidate`)."""
        kinds = self.request.get("placer") == AUTO_PLACER and any(e.level == "schedule" for e in self.log)
        kept = None
        if kinds:  # the candidate's name in the log: the unpipelined one's is not its placer's
            kept = self.kept if self.placement.schedule is not None else UNPIPELINED
        return [e for e in self.log if e.candidate == kept]

    def _order_search(self) -> tuple[Tried | None, list[Tried]]:
        """Order auto's decision for the placer kept (level `ORDER_AUTO`; None where order auto did not decide
        it) and the orders it placed (each one's step or why it was dropped), read from the search's log: the
        kept candidate's entries (`_kept_entries`) at the micro-batch count kept, if any."""
        sched = self.placement.schedule
        at = sched.microbatches if sched is not None else None
        mine = [e for e in self._kept_entries() if e.microbatches in (None, at)]
        decided = next((e for e in reversed(mine) if e.level == ORDER_AUTO and e.placer == self.placer), None)
        if decided is None:
            return None, []
        trial = self.request.get("try_with") or self.placer  # the placer that placed the orders
        return decided, [e for e in mine if e.level == "order" and e.placer == trial]

    def _auto_search(self) -> tuple[dict[str, float | str], dict[str, float]]:
        """What placer auto tried, read from the search's log (empty for any other request): each name's step
        or why it was dropped, and the wall seconds of each candidate that ran. On a captured model its candidates
        are the placement without micro-batches, the parallel plans and each pipeline kind (level "schedule"), and
        it lists the placers of `AUTO_PLACERS` the unpipelined one compared first; on a graph file its candidates
        are its placers (level "placer")."""
        if self.request.get("placer") != AUTO_PLACER:
            return {}, {}
        candidates = [e for e in self.log if e.level == "schedule"]
        placers = [e for e in self.log if e.level == "placer" and (not candidates or e.placer in AUTO_PLACERS)]
        tried = {e.placer: e.outcome for e in placers + candidates}
        times = {e.placer: e.seconds for e in candidates or placers if not (e.dropped or "").startswith("skipped")}
        return tried, times

    @property
    def kept(self) -> str:
        """The candidate a search over candidates kept, named as its log names it: the placer (`placer`), but
        "pipeline 1f1b" for a pipeline of placer auto's search on a captured model, whose candidates are the
        pipeline kinds."""
        sched = self.placement.schedule
        kinds = any(e.level == "schedule" for e in self.log)
        return (f"{AUTO_PIPELINE} {sched.kind}" if kinds and self.placer == AUTO_PIPELINE and sched is not None
                else self.placer)

    def __rich__(self) -> Group:
        pipelined = self.parallel is None or self.parallel.plan.pp > 1
        # a parallel plan's table is replica 0's pipeline: its transfers, not the replicas' gradient collectives
        moved = (f" within replica 0 (the step includes the {self.parallel.plan.dp} replicas' gradient sync)"
                 if self.parallel is not None and self.parallel.plan.dp > 1 else "")
        return Group(result_view(self.graph, self.cluster, self.result, self.bound, pipelined=pipelined,
                                 moved=moved),
                     *self.lines())

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def how_made(made: MadeBy) -> str:
    """How a placement was made, for a report's line: "placer m-etf, order bfs, seed 0, autograd", "placer
    even-refine (no order), seed 0" or "module map FILE"."""
    if made.placer == MAP_PLACER:
        return f"module map {made.settings.get('module_map')}"
    return (f"placer {made.placer}" + (f", order {made.order}" if made.order else " (no order)")
            + f", seed {DEFAULT_SEED if made.seed is None else made.seed}"
            + (f", {made.semantics}" if made.semantics else ""))


def parallel_doc(found: ParallelResult, search: Any) -> dict[str, Any]:
    """The "parallel" object of `devplace place --json` for a parallel plan: its dimensions (dp, pp,
    microbatches, schedule, zero, recompute; zero and recompute per stage), the whole plan, each device's memory
    by category, each stage's gradient sync, what devplace's runtime does not run of it, and the search."""
    plan = found.plan
    gap = runtime_gap(plan)
    return {"dp": plan.dp, "pp": plan.pp, "microbatches": plan.microbatches, "schedule": plan.schedule,
            "zero": list(plan.zero), "recompute": list(plan.recompute), "plan": plan.to_dict(),
            "devplace_run_runs_it": gap is None, "devplace_run_does_not_run": gap,
            **{k: v for k, v in found.to_dict().items() if k in ("memory", "sync", "pipeline_step_time_s")},
            "search": search}


def parallel_lines(found: ParallelResult) -> list[RenderableType]:
    """The report's lines for a parallel plan: the plan, what devplace's runtime does not run of it, and each
    device's memory by category at its peak (why the plan fits)."""
    plan, gap = found.plan, runtime_gap(found.plan)
    out = [Text(f"parallel plan: {plan.label} ({plan.microbatch_size} samples per micro-batch); step "
                f"{fmt_time(found.step_time_s)} with gradient sync, one replica's pipeline "
                f"{fmt_time(max(p.step_time_s for p in found.pipelines))}; the table's ops and transfers are "
                "replica 0's"),
           Text("devplace run runs this plan" if gap is None else
                f"devplace run does not run this plan yet ({gap}): it refuses it; `devplace export --format "
                "parallel` writes its torch configuration")]
    table = Table(show_edge=False, header_style="bold", title="memory per device at its peak: parameters, "
                  "gradients, optimizer state, activations stashed for the backward, temporaries")
    for col in ("device", "stage", "params", "grads", "optimizer", "stash", "temps", "total", "capacity"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for m in found.memory:
        table.add_row(str(m.device), str(m.stage), *(fmt_bytes(getattr(m, c)) for c in CATEGORIES),
                      fmt_bytes(m.total), fmt_bytes(m.capacity))
    return [*out, table]


def place_graph(graph: CompGraph, cluster: Cluster, *, placer: str = DEFAULT_PLACER, order: str = DEFAULT_ORDER,
                seed: int = DEFAULT_SEED, coarsening: Coarsening | None = None, full: CompGraph | None = None,
                progress: Progress | None = None, try_orders: int | None = None, try_with: str | None = None,
                simulation_model: str = DEFAULT_SIM_MODEL, semantics: Semantics | str | None = None,
                microbatch_graph: MicrobatchGraph | None = None, parallel: ParallelAsk | None = None,
                **settings: Any) -> Placed:
    """Place `graph` on `cluster` with `placer` walking `order`, and simulate the result: the one search
    (`devplace.placers.search`) behind every entry point (`devplace place`, `devplace.plan`, a study cell,
    `devplace run --model`).

    With `coarsening` (whose coarse graph is `graph`) and `full` (the graph it coarsens), the placement is
    expanded to every op of `full`, which is what is simulated and reported. `microbatch_graph` (a captured
    model's: `devplace.capture.custom.microbatch_graphs`) gives a micro-batch count's graph captured at batch / M,
    so placer auto and `pipeline` place pipelines on it (the reported graph is then that micro-batch's).
    `simulation_model` is the model `result` is simulated under (the placement fits under the devplace model
    whatever it is). `progress`, `try_orders`, `try_with`, `semantics` (None: the graph's own,
    `devplace.graph.semantics`), `parallel` (parallel plans asked for, `ParallelAsk`) and the placer `settings`
    go to the search unchanged. The search's wall time and
    simulation count are the report's.
    """
    if (coarsening is None) != (full is None):
        raise ValueError("place_graph: give coarsening and full together")
    check_seed(seed)
    # with a coarsening: placed on the coarse graph, judged (and placed again with lowered caps if need be) on the
    # full graph, which is what is reported
    found = search_placement(full if full is not None else graph, cluster, coarsening=coarsening, placer=placer,
                             order=order, seed=seed, progress=progress, try_orders=try_orders, try_with=try_with,
                             semantics=semantics, microbatch_graph=microbatch_graph, parallel=parallel, **settings)
    placement = found.placement
    # the search simulated it as run under the devplace model (a pipeline: under the schedule it was made for);
    # another model simulates it again
    result = (found.result if placement.schedule is not None or sim_model_name(simulation_model) == SIM_DEVPLACE
              else simulate(found.graph, cluster, placement, model=simulation_model))
    asked = full if full is not None else graph  # the whole batch's step, where the answer is one micro-batch's
    # how it was made is the search's record (`placement.made_by`), read by the Placed, not copied into it
    return Placed(found.graph, cluster, placement, result, found.coarsening, log=found.log,
                  whole=asked if found.graph is not asked else None, parallel=found.parallel)


@dataclass(eq=False)
class Simulated:
    """A given placement simulated under one model: what `devplace simulate` reports."""

    graph: CompGraph
    cluster: Cluster
    placement: Placement
    result: SimResult
    bound: LowerBound
    written: list[tuple[str, Path]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def write(self, *, trace: Path | None = None, plot: Path | None = None) -> None:
        """Write a Chrome trace and a timeline PNG where asked; `written` lists them."""
        self.written += _write_timelines(self.graph, self.cluster, self.result, self.bound.value_s, trace, plot)

    def to_dict(self, per_op: bool = False) -> dict[str, Any]:
        """The `devplace simulate --json` document; `per_op` adds each op's device, start and finish."""
        doc = self.result.to_dict(self.graph.ids, per_op=per_op)
        doc.update(graph=self.graph.name, cluster=self.cluster.name, lower_bound_s=self.bound.value_s,
                   step_over_lower_bound=_over_bound(self.result.step_time_s, self.bound))
        return json_safe(doc)

    def __rich__(self) -> Group:
        return Group(result_view(self.graph, self.cluster, self.result, self.bound), *_wrote(self.written))

    def text(self, width: int = 120) -> str:
        """The report as plain text."""
        return render_text(self, width)


def simulate_placement(graph: CompGraph, cluster: Cluster, placement: Placement, *,
                       model: str = DEFAULT_SIM_MODEL) -> Simulated:
    """Simulate `placement` of `graph` on `cluster` under simulation `model`, with the lower bound; a placement
    made for a micro-batch schedule (`placement.schedule`, the `pipeline` placer's) is simulated under it, which
    only the devplace model can; under a V (replica 0 of a parallel plan), with the stages it records."""
    schedule = placement.schedule
    if schedule is not None and sim_model_name(model) != SIM_DEVPLACE:
        raise DevplaceError(f"this placement was made for a {schedule.kind} pipeline schedule, which only the "
                            f"{SIM_DEVPLACE} model simulates; use --model {SIM_DEVPLACE}")
    if schedule is not None and schedule.kind in V_SHAPED and "parallel" in placement.meta:
        # the placement's devices cannot tell a V's two stages per device apart: its recorded stages do
        plan = ParallelPlan.from_dict(placement.meta["parallel"])
        stage = recorded_stages(plan, graph.ids, placement.assignment, placement.meta.get(STAGES_KEY))
        result: SimResult = simulate_schedule(graph, cluster, placement.to_array(graph, cluster.num_devices), schedule,
                                              np.asarray(stage, dtype=np.int64) // plan.pp)
    else:
        result = simulate(graph, cluster, placement, model=model, schedule=schedule)
    return Simulated(graph, cluster, placement, result, lower_bound(graph, cluster, schedule))

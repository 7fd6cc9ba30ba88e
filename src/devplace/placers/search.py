"""The one placement search: `place` and `place_expanded` are thin wrappers over `search`.

It reads top to bottom:

1. A `Request` (the graph as run, the cluster, placer, order, seed, semantics, settings, `try_orders` /
   `try_with`, and the coarsening the placer sees, if any) becomes a `SearchPlan` once (`plan_search`). Every
   "auto" is resolved there and nowhere else: placer "auto" into `AUTO_PLACERS` (each one it leaves out with
   the reason, `AUTO_PIPELINE` as a candidate or as the last resort when nothing else fits), order "auto" into
   the orders of `auto_orders` (or the model's one order), `try_with` into the placer that tries the orders
   before the asked one runs once under the best of them.
2. Each candidate -- a placer at its settings walking one order -- is placed by `place_candidate` on a `View` of
   the graph (the graph itself or its coarse groups, either with its tie classes folded into one node each;
   every view `expand`s a device per node it has to the graph that runs) under one memory-fit loop (`fit`),
   and judged on the graph as run. A refining placer's start (`PlacerSpec.refines`) is judged beside it
   (`refined`): the refiner searched a view of the step, and the step as run can rank the two the other way.
3. The fastest is kept (ties: the earlier candidate); every decision is logged (`Tried`: the step, or why
   the candidate was dropped, and its seconds) and the answer is a `SearchResult`: the placement, its
   simulation, the log and what the search cost. The placement's meta records it for the file format
   (meta["placer_auto"], ["order_auto"], ["refined_from"], ...).

Captured models. A request may carry a provider of micro-batch graphs (`MicrobatchGraph`: M -> the step captured
at batch / M, made in `capture/` since placers do not import torch). Placer "auto" and `pipeline` then search one
level up (`search_captured`): the placement without micro-batches and each pipeline kind, each micro-batch count
placed on its own capture (skipped before capturing where its lower bound rules it out), every candidate
logged. Without a provider (a graph file) a pipeline costs a micro-batch as the whole batch's / M, and the
schedule says so (`microbatch_graph`). `devplace place --model`, `devplace.plan`, a study cell and `devplace run
--model` all come here through `planning.place_graph`.

Coarse views. Placers see the coarse graph (a few hundred groups); the step that runs is the full graph.
Memory peaks of the two differ (a coarse group's working set is an estimate), so a coarse placement that fits
can be over memory on the full graph: `fit` then places again with the device caps the placer sees lowered.
Coarsening can also merge tie classes: a group holding ops of several classes (one layer's forward op and
another's backward op) ties them all together, so a coarse graph of 250 groups may have only a handful of
classes (gpt2-xl: 3, the largest over 16 GB) and no placer can fit it. Under the autograd rule, when every view
of the given coarsening fails, the full graph is coarsened again with `REFINE_FACTOR` times as many groups (at
most `REFINE_STEPS` times): finer groups mix fewer classes. Orders are compared on the full graph: the coarse
graph's step can rank them differently (mobilenet_v3_large at 200 groups, 1F1B M=8 on 4xV100-16GB: the coarse
graph's best order ran 9.9 ms on the full graph, topo's 9.3 ms). Where no order fits on its own, the order is
chosen on the placer's view at every lowered cap (an order that fits at one cap can be another than at the
next: mobilenet_v3_large at batch 384 on 4xV100-16GB with m-etf).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from devplace.defaults import (
    AUTO_PIPELINE,
    AUTO_PLACER,
    AUTO_PLACERS,
    AUTO_QUADRATIC_NODES,
    AUTO_QUADRATIC_SIMULATIONS,
    AUTO_QUADRATIC_WORK,
    AUTO_SCHEDULES,
    AUTO_SIMULATED_EDGES,
    AUTO_SIMULATED_NODES,
    AUTO_SIMULATED_NODES_FLOOR,
    CANONICAL_ORDER,
    DEFAULT_ORDER,
    DEFAULT_PLACER,
    DEFAULT_SEED,
    PARALLEL_PLACER,
)
from devplace.errors import DevplaceError, GraphError
from devplace.graph.batch import graph_batch, graph_microbatches, microbatching_note
from devplace.graph.coarsen import Coarsening, coarsen
from devplace.graph.compgraph import CompGraph
from devplace.graph.parallel import RECOMPUTE, RUN_SCHEDULES, STAGES_KEY, ZERO_STAGES, ParallelAsk, stages_record
from devplace.graph.placement import MadeBy, Placement
from devplace.graph.schedule import V_SHAPED
from devplace.graph.semantics import Semantics, semantics_of
from devplace.graph.ties import fold, tie_classes, untied, violations
from devplace.hardware.cluster import Cluster, canonical_order, reordered
from devplace.orders import Order, check_order, order_label, traversal_indices
from devplace.orders.auto import candidate_orders, recommend_order
from devplace.placers.memory import NoFitError, memory_needs, no_fit_error, unrunnable_error
from devplace.placers.parallel import SCHEDULES, ParallelSearch, as_microbatch, search_parallel
from devplace.placers.pipeline import pipeline_schedules
from devplace.placers.registry import (
    FullGraph,
    PlacerError,
    PlacerOutput,
    PlacerSpec,
    Progress,
    as_output,
    get_placer,
)
from devplace.sim.bounds import lower_bound, memory_lower_bound, microbatch_bounds, microbatch_outlook
from devplace.sim.count import counting
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.parallel import ParallelResult, simulate_parallel, stage_layout
from devplace.sim.result import SimResult
from devplace.sim.schedule import KINDS as SCHEDULE_KINDS
from devplace.sim.schedule import Schedule, ScheduledResult, ScheduleError, simulate_schedule
from devplace.units import fmt_bytes

CAP_RETRIES = 4  # placer reruns with lowered device caps when the graph as run is over memory
# a coarsening that fits nowhere under the autograd rule: coarsen again with this many times the groups, at most
# REFINE_STEPS times
REFINE_FACTOR = 4
REFINE_STEPS = 2
# why placer "auto" skips its unpipelined placers when the memory lower bound rules out every placement
UNPIPELINED_NO_FIT = "skipped: no placement without micro-batches fits"


# ----------------------------------------------------------------------------------------- the request


@dataclass(frozen=True, eq=False)
class Request:
    """What to place: `graph` (the graph as run: every op) on `cluster` with `placer` (a name or "auto") walking
    `order` (a name, "auto", a node sequence or a callable), `seed`, `semantics` (resolved), the placer's
    `settings`, `try_orders` / `try_with` (order "auto"), `coarsening` (the coarse graph the placer sees
    instead of `graph`; None: `graph` itself) and `progress`."""

    graph: CompGraph
    cluster: Cluster
    placer: str
    order: Order
    seed: int
    semantics: Semantics
    settings: Mapping[str, Any]
    try_orders: int | None = None
    try_with: str | None = None
    coarsening: Coarsening | None = None
    progress: Progress | None = None
    microbatch_graph: MicrobatchGraph | None = None
    parallel: ParallelAsk | None = None  # parallel plans asked for (`search_parallel_plans`); None: not searched

    @property
    def seen(self) -> CompGraph:
        """The graph the placers place: the coarse graph with a coarsening, else `graph` itself."""
        return self.coarsening.graph if self.coarsening is not None else self.graph


# M -> (the full graph of one of M micro-batches, captured at batch / M and marked so, its coarsening or None)
MicrobatchGraph = Callable[[int], tuple[CompGraph, Coarsening | None]]


@dataclass(frozen=True)
class SearchProgress:
    """A `Progress` for a search over candidates (placer "auto", `order="auto"`, nested): `show(fraction of the
    whole search done, label)`, the label naming the candidate running at every level ("placer greedy (2/3) ·
    order bfs (4/10)"). Candidate i of n gets the i-th n-th of its parent's share, so the fraction only grows
    from one candidate to the next and the bar does not restart with each one. A plain callback given instead
    sees each candidate's own (done, total), restarting."""

    show: Callable[[float, str], None]
    lo: float = 0.0
    hi: float = 1.0
    label: str = ""

    def __call__(self, done: int, total: int) -> None:
        share = min(max(done / total, 0.0), 1.0) if total else 0.0
        self.show(self.lo + (self.hi - self.lo) * share, self.label)

    def candidate(self, index: int, count: int, what: str) -> SearchProgress:
        """The progress of candidate `index` (from 0) of `count`, described by `what` ("placer m-etf"), shown
        at once."""
        width = (self.hi - self.lo) / count
        here = f"{what} ({index + 1}/{count})"
        sub = SearchProgress(self.show, self.lo + index * width, self.lo + (index + 1) * width,
                             f"{self.label} · {here}" if self.label else here)
        sub(0, 1)
        return sub


def candidate_progress(progress: Progress | None, index: int, count: int, what: str) -> Progress | None:
    """`progress` for candidate `index` of `count` of a search (`SearchProgress.candidate`; another callback as
    given)."""
    return progress.candidate(index, count, what) if isinstance(progress, SearchProgress) else progress


# ----------------------------------------------------------------------------------- "auto", resolved here


def check_auto_placer(settings: Mapping[str, Any]) -> str | None:
    """Placer "auto" takes one setting, `schedule`: "none" (no micro-batches), a schedule kind (pipelines only),
    or absent (both compared); each placer it tries runs at its defaults. Returns the schedule asked for."""
    others = [k for k in settings if k != "schedule"]
    if others:
        raise PlacerError(f"placer {AUTO_PLACER!r} tries {', '.join(AUTO_PLACERS)} and {AUTO_PIPELINE} at their "
                          f"default settings; to give settings ({', '.join(map(repr, others))}), name the placer "
                          "(--placer NAME)")
    schedule = settings.get("schedule")
    kinds = (*AUTO_SCHEDULES, *SCHEDULE_KINDS, *V_SHAPED)  # a V: parallel plans only (`search`)
    if schedule is not None and schedule not in kinds:
        raise PlacerError(f"placer {AUTO_PLACER!r}: schedule must be one of {', '.join(kinds)}, got {schedule!r}")
    return schedule


def request_settings(placer: str) -> dict[str, Any]:
    """The settings a request for `placer` takes, with their defaults: the placer's own, or placer "auto"'s one,
    `schedule` (`check_auto_placer`; None: placements with and without micro-batches compared)."""
    return {"schedule": None} if placer == AUTO_PLACER else dict(get_placer(placer).settings)


def request_walks_order(placer: str) -> bool:
    """Whether a request for `placer` walks a traversal order (placer "auto" does: its placers walk it)."""
    return placer == AUTO_PLACER or get_placer(placer).uses_order


def check_request_settings(placer: str, settings: Mapping[str, Any]) -> None:
    """A PlacerError for settings a request for `placer` refuses: the placer's own checks of the values, or
    placer "auto"'s (`check_auto_placer`)."""
    if placer == AUTO_PLACER:
        check_auto_placer(settings)
    else:
        get_placer(placer).check_settings(settings)


def auto_candidates(graph: CompGraph, schedule: str | None, *, devices: int) -> tuple[str, ...]:
    """The placers placer "auto" compares under `schedule` (`check_auto_placer`): `AUTO_PLACERS` unless a
    schedule kind is asked for, and `AUTO_PIPELINE` unless "none" is, when the graph records a batch of at least
    2 samples (a graph of unknown batch is pipelined only when nothing else fits, `plan_search`). On a graph of
    more than `AUTO_QUADRATIC_NODES` nodes (or of more nodes x (nodes + edges) than `AUTO_QUADRATIC_WORK`, or of
    more nodes x `devices` than `AUTO_QUADRATIC_SIMULATIONS`) the placers whose time grows with its square are left
    out (`auto_skipped`)."""
    if schedule in SCHEDULE_KINDS:
        return (AUTO_PIPELINE,)
    batch = graph_batch(graph)
    split = schedule is None and graph_microbatches(graph) is None and batch is not None and batch >= 2
    kept = tuple(p for p in AUTO_PLACERS if p not in auto_skipped(graph, devices=devices))
    return (*kept, AUTO_PIPELINE) if split else kept


def auto_skipped(graph: CompGraph, *, devices: int) -> dict[str, str]:
    """The placers of `AUTO_PLACERS` that placer "auto" leaves out on `graph` placed on `devices` devices, each
    with the reason."""
    work = graph.num_nodes * (graph.num_nodes + graph.num_edges)
    if graph.num_nodes > AUTO_QUADRATIC_NODES:
        why = f"{graph.num_nodes:,} nodes (more than {AUTO_QUADRATIC_NODES:,})"
    elif work > AUTO_QUADRATIC_WORK:
        why = (f"{graph.num_nodes:,} nodes and {graph.num_edges:,} edges (nodes x (nodes + edges) = {work:.1e}, more "
               f"than {AUTO_QUADRATIC_WORK:.1e})")
    elif graph.num_nodes * devices > AUTO_QUADRATIC_SIMULATIONS:
        why = (f"{graph.num_nodes:,} nodes on {devices:,} devices (nodes x devices = {graph.num_nodes * devices:,}, "
               f"more than {AUTO_QUADRATIC_SIMULATIONS:,})")
    else:
        return {}
    return {p: (f"skipped: its time grows with the square of the graph, and {graph.name!r} has {why}; name it with "
                "--placer to run it") for p in AUTO_PLACERS if get_placer(p).quadratic}


@dataclass(frozen=True)
class AutoOrders:
    """What `order="auto"` does for a placer on a graph (`auto_orders`): `candidates`, the orders to place under
    and keep the best of (empty: the model's `model_order` alone, one run); `mode` and `reason` say which and
    why; `base` is the recommendation model's part of meta["order_auto"]."""

    candidates: list[str]
    model_order: str
    mode: str
    reason: str
    base: dict[str, Any]


def auto_orders(graph: CompGraph, cluster: Cluster, spec: PlacerSpec, try_orders: int | None,
                settings: Mapping[str, Any]) -> AutoOrders:
    """The orders `order="auto"` tries (see `place`):

    - `try_orders=K`: the model's K highest-ranked orders;
    - else, a placer registered `cheap` that walks an order: every candidate order (`candidate_orders`);
    - else (an expensive placer, or one that ignores the order): none, the model's rule alone."""
    if try_orders is not None and (isinstance(try_orders, bool) or not isinstance(try_orders, int)
                                   or try_orders < 1):
        raise PlacerError(f"try_orders (--try) must be an integer >= 1, got {try_orders!r}")
    rec = recommend_order(graph, cluster, placer=spec.name, uses_order=spec.uses_order)
    base = {"rule": rec.rule, "model_order": rec.order, "expected_gain": rec.expected_gain, "source": rec.source}
    if not spec.uses_order or (try_orders is None and not spec.cheap):
        why = (rec.rule if not spec.uses_order else
               f"placer {spec.name!r} is not registered cheap, so the orders are not tried (try_orders=K, --try K, "
               f"tries K): the model's rule decides")
        return AutoOrders([], rec.order, "model", why, base)
    if try_orders is None:
        candidates = candidate_orders(rec)
        same = ""
        if spec.order_key is not None:  # orders the placer cannot tell apart are placed once
            kept: dict[Any, list[str]] = {}
            for name in candidates:
                key = spec.order_key(graph, traversal_indices(graph, name, DEFAULT_SEED, cluster=cluster), settings)
                kept.setdefault(key, []).append(name)
            candidates = [names[0] for names in kept.values()]
            merged = [f"{names[0]} for {', '.join(names[1:])}" for names in kept.values() if len(names) > 1]
            same = f"; orders it cannot tell apart placed once ({'; '.join(merged)})" if merged else ""
        return AutoOrders(candidates, rec.order, f"try all {len(candidates)}",
                          f"placer {spec.name!r} is registered cheap: placed under every candidate order (the "
                          f"model's ranking first){same}, kept the smallest simulated step time", base)
    candidates = list(rec.ranking[:try_orders])
    return AutoOrders(candidates, rec.order, f"try {len(candidates)}",
                      f"smallest simulated step time of the model's {len(candidates)} most promising orders", base)


def auto_settings(placer: str, schedule: str | None, seen: CompGraph) -> tuple[dict[str, Any], str | None]:
    """The settings placer "auto" gives `placer`, which places `seen`, and what they change, if anything: the
    schedule kind asked for to `AUTO_PIPELINE`; to a placer that refines by simulating (setting `max_evals`), its
    share of `AUTO_SIMULATED_NODES` where that is below its default (the search's time grows with the graph, not
    with its square)."""
    if placer == AUTO_PIPELINE:
        return ({"schedule": schedule} if schedule in SCHEDULE_KINDS else {}), None
    default = get_placer(placer).settings.get("max_evals")
    if not isinstance(default, int) or (seen.num_nodes * default <= AUTO_SIMULATED_NODES
                                        and seen.num_edges * default <= AUTO_SIMULATED_EDGES):
        return {}, None
    evals = max(AUTO_SIMULATED_NODES_FLOOR, min(AUTO_SIMULATED_NODES // seen.num_nodes,
                                                AUTO_SIMULATED_EDGES // max(seen.num_edges, 1)))
    return {"max_evals": evals}, (f"limited to {evals:,} simulations (max_evals; default {default:,}): placer auto "
                                  f"simulates at most {AUTO_SIMULATED_NODES:,} nodes and {AUTO_SIMULATED_EDGES:,} "
                                  f"edges per refining placer, and the graph it places has {seen.num_nodes:,} "
                                  f"nodes and {seen.num_edges:,} edges; name it with --placer to run it in full")


# ------------------------------------------------------------------------------------ the candidates


@dataclass(frozen=True)
class PlacerCandidates:
    """The candidates of one placer: `placer` at `settings` walking each of `orders` (one, unless order "auto"
    tries several: `auto` says how it chose them). `trial`: the placer that places the orders (`try_with`),
    `placer` then running once under the best of them. `on_view`: when no order fits alone as run, choose among
    them on the placer's view at every lowered cap. `skipped`: why placer "auto" leaves this one out; `note`:
    what placer "auto" changed about it (`auto_settings`). `last_resort`: placed only when no other placer of
    placer "auto" fits. `start`: a refining placer's start (`PlacerSpec.refines`), its own candidates under the
    same order, judged beside it (`refined`)."""

    placer: str
    settings: dict[str, Any]
    orders: tuple[Order, ...] = ()
    auto: AutoOrders | None = None
    trial: str | None = None
    on_view: bool = False
    skipped: str | None = None
    note: str | None = None
    last_resort: bool = False
    start: PlacerCandidates | None = None


@dataclass(frozen=True)
class SearchPlan:
    """Every candidate of a request, made once (`plan_search`): one `PlacerCandidates` per placer; `auto`: the
    placer was "auto" (the placers are compared and meta["placer_auto"] says how)."""

    placers: tuple[PlacerCandidates, ...]
    auto: bool


def plan_search(req: Request) -> SearchPlan:
    """The candidates of `req` (module docstring, step 1); PlacerError for a bad placer, order or setting."""
    order = check_order(req.order, allow_auto=True)
    if req.try_orders is not None and order != "auto":
        raise PlacerError(f"try_orders (--try) needs order='auto' (--order auto), got order {order_label(order)!r}")
    if req.try_with is not None and req.try_orders is None:
        raise PlacerError("try_with (--try-with) names the placer that tries the orders of try_orders (--try K); "
                          "give both")
    if req.placer != AUTO_PLACER:
        return SearchPlan((_placer_candidates(req, req.placer, dict(req.settings), order),), auto=False)
    schedule = check_auto_placer(req.settings)
    devices = req.cluster.num_devices
    names = auto_candidates(req.graph, schedule, devices=devices)
    skipped = auto_skipped(req.graph, devices=devices) if schedule not in SCHEDULE_KINDS else {}
    # the unpipelined placers when no placement of the step fits memory by its lower bound, before they run
    classes = tie_classes(req.graph) if req.semantics is Semantics.AUTOGRAD else None
    why = memory_lower_bound(req.graph, req.cluster, classes).why_not(req.graph, req.cluster) \
        if any(p in AUTO_PLACERS and p not in skipped for p in names) else None
    if why is not None:
        skipped.update((p, f"{UNPIPELINED_NO_FIT}, {why}")
                       for p in names if p in AUTO_PLACERS and p not in skipped)
    plans = [PlacerCandidates(p, {}, skipped=reason) for p, reason in skipped.items()]
    for p in (p for p in names if p not in skipped):
        settings, note = auto_settings(p, schedule, req.seen)
        plans.append(replace(_placer_candidates(req, p, settings, order), note=note))
    if (AUTO_PIPELINE not in names and schedule is None
            and memory_needs(req.graph).params_bytes < float(req.cluster.memory.sum())):
        plans.append(replace(_placer_candidates(req, AUTO_PIPELINE, {}, order), last_resort=True))
    return SearchPlan(tuple(plans), auto=True)


def _placer_candidates(req: Request, placer: str, settings: dict[str, Any], order: Order) -> PlacerCandidates:
    """The candidates of `placer`, with its start's beside it when it refines one."""
    mine = _orders_of(req, placer, settings, order)
    start = get_placer(placer).start_placer(settings)
    return mine if start is None else replace(mine, start=_orders_of(req, start, {}, order))


def _orders_of(req: Request, placer: str, settings: dict[str, Any], order: Order) -> PlacerCandidates:
    spec = get_placer(placer)
    accepted = spec.settings
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
        raise PlacerError(f"placer {placer!r} has no setting {', '.join(map(repr, unknown))}; its settings: {listed}")
    if order != "auto":
        return PlacerCandidates(placer, settings, (order,))
    auto = auto_orders(req.seen, req.cluster, spec, req.try_orders, settings)
    if not auto.candidates:
        return PlacerCandidates(placer, settings, (auto.model_order,), auto)
    trial = get_placer(req.try_with).name if req.try_with is not None else None
    return PlacerCandidates(placer, settings, tuple(auto.candidates), auto, trial,
                            on_view=req.coarsening is not None and trial is None)


# ------------------------------------------------------------------------------------------- the views


@dataclass(frozen=True, eq=False)
class View:
    """The graph a placer sees: `graph`, whose node v stands for nodes of `parent`'s graph (`up(devices)`: a
    device per node here -> one per node there), up to the graph that runs (no parent). `ties` is its tie
    class per node (what a placer that takes `ties` keeps on one device); `classes` the number of tie classes
    of the graph it folds or is (None: untied); `coarsening` the coarse groups it stands on, if any."""

    graph: CompGraph
    ties: np.ndarray
    classes: int | None = None
    folded: bool = False
    coarsening: Coarsening | None = None
    parent: View | None = None
    up: Callable[[np.ndarray], np.ndarray] | None = None

    @staticmethod
    def of(graph: CompGraph) -> View:
        """The graph itself."""
        return View(graph, untied(graph))

    @staticmethod
    def coarse(coarsening: Coarsening, full: CompGraph) -> View:
        """`coarsening`'s groups standing for the ops of `full`; GraphError where they do not cover it."""
        where = {op: coarsening.graph.index[gid] for gid, ops in coarsening.members.items() for op in ops}
        missing = [op for op in full.ids if op not in where]
        if missing or len(where) != full.num_nodes:
            extra = next((op for op in where if op not in full.index), None)
            raise GraphError(f"the coarsening of {coarsening.original!r} does not group the ops of graph "
                             f"{full.name!r} (e.g. {missing[0] if missing else extra!r}); pass the full graph it was "
                             "made from")
        index = np.array([where[op] for op in full.ids], dtype=np.int64)
        return View(coarsening.graph, untied(coarsening.graph), coarsening=coarsening, parent=View.of(full),
                    up=lambda devices: np.asarray(devices, dtype=np.int64)[index])

    def tied(self, classes: np.ndarray) -> View:
        """This view keeping the tie classes `classes` of its nodes together (placed natively)."""
        return replace(self, ties=classes, classes=int(classes.max()) + 1)

    def fold(self, classes: np.ndarray) -> View:
        """A view with one node per class of `classes` (`devplace.graph.ties.fold`) standing for this one."""
        folding = fold(self.graph, classes)
        return View(folding.graph, untied(folding.graph), int(classes.max()) + 1, True, self.coarsening, self,
                    folding.expand)

    def expand(self, devices: np.ndarray) -> np.ndarray:
        """A device per node of the graph that runs, from a device per node of this view."""
        view, out = self, np.asarray(devices, dtype=np.int64)
        while view.parent is not None and view.up is not None:
            out, view = view.up(out), view.parent
        return out

    def unfolded(self, devices: np.ndarray) -> tuple[CompGraph, np.ndarray]:
        """The graph before tie classes were folded (the coarse graph, or the graph itself) and its devices."""
        if self.folded and self.parent is not None and self.up is not None:
            return self.parent.graph, self.up(devices)
        return self.graph, np.asarray(devices, dtype=np.int64)

    def judged_on(self) -> FullGraph:
        """What a placer that takes `full` judges its answer on: the graph before tie classes were folded (not
        the full graph under a coarsening: simulating it in every episode would cost the learned placers its
        size over the coarse graph's)."""
        if self.folded and self.parent is not None and self.up is not None:
            return FullGraph(self.parent.graph, self.up)
        return FullGraph.same(self.graph)


def views(req: Request, spec: PlacerSpec) -> Iterator[View]:
    """The views `spec` is placed on for `req`, in turn while the previous one finds nothing that fits: the
    graph (or its coarse groups); under the autograd rule with tie classes, natively where the placer keeps
    classes together itself (it sees the real dependencies), then with the classes folded; then, for a
    coarsening whose groups tie too much, the same on finer coarsenings (module docstring)."""
    coarsening, finer = req.coarsening, 0
    while True:
        base = View.of(req.graph) if coarsening is None else View.coarse(coarsening, req.graph)
        classes = tie_classes(base.graph) if req.semantics is Semantics.AUTOGRAD else untied(base.graph)
        if not classes.size or int(classes.max()) + 1 == classes.size:
            yield base
        else:
            if spec.handles_ties:
                yield base.tied(classes)
            yield base.fold(classes)
        if (coarsening is None or finer == REFINE_STEPS or req.semantics is not Semantics.AUTOGRAD
                or coarsening.num_groups >= req.graph.num_nodes):
            return
        finer += 1
        coarsening = coarsen(req.graph, coarsening.num_groups * REFINE_FACTOR)


# ------------------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class Tried:
    """One entry of a search's log: at `level` "placer" (a placer of placer "auto", or the one placer asked
    for), "order" (an order of order "auto", placed by `placer`) or "start" (a refining placer's start, `placer`,
    judged beside it) -- and, in the searches over captures of a model (`devplace.app`), "schedule" (`placer`
    names the candidate: "unpipelined", "pipeline 1f1b") and "microbatches" (the pipeline on the capture at
    batch / `microbatches`), and "parallel" (`placer` names the parallel plan kept, `search_parallel_plans`): the
    step on the graph as run, or why it was `dropped` (its NoFitError, or why it
    was skipped), and the `seconds` it took; `note`: what the search changed about the candidate (placer "auto"
    limits a refining placer's simulations on a large graph). Level `ORDER_AUTO` is order "auto"'s decision for
    `placer`: the `order` kept (None: the placer walks none), its step, and why in `note`.

    Where an entry was logged inside a candidate of a search over a captured model, `candidate` names it (placer
    auto's "unpipelined", "parallel", "pipeline 1f1b") and `microbatches` the micro-batch count it was placed at,
    so that a report can read the kept candidate's own entries (`devplace.planning.Placed`)."""

    level: str
    placer: str
    order: str | None
    step_time_s: float | None
    dropped: str | None
    seconds: float
    microbatches: int | None = None
    note: str | None = None
    candidate: str | None = None

    @property
    def outcome(self) -> float | str:
        """The step time, or why it was dropped (what meta["placer_auto"]["tried"] records)."""
        return self.dropped if self.step_time_s is None else self.step_time_s  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`--json`'s "search_log", a saved plan's)."""
        return {f: getattr(self, f) for f in TRIED_FIELDS}

    @classmethod
    def from_dict(cls, doc: Any) -> Tried:
        """The entry of a `to_dict()` document; ValueError for one that is not (the caller names the file)."""
        texts, counts = ("level", "placer", "order", "dropped", "note", "candidate"), ("microbatches",)
        if (not isinstance(doc, Mapping) or set(doc) - set(TRIED_FIELDS) or not isinstance(doc.get("level"), str)
                or not isinstance(doc.get("placer"), str)
                or any(doc.get(k) is not None and not isinstance(doc[k], str) for k in texts)
                or any(doc.get(k) is not None and (isinstance(doc[k], bool) or not isinstance(doc[k], int))
                       for k in counts)
                or any(doc.get(k) is not None and (isinstance(doc[k], bool) or not isinstance(doc[k], int | float))
                       for k in ("step_time_s", "seconds"))):
            raise ValueError(f"a search log entry has the fields {', '.join(TRIED_FIELDS)} (level and placer "
                             f"names, times as numbers), got {doc!r:.160}")
        return cls(**{"order": None, "step_time_s": None, "dropped": None, "seconds": 0.0, **doc})


TRIED_FIELDS = ("level", "placer", "order", "step_time_s", "dropped", "seconds", "microbatches", "note", "candidate")
ORDER_AUTO = "order auto"  # the level of order "auto"'s decision in a search's log (`Tried`)


@dataclass(frozen=True, eq=False)
class Fitted:
    """A candidate placed and judged: `placer` at `settings` walking `order`, on `view` (`view_devices`),
    expanded to the graph as run (`devices`) whose simulation is `result`, after `retries` reruns with lowered
    caps; `extra` is what the search adds to the placement's meta (order_auto, placer_auto, refined_from)."""

    placer: str
    order: Order
    settings: dict[str, Any]
    view: View
    view_devices: np.ndarray
    devices: np.ndarray
    result: SimResult
    retries: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return float(self.result.step_time_s)

    @property
    def schedule(self) -> Schedule | None:
        return self.result.schedule if isinstance(self.result, ScheduledResult) else None

    def noting(self, **extra: Any) -> Fitted:
        """The same with `extra` added to what the search records in the meta."""
        return replace(self, extra={**self.extra, **extra})


@dataclass(frozen=True, eq=False)
class SearchResult:
    """A placement found and simulated: `graph` is the graph as run (one micro-batch's, captured at its own size,
    for a pipeline placed on such a graph), `placement` places every node of it and `result` is its
    simulation there (a ScheduledResult under a schedule); `coarse` is the placement of the coarse graph the
    placer saw (the same as `placement` without a coarsening), `coarsening` the one placed (the given one, or a
    finer one, module docstring); `cap_retries` the reruns with lowered caps; `log` what was tried and why each
    candidate was dropped. How it was made is `placement.made_by`, the one record (`search` completes it: the
    request, the groups placed, the search's `seconds` and `simulations`)."""

    graph: CompGraph
    placement: Placement
    result: SimResult
    coarse: Placement
    coarsening: Coarsening | None
    cap_retries: int
    log: tuple[Tried, ...]
    parallel: ParallelResult | None = None  # the parallel plan found, simulated (`search_parallel_plans`)

    @property
    def made_by(self) -> MadeBy:
        """How it was made (`placement.made_by`, which the search always sets)."""
        assert self.placement.made_by is not None
        return self.placement.made_by

    @property
    def seconds(self) -> float | None:
        """The whole search's wall time (None before `search` measured it)."""
        return self.made_by.seconds

    @property
    def simulations(self) -> int | None:
        """The steps the whole search simulated (None before `search` counted them)."""
        return self.made_by.simulations


def search(req: Request) -> SearchResult:
    """Place `req`: plan its candidates, place and judge each, keep the fastest (module docstring); with a
    `microbatch_graph`, placer "auto" and `pipeline` search over the captures of its micro-batches
    (`search_captured`). The answer's record of how it was made (`placement.made_by`) is completed here, once:
    the request (`request_record`), the groups placed, and the wall `seconds` and `simulations` of the whole
    search."""
    t0 = time.perf_counter()
    with counting() as count:
        if req.parallel is not None:
            found = search_parallel_plans(req)
        elif req.placer == AUTO_PLACER and v_schedule(req) is not None:
            # a V (zbv, dualpipev) is only a parallel plan's: its stages, not a placement, say where each op runs;
            # placer auto's default answers one devplace runs
            found = search_parallel_plans(replace(req, parallel=ParallelAsk()), runnable=True)
        else:
            found = search_captured(req) if captures_microbatches(req) else search_graph(req)
    groups = found.coarsening.num_groups if found.coarsening is not None else found.graph.num_nodes
    made = replace(found.made_by, request=request_record(req), groups=groups, seconds=time.perf_counter() - t0,
                   simulations=count.runs)
    return replace(found, placement=replace(found.placement, made_by=made))


def request_record(req: Request) -> dict[str, Any]:
    """What `req` asked, as a placement records it (`MadeBy.request`): placer, order (its name; "custom" for a
    caller's own), seed and settings, and try_orders, try_with and the parallel plans asked for where given.
    `replay_request` turns it back into the search's arguments."""
    doc: dict[str, Any] = {"placer": req.placer, "order": order_label(req.order), "seed": req.seed,
                           "settings": dict(req.settings)}
    if req.try_orders is not None:
        doc["try_orders"] = req.try_orders
    if req.try_with is not None:
        doc["try_with"] = req.try_with
    if req.parallel is not None:
        doc["parallel"] = req.parallel.to_dict()
    return doc


def replay_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `search_placement` (and `planning.place_graph`) that ask `request` (a
    `request_record`) again: placer, order, seed, try_orders, try_with, parallel and the settings. PlacerError
    for a record that is not one (an edited file)."""
    known = {"placer", "order", "seed", "settings", "try_orders", "try_with", "parallel"}
    settings = request.get("settings") or {}
    if (set(request) - known or not isinstance(request.get("placer"), str) or not isinstance(request.get("order"), str)
            or not isinstance(settings, Mapping)):
        raise PlacerError(f"a recorded request must name its placer and order, with its settings an object and no "
                          f"other keys than {', '.join(sorted(known))}; got {dict(request)!r:.200}")
    ask = request.get("parallel")
    return {"placer": request["placer"], "order": request["order"], "seed": request.get("seed", DEFAULT_SEED),
            "try_orders": request.get("try_orders"), "try_with": request.get("try_with"),
            "parallel": None if ask is None else ParallelAsk.from_dict(ask), **settings}


def search_graph(req: Request) -> SearchResult:
    """Place `req` on its graph.

    The placers see the cluster's devices in a canonical order (`canonical_order`: fastest first for the graph,
    then the most memory, then the fastest links) and the answer is given back in the order the cluster lists
    them: the same GPUs listed in another order give the same placement (list schedulers, for one, break ties
    by device index)."""
    log: list[Tried] = []
    perm = canonical_order(req.graph, req.cluster)
    listed = bool(np.array_equal(perm, np.arange(perm.size)))
    canon = req if listed else replace(req, cluster=reordered(req.cluster, perm))
    plan = plan_search(canon)
    kept = _best_placer(canon, plan, log)
    found = _result(canon, kept, log)
    return found if listed else _as_listed(found, req, perm)


def _as_listed(found: SearchResult, req: Request, perm: np.ndarray) -> SearchResult:
    """`found`, made on the canonically ordered cluster (device i there is device perm[i] of `req.cluster`), with
    its devices renumbered as `req.cluster` lists them and simulated there (the same step, relabelled)."""
    schedule = found.placement.schedule
    if schedule is not None:  # the pipeline's positions, as the listed devices
        along = schedule.device_order or tuple(range(perm.size))
        schedule = replace(schedule, device_order=tuple(int(perm[d]) for d in along))
    placement, coarse = (replace(p, assignment={k: int(perm[d]) for k, d in p.assignment.items()}, schedule=schedule)
                         for p in (found.placement, found.coarse))
    devices = placement.to_array(req.graph, req.cluster.num_devices)
    result = simulate_output(req.graph, req.cluster, devices, schedule)
    return replace(found, placement=placement, coarse=coarse, result=result)


def _best_placer(req: Request, plan: SearchPlan, log: list[Tried]) -> Fitted:
    """The fastest of the plan's placers (the one asked for, or those of placer "auto"); with placer "auto",
    meta["placer_auto"] records each one's step (or why it was dropped or skipped), its seconds and why."""
    if not plan.auto:
        (only,) = plan.placers
        return _timed(log, "placer", only.placer, None, lambda: refined(req, only, req.progress, log))
    log += [Tried("placer", pc.placer, None, None, pc.skipped, 0.0) for pc in plan.placers if pc.skipped]
    first = [pc for pc in plan.placers if not pc.skipped and not pc.last_resort]
    last = [pc for pc in plan.placers if pc.last_resort]
    best: Fitted | None = None
    reasons: dict[str, str] = {}
    for i, pc in enumerate(first + last):
        if pc.last_resort and best is not None:
            break
        sub = (candidate_progress(req.progress, i, len(first), f"placer {pc.placer}") if not pc.last_resort else
               candidate_progress(req.progress, i, i + 1, f"placer {pc.placer} (none of the others fits)"))
        try:
            fitted = _timed(log, "placer", pc.placer, None, lambda pc=pc, sub=sub: refined(req, pc, sub, log),
                            pc.note)
        except NoFitError as exc:
            reasons[pc.placer] = exc.reason or str(exc)
            continue
        if best is None or fitted.step_time_s < best.step_time_s:  # strictly smaller: ties keep the earlier
            best = fitted
    if best is None:
        reasons = {**{pc.placer: pc.skipped for pc in plan.placers if pc.skipped}, **reasons}
        why = "; ".join(f"{p}: {r}" for p, r in reasons.items())
        raise no_fit_error(req.graph, req.cluster, AUTO_PLACER, f"none of {', '.join(reasons)} fits ({why})")
    placers = [e for e in log if e.level == "placer"]
    times = {e.placer: e.seconds for e in placers if not (e.dropped or "").startswith("skipped")}
    # those that ran, and those the memory bound skipped
    flat = [e for e in placers if e.placer in AUTO_PLACERS
            and (e.placer in times or (e.dropped or "").startswith(UNPIPELINED_NO_FIT))]
    if best.placer == AUTO_PIPELINE and flat and all(e.step_time_s is None for e in flat):
        why = (f"none of {', '.join(AUTO_PLACERS)} fits without micro-batches; {AUTO_PIPELINE} runs the step in "
               "micro-batches, which hold the activations of fewer samples at once")
    else:
        why = f"smallest simulated step time of {', '.join(times)} (placer {AUTO_PLACER!r})"
    return best.noting(placer_auto={"placer": best.placer, "tried": {e.placer: e.outcome for e in placers},
                                    "time_s": times, "why": why})


def _best_order(req: Request, pc: PlacerCandidates, progress: Progress | None, log: list[Tried]) -> Fitted:
    """The fastest of one placer's orders (`_compare_orders`); order "auto"'s decision logged (level
    `ORDER_AUTO`: the order kept, its step, why)."""
    t0 = time.perf_counter()
    fitted = _compare_orders(req, pc, progress, log)
    auto = fitted.extra.get("order_auto")
    if pc.auto is not None and isinstance(auto, dict):
        log.append(Tried(ORDER_AUTO, pc.placer, auto["order"], fitted.step_time_s, None, time.perf_counter() - t0,
                         note=auto["why"]))
    return fitted


def _compare_orders(req: Request, pc: PlacerCandidates, progress: Progress | None, log: list[Tried]) -> Fitted:
    """The fastest of one placer's orders (order "auto": meta["order_auto"] records how it was chosen): each
    order placed by `pc.trial` when given, `pc.placer` then once under the best; where none fits alone and
    `pc.on_view`, the order chosen on the placer's view at every lowered cap."""
    auto = pc.auto
    if auto is None:
        return place_candidate(req, pc.placer, pc.orders, pc.settings, progress)
    if not auto.candidates:  # the model's order alone (walked only by a placer that walks one)
        walked = auto.model_order if get_placer(pc.placer).uses_order else None
        return place_candidate(req, pc.placer, pc.orders, pc.settings, progress).noting(
            order_auto={"order": walked, "mode": auto.mode, **auto.base, "why": auto.reason})
    trial = pc.trial or pc.placer
    mark, best, first_error = len(log), None, None
    for j, order in enumerate(pc.orders):
        sub = candidate_progress(progress, j, len(pc.orders), f"order {order_label(order)}")
        try:
            fitted = _timed(log, "order", trial, order_label(order), lambda order=order, sub=sub: place_candidate(
                req, trial, (order,), pc.settings if trial == pc.placer else {}, sub if trial == pc.placer else None))
        except NoFitError as exc:
            first_error = first_error or exc
            continue
        if best is None or fitted.step_time_s < best.step_time_s:  # strictly smaller: ties keep the model's first
            best = fitted
    orders = [e for e in log[mark:] if e.level == "order" and e.placer == trial]
    why = {"mode": auto.mode, "tried": {e.order: e.outcome for e in orders},
           "time_s": {e.order: e.seconds for e in orders}, **auto.base,
           "why": auto.reason + (" of the full graph" if req.coarsening is not None else "")}
    if best is None:
        if not pc.on_view:
            assert first_error is not None
            raise first_error
        best = place_candidate(req, pc.placer, pc.orders, pc.settings, progress)
        why.update(why=f"{auto.reason}; no order fits alone as run, so the order was chosen on the placer's view "
                       "at every lowered cap")
    elif trial != pc.placer:
        why.update(mode=f"{auto.mode} with {trial}", tried_with=trial, why=f"{why['why']} when placed by {trial}")
        best = place_candidate(req, pc.placer, (best.order,), pc.settings, progress)
    return best.noting(order_auto={"order": order_label(best.order), **why})


def refined(req: Request, pc: PlacerCandidates, progress: Progress | None, log: list[Tried]) -> Fitted:
    """The fastest of `pc`'s orders (`_best_order`) and, for a refining placer, its start's (`pc.start`, placed
    the same way): the start's placement where it is faster as run, with the refiner's name, order and
    settings, so a refining placer never ends worse than its start as the caller sees it (it searched a view of
    the step, and the step as run can rank the two the other way). meta["refined_from"] records the start, its
    step and which was kept. A start that does not fit or runs pipelined (anneal from `pipeline` anneals its
    devices unpipelined) is not compared."""
    mine = _best_order(req, pc, progress, log)
    if pc.start is None:
        return mine
    start = pc.start
    try:
        theirs = _timed(log, "start", start.placer, None, lambda: _best_order(req, start, None, log))
    except NoFitError:
        return mine
    if theirs.schedule is not None:
        return mine
    kept = theirs.step_time_s < mine.step_time_s
    chosen = replace(theirs, placer=mine.placer, order=mine.order, settings=mine.settings, extra=mine.extra) \
        if kept else mine
    return chosen.noting(refined_from={"placer": start.placer, "step_time_s": theirs.step_time_s,
                                       "refined_step_time_s": mine.step_time_s,
                                       "kept": "start" if kept else "refined"})


def _timed(log: list[Tried], level: str, placer: str, order: str | None, attempt: Callable[[], Fitted],
           note: str | None = None) -> Fitted:
    """`attempt()`, logged at `level` with its step or its NoFitError (re-raised), its seconds and `note`."""
    t0 = time.perf_counter()
    try:
        fitted = attempt()
    except NoFitError as exc:
        log.append(Tried(level, placer, order, None, f"{type(exc).__name__}: {exc.reason or exc}",
                         time.perf_counter() - t0, note=note))
        raise
    log.append(Tried(level, placer, order, fitted.step_time_s, None, time.perf_counter() - t0, note=note))
    return fitted


# ------------------------------------------------------------------------------- one candidate, placed


def place_candidate(req: Request, placer: str, orders: tuple[Order, ...], settings: dict[str, Any],
                    progress: Progress | None) -> Fitted:
    """`placer` at `settings` walking `orders[0]` (several: the one that does best on the placer's view at each
    cap) placed on the first of `views` where it fits as run (`fit`); NoFitError from the last view tried."""
    spec = get_placer(placer)
    # the placers' graph (the full graph's parameters are checked as run)
    if float(req.seen.param_bytes.sum()) > float(req.cluster.memory.sum()):
        raise no_fit_error(req.graph, req.cluster, placer, "the parameters alone exceed the cluster's memory")
    error: NoFitError | None = None
    for view in views(req, spec):
        try:
            fitted = fit(req, view, placer, settings, _runner(req, view, spec, orders, settings, progress))
        except NoFitError as exc:
            error = exc
            continue
        if view.classes is not None and not view.folded and violations(view.graph, fitted.view_devices, view.ties):
            # a placer that takes `ties` and splits a class: a bug, not a user error
            raise RuntimeError(f"placer {placer!r} split a tie class although it takes `ties`")
        return fitted
    assert error is not None
    raise error


Run = Callable[[Cluster], tuple[PlacerOutput, Order]]


def _runner(req: Request, view: View, spec: PlacerSpec, orders: tuple[Order, ...], settings: dict[str, Any],
            progress: Progress | None) -> Run:
    """run(cluster seen) -> (the placer's output on `view`, the order it walked)."""
    extra = {"progress": progress} if progress is not None and spec.reports_progress else {}
    call = {**settings, **extra, **({"ties": view.ties} if spec.handles_ties else {}),
            **({"full": view.judged_on()} if spec.takes_full else {}),
            **({"as_run": FullGraph(req.graph, view.expand)} if spec.takes_as_run else {})}
    visits = [traversal_indices(view.graph, order, req.seed, cluster=req.cluster) for order in orders]

    def once(seen: Cluster, visit: np.ndarray) -> PlacerOutput:
        # then the placer's own adjust step, if it has one (the pipeline placer's simulated refinement)
        out = as_output(spec.func(view.graph, seen, order=visit, seed=req.seed, **call)).adjusted()
        dev = out.devices
        if dev.shape != (view.graph.num_nodes,) or (view.graph.num_nodes and not
                                                    (dev.min() >= 0 and dev.max() < req.cluster.num_devices)):
            raise RuntimeError(f"placer {spec.name!r} returned an invalid device array")  # a bug, not a user error
        return out

    def run(seen: Cluster) -> tuple[PlacerOutput, Order]:
        if len(orders) == 1:
            return once(seen, visits[0]), orders[0]
        # no order fits alone as run: the one that does best on the view at these caps
        best: tuple[PlacerOutput, Order, float] | None = None
        unrunnable: list[NoFitError] = []  # orders whose placements do not run (not memory)
        for order, visit in zip(orders, visits, strict=True):
            try:
                out = once(seen, visit)
                step = simulate_output(view.graph, seen, out.devices, out.schedule, spec.name)
            except NoFitError as exc:
                unrunnable += [] if exc.memory else [exc]
                continue
            if step.feasible and (best is None or step.step_time_s < best[2]):
                best = (out, order, step.step_time_s)
        if best is None and len(unrunnable) == len(orders):
            raise unrunnable[0]  # not memory: say why, not "no fit"
        if best is None:
            raise no_fit_error(req.graph, req.cluster, spec.name, f"no order of {len(orders)} places its view "
                               "within memory")
        return best[0], best[1]
    return run


def fit(req: Request, view: View, placer: str, settings: dict[str, Any], run: Run) -> Fitted:
    """The one memory-fit loop: place `view` with `run(cluster seen)`, expand its devices to the graph as run and
    simulate that (under the schedule `run` returns, if any); while a device is over memory, lower that
    device's cap to min(cap, the view's simulated peak there) x capacity / the real peak there, and place again
    (at most `CAP_RETRIES` times). NoFitError for the graph on the real cluster, with the overflow, else."""
    graph, cluster = req.graph, req.cluster
    caps = cluster.memory.astype(np.float64)
    seen = cluster
    for attempt in range(CAP_RETRIES + 1):
        try:
            out, order = run(seen)
        except NoFitError as exc:
            if attempt == 0:
                raise
            raise no_fit_error(graph, cluster, placer, f"as run, its placement was over memory; with the device "
                               f"caps lowered to {_caps_text(caps)} to make room, it found none "
                               f"({exc.reason or exc})") from exc
        devices = view.expand(out.devices)
        result = simulate_output(graph, cluster, devices, out.schedule, placer)
        if result.feasible:
            return Fitted(placer, order, dict(settings), view, out.devices, devices, result, attempt)
        if attempt == CAP_RETRIES:
            break
        # the view's own peak: the graph's where the view is the graph itself (no second simulation)
        view_peak = (result.peak_memory_bytes if view.parent is None else
                     simulate_output(view.graph, seen, out.devices, out.schedule).peak_memory_bytes)
        caps = caps.copy()
        for d in result.oom:
            # shrink what the view may hold on d by the factor the real peak exceeds the real capacity: a view
            # that understates memory by any factor still ends up within it (subtracting the overflow would
            # go to zero when the view's own peak is smaller than the overflow)
            full_cap, full_peak = float(result.memory_bytes[d]), float(result.peak_memory_bytes[d])
            caps[d] = min(caps[d], float(view_peak[d])) * full_cap / full_peak
        seen = with_caps(cluster, caps)
    over_text = ", ".join(f"device {d} by {fmt_bytes(float(b))}" for d, b in result.oom.items())
    raise no_fit_error(graph, cluster, placer, f"as run, its placement is over memory on {over_text} after "
                       f"{CAP_RETRIES} rerun(s) with lowered device caps (last: {_caps_text(caps)})")


def simulate_output(graph: CompGraph, cluster: Cluster, devices: np.ndarray, schedule: Schedule | None,
                    placer: str | None = None) -> SimResult:
    """The step of `graph` under `devices` as it runs: under `schedule` when given (a ScheduledResult), else
    unpipelined (the reference model). With `placer` named, devices that form no pipeline under `schedule` on
    `graph` (a placer judged its stages on a folded or coarse view of it, where they did) are that placer's
    NoFitError saying why (not memory: `unrunnable_error`), so a search over orders or placers skips it instead
    of stopping."""
    if schedule is None:
        return DevplaceModel(graph, cluster).run(devices)
    try:
        return simulate_schedule(graph, cluster, devices, schedule)
    except ScheduleError as exc:
        if placer is None:
            raise
        why = (f"its {schedule.kind} stages are no pipeline on the graph as it runs ({exc}); another --order, or "
               "more groups (--max-nodes), may stage it")
        raise unrunnable_error(f"placer {placer!r} found no placement of {graph.name!r} on {cluster.name!r} that "
                               f"runs: {why}", why) from exc


def with_caps(cluster: Cluster, caps: np.ndarray) -> Cluster:
    """`cluster` with device d's memory set to caps[d] (same name, speeds and links): what a placer sees when
    it must leave room for memory its own view of the graph does not count."""
    devices = tuple(replace(d, memory_bytes=float(c)) for d, c in zip(cluster.devices, caps, strict=True))
    return Cluster(cluster.name, devices, cluster.link, dict(cluster.links), dict(cluster.meta))


def _caps_text(caps: np.ndarray) -> str:
    return ", ".join(fmt_bytes(max(float(c), 0.0)) for c in caps)


# ------------------------------------------------------------------------------------------ the answer


def _result(req: Request, kept: Fitted, log: list[Tried]) -> SearchResult:
    """The kept candidate as a SearchResult, its meta the file format's record of how it was made."""
    graph, cluster, view = req.graph, req.cluster, kept.view
    made_by = MadeBy(kept.placer, order_label(kept.order) if get_placer(kept.placer).uses_order else None, req.seed,
                     dict(kept.settings), req.semantics.value)
    meta: dict[str, object] = {"step_time_s": kept.step_time_s}
    if view.classes is not None:
        meta.update(tie_classes=view.classes, ties="folded" if view.folded else "native", cap_retries=kept.retries)
    if req.coarsening is not None:
        meta["full_cap_retries"] = kept.retries
        if view.coarsening is not req.coarsening and view.coarsening is not None:
            meta["refined_groups"] = view.coarsening.num_groups
    meta.update(kept.extra)
    placement = Placement(dict(zip(graph.ids, kept.devices.tolist(), strict=True)), graph=graph.name,
                          cluster=cluster.name, meta=meta, schedule=kept.schedule, made_by=made_by)
    coarse = placement
    if req.coarsening is not None:
        seen, devices = view.unfolded(kept.view_devices)
        coarse = replace(placement, assignment=dict(zip(seen.ids, devices.tolist(), strict=True)), graph=seen.name)
    return SearchResult(graph, placement, kept.result, coarse, view.coarsening, kept.retries, tuple(log))


# ---------------------------------------------------------------- a captured model: micro-batches of their own size

# the schedules placer auto pipelines a captured model under
AUTO_PIPELINE_KINDS = ("1f1b", "interleaved-1f1b")
UNPIPELINED = "unpipelined"  # placer auto's candidate without micro-batches on a captured model (its log's name)


def captures_microbatches(req: Request) -> bool:
    """Whether `req` searches over micro-batches captured at their own size: it has a `microbatch_graph`, a
    graph that records its batch, and placer "auto" or `AUTO_PIPELINE`."""
    return (req.microbatch_graph is not None and graph_batch(req.graph) is not None
            and req.placer in (AUTO_PLACER, AUTO_PIPELINE))


def search_captured(req: Request) -> SearchResult:
    """`req` on a captured model (`captures_microbatches`): `AUTO_PIPELINE` over its micro-batch counts
    (`search_microbatches`), or placer "auto" comparing the placement without micro-batches with pipelines
    (`search_auto_captured`)."""
    req = memoized(req)
    if req.placer == AUTO_PIPELINE:
        return search_microbatches(req, dict(req.settings))
    return search_auto_captured(req, check_auto_placer(req.settings))


def memoized(req: Request) -> Request:
    """`req` whose micro-batch graph provider captures each count once for every candidate of a search (a
    pipeline kind, a parallel plan) and gives the request's own graph for M = 1."""
    provider = req.microbatch_graph
    assert provider is not None
    cache: dict[int, tuple[CompGraph, Coarsening | None]] = {1: (req.graph, req.coarsening)}

    def graph_of(m: int) -> tuple[CompGraph, Coarsening | None]:
        if m not in cache:
            cache[m] = provider(m)
        return cache[m]
    return replace(req, microbatch_graph=graph_of)


class Outpaced(PlacerError):
    """A candidate skipped before it ran: its lower bound is not below a step another candidate found."""


def search_auto_captured(req: Request, schedule: str | None) -> SearchResult:
    """Placer auto on a captured model: the best of the parallel plans devplace runs (`default_parallel`), of
    `AUTO_PLACERS` without micro-batches (skipped, with the reason, where the parameters and the whole batch's
    activations exceed the cluster's memory, or where the step's lower bound is not below the fastest candidate,
    which are placed first) and of `AUTO_PIPELINE` under each of `AUTO_PIPELINE_KINDS` (or the one kind asked for)
    on micro-batches captured at their own size (`search_microbatches`, skipping the counts whose lower bound is
    not below the fastest candidate), unless `schedule` is "none"; a model whose result micro-batching or
    data-parallel replicas change (BatchNorm: `microbatching_note`) gets either only where its unpipelined step
    does not fit or a schedule is asked for. The fastest that fits is kept (of equals the first: unpipelined).
    The log holds every search's entries and one per candidate (level "schedule"); meta["placer_auto"] is read
    from it: each of `AUTO_PLACERS`' and each candidate's step (or why it was skipped or did not fit), and the
    candidates' times."""
    log: list[Tried] = []
    found: list[tuple[str, SearchResult]] = []
    changes = microbatching_note(req.graph)

    def fastest() -> float:
        return min((r.result.step_time_s for _, r in found), default=math.inf)

    def unpipelined() -> None:
        """The placement without micro-batches, unless it cannot fit or its lower bound is not below the fastest
        candidate found (DESIGN.md section 8); first in the log and among equals either way."""
        nonlocal found
        needs, has = memory_needs(req.graph).total_bytes, float(req.cluster.memory.sum())
        bound = lower_bound(req.graph, req.cluster).value_s
        if needs > has:
            log.insert(0, Tried("schedule", UNPIPELINED, None, None, f"skipped: the parameters and the whole "
                                f"batch's activations need {fmt_bytes(needs)}, the cluster has {fmt_bytes(has)}", 0.0))
        elif bound >= fastest():
            log.insert(0, Tried("schedule", UNPIPELINED, None, None, f"skipped: no step without micro-batches "
                                f"beats {fastest():.4g} s (its lower bound is {bound:.4g} s)", 0.0))
        else:
            flat = replace(req, settings={"schedule": "none"}, microbatch_graph=None)
            mark = len(log)
            unpiped = _candidate(log, "schedule", UNPIPELINED, lambda: search_graph(flat))
            log[:] = log[mark:] + log[:mark]
            found = unpiped + found

    def kept_own(name: str, flag: str) -> bool:
        """True (and logged) where the model's own step fits and `name` would change its result (issue 30)."""
        if changes is not None and schedule is None and found:
            log.append(Tried("schedule", name, None, None, f"skipped: {changes} ({flag} anyway)", 0.0))
            return True
        return False

    # placed after the pipelines, so its lower bound can skip it; first where micro-batching changes the
    # model's result, whose own step is kept when it fits (issue 30)
    first = changes is not None and schedule is None
    if first:
        unpipelined()
    batch = graph_batch(req.graph)
    # the parallel plans first: data parallelism answers in one pass, and its step skips pipelines' counts
    helps = schedule is None and req.cluster.num_devices >= 2 and batch >= 2  # type: ignore[operator]
    conflicts = parallel_conflicts(req)
    if helps and conflicts:
        log.append(Tried("schedule", PARALLEL_PLACER, None, None, "skipped: parallel plans choose their own cuts, "
                         f"schedule and micro-batches, and {', '.join(conflicts)} fixed them", 0.0))
    elif helps and not kept_own(PARALLEL_PLACER, "--parallel plans it"):
        found += _candidate(log, "schedule", PARALLEL_PLACER, lambda: default_parallel(req),
                            (NoFitError, PlacerError, DevplaceError))
    if schedule != "none" and batch >= 2:  # type: ignore[operator]
        for kind in (schedule,) if schedule is not None else AUTO_PIPELINE_KINDS:
            if kept_own(f"{AUTO_PIPELINE} {kind}", f"--schedule {kind} pipelines it"):
                continue
            # PlacerError too: e.g. no micro-batch count divides the batch for interleaving
            found += _candidate(log, "schedule", f"{AUTO_PIPELINE} {kind}", lambda kind=kind: search_microbatches(
                req, {"schedule": kind}, fastest()), (NoFitError, PlacerError))
    if schedule in (None, "none") and not first:  # no schedule kind asked for
        unpipelined()
    candidates = [e for e in log if e.level == "schedule"]
    if not found:
        why = "; ".join(f"{e.placer}: {e.dropped}" for e in candidates)
        raise no_fit_error(req.graph, req.cluster, AUTO_PLACER, f"nothing fits ({why})")
    name, best = min(found, key=lambda nb: nb[1].result.step_time_s)
    # the placers of AUTO_PLACERS as the unpipelined search judged them, then the candidates
    tried = {e.placer: e.outcome for e in log if e.level == "placer" and e.placer in AUTO_PLACERS}
    tried.update((e.placer, e.outcome) for e in candidates)
    times = {e.placer: e.seconds for e in candidates if not (e.dropped or "").startswith("skipped")}
    made = best.placement.made_by
    meta = {"placer": made.placer if name == UNPIPELINED and made is not None else name, "tried": tried,
            "time_s": times, "why": f"smallest simulated step time of {', '.join(times)} (placer {AUTO_PLACER!r})"}
    return replace(best, placement=best.placement.with_meta(placer_auto=meta), log=tuple(log))


def search_microbatches(req: Request, settings: dict[str, Any], beat: float = math.inf) -> SearchResult:
    """The `pipeline` placer at `settings` on a captured model, one micro-batch count at a time (the given one,
    else each of the placer's choices that divides the batch), each on the graph `req.microbatch_graph(M)` gives
    (every op costed at the micro-batch's size); the fastest feasible pipeline is kept. A count whose lower bound
    (`microbatch_bounds`) is not below `beat` (another candidate's step) is skipped before its graph is made; the
    others' graphs are made, and the counts placed in the order of the step their own graph promises
    (`microbatch_outlook`'s estimate; of equals the larger M first): a small micro-batch can cost more than its
    share of the batch (fixed costs per op), so the largest count is not always the most promising, and placing it
    first spent the longest simulations on it (t5-small on a mixed cluster: M=32 first, 77 of 210 s, slowest of
    all). A count whose bound (also `microbatch_outlook`'s, on its graph) is not below the fastest pipeline found
    or `beat` is skipped, and logged so; `Outpaced` when every count is. The log holds each count's search and an
    entry per count (level "microbatches"); meta["microbatch_search"] records each count's step (or why it did not
    fit or was skipped), read from it. With order "auto" the orders are compared at the first count placed that
    fits and the kept order walks the others (meta["microbatch_search"]["order_chosen_at"]). NoFitError when none
    fits."""
    assert req.microbatch_graph is not None
    batch = graph_batch(req.graph)
    kind, chunks = settings.get("schedule", "1f1b"), settings.get("chunks")
    schedules = pipeline_schedules(kind, settings.get("microbatches"), chunks, req.cluster.num_devices, batch=batch)
    counts = [s.microbatches for s in schedules][::-1]
    rest = {k: v for k, v in settings.items() if k != "microbatches" and v is not None}
    log: list[Tried] = []
    best: SearchResult | None = None
    walk = replace(req, placer=AUTO_PIPELINE, microbatch_graph=None)
    chosen_at: int | None = None
    one_stage = kind in ("gpipe", "1f1b") and int(chunks or 1) == 1
    bounds = microbatch_bounds(req.graph, req.cluster, counts, one_stage_per_device=one_stage)
    unrunnable: dict[int, NoFitError] = {}  # counts whose pipelines do not run (not memory)

    def attempt(at_m: Request) -> SearchResult:
        try:
            return search_graph(at_m)
        except NoFitError as exc:
            if not exc.memory:
                unrunnable[at_m.settings["microbatches"]] = exc
            raise

    outlook = {m: microbatch_outlook(req.microbatch_graph(m)[0], req.cluster, m, chunks=int(schedules[0].chunks or 1),
                                     one_stage_per_device=one_stage) for m in counts if bounds[m] < beat}
    limit = {m: max(bounds[m], outlook[m].bound_s) if m in outlook else bounds[m] for m in counts}
    for m in sorted(counts, key=lambda m: outlook[m].estimate_s if m in outlook else math.inf):
        fastest = min(beat, best.result.step_time_s if best is not None else math.inf)
        if limit[m] >= fastest:
            log.append(Tried("microbatches", AUTO_PIPELINE, None, None, f"skipped: no pipeline at M={m} beats "
                             f"{fastest:.4g} s (its lower bound is {limit[m]:.4g} s)", 0.0, m))
            continue
        graph, coarsening = req.microbatch_graph(m)
        at_m = replace(walk, graph=graph, coarsening=coarsening, settings={**rest, "microbatches": m})
        for _, found in _candidate(log, "microbatches", AUTO_PIPELINE, lambda at_m=at_m: attempt(at_m),
                                   microbatches=m):
            order = found.placement.made_by.order if found.placement.made_by is not None else None
            if walk.order == "auto" and order is not None:
                walk = replace(walk, order=order, try_orders=None, try_with=None)
                chosen_at = m
            if best is None or found.result.step_time_s < best.result.step_time_s:
                best = found
    tried = {str(e.microbatches): e.outcome for e in log if e.level == "microbatches"}
    if best is None and all(str(why).startswith("skipped") for why in tried.values()):
        raise Outpaced(f"no pipeline at any micro-batch count beats {beat:.4g} s (the lower bounds of "
                       f"M={', '.join(tried)}: {', '.join(f'{limit[int(m)]:.4g}' for m in tried)} s)")
    if best is None:
        reasons = "; ".join(f"M={m}: {why}" for m, why in tried.items())
        placed = [m for m, why in tried.items() if not str(why).startswith("skipped")]
        if unrunnable and len(unrunnable) == len(placed):  # not memory: say why, not "no fit"
            alike: dict[str, list[str]] = {}  # each reason once, with its counts
            for m, exc in unrunnable.items():
                alike.setdefault(exc.reason or str(exc), []).append(str(m))
            why = "; ".join(f"M={', '.join(ms)}: {text}" for text, ms in alike.items())
            raise unrunnable_error(f"placer {AUTO_PIPELINE!r} found no pipeline of {req.graph.name!r} on "
                                   f"{req.cluster.name!r} that runs, at any micro-batch count the batch of {batch} "
                                   f"allows ({why})", f"no pipeline runs ({why})")
        raise no_fit_error(req.graph, req.cluster, AUTO_PIPELINE, f"no micro-batch count the batch of {batch} "
                           f"allows fits ({reasons})")
    assert best.placement.schedule is not None
    meta = {"batch": batch, "tried": tried, "kept": best.placement.schedule.microbatches,
            "order_chosen_at": chosen_at}
    return replace(best, placement=best.placement.with_meta(microbatch_search=meta), log=tuple(log))


def _candidate(log: list[Tried], level: str, name: str, run: Callable[[], SearchResult],
               errors: tuple[type[Exception], ...] = (NoFitError,), microbatches: int | None = None,
               ) -> list[tuple[str, SearchResult]]:
    """`run()`, one candidate of a search over a captured model's micro-batches, logged: its own search's log,
    then an entry at `level` with its step (or why it was dropped: one of `errors`) and wall seconds. Returns
    [(name, it)], or [] when dropped."""
    t0 = time.perf_counter()
    try:
        found = run()
    except errors as exc:
        why = (f"skipped: {exc}" if isinstance(exc, Outpaced) else
               f"{type(exc).__name__}: {getattr(exc, 'reason', '') or exc}")
        log.append(Tried(level, name, None, None, why, time.perf_counter() - t0, microbatches))
        return []
    # its entries say which candidate and micro-batch count they were logged under (the outermost candidate's name)
    log += [replace(e, microbatches=microbatches if e.microbatches is None else e.microbatches,
                    candidate=name if level == "schedule" else e.candidate) for e in found.log]
    log.append(Tried(level, name, None, found.result.step_time_s, None, time.perf_counter() - t0, microbatches))
    return [(name, found)]


# ------------------------------------------------------------------------------------- the entry points


def place(graph: CompGraph, cluster: Cluster, *, placer: str = DEFAULT_PLACER, order: Order = DEFAULT_ORDER,
          seed: int = DEFAULT_SEED, progress: Progress | None = None, try_orders: int | None = None,
          try_with: str | None = None, semantics: Semantics | str | None = None, **settings: Any) -> Placement:
    """Place every node of `graph` on a device of `cluster` with `placer`, walking the graph in `order`.

    Settings are the placer's keyword arguments (see `devplace placers`). The result is always
    memory-feasible under the `devplace` simulation model; when the placer finds nothing that fits, a
    NoFitError says how much memory the step needs and what would hold it. `progress(done, total)` is
    called now and then by placers with long loops (greedy, anneal). `order` is an order name, "auto", a
    sequence listing every node id once, or a callable graph -> such a sequence (`made_by.order` is then "custom").

    `semantics` (`devplace.graph.semantics`; None: the graph's own, `semantics_of(graph)` -- op by op unless
    the graph says "autograd", as a captured model does): "op-by-op" places every node on its own. "autograd":
    a training step runs each backward and optimizer op on its forward op's device, and each input with its
    first consumer, whatever a placer says, so every tie class of `graph`
    (`devplace.graph.ties.tie_classes`) is one decision. A placer that takes `ties` (m-etf, m-sct, heft,
    greedy, even, even-refine: `PlacerSpec.handles_ties`) places `graph` itself and keeps each class on one
    device (the list schedulers decide a class when they place its first op);
    every other placer -- and one that takes `ties` but finds nothing that fits that way -- places the folded
    graph (`devplace.graph.ties.fold`: one node per class, with the compute and memory of all its ops) and
    every op of a class goes to its class's device (meta["ties"]: "native" or "folded"); a placer that takes
    `full` (`PlacerSpec.takes_full`: placeto, seq2seq) is also given `FullGraph(graph, expand)` to judge its
    answer on `graph` itself. Either way the placement is simulated and checked on `graph` itself, so the
    reported step time is the one autograd runs. When the placer's view is over memory as run, the placer runs
    again with the device caps it sees lowered in proportion to the overflow (`fit`, at most `CAP_RETRIES`
    times), else NoFitError. A graph without ties is placed the same either way. `made_by.semantics` records the
    semantics placed under and, where classes were tied, meta["tie_classes"] their number, meta["ties"] how they
    were placed and meta["cap_retries"] the reruns.

    A placer that returns a `PlacerOutput` with a schedule (the `pipeline` placer) is checked, here and in
    every rerun, with `devplace.sim.simulate(..., schedule=)`: meta["step_time_s"] is then the pipelined step
    and `placement.schedule` the schedule (a file records it under "schedule", `Schedule.to_dict()`); how it
    was made is `placement.made_by` (placer, order, seed, settings, semantics).

    `order="auto"`: a placer registered `cheap` (`PlacerSpec.cheap`: list schedulers, greedy, contiguous...)
    is placed under every candidate order (`devplace.orders.auto.candidate_orders`: all but `random`, the
    model's ranking first) and the smallest simulated step time is kept; any other placer takes the order the
    shipped recommendation model picks from the graph's features (`devplace.orders.auto`). With
    `try_orders=K` any placer instead runs with each of the model's K most promising orders and keeps the
    placement with the smallest simulated step time (K times the placement time); with `try_with=CHEAP` as
    well, the K orders are tried with the placer CHEAP (at its default settings) and `placer` runs once, with
    the order that did best there: for expensive placers (placeto, seq2seq), at the risk that the cheap
    placer's best order is not theirs. The Placement's meta["order_auto"] records the chosen order and why.
    The search itself: `devplace.placers.search` (its module docstring).
    """
    return search_placement(graph, cluster, placer=placer, order=order, seed=seed, progress=progress,
                            try_orders=try_orders, try_with=try_with, semantics=semantics, **settings).placement


def place_expanded(coarsening: Coarsening, full: CompGraph, cluster: Cluster, *, placer: str = DEFAULT_PLACER,
                   order: Order = DEFAULT_ORDER, seed: int = DEFAULT_SEED, progress: Progress | None = None,
                   try_orders: int | None = None, try_with: str | None = None, semantics: Semantics | str | None = None,
                   **settings: Any) -> SearchResult:
    """Place `coarsening.graph` as `place` does (same arguments), expand it to `full` (the graph the coarsening
    was made from) and judge it on `full`: the result is never over memory as run on the full graph.

    When the full graph is over memory on some device, the placer runs again seeing that device's cap
    lowered to min(cap, its view's peak there) x capacity / the full graph's peak there (at most
    `CAP_RETRIES` times); if it still does not fit, NoFitError with the memory the step needs, the cluster's and
    a suggestion. `semantics` (None: the full graph's own, `semantics_of(full)`) is the coarse graph's placing
    semantics too; under "autograd" (a captured model's) every backward and optimizer op runs with its forward
    op, so the placement is what autograd runs and `result` is its as-run step time. A placer that returns a
    schedule (`pipeline`) has the full graph simulated under it (`result` is a ScheduledResult,
    `placement.schedule` kept). When no view of the coarsening fits under the autograd rule, the full graph is
    coarsened finer and placed again (module docstring); meta["refined_groups"] records the number of groups
    placed then.
    `order="auto"` compares the orders on the full graph (module docstring; meta["order_auto"]).
    """
    return search_placement(full, cluster, coarsening=coarsening, placer=placer, order=order, seed=seed,
                            progress=progress, try_orders=try_orders, try_with=try_with, semantics=semantics,
                            **settings)


def search_placement(graph: CompGraph, cluster: Cluster, *, coarsening: Coarsening | None = None,
                     placer: str = DEFAULT_PLACER, order: Order = DEFAULT_ORDER, seed: int = DEFAULT_SEED,
                     progress: Progress | None = None, try_orders: int | None = None, try_with: str | None = None,
                     semantics: Semantics | str | None = None, microbatch_graph: MicrobatchGraph | None = None,
                     parallel: ParallelAsk | None = None, **settings: Any) -> SearchResult:
    """`place` (without `coarsening`) or `place_expanded` (`graph` is then the full graph the coarsening was made
    from), answering with the whole SearchResult: the placement, its simulation, the log and the cost.

    `microbatch_graph(M)` gives the graph of one of M micro-batches of a captured model, captured at batch / M
    (`devplace.capture.custom.microbatch_graphs`): placer "auto" and `pipeline` then place each count's pipeline
    on it (`search_captured`). Without it a pipeline costs a micro-batch as the whole batch's / M, all a graph
    file allows; `placement.schedule.microbatch_graph` says which. `parallel` (a `ParallelAsk`) searches
    parallel plans instead (`search_parallel_plans`; the answer's `parallel`)."""
    if coarsening is not None and coarsening.original and coarsening.original != graph.name:
        raise GraphError(f"the coarsening was made from graph {coarsening.original!r}, not {graph.name!r}; pass the "
                         "full graph it was made from (e.g. Prepared.full with Prepared.coarsening)")
    return search(Request(graph, cluster, placer, order, seed, semantics_of(graph, semantics), settings, try_orders,
                          try_with, coarsening, progress, microbatch_graph, parallel))


# ------------------------------------------------------------- parallel plans: the nested search, resolved here

PARALLEL_SCHEDULES = SCHEDULES  # the pipeline schedules judged on each cut of a parallel plan (1f1b, zero bubble, V)
PARALLEL_MICROBATCH_COUNTS = 3  # micro-batch sizes a parallel search tries (`parallel_microbatches`)


def parallel_degrees(ask: ParallelAsk, devices: int, batch: int) -> tuple[int, ...]:
    """The data-parallel degrees a parallel search tries for `ask` on `devices` at a global `batch` (pp = devices
    / dp: a plan uses every device): the one `--dp` or `--pp` fixes, else every divisor of the devices that
    divides the batch (above 1 where `--zero` shards). PlacerError saying what does not match, and what would."""
    ask.check_devices(devices)
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    if ask.dp is not None or ask.pp is not None:
        dps = (ask.dp if ask.dp is not None else devices // ask.pp,)  # type: ignore[operator]
    else:
        dps = tuple(d for d in divisors if batch % d == 0 and (d > 1 or not ask.zero))
    if not dps:
        raise PlacerError(f"no data-parallel degree above 1 divides both the {devices} devices and the batch of "
                          f"{batch}, and --zero {ask.zero} needs one; use --zero 0 or another --batch")
    if batch % dps[0]:
        raise PlacerError(f"dp = {dps[0]} replicas do not split the batch of {batch} evenly; use a --batch that "
                          f"{dps[0]} divides, or another --dp/--pp")
    return dps


def parallel_microbatches(batch: int, devices: int, dps: tuple[int, ...]) -> tuple[int, ...]:
    """The counts K the global `batch` is cut into that a parallel search tries for the degrees `dps` (each
    replica runs K / dp micro-batches, gradients accumulated; one capture, at batch / K samples, serves every plan
    at that K): multiples of every dp that divide the batch, from the smallest that gives at least as many
    micro-batches as `devices` (a pipeline over all of them keeps every stage busy; else the largest there is),
    then each next one that halves the micro-batch, `PARALLEL_MICROBATCH_COUNTS` at most. Smaller micro-batches
    hold fewer activations (a plan that fits without recomputation) and shrink pipeline bubbles; larger ones use
    the device better."""
    step = math.lcm(*dps)
    counts = [k for k in range(step, batch + 1, step) if batch % k == 0]
    first = next((k for k in counts if k >= devices), counts[-1])
    out = [first]
    while len(out) < PARALLEL_MICROBATCH_COUNTS and out[-1] * 2 in counts:
        out.append(out[-1] * 2)
    return tuple(out)


def v_schedule(req: Request) -> str | None:
    """The V-shaped schedule `req` fixes (`--schedule zbv|dualpipev`), which only parallel plans run; else None."""
    kind = req.settings.get("schedule")
    return kind if kind in V_SHAPED else None


def parallel_conflicts(req: Request) -> list[str]:
    """The options of `req` that parallel plans choose themselves (they cut with `AUTO_PIPELINE` in the canonical
    order and pick their schedule and micro-batches, unless `--schedule` fixes a V: `v_schedule`): empty when none
    is given."""
    settings = {k: v for k, v in req.settings.items() if not (k == "schedule" and v in V_SHAPED)}
    return [what for what, yes in (("--placer", req.placer not in (AUTO_PLACER, AUTO_PIPELINE)),
                                   ("--order", req.order not in ("auto", CANONICAL_ORDER)),
                                   ("--try/--try-with", req.try_orders is not None),
                                   ("--set/--schedule/--microbatches/--chunks",
                                    any(v is not None for v in settings.values()))) if yes]


def _fixed_degrees(ask: ParallelAsk) -> str:
    """What `ask` fixes of dp and pp, for a message ("--dp 4", or "every data-parallel degree")."""
    fixed = [f"--{k} {v}" for k, v in (("dp", ask.dp), ("pp", ask.pp)) if v is not None]
    return " and ".join(fixed) or "every data-parallel degree"


def default_parallel(req: Request) -> SearchResult:
    """The parallel plans placer "auto" tries on a captured model (`search_auto_captured`): every dimension
    searched (`search_parallel_plans`), under the pipeline schedules devplace's runtime runs
    (`graph.parallel.RUN_SCHEDULES`): a plan the default returns runs (`devplace run`). PlacerError where the
    request fixes what parallel plans choose themselves (an order, placer settings)."""
    runnable = tuple(k for k in PARALLEL_SCHEDULES if k in RUN_SCHEDULES)
    return search_parallel_plans(replace(req, parallel=ParallelAsk()), runnable, runnable=True)


def search_parallel_plans(req: Request, schedules: tuple[str, ...] = PARALLEL_SCHEDULES,
                          runnable: bool = False) -> SearchResult:
    """Parallel plans for `req` (DESIGN.md section 9b): every dimension `req.parallel` leaves open resolved here
    (dp and pp, `parallel_degrees`; ZeRO 0-3; recomputation none or full, and under "auto" a number of each
    stage's blocks where only full fits, `fewest_blocks`; each of `schedules` on each cut), then
    the nested search `devplace.placers.parallel.search_parallel` on one micro-batch captured at its own size
    (at each count of `parallel_microbatches`, whose degrees are skipped where their lower bound is not below the
    plan kept at an earlier count: `search_parallel`'s `beat`; the full graph: zero bubble needs each backward's B
    and W ops apart; with `runnable`, only plans devplace's runtime runs, `graph.parallel.runtime_gap`). The answer
    places replica 0 (stage s on `plan.replica(0)[s]`) under the plan's pipeline schedule; `parallel` is the
    plan simulated, and meta["parallel"] the plan (`ParallelPlan.to_dict`, what a saved placement replays),
    meta["parallel_search"] what was asked and each plan's step or why it did not fit. PlacerError for a
    request parallel plans cannot answer (a graph file, another placer, an order, placer settings); a
    DevplaceError naming every plan's outcome when none fits."""
    ask, t0 = req.parallel, time.perf_counter()
    assert ask is not None
    flags = "--dp/--pp/--zero/--recompute/--parallel"
    batch = graph_batch(req.graph)
    if req.microbatch_graph is None or batch is None:
        raise PlacerError(f"parallel plans ({flags}) need a model captured here (--model NAME), so that each "
                          "micro-batch is captured at its own size; a graph file cannot be cut into micro-batches")
    given = parallel_conflicts(req)
    if given:
        raise PlacerError(f"parallel plans ({flags}) cut their stages with the {AUTO_PIPELINE} placer in the "
                          f"canonical order and choose their schedule and micro-batches; drop {', '.join(given)}")
    n = req.cluster.num_devices
    dps = parallel_degrees(ask, n, batch)
    fixed = v_schedule(req)
    if fixed is not None:  # a V runs a pipeline: every dp that leaves 2 or more stages
        schedules, dps = (fixed,), tuple(d for d in dps if n // d >= 2)
        if not dps:
            raise PlacerError(f"--schedule {fixed} runs a pipeline of 2 or more stages (two per device, in a V), and "
                              f"the {n} device(s) with {_fixed_degrees(ask)} leave one; use --pp 2 or more")
    # searched on the devices in their canonical order, so that the same GPUs listed otherwise give the same plan
    perm = canonical_order(req.graph, req.cluster)
    canon = reordered(req.cluster, perm)
    kept: tuple[int, CompGraph, ParallelSearch] | None = None
    tried: dict[str, float | str] = {}
    failed: list[str] = []
    for k in parallel_microbatches(batch, n, dps):  # of equal steps the first: the largest micro-batch
        graph = req.graph if k == 1 else req.microbatch_graph(k)[0]
        # a degree of this count whose bound is not below the kept plan's step is skipped (`search_parallel`)
        beat = kept[2].best.step_time_s if kept is not None and kept[2].best is not None else math.inf
        try:
            found = search_parallel(graph, canon, batch=batch, microbatch_size=batch // k, dps=dps,
                                    zeros=ZERO_STAGES if ask.zero is None else (ask.zero,),
                                    recomputes=RECOMPUTE if ask.recompute == "auto" else (ask.recompute,),
                                    schedules=schedules, runnable=runnable, beat=beat)
        except DevplaceError as exc:  # nothing fits at this micro-batch size: another may
            failed.append(f"micro-batches of {batch // k}: {exc}")
            continue
        tried.update((c.label(k),
                      c.step_time_s if c.feasible else (c.note or "over memory")) for c in found.candidates)
        if found.best is not None and found.best.step_time_s < beat:
            kept = (k, graph, found)
    if kept is None:
        raise DevplaceError("; ".join(failed))
    k, graph, found = kept
    assert found.best is not None and found.stage is not None
    one = as_microbatch(graph, found.best.plan.microbatches)
    # the plan on the devices as the cluster lists them, simulated there (the same step, relabelled)
    best = found.best
    if not np.array_equal(perm, np.arange(perm.size)):
        plan = replace(best.plan, devices=tuple(int(perm[d]) for d in best.plan.devices or ()))
        best = simulate_parallel(one, req.cluster, found.stage, plan)
    plan = best.plan
    devices = np.asarray(plan.replica(0), dtype=np.int64)[stage_layout(plan, found.stage)[0]]
    # made by this search, no registered placer (the cut walks the canonical order); the plan is meta["parallel"]
    made_by = MadeBy(PARALLEL_PLACER, CANONICAL_ORDER if plan.pp > 1 else None, req.seed, {}, req.semantics.value)
    meta = {"step_time_s": best.step_time_s, "parallel": plan.to_dict(),
            STAGES_KEY: stages_record(one.ids, found.stage),
            "parallel_search": {"asked": ask.to_dict(), "microbatch_size": batch // k, "tried": tried,
                                "kept": plan.label}}
    placement = Placement(dict(zip(one.ids, devices.tolist(), strict=True)), graph=one.name,
                          cluster=req.cluster.name, meta=meta, schedule=plan.pipeline_schedule(0, True),
                          made_by=made_by)
    log = (Tried("parallel", plan.label, None, best.step_time_s, None, time.perf_counter() - t0),)
    return SearchResult(one, placement, best.as_sim_result(), placement, None, 0, log, best)

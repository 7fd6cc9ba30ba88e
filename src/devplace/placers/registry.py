"""The placer registry and `place()`, the one interface every placer shares.

A placer is a function `(graph, cluster, *, order, seed, **settings) -> np.ndarray` (a device index per
node) registered with `@register(name, uses_order=...)`; `order` is the traversal as node indices. A placer
whose devices are meant to run under a micro-batch schedule (the `pipeline` placer) returns a
`PlacerOutput(devices, schedule)` instead, and `place()` judges it under that schedule. A new placer is one
module in `devplace/placers/` or a subpackage of it: every module there is imported by `placer_names()` (and
by `get_placer` for a name that its own module, `placers/<name with _ for ->.py`, does not register).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from devplace.defaults import (
    AUTO_PIPELINE,
    AUTO_PLACER,
    AUTO_PLACERS,
    AUTO_SCHEDULES,
    DEFAULT_ORDER,
    DEFAULT_PLACER,
    DEFAULT_SEED,
)
from devplace.errors import DevplaceError
from devplace.graph.batch import graph_batch, graph_microbatches
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import Placement
from devplace.graph.semantics import Semantics, semantics_of
from devplace.graph.ties import fold, tie_classes, untied, violations
from devplace.hardware.cluster import Cluster
from devplace.orders import Order, check_order, order_label, traversal_indices
from devplace.orders.auto import candidate_orders, recommend_order
from devplace.placers.memory import NoFitError, memory_needs, no_fit_error
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.result import SimResult
from devplace.sim.schedule import KINDS as SCHEDULE_KINDS
from devplace.sim.schedule import Schedule, ScheduledResult, simulate_schedule
from devplace.units import fmt_bytes


@dataclass(frozen=True, eq=False)
class PlacerOutput:
    """What a placer returns when its devices run under a micro-batch schedule: `devices` (a device index per
    node) and `schedule` (None: the unpipelined step). `place()` checks memory, and records the step time,
    under `schedule`, and puts `schedule.to_dict()` in meta["schedule"]."""

    devices: np.ndarray
    schedule: Schedule | None = None


def as_output(value: np.ndarray | PlacerOutput) -> PlacerOutput:
    """A placer's return value as a PlacerOutput (a bare device array runs unpipelined)."""
    if isinstance(value, PlacerOutput):
        return PlacerOutput(np.asarray(value.devices, dtype=np.int64), value.schedule)
    return PlacerOutput(np.asarray(value, dtype=np.int64))


def simulate_output(graph: CompGraph, cluster: Cluster, devices: np.ndarray, schedule: Schedule | None) -> SimResult:
    """The step of `graph` under `devices` as it runs: under `schedule` when given (a ScheduledResult), else
    unpipelined (the reference model)."""
    if schedule is None:
        return DevplaceModel(graph, cluster).run(devices)
    return simulate_schedule(graph, cluster, devices, schedule)


@dataclass(frozen=True, eq=False)
class FullGraph:
    """The graph a placer's nodes stand for, passed by `place` to placers that take a `full` keyword (the
    learned ones, which judge their answer on it): `graph`, and `expand` (a device per node the placer sees ->
    a device per node of `graph`; the folded graph's classes under the autograd semantics, else the identity)."""

    graph: CompGraph
    expand: Callable[[np.ndarray], np.ndarray]

    @staticmethod
    def same(graph: CompGraph) -> FullGraph:
        """`graph` standing for itself (placed op by op, or native)."""
        return FullGraph(graph, lambda devices: np.asarray(devices, dtype=np.int64))


PlacerFn = Callable[..., np.ndarray | PlacerOutput]
# progress(done, total): placers with long loops accept a `progress` keyword and call it now and then
Progress = Callable[[int, int], None]


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


class PlacerError(DevplaceError):
    """An unknown placer or an unknown or invalid setting."""


@dataclass(frozen=True)
class PlacerSpec:
    """A registered placer: its function, whether it walks the graph in `order`, and its settings."""

    name: str
    func: PlacerFn
    uses_order: bool
    # cheap: one run costs at most some tens of simulations of the graph (list schedulers, greedy, pipeline), so
    # `order="auto"` places under every candidate order and keeps the best under the simulator; not cheap
    # (search and learned placers: anneal, placeto, seq2seq), the order model's rule decides alone
    cheap: bool = False
    # check(**settings): the placer's own checks of its setting values that need no graph (ranges, names),
    # run by `check_settings` so that a study file is refused when it is read, not when its first cell runs
    check: Callable[..., None] | None = None
    # refines(settings with defaults) -> the placer whose placement this one starts from and improves (even-refine:
    # "even"; anneal: its `start`): `place` and `place_expanded` judge that start as they judge this placer and
    # keep it when it is faster, so a refining placer never ends worse than its start as the caller sees it
    refines: Callable[[Mapping[str, Any]], str] | None = None

    def start_placer(self, settings: Mapping[str, Any]) -> str | None:
        """The placer whose placement this one refines under `settings` (None: not a refining placer)."""
        return None if self.refines is None else self.refines({**self.settings, **settings})

    def check_settings(self, settings: Mapping[str, Any]) -> None:
        """Raise the PlacerError the placer would raise for a bad setting value, without placing anything
        (settings not given take their defaults; placers without a `check` accept any value here)."""
        if self.check is None:
            return
        wanted = inspect.signature(self.check).parameters
        self.check(**{k: v for k, v in {**self.settings, **settings}.items() if k in wanted})

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.func) or "").split("\n\n")[0].replace("\n", " ")

    @property
    def settings(self) -> dict[str, Any]:
        """Keyword settings beyond order and seed, with their defaults."""
        params = inspect.signature(self.func).parameters.values()
        return {p.name: p.default for p in params
                if p.kind is inspect.Parameter.KEYWORD_ONLY
                and p.name not in ("order", "seed", "progress", "ties", "full")}

    @property
    def reports_progress(self) -> bool:
        return "progress" in inspect.signature(self.func).parameters

    @property
    def handles_ties(self) -> bool:
        """True when the placer takes `ties` (a tie class per node) and keeps every class on one device
        itself; `place` folds the graph for the others (see `place`'s semantics)."""
        return "ties" in inspect.signature(self.func).parameters


_REGISTRY: dict[str, PlacerSpec] = {}
_LOADED = False


def register(name: str, *, uses_order: bool, cheap: bool = False, check: Callable[..., None] | None = None,
             refines: Callable[[Mapping[str, Any]], str] | None = None) -> Callable[[PlacerFn], PlacerFn]:
    """Class the decorated function as placer `name`. `cheap=True` declares that one run costs at most some
    tens of simulations of the graph, so that `order="auto"` may try every candidate order (see `place`).
    `check` (keyword arguments: settings) raises PlacerError for bad setting values; the placer calls it too.
    `refines(settings)` names the placer whose placement this one starts from (`PlacerSpec.refines`)."""
    def deco(func: PlacerFn) -> PlacerFn:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise RuntimeError(f"placer {name!r} registered twice")
        _REGISTRY[name] = PlacerSpec(name, func, uses_order, cheap, check, refines)
        return func
    return deco


def _raise(name: str) -> None:
    """walk_packages' onerror: it is called inside the `except` of a failed subpackage import, which it would
    otherwise drop silently for an ImportError; re-raise it."""
    raise


def _load_all() -> None:
    """Import every module of `devplace.placers` and its subpackages, so that each `@register` runs. Helper
    modules (this one, memory, common, list_scheduling, rl's trainer...) register nothing and are imported by
    the placers anyway, so there is no list of modules to skip or to include."""
    global _LOADED
    if _LOADED:
        return
    import devplace.placers as pkg

    for mod in sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}.", onerror=_raise)):
        importlib.import_module(mod)
    _LOADED = True


def placer_names() -> list[str]:
    """Names of all registered placers, sorted."""
    _load_all()
    return sorted(_REGISTRY)


def check_auto_placer(settings: Mapping[str, Any]) -> str | None:
    """Placer "auto" takes one setting, `schedule`: "none" (no micro-batches), a schedule kind (pipelines only),
    or absent (both compared); each placer it tries runs at its defaults. Returns the schedule asked for."""
    others = [k for k in settings if k != "schedule"]
    if others:
        raise PlacerError(f"placer {AUTO_PLACER!r} tries {', '.join(AUTO_PLACERS)} and {AUTO_PIPELINE} at their "
                          f"default settings; to give settings ({', '.join(map(repr, others))}), name the placer "
                          "(--placer NAME)")
    schedule = settings.get("schedule")
    kinds = (*AUTO_SCHEDULES, *SCHEDULE_KINDS)
    if schedule is not None and schedule not in kinds:
        raise PlacerError(f"placer {AUTO_PLACER!r}: schedule must be one of {', '.join(kinds)}, got {schedule!r}")
    return schedule


def auto_candidates(graph: CompGraph, schedule: str | None) -> tuple[str, ...]:
    """The placers placer "auto" compares under `schedule` (`check_auto_placer`): `AUTO_PLACERS` unless a
    schedule kind is asked for, and `AUTO_PIPELINE` unless "none" is, when the graph records a batch of at least
    2 samples (a graph of unknown batch is pipelined only when nothing else fits, `best_placer`)."""
    if schedule in SCHEDULE_KINDS:
        return (AUTO_PIPELINE,)
    batch = graph_batch(graph)
    split = schedule is None and graph_microbatches(graph) is None and batch is not None and batch >= 2
    return (*AUTO_PLACERS, AUTO_PIPELINE) if split else AUTO_PLACERS


def best_placer(graph: CompGraph, cluster: Cluster, attempt: Callable[[str, Progress | None], Any],
                step_of: Callable[[Any], float], progress: Progress | None = None,
                schedule: str | None = None) -> Best:
    """`best_of` over `auto_candidates` (placer "auto"). When none fits, no pipeline was among them and none is
    refused ("none"), and the parameters fit, `AUTO_PIPELINE` places the step in micro-batches (tried and times
    record it too); when that does not fit either, one NoFitError for `graph` that gives each placer's reason."""
    reasons: dict[str, str] = {}

    def noting(p: str, sub: Progress | None) -> Any:
        try:
            return attempt(p, sub)
        except NoFitError as exc:
            reasons[p] = exc.reason or str(exc)
            raise

    candidates = auto_candidates(graph, schedule)
    times: dict[str, float] = {}
    try:
        return best_of(candidates, noting, step_of, progress=progress, what="placer", times=times)
    except NoFitError:
        tried: dict[str, Any] = {p: f"NoFitError: {r}" for p, r in reasons.items()}
    if (AUTO_PIPELINE not in candidates and schedule is None
            and memory_needs(graph).params_bytes < float(cluster.memory.sum())):
        t0 = time.perf_counter()
        try:
            out = noting(AUTO_PIPELINE, candidate_progress(progress, len(candidates), len(candidates) + 1,
                                                           f"placer {AUTO_PIPELINE} (none of the others fits)"))
        except NoFitError:
            pass
        else:
            times[AUTO_PIPELINE] = time.perf_counter() - t0
            return Best(AUTO_PIPELINE, out, {**tried, AUTO_PIPELINE: step_of(out)}, times)
    why = "; ".join(f"{p}: {r}" for p, r in reasons.items())
    raise no_fit_error(graph, cluster, AUTO_PLACER, f"none of {', '.join(reasons)} fits ({why})") from None


def auto_settings(placer: str, schedule: str | None) -> dict[str, Any]:
    """The settings placer "auto" gives `placer`: the schedule kind asked for to `AUTO_PIPELINE`, none otherwise."""
    return {"schedule": schedule} if placer == AUTO_PIPELINE and schedule in SCHEDULE_KINDS else {}


def placer_auto_meta(best: Best) -> dict[str, Any]:
    """meta["placer_auto"] of a placement made by placer "auto": the placer kept, each one's step (or its
    NoFitError), the seconds each one's search took (`time_s`) and why."""
    compared = ", ".join(best.tried)
    why = (f"smallest simulated step time of {compared} (placer {AUTO_PLACER!r})"
           if best.name != AUTO_PIPELINE or AUTO_PLACERS[0] not in best.tried or len(best.tried) > len(AUTO_PLACERS)
           else f"none of {', '.join(AUTO_PLACERS)} fits without micro-batches; {AUTO_PIPELINE} runs the step in "
           "micro-batches, which hold the activations of fewer samples at once")
    return {"placer": best.name, "tried": best.tried, "time_s": best.times, "why": why}


def get_placer(name: str) -> PlacerSpec:
    """The registered placer `name`, or a PlacerError listing the valid names.

    The module named like the placer (`m-etf`: `placers/m_etf.py`) is imported first, and every module only
    when that does not register `name`: placing with a classic placer then does not import the learned
    placers' modules, and with them torch (about 3.5 s of CPU here, more than the rest of `devplace place`)."""
    if name == AUTO_PLACER:  # a decision that `place` makes, not a placer to look up
        raise PlacerError(f"placer {AUTO_PLACER!r} (the best of {', '.join(AUTO_PLACERS)}) is not one placer; here "
                          f"name one of: {', '.join(placer_names())}")
    if name not in _REGISTRY and isinstance(name, str) and name.replace("-", "_").isidentifier():
        try:
            importlib.import_module(f"{__package__}.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{name.replace('-', '_')}":  # a missing dependency, not a missing module
                raise
    if name not in _REGISTRY:
        _load_all()
    if name not in _REGISTRY:
        raise PlacerError(f"unknown placer {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def place(graph: CompGraph, cluster: Cluster, *, placer: str = DEFAULT_PLACER, order: Order = DEFAULT_ORDER,
          seed: int = DEFAULT_SEED, progress: Progress | None = None, try_orders: int | None = None,
          try_with: str | None = None, semantics: Semantics | str | None = None, **settings: Any) -> Placement:
    """Place every node of `graph` on a device of `cluster` with `placer`, walking the graph in `order`.

    Settings are the placer's keyword arguments (see `devplace placers`). The result is always
    memory-feasible under the `devplace` simulation model; when the placer finds nothing that fits, a
    NoFitError says how much memory the step needs and what would hold it. `progress(done, total)` is
    called now and then by placers with long loops (greedy, anneal). `order` is an order name, "auto", a
    sequence listing every node id once, or a callable graph -> such a sequence (meta["order"] is then "custom").

    `semantics` (`devplace.graph.semantics`; None: the graph's own, `semantics_of(graph)` -- op by op unless
    the graph says "autograd", as a captured model does): "op-by-op" places every node on its own. "autograd":
    a training step runs each backward and optimizer op on its forward op's device, and each input with its
    first consumer, whatever a placer says, so every tie class of `graph`
    (`devplace.graph.ties.tie_classes`) is one decision. A placer that takes `ties` (m-etf, m-sct, heft,
    greedy, even, even-refine: `PlacerSpec.handles_ties`) places `graph` itself and keeps each class on one
    device (the list schedulers decide a class when they place its first op);
    every other placer -- and one that takes `ties` but finds nothing that fits that way -- places the folded
    graph (`devplace.graph.ties.fold`: one node per class, with the compute and memory of all its ops) and
    every op of a class goes to its class's device (meta["ties"]: "native" or "folded"). Either way the
    placement is simulated and checked on `graph` itself, so the reported step time is the one autograd
    runs. When the placer's view fits but `graph` does not, the placer runs again with the device caps it
    sees lowered in proportion to the overflow (`within_memory`, at most `CAP_RETRIES` times), else
    NoFitError. A graph without ties is placed the same either way. meta["semantics"] records the semantics
    placed under and, where classes were tied, meta["tie_classes"] their number, meta["ties"] how they were
    placed and meta["cap_retries"] the reruns.

    A placer that returns a `PlacerOutput` with a schedule (the `pipeline` placer) is checked, here and in
    every rerun, with `devplace.sim.simulate(..., schedule=)`: meta["step_time_s"] is then the pipelined step
    and meta["schedule"] the schedule (`Schedule.to_dict()`; `schedule_of(placement)` reads it back).

    `order="auto"`: a placer registered `cheap` (`PlacerSpec.cheap`: list schedulers, greedy, contiguous...)
    is placed under every candidate order (`devplace.orders.auto.candidate_orders`: all but `random`, the
    model's ranking first) and the smallest simulated step time is kept; any other placer takes the order the
    shipped recommendation model picks from the graph's features (`devplace.orders.auto`). With
    `try_orders=K` any placer instead runs with each of the model's K most promising orders and keeps the
    placement with the smallest simulated step time (K times the placement time); with `try_with=CHEAP` as
    well, the K orders are tried with the placer CHEAP (at its default settings) and `placer` runs once, with
    the order that did best there: for expensive placers (placeto, seq2seq), at the risk that the cheap
    placer's best order is not theirs. The Placement's meta["order_auto"] records the chosen order and why.
    """
    semantics = semantics_of(graph, semantics)
    if placer == AUTO_PLACER:
        schedule = check_auto_placer(settings)
        best = best_placer(
            graph, cluster,
            lambda p, sub: place(graph, cluster, placer=p, order=order, seed=seed, progress=sub,
                                 try_orders=try_orders, try_with=try_with, semantics=semantics,
                                 **auto_settings(p, schedule)),
            lambda pl: pl.meta["step_time_s"], progress, schedule)
        return best.result.with_meta(placer_auto=placer_auto_meta(best))
    spec = get_placer(placer)
    order = check_order(order, allow_auto=True)
    if try_orders is not None and order != "auto":
        raise PlacerError(f"try_orders (--try) needs order='auto' (--order auto), got order {order_label(order)!r}")
    if try_with is not None and try_orders is None:
        raise PlacerError("try_with (--try-with) names the placer that tries the orders of try_orders (--try K); "
                          "give both")
    if order == "auto":
        return _place_auto(graph, cluster, spec, seed, progress, try_orders, try_with, semantics, settings)
    accepted = spec.settings
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
        raise PlacerError(f"placer {placer!r} has no setting {', '.join(map(repr, unknown))}; its settings: {listed}")
    if float(graph.param_bytes.sum()) > float(cluster.memory.sum()):
        raise no_fit_error(graph, cluster, placer, "the parameters alone exceed the cluster's memory")
    classes = tie_classes(graph) if semantics is Semantics.AUTOGRAD else untied(graph)
    tied = bool(classes.size) and int(classes.max()) + 1 < classes.size
    extra: dict[str, Any] = {"progress": progress} if progress is not None and spec.reports_progress else {}

    takes_full = "full" in inspect.signature(spec.func).parameters

    def runner(target: CompGraph, ties: np.ndarray, full: FullGraph) -> Callable[[Cluster], PlacerOutput]:
        visit = traversal_indices(target, order, seed, cluster=cluster)
        call = {**settings, **extra, **({"ties": ties} if spec.handles_ties else {}),
                **({"full": full} if takes_full else {})}

        def run(seen: Cluster) -> PlacerOutput:
            out = as_output(spec.func(target, seen, order=visit, seed=seed, **call))
            dev = out.devices
            if dev.shape != (target.num_nodes,) or (target.num_nodes and not
                                                    (dev.min() >= 0 and dev.max() < cluster.num_devices)):
                raise RuntimeError(f"placer {placer!r} returned an invalid device array")  # a bug, not a user error
            return out
        return run

    if not tied:
        out = runner(graph, classes, FullGraph.same(graph))(cluster)
        devices = out.devices
        result = simulate_output(graph, cluster, devices, out.schedule)
        if not result.feasible:
            over = ", ".join(f"device {d} by {b:.3g} bytes" for d, b in result.oom.items())
            raise no_fit_error(graph, cluster, placer, f"its best placement is over memory on {over}")
    else:
        # native first where the placer keeps classes together itself (it sees the real dependencies); the
        # folded graph where it does not, or where native placement found nothing that fits
        modes = ("native", "folded") if spec.handles_ties else ("folded",)
        for mode in modes:
            if mode == "native":
                run, expand = runner(graph, classes, FullGraph.same(graph)), np.asarray
            else:
                folding = fold(graph, classes)
                run, expand = (runner(folding.graph, untied(folding.graph), FullGraph(graph, folding.expand)),
                               folding.expand)
            try:
                devices, result, retries = within_memory(graph, graph if mode == "native" else folding.graph,
                                                         cluster, placer, run, expand)
                break
            except NoFitError:
                if mode == modes[-1]:
                    raise
        if violations(graph, devices, classes):  # a native placer that splits a class: a bug, not a user error
            raise RuntimeError(f"placer {placer!r} split a tie class although it takes `ties`")
    placement = Placement.from_array(graph, devices, cluster=cluster.name)
    meta = {"placer": placer, "order": order_label(order) if spec.uses_order else None, "seed": seed,
            "settings": dict(settings), "step_time_s": result.step_time_s, "semantics": semantics.value}
    if isinstance(result, ScheduledResult):
        meta["schedule"] = result.schedule.to_dict()
    if tied:
        meta.update(tie_classes=int(classes.max()) + 1, ties=mode, cap_retries=retries)
    mine = Placement(placement.assignment, graph=graph.name, cluster=cluster.name, meta=meta)
    return no_worse_than_start(
        spec, settings, mine,
        lambda start: place(graph, cluster, placer=start, order=order, seed=seed, semantics=semantics),
        lambda p: p.meta["step_time_s"], relabel_start)


def no_worse_than_start(spec: PlacerSpec, settings: Mapping[str, Any], mine: Any, attempt: Callable[[str], Any],
                        step_of: Callable[[Any], float], relabel: Callable[[Any, Any, dict[str, Any]], Any]) -> Any:
    """The promise of a refining placer (`PlacerSpec.refines`): `mine`, its result as the caller judges it, unless
    `attempt(start)` -- its start placer's result judged the same way (`place` on the same graph, `place_expanded`
    on the same coarsening) -- is faster; then that, relabelled by `relabel(start result, mine, meta)`. A
    refiner searches a view of the step (a folded or coarse graph, caps lowered for memory) and the step as run
    can rank two placements the other way. meta["refined_from"] records the start, its step and which was kept.
    A start that does not fit or runs pipelined (anneal from `pipeline` anneals its devices unpipelined) is not
    compared."""
    start = spec.start_placer(settings)
    if start is None:
        return mine
    try:
        theirs = attempt(start)
    except NoFitError:
        return mine
    if getattr(theirs, "placement", theirs).meta.get("schedule") is not None:
        return mine
    kept = step_of(theirs) < step_of(mine)
    meta = {"placer": start, "step_time_s": step_of(theirs), "refined_step_time_s": step_of(mine),
            "kept": "start" if kept else "refined"}
    return relabel(theirs, mine, meta) if kept else relabel(mine, mine, meta)


def relabel_start(chosen: Placement, mine: Placement, refined_from: dict[str, Any]) -> Placement:
    """`chosen`'s assignment with `mine`'s meta (the placer asked for, its settings) and the judged step time."""
    how = {k: chosen.meta[k] for k in ("ties", "tie_classes", "cap_retries", "full_cap_retries") if k in chosen.meta}
    meta = {**mine.meta, **how, "step_time_s": chosen.meta["step_time_s"], "refined_from": refined_from}
    return Placement(chosen.assignment, graph=chosen.graph, cluster=chosen.cluster, meta=meta)


CAP_RETRIES = 4  # placer reruns with lowered device caps when the graph as run is over memory


def with_caps(cluster: Cluster, caps: np.ndarray) -> Cluster:
    """`cluster` with device d's memory set to caps[d] (same name, speeds and links): what a placer sees when
    it must leave room for memory its own view of the graph does not count."""
    devices = tuple(replace(d, memory_bytes=float(c)) for d, c in zip(cluster.devices, caps, strict=True))
    return Cluster(cluster.name, devices, cluster.link, dict(cluster.links), dict(cluster.meta))


def within_memory(graph: CompGraph, view: CompGraph, cluster: Cluster, placer: str,
                  run: Callable[[Cluster], PlacerOutput], expand: Callable[[np.ndarray], np.ndarray],
                  ) -> tuple[np.ndarray, SimResult, int]:
    """Place `view` (a folded or coarse stand-in for `graph`) with `run(cluster seen)`, map its devices to
    `graph` with `expand`, and simulate `graph` (under the schedule `run` returns, if any); while a device is
    over memory, lower that device's cap to min(cap, the view's simulated peak there) x capacity / the real
    peak there, and place again (at most `CAP_RETRIES` times). Returns (device per node of `graph`, its
    simulation -- a ScheduledResult under a schedule --, the number of retries), or raises NoFitError for
    `graph` on the real `cluster` with the overflow and a suggestion."""
    caps = cluster.memory.astype(np.float64)
    seen = cluster
    for attempt in range(CAP_RETRIES + 1):
        try:
            out = run(seen)
        except NoFitError as exc:
            if attempt == 0:
                raise
            raise no_fit_error(graph, cluster, placer, f"as run, its placement was over memory; with the device "
                               f"caps lowered to {_caps_text(caps)} to make room, it found none "
                               f"({exc.reason or exc})") from exc
        devices = expand(out.devices)
        result = simulate_output(graph, cluster, devices, out.schedule)
        if result.feasible:
            return devices, result, attempt
        if attempt == CAP_RETRIES:
            break
        view_peak = simulate_output(view, seen, out.devices, out.schedule).peak_memory_bytes
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


def schedule_of(placement: Placement) -> Schedule | None:
    """The schedule a placement was made for (meta["schedule"], set by `place` for placers that return one),
    or None for an unpipelined one."""
    doc = placement.meta.get("schedule")
    return Schedule.from_dict(doc) if doc is not None else None


def _caps_text(caps: np.ndarray) -> str:
    return ", ".join(fmt_bytes(max(float(c), 0.0)) for c in caps)


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


def auto_orders(graph: CompGraph, cluster: Cluster, spec: PlacerSpec, try_orders: int | None) -> AutoOrders:
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
        return AutoOrders(candidates, rec.order, f"try all {len(candidates)}",
                          f"placer {spec.name!r} is registered cheap: placed under every candidate order (the "
                          "model's ranking first), kept the smallest simulated step time", base)
    candidates = list(rec.ranking[:try_orders])
    return AutoOrders(candidates, rec.order, f"try {len(candidates)}",
                      f"smallest simulated step time of the model's {len(candidates)} most promising orders", base)


@dataclass(frozen=True)
class Best:
    """What `best_of` keeps: the candidate `name`, its `result`, `tried` (each candidate's step, or its
    NoFitError) and `times` (the seconds each candidate's attempt took)."""

    name: str
    result: Any
    tried: dict[str, Any]
    times: dict[str, float]


def best_of(candidates: Sequence[str], attempt: Callable[[str, Progress | None], Any],
            step_of: Callable[[Any], float], *, progress: Progress | None = None, what: str = "order",
            times: dict[str, float] | None = None) -> Best:
    """The candidate (an order, a placer: `what`) whose `attempt(name, progress)` has the smallest `step_of`;
    ties keep the earlier candidate (the model's higher-ranked order). A candidate whose attempt raises
    NoFitError is recorded in `tried` with the error and skipped; when every one does, the first error is raised
    (any other error, a bad setting say, is the same for every candidate and is raised at once). Each attempt
    gets `progress` scoped to it (`candidate_progress`); its time goes to `times` (given: filled in place)."""
    tried: dict[str, Any] = {}
    times = {} if times is None else times
    best: tuple[str, Any, float] | None = None
    first_error: NoFitError | None = None
    for i, name in enumerate(candidates):
        t0 = time.perf_counter()
        try:
            out = attempt(name, candidate_progress(progress, i, len(candidates), f"{what} {name}"))
        except NoFitError as exc:
            tried[name] = f"{type(exc).__name__}: {exc}"
            first_error = first_error or exc
            continue
        finally:
            times[name] = time.perf_counter() - t0
        step = tried[name] = step_of(out)
        if best is None or step < best[2]:  # strictly smaller only
            best = (name, out, step)
    if best is None:
        assert first_error is not None
        raise first_error
    return Best(best[0], best[1], tried, times)


def _place_auto(graph: CompGraph, cluster: Cluster, spec: PlacerSpec, seed: int, progress: Progress | None,
                try_orders: int | None, try_with: str | None, semantics: Semantics,
                settings: dict[str, Any]) -> Placement:
    """`order="auto"` (see `place`): the orders of `auto_orders` placed (by `try_with` when given), the one
    with the smallest simulated step time kept."""
    auto = auto_orders(graph, cluster, spec, try_orders)
    if not auto.candidates:
        placement = place(graph, cluster, placer=spec.name, order=auto.model_order, seed=seed, progress=progress,
                          semantics=semantics, **settings)
        return placement.with_meta(order_auto={"order": auto.model_order, "mode": auto.mode, **auto.base,
                                               "why": auto.reason})
    trial = get_placer(try_with) if try_with is not None else spec
    trial_settings = settings if trial is spec else {}
    found = best_of(
        auto.candidates,
        lambda order, sub: place(graph, cluster, placer=trial.name, order=order, seed=seed,
                                 progress=sub if trial is spec else None, semantics=semantics,
                                 **trial_settings),
        lambda p: p.meta["step_time_s"], progress=progress)
    why = {"order": found.name, "mode": auto.mode, "tried": found.tried, "time_s": found.times, **auto.base,
           "why": auto.reason}
    best = found.result
    if trial is not spec:
        why.update(mode=f"{auto.mode} with {trial.name}", tried_with=trial.name,
                   why=f"{auto.reason} when placed by {trial.name}")
        best = place(graph, cluster, placer=spec.name, order=found.name, seed=seed, progress=progress,
                     semantics=semantics, **settings)
    return best.with_meta(order_auto=why)

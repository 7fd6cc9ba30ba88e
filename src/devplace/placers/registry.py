"""The placer registry: `register`, `get_placer`, `placer_names`, and the interface of a placer call.

A placer is a function `(graph, cluster, *, order, seed, **settings) -> np.ndarray` (a device index per
node) registered with `@register(name, uses_order=...)`; `order` is the traversal as node indices. A placer
whose devices are meant to run under a micro-batch schedule (the `pipeline` placer) returns a
`PlacerOutput(devices, schedule)` instead, and the search (`devplace.placers.search`, behind `place`) judges it
under that schedule. A new placer is one module in `devplace/placers/` or a subpackage of it: every module
there is imported by `placer_names()` (and by `get_placer` for a name that its own module,
`placers/<name with _ for ->.py`, does not register).
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import types
import typing
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from devplace.defaults import AUTO_PLACER, AUTO_PLACERS
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.sim.schedule import Schedule


@dataclass(frozen=True, eq=False)
class PlacerOutput:
    """What a placer returns when its devices run under a micro-batch schedule: `devices` (a device index per
    node) and `schedule` (None: the unpipelined step). `place()` checks memory, and records the step time,
    under `schedule`, and gives the Placement that `schedule`. `adjust`: where the placer's answer is the start of
    a step that improves it under the simulator (the `pipeline` placer: its dynamic program's split, then the
    simulator judging its candidates and refining the best), that step, which the search runs after the placer
    and judges the output of (Baechi's place -> adjust -> simulate); None: the answer as it is."""

    devices: np.ndarray
    schedule: Schedule | None = None
    adjust: Callable[[], PlacerOutput] | None = None

    def adjusted(self) -> PlacerOutput:
        """The answer after the placer's adjust step (itself where it has none)."""
        return self if self.adjust is None else as_output(self.adjust())


def as_output(value: np.ndarray | PlacerOutput) -> PlacerOutput:
    """A placer's return value as a PlacerOutput (a bare device array runs unpipelined)."""
    if isinstance(value, PlacerOutput):
        return PlacerOutput(np.asarray(value.devices, dtype=np.int64), value.schedule, value.adjust)
    return PlacerOutput(np.asarray(value, dtype=np.int64))


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
    # order_key(graph, visit, settings) -> what of the order the placer's result at `settings` depends on (the
    # pipeline placer: the forward ops' sequence, segment by segment where it cuts at module starts);
    # `order="auto"` places under one of the orders with equal keys only
    order_key: Callable[[CompGraph, np.ndarray, Mapping[str, Any]], Hashable] | None = None
    # quadratic: one run's time grows with the square of the graph (greedy: V x D simulations of up to V ops);
    # placer "auto" leaves it out on graphs of more than AUTO_QUADRATIC_NODES nodes, and says so
    quadratic: bool = False

    def start_placer(self, settings: Mapping[str, Any]) -> str | None:
        """The placer whose placement this one refines under `settings` (None: not a refining placer)."""
        return None if self.refines is None else self.refines({**self.settings, **settings})

    def validate(self, settings: Mapping[str, Any]) -> None:
        """Refuse, without placing anything, settings this placer does not have, values not of the type its
        function declares (int, float, bool, str or a union of them; numbers finite), and values its own check
        refuses (ranges, names, and the upper limit of every setting that scales work: docs/limits.md). What
        `--set`, a study file and a plan's placer_settings are checked with before any work. PlacerError."""
        accepted = self.settings
        unknown = sorted(set(settings) - set(accepted), key=str)
        if unknown:
            listed = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
            raise PlacerError(f"placer {self.name!r} has no setting {', '.join(map(repr, unknown))}; its settings: "
                              f"{listed}")
        hints = typing.get_type_hints(self.func)
        for key, value in settings.items():
            allowed = _scalar_types(hints.get(key))
            if allowed is not None and not any(_is(value, t) for t in allowed):
                names = " or ".join(t.__name__ for t in allowed if t is not type(None))
                raise PlacerError(f"placer {self.name!r} setting {key!r} must be {names}, got {value!r}"[:300])
            if isinstance(value, float) and not math.isfinite(value):
                raise PlacerError(f"placer {self.name!r} setting {key!r} must be a finite number, got {value!r}")
        self.check_settings(settings)

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
    def takes_full(self) -> bool:
        """True when the placer takes `full` (a `FullGraph`: the graph its nodes stand for) to judge its answer
        on the graph that runs (the learned placers)."""
        return "full" in inspect.signature(self.func).parameters

    @property
    def takes_as_run(self) -> bool:
        """True when the placer takes `as_run` (a `FullGraph`: the graph that runs, which the search judges the
        answer on, even under a coarsening) to judge its own candidates there (the `pipeline` placer)."""
        return "as_run" in inspect.signature(self.func).parameters

    @property
    def handles_ties(self) -> bool:
        """True when the placer takes `ties` (a tie class per node) and keeps every class on one device
        itself; `place` folds the graph for the others (see `place`'s semantics)."""
        return "ties" in inspect.signature(self.func).parameters


def _scalar_types(hint: Any) -> tuple[type, ...] | None:
    """The plain types a setting's annotation allows, or None when it is not made of int/float/bool/str/None."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    if not members or not all(m in (int, float, bool, str, type(None)) for m in members):
        return None
    return tuple(members)


def _is(value: Any, t: type) -> bool:
    if t is float:  # an integer is a fine float; a bool is neither
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


_REGISTRY: dict[str, PlacerSpec] = {}
_LOADED = False


def register(name: str, *, uses_order: bool, cheap: bool = False, check: Callable[..., None] | None = None,
             refines: Callable[[Mapping[str, Any]], str] | None = None,
             order_key: Callable[[CompGraph, np.ndarray, Mapping[str, Any]], Hashable] | None = None,
             quadratic: bool = False) -> Callable[[PlacerFn], PlacerFn]:
    """Class the decorated function as placer `name`. `cheap=True` declares that one run costs at most some
    tens of simulations of the graph, so that `order="auto"` may try every candidate order (see `place`).
    `check` (keyword arguments: settings) raises PlacerError for bad setting values; the placer calls it too.
    `refines(settings)` names the placer whose placement this one starts from (`PlacerSpec.refines`);
    `order_key(graph, visit, settings)` what of an order its result depends on (`PlacerSpec.order_key`);
    `quadratic` that its time grows with the square of the graph (`PlacerSpec.quadratic`)."""
    def deco(func: PlacerFn) -> PlacerFn:
        if name in _REGISTRY and _REGISTRY[name].func is not func:
            raise RuntimeError(f"placer {name!r} registered twice")
        _REGISTRY[name] = PlacerSpec(name, func, uses_order, cheap, check, refines, order_key, quadratic)
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

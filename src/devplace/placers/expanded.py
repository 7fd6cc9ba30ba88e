"""Placing a coarsened graph so that its full graph, as autograd runs it, fits: `place_expanded`.

Placers see the coarse graph (a few hundred groups); the step that runs is the full graph. Memory peaks of
the two differ (a coarse group's working set is an estimate), so a coarse placement that fits can be over
memory on the full graph. `place_expanded` checks the expanded placement on the full graph and, when it is
over, places again with lowered device caps (`devplace.placers.registry.within_memory`).

Coarsening can also merge tie classes: a group holding ops of several classes (one layer's forward op and
another's backward op) ties them all together, so a coarse graph of 250 groups may have only a handful of
classes (gpt2-xl: 3, the largest over 16 GB) and no placer can fit it. When placing the given coarsening
raises NoFitError (under the autograd rule), the full graph is coarsened again with `REFINE_FACTOR` times
as many groups (at most `REFINE_STEPS` times): finer groups mix fewer classes.

`order="auto"` for a placer that tries orders (registered cheap, or `try_orders`) compares the orders on the
full graph: each candidate is placed and expanded, and the smallest step of the full graph as run is kept. The
coarse graph's step can rank orders differently (mobilenet_v3_large at 200 groups, 1F1B M=8 on 4xV100-16GB:
the coarse graph's best order ran 9.9 ms on the full graph, topo's 9.3 ms). Where no order fits on its own,
`place` chooses among them on the coarse graph at every lowered cap, as without this comparison (an order
that fits at one cap can be another than at the next: mobilenet_v3_large at batch 384 on 4xV100-16GB with
m-etf).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from devplace.defaults import AUTO_PLACER, DEFAULT_ORDER, DEFAULT_PLACER, DEFAULT_SEED
from devplace.errors import GraphError
from devplace.graph.coarsen import Coarsening, coarsen
from devplace.graph.compgraph import CompGraph
from devplace.graph.placement import Placement
from devplace.graph.semantics import Semantics, semantics_of
from devplace.hardware.cluster import Cluster
from devplace.placers.memory import NoFitError
from devplace.placers.registry import (
    PlacerOutput,
    Progress,
    auto_orders,
    auto_settings,
    best_of,
    best_placer,
    check_auto_placer,
    get_placer,
    no_worse_than_start,
    place,
    placer_auto_meta,
    relabel_start,
    schedule_of,
    within_memory,
)
from devplace.sim.result import SimResult


@dataclass(frozen=True, eq=False)
class ExpandedPlacement:
    """A placement of a full graph made on its coarsening: `coarse` (the placer's output, with its meta),
    `placement` (every op of the full graph), `result` (the simulation of `placement` on the full graph),
    `cap_retries` (how many times the placer ran again with lowered caps for the full graph to fit) and
    `coarsening` (the one `coarse` places: the given one, or a finer one of the full graph, see the module
    docstring)."""

    coarse: Placement
    placement: Placement
    result: SimResult
    cap_retries: int
    coarsening: Coarsening


# a coarsening that fits nowhere under the autograd rule: coarsen again with this many times the groups, at most
# REFINE_STEPS times
REFINE_FACTOR = 4
REFINE_STEPS = 2


def place_expanded(coarsening: Coarsening, full: CompGraph, cluster: Cluster, *, placer: str = DEFAULT_PLACER,
                   order: str = DEFAULT_ORDER, seed: int = DEFAULT_SEED, progress: Progress | None = None,
                   try_orders: int | None = None, try_with: str | None = None, semantics: Semantics | str | None = None,
                   **settings: Any) -> ExpandedPlacement:
    """Place `coarsening.graph` with `devplace.place` (same arguments), expand it to `full` (the graph the
    coarsening was made from) and simulate `full`: the result is never over memory as run on the full graph.

    When the full graph is over memory on some device, the placer runs again seeing that device's cap
    lowered to min(cap, the coarse placement's peak there) x capacity / the full graph's peak there (at most
    `CAP_RETRIES` times);
    if it still does not fit, NoFitError with the memory the step needs, the cluster's and a suggestion.
    `semantics` (None: the full graph's own, `semantics_of(full)`) is the coarse graph's placing semantics
    too; under "autograd" (a captured model's) every backward and optimizer op runs with its forward op, so the
    placement is what autograd runs and `result` is its as-run step time. A placer that returns a schedule
    (`pipeline`) has the full graph simulated under it (`result` is a ScheduledResult, meta["schedule"] kept).
    When that raises NoFitError with fewer groups than the full graph has ops, the full graph is coarsened
    finer and placed again (module docstring); meta["refined_groups"] records the number of groups placed then.
    `order="auto"` that tries orders compares them on the full graph (module docstring; meta["order_auto"]).
    """
    if coarsening.original and coarsening.original != full.name:
        raise GraphError(f"the coarsening was made from graph {coarsening.original!r}, not {full.name!r}; pass the "
                         "full graph it was made from (e.g. Prepared.full with Prepared.coarsening)")
    semantics = semantics_of(full, semantics)
    if placer == AUTO_PLACER:  # each placer judged on the full graph as run
        schedule = check_auto_placer(settings)
        found = best_placer(
            full, cluster,
            lambda p, sub: place_expanded(coarsening, full, cluster, placer=p, order=order, seed=seed, progress=sub,
                                          try_orders=try_orders, try_with=try_with, semantics=semantics,
                                          **auto_settings(p, schedule)),
            lambda ex: ex.result.step_time_s, progress, schedule)
        why, best = placer_auto_meta(found), found.result
        return replace(best, coarse=best.coarse.with_meta(placer_auto=why),
                       placement=best.placement.with_meta(placer_auto=why))
    if order == "auto" and try_with is None:
        auto = auto_orders(coarsening.graph, cluster, get_placer(placer), try_orders)
        if auto.candidates:  # compared on the full graph (module docstring)
            try:
                found = best_of(
                    auto.candidates,
                    lambda o, sub: place_expanded(coarsening, full, cluster, placer=placer, order=o, seed=seed,
                                                  progress=sub, semantics=semantics, **settings),
                    lambda ex: ex.result.step_time_s, progress=progress)
            except NoFitError:
                pass  # no order fits on its own; below, `place` chooses the order again at every lowered cap
            else:
                why = {"order": found.name, "mode": auto.mode, "tried": found.tried, "time_s": found.times,
                       **auto.base, "why": f"{auto.reason} of the full graph"}
                best = found.result
                return replace(best, coarse=best.coarse.with_meta(order_auto=why),
                               placement=best.placement.with_meta(order_auto=why))
    given, refined = coarsening, 0
    while True:
        try:
            coarse, placement, result, retries = _place_on(coarsening, full, cluster, placer, order=order, seed=seed,
                                                           progress=progress, try_orders=try_orders,
                                                           try_with=try_with, semantics=semantics,
                                                           **settings)
            break
        except NoFitError:
            if (refined == REFINE_STEPS or semantics is not Semantics.AUTOGRAD
                    or coarsening.num_groups >= full.num_nodes):
                raise
            refined += 1
            coarsening = coarsen(full, coarsening.num_groups * REFINE_FACTOR)
    if refined:
        meta = {**coarse.meta, "refined_groups": coarsening.num_groups}
        coarse = Placement(coarse.assignment, graph=coarse.graph, cluster=cluster.name, meta=meta)
        placement = Placement(placement.assignment, graph=full.name, cluster=cluster.name, meta=meta)
    mine = ExpandedPlacement(coarse, placement, result, retries, coarsening)
    # a refining placer's start judged on the full graph too: the coarse graph can rank them the other way
    return no_worse_than_start(
        get_placer(placer), settings, mine,
        lambda start: place_expanded(given, full, cluster, placer=start, order=order, seed=seed,
                                     semantics=semantics),
        lambda ex: ex.result.step_time_s,
        lambda chosen, ours, why: replace(chosen, coarse=relabel_start(chosen.coarse, ours.coarse, why),
                                          placement=relabel_start(chosen.placement, ours.placement, why)))


def _place_on(coarsening: Coarsening, full: CompGraph, cluster: Cluster, placer: str,
              **options: Any) -> tuple[Placement, Placement, SimResult, int]:
    """One `place_expanded` on a given coarsening: (coarse placement, full placement, result, cap retries)."""
    coarse_graph = coarsening.graph
    made: list[Placement] = []

    def run(seen: Cluster) -> PlacerOutput:
        p = place(coarse_graph, seen, placer=placer, **options)
        made.append(p)
        # a pipelined coarse placement is judged on the full graph under the same schedule
        return PlacerOutput(p.to_array(coarse_graph, cluster.num_devices), schedule_of(p))

    def expand(coarse_devices: np.ndarray) -> np.ndarray:
        return coarsening.expand(coarse_devices).to_array(full, cluster.num_devices)

    devices, result, retries = within_memory(full, coarse_graph, cluster, placer, run, expand)
    coarse = made[-1]
    meta = {**coarse.meta, "step_time_s": result.step_time_s, "full_cap_retries": retries}
    coarse = Placement(coarse.assignment, graph=coarse.graph, cluster=cluster.name, meta=meta)
    placement = Placement(dict(zip(full.ids, devices.tolist(), strict=True)), graph=full.name,
                          cluster=cluster.name, meta=meta)
    return coarse, placement, result, retries

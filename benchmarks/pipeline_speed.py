"""The `pipeline` placer's time against Alpa's stage DP on the same units, side by side in one run (issue 29).

    PYTHONPATH=$PWD/src:$PWD/benchmarks .venv/bin/python benchmarks/pipeline_speed.py \
        [--models gpt2-xl llama-1b ...] [--clusters 4xV100-16GB] [--microbatches 8] [--order topo] [--repeat 2] \
        [--repeat-fast 10]

For each model of `benchmarks/peers.py` (its batch), cluster and micro-batch count M, the model is captured once,
then again at batch / M (`microbatch_prepared`, every op costed at the micro-batch's size), and in this process:

- alpa, alpa-hetero: `peers.alpa_training_dp` on the units `peers.units_of` cuts (the even placer's cut points:
  where a module call begins), with the first device's costs on every stage (alpa) or each stage's own device's
  (alpa-hetero), as `benchmarks/peers.py` runs them; the units' costs are computed before the clock starts
  ("alpa's units": `units_of` timed on its own, what building them from the graph costs);
- pipeline DP: the placer's dynamic program alone (`_Search.splits` for each way of counting transfers, every
  bound of its grid), on its items and memory table built before the clock starts: the like of alpa's column;
- placer: the registered `pipeline` placer as the search calls it (the micro-batch graph's colocation groups,
  tied, judged on every op: `as_run`) on a fresh copy of the graphs: items, memory table and dynamic program
  from the graph, returning the split its cost model ranks first, nothing simulated;
- adjust: the step the search runs after it (`PlacerOutput.adjust`: the simulator judges the dynamic program's
  candidates on the graph as run and refines the best), and its simulations;
- place_graph: `planning.place_graph(..., placer="pipeline", order=--order, microbatches=M)`, what
  `devplace place --placer pipeline` runs on this graph (placer, adjust and the search's check of the answer);
- the steps (s): of the placer's split and of place_graph's answer simulated as run (over: over memory), and
  of Alpa's split under the same 1F1B schedule.

Each method runs `--repeat` times (what takes milliseconds: `--repeat-fast`) after one untimed run (numba's
compiled code loaded), the least time kept; the placer, its adjust step and place_graph each time on a fresh copy
of the graphs (what is derived from a graph and the outcomes of the splits simulated are kept per graph object,
so a second run on the same graph would simulate almost nothing).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
from collections.abc import Callable

import numpy as np

import peers
from devplace.app.with_torch import prepare_model
from devplace.capture.custom import microbatch_prepared
from devplace.capture.pipeline import Prepared
from devplace.graph.compgraph import CompGraph
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import Cluster
from devplace.orders import traversal_indices
from devplace.placers import PlacerOutput, get_placer
from devplace.placers.pipeline import CANDIDATES, stage_splits
from devplace.placers.registry import FullGraph
from devplace.placers.search import View
from devplace.planning import Placed, place_graph
from devplace.sim import Schedule, simulate
from devplace.sim.count import counting


def least_time(run: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The least wall time of `repeat` timed runs of `run` after an untimed one, and the last run's value."""
    value = run()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = run()
        best = min(best, time.perf_counter() - t0)
    return best, value


def least_fresh(run: Callable[[], tuple[float, object]], repeat: int) -> tuple[float, object]:
    """The least of `repeat` times that `run` measures itself (on fresh graphs) after an untimed run, each after a
    garbage collection (the graphs of the runs before are freed before the clock starts, not during)."""
    runs = []
    for _ in range(repeat + 1):
        gc.collect()
        runs.append(run())
    return min(runs[1:], key=lambda r: r[0])


def step_of(graph: CompGraph, cluster: Cluster, devices: np.ndarray, schedule: Schedule | None) -> str:
    """The step of `devices` simulated under `schedule`, marked where it is over memory."""
    r = simulate(graph, cluster, devices, schedule=schedule)
    return f"{r.step_time_s:.4f}" + ("" if r.feasible else " over")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-xl", "llama-1b", "vit_b_16"], choices=list(peers.MODELS))
    ap.add_argument("--clusters", nargs="+", default=["4xV100-16GB"], choices=list(peers.CLUSTERS))
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8])
    ap.add_argument("--order", default="topo", help="the pipeline placer's order (auto: every order it tells apart)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs of the adjust step and of place_graph")
    ap.add_argument("--repeat-fast", type=int, default=10,
                    help="timed runs of what takes milliseconds (alpa, units, DP, placer): the least of more runs is "
                    "less at the mercy of a loaded machine's scheduler")
    args = ap.parse_args()
    print("| model | cluster | M | units | alpa (s) | alpa-hetero (s) | alpa's units (s) | pipeline DP (s) | "
          "DP / alpa-hetero | placer (s) | placer / alpa-hetero | placer / (units + alpa-hetero) | adjust (s) | "
          "simulations | place_graph (s) | place_graph / alpa-hetero | placer's split (s) | place_graph's answer (s) | "
          "alpa's split (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    spec = get_placer("pipeline")
    for name in args.models:
        model, batch = peers.MODELS[name]
        for cname in args.clusters:
            cluster = peers.CLUSTERS[cname]()
            prepared = prepare_model(model, batch=batch, cluster=cluster)
            for m in args.microbatches:
                if batch % m:
                    continue
                micro = microbatch_prepared(prepared, m)
                frozen = pickle.dumps(micro)
                t_units, units = least_time(lambda: peers.units_of(micro.full, cluster), args.repeat_fast)  # noqa: B023
                p = cluster.num_devices
                first = np.repeat(units.times[:, :1], p, axis=1)
                same = np.full(p, cluster.memory[0])
                t_alpa, bounds = least_time(lambda: peers.alpa_training_dp(
                    first, units.params, units.acts, same, m), args.repeat_fast)  # noqa: B023 - called here
                t_hetero, _ = least_time(lambda: peers.alpa_training_dp(
                    units.times, units.params, units.acts, cluster.memory, m), args.repeat_fast)  # noqa: B023
                schedule = Schedule("1f1b", m, microbatch_graph=True)

                def as_searched(fresh: Prepared) -> tuple[View, np.ndarray]:
                    """The view of a fresh copy the search gives the placer (coarse groups, tied), and its order."""
                    view = View.coarse(fresh.coarsening, fresh.full)
                    view = view.tied(tie_classes(view.graph))
                    return view, traversal_indices(view.graph, args.order, 0, cluster=cluster)  # noqa: B023

                def place_fresh() -> tuple[float, tuple[PlacerOutput, View]]:
                    view, visit = as_searched(pickle.loads(frozen))  # noqa: B023 - called in this iteration
                    t0 = time.perf_counter()
                    out = spec.func(view.graph, cluster, order=visit, seed=0, ties=view.ties,  # noqa: B023
                                    as_run=FullGraph(view.parent.graph, view.expand), microbatches=m)  # noqa: B023
                    return time.perf_counter() - t0, (out, view)

                def adjust_fresh() -> tuple[float, tuple[PlacerOutput, int]]:
                    out, _ = place_fresh()[1]
                    t0 = time.perf_counter()
                    with counting() as count:
                        adjusted = out.adjust()
                    return time.perf_counter() - t0, (adjusted, count.runs)

                def graph_fresh() -> tuple[float, Placed]:
                    fresh = pickle.loads(frozen)  # noqa: B023 - called in this iteration
                    t0 = time.perf_counter()
                    placed = place_graph(fresh.graph, cluster, placer="pipeline", order=args.order,  # noqa: B023
                                         coarsening=fresh.coarsening, full=fresh.full, microbatches=m)  # noqa: B023
                    return time.perf_counter() - t0, placed

                view, visit = as_searched(pickle.loads(frozen))
                found = stage_splits(view.graph, cluster, visit, microbatches=m, ties=view.ties,
                                     as_run=FullGraph(view.parent.graph, view.expand))
                t_dp, _ = least_time(lambda: [search.splits(s, waits, CANDIDATES)
                                              for search, schedules, _ in found.runs  # noqa: B023
                                              for s in schedules for waits in (False, True)], args.repeat_fast)
                t_place, (out, view) = least_fresh(place_fresh, args.repeat_fast)
                t_adjust, (_, sims) = least_fresh(adjust_fresh, args.repeat)
                t_graph, placed = least_fresh(graph_fresh, args.repeat)
                full = view.parent.graph
                own = step_of(full, cluster, view.expand(out.devices), out.schedule)
                alpa_step = "-" if bounds is None else step_of(micro.full, cluster, units.devices(bounds), schedule)
                print(f"| {name} | {cname} | {m} | {units.count} | {t_alpa:.4f} | {t_hetero:.4f} | {t_units:.4f} | "
                      f"{t_dp:.4f} | {t_dp / t_hetero:.1f}x | {t_place:.4f} | {t_place / t_hetero:.1f}x | "
                      f"{t_place / (t_units + t_hetero):.1f}x | "
                      f"{t_adjust:.3f} | {sims} | {t_graph:.3f} | {t_graph / t_hetero:.0f}x | {own} | "
                      f"{placed.result.step_time_s:.4f} | {alpa_step} |", flush=True)


if __name__ == "__main__":
    main()

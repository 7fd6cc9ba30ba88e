"""The `pipeline` placer's time against Alpa's stage DP on the same units, side by side in one run (issue 29).

    PYTHONPATH=$PWD/src:$PWD/benchmarks .venv/bin/python benchmarks/pipeline_speed.py \
        [--models gpt2-xl llama-1b ...] [--clusters 4xV100-16GB] [--microbatches 8] [--order topo] [--repeat 2]

For each model of `benchmarks/peers.py` (its batch), cluster and micro-batch count M, the model is captured once,
then again at batch / M (`microbatch_prepared`, every op costed at the micro-batch's size), and in this process:

- alpa, alpa-hetero: `peers.alpa_training_dp` on the units `peers.units_of` cuts (the even placer's cut points:
  where a module call begins), with the first device's costs on every stage (alpa) or each stage's own device's
  (alpa-hetero), as `benchmarks/peers.py` runs them; the units' costs are computed before the clock starts;
- pipeline: `planning.place_graph(..., placer="pipeline", order=--order, microbatches=M)` on the same micro-batch
  graph (its colocation groups, judged on every op): the placer as a whole, with its dynamic program, the
  simulations of its splits as run and the search's final check of its answer;
- its step and simulations, and the step of Alpa's split simulated as run under the same 1F1B schedule.

Each method runs `--repeat` times after one untimed run (numba's compiled code loaded), the least time kept; the
placer each time on a fresh copy of the graphs (what it derives from a graph and the outcomes of the splits it
simulated are kept per graph object, so a second run on the same graph would simulate almost nothing).
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Callable

import numpy as np

import peers
from devplace.app.with_torch import prepare_model
from devplace.capture.custom import microbatch_prepared
from devplace.planning import Placed, place_graph
from devplace.sim import Schedule, simulate


def least_time(run: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The least wall time of `repeat` timed runs of `run` after an untimed one, and the last run's value."""
    value = run()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = run()
        best = min(best, time.perf_counter() - t0)
    return best, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-xl", "llama-1b", "vit_b_16"], choices=list(peers.MODELS))
    ap.add_argument("--clusters", nargs="+", default=["4xV100-16GB"], choices=list(peers.CLUSTERS))
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8])
    ap.add_argument("--order", default="topo", help="the pipeline placer's order (auto: every order it tells apart)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print("| model | cluster | M | units | alpa (s) | alpa-hetero (s) | pipeline placer (s) | placer / alpa | "
          "placer / alpa-hetero | simulations | placer's step (s) | alpa's step (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        model, batch = peers.MODELS[name]
        for cname in args.clusters:
            cluster = peers.CLUSTERS[cname]()
            prepared = prepare_model(model, batch=batch, cluster=cluster)
            for m in args.microbatches:
                if batch % m:
                    continue
                micro = microbatch_prepared(prepared, m)
                units = peers.units_of(micro.full, cluster)
                p = cluster.num_devices
                first = np.repeat(units.times[:, :1], p, axis=1)
                same = np.full(p, cluster.memory[0])
                t_alpa, bounds = least_time(lambda: peers.alpa_training_dp(
                    first, units.params, units.acts, same, m), args.repeat)  # noqa: B023 - called here
                t_hetero, _ = least_time(lambda: peers.alpa_training_dp(
                    units.times, units.params, units.acts, cluster.memory, m), args.repeat)  # noqa: B023
                frozen = pickle.dumps(micro)

                def place_fresh() -> tuple[float, Placed]:
                    fresh = pickle.loads(frozen)  # noqa: B023 - called in this iteration
                    t0 = time.perf_counter()
                    placed = place_graph(fresh.graph, cluster, placer="pipeline", order=args.order,  # noqa: B023
                                         coarsening=fresh.coarsening, full=fresh.full, microbatches=m)  # noqa: B023
                    return time.perf_counter() - t0, placed

                runs = [place_fresh() for _ in range(args.repeat + 1)][1:]
                t_pipe, placed = min(runs, key=lambda r: r[0])
                schedule = Schedule("1f1b", m, microbatch_graph=True)
                alpa_step = "-"
                if bounds is not None:
                    r = simulate(micro.full, cluster, units.devices(bounds), schedule=schedule)  # type: ignore[arg-type]
                    alpa_step = f"{r.step_time_s:.4f}" + ("" if r.feasible else " over")
                step = placed.result.step_time_s
                print(f"| {name} | {cname} | {m} | {units.count} | {t_alpa:.3f} | {t_hetero:.3f} | {t_pipe:.3f} | "
                      f"{t_pipe / t_alpa:.1f}x | {t_pipe / t_hetero:.1f}x | {placed.simulations} | "
                      f"{step:.4f} | {alpa_step} |", flush=True)


if __name__ == "__main__":
    main()

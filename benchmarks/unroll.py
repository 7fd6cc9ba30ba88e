"""Building a schedule's unrolled step: `CompGraph.from_arrays` (what `devplace.sim.schedule.unroll` uses)
against the same graph built from records with `CompGraph.build`, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/unroll.py [--model gpt2-xl] [--cluster 4xV100-16GB] [--microbatches 32]

For the zoo model's pipeline placement (topo order, 1F1B at M micro-batches): the time to unroll the step
(columns, `from_arrays`), the time `CompGraph.build` takes for the same nodes and edges as records, and the
time of one whole `simulate(..., schedule=)`. Wall-clock seconds, best of 3, this machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from devplace.capture.pipeline import zoo_prepared
from devplace.graph.compgraph import CompGraph
from devplace.hardware.presets import PRESETS
from devplace.orders import traversal_indices
from devplace.placers.pipeline import pipeline_plan
from devplace.sim import Schedule, simulate
from devplace.sim.schedule import pipeline_stages, unroll


def best_of(n: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--cluster", default="4xV100-16GB")
    ap.add_argument("--microbatches", type=int, default=32)
    args = ap.parse_args()
    cluster = PRESETS[args.cluster]()
    g = zoo_prepared(args.model).graph
    s = Schedule("1f1b", args.microbatches)
    order = traversal_indices(g, "topo", 0, cluster=cluster)
    devices = pipeline_plan(g, cluster, order, schedule="1f1b", microbatches=args.microbatches).devices
    stages = pipeline_stages(g, devices, 1)
    u = unroll(g, devices, s, stages).graph
    nodes = [u.node_record(v) for v in range(u.num_nodes)]
    edges = [u.edge_record(e) for e in range(u.num_edges)]
    t_arrays = best_of(3, lambda: unroll(g, devices, s, stages))
    t_build = best_of(3, lambda: CompGraph.build(u.name, nodes, edges))
    t_sim = best_of(3, lambda: simulate(g, cluster, devices, schedule=s))
    print(f"{args.model} ({g.num_nodes} groups), 1f1b M={args.microbatches}: unrolled step of {u.num_nodes} nodes, "
          f"{u.num_edges} edges")
    print("| unroll with from_arrays (s) | CompGraph.build of the same records (s) | build / from_arrays | "
          "one simulate(schedule=) (s) |")
    print("|---:|---:|---:|---:|")
    print(f"| {t_arrays:.3f} | {t_build:.3f} | {t_build / t_arrays:.1f}x | {t_sim:.3f} |")


if __name__ == "__main__":
    main()

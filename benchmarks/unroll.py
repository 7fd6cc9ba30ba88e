"""Building a schedule's unrolled step: `CompGraph.from_arrays` (what `devplace.sim.schedule.unroll` uses)
against the same graph built from records with `CompGraph.build`, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/unroll.py [--model gpt2-xl] [--cluster 4xV100-16GB] [--microbatches 32]
        [--batch 32] [--kinds 1f1b zero-bubble] [--repeat 20]

For the zoo model's pipeline placement (topo order, 1F1B at M micro-batches; the model captured at `--batch`,
by default the zoo's, which M must divide: gpt2-xl's is 4, so M=32 needs `--batch 32`): the time to unroll the step
(columns, `from_arrays`), the time `CompGraph.build` takes for the same nodes and edges as records, and the
time of one whole `simulate(..., schedule=)`. Wall-clock seconds, best of 3, this machine. Then, per schedule
kind of `--kinds` on the same placement: what `simulate_schedule` builds before it simulates (stages, relays,
the unrolled step: "build") and the whole `simulate_schedule`, milliseconds, best of `--repeat` after one untimed
run (the kinds a placement runs alone, one chunk per device; only public functions, so the script runs on older
code too, for before/after).
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
from devplace.sim.schedule import pipeline_stages, relay, simulate_schedule, unroll


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
    ap.add_argument("--batch", type=int, default=None, help="the batch captured (default: the zoo's)")
    ap.add_argument("--kinds", nargs="*", default=[], choices=["gpipe", "1f1b", "zero-bubble"])
    ap.add_argument("--repeat", type=int, default=20, help="timed runs per kind (the least kept)")
    args = ap.parse_args()
    cluster = PRESETS[args.cluster]()
    g = zoo_prepared(args.model, batch=args.batch).graph
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
    if args.kinds:
        print("\n| schedule | unrolled nodes | build: stages + relay + unroll (ms) | simulate_schedule (ms) |")
        print("|---|---:|---:|---:|")
    for kind in args.kinds:
        sk = Schedule(kind, args.microbatches)

        def build(sk: Schedule = sk) -> object:
            st = pipeline_stages(g, devices, 1)
            rel = relay(g, devices, st)
            return unroll(rel.graph, rel.devices, sk, rel.stages, cluster)
        size = build().graph.num_nodes  # untimed: numba's compiled code loaded
        simulate_schedule(g, cluster, devices, sk)
        t_b = best_of(args.repeat, build)
        t_s = best_of(args.repeat, lambda sk=sk: simulate_schedule(g, cluster, devices, sk))
        print(f"| {kind} | {size} | {t_b * 1e3:.2f} | {t_s * 1e3:.2f} |")


if __name__ == "__main__":
    main()

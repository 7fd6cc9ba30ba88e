"""The nested search over parallel plans (`devplace.placers.parallel.search_parallel`) against the hand
configurations of issue 31, all simulated by `devplace.sim.parallel.simulate_parallel` in this run.

    PYTHONPATH=src .venv/bin/python benchmarks/parallel.py [--model llama-1b] [--cluster 2x8xA100-IB]
        [--batch 32] [--microbatch-size 2] [--cache /tmp/devplace-parallel] [--graph colocated|full]

The model is captured once at the micro-batch size (cached as JSON under --cache), costed for the cluster's
device kind and colocated (`capture.pipeline.prepare`; `--graph full` plans every op instead, which keeps the
backward's B and W ops apart, as zero-bubble schedules need: colocation merges them); every plan runs that
graph M = batch / (dp x micro-batch size) times per replica. Hand configurations, as a Megatron-LM or
torchtitan user writes them: pure data parallel with ZeRO-1, and with ZeRO-3 and full recomputation; every
dp x pp (pp >= 2) with 1F1B, no sharding, no recomputation, the stages cut evenly by compute at module
boundaries (`placers.even.even_devices`, accelerate's "balanced").
Printed: each hand configuration's step, memory fit and ratio to the search's answer; the search's answer and
its wall time; every plan the search judged.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from devplace.capture.pipeline import capture_zoo_model, prepare
from devplace.graph.io import load_graph, save_graph
from devplace.graph.parallel import ParallelPlan
from devplace.hardware.cost import cost_devices
from devplace.hardware.presets import PRESETS
from devplace.placers.even import even_devices
from devplace.placers.parallel import as_microbatch, search_parallel, sub_cluster
from devplace.sim.parallel import ParallelResult, simulate_parallel


def hand_configurations(devices: int) -> list[tuple[int, int, str]]:
    """(dp, zero, recompute), pp = devices / dp: pure data parallel with ZeRO-1, and with ZeRO-3 and full
    recomputation; every dp x pp with pp >= 2 without either (on 16 devices the issue's five and pp = 16)."""
    pipelines = [(dp, 0, "none") for dp in range(devices // 2, 0, -1) if devices % dp == 0]
    return [(devices, 1, "none"), (devices, 3, "full"), *pipelines]


def hand(graph, cluster, batch: int, size: int, dp: int, zero: int, recompute: str) -> ParallelResult:
    """A hand configuration: dp replicas of an even pipeline over the other devices."""
    pp = cluster.num_devices // dp
    m = batch // size // dp
    plan = ParallelPlan(dp, pp, m, batch, "1f1b" if pp > 1 else "none", zero=zero, recompute=recompute)
    one = as_microbatch(graph, m)
    stage = (even_devices(one, sub_cluster(cluster, plan.replica(0))) if pp > 1
             else np.zeros(one.num_nodes, dtype=np.int64))
    return simulate_parallel(one, cluster, stage, plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--cluster", default="2x8xA100-IB")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/devplace-parallel"))
    ap.add_argument("--graph", choices=("colocated", "full"), default="colocated",
                    help="plan the colocated groups (default) or every op (keeps B and W apart for zero bubble)")
    args = ap.parse_args()
    cluster = PRESETS[args.cluster]()
    path = args.cache / f"{args.model}-b{args.microbatch_size}.json"
    if path.exists():
        captured = load_graph(path)
    else:
        captured = capture_zoo_model(args.model, batch=args.microbatch_size)
        args.cache.mkdir(parents=True, exist_ok=True)
        save_graph(captured, path)
    device, kinds = cost_devices(cluster)
    prepared = prepare(captured, device=device, kinds=kinds)
    graph = prepared.graph if args.graph == "colocated" else prepared.full
    print(f"{args.model} batch {args.batch} (micro-batches of {args.microbatch_size}) on {args.cluster}: "
          f"{graph.num_nodes} {'colocated groups' if args.graph == 'colocated' else 'ops'}")
    t0 = time.perf_counter()
    found = search_parallel(graph, cluster, batch=args.batch, microbatch_size=args.microbatch_size)
    wall = time.perf_counter() - t0
    best = found.best
    print(f"search: {best.plan.label}: {best.step_time_s * 1e3:.1f} ms, {wall:.1f} s wall, "
          f"{len(found.candidates)} plans judged")
    print("\n| configuration | step (ms) | fits | peak GB (max device) | ratio default / this |")
    print("|---|---|---|---|---|")
    for dp, zero, recompute in hand_configurations(cluster.num_devices):
        r = hand(graph, cluster, args.batch, args.microbatch_size, dp, zero, recompute)
        peak = max(m.total for m in r.memory) / 1e9
        print(f"| {r.plan.label} (even cuts) | {r.step_time_s * 1e3:.1f} | {'yes' if r.feasible else 'no'} | "
              f"{peak:.1f} | {best.step_time_s / r.step_time_s:.3f} |")
    peak = max(m.total for m in best.memory) / 1e9
    print(f"| default: {best.plan.label} | {best.step_time_s * 1e3:.1f} | yes | {peak:.1f} | 1.000 |")
    print("\nplans judged by the search:")
    for c in found.candidates:
        what = c.plan.label if c.plan else f"dp={c.dp}"
        step = f"{c.step_time_s * 1e3:.1f} ms" if c.step_time_s is not None else c.note
        print(f"  {what}: {step}{'' if c.feasible or c.plan is None else ' (over memory)'}")


if __name__ == "__main__":
    main()

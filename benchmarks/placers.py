"""Placer quality and speed, side by side in one run.

Part 1 (quality): generated layered graphs x cluster presets x every placer (sequential placers under
several traversal orders): step time / lower bound, step time / best single device, placement time; then
the geometric mean of step / LB per placer (each placer at its best order per graph, and at `topo`).
Part 2 (speed): placement time on a 10k-op graph for the fast placers, and on 1k ops for `greedy`.

Run: `.venv/bin/python benchmarks/placers.py [--quick]`. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph import load_graph
from devplace.hardware.cluster import load_cluster
from devplace.placers import get_placer, placer_names
from devplace.planning import place_graph
from devplace.sim import DevplaceModel, lower_bound
from devplace.zoo import layered_graph

ORDERS = ("topo", "reversed-topo", "dfs-preorder", "bfs", "critical-path")
SKIP = {"ilp"}  # exact; measured separately on tiny graphs in tests
SETTINGS = {"anneal": {"steps": 3000}}


def suite(quick: bool):
    graphs = [layered_graph(400, width=8, seed=1, name="deep-400"),
              layered_graph(400, width=40, seed=2, name="wide-400"),
              layered_graph(1000, width=32, seed=3, name="mixed-1000")]
    if not quick:
        graphs.append(load_graph("src/devplace/data/example_mlp.json"))
    clusters = ["4xV100-16GB", "8xA100-40GB-NVLink"]
    return graphs, [load_cluster(c) for c in clusters]


def quality(quick: bool) -> None:
    graphs, clusters = suite(quick)
    names = [n for n in placer_names() if n not in SKIP]
    per_placer: dict[str, list[float]] = defaultdict(list)  # best order per (graph, cluster)
    per_placer_topo: dict[str, list[float]] = defaultdict(list)
    print("| graph | cluster | placer | order | step / LB | step / best single | place time (s) |")
    print("|---|---|---|---|---:|---:|---:|")
    for g in graphs:
        for c in clusters:
            # the baselines once per (graph, cluster), not once per placement
            lb = lower_bound(g, c).value_s
            single = DevplaceModel(g, c).best_single_device()[1]
            for name in names:
                orders = ORDERS if get_placer(name).uses_order else ("-",)
                ratios = {}
                for order in orders:
                    try:
                        placed = place_graph(g, c, placer=name, order="topo" if order == "-" else order, seed=0,
                                             **SETTINGS.get(name, {}))
                    except DevplaceError as exc:
                        print(f"| {g.name} | {c.name} | {name} | {order} | no fit | | ({type(exc).__name__}) |")
                        continue
                    step = placed.result.step_time_s
                    ratios[order] = step / lb
                    print(f"| {g.name} | {c.name} | {name} | {order} | {step / lb:.3f} | {step / single:.3f} | "
                          f"{placed.placement_time_s:.2f} |")
                if ratios:
                    per_placer[name].append(min(ratios.values()))
                    per_placer_topo[name].append(ratios.get("topo", ratios.get("-", math.nan)))
    print()
    print("| placer | geomean step / LB, best order | geomean step / LB, topo | cells |")
    print("|---|---:|---:|---:|")
    for name in names:
        best, topo = per_placer[name], per_placer_topo[name]
        if best:
            print(f"| {name} | {math.exp(np.mean(np.log(best))):.3f} | {math.exp(np.nanmean(np.log(topo))):.3f} | "
                  f"{len(best)} |")


def speed() -> None:
    c = load_cluster("8xV100-32GB-NVLink")
    big = layered_graph(10_000, width=100, seed=1)
    small = layered_graph(1_000, width=32, seed=1)
    print()
    print("| placer | graph | cluster | place time (s) | step / LB |")
    print("|---|---|---|---:|---:|")
    cases = [(n, big) for n in ("m-topo", "heft", "contiguous", "partition", "m-etf", "m-sct") if n in placer_names()]
    cases.append(("greedy", small))
    for name, g in cases:
        place_graph(g, c, placer=name)  # warm: numba caches loaded, first-call costs out of the figure
        placed = place_graph(g, c, placer=name)
        step_over_lb = placed.result.step_time_s / placed.bound.value_s
        print(f"| {name} | {g.num_nodes} ops | {c.name} | {placed.placement_time_s:.2f} | {step_over_lb:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer graphs")
    parser.add_argument("--part", choices=("quality", "speed", "all"), default="all")
    args = parser.parse_args()
    if args.part in ("quality", "all"):
        quality(args.quick)
    if args.part in ("speed", "all"):
        speed()


if __name__ == "__main__":
    main()

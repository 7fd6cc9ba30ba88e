"""The `pipeline` placer against the bound and an equal-layer split, under one schedule, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline.py [--models gpt2 ...] [--cluster 4xV100-16GB]
                                                           [--schedule 1f1b] [--microbatches 8]

For each zoo model (captured, costed for a V100, colocated): the pipeline placer's simulated step (topo
order) under the schedule; total work / devices (the bound without the bubble); the ideal pipeline
(M + p - 1) / M times that; an equal-layer split (the transformer blocks split evenly over the devices,
what a user writes by hand; layers found by their module path, e.g. `h.7`, embeddings on the first device,
the head on the last) under the same schedule; and the non-pipelined `contiguous` placement of the same
order. Ratios are of simulated step times, all in this run.
"""

from __future__ import annotations

import argparse
import re
import time

import numpy as np

from devplace.capture.pipeline import zoo_prepared
from devplace.graph.compgraph import CompGraph
from devplace.graph.ties import tie_classes
from devplace.hardware.presets import PRESETS
from devplace.orders import traversal_indices
from devplace.placers import NoFitError, place
from devplace.placers.pipeline import pipeline_plan
from devplace.sim import Schedule, ScheduleError, simulate
from devplace.sim.schedule import FORWARD, op_phases

LAYER = re.compile(r"\.(?:h|layers?|blocks?|block)\.(\d+)[./]")


def equal_layer_split(graph: CompGraph, devices: int) -> np.ndarray:
    """Blocks 0..L-1 on device block * p // L; a tie class without a block goes to the first device if one of
    its forward ops feeds block 0 (embeddings), else to the last (the head)."""
    classes = tie_classes(graph)
    phase = op_phases(graph)
    layer = np.full(graph.num_nodes, -1)
    for v in range(graph.num_nodes):
        found = LAYER.search(graph.ids[v]) or LAYER.search(graph.group[v])
        if found:
            layer[v] = int(found.group(1))
    n_layers = int(layer.max()) + 1
    if n_layers == 0:
        raise SystemExit(f"{graph.name}: no numbered blocks found in the op names")
    feeds_first = set()  # forward ancestors of block 0's forward ops
    todo = [v for v in range(graph.num_nodes) if layer[v] == 0 and phase[v] == FORWARD]
    while todo:
        for u in graph.predecessors(todo.pop()):
            if phase[u] == FORWARD and layer[u] < 0 and u not in feeds_first:
                feeds_first.add(u)
                todo.append(u)
    out = np.empty(graph.num_nodes, dtype=np.int64)
    for c in np.unique(classes):
        members = np.flatnonzero(classes == c)
        blocks = layer[members][layer[members] >= 0]
        if blocks.size:
            d = int(blocks.min()) * devices // n_layers
        else:
            d = 0 if feeds_first.intersection(members.tolist()) else devices - 1
        out[members] = d
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2"])
    ap.add_argument("--cluster", default="4xV100-16GB")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    cluster = PRESETS[args.cluster]()
    p = cluster.num_devices
    m = args.microbatches
    sched = Schedule(args.schedule, m)
    print(f"{args.cluster}, {args.schedule}, M={m}; step times in ms (simulated), ratios side by side")
    print("| model | groups | work/devices | ideal pipeline | pipeline placer | / work | peak GB | equal-layer split "
          "| peak GB | placer vs equal | contiguous (no pipeline) | placer time (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        g = zoo_prepared(name).graph
        order = traversal_indices(g, "topo", 0, cluster=cluster)
        t0 = time.perf_counter()
        plan = pipeline_plan(g, cluster, order, schedule=args.schedule, microbatches=m)
        took = time.perf_counter() - t0
        work = float(g.compute_s.sum() / cluster.speeds.sum())
        try:
            even = simulate(g, cluster, equal_layer_split(g, p), schedule=sched)
        except ScheduleError:  # e.g. t5: encoder and decoder blocks share their numbers
            even = None
        try:
            flat_txt = f"{place(g, cluster, placer='contiguous', order='topo').meta['step_time_s'] * 1e3:.1f}"
        except NoFitError:
            flat_txt = "does not fit"
        assert plan.result.feasible
        if even is None:
            even_txt, even_peak, gain = "not a pipeline", "-", "-"
        else:
            even_txt = f"{even.step_time_s * 1e3:.1f}" + ("" if even.feasible else " (over memory)")
            even_peak = f"{even.peak_memory_bytes.max() / 1e9:.1f}"
            gain = f"{even.step_time_s / plan.step_time_s:.3f}x"
        print(f"| {name} | {g.num_nodes} | {work * 1e3:.1f} | {work * (m + p - 1) / m * 1e3:.1f} | "
              f"{plan.step_time_s * 1e3:.1f} | {plan.step_time_s / work:.3f} | "
              f"{plan.result.peak_memory_bytes.max() / 1e9:.1f} | {even_txt} | {even_peak} | {gain} | {flat_txt} | "
              f"{took:.1f} |")


if __name__ == "__main__":
    main()

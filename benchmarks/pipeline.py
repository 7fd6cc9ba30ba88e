"""The `pipeline` placer against the bound, the even split and an equal-layer split under one schedule, and the
best placement without micro-batches, side by side (issue 12, item 7).

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline.py [--models gpt2-xl llama-1b vit_b_16 ...]
        [--cluster 4xV100-16GB] [--schedule 1f1b] [--microbatches 8] [--flat even,contiguous,m-etf]

Each model is a zoo name (its default batch rounded up to a multiple of M, so that the micro-batches exist) or
a case of benchmarks/beyond_zoo.py (its batch, chosen there so that the step does not fit one 16 GB V100, which
M must divide; captured graphs cached as that script does). The training step is captured, costed for every
device kind of the cluster and colocated; every step time is simulated on the full graph, in this run:

- pipeline placer: `place_prepared(..., placer="pipeline")` with `--order` (default `auto`, which tries every
  order for this cheap placer), as `devplace place --model` runs it: a zoo model's pipeline on one micro-batch
  captured at batch / M (a beyond-zoo case's on its whole step's costs / M), placed on the colocation groups,
  expanded to every op, checked as run, under the schedule; the order it walked is printed; the even and
  equal-layer splits are simulated on the same micro-batch graph;
- work / devices: total work over total speed, the bound no schedule beats; ideal: that times the slots of
  an even pipeline, (M + p - 1) / M;
- even split: `placers.even.even_devices` (equal compute per device at module boundaries, accelerate's
  `balanced` by compute) under the same schedule;
- equal-layer split: the numbered blocks (`h.7`, `layers.3`, `encoder_layer_11`, ...; t5's decoder blocks
  after its encoder's, CLIP's vision tower after its text tower) split evenly over the devices, what a user
  writes by hand (embeddings with the first block they feed, the head on the last device), under the same
  schedule; "not a pipeline" where that split sends activations back to a lower device;
- best without micro-batches: the fastest memory-feasible placement of the `--flat` placers (topo order),
  one step, no schedule.

Times are per sample (the step over the batch), in ms; ratios are of step times.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from beyond_zoo import CASES, captured
from devplace.app.with_torch import place_prepared, prepare_model
from devplace.capture.pipeline import Prepared, prepare
from devplace.graph.compgraph import CompGraph
from devplace.graph.modules import numbered_block
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import Cluster
from devplace.hardware.cost import cost_devices
from devplace.hardware.presets import PRESETS
from devplace.placers import NoFitError
from devplace.placers.even import even_devices
from devplace.planning import place_graph
from devplace.sim import Schedule, ScheduleError, SimResult, simulate
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.schedule import FORWARD, op_phases
from devplace.zoo.models import MODELS


def equal_layer_split(graph: CompGraph, devices: int) -> np.ndarray | None:
    """The numbered blocks, in the order the program first runs them (the encoder's before the decoder's),
    split evenly: block i of L on device i * p // L. A tie class without a block goes with the first block its
    forward ops feed (embeddings), else to the last device (the head, the loss). None without blocks."""
    classes = tie_classes(graph)
    phase = op_phases(graph)
    index: dict[tuple[str, int], int] = {}
    block = np.full(graph.num_nodes, -1)
    for v in range(graph.num_nodes):  # node order: the order of the capture, the program's
        found = numbered_block(graph.group[v]) or numbered_block(graph.ids[v])
        if found:
            block[v] = index.setdefault(found, len(index))
    if not index:
        return None
    device_of = np.arange(len(index)) * devices // len(index)
    feeds = np.full(graph.num_nodes, len(index))  # the first block an op's forward output reaches
    for v in graph.topo_order[::-1].tolist():
        if phase[v] == FORWARD:
            for w in graph.successors(v):
                if phase[w] == FORWARD:
                    feeds[v] = min(feeds[v], block[w] if block[w] >= 0 else feeds[w])
    out = np.empty(graph.num_nodes, dtype=np.int64)
    for c in np.unique(classes):
        members = np.flatnonzero(classes == c)
        blocks = block[members][block[members] >= 0]
        first = int(blocks.min()) if blocks.size else int(feeds[members].min())
        out[members] = device_of[first] if first < len(index) else devices - 1
    return out


def prepared_model(name: str, cluster: Cluster, cache: Path, microbatches: int) -> tuple[Prepared, int]:
    """The prepared step of zoo model or beyond-zoo case `name`, and its batch: a zoo model's default batch
    rounded up to a multiple of `microbatches` (micro-batches must exist), captured with its `ModelRef` so that
    the pipeline is placed on micro-batches captured at their own size; a beyond-zoo case at its own batch, which
    `microbatches` must divide (its pipeline's micro-batches are the whole step's costs / M: no model ref)."""
    kinds = cost_devices(cluster)
    if name in MODELS:
        batch = -(-MODELS[name].batch // microbatches) * microbatches
        return prepare_model(name, batch=batch, cluster=cluster), batch
    cases = {c.name: c for c in CASES}
    if name not in cases:
        raise SystemExit(f"unknown model {name!r}: a zoo model ({', '.join(MODELS)}) or a case of "
                         f"benchmarks/beyond_zoo.py ({', '.join(cases)})")
    if cases[name].batch % microbatches:
        raise SystemExit(f"{name}: its batch of {cases[name].batch} has no {microbatches} equal micro-batches")
    graph, _ = captured(cases[name], cache)
    return prepare(graph, device=kinds[0], kinds=kinds[1]), cases[name].batch


def split_text(result: SimResult | None, ours: float, why: str, per: float) -> tuple[str, str]:
    """(cell in ms per sample, `per` ms per second of step, and ratio to the placer's step) of a split
    simulated under the schedule."""
    if result is None:
        return why, "-"
    cell = f"{result.step_time_s * per:.2f}" + ("" if result.feasible else " (over memory)")
    return cell, f"{result.step_time_s / ours:.3f}x"


def under(full: CompGraph, cluster: Cluster, devices: np.ndarray | None, schedule: Schedule) -> SimResult | None:
    """`devices` simulated under `schedule`, or None when they are no pipeline (or absent)."""
    if devices is None:
        return None
    try:
        return simulate(full, cluster, devices, schedule=schedule)
    except ScheduleError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-xl", "llama-1b", "t5-small", "bert-base", "vit_b_16"])
    ap.add_argument("--cluster", default="4xV100-16GB")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--flat", default="even,contiguous,m-etf", help="placers of the step without micro-batches")
    ap.add_argument("--order", default="auto", help="order of the pipeline placer (auto: the best of every order)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/devplace-beyond-zoo"))
    args = ap.parse_args()
    cluster = PRESETS[args.cluster]()
    p, m = cluster.num_devices, args.microbatches
    print(f"{args.cluster}, {args.schedule}, M={m}; simulated ms per sample; ratios to the pipeline placer's step")
    print("| model | batch | ops | one device | work / devices | ideal | pipeline placer | order | / work | peak GB | "
          "even split | even / placer | equal-layer split | equal-layer / placer | best without micro-batches "
          "| that / placer | placer time (s) |")
    print("|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for name in args.models:
        prepared, batch = prepared_model(name, cluster, args.cache, m)
        t0 = time.perf_counter()
        try:
            placed = place_prepared(prepared, cluster, placer="pipeline", order=args.order,
                                    settings={"schedule": args.schedule, "microbatches": m})
        except NoFitError as exc:  # said so, not compared
            print(f"| {name} | {batch} | {prepared.full.num_nodes} | no pipeline fits memory: {exc.reason} |",
                  flush=True)
            continue
        took = time.perf_counter() - t0
        full = placed.graph  # one micro-batch, captured at batch / M, for a zoo model
        sched = placed.placement.schedule
        ours = placed.result.step_time_s
        assert placed.result.feasible
        per = 1e3 / batch
        work = placed.bound.work_s
        one = DevplaceModel(prepared.full, cluster).run(np.zeros(prepared.full.num_nodes, dtype=np.int64))
        one_txt = (f"{one.step_time_s * per:.1f}" if one.feasible
                   else f"does not fit ({one.peak_memory_bytes[0] / 1e9:.1f} GB)")
        even = under(full, cluster, even_devices(full, cluster), sched)
        even_txt, even_ratio = split_text(even, ours, "not a pipeline", per)
        layers = equal_layer_split(full, p)
        layer_txt, layer_ratio = split_text(under(full, cluster, layers, sched), ours,
                                            "no blocks" if layers is None else "not a pipeline", per)
        flat: list[tuple[float, str]] = []
        for flat_placer in args.flat.split(","):
            try:
                r = place_graph(prepared.graph, cluster, placer=flat_placer, order="topo",
                                coarsening=prepared.coarsening, full=prepared.full).result
                flat.append((r.step_time_s, flat_placer))
            except NoFitError:
                pass
        flat_txt, flat_ratio = ((f"{min(flat)[1]} {min(flat)[0] * per:.2f}", f"{min(flat)[0] / ours:.3f}x") if flat
                                else ("none fits", "-"))
        print(f"| {name} | {batch} | {full.num_nodes} | {one_txt} | {work * per:.2f} | "
              f"{work * (m + p - 1) / m * per:.2f} | {ours * per:.2f} | {placed.order} | {ours / work:.3f} | "
              f"{placed.result.peak_memory_bytes.max() / 1e9:.1f} | {even_txt} | {even_ratio} | {layer_txt} | "
              f"{layer_ratio} | {flat_txt} | {flat_ratio} | {took:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""The nested search over parallel plans (`devplace.placers.parallel.search_parallel`) against the hand
configurations of issue 31, all simulated by `devplace.sim.parallel.simulate_parallel` in this run, on a grid of
models x clusters.

    PYTHONPATH=src .venv/bin/python benchmarks/parallel.py [--models llama-1b,gpt2-xl]
        [--clusters 4xV100-16GB,2x8xA100-IB] [--batch 32] [--microbatch-size 1] [--max-seq-len N]
        [--precision fp32|amp-fp16|amp-bf16] [--cache /tmp/devplace-parallel] [--graph colocated|full] [--detail]
        [--default]

Each model is captured once at the micro-batch size (fake tensors on the meta device, cached as JSON under
--cache) at the zoo's sequence length (llama-1b 2048, gpt2-xl 1024, llama3-8b 8192, llama-13b 4096,
gpt3-1.3b 2048) or `--max-seq-len`, whichever is shorter, in fp32 with Adam or under autocast
(`--precision amp-fp16`: fp16 matrix products, fp32 parameters, Adam states and master weights), then costed
for each cluster's device kind and colocated (`capture.pipeline.prepare`; `--graph full` plans every op
instead, which keeps the backward's B and W ops apart, as zero-bubble schedules need: colocation merges them);
every plan runs that graph M = batch / (dp x micro-batch size) times per replica.

Hand configurations (`hand_configurations`), as a Megatron-LM or torchtitan user writes them, each with and
without full recomputation (per layer, Megatron's `--recompute-granularity full`, torchtitan's full activation
checkpointing): pure data parallel with DDP, ZeRO-1 (Megatron's distributed optimizer) and ZeRO-3 (FSDP);
every dp x pp (pp >= 2) with 1F1B, the stages cut evenly by compute at module boundaries
(`placers.even.even_devices`, accelerate's "balanced"), the stage replicas synchronised by DDP, ZeRO-1 or
FSDP (dp >= 2).

Printed, per (model, cluster): the search's answer, its step, peak memory and wall time, the best hand
configuration that fits and the ratio answer / best hand (below 1: the search is faster), one summary row per
cell for docs/performance.md; with `--detail`, every hand configuration and every plan the search judged; with
`--default`, devplace's default search on the same model, batch and cluster (`devplace place --model`: the
whole batch captured, each micro-batch at its own size, placer auto) against the best hand configuration.
A cell where no plan fits memory says so (the search's error names every candidate's outcome).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from devplace.capture.pipeline import capture_zoo_model, prepare
from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph
from devplace.graph.io import load_graph, save_graph
from devplace.graph.parallel import ParallelPlan
from devplace.hardware.cluster import Cluster
from devplace.hardware.cost import cost_devices
from devplace.hardware.presets import PRESETS
from devplace.placers.even import even_devices
from devplace.placers.parallel import ParallelSearch, as_microbatch, search_parallel, sub_cluster
from devplace.sim.parallel import ParallelResult, simulate_parallel
from devplace.zoo.models import get_spec

PRECISIONS = {"fp32": (None, False), "amp-fp16": ("fp16", True), "amp-bf16": ("bf16", True)}


def hand_configurations(devices: int, microbatches: int) -> list[tuple[int, int, str]]:
    """(dp, zero, recompute), pp = devices / dp, for every dp that divides the devices and the step's
    `microbatches` (batch / micro-batch size): pure data parallel (pp = 1) with ZeRO 0, 1 and 3; every dp x pp
    with pp >= 2 with ZeRO 0, 1 and 3 over each stage's replicas (only 0 when dp = 1); each with and without
    full recomputation."""
    out = []
    for dp in range(devices, 0, -1):
        if devices % dp or microbatches % dp:
            continue
        for zero in (0, 1, 3) if dp > 1 else (0,):
            out += [(dp, zero, "none"), (dp, zero, "full")]
    return out


def hand(graph: CompGraph, cluster: Cluster, batch: int, size: int, dp: int, zero: int,
         recompute: str) -> ParallelResult:
    """A hand configuration: dp replicas of an even 1F1B pipeline over the other devices."""
    pp = cluster.num_devices // dp
    m = batch // size // dp
    plan = ParallelPlan(dp, pp, m, batch, "1f1b" if pp > 1 else "none", zero=zero, recompute=recompute)
    one = as_microbatch(graph, m)
    stage = (even_devices(one, sub_cluster(cluster, plan.replica(0))) if pp > 1
             else np.zeros(one.num_nodes, dtype=np.int64))
    return simulate_parallel(one, cluster, stage, plan)


@dataclass(frozen=True)
class Cell:
    """One (model, cluster) of the grid: the search's answer (None: no plan fits, `error` says why), its wall
    time, and every hand configuration simulated."""

    model: str
    cluster: str
    nodes: int
    found: ParallelSearch | None
    error: str
    search_s: float
    hands: tuple[ParallelResult, ...]

    def best_hand(self) -> ParallelResult | None:
        fits = [h for h in self.hands if h.feasible]
        return min(fits, key=lambda h: h.step_time_s) if fits else None


def peak_gb(result: ParallelResult) -> float:
    """The largest device's memory total, GB."""
    return max(m.total for m in result.memory) / 1e9


def short(plan: ParallelPlan) -> str:
    """A plan in a table cell: "dp=2 pp=4 1f1b M=8 Z1 rc" (ZeRO stage of its first stage, the same for every
    stage; "rc" full recomputation on every stage, "rc=4" the first 4 blocks of each, "rc=4,none" per stage)."""
    kind = "" if plan.pp == 1 else f" {plan.schedule}"
    rc = set(plan.recompute)
    said = "" if rc == {"none"} else " rc" if rc == {"full"} else f" rc={plan.recompute[0]}" if len(rc) == 1 \
        else " rc=" + ",".join(map(str, plan.recompute))
    return f"dp={plan.dp} pp={plan.pp}{kind} M={plan.microbatches} Z{plan.zero[0]}{said}"


def captured(model: str, size: int, seq_len: int | None, precision: str, cache: Path) -> CompGraph:
    """The model's step at `size` samples of `seq_len` tokens, from the cache or captured now (and cached)."""
    dtype, amp = PRECISIONS[precision]
    tail = (f"-s{seq_len}" if seq_len else "") + ("" if precision == "fp32" else f"-{precision}")
    path = cache / f"{model}-b{size}{tail}.json"
    if path.exists():
        return load_graph(path)
    t0 = time.perf_counter()
    graph = capture_zoo_model(model, batch=size, seq_len=seq_len, dtype=dtype, amp=amp)
    print(f"captured {model} ({precision}, {size} x {seq_len} per micro-batch): {graph.num_nodes} ops in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    save_graph(graph, path)
    return graph


def run_cell(model: str, graph: CompGraph, cluster_name: str, batch: int, size: int, which: str) -> Cell:
    """Search and hand configurations of one model on one cluster."""
    cluster = PRESETS[cluster_name]()
    device, kinds = cost_devices(cluster)
    prepared = prepare(graph, device=device, kinds=kinds)
    g = prepared.graph if which == "colocated" else prepared.full
    t0 = time.perf_counter()
    try:
        found, error = search_parallel(g, cluster, batch=batch, microbatch_size=size), ""
    except DevplaceError as exc:
        found, error = None, str(exc)
    wall = time.perf_counter() - t0
    hands = tuple(hand(g, cluster, batch, size, dp, zero, rc)
                  for dp, zero, rc in hand_configurations(cluster.num_devices, batch // size))
    return Cell(model, cluster_name, g.num_nodes, found, error, wall, hands)


def default_row(model: str, cluster_name: str, batch: int, seq_len: int | None, precision: str,
                best: ParallelResult | None) -> str:
    """The row of the default search on the cell (`devplace place --model`, placer auto: pipelines, the parallel
    plans devplace runs, placements without micro-batches, each micro-batch captured at its own size), against the
    best hand configuration that fits."""
    from devplace.app.with_torch import place_prepared, prepare_model

    cluster = PRESETS[cluster_name]()
    dtype, amp = PRECISIONS[precision]
    t0 = time.perf_counter()
    try:
        placed = place_prepared(prepare_model(model, batch=batch, seq_len=seq_len, dtype=dtype, amp=amp,
                                              cluster=cluster), cluster)
    except DevplaceError as exc:
        why = str(exc).splitlines()[0][:80]
        return f"| {model} | {cluster_name} | {why} | - | - | {time.perf_counter() - t0:.1f} | - |"
    wall = time.perf_counter() - t0
    answer = (short(placed.parallel.plan) if placed.parallel is not None else
              str(placed.placement.meta.get("placer_auto", {}).get("placer", placed.placer)))
    step = placed.result.step_time_s
    ratio = f"{step / best.step_time_s:.3f}" if best is not None else "-"
    return (f"| {model} | {cluster_name} | {answer} | {step * 1e3:.1f} | "
            f"{float(placed.result.peak_memory_bytes.max()) / 1e9:.1f} | {wall:.1f} | {ratio} |")


def summary_row(cell: Cell) -> str:
    """The cell's row of docs/performance.md's table."""
    best = cell.best_hand()
    fit = f"{sum(h.feasible for h in cell.hands)}/{len(cell.hands)}"
    hand_text = f"{short(best.plan)} | {best.step_time_s * 1e3:.1f}" if best else "none fits | -"
    if cell.found is None:
        head = f"| {cell.model} | {cell.cluster} | no plan fits | - | - | {cell.search_s:.1f}"
        return f"{head} | {hand_text} | {fit} | - |"
    answer = cell.found.best
    ratio = f"{answer.step_time_s / best.step_time_s:.3f}" if best else "-"
    return (f"| {cell.model} | {cell.cluster} | {short(answer.plan)} | {answer.step_time_s * 1e3:.1f} | "
            f"{peak_gb(answer):.1f} | {cell.search_s:.1f} | {hand_text} | {fit} | {ratio} |")


def detail(cell: Cell) -> None:
    """Every hand configuration and every plan the search judged."""
    print(f"\n{cell.model} on {cell.cluster} ({cell.nodes} nodes planned):")
    if cell.found is None:
        print(f"  search: {cell.error}")
    for h in cell.hands:
        print(f"  hand {short(h.plan)} (even cuts): {h.step_time_s * 1e3:.1f} ms, peak {peak_gb(h):.1f} GB"
              f"{'' if h.feasible else ' (over memory)'}")
    for c in cell.found.candidates if cell.found else ():
        what = short(c.plan) if c.plan else f"dp={c.dp} {c.kind}"
        step = f"{c.step_time_s * 1e3:.1f} ms" if c.step_time_s is not None else c.note
        print(f"  search {what}: {step}{'' if c.feasible or c.plan is None else ' (over memory)'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-1b", help="zoo models, comma-separated")
    ap.add_argument("--clusters", default="2x8xA100-IB", help="cluster presets, comma-separated")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="capture each model at its zoo sequence length or this, whichever is shorter")
    ap.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/devplace-parallel"))
    ap.add_argument("--graph", choices=("colocated", "full"), default="colocated",
                    help="plan the colocated groups (default) or every op (keeps B and W apart for zero bubble)")
    ap.add_argument("--detail", action="store_true", help="print every hand configuration and searched plan")
    ap.add_argument("--default", action="store_true",
                    help="also run devplace's default search (placer auto, the whole batch captured) on each cell")
    args = ap.parse_args()
    size = args.microbatch_size
    print(f"batch {args.batch} in micro-batches of {size}, {args.precision}, {args.graph} graph")
    rows, defaults = [], []
    for model in args.models.split(","):
        seq = get_spec(model).seq_len
        if args.max_seq_len is not None and seq is not None and seq > args.max_seq_len:
            seq = args.max_seq_len
        graph = captured(model, size, seq, args.precision, args.cache)
        for cluster in args.clusters.split(","):
            cell = run_cell(model, graph, cluster, args.batch, size, args.graph)
            rows.append(summary_row(cell))
            print(rows[-1], flush=True)
            if args.default:
                defaults.append(default_row(model, cluster, args.batch, seq, args.precision, cell.best_hand()))
                print(defaults[-1], flush=True)
            if args.detail:
                detail(cell)
    print("\n| model | cluster | search's answer | step (ms) | peak GB | search s | best hand configuration that fits "
          "| its step (ms) | hand configs that fit | answer / best hand |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    print("\n".join(rows))
    if defaults:
        print("\n| model | cluster | default's answer | step (ms) | peak GB | wall s | default / best hand |")
        print("|---|---|---|---:|---:|---:|---:|")
        print("\n".join(defaults))


if __name__ == "__main__":
    main()

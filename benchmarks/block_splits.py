"""Is the pipeline placer's 1F1B split the best one the export can run? Every split at block starts, simulated.

On a captured model the `pipeline` placer cuts stages only where devplace's pipeline export can cut (a block
start, `cuts=blocks`). This script enumerates every split of the placer's item sequence into one stage per
device at those places, under each device order the placer tries (`device_orders`), simulates each under 1F1B
at M micro-batches on the micro-batch graph (as `benchmarks/peers.py` does), and prints the best feasible one
beside the placer's answer. Exhaustive, so only for models with a few dozen block starts.

    PYTHONPATH=$PWD/src:$PWD/benchmarks .venv/bin/python benchmarks/block_splits.py gpt2 mixed-slow-first 8
"""

from __future__ import annotations

import argparse
import itertools
import time

import peers
from devplace.app.with_torch import place_prepared, prepare_model
from devplace.capture.custom import microbatch_prepared
from devplace.errors import DevplaceError
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import op_times, step_times
from devplace.placers.pipeline import _items, _Search, device_orders
from devplace.sim import Schedule
from devplace.sim.schedule import simulate_schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=list(peers.MODELS))
    ap.add_argument("cluster", choices=list(peers.CLUSTERS))
    ap.add_argument("microbatches", type=int)
    args = ap.parse_args()
    model, batch = peers.MODELS[args.model]
    cluster = peers.CLUSTERS[args.cluster]()
    m = args.microbatches
    prepared = prepare_model(model, batch=batch, cluster=cluster)
    t0 = time.perf_counter()
    placed = place_prepared(prepared, cluster, placer="pipeline", settings={"schedule": "1f1b", "microbatches": m})
    placer_s = time.perf_counter() - t0
    graph = microbatch_prepared(prepared, m).full
    items = _items(graph, graph.topo_order, tie_classes(graph), op_times(graph, cluster), step_times(graph, cluster),
                   "blocks")
    n = items.nodes.shape[0]
    stops = [int(s) for s in items.stops if 0 < s < n and not items.blocked[s]]
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    count, t0 = 0, time.perf_counter()
    for order in device_orders(graph, cluster):
        search = _Search(graph, cluster, items, order)
        schedule = Schedule("1f1b", m, microbatch_graph=True, device_order=order)
        for cuts in itertools.combinations(stops, cluster.num_devices - 1):
            try:
                r = simulate_schedule(graph, cluster, search.devices((*cuts, n)), schedule)
            except DevplaceError:  # a tie class forced across the stage order: not a pipeline
                continue
            count += 1
            if r.feasible and (best is None or r.step_time_s < best[0]):
                best = (r.step_time_s, cuts, order)
    took = time.perf_counter() - t0
    print(f"{args.model} on {args.cluster}, 1f1b M={m}: {n} items, {len(stops)} block starts, {count} splits "
          f"simulated in {took:.0f} s")
    print(f"  pipeline placer: {placed.result.step_time_s:.4f} s ({placer_s:.1f} s with its captures)")
    if best is None:
        print("  no split at block starts fits memory")
    else:
        print(f"  best split at block starts: {best[0]:.4f} s (cuts {best[1]}, device order {best[2]}); placer / "
              f"best = {placed.result.step_time_s / best[0]:.4f}")


if __name__ == "__main__":
    main()

"""Simulator speed: the compiled `devplace` model (and the `placeto` model) on layered DAGs of 1k, 10k
and 100k ops under random placements on 4 devices, and, side by side in the same run, the plain-Python
heapq reference of the same model (tests/reference_sim.py) on the 1k graph.

Run: `.venv/bin/python benchmarks/sim_speed.py` (or `make bench`). Prints a Markdown table.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from devplace.hardware.cluster import load_cluster
from devplace.sim import DevplaceModel, simulate
from devplace.sim.placeto import PlacetoModel
from devplace.zoo import layered_graph
from reference_sim import reference_simulate


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    cluster = load_cluster("4xV100-16GB")
    rng = np.random.Generator(np.random.PCG64(0))
    rows = []
    ref_1k = None
    for n in (1_000, 10_000, 100_000):
        g = layered_graph(n, width=max(8, int(n ** 0.5)), seed=1)
        devs = rng.integers(0, cluster.num_devices, n)
        model = DevplaceModel(g, cluster)
        model.run(devs)  # warm: compiled code loaded from the on-disk cache
        repeats = {1_000: 200, 10_000: 30, 100_000: 7}[n]
        t_run = median_time(lambda: model.run(devs), repeats)  # noqa: B023
        t_simulate = median_time(lambda: simulate(g, cluster, devs), max(3, repeats // 4))  # noqa: B023
        placeto = PlacetoModel(g, cluster)
        placeto.run(devs)
        t_placeto = median_time(lambda: placeto.run(devs), repeats)  # noqa: B023
        row = {"ops": n, "edges": g.num_edges, "run_ms": t_run * 1e3, "simulate_ms": t_simulate * 1e3,
               "ops_per_s": n / t_run, "placeto_ms": t_placeto * 1e3}
        if n == 1_000:
            nodes = [g.node_record(v) for v in range(n)]
            edges = [g.edge_record(e) for e in range(g.num_edges)]
            links = {(a, b): (cluster.bandwidth[a, b], cluster.latency[a, b])
                     for a in range(cluster.num_devices) for b in range(cluster.num_devices) if a != b}
            placement = {g.ids[v]: int(devs[v]) for v in range(n)}
            ref = reference_simulate(nodes, edges, cluster.speeds.tolist(), links, placement)
            assert abs(ref.step_time_s - model.run(devs).step_time_s) < 1e-12, "reference and compiled disagree"
            speeds = cluster.speeds.tolist()
            ref_1k = median_time(lambda: reference_simulate(nodes, edges, speeds, links, placement), 15)  # noqa: B023
            row["reference_ms"] = ref_1k * 1e3
        rows.append(row)
    print("| ops | edges | DevplaceModel.run (ms, median) | simulate() incl. set-up (ms) | ops/s | "
          "PlacetoModel.run (ms) | plain-Python reference (ms) | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ref = f"{r['reference_ms']:.1f}" if "reference_ms" in r else ""
        up = f"{r['reference_ms'] / r['run_ms']:.0f}x" if "reference_ms" in r else ""
        print(f"| {r['ops']:,} | {r['edges']:,} | {r['run_ms']:.3f} | {r['simulate_ms']:.3f} | "
              f"{r['ops_per_s']:,.0f} | {r['placeto_ms']:.3f} | {ref} | {up} |")


if __name__ == "__main__":
    main()

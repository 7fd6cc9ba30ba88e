"""Study runner throughput: cells per minute of a cut of the `quick` preset, with 1 and 2 workers, on the local
process pool and on a local Ray cluster, side by side in one run.

The cut: cifar10/0, ptb/0 and nmt/0 (100 groups, as in `quick`), orders topo, bfs, dfs-preorder and
lexicographic, seed 0, the four `quick` placers (placeto 10 episodes, greedy, m-topo, contiguous): 48 cells.
Graphs are captured once before the timed runs (into a shared cache), so the figures are for running cells,
including each backend's start-up (process pool or Ray cluster, torch import in every worker). "time in
cells" sums the cells' wall times over workers: when it grows with the worker count, the workers are
competing for cores (other processes on the machine).

Run: `.venv/bin/python benchmarks/study_throughput.py [--out DIR]`. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from devplace.study import read_cells, run_study
from devplace.study.spec import parse_study

STUDY = """
name = "throughput"
graphs = ["cifar10/0", "ptb/0", "nmt/0"]
max_nodes = 100
clusters = ["3xGPU-placeto"]
sim_model = "placeto"
orders = ["topo", "bfs", "dfs-preorder", "lexicographic"]
seeds = [0]
[[placers]]
name = "placeto"
settings = { episodes = 10 }
[[placers]]
name = "greedy"
[[placers]]
name = "m-topo"
[[placers]]
name = "contiguous"
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="devplace-study-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "graphs"
    spec = parse_study(STUDY, base_dir=work, source="throughput")
    # capture the three graphs once, outside the timings
    warm = parse_study(STUDY.replace('name = "placeto"\nsettings = { episodes = 10 }', 'name = "single"'),
                       base_dir=work, source="warm")
    run_study(warm, work / "warm.sqlite", workers=2, cache_dir=cache)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for backend in ("local", "ray"):
        for workers in (1, 2):
            db = work / f"{backend}-{workers}.sqlite"
            for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
                f.unlink(missing_ok=True)
            t0 = time.perf_counter()
            s = run_study(spec, db, backend=backend, workers=workers, cache_dir=cache)
            wall = time.perf_counter() - t0
            # seconds spent inside cells, summed over workers: it grows when workers compete for cores
            busy = sum(r["wall_s"] for r in read_cells(db))
            rows.append((backend, workers, s.ran, s.failed, wall, 60.0 * s.ran / wall, busy))
    base = rows[0][5]
    print(f"load average before: {load}")
    print("| backend | workers | cells | failed | wall (s) | cells / min | vs local x1 | time in cells (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for backend, workers, ran, failed, wall, cpm, busy in rows:
        print(f"| {backend} | {workers} | {ran} | {failed} | {wall:.1f} | {cpm:.1f} | {cpm / base:.2f} | {busy:.1f} |")
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

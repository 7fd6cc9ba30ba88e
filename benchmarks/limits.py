"""`devplace place` at the documented size limits (docs/limits.md): this tree, and another source tree beside it.

    python benchmarks/limits.py [--before /path/to/other/src] [--timeout 60]

Cases (issue 32, item 11): a 3-node chain on a cluster of 1,024 devices (`MAX_DEVICES`), and a 600-node random
DAG with about 135,000 edges (each pair of nodes joined with probability 0.75, seed 0) on 4xV100-16GB, both with
the default placer and order. Each runs as its own `python -m devplace place ... --quiet` process (the numba
cache warmed by a first run), the trees alternately so that machine load hits both alike; prints the wall and
CPU seconds of each (">" the timeout where it did not finish) and their ratio. The budget is 30 s a case. Make
the other tree with e.g. `git archive <commit> src | tar -x -C /tmp/before`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "src"


def write_cases(folder: Path) -> dict[str, list[str]]:
    """The input files of each case in `folder`; case name -> `devplace place` arguments."""
    chain = {"format": "devplace.graph/1", "name": "chain3",
             "nodes": [{"id": v, "compute_s": 1e-3, "output_bytes": 1000} for v in "abc"],
             "edges": [{"src": "a", "dst": "b", "bytes": 1000}, {"src": "b", "dst": "c", "bytes": 1000}]}
    devices = [{"name": f"d{i}", "memory_bytes": 1e10} for i in range(1024)]
    cluster = {"format": "devplace.cluster/1", "name": "1024", "devices": devices,
               "link": {"bandwidth_Bps": 1e10, "latency_s": 1e-5}}
    rng = random.Random(0)
    nodes = [{"id": f"n{i}", "compute_s": 1e-3 * (1 + rng.random()), "output_bytes": 10_000} for i in range(600)]
    edges = [{"src": f"n{i}", "dst": f"n{j}", "bytes": 10_000} for i in range(600) for j in range(i + 1, 600)
             if rng.random() < 0.75]
    dense = {"format": "devplace.graph/1", "name": "dense600", "nodes": nodes, "edges": edges}
    for name, doc in (("chain3.json", chain), ("c1024.json", cluster), ("dense600.json", dense)):
        (folder / name).write_text(json.dumps(doc))
    return {"3 nodes, 1,024 devices": [str(folder / "chain3.json"), "-c", str(folder / "c1024.json")],
            f"600 nodes, {len(edges):,} edges, 4 devices": [str(folder / "dense600.json"), "-c", "4xV100-16GB"]}


def once(src: Path, args: list[str], timeout: float) -> tuple[float, float, bool]:
    """(wall s, CPU s of the child, finished) of one `devplace place ARGS --quiet` with `src` on the path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "devplace", "place", *args, "--quiet"], env=env, check=True,
                       stdout=subprocess.DEVNULL, timeout=timeout)
        done = True
    except subprocess.TimeoutExpired:
        done = False
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="the other tree's src/ folder")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take")
    args = ap.parse_args()
    trees = ([("before", args.before)] if args.before else []) + [("this tree", HERE)]
    with tempfile.TemporaryDirectory() as tmp:
        cases = write_cases(Path(tmp))
        first = next(iter(cases.values()))
        for _, src in trees:  # compile numba's cache of each tree once, on the small case
            once(src, first, args.timeout)
        print("| case | " + " | ".join(f"{t} wall s (CPU s)" for t, _ in trees) + " |")
        print("|---|" + "---|" * len(trees))
        for case, place_args in cases.items():
            cells = []
            for _, src in trees:
                wall, cpu, done = once(src, place_args, args.timeout)
                cells.append(f"{wall:.1f} ({cpu:.1f})" if done else f"> {args.timeout:.0f} (killed)")
            print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

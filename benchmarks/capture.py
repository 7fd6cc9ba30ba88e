"""Capture cost per zoo model: wall time and peak RSS of capturing the training step (each model in a fresh
process, so RSS is that model's alone, torch import included), node counts after capture, colocation and
coarsening to 300 groups, and the analytic step time on one V100.

Run: `.venv/bin/python benchmarks/capture.py [--models a,b]`. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch  # noqa: F401  (imported before the clock starts: the figure is capture, not import)
from devplace.capture.pipeline import capture_zoo_model, prepare
from devplace.graph.coarsen import coarsen
t0 = time.perf_counter()
g = capture_zoo_model(sys.argv[1])
t_capture = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
p = prepare(g)
t_colocate = time.perf_counter() - t0
t0 = time.perf_counter()
c = coarsen(p.full, 300)
t_coarsen = time.perf_counter() - t0
print(json.dumps({"ops": g.num_nodes, "edges": g.num_edges, "capture_s": t_capture, "rss_bytes": rss,
                  "groups": p.graph.num_nodes, "colocate_s": t_colocate, "coarse": c.graph.num_nodes,
                  "coarsen_s": t_coarsen, "compute_s": float(p.full.compute_s.sum()),
                  "params": g.meta["capture"]["params"]}))
"""


def main() -> None:
    from devplace.zoo.models import model_names

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(model_names()))
    args = parser.parse_args()
    print("| model | params | ops | edges | capture (s) | peak RSS (GB) | colocation groups | cost + colocate (s) "
          "| coarsen to 300 (s) | analytic step on 1 V100 (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1][:80]} |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['params'] / 1e6:,.1f} M | {r['ops']:,} | {r['edges']:,} | {r['capture_s']:.1f} | "
              f"{r['rss_bytes'] / 1e9:.2f} | {r['groups']:,} | {r['colocate_s']:.1f} | {r['coarsen_s']:.2f} | "
              f"{r['compute_s'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()

"""What placeto's network costs per episode, counted, against what this machine can do (issue 13 item 1).

For graph 0 of each study family coarsened to 300 groups on `3xGPU-placeto` (the issue's setting), one
rollout step of the default policy (8 rounds of message passing each way, width 32) is counted with
torch's FlopCounterMode; the sparse sum-aggregation, which that counter books as a dense [2V, 2V] product,
is counted as nnz x d adds per round instead. An episode is V rollout steps plus the REINFORCE update,
which re-embeds the same V states with gradients (forward + backward, about 3x the forward). Then a
measured dense fp32 matmul rate (one large product, all threads), for scale, and the theoretical peak from
`--ghz`, `--cores`, `--flops-per-cycle` (2 x 256-bit FMA = 32 fp32 FLOPs per cycle per core on AVX2).

Run: `.venv/bin/python benchmarks/placeto_flops.py` (about 30 s).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from devplace.capture.pipeline import family_graph
from devplace.hardware.cluster import load_cluster
from devplace.placers.rl.placeto import PlacetoHyper, _GraphContext, new_policy


def step_flops(family: str, cluster: str) -> tuple[int, int, float]:
    """(V, E, FLOPs of one rollout step) for graph 0 of `family` at 300 groups."""
    g = family_graph(family, 0, max_nodes=300)
    hyper = PlacetoHyper()
    ctx = _GraphContext(g, load_cluster(cluster), hyper)
    policy = new_policy(ctx.num_features, ctx.nd, hyper, 0)
    devices = np.zeros(ctx.n, dtype=np.int64)
    start_s = ctx.model.run(devices).start_s
    x = torch.from_numpy(ctx.features(devices, start_s, np.zeros(ctx.n, np.float32), 0))[None]
    masks = torch.from_numpy(ctx.pools(0, start_s)[None].astype(np.float32))
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        policy(x, ctx.adj, torch.zeros(1, dtype=torch.long), masks)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    dense = counter.get_total_flops() - counts.get("aten.mm", 0)  # aten.mm here is the sparse product
    return ctx.n, ctx.num_edges, dense + hyper.rounds * ctx.adj.adj._nnz() * hyper.hidden


def matmul_rate(n: int = 2048, repeats: int = 5) -> float:
    """Best measured fp32 GFLOP/s of an n x n matmul over `repeats` tries."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="3xGPU-placeto")
    ap.add_argument("--ghz", type=float, default=2.45)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--flops-per-cycle", type=int, default=32)
    ap.add_argument("--target", type=float, default=10.0, help="episodes per second asked for")
    args = ap.parse_args()
    peak = args.ghz * args.cores * args.flops_per_cycle
    print(f"theoretical fp32 peak: {peak:.0f} GFLOP/s; measured 2048^2 matmul: {matmul_rate():.0f} GFLOP/s\n")
    print("| graph | V | E | MFLOP / step | rollout GFLOP | update GFLOP | episode GFLOP | "
          f"GFLOP/s for {args.target:g} ep/s | / peak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for family in ("cifar10", "ptb", "nmt"):
        v, e, f = step_flops(family, args.cluster)
        rollout, update = v * f / 1e9, 3 * v * f / 1e9
        need = args.target * (rollout + update)
        print(f"| {family}-0.coarse300 | {v} | {e} | {f / 1e6:.1f} | {rollout:.2f} | {update:.2f} | "
              f"{rollout + update:.2f} | {need:.0f} | {need / peak:.2f}x |")


if __name__ == "__main__":
    main()

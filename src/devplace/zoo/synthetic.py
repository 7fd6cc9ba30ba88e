"""Synthetic graphs for benchmarks and tests: random layered DAGs with seeded sizes."""

from __future__ import annotations

import numpy as np

from devplace.graph.compgraph import CompGraph


def layered_graph(num_nodes: int, *, width: int = 32, fan_in: int = 2, seed: int = 0,
                  name: str | None = None) -> CompGraph:
    """A DAG of `num_nodes` ops in layers of `width`; each op of layer i > 0 reads `fan_in` distinct ops of
    layer i-1 (and, with probability 0.1, one op of an earlier layer: a skip edge). Compute times are
    log-uniform in [10 µs, 1 ms], outputs in [64 kB, 16 MB], 10% of ops hold 1-100 MB of parameters."""
    rng = np.random.Generator(np.random.PCG64(seed))
    compute = np.exp(rng.uniform(np.log(1e-5), np.log(1e-3), num_nodes))
    out = np.round(np.exp(rng.uniform(np.log(64e3), np.log(16e6), num_nodes)))
    params = np.where(rng.random(num_nodes) < 0.1, np.round(rng.uniform(1e6, 1e8, num_nodes)), 0.0)
    nodes = [{"id": f"op{v}", "op": "synthetic", "kind": "forward", "compute_s": float(compute[v]),
              "output_bytes": float(out[v]), "param_bytes": float(params[v])} for v in range(num_nodes)]
    edges = []
    for v in range(width, num_nodes):
        layer_start = (v // width) * width
        prev = np.arange(layer_start - width, layer_start)
        srcs = set(rng.choice(prev, size=min(fan_in, width), replace=False).tolist())
        if layer_start >= 2 * width and rng.random() < 0.1:
            srcs.add(int(rng.integers(0, layer_start - width)))
        for u in sorted(srcs):
            edges.append({"src": f"op{u}", "dst": f"op{v}", "bytes": float(out[u])})
    return CompGraph.build(name or f"layered-{num_nodes}-w{width}-s{seed}", nodes, edges)

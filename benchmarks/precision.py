"""Precision-aware analytic costs vs the precision-blind ones: single-device step time of zoo models.

For each model and precision (fp32; bf16 = parameters and inputs cast; amp-bf16 / amp-fp16 = autocast to
that dtype with fp32 parameters) the training step is captured once and costed twice on one device of each
kind (V100 SXM2, A100 SXM4):

- blind: every op's FLOPs at the device's `peak_flops` (the BF16/FP16 tensor-core peak), which is what the
  analytic model did before it read the op's dtype (reproduced here by clearing the per-precision peaks);
- aware: each matrix op at the peak of its own precision (`peak_flops_for`).

It prints the simulated single-device step time (every op on device 0, as `devplace place --placer single`)
and the aware / blind ratio. Usage: `python benchmarks/precision.py [model ...]` (default inception_v3 gpt2).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np

from devplace.capture.pipeline import capture_zoo_model, prepare
from devplace.hardware.cluster import PRECISION_PEAK_KEYS, Cluster
from devplace.hardware.presets import PRESETS
from devplace.sim import simulate

CLUSTERS = ("8xV100-32GB-NVLink", "8xA100-40GB-NVLink")
PRECISIONS = {"fp32": {"dtype": "fp32"}, "bf16": {"dtype": "bf16"}, "amp-bf16": {"amp": True},
              "amp-fp16": {"amp": True, "dtype": "fp16"}}


def blind(cluster: Cluster) -> Cluster:
    """`cluster` with the per-precision peaks cleared: every op costed at `peak_flops`."""
    devs = tuple(replace(d, **dict.fromkeys(PRECISION_PEAK_KEYS, 0.0)) for d in cluster.devices)
    return Cluster(cluster.name, devs, cluster.link, dict(cluster.links), dict(cluster.meta))


def single_step_s(graph, cluster: Cluster) -> tuple[float, bool]:
    prepared = prepare(graph, device=cluster.devices[0])
    res = simulate(prepared.full, cluster, np.zeros(prepared.full.num_nodes, dtype=np.int64))
    return res.step_time_s, bool(res.feasible)


def main(models: list[str]) -> None:
    print(f"{'model':<14} {'precision':<9} {'cluster':<20} {'blind ms':>10} {'aware ms':>10} {'aware/blind':>11}"
          f" {'fits':>5}")
    for model in models:
        for label, opts in PRECISIONS.items():
            t0 = time.perf_counter()
            graph = capture_zoo_model(model, **opts)
            took = time.perf_counter() - t0
            for name in CLUSTERS:
                cluster = PRESETS[name]()
                before, _ = single_step_s(graph, blind(cluster))
                after, fits = single_step_s(graph, cluster)
                print(f"{model:<14} {label:<9} {name:<20} {before * 1e3:>10.1f} {after * 1e3:>10.1f} "
                      f"{after / before:>11.2f} {'yes' if fits else 'no':>5}")
            print(f"  ({model} {label}: captured in {took:.1f} s, {graph.num_nodes} ops)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["inception_v3", "gpt2"])

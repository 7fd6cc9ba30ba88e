"""Graph features on a cluster: `devplace.graph.features.graph_features_on_link` with the cluster's averaged link
and speed (`devplace.graph_features`)."""

from __future__ import annotations

import math

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.graph.features import graph_features_on_link
from devplace.hardware.cluster import Cluster


def comm_params(cluster: Cluster) -> tuple[float, float, float]:
    """(bandwidth, latency, speed) averaged as the `critical-path` order does: harmonic mean of bandwidths
    over ordered pairs of distinct devices, arithmetic mean of their latencies, harmonic mean of speeds."""
    n = cluster.num_devices
    speed = float(1.0 / np.mean(1.0 / cluster.speeds))
    if n == 1:
        return math.inf, 0.0, speed
    off = ~np.eye(n, dtype=bool)
    return float(1.0 / np.mean(1.0 / cluster.bandwidth[off])), float(np.mean(cluster.latency[off])), speed


def graph_features(graph: CompGraph, cluster: Cluster | None = None) -> dict[str, float]:
    """Every feature of docs/features.md; `comm_to_compute` needs a cluster (NaN without one)."""
    if cluster is None:
        return graph_features_on_link(graph)
    bandwidth, latency, speed = comm_params(cluster)
    return graph_features_on_link(graph, bandwidth_Bps=bandwidth, latency_s=latency, speed=speed)

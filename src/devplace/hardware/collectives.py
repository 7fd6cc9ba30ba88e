"""Collective communication costs on a cluster's links (DESIGN.md section 9b): ring all-reduce, reduce-scatter
and all-gather on the links a group of devices actually uses, hierarchical where the group spans nodes.

A ring over devices d0, d1, ..., d(n-1) sends d(i) -> d(i+1) and d(n-1) -> d0; it runs at the slowest
bandwidth B among those links and pays the largest latency a among them per step:

- all-reduce: 2 (n-1)/n * S/B + 2 (n-1) a
- reduce-scatter, all-gather: (n-1)/n * S/B + (n-1) a each (S: the whole message; each device ends with or
  starts from S/n)

Nodes are not written in a cluster file; they are read off its links (`node_of`): devices joined by links
faster than the cluster's slowest pair are in one node. A group with g >= 2 devices on each of k >= 2 nodes
runs hierarchically: reduce-scatter inside each node, then g rings across the nodes (one per local rank, each
on its own devices' links, all at once) on S/g, then all-gather inside each node. The reduce-scatter and
all-gather alone are the first two and the last two of those phases. Any other group is one flat ring in the
group's order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from devplace.errors import ClusterError
from devplace.hardware.cluster import Cluster

KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def ring_all_reduce_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Seconds of a ring all-reduce of `nbytes` over n devices: 2 (n-1)/n * S/B + 2 (n-1) a."""
    return 2.0 * ring_reduce_scatter_s(nbytes, n, bandwidth_Bps, latency_s)


def ring_reduce_scatter_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Seconds of a ring reduce-scatter (or all-gather: the same steps the other way) of `nbytes` over n
    devices: (n-1)/n * S/B + (n-1) a."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth_Bps + (n - 1) * latency_s


def ring_link(cluster: Cluster, ring: Sequence[int]) -> tuple[float, float]:
    """(bandwidth, latency) a ring over `ring` (in that order, closing back to the first) runs at: the slowest
    bandwidth and the largest latency among the links it uses."""
    src = np.asarray(ring, dtype=np.int64)
    dst = np.roll(src, -1)
    return float(cluster.bandwidth[src, dst].min()), float(cluster.latency[src, dst].max())


def node_of(cluster: Cluster) -> np.ndarray:
    """int64[D]: each device's node. Where every pair's link is as fast as the slowest pair's, the cluster is
    one node; otherwise nodes are the connected groups of devices joined (both ways) by links faster than the
    slowest pair."""
    bw = np.minimum(cluster.bandwidth, cluster.bandwidth.T)
    n = cluster.num_devices
    off = ~np.eye(n, dtype=bool)
    slowest = bw[off].min(initial=np.inf)
    fast = (bw > slowest) & off
    node = np.full(n, -1, dtype=np.int64)
    if not fast.any():
        return np.zeros(n, dtype=np.int64)
    count = 0
    for start in range(n):  # connected components, by a walk from each device not yet reached
        if node[start] >= 0:
            continue
        node[start] = count
        stack = [start]
        while stack:
            a = stack.pop()
            for b in np.flatnonzero(fast[a] & (node < 0)).tolist():
                node[b] = count
                stack.append(b)
        count += 1
    return node


def collective_s(cluster: Cluster, group: Sequence[int], kind: str, nbytes: float) -> float:
    """Seconds of collective `kind` ("all-reduce", "reduce-scatter", "all-gather") of a message of `nbytes`
    (the whole buffer, not one device's shard) over the devices of `group`, in that ring order (see the module
    docstring for the formulas and when a group runs hierarchically). 0 for a group of one device."""
    if kind not in KINDS:
        raise ClusterError(f"unknown collective {kind!r}; choose one of: {', '.join(KINDS)}")
    members = [int(d) for d in group]
    if len(set(members)) != len(members) or not all(0 <= d < cluster.num_devices for d in members):
        raise ClusterError(f"a collective's group must list distinct devices of cluster {cluster.name!r} "
                           f"(0..{cluster.num_devices - 1}), got {list(group)!r}")
    if nbytes < 0:
        raise ClusterError(f"a collective's message size must be >= 0 bytes, got {nbytes!r}")
    if len(members) <= 1:
        return 0.0
    node = node_of(cluster)
    parts: dict[int, list[int]] = {}
    for d in members:
        parts.setdefault(int(node[d]), []).append(d)
    sizes = {len(p) for p in parts.values()}
    g = sizes.pop() if len(sizes) == 1 else 0
    if len(parts) < 2 or g < 2:
        ring = _ring(cluster, members, nbytes)
        return ring[kind]
    inner = [_ring(cluster, p, nbytes) for p in parts.values()]  # every node at once: the slowest counts
    rows = list(parts.values())
    across = [_ring(cluster, [p[k] for p in rows], nbytes / g) for k in range(g)]
    rs_in = max(r["reduce-scatter"] for r in inner)
    ag_in = max(r["all-gather"] for r in inner)
    if kind == "reduce-scatter":
        return rs_in + max(r["reduce-scatter"] for r in across)
    if kind == "all-gather":
        return max(r["all-gather"] for r in across) + ag_in
    return rs_in + max(r["all-reduce"] for r in across) + ag_in


def _ring(cluster: Cluster, ring: list[int], nbytes: float) -> dict[str, float]:
    """Each collective's seconds as one flat ring over `ring`."""
    bandwidth, latency = ring_link(cluster, ring)
    half = ring_reduce_scatter_s(nbytes, len(ring), bandwidth, latency)
    return {"all-reduce": 2.0 * half, "reduce-scatter": half, "all-gather": half}

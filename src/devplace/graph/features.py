"""Graph features: numbers that describe a graph's shape, cost and communication, the inputs of the study's
recommendation model (which traversal order suits which graph). Every formula is in `docs/features.md`.

`graph_features_on_link(graph, bandwidth_Bps=..., latency_s=..., speed=...)` returns a dict with the keys of
`FEATURE_NAMES`, always all of them, always in that order, every value a Python float (counts too), so a list
of them is a ready feature matrix. A value that is undefined for a graph is NaN, never a missing key.

Conventions (see the docs for every formula):
- Degrees, branching/merging and skip edges count each distinct (src, dst) pair once, as the walks of
  DESIGN.md section 6 do: two tensors from u to v are one neighbour. `edges` counts edge records,
  `distinct_edges` the distinct pairs.
- Levels are ASAP levels (`asap_levels`): hops on the longest path from a source, sources at level 0.
- The compute-weighted features (`parallelism`, `top10_compute_share`, `compute_cv`, the `*_compute_share`
  by kind) weigh op v by w(v) = compute_s(v); when the graph's total compute is 0 every op weighs 1 instead,
  so they still describe the graph's shape (e.g. `parallelism` becomes nodes / (depth + 1)).
- The communication model is plain numbers so that `graph/` does not import `hardware/` (for a `Cluster`,
  `devplace.hardware.features.graph_features(graph, cluster)` derives them as below): a transfer of b bytes
  takes `latency_s + b / bandwidth_Bps`, an op takes `compute_s / speed`. For a `Cluster`, pass the averages
  over its ordered pairs of distinct devices and over its devices that make the totals equal the mean over
  the cluster::

      off = ~np.eye(D, dtype=bool)
      bandwidth_Bps = 1 / np.mean(1 / cluster.bandwidth[off])   # harmonic mean (math.inf when D == 1)
      latency_s = float(np.mean(cluster.latency[off]))          # arithmetic mean (0.0 when D == 1)
      speed = 1 / np.mean(1 / cluster.speeds)                   # harmonic mean

  (harmonic means because time is proportional to 1/bandwidth and 1/speed; with identical devices and
  links they are the common values; the same averages as the `critical-path` order's. One device has no
  transfers, so its ratio is 0; `bandwidth_Bps=None` means "no cluster given" and gives NaN).

Cost: O(V + E) (one pass for the ASAP levels, one for the critical path, vector sums); the top-10% share
uses a partial sort, O(V).
"""

from __future__ import annotations

import math

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.compgraph import CompGraph, _first_of_parallel
from devplace.graph.info import asap_levels, longest_path

KINDS = ("forward", "backward", "optimizer")

# name -> one-line formula; the order is the order of `graph_features_on_link`'s keys. V = nodes, D = distinct
# (src, dst) pairs, L(v) = ASAP level, w(v) = compute_s(v) (1 for every op when the total compute is 0).
FEATURE_DESCRIPTIONS: dict[str, str] = {
    "nodes": "V, number of ops",
    "edges": "E, number of edge records (parallel edges, one per tensor, each count)",
    "distinct_edges": "D, number of distinct (src, dst) pairs",
    "sources": "ops with no predecessor",
    "sinks": "ops with no successor",
    "depth": "max L(v): hops on the longest path (0 for an empty or edgeless graph)",
    "width": "max over levels l of |{v : L(v) = l}|",
    "mean_width": "V / (depth + 1), ops per ASAP level (0 when V = 0)",
    "mean_degree": "D / V, mean in-degree = mean out-degree over distinct neighbours (0 when V = 0)",
    "max_in_degree": "max over v of the number of distinct predecessors",
    "max_out_degree": "max over v of the number of distinct successors",
    "branching_share": "|{v : distinct successors > 1}| / V",
    "merging_share": "|{v : distinct predecessors > 1}| / V",
    "skip_edges": "|{(u, v) distinct pair : L(v) - L(u) > 1}|",
    "skip_edge_share": "skip_edges / D (0 when D = 0)",
    "mean_edge_span": "mean over distinct pairs (u, v) of L(v) - L(u), >= 1 (0 when D = 0)",
    "total_compute_s": "sum of compute_s, seconds at speed 1",
    "critical_path_s": "max over paths of the sum of compute_s on it, seconds at speed 1, no communication",
    "parallelism": "sum w / max over paths of sum w (1 for a chain; 1 when V = 0)",
    "top10_compute_share": "sum of the ceil(V / 10) largest w / sum w (0 when V = 0)",
    "compute_cv": "std(w) / mean(w), population std (0 when V = 0)",
    "forward_compute_share": "sum of w over ops of kind 'forward' / sum w (0 when V = 0)",
    "backward_compute_share": "sum of w over ops of kind 'backward' / sum w (0 when V = 0)",
    "optimizer_compute_share": "sum of w over ops of kind 'optimizer' / sum w (0 when V = 0)",
    "edge_bytes_per_output_byte": "sum of edge bytes / sum of output_bytes (NaN when the latter is 0)",
    "comm_to_compute": "(E * latency_s + sum of edge bytes / bandwidth_Bps) / (total_compute_s / speed); "
                       "NaN when bandwidth_Bps is None or total_compute_s is 0",
}

FEATURE_NAMES: tuple[str, ...] = tuple(FEATURE_DESCRIPTIONS)


def _check(value: float, name: str, *, positive: bool, allow_inf: bool = False) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise DevplaceError(f"graph_features_on_link: {name} must be a number, got {value!r}") from None
    bad = math.isnan(x) or (math.isinf(x) and not allow_inf) or (x <= 0 if positive else x < 0)
    if bad:
        need = "> 0" if positive else ">= 0"
        raise DevplaceError(f"graph_features_on_link: {name} is {value!r}; it must be a finite number {need}")
    return x


def graph_features_on_link(graph: CompGraph, *, bandwidth_Bps: float | None = None, latency_s: float = 0.0,
                           speed: float = 1.0) -> dict[str, float]:
    """The features of `graph`, keyed and ordered as `FEATURE_NAMES`; every value a float, NaN if undefined.

    `bandwidth_Bps`, `latency_s` and `speed` describe the communication model of `comm_to_compute` (a transfer of
    b bytes takes latency_s + b / bandwidth_Bps, an op compute_s / speed); with `bandwidth_Bps=None` that feature
    is NaN. The module docstring says how to derive them from a cluster. Deterministic: the same graph and
    arguments give the same floats.
    """
    bw = None if bandwidth_Bps is None else _check(bandwidth_Bps, "bandwidth_Bps", positive=True, allow_inf=True)
    lat = _check(latency_s, "latency_s", positive=False)
    spd = _check(speed, "speed", positive=True)

    n, n_e = graph.num_nodes, graph.num_edges
    first = np.asarray(_first_of_parallel(graph), dtype=bool)
    dsrc, ddst = graph.edge_src[first], graph.edge_dst[first]
    n_d = int(dsrc.shape[0])
    indeg = np.bincount(ddst, minlength=n)
    outdeg = np.bincount(dsrc, minlength=n)

    levels = asap_levels(graph)
    depth = int(levels.max()) if n else 0
    width = int(np.bincount(levels).max()) if n else 0
    span = levels[ddst] - levels[dsrc]
    skips = int(np.count_nonzero(span > 1))

    # Sums are exactly rounded (math.fsum) so that a sub-sum never exceeds its total: a chain's parallelism is
    # exactly 1 and no share exceeds 1, whatever the order of the terms.
    compute = graph.compute_s.tolist()
    total = math.fsum(compute)
    unit = total == 0
    w = [1.0] * n if unit else compute
    path = longest_path(graph, w)
    cp_s = 0.0 if unit else math.fsum(compute[v] for v in path)
    w_total = float(n) if unit else total
    w_cp = float(len(path)) if unit else cp_s
    if n:
        k = math.ceil(n / 10)
        warr = np.asarray(w, dtype=np.float64)
        top = math.fsum(np.partition(warr, n - k)[n - k:].tolist()) / w_total
        mean_w = w_total / n
        cv = math.sqrt(math.fsum(((warr - mean_w) ** 2).tolist()) / n) / mean_w
        kinds = np.asarray(graph.kind, dtype=object)
        kind_share = [math.fsum(warr[kinds == kd].tolist()) / w_total for kd in KINDS]
    else:
        top, cv, kind_share = 0.0, 0.0, [0.0] * len(KINDS)

    edge_bytes = math.fsum(graph.edge_bytes.tolist())
    out_bytes = math.fsum(graph.output_bytes.tolist())
    ccr = math.nan if bw is None or total == 0 else (n_e * lat + edge_bytes / bw) / (total / spd)

    values = [
        n, n_e, n_d,
        int(np.count_nonzero(indeg == 0)), int(np.count_nonzero(outdeg == 0)),
        depth, width, n / (depth + 1),
        n_d / n if n else 0.0,
        int(indeg.max()) if n else 0, int(outdeg.max()) if n else 0,
        int(np.count_nonzero(outdeg > 1)) / n if n else 0.0,
        int(np.count_nonzero(indeg > 1)) / n if n else 0.0,
        skips, skips / n_d if n_d else 0.0, float(span.mean()) if n_d else 0.0,
        total, cp_s,
        w_total / w_cp if n else 1.0,
        top, cv, *kind_share,
        edge_bytes / out_bytes if out_bytes > 0 else math.nan,
        ccr,
    ]
    return {name: float(v) for name, v in zip(FEATURE_NAMES, values, strict=True)}

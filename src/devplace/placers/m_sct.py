"""`m-sct`: Baechi's m-SCT (Jeon et al., SoCC 2020): m-ETF plus Hanen and Munier's favourite-child rule.

Uses `order` exactly as `m-etf` does: as the tie-break among ops that can start at the same time (Baechi:
topological order, the default `topo`).

What it does, exactly:

1. **LP relaxation** (Hanen-Munier "small communication times"), solved with HiGHS (interior point with
   crossover, one thread: a vertex solution, the same on every run); times are scaled by the largest
   cost for the solver, which does not change x. p_v = op time at the mean speed (mean of
   `compute_s / speed` over devices); c_uv = mean transfer time of the tensors u sends v (per tensor:
   mean latency + bytes x mean inverse bandwidth over ordered device pairs, as in HEFT's upward rank);
   parallel edges (several tensors u -> v) are one pair with the summed cost. Variables: x_uv in [0, 1] per
   pair (1 = the communication is paid), start s_v >= 0, makespan w. Minimise w subject to
   s_u + p_u + c_uv x_uv <= s_v for every pair; sum of x over u's out-pairs >= outdeg(u) - 1 (at most one
   favourite child) and over v's in-pairs >= indeg(v) - 1 (at most one favourite parent), written only
   where the degree is >= 2 (otherwise they always hold); s_v + p_v <= w, written only for sinks (the
   precedence rows imply it for the rest).
2. **Rounding** with `threshold` (Baechi: 0.5 or 0.1): a pair with x_uv <= threshold is a favourite edge
   (Baechi rounds x - threshold + 0.5 half to even, which is the same test). Rounding can leave an op with
   two favourite children or two favourite parents (Baechi's code notes this and keeps the last edge it
   sees); here the favourite edges are accepted in increasing x (ties: by (u, v)) while u has no favourite
   child and v no favourite parent yet.
3. **Scheduling**: m-ETF (see `m-etf`; shared core `devplace.placers.list_scheduling`), plus: when a device
   is idle and the last op it ran has a favourite child that is ready (all its predecessors finished) and
   would start earliest on this device (over all devices with room; ties count), the device waits for that
   child and meanwhile starts only an **urgent** op: one whose urgent time has come, where an op's urgent
   time is the latest of its earliest start times over the devices with room (Baechi's `urgent_ts`: by
   then every device could run it, so holding it back gains nothing). Other devices still run as in m-ETF.
4. Memory, the simulator check and the NoFitError are m-ETF's.

**Large graphs**: the LP has pairs + V + 1 columns and at most pairs + 3V rows. HiGHS's interior-point
solver with crossover (a vertex, like simplex; dual simplex alone takes minutes at 10k ops) needs about
1.6 s for a 5k-op layered graph, 8 s for 10k and 35 s for 20k (2 cores); the schedule itself takes well
under a second. Above `max_lp_nodes` ops (default 20000) the LP is skipped and no op has a favourite
child, which makes m-SCT exactly m-ETF (nothing is reported; compare with `m-etf` to see it).
"""

from __future__ import annotations

import numpy as np

from devplace.defaults import MAX_LP_NODES
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, op_times
from devplace.placers.common import silent_highs
from devplace.placers.list_scheduling import ListScheduler, place_within_memory
from devplace.placers.m_etf import order_keys
from devplace.placers.registry import PlacerError, register

ROUND_EPS = 1e-9  # LP values are exact only to the solver's tolerance


def lp_relaxation(graph: CompGraph, cluster: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Solve the SCT LP relaxation. Returns (pair_src, pair_dst, x per pair, LP makespan w); pairs are the
    distinct (u, v) with an edge, sorted by (u, v)."""
    import highspy

    n = graph.num_nodes
    p = op_times(graph, cluster).mean(axis=1)
    nd = cluster.num_devices
    if nd > 1:
        off = ~np.eye(nd, dtype=bool)
        ce = float(np.mean(cluster.latency[off])) + graph.edge_bytes * float(np.mean(1.0 / cluster.bandwidth[off]))
    else:
        ce = np.zeros(graph.num_edges)
    pair_key, inv = np.unique(graph.edge_src * n + graph.edge_dst, return_inverse=True)
    pu, pv = pair_key // n, pair_key % n
    n_p = pair_key.shape[0]
    c = np.bincount(inv, weights=ce, minlength=n_p)
    # times in units of the largest cost: the same x, better scaled for the solver (seconds can be 1e-6)
    unit = float(max(p.max(initial=0.0), c.max(initial=0.0))) or 1.0
    p, c = p / unit, c / unit
    outdeg = np.bincount(pu, minlength=n)
    indeg = np.bincount(pv, minlength=n)
    xs, ss, w = np.arange(n_p), n_p + np.arange(n), n_p + n  # column indices

    rows, cols, vals, lo, hi = [], [], [], [], []
    inf = highspy.kHighsInf
    r0 = 0

    def block(row: np.ndarray, col: np.ndarray, val: np.ndarray) -> None:
        rows.append(row)
        cols.append(col)
        vals.append(val)

    # s_u - s_v + c x <= -p_u
    r = np.arange(n_p)
    block(np.concatenate([r, r, r]), np.concatenate([ss[pu], ss[pv], xs]),
          np.concatenate([np.ones(n_p), -np.ones(n_p), c]))
    lo.append(np.full(n_p, -inf))
    hi.append(-p[pu])
    r0 += n_p
    # sum of x over out-pairs >= outdeg - 1 (outdeg >= 2), then over in-pairs
    for ends, deg in ((pu, outdeg), (pv, indeg)):
        many = np.flatnonzero(deg >= 2)
        row_of = np.full(n, -1, dtype=np.int64)
        row_of[many] = r0 + np.arange(many.shape[0])
        sel = np.flatnonzero(deg[ends] >= 2)
        block(row_of[ends[sel]], xs[sel], np.ones(sel.shape[0]))
        lo.append((deg[many] - 1).astype(np.float64))
        hi.append(np.full(many.shape[0], inf))
        r0 += many.shape[0]
    # s_v - w <= -p_v for sinks
    sinks = np.flatnonzero(outdeg == 0)
    r = r0 + np.arange(sinks.shape[0])
    block(np.concatenate([r, r]), np.concatenate([ss[sinks], np.full(sinks.shape[0], w)]),
          np.concatenate([np.ones(sinks.shape[0]), -np.ones(sinks.shape[0])]))
    lo.append(np.full(sinks.shape[0], -inf))
    hi.append(-p[sinks])
    r0 += sinks.shape[0]

    row = np.concatenate(rows)
    by_row = np.argsort(row, kind="stable")
    lp = highspy.HighsLp()
    lp.num_col_ = n_p + n + 1
    lp.num_row_ = r0
    lp.col_cost_ = np.concatenate([np.zeros(n_p + n), [1.0]])
    lp.col_lower_ = np.zeros(n_p + n + 1)
    lp.col_upper_ = np.concatenate([np.ones(n_p), np.full(n + 1, inf)])
    lp.row_lower_ = np.concatenate(lo)
    lp.row_upper_ = np.concatenate(hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = lp.num_col_
    lp.a_matrix_.num_row_ = r0
    start = np.zeros(r0 + 1, dtype=np.int32)
    np.cumsum(np.bincount(row, minlength=r0), out=start[1:])
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = np.concatenate(cols)[by_row].astype(np.int32)
    lp.a_matrix_.value_ = np.concatenate(vals)[by_row].astype(np.float64)
    h = silent_highs()
    h.setOptionValue("solver", "ipm")  # + crossover: a vertex; simplex alone takes minutes at 10k ops
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:  # cannot happen: s = longest path, x = 1 is feasible
        raise RuntimeError(f"m-sct: the LP relaxation ended with {h.modelStatusToString(h.getModelStatus())}")
    sol = np.asarray(h.getSolution().col_value, dtype=np.float64)
    return pu, pv, sol[:n_p], float(sol[w]) * unit


def favourite_children(graph: CompGraph, cluster: Cluster, threshold: float) -> np.ndarray:
    """favourite[u] = u's favourite child, or -1 (steps 1 and 2 of the module docstring)."""
    fav = np.full(graph.num_nodes, -1, dtype=np.int64)
    if graph.num_edges == 0:
        return fav
    pu, pv, x, _ = lp_relaxation(graph, cluster)
    cand = np.flatnonzero(x <= threshold + ROUND_EPS)
    cand = cand[np.argsort(x[cand], kind="stable")]  # pairs are in (u, v) order: ties keep it
    has_parent = np.zeros(graph.num_nodes, dtype=bool)
    for i in cand.tolist():
        u, v = int(pu[i]), int(pv[i])
        if fav[u] < 0 and not has_parent[v]:
            fav[u] = v
            has_parent[v] = True
    return fav


def _check_settings(threshold: float, max_lp_nodes: int) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0:
        raise PlacerError(f"placer 'm-sct': setting 'threshold' must be a number in [0, 1], got {threshold!r}")
    if isinstance(max_lp_nodes, bool) or not isinstance(max_lp_nodes, int) or not 0 <= max_lp_nodes <= MAX_LP_NODES:
        raise PlacerError(f"placer 'm-sct': setting 'max_lp_nodes' must be an integer >= 0 and at most "
                          f"{MAX_LP_NODES:,}, got {max_lp_nodes!r}")


@register("m-sct", uses_order=True, cheap=True, check=_check_settings)
def m_sct(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int, threshold: float = 0.5,
          max_lp_nodes: int = 20000, ties: np.ndarray | None = None) -> np.ndarray:
    """Baechi's m-SCT: m-ETF that keeps a device for the favourite child chosen by an LP relaxation (HiGHS).

    Uses `order` as m-ETF does (tie-break among ops that could start at the same time). `threshold`: an
    edge whose LP variable is <= it is a favourite edge (Baechi: 0.5 or 0.1). Graphs of more than
    `max_lp_nodes` ops skip the LP, which makes m-SCT the same as m-ETF. Deterministic; `seed` is unused.
    `ties` as for m-ETF (a favourite child tied elsewhere is kept only on its class's device).
    """
    _check_settings(threshold, max_lp_nodes)
    if graph.num_nodes <= max_lp_nodes:
        fav = favourite_children(graph, cluster, float(threshold))
    else:
        fav = np.full(graph.num_nodes, -1, dtype=np.int64)
    sched = ListScheduler(graph, cluster, ties)
    key = order_keys(order)
    return place_within_memory(graph, cluster, "m-sct", lambda caps: sched.event(key, favourite=fav, cap=caps))

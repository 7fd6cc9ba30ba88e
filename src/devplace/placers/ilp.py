"""`ilp`: exact placement *and* schedule of a small graph as a mixed-integer program, solved with HiGHS.

For optimality gaps: on graphs of up to `max_nodes` ops (default 30) it finds the placement whose best
schedule is shortest in a *contention-free* model of the step, then reports that placement; the step time
that counts is the devplace simulation of it (`place()` records it).

The program (times in units of the horizon / 1000, so HiGHS's absolute tolerances are relative ones):

- x[v,d] binary: op v runs on device d; `sum_d x[v,d] = 1`. Its duration is `P_v = sum_d p_v(d) x[v,d]`
  with `p_v(d) = compute_s(v) / speed(d)`.
- s_v >= 0 continuous: start of v; C: the makespan, `C >= s_v + P_v` for every sink v. Minimise C.
- Precedence with communication, for every pair u -> v joined by edges (parallel edges merged): with
  `comm_ab(u, v) = sum over the tensors v reads from u of (latency + bytes / bandwidth)` of link (a, b),
  `s_v >= s_u + P_u + comm_ab (x[u,a] + x[v,b] - 1)` for every a != b, and `s_v >= s_u + P_u`. When all
  links are equal (comm_ab = c) the D(D-1) rows collapse to D exact ones: `s_v >= s_u + P_u + c (x[u,a] -
  x[v,a])` for every a.
- No overlap on a device (disjunctive, big-M = the horizon H): for every pair u, v that the DAG does not
  order (neither reaches the other; ordered pairs are kept apart by the precedence rows), a continuous
  `same_uv >= x[u,d] + x[v,d] - 1` (every d) and a binary y_uv (1: u first),
  `s_v >= s_u + P_u - H (1 - y_uv) - H (1 - same_uv)` and `s_u >= s_v + P_v - H y_uv - H (1 - same_uv)`.
  H bounds every schedule worth having: the simulated step time of a starting placement when one fits,
  else `sum_v max_d p_v(d) + sum_(u,v) max_ab comm_ab(u, v)` (any placement, run one op at a time).
- Memory: `sum_v param_bytes(v) x[v,d] <= memory(d)` (persistent memory), and, for each op v of nonzero
  time, `sum_u param_bytes(u) x[u,d] + (output_bytes(v) + temp_bytes(v)) x[v,d] <= memory(d)` (while v runs
  its output and scratch are live on its device). These are necessary, not sufficient: the live memory of
  the simulator (outputs held until consumers finish, received tensors) is checked after each solve; a
  placement the simulator finds over memory is cut off (a no-good cut on the whole assignment, exact) and
  the program solved again; after `CUT_ROUNDS` such cuts the over-full devices' memory rows are also
  tightened by the overshoot (no longer exact). All rounds share `time_limit_s`.
- Symmetry: when all devices are interchangeable (same speed and memory, one link for every pair) the
  devices are labelled in order of their first op: op i may use device d >= 1 only if device d-1 holds an
  op before i (`x[i,d] <= sum_(j<i) x[j,d-1]`), which removes the D! relabellings.

What is relaxed: the program ignores channel contention (two transfers on one channel at once) and lets the
schedule choose any order, where the simulator serves channels FIFO and starts ready ops by (ready time,
rank). So the program's optimum C* is a lower bound on the simulated step time of every placement that
fits (`IlpResult.objective_s <= best simulated step time`), and "exact" means exact for the contention-free
model; on graphs where no channel carries two transfers at once and the simulator's order is optimal
(chains, single-level fan-outs), the placement found is the simulator's optimum. Elsewhere the simulated
step time of the program's optimum can be well above C* (13% and 36% on the 20- and 30-op layered graphs
measured, with transfers as long as ops), so of the solver's incumbents (every improving solution it found, kept with
`mip_improving_solution_save`) that fit, the one the simulator finds fastest is returned -- never worse
than the program's optimum, not proven optimal for the simulator. C* itself, when proven, is a lower
bound on every placement's simulated step time and usually tighter than `devplace.sim.lower_bound`.

HiGHS runs with one thread (its thread pool is global and sized by the first run in a process; m-sct asks
for one thread too), `random_seed` = `seed`, and relative gap 1e-6: deterministic for a seed unless the
time limit binds. A binding time limit leaves the best placement found so far (`IlpResult.optimal` is
False; the result then depends on the machine's speed); when not even one solve finished, the single-device
starting placement (or the best fitting incumbent) is returned.

Does not use the traversal order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from devplace.defaults import MAX_ILP_NODES, MAX_TIME_LIMIT_S
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, op_times
from devplace.placers.common import positive_int, silent_highs
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import PlacerError, register
from devplace.sim.devplace_model import DevplaceModel

CUT_ROUNDS = 10  # no-good cuts before memory rows are tightened as well
MAX_ROUNDS = 40
MIP_REL_GAP = 1e-6  # HiGHS's default 1e-4 would stop 0.01% short of the optimum


class IlpTooLargeError(PlacerError):
    """The graph has more ops than the exact `ilp` placer accepts (its `max_nodes` setting)."""


@dataclass(frozen=True)
class IlpResult:
    """What the solver found: the placement, its simulated step time, the program's own makespan and bound."""

    devices: np.ndarray  # int64[V], the placement returned
    step_time_s: float  # devplace simulation of `devices`
    objective_s: float  # the program's makespan C* of its last solve (NaN when no solve gave a placement that fits)
    bound_s: float  # HiGHS's dual bound on C*
    optimal: bool  # proven: solved to optimality, no time limit hit, no memory row tightened
    rounds: int  # solves (1 + memory cuts)
    solve_s: float  # wall time of all solves

    # When `optimal`, objective_s (= bound_s within 1e-6) is a lower bound on the simulated step time of
    # every placement that fits: the simulator's schedule of any placement is a solution of the program.


class _Rows:
    """Sparse rows lo <= a.x <= hi, collected then handed to HiGHS in one call."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.starts: list[int] = []
        self.index: list[int] = []
        self.value: list[float] = []

    def add(self, cols: list[int], vals: list[float], lo: float = -math.inf, hi: float = math.inf) -> None:
        merged: dict[int, float] = {}
        for c, a in zip(cols, vals, strict=True):
            merged[c] = merged.get(c, 0.0) + a
        self.starts.append(len(self.index))
        self.index.extend(merged)
        self.value.extend(merged.values())
        self.lo.append(lo)
        self.hi.append(hi)

    def flush(self, h) -> None:  # type: ignore[no-untyped-def]
        import highspy

        if not self.lo:
            return
        inf = h.getInfinity()
        lo = np.clip(np.array(self.lo), -inf, inf)
        hi = np.clip(np.array(self.hi), -inf, inf)
        status = h.addRows(len(self.lo), lo, hi, len(self.index), np.array(self.starts, dtype=np.int32),
                           np.array(self.index, dtype=np.int32), np.array(self.value, dtype=np.float64))
        # kWarning: HiGHS dropped coefficients below its small_matrix_value (1e-9), e.g. an op's bytes on a
        # memory row scaled by a device a billion times larger; they cannot decide feasibility, and place()
        # re-checks memory with the simulator anyway
        if status not in (highspy.HighsStatus.kOk, highspy.HighsStatus.kWarning):
            raise RuntimeError(f"HiGHS refused the ilp placer's rows ({status})")  # a bug, not a user error
        self.clear()


def _reachability(graph: CompGraph) -> list[int]:
    """reach[v]: bitset of the nodes reachable from v (v excluded)."""
    reach = [0] * graph.num_nodes
    for v in reversed(graph.topo_order.tolist()):
        r = 0
        for w in graph.successors(v):
            r |= reach[w] | (1 << w)
        reach[v] = r
    return reach


def _interchangeable(cluster: Cluster) -> bool:
    speeds, mem = cluster.speeds, cluster.memory
    nd = cluster.num_devices
    off = ~np.eye(nd, dtype=bool)
    return bool(np.all(speeds == speeds[0]) and np.all(mem == mem[0])
                and np.all(cluster.bandwidth[off] == cluster.link.bandwidth_Bps)
                and np.all(cluster.latency[off] == cluster.link.latency_s))


def _check_settings(time_limit_s: float, max_nodes: int) -> None:
    if (isinstance(time_limit_s, bool) or not isinstance(time_limit_s, int | float)
            or not 0 < time_limit_s <= MAX_TIME_LIMIT_S):
        raise PlacerError(f"ilp: time_limit_s={time_limit_s!r} must be a number of seconds > 0 and at most "
                          f"{MAX_TIME_LIMIT_S:,.0f} (a day)")
    positive_int(max_nodes, "max_nodes", "ilp", MAX_ILP_NODES)


def solve_ilp(graph: CompGraph, cluster: Cluster, *, seed: int = 0, time_limit_s: float = 60.0,
              max_nodes: int = 30) -> IlpResult:
    """Solve the program of the module docstring; raise IlpTooLargeError above `max_nodes` ops and a
    NoFitError when no placement fits."""
    _check_settings(time_limit_s, max_nodes)
    n, nd = graph.num_nodes, cluster.num_devices
    if n > max_nodes:
        raise IlpTooLargeError(
            f"placer 'ilp' places graphs of at most max_nodes={max_nodes} ops exactly, and {graph.name!r} has "
            f"{n}; its solve time grows exponentially with the number of ops. Coarsen the graph, use a "
            "heuristic placer (m-etf, heft, anneal), or raise max_nodes (with time_limit_s) at your own cost")
    t0 = time.perf_counter()
    model = DevplaceModel(graph, cluster)
    if n == 0:
        return IlpResult(np.zeros(0, dtype=np.int64), 0.0, 0.0, 0.0, True, 0, 0.0)
    mem = cluster.memory.copy()
    p = op_times(graph, cluster)  # [V, D] seconds
    param, live = graph.param_bytes, graph.output_bytes + graph.temp_bytes

    # merged pairs u -> v and their transfer time on each link
    pairs: dict[tuple[int, int], list[int]] = {}
    for e, (u, v) in enumerate(zip(graph.edge_src.tolist(), graph.edge_dst.tolist(), strict=True)):
        pairs.setdefault((u, v), []).append(e)
    comm = {}
    for (u, v), es in pairs.items():
        nbytes = graph.edge_bytes[es]
        comm[(u, v)] = len(es) * cluster.latency + nbytes.sum() / cluster.bandwidth  # [D, D], 0 on diagonal
    off = ~np.eye(nd, dtype=bool)
    uniform = bool(np.all(cluster.bandwidth[off] == cluster.link.bandwidth_Bps)
                   and np.all(cluster.latency[off] == cluster.link.latency_s))

    # a starting placement: everything on the fastest device it fits on (by the program's own rows)
    start_dev, start_res = None, None
    for d in np.argsort(p.sum(axis=0), kind="stable").tolist():
        if param.sum() + (live[graph.compute_s > 0].max(initial=0.0)) <= mem[d]:
            cand = np.full(n, d, dtype=np.int64)
            r = model.run(cand)
            if r.feasible:
                start_dev, start_res = cand, r
                break
    horizon = float(p.max(axis=1).sum() + sum(float(c[off].max()) if nd > 1 else 0.0 for c in comm.values()))
    if start_res is not None:
        horizon = min(horizon, start_res.step_time_s)
    if horizon <= 0:  # nothing takes time: every placement that fits is optimal
        horizon = 1.0
    unit = horizon / 1000.0
    big = 1000.0  # the horizon in program units

    reach = _reachability(graph)
    free_pairs = [(u, v) for u in range(n) for v in range(u + 1, n)
                  if not (reach[u] >> v) & 1 and not (reach[v] >> u) & 1]
    nx_, ns = n * nd, n
    col_s = nx_
    col_c = nx_ + ns
    col_y = col_c + 1
    col_same = col_y + len(free_pairs)
    ncols = col_same + len(free_pairs)

    def x(v: int, d: int) -> int:
        return v * nd + d

    h = silent_highs()
    h.setOptionValue("random_seed", int(seed) % (2**31 - 1))
    h.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("mip_improving_solution_save", True)
    inf = h.getInfinity()
    lower = np.zeros(ncols)
    upper = np.ones(ncols)
    upper[col_s:col_c + 1] = big
    cost = np.zeros(ncols)
    cost[col_c] = 1.0
    h.addCols(ncols, cost, lower, np.minimum(upper, inf), 0, np.zeros(ncols, dtype=np.int32),
              np.zeros(0, dtype=np.int32), np.zeros(0))
    integer = np.r_[np.arange(nx_), np.arange(col_y, col_same)].astype(np.int32)
    h.changeColsIntegrality(len(integer), integer, np.ones(len(integer), dtype=np.uint8))

    rows = _Rows()
    pu = p / unit
    for v in range(n):
        rows.add([x(v, d) for d in range(nd)], [1.0] * nd, 1.0, 1.0)

    def duration(v: int) -> tuple[list[int], list[float]]:
        return [x(v, d) for d in range(nd)], [float(pu[v, d]) for d in range(nd)]

    for (u, v), c in comm.items():
        u_cols, u_vals = duration(u)
        base_cols, base_vals = [col_s + v, col_s + u, *u_cols], [1.0, -1.0, *(-a for a in u_vals)]
        rows.add(base_cols, base_vals, 0.0)  # s_v >= s_u + P_u
        if nd == 1:
            continue
        c_units = c / unit
        if uniform:
            k = float(c_units[0, 1])
            if k > 0:
                for a in range(nd):
                    # s_v - s_u - P_u - k x[u,a] + k x[v,a] >= 0
                    rows.add([*base_cols, x(u, a), x(v, a)], [*base_vals, -k, k], 0.0)
        else:
            for a in range(nd):
                for b in range(nd):
                    k = float(c_units[a, b])
                    if a != b and k > 0:
                        rows.add([*base_cols, x(u, a), x(v, b)], [*base_vals, -k, -k], -k)
    for i, (u, v) in enumerate(free_pairs):
        y, same = col_y + i, col_same + i
        for d in range(nd):
            rows.add([same, x(u, d), x(v, d)], [1.0, -1.0, -1.0], -1.0)
        u_cols, u_vals = duration(u)
        v_cols, v_vals = duration(v)
        # s_v - s_u - P_u - H y - H same >= -2H
        rows.add([col_s + v, col_s + u, *u_cols, y, same], [1.0, -1.0, *(-a for a in u_vals), -big, -big], -2 * big)
        # s_u - s_v - P_v + H y - H same >= -H
        rows.add([col_s + u, col_s + v, *v_cols, y, same], [1.0, -1.0, *(-a for a in v_vals), big, -big], -big)
    sinks = [v for v in range(n) if graph.succ_ptr[v] == graph.succ_ptr[v + 1]]
    for v in sinks:
        v_cols, v_vals = duration(v)
        rows.add([col_c, col_s + v, *v_cols], [1.0, -1.0, *(-a for a in v_vals)], 0.0)
    symmetric = _interchangeable(cluster) and nd > 1
    if symmetric:
        topo = graph.topo_order.tolist()
        for i, v in enumerate(topo):
            for d in range(1, nd):
                if d > i:
                    rows.add([x(v, d)], [1.0], hi=0.0)
                else:
                    rows.add([x(v, d), *(x(w, d - 1) for w in topo[:i])], [1.0, *([-1.0] * i)], hi=0.0)
    mem_rows: dict[int, int] = {}  # device -> first row index of its memory rows
    mem_count = 0
    busy_ops = [v for v in range(n) if graph.compute_s[v] > 0 and live[v] > 0]
    row_base = h.getNumRow()
    nrow = len(rows.lo)
    for d in range(nd):
        scale = 1.0 / mem[d]
        mem_rows[d] = row_base + nrow + mem_count
        prow_cols = [x(u, d) for u in range(n) if param[u] > 0]
        prow_vals = [float(param[u] * scale) for u in range(n) if param[u] > 0]
        rows.add(prow_cols, prow_vals, hi=1.0)
        mem_count += 1
        for v in busy_ops:
            cols, vals = list(prow_cols), list(prow_vals)
            if x(v, d) in cols:
                vals[cols.index(x(v, d))] += float(live[v] * scale)
            else:
                cols.append(x(v, d))
                vals.append(float(live[v] * scale))
            rows.add(cols, vals, hi=1.0)
            mem_count += 1
    rows.flush(h)
    per_device_rows = 1 + len(busy_ops)

    if start_dev is not None and start_res is not None:  # a MIP start: the single-device schedule
        sol = np.zeros(ncols)
        sol[[x(v, int(start_dev[v])) for v in range(n)]] = 1.0
        sol[col_s:col_s + n] = start_res.start_s / unit
        sol[col_c] = start_res.step_time_s / unit
        for i, (u, v) in enumerate(free_pairs):
            sol[col_y + i] = 1.0 if (start_res.start_s[u], u) < (start_res.start_s[v], v) else 0.0
            sol[col_same + i] = 1.0
        h.setSolution(ncols, np.arange(ncols, dtype=np.int32), sol)

    import highspy

    rounds, tightened = 0, np.zeros(nd)
    exact = True
    best: IlpResult | None = None
    pool: tuple[float, np.ndarray] | None = None  # best simulated incumbent that fits
    optimal = True
    while rounds < MAX_ROUNDS:
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            optimal = False
            break
        h.setOptionValue("time_limit", float(left))
        h.run()
        rounds += 1
        status = h.getModelStatus()
        info = h.getInfo()
        if status == highspy.HighsModelStatus.kInfeasible:
            break
        if info.primal_solution_status != 2:  # no feasible solution within the time limit
            optimal = False
            break
        values = np.asarray(h.getSolution().col_value)
        devices = values[:nx_].reshape(n, nd).argmax(axis=1).astype(np.int64)
        res = model.run(devices)
        this_optimal = status == highspy.HighsModelStatus.kOptimal
        # the solver's earlier incumbents: the simulator may like one of them better (contention)
        for sol in h.getSavedMipSolutions():
            cand = np.asarray(sol.col_value)[:nx_].reshape(n, nd).argmax(axis=1).astype(np.int64)
            r = model.run(cand)
            if r.feasible and (pool is None or r.step_time_s < pool[0]):
                pool = (r.step_time_s, cand)
        if res.feasible:
            chosen, chosen_t = devices, res.step_time_s
            if pool is not None and pool[0] < chosen_t:
                chosen_t, chosen = pool
            best = IlpResult(devices=chosen, step_time_s=chosen_t, objective_s=float(values[col_c]) * unit,
                             bound_s=float(info.mip_dual_bound) * unit, optimal=this_optimal, rounds=rounds,
                             solve_s=time.perf_counter() - t0)
            break
        optimal = optimal and this_optimal
        # cut this assignment off; after CUT_ROUNDS, also tighten the over-full devices' memory rows
        rows.add([x(v, int(devices[v])) for v in range(n)], [1.0] * n, hi=float(n - 1))
        rows.flush(h)
        if rounds >= CUT_ROUNDS:
            exact = False  # tightened rows may cut off placements that fit: no longer a proof
            worst = max(res.oom.values())
            for d, over in res.oom.items():
                # interchangeable devices stay interchangeable (the symmetry rows assume it)
                for dd in range(nd) if symmetric else [d]:
                    tightened[dd] += worst if symmetric else over
                    hi = max(0.0, 1.0 - tightened[dd] / mem[dd])
                    for r in range(mem_rows[dd], mem_rows[dd] + per_device_rows):
                        h.changeRowBounds(r, -inf, hi)
                if symmetric:
                    break
    if best is None:
        fallback = pool
        if start_dev is not None and start_res is not None and (pool is None or start_res.step_time_s < pool[0]):
            fallback = (start_res.step_time_s, start_dev)
        if fallback is not None:  # time ran out, or the tightened program lost every placement that fits
            return IlpResult(devices=fallback[1], step_time_s=fallback[0], objective_s=math.nan, bound_s=0.0,
                             optimal=False, rounds=rounds, solve_s=time.perf_counter() - t0)
        if (optimal and exact) or rounds >= MAX_ROUNDS:
            raise no_fit_error(graph, cluster, "ilp", f"no placement fits after {rounds} solve(s) of the program")
        raise PlacerError(f"ilp: HiGHS found no placement of {graph.name!r} that fits within time_limit_s="
                          f"{time_limit_s}; raise time_limit_s or use a heuristic placer")
    if not (optimal and exact):
        best = IlpResult(best.devices, best.step_time_s, best.objective_s, best.bound_s, False, best.rounds,
                         best.solve_s)
    return best


@register("ilp", uses_order=False, check=_check_settings)
def ilp(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int = 0, time_limit_s: float = 60.0,
        max_nodes: int = 30) -> np.ndarray:
    """Exact placement and schedule of a small graph (mixed-integer program, HiGHS), for optimality gaps.

    Optimal for a contention-free model of the step (transfers never wait for a busy channel, any schedule
    order); the placement's step time is then the devplace simulation. Memory: persistent memory and each
    op's own output and scratch are rows of the program; the simulator's live memory is checked after each
    solve and an over-memory placement cut off. Raises IlpTooLargeError above `max_nodes` ops. Stops at
    `time_limit_s` with the best placement found. Does not use the traversal order.
    """
    del order
    return solve_ilp(graph, cluster, seed=seed, time_limit_s=time_limit_s, max_nodes=max_nodes).devices

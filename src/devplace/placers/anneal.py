"""`anneal`: simulated annealing on the simulator, from the placement of another placer, moves in `order`.

Search state: a device per op. Step k visits op `order[k mod V]` (the traversal order, cyclically) and
proposes one move for it, chosen by the seeded RNG:
- with probability `swap_prob`, swap its device with that of a random graph neighbour (predecessor or
  successor) on another device -- the move that rebalances a cut without changing how many ops each
  device holds;
- otherwise (or when every neighbour shares its device) move it to another device, chosen uniformly.
Each proposal is simulated in full (`devplace` model) and accepted by the Metropolis rule: always when the
step time does not grow, else with probability exp(-increase / T). The temperature is scaled to the room
for improvement, the gap G = (start step time) - (lower bound, DESIGN.md section 8), and falls
geometrically from `initial_temp x G` to `final_temp x G` over the budget:
`T = initial_temp x G x (final_temp / initial_temp) ** progress`, progress = k / steps (or the elapsed share
of `time_limit_s` when that is larger). So a poor start (m-topo's pipeline, several times the bound) is
searched hot and a good one (m-etf, greedy, within a few % of the bound) only perturbed; a start at the
bound is already optimal and returned as is. A proposal that is over memory is rejected outright; only when
the start itself is over memory is one accepted if it lowers the total overflow (a repair walk). The best
feasible placement seen is returned, so the result is never worse than the start; if no feasible placement
was ever seen, NoFitError.

Cost: one full simulation per step, O((V + E) log V): about 0.6-0.7 ms for 1,000 ops on one slow core
(1,400-1,600 steps/s), so the default 15,000 steps take about 10 s there; the time grows linearly with
the graph, so give big graphs a `steps` or `time_limit_s` of their own. Only `steps` is deterministic: with
`time_limit_s` the search stops (and cools) by the clock, so the result depends on the machine and its load.
"""

from __future__ import annotations

import math
import time

import numpy as np

from devplace.defaults import MAX_SEARCH_STEPS, MAX_TIME_LIMIT_S
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.memory import NoFitError, no_fit_error
from devplace.placers.registry import PlacerError, Progress, as_output, get_placer, register
from devplace.sim.bounds import lower_bound
from devplace.sim.devplace_model import DevplaceModel

DEFAULT_STEPS = 15_000


def _neighbours(graph: CompGraph) -> list[list[int]]:
    """Distinct predecessors and successors of every node, predecessors first, each in first-edge order."""
    return [list(dict.fromkeys(graph.predecessors(v) + graph.successors(v))) for v in range(graph.num_nodes)]


def _check_settings(start: str, steps: int, time_limit_s: float | None, initial_temp: float, final_temp: float,
                    swap_prob: float) -> None:
    if start == "anneal":
        raise PlacerError("anneal cannot start from itself; give start= another placer, e.g. 'm-topo' or 'greedy'")
    try:
        get_placer(start)
    except PlacerError as exc:
        raise PlacerError(f"anneal: setting 'start': {exc}") from None
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or not 0 <= steps <= MAX_SEARCH_STEPS:
        raise PlacerError(f"anneal: steps must be an integer >= 0 and at most {MAX_SEARCH_STEPS:,}, got {steps!r}")
    if time_limit_s is not None and not (isinstance(time_limit_s, int | float) and not isinstance(time_limit_s, bool)
                                         and 0 < time_limit_s <= MAX_TIME_LIMIT_S):
        raise PlacerError(f"anneal: time_limit_s must be a number of seconds > 0 and at most {MAX_TIME_LIMIT_S:,.0f} "
                          f"(a day), or None, got {time_limit_s!r}")
    if not (isinstance(initial_temp, int | float) and isinstance(final_temp, int | float)
            and 0 < final_temp <= initial_temp and math.isfinite(initial_temp)):
        raise PlacerError("anneal: need 0 < final_temp <= initial_temp (fractions of the start's gap to the lower "
                          f"bound), got initial_temp={initial_temp!r}, final_temp={final_temp!r}")
    if not (isinstance(swap_prob, int | float) and 0.0 <= swap_prob <= 1.0):
        raise PlacerError(f"anneal: swap_prob must be in [0, 1], got {swap_prob!r}")


def _overflow(result_peak: np.ndarray, memory: np.ndarray) -> float:
    return float(np.maximum(result_peak - memory, 0.0).sum())


@register("anneal", uses_order=True, check=_check_settings, refines=lambda settings: settings["start"])
def anneal(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int = 0, start: str = "m-topo",
           steps: int = DEFAULT_STEPS, time_limit_s: float | None = None, initial_temp: float = 0.05,
           final_temp: float = 1e-4, swap_prob: float = 0.25, progress: Progress | None = None) -> np.ndarray:
    """Simulated annealing on the simulated step time, from `start`'s placement; moves visit ops in the order.

    `start` names another placer (run with the same order and seed). One step = one move of the current op
    of the order (cyclically): to another device, or (probability `swap_prob`) a device swap with a
    neighbour; Metropolis acceptance with a geometric temperature from `initial_temp` to `final_temp`
    (fractions of the start's gap to the lower bound). Over-memory moves are rejected; the best feasible placement seen
    is returned (never worse than the start). `steps` (default about 10 s for 1,000 ops) is deterministic
    for a seed; `time_limit_s` (wall clock, the start placer included) also stops the search by the clock,
    which makes the result machine-dependent.
    """
    _check_settings(start, steps, time_limit_s, initial_temp, final_temp, swap_prob)
    began = time.perf_counter()
    n, nd = graph.num_nodes, cluster.num_devices
    try:
        # a start that returns a schedule (pipeline): anneal its devices as an unpipelined step
        init = as_output(get_placer(start).func(graph, cluster, order=order, seed=seed)).adjusted().devices
    except NoFitError:
        # the start placer's own error would name only it; the user asked for anneal
        raise no_fit_error(graph, cluster, f"anneal (start={start!r})",
                           f"its start placer {start!r} found no placement that fits; give another start= "
                           "(e.g. 'm-etf' or 'greedy')") from None
    cur = np.array(init, dtype=np.int64).reshape(n)
    if n == 0 or nd == 1 or steps == 0:
        # nothing to search; place() still re-checks the start's feasibility
        return cur
    if cur.min() < 0 or cur.max() >= nd:
        raise RuntimeError(f"anneal: start placer {start!r} returned an invalid device array")  # a bug

    model = DevplaceModel(graph, cluster)
    memory = cluster.memory
    res = model.run(cur)
    cur_ok, cur_t = res.feasible, res.step_time_s
    cur_over = _overflow(res.peak_memory_bytes, memory)
    best = cur.copy() if cur_ok else None
    best_t = cur_t if cur_ok else math.inf
    gap = res.step_time_s - lower_bound(graph, cluster).value_s
    if cur_ok and gap <= 0:
        return cur  # at the lower bound: optimal
    temp0 = initial_temp * max(gap, 0.0)
    cooling = math.log(final_temp / initial_temp)
    neighbours = _neighbours(graph)
    visit = np.asarray(order, dtype=np.int64).tolist()
    rng = np.random.Generator(np.random.PCG64(seed))

    for k in range(steps):
        if progress is not None and k % 100 == 0:
            progress(k, steps)
        done = k / steps
        if time_limit_s is not None:
            elapsed = time.perf_counter() - began
            if elapsed >= time_limit_s:
                break
            done = max(done, elapsed / time_limit_s)
        temp = temp0 * math.exp(cooling * done)
        u_move, u_pick, u_accept = rng.random(3).tolist()
        v = visit[k % n]
        dv = int(cur[v])
        w = -1
        if u_move < swap_prob:
            others = [x for x in neighbours[v] if cur[x] != dv]
            if others:
                w = others[min(int(u_pick * len(others)), len(others) - 1)]
        if w >= 0:
            cur[v], cur[w] = cur[w], dv
        else:
            cur[v] = (dv + 1 + min(int(u_pick * (nd - 1)), nd - 2)) % nd
        res = model.run(cur)
        new_t, new_ok = res.step_time_s, res.feasible
        if new_ok:
            accept = (not cur_ok or new_t <= cur_t
                      or (temp > 0 and u_accept < math.exp(-(new_t - cur_t) / temp)))
            new_over = 0.0
        else:
            new_over = _overflow(res.peak_memory_bytes, memory)
            accept = not cur_ok and new_over <= cur_over
        if accept:
            cur_ok, cur_t, cur_over = new_ok, new_t, new_over
            if new_ok and new_t < best_t:
                best_t = new_t
                best = cur.copy()
        elif w >= 0:
            cur[w], cur[v] = cur[v], dv
        else:
            cur[v] = dv
    if best is None:
        raise no_fit_error(graph, cluster, "anneal", f"neither the start placement ({start!r}) nor any of the "
                                                     "searched moves is within every device's memory")
    return best

"""`even-refine`: local search on the simulator that starts from the `even` split and never ends worse.

The `even` baseline (devplace.placers.even) cuts the program-ordered sequence of tie classes into k
contiguous, equal-compute parts. It ignores communication and parallel branches: a two-tower model whose
towers are cut into consecutive parts, or a tower that shares a device with the tail of the other, serialises
work that could overlap. This placer keeps the even split's representation -- a device per position of the
class sequence -- and improves it with block moves, each simulated in full on the graph it is given:

- a *run* is a maximal stretch of the sequence on one device (the even split has k of them);
- a move gives a block of positions to another device: the last or first 1, 2, 4, ... positions of a run
  (moving a cut between two parts, or peeling a stretch off to a third device), a whole run (an idle device
  takes a branch; two runs on one device merge), or any single position (branches that the sequence
  interleaves -- the topological order of a graph without module paths -- come apart one class at a time).

Moves are tried in a fixed order (runs left to right, per run its blocks largest first, devices by index;
then the single positions), and the first one that fits in memory and makes the step strictly shorter (by
more than one part in 1e9, so float noise cannot cycle), or keeps it and lowers the sum of the ops' finish
times (so a move that lets one branch finish sooner counts while another still sets the step time), is
kept; the scan goes on after it, over the moves of the new placement, and stops when a whole cycle of
moves finds none (a local optimum) or after `max_evals` simulations. When the even split itself is over
memory, moves that lower the total overflow are kept until one fits (a repair walk); if none ever fits,
NoFitError. Deterministic (no randomness; `seed` unused).

It takes `ties`, so under the autograd rule it places the graph itself and simulates the real dependencies
(the backward pass waits for the loss): every move gives whole tie classes to a device. The start is the
`even` placer's own split of this graph, so on the graph it is given the result is never slower than `even`.
Given a coarse graph (`place_expanded`), that is a promise about the coarse graph only: the full graph's
simulation schedules ops one by one and can rank two placements the other way (llama-1b on 4xV100-16GB,
docs/performance.md "Beyond the zoo").

Cost: at most `max_evals` simulations, O((V + E) log V) each; a cycle of moves is about (runs x 2 log2(run
length) + runs + classes) x (k - 1) simulations: a few hundred for a few hundred classes on 4 devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import numpy as np

from devplace.defaults import MAX_SEARCH_STEPS
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.common import describe_oom, positive_int
from devplace.placers.even import class_devices, even_split
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel

DEFAULT_MAX_EVALS = 3000
REL_TOL = 1e-9  # a move must shorten the step by more than this share of it


def _runs(part: np.ndarray) -> list[tuple[int, int]]:
    """Maximal stretches [start, stop) of equal device in `part`."""
    change = np.flatnonzero(np.diff(part)) + 1
    bounds = [0, *change.tolist(), len(part)]
    return list(pairwise(bounds))


def _moves(part: np.ndarray, num_devices: int) -> Iterator[tuple[int, int, int]]:
    """Candidate block moves (start, stop, device) of a placement of the sequence, in the fixed scan order."""
    for start, stop in _runs(part):
        here = int(part[start])
        blocks: list[tuple[int, int]] = []
        size = 1
        while size < stop - start:
            blocks.append((stop - size, stop))  # the run's last positions: its right cut moves left
            blocks.append((start, start + size))  # its first positions: its left cut moves right
            size *= 2
        blocks.sort(key=lambda b: b[0] - b[1])  # largest first (stable: ends before starts)
        blocks.append((start, stop))
        for lo, hi in blocks:
            for d in range(num_devices):
                if d != here:
                    yield lo, hi, d
    # then every single position (inside runs too: branches that the sequence interleaves move one by one)
    for i, here in enumerate(part.tolist()):
        for d in range(num_devices):
            if d != here:
                yield i, i + 1, d


def _check_settings(max_evals: int) -> int:
    return positive_int(max_evals, "max_evals", "even-refine", MAX_SEARCH_STEPS)


@register("even-refine", uses_order=False, check=_check_settings, refines=lambda settings: "even")
def even_refine(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int = 0,
                max_evals: int = DEFAULT_MAX_EVALS, ties: np.ndarray | None = None) -> np.ndarray:
    """Local search from the `even` split: moves blocks of the class sequence between devices while the step shortens.

    Starts from `even`'s split of the graph (a device per position of the program-ordered tie class
    sequence); tries, in a fixed order, giving the first or last 1, 2, 4, ... positions of a run, a whole run
    or one position to another device, and keeps the first move that fits in memory and shortens the
    simulated step (or keeps it and lowers the sum of the ops' finish times), until a full cycle of moves
    finds none or `max_evals` simulations are spent. Never slower than `even` on the graph
    it places; a start that is over memory is repaired by moves that lower the overflow (else NoFitError).
    Whole tie classes move (`ties` makes `place` hand it the graph itself). Deterministic; `seed` unused.
    """
    max_evals = _check_settings(max_evals)
    nd = cluster.num_devices
    classes, seq, part = even_split(graph, nd)
    if graph.num_nodes == 0 or nd == 1:
        return class_devices(classes, seq, part)
    model = DevplaceModel(graph, cluster)

    def score(candidate: np.ndarray) -> tuple[bool, float, float, float, str]:
        """(fits, step time, sum of the ops' finish times, total overflow, what is over memory) of a device per
        sequence position."""
        result = model.run(class_devices(classes, seq, candidate))
        over = float(np.maximum(result.peak_memory_bytes - result.memory_bytes, 0.0).sum())
        return (result.feasible, result.step_time_s, float(result.finish_s.sum()), over,
                "" if result.feasible else describe_oom(result))

    fits, step, flow, over, oom = score(part)
    evals = 1
    moves = list(_moves(part, nd))
    at, failed = 0, 0  # the scan's position in `moves` (cyclic) and the moves tried since the last change
    while evals < max_evals and failed < len(moves):
        lo, hi, d = moves[at % len(moves)]
        trial = part.copy()
        trial[lo:hi] = d
        t_fits, t_step, t_flow, t_over, t_oom = score(trial)
        evals += 1
        if fits:
            # shorter, or as short with the ops finishing earlier overall: the second criterion crosses the
            # plateaus where one branch is done sooner but another still sets the step time
            better = t_fits and (t_step < step * (1.0 - REL_TOL)
                                 or (t_step <= step and t_flow < flow * (1.0 - REL_TOL)))
        else:
            better = t_fits or t_over < over
        if better:
            part, fits, step, flow, over, oom = trial, t_fits, t_step, t_flow, t_over, t_oom
            # the scan goes on from here over the moves of the new placement: a full cycle of them without a
            # change is a local optimum
            moves = list(_moves(part, nd))
            failed = 0
        else:
            failed += 1
        at = (at + 1) % len(moves)
    if not fits:
        raise no_fit_error(graph, cluster, "even-refine", f"the even split and every move searched from it are "
                                                          f"over memory (last: {oom})")
    return class_devices(classes, seq, part)

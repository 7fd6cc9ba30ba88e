"""A nested search over parallel plans (DESIGN.md section 9b): data-parallel degree, pipeline stages, ZeRO stage
and recomputation, each plan judged by `devplace.sim.parallel.simulate_parallel`.

The graph is one micro-batch, captured at `microbatch_size` samples, so one capture serves every plan: for each
data-parallel degree dp that divides the cluster's devices and leaves whole micro-batches (batch divisible by
dp * microbatch_size), the pipeline has pp = devices / dp stages and M = batch / (dp * microbatch_size)
micro-batches. The devices form the plan's default mesh: a stage's dp replicas on consecutive devices (inside a
node first), so the pipeline's hops cross nodes and the gradient syncs stay inside them where they can.

For pp > 1 the `pipeline` placer (`pipeline_plan`, as a function: the cuts, the micro-batch schedule and its
refinement are its own) cuts the graph into pp stages on replica 0's devices, without sharding or
recomputation; where no such split fits memory, it cuts on devices with room to spare, and the ZeRO stages and
recomputation below decide whether the plan fits. It cuts once per layout: for the first schedule of one chunk
per device (1F1B; zero bubble with one chunk is ZB-H1), and for the first V-shaped one (ZBV) into 2 pp stages on
the V's device map (stage k on position k, then 2 pp - 1 - k on the way back), its dynamic program and
simulator judging that layout; a schedule torch does not run at the plan's M (`Schedule.unrunnable`: 1F1B and
DualPipeV with fewer micro-batches than stages) is a candidate not judged. Every schedule, ZeRO stage (0 only
when dp = 1) and recomputation choice (the same for all stages) is then simulated on its layout's stages
(recomputation is not simulated where the same plan fits without it: it only adds work). Where no
recomputation is over memory and full recomputation fits, each stage then recomputes the fewest of its blocks
that a memory model of the two simulations says fit (`fewest_blocks`: none for a stage that fits), one more
plan judged; the fastest plan that fits memory wins (ties: the first in the order dp ascending, schedule, ZeRO
ascending, no recomputation first, then full, then some blocks).

A data-parallel degree whose lower bound (`microbatch_work_bound` of each replica's devices: its M micro-batches'
forward and backward work shared by them, the largest over the replicas) is not below the fastest plan found
before it (in this search, or `beat`, another search's) is skipped before it is cut: every plan of it has a step
at least that bound, so none would be strictly faster, and of equal steps the one found first wins anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from devplace.errors import DevplaceError
from devplace.graph.batch import MICROBATCHES_META_KEY, graph_batch
from devplace.graph.compgraph import CompGraph
from devplace.graph.parallel import RECOMPUTE, ZERO_STAGES, ParallelPlan, runtime_gap
from devplace.graph.phases import accumulation_extended, step_compute_extended
from devplace.graph.schedule import V_SHAPED, Schedule
from devplace.graph.ties import tie_classes_extended
from devplace.hardware.cluster import Cluster, Link
from devplace.placers.memory import NoFitError
from devplace.placers.pipeline import pipeline_plan
from devplace.sim.bounds import microbatch_work_bound
from devplace.sim.parallel import ParallelResult, op_blocks, simulate_parallel, stage_blocks, stage_layout

# the pipeline schedules judged on each cut (for pp > 1): one chunk per device, cut for the first of them, and the
# V-shaped ones (two chunks per device, in a V), cut for the first of those over their 2 pp stages
SCHEDULES = ("1f1b", "zero-bubble", *V_SHAPED)
ROOM = 1e3  # memory factor of the devices a pipeline is cut on when no split fits without sharding


@dataclass(frozen=True)
class Candidate:
    """One plan the search judged: its simulated step, whether it fits, and why it was not judged (`note`); without
    a plan (no pipeline was cut, or the schedule does not run at that M), `kind` names the schedule it was for."""

    plan: ParallelPlan | None
    dp: int
    step_time_s: float | None
    feasible: bool
    note: str = ""
    kind: str = ""

    def label(self, m: int) -> str:
        """The plan's label, or, without a plan, its dp, M (`m` micro-batches in all) and schedule."""
        return self.plan.label if self.plan is not None else f"dp={self.dp} M={m // self.dp} {self.kind}"


@dataclass(frozen=True)
class ParallelSearch:
    """The best plan found (`best`, simulated, with `stage`: each op's pipeline stage) and every candidate; `best`
    and `stage` are None only where every candidate was skipped by its bound (`search_parallel`'s `beat`)."""

    best: ParallelResult | None
    stage: np.ndarray | None
    candidates: tuple[Candidate, ...]


def search_parallel(graph: CompGraph, cluster: Cluster, *, batch: int, microbatch_size: int,
                    dps: tuple[int, ...] | None = None, zeros: tuple[int, ...] = ZERO_STAGES,
                    recomputes: tuple[str, ...] = RECOMPUTE, schedules: tuple[str, ...] = SCHEDULES,
                    runnable: bool = False, beat: float = math.inf) -> ParallelSearch:
    """The fastest plan that fits memory for a global `batch` on all of `cluster`'s devices (module
    docstring). `graph` is one micro-batch of `microbatch_size` samples; `dps` the data-parallel degrees to try
    (default: every one that divides the devices and leaves whole micro-batches); `schedules` the pipeline
    schedules judged on each cut (for pp > 1; the placer cuts for the first; one chunk per device, so
    "zero-bubble" is ZB-H1). With `runnable`, a plan devplace's runtime does not run (`runtime_gap`: ZeRO-3 under
    zero bubble) is a candidate not judged, the gap its note. A degree whose lower bound is not below `beat` (a
    step found elsewhere) or the fastest plan found before it is skipped (module docstring), a candidate saying
    so; where every one is, the answer has no `best`. DevplaceError when no plan fits, naming each candidate's
    outcome."""
    n = cluster.num_devices
    recorded = graph_batch(graph)
    if recorded is not None and recorded != microbatch_size:
        raise DevplaceError(f"graph {graph.name!r} was captured at batch {recorded}, not at the micro-batch size "
                            f"{microbatch_size}; capture one micro-batch, or pass microbatch_size={recorded}")
    if microbatch_size < 1 or batch < 1 or batch % microbatch_size:
        raise DevplaceError(f"the batch of {batch} is not a whole number of micro-batches of {microbatch_size}; "
                            "use a micro-batch size that divides the batch")
    fitting = tuple(d for d in range(1, n + 1) if n % d == 0 and (batch // microbatch_size) % d == 0)
    choices = dps or fitting
    if set(choices) - set(fitting):
        raise DevplaceError(f"data-parallel degrees {sorted(set(choices) - set(fitting))} do not divide the "
                            f"{n} devices and the {batch // microbatch_size} micro-batches of the batch; use some "
                            f"of {', '.join(map(str, fitting))}")
    candidates: list[Candidate] = []
    judged: list[tuple[float, ParallelResult, np.ndarray]] = []
    skipped = False
    for dp in choices:
        pp, m = n // dp, batch // microbatch_size // dp
        one = as_microbatch(graph, m)
        fastest = min([beat, *(step for step, _, _ in judged)])
        bound = _replicas_bound(one, cluster, ParallelPlan(dp, pp, m, batch, "1f1b" if pp > 1 else "none"))
        if bound >= fastest:
            candidates.append(Candidate(None, dp, None, False, f"skipped: no plan beats {fastest:.4g} s (its lower "
                                        f"bound is {bound:.4g} s)", "/".join(schedules) if pp > 1 else "none"))
            skipped = True
            continue
        cuts: dict[bool, np.ndarray | None] = {}  # per layout (V-shaped or not), its cut; None: none fits
        for kind in schedules if pp > 1 else ("none",):
            v_shaped = kind in V_SHAPED
            why = Schedule(kind, m, 2 if v_shaped else 1).unrunnable(pp) if pp > 1 else None
            if why is not None:
                candidates.append(Candidate(None, dp, None, False, why, kind))
                continue
            if v_shaped not in cuts:  # the first schedule of a layout cuts for every schedule of it
                cuts[v_shaped] = _cut(one, cluster, dp, pp, m, batch, kind, candidates)
            stage = cuts[v_shaped]
            if stage is None:
                continue
            for zero in (z for z in zeros if dp > 1 or z == 0):
                fits_without = False
                simulated: dict[str, ParallelResult] = {}
                for recompute in recomputes:
                    plan = ParallelPlan(dp, pp, m, batch, kind, chunks=2 if v_shaped else 1, zero=zero,
                                        recompute=recompute)
                    gap = runtime_gap(plan) if runnable else None
                    if gap is not None:
                        candidates.append(Candidate(plan, dp, None, False, f"devplace run does not run {gap}"))
                        continue
                    if recompute != "none" and fits_without:  # recomputation only adds work to a plan that fits
                        candidates.append(Candidate(plan, dp, None, False, "skipped: the same plan fits without "
                                                    "recomputation, which only adds work"))
                        continue
                    result = simulated[recompute] = simulate_parallel(one, cluster, stage, plan)
                    candidates.append(Candidate(plan, dp, result.step_time_s, result.feasible))
                    if result.feasible:
                        judged.append((result.step_time_s, result, stage))
                        fits_without = fits_without or recompute == "none"
                if "none" in simulated and "full" in simulated and simulated["full"].feasible and not fits_without:
                    partial = fewest_blocks(one, cluster, stage, simulated["none"], simulated["full"])
                    if partial is not None:
                        candidates.append(Candidate(partial.plan, dp, partial.step_time_s, partial.feasible,
                                                    "" if partial.feasible else "over memory (the memory model's "
                                                    "number of blocks)"))
                        if partial.feasible:
                            judged.append((partial.step_time_s, partial, stage))
    if not judged and skipped:
        return ParallelSearch(None, None, tuple(candidates))
    if not judged:
        tried = "; ".join(f"{c.label(batch // microbatch_size)}: {c.note or 'over memory'}" for c in candidates)
        raise DevplaceError(f"no parallel plan of {graph.name!r} at batch {batch} fits {cluster.name!r} ({tried}); "
                            "use more devices or a smaller micro-batch")
    _, best, stage = min(judged, key=lambda x: x[0])
    return ParallelSearch(best, stage, tuple(candidates))


def _replicas_bound(graph: CompGraph, cluster: Cluster, plan: ParallelPlan) -> float:
    """A lower bound on the step of every plan with `plan`'s dp, pp and M, whatever its schedule, cut, ZeRO stage
    and recomputation: each replica runs a pipeline of the M micro-batches of `graph` on its devices, and the
    plan's step is at least each replica's pipelined step (`simulate_parallel`: the largest of them and the
    syncs' ends), so at least the largest of their `microbatch_work_bound`s (replicas on devices of the same
    kinds computed once)."""
    bounds: dict[tuple[str, ...], float] = {}
    for r in range(plan.dp):
        devices = plan.replica(r)
        kinds = tuple(sorted(f"{cluster.devices[d].kind}/{cluster.devices[d].speed!r}" for d in devices))
        if kinds not in bounds:
            bounds[kinds] = microbatch_work_bound(graph, sub_cluster(cluster, devices), plan.microbatches)
    return max(bounds.values())


def fewest_blocks(graph: CompGraph, cluster: Cluster, stage: np.ndarray, none: ParallelResult,
                  full: ParallelResult) -> ParallelResult | None:
    """The plan of `none` (no recomputation, over memory) with each stage recomputing the fewest of its blocks
    that the memory model says fit, simulated; None where that is every block of every stage (`full`, judged
    already). The model, from the two simulations: a stage's peak falls linearly from its peak without
    recomputation to its peak with all n of its blocks recomputed, (none - full) / n per block, so a stage
    over its devices' memory by `over` recomputes ceil(over / that) blocks; a stage that fits recomputes none.
    No retry: the answer is judged like any candidate (the plan with "full" stays the fallback)."""
    pp = none.plan.pp
    counts = stage_blocks(op_blocks(graph), stage_layout(none.plan, stage)[0], pp)
    ks: list[int | str] = []
    for s in range(pp):
        n = counts[s].size
        mine = [(a, b) for a, b in zip(none.memory, full.memory, strict=True) if a.stage == s]
        over = max(a.total - a.capacity for a, _ in mine)
        per_block = min(a.total - b.total for a, b in mine) / max(n, 1)
        if over <= 0:
            ks.append("none")
        elif n == 0 or per_block <= 0:
            ks.append("full")
        else:  # all n blocks is "full"
            k = math.ceil(over / per_block)
            ks.append(k if k < n else "full")
    if all(k == "full" for k in ks) or all(k == "none" for k in ks):
        return None
    return simulate_parallel(graph, cluster, stage, replace(none.plan, recompute=tuple(ks)))


def _cut(graph: CompGraph, cluster: Cluster, dp: int, pp: int, m: int, batch: int, kind: str,
         candidates: list[Candidate]) -> np.ndarray | None:
    """Each op's pipeline stage: for pp = 1 stage 0, else the pipeline placer's cut for schedule `kind` on the
    devices of replica 0 (`_stages`); None, with a candidate saying why, where it finds no pipeline."""
    if pp == 1:
        return np.zeros(graph.num_nodes, dtype=np.int64)
    try:
        return _stages(graph, cluster, ParallelPlan(dp, pp, m, batch, kind).replica(0), m, kind)
    except NoFitError as exc:
        layout = f"{2 * pp} stages in a V" if kind in V_SHAPED else f"{pp} stages"
        candidates.append(Candidate(None, dp, None, False, f"no pipeline of {layout}: {exc}", kind))
        return None


def as_microbatch(graph: CompGraph, m: int) -> CompGraph:
    """`graph` marked as one of `m` micro-batches of its replica's step (meta "microbatches")."""
    if graph.meta.get(MICROBATCHES_META_KEY) == m:
        return graph
    # the graph's own columns (valid already), not its records through `CompGraph.build` (4 of them were 0.5 s of
    # llama-1b b4's default); + 0.0 as the records' round trip makes -0.0 of 0.0. The same nodes, records and
    # meta but the count: the tie classes and once-per-step seconds are the graph's
    marked = CompGraph.from_arrays(
        graph.name, graph.ids, graph.op, graph.kind, graph.group, graph.compute_s + 0.0, graph.output_bytes + 0.0,
        graph.param_bytes + 0.0, graph.temp_bytes + 0.0, graph.edge_src, graph.edge_dst, graph.edge_bytes + 0.0,
        graph.edge_tensor, meta={**graph.meta, MICROBATCHES_META_KEY: m},
        kind_compute={k: col + 0.0 for k, col in graph.kind_compute.items()}, node_extra=graph.node_extra,
        edge_extra=graph.edge_extra)
    tie_classes_extended(marked, graph)
    step_compute_extended(marked, graph)
    accumulation_extended(marked, graph)
    return marked


def _stages(graph: CompGraph, cluster: Cluster, replica: tuple[int, ...], m: int, schedule: str) -> np.ndarray:
    """Each op's pipeline stage (0..pp - 1, or 0..2 pp - 1 along a V): the pipeline placer's cut of `graph` for
    `schedule` on the devices `replica` (in that order), with room to spare where no split fits them (module
    docstring)."""
    sub = sub_cluster(cluster, replica)
    try:
        cut = pipeline_plan(graph, sub, graph.topo_order, schedule=schedule, microbatches=m)
    except NoFitError:
        roomy = Cluster(sub.name, tuple(replace(d, memory_bytes=d.memory_bytes * ROOM) for d in sub.devices),
                        sub.link, dict(sub.links), dict(sub.meta))
        cut = pipeline_plan(graph, roomy, graph.topo_order, schedule=schedule, microbatches=m)
    return cut.stage


def sub_cluster(cluster: Cluster, devices: tuple[int, ...]) -> Cluster:
    """The cluster of `devices` (device i of it is devices[i]) with the links among them."""
    index = {d: i for i, d in enumerate(devices)}
    links: dict[tuple[int, int], Link] = {(index[a], index[b]): lk for (a, b), lk in cluster.links.items()
                                          if a in index and b in index}
    return Cluster(cluster.name, tuple(cluster.devices[d] for d in devices), cluster.link, links, dict(cluster.meta))

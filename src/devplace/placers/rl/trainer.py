"""Training one placeto policy over many graphs (a family), with rollout workers in local processes or on Ray.

The loop is synchronous, one *round* per episode index: the learner sends the current weights to the
workers; graph i is handled by worker i mod W (round-robin); each worker runs one sampling episode per graph
it holds (starting from that graph's best feasible placement so far) and returns the episode log (states,
actions, rewards, entropies) and the best placement it saw. The learner then computes each episode's
discounted returns, subtracts that graph's per-step baseline (mean over its last `baseline_window` episodes),
divides by the advantages' std over the episode (`PlacetoHyper.discount`, `normalize_advantage`), sums the REINFORCE
gradients of all the round's episodes (each weighted 1 / #graphs), clips and takes one Adam step.

Determinism: the sampling seed of (round r, graph i) is derived from (seed, r, i) only, and the learner
processes the logs in graph order, so the curve does not depend on the backend or on the number of workers
(the rollouts run single-threaded everywhere). A checkpoint holds the optimizer state, every graph's recent
returns and best placement: resuming it continues the run exactly as if it had not stopped.

Cost: the learner's gradient step re-embeds every state of every episode with gradients (about two thirds
of an episode's time on one graph, see `train_placeto`), and it runs in the learner only; workers make the
rollouts parallel.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from devplace.defaults import CANONICAL_ORDER, DEFAULT_SEED, cpu_cores
from devplace.graph.compgraph import CompGraph
from devplace.graph.semantics import Semantics, semantics_of
from devplace.graph.ties import fold, is_tied
from devplace.hardware.cluster import Cluster
from devplace.orders import check_order_name, traversal_indices
from devplace.placers.registry import FullGraph, PlacerError
from devplace.placers.rl.checkpoint import PolicyFileError, load_policy, save_policy
from devplace.placers.rl.placeto import (
    EpisodeLog,
    PlacetoHyper,
    PlacetoPolicy,
    _GraphContext,
    accumulate_gradient,
    advantages_of,
    apply_gradient,
    check_settings,
    new_best,
    new_policy,
    num_parameters,
    returns_of,
    run_episode,
    single_thread,
    start_placement,
    update_steps,
)
from devplace.placers.rl.start import Judge

BACKENDS = ("local", "ray")
# progress(rounds done, rounds in this run, the rows of the round just done)
TrainProgress = Callable[[int, int, list[dict[str, Any]]], None]


@dataclass
class Rollout:
    """What a worker returns for one episode of one graph."""

    graph: int
    log: EpisodeLog
    best_devices: np.ndarray
    best_step_time_s: float


@dataclass
class TrainResult:
    """`train`'s result: the policy, the learning curve rows, and each graph's best feasible placement (`best`:
    name -> (a device per node of the graph as given, its step time there), judged as `train` says)."""

    policy: PlacetoPolicy
    rows: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)
    start_step_time_s: dict[str, float] = field(default_factory=dict)
    episodes_done: int = 0
    num_parameters: int = 0
    output: Path | None = None


class RolloutWorker:
    """Holds the contexts of some graphs and runs sampling episodes on them with the weights it is sent."""

    def __init__(self, graphs: dict[int, CompGraph], cluster: Cluster, hyper: PlacetoHyper,
                 orders: dict[int, np.ndarray]) -> None:
        torch.set_num_threads(1)
        self.hyper, self.orders = hyper, orders
        self.ctx = {i: _GraphContext(g, cluster, hyper) for i, g in graphs.items()}
        self.policy: PlacetoPolicy | None = None

    def rollout(self, graph: int, weights: dict[str, torch.Tensor], begin: np.ndarray, seed: int) -> Rollout:
        """One sampling episode of graph `graph` from placement `begin`, with the policy `weights`."""
        ctx = self.ctx[graph]
        if self.policy is None:
            self.policy = PlacetoPolicy(ctx.num_features, ctx.nd, self.hyper.hidden, self.hyper.rounds,
                                        self.hyper.encoder)
        self.policy.load_state_dict(weights)
        with single_thread():
            begin_result = ctx.model.run(begin)
            best = new_best(ctx, begin, begin_result.step_time_s)
            log = run_episode(self.policy, ctx, begin, begin_result, self.orders[graph], best,
                              torch.Generator().manual_seed(seed), memory_penalty=self.hyper.memory_penalty,
                              keep_states=True)
        return Rollout(graph, log, best.devices, best.step_time_s)


# --------------------------------------------------------------------------- backends

_PROCESS_WORKER: RolloutWorker | None = None


def _init_process_worker(graphs: dict[int, CompGraph], cluster: Cluster, hyper: PlacetoHyper,
                         orders: dict[int, np.ndarray]) -> None:
    global _PROCESS_WORKER
    _PROCESS_WORKER = RolloutWorker(graphs, cluster, hyper, orders)


def _process_rollout(graph: int, weights: dict[str, torch.Tensor], begin: np.ndarray, seed: int) -> Rollout:
    assert _PROCESS_WORKER is not None
    return _PROCESS_WORKER.rollout(graph, weights, begin, seed)


class _Backend:
    """Runs a round's rollouts on W workers, graph i on worker i mod W; results in graph order."""

    def __init__(self, graphs: Sequence[CompGraph], cluster: Cluster, hyper: PlacetoHyper,
                 orders: list[np.ndarray], workers: int, backend: str, address: str | None) -> None:
        self.workers = workers = max(1, min(workers, len(graphs)))
        self.kind = backend
        shares = [({i: graphs[i] for i in range(w, len(graphs), workers)},
                   {i: orders[i] for i in range(w, len(graphs), workers)}) for w in range(workers)]
        self._ray_started = False
        if backend == "ray":
            import ray

            if not ray.is_initialized():
                if address:
                    ray.init(address=address, log_to_driver=False)
                else:
                    # a cluster of its own, never one another process on this machine runs (see study.backends)
                    ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
                self._ray_started = True
            actor = ray.remote(num_cpus=1)(RolloutWorker)
            self.actors = [actor.remote(g, cluster, hyper, o) for g, o in shares]
        elif workers == 1:
            self.local = RolloutWorker(shares[0][0], cluster, hyper, shares[0][1])
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # spawn, not fork: a forked child of a process that already ran torch's thread pools can hang
            ctx = multiprocessing.get_context("spawn")
            self.pools = [ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_process_worker,
                                              initargs=(g, cluster, hyper, o)) for g, o in shares]

    def run(self, jobs: list[tuple[int, dict[str, torch.Tensor], np.ndarray, int]]) -> list[Rollout]:
        if self.kind == "ray":
            import ray

            weights_ref = ray.put(jobs[0][1]) if jobs else None
            refs = [self.actors[g % self.workers].rollout.remote(g, weights_ref, b, s) for g, _, b, s in jobs]
            rollouts = list(ray.get(refs))
            for ro in rollouts:  # Ray hands back read-only arrays; torch.from_numpy wants writable ones
                if ro.log.states is not None and not ro.log.states.flags.writeable:
                    ro.log.states, ro.log.pool_masks = ro.log.states.copy(), ro.log.pool_masks.copy()
            return rollouts
        if self.workers == 1:
            return [self.local.rollout(*job) for job in jobs]
        futures = [self.pools[job[0] % self.workers].submit(_process_rollout, *job) for job in jobs]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self.kind == "ray":
            import ray

            for a in self.actors:
                ray.kill(a)
            if self._ray_started:
                ray.shutdown()
        elif self.workers > 1:
            for p in self.pools:
                p.shutdown()


# --------------------------------------------------------------------------- the learner


def episode_seed(seed: int, round_: int, graph: int) -> int:
    """The sampling seed of graph `graph`'s episode in round `round_` (independent of the workers)."""
    return int(np.random.SeedSequence([seed, round_, graph]).generate_state(1, dtype=np.uint64)[0] >> 1)


def train(graphs: Sequence[CompGraph], cluster: Cluster, *, order: str = CANONICAL_ORDER,
          episodes: int = PlacetoHyper.episodes, seed: int = DEFAULT_SEED, encoder: str = PlacetoHyper.encoder,
          hidden: int = PlacetoHyper.hidden,
          rounds: int = PlacetoHyper.rounds, memory_penalty: float = PlacetoHyper.memory_penalty,
          sim_model: str = PlacetoHyper.sim_model, lr: float = PlacetoHyper.lr, start: str = PlacetoHyper.start,
          workers: int = 1, backend: str = "local", address: str | None = None, resume: str | Path | None = None,
          output: str | Path | None = None, log: str | Path | None = None,
          progress: TrainProgress | None = None, semantics: Semantics | str | None = None) -> TrainResult:
    """Train one placeto policy over `graphs` for `episodes` rounds (one sampling episode per graph per round).

    Graphs go round-robin to `workers` rollout workers: in this process (`backend="local"`, workers=1), in
    local processes (local, workers > 1) or as Ray actors (`backend="ray"`; Ray is started locally unless
    `address` names a running cluster). Each graph's first episode starts from `start` (see
    `PlacetoHyper.start`; the defaults of all settings are `PlacetoHyper`'s). `resume`: a checkpoint written
    by an earlier `train` to continue (its encoder, hidden and rounds win). `output`: write the policy
    checkpoint there; `log`: the learning curve CSV. The same seed, order and inputs give the same curve for
    any backend and number of workers.

    Each graph is placed under `semantics` (None: its own, `devplace.graph.semantics`: family graphs op by op):
    op by op the policy decides every node; as autograd runs, it decides the graph's tie classes (the folded
    graph, `devplace.graph.ties.fold`), in the local and the Ray workers alike. A graph's answer
    (`TrainResult.best`) is judged on the graph itself against its start and every single device that fits
    (`devplace.placers.rl.start.judged_best`), so it is never worse than either there.
    """
    if not graphs:
        raise PlacerError("train: no graphs to train on")
    if backend not in BACKENDS:
        raise PlacerError(f"train: unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= cpu_cores():
        raise PlacerError(f"train: workers must be an integer from 1 to {cpu_cores()} (the CPU cores of this "
                          f"machine), got {workers!r}")
    check_order_name(order)
    names = [g.name for g in graphs]
    if len(set(names)) != len(names):
        raise PlacerError("train: graph names must be distinct (they key the checkpoint's per-graph state)")
    hyper = PlacetoHyper(episodes=episodes, memory_penalty=memory_penalty, rounds=rounds, hidden=hidden,
                         encoder=encoder, sim_model=sim_model, lr=lr, start=start)
    state: dict[str, Any] = {}
    policy = None
    if resume is not None:
        policy, doc = load_policy(resume, num_devices=cluster.num_devices)
        hyper = replace(hyper, encoder=policy.encoder, hidden=policy.hidden, rounds=policy.rounds)
        state = doc.get("training") or {}
        if not state:
            raise PolicyFileError(f"{resume}: the checkpoint has no training state to resume (a policy saved "
                                  "without it can still start a new run with `devplace place --set policy=...`)")
    check_settings(hyper)
    fulls: list[FullGraph] = []
    views: list[CompGraph] = []
    for g in graphs:
        if semantics_of(g, semantics) is Semantics.AUTOGRAD and is_tied(g):
            folding = fold(g)
            views.append(folding.graph)
            fulls.append(FullGraph(g, folding.expand))
        else:
            views.append(g)
            fulls.append(FullGraph.same(g))
    with single_thread():
        return _train(views, names, fulls, cluster, order, seed, hyper, policy, state, workers, backend, address,
                      Path(output) if output is not None else None, log, progress)


def _train(graphs: list[CompGraph], names: list[str], fulls: list[FullGraph], cluster: Cluster, order: str,
           seed: int, hyper: PlacetoHyper,
           policy: PlacetoPolicy | None, state: dict[str, Any], workers: int, backend: str, address: str | None,
           output: Path | None, log: str | Path | None, progress: TrainProgress | None) -> TrainResult:
    t0 = time.perf_counter()
    orders = [traversal_indices(g, order, seed, cluster=cluster) for g in graphs]
    ctxs = [_GraphContext(g, cluster, hyper) for g in graphs]
    if policy is None:
        policy = new_policy(ctxs[0].num_features, cluster.num_devices, hyper, seed)
    opt = torch.optim.Adam(policy.parameters(), lr=hyper.lr)
    if state.get("optimizer"):
        try:
            opt.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:  # torch's errors for a state of other shapes
            raise PolicyFileError(f"the checkpoint's optimizer state does not fit its policy ({type(exc).__name__}: "
                                  f"{str(exc)[:200]}); the checkpoint is damaged: start a new run without --resume"
                                  ) from None
    done = int(state.get("episodes_done", 0))
    result = TrainResult(policy, num_parameters=num_parameters(policy), episodes_done=done)
    best = {}
    starts: list[np.ndarray] = []
    recent: list[deque[np.ndarray]] = []
    for i, (g, ctx) in enumerate(zip(graphs, ctxs, strict=True)):
        start, start_result = start_placement(ctx, orders[i], seed)
        starts.append(start)
        saved = state.get("best", {}).get(names[i])
        if saved is not None and len(saved) == g.num_nodes:  # the same graph as in the checkpoint
            devices = saved.numpy().astype(np.int64)
            best[i] = new_best(ctx, devices, float(ctx.model.run(devices).step_time_s))
        else:
            best[i] = new_best(ctx, start, start_result.step_time_s)
        past = state.get("baselines", {}).get(names[i])
        recent.append(deque([r for r in past.numpy()] if past is not None and past.shape[-1] == g.num_nodes else [],
                            maxlen=hyper.baseline_window))
    trainable = [i for i, g in enumerate(graphs) if g.num_nodes > 0] if cluster.num_devices > 1 else []
    pool = _Backend([graphs[i] for i in trainable], cluster, hyper, [orders[i] for i in trainable], workers,
                    backend, address) if trainable and hyper.episodes else None
    try:
        for r in range(done, done + hyper.episodes) if pool is not None else ():
            weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            jobs = [(k, weights, best[i].devices, episode_seed(seed, r, i)) for k, i in enumerate(trainable)]
            rollouts = pool.run(jobs)
            opt.zero_grad()
            rows = []
            for ro in rollouts:
                i = trainable[ro.graph]
                ctx = ctxs[i]
                if ro.best_step_time_s < best[i].step_time_s:
                    best[i].devices, best[i].step_time_s = ro.best_devices.copy(), ro.best_step_time_s
                adv = advantages_of(returns_of(ro.log, hyper.discount), recent[i], hyper)
                steps = update_steps(len(ro.log.actions), hyper, np.random.Generator(np.random.PCG64([seed, r, i])))
                accumulate_gradient(policy, ctx, ro.log, adv, hyper, weight=1.0 / len(trainable), steps=steps)
                rows.append({"episode": r, "graph": names[i], "step_time_s": ro.log.final_step_time_s,
                             "best_step_time_s": best[i].step_time_s, "entropy": float(np.mean(ro.log.entropies)),
                             "wall_s": time.perf_counter() - t0, "greedy": 0})
            apply_gradient(policy, opt, hyper)
            result.rows.extend(rows)
            result.episodes_done = r + 1
            if progress is not None:
                progress(r + 1 - done, hyper.episodes, rows)
    finally:
        if pool is not None:
            pool.close()
    for i, name in enumerate(names):  # judged on the graph as given: never worse than its start or one device
        judge = Judge(fulls[i], cluster, hyper.sim_model)
        devices, step = judge.best([best[i].devices, starts[i]])
        result.best[name] = (fulls[i].expand(devices), step)
        result.start_step_time_s[name] = judge.step(starts[i])
    if output is not None:
        training = {"episodes_done": result.episodes_done, "seed": seed, "order": order, "lr": hyper.lr,
                    "sim_model": hyper.sim_model, "memory_penalty": float(hyper.memory_penalty),
                    "graphs": list(names), "optimizer": opt.state_dict(),
                    "best": {names[i]: torch.as_tensor(best[i].devices) for i, g in enumerate(graphs)},
                    "baselines": {names[i]: torch.as_tensor(np.stack(recent[i])) for i, g in enumerate(graphs)
                                  if recent[i]}}
        result.output = save_policy(output, policy, training)
    if log is not None:
        from devplace.placers.rl.curve import write_curve

        write_curve(log, result.rows)
    return result


def parse_indices(text: str, limit: int) -> list[int]:
    """"0-23" or "0,3,5-7" -> sorted distinct indices, each in 0..limit-1 (a PlacerError otherwise)."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a, b = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise PlacerError(f"--graphs expects indices like 0-23 or 0,3,5-7, got {text!r}") from None
        if not 0 <= a <= b < limit:
            raise PlacerError(f"--graphs: {part!r} is outside 0-{limit - 1}")
        out.update(range(a, b + 1))
    return sorted(out)


def mean_best_ratio(result: TrainResult) -> float:
    """Geometric mean over graphs of best step time / start step time (below 1: the training improved)."""
    ratios = [result.best[n][1] / s for n, s in result.start_step_time_s.items() if s > 0]
    return math.exp(float(np.mean(np.log(ratios)))) if ratios else math.nan

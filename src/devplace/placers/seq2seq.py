"""`seq2seq`: the ColocRL one-shot RL placer (Mirhoseini et al., ICML 2017), read as the paper.

Model (all sizes in `Seq2SeqConfig`, the one place the hyperparameters live):
- Per-node features, read **in the given traversal order**: a hashed op-type embedding (crc32 of the op
  name into `op_buckets` buckets), the op's compute time, output bytes and parameter bytes (each divided by
  its largest value in the graph), and in-/out-degree (divided by the largest degree).
- Encoder: a bidirectional LSTM over that sequence (the paper's "groups in graph order"; here every node
  is one group -- coarsen the graph first for large models).
- Decoder: an LSTM that emits one device per node, step t for node order[t]. Its input at step t is the
  trainable embedding of the device it sampled at step t-1 (a start embedding at t = 0) together with the
  encoder state of node t; content-based attention over all encoder states (Luong's "general" score,
  (W_d h_t) . (W_e e_s), chosen over Bahdanau's additive score because the latter keeps a [K, V, A]
  tensor per step for the backward pass) gives a context vector, and a linear layer on
  [decoder state; context] gives the device logits (optionally clipped, clip x tanh(logits / clip)), plus a
  learned "stay" bonus (initial value `stay_bias`) for the devices of the node's graph neighbours already
  placed, split by edge bytes (or, `stay_target="previous"`, for the previous node's device). Autoregressive.
  The bonus is the start of training: with uniform first samples, a random placement of a family graph is
  2-4x slower than one device, so REINFORCE only learned to put everything on one device.
- REINFORCE: each iteration samples a batch of `samples` placements; cost = sqrt(simulated step time)
  (the paper's, divided by sqrt of the serial time on the fastest device so it is about 1 for any graph;
  `cost="log"` for log);
  an infeasible sample's cost grows by `memory_penalty` x its relative overflow (sum over devices of
  bytes over memory / memory). Loss = mean((cost - b) x log p(placement)) - entropy_coef x entropy, with b a
  moving average of the batch mean cost (decay 0.9; `baseline="batch"`: the batch's own mean, as HDP);
  gradients clipped by norm; Adam.
- Start (`start="classic"`, the default): the best classic placement (m-etf, m-sct, heft, m-topo, contiguous,
  single; devplace.placers.rl.start) is the best so far before the first sample, and a learned logit bonus
  (initial `start_bias`) for each node's device in it centres the samples on it. `start="none"`: the plain
  ColocRL decoder, as measured below.
- Result: the best memory-feasible placement seen (sampled, or the start); when none fits, m-etf's placement
  (which raises NoFitError itself when nothing fits).

Deterministic for a seed: numpy's Generator(PCG64(seed)) draws two seeds; parameters are initialised
under torch.manual_seed(first) (inside fork_rng, so the caller's torch RNG is untouched) and placements
are sampled from a torch.Generator seeded with the second. `train_seq2seq` returns the
per-iteration learning curve with the placement.

Cost: the decoder is a Python loop of V LSTM steps each attending over V encoder states, so an iteration
is V sequential steps forward and backward and O(V^2 x hidden) of attention. Measured (torch on one
thread, 8 samples, hidden 64, 3 devices, layered_graph(V, width=12), a shared 2-core machine):
V = 300: 0.28-0.37 s per iteration (15-19 s for the default 50); V = 1,000: 1.0-1.1 s; V = 3,000:
5.1-5.3 s (the V^2 attention and the autograd tape start to dominate); the neighbour bonus adds about
10% (300-node family graphs: 10.3-11.7 s -> 11.4-12.3 s for 50 iterations). A graph of many thousand nodes
should be coarsened (devplace.graph.coarsen) to a few hundred groups first, as the paper grouped ops.

Learning: 50 iterations x 8 samples is a small budget for REINFORCE on a one-shot V-long action (the
paper trained for hours). The policy clearly learns coarse structure (e.g. to leave a 10x slower device
empty, within about 20 iterations). On the family graphs (cifar10/ptb/nmt 0 at 100 groups, 3xGPU-placeto,
topo and dfs-preorder, seeds 0-2) the neighbour bonus took the best sample from 1.29x the lower bound
(geomean; worst 3.35x, cifar10 dfs-preorder) to 1.16x (worst 1.45x), 0.95x the better of m-etf and heft.
That gain is the start, not the learning: with lr = 0 the result is the same (1.15x), because 400
samples move the mean sampled step time only a few percent. Tried without a measurable gain: the batch
mean as baseline (HDP), advantage normalisation, log cost, logit clipping, a previous-node feature,
16 samples x 25 iterations; a larger lr or entropy either collapses the policy onto one device or keeps it
uniform.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from devplace.defaults import (
    DEFAULT_SIM_MODEL,
    MAX_EPISODES,
    MAX_SAMPLES,
    MAX_SEQ2SEQ_HIDDEN,
    SIM_DEVPLACE,
    SIM_MODELS,
    sim_model_name,
)
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, op_times
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import FullGraph, PlacerError, Progress, get_placer, register
from devplace.placers.rl.curve import write_curve
from devplace.placers.rl.start import best_classic, judged_best
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.placeto import PlacetoSimModel


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Every hyperparameter of the ColocRL placer."""

    episodes: int = 50  # REINFORCE iterations
    samples: int = 8  # placements sampled per iteration (the batch)
    hidden: int = 64  # LSTM hidden size (encoder per direction, decoder)
    op_buckets: int = 64  # hashed op-type vocabulary
    op_embed: int = 16  # op-type embedding size
    device_embed: int = 16  # device embedding size (decoder input)
    attention: int = 64  # attention projection size
    lr: float = 1e-3  # Adam learning rate (3e-3 collapsed the policy onto one device within ~20 iterations)
    baseline_decay: float = 0.9  # moving-average baseline: b <- decay b + (1 - decay) mean cost
    entropy_coef: float = 1e-3  # weight of the entropy bonus (entropy summed over nodes)
    grad_clip: float = 1.0  # gradient norm clipping
    memory_penalty: float = 1.0  # cost += memory_penalty x relative overflow for infeasible samples
    scale_advantage: bool = False  # divide (cost - baseline) by the batch's cost std (not in the paper)
    baseline: str = "ema"  # "ema": moving average of batch means (ColocRL); "batch": this batch's mean (HDP)
    cost: str = "sqrt"  # cost of a step time t (over serial): "sqrt" (ColocRL) or "log"
    # The start of training: a learned logit bonus (initial value stay_bias; 0 = the plain decoder, not learned)
    # for the devices of the node's already-placed graph neighbours ("graph", split by edge bytes) or of the
    # previous node of the order ("previous"). Without it the first samples are uniform over devices, 2-4x
    # slower than one device on the family graphs, and REINFORCE only learns to collapse onto one device.
    stay_bias: float = 4.0
    stay_target: str = "graph"
    logit_clip: float = 0.0  # > 0: logits = clip x tanh(logits / clip) (ColocRL/HDP's logit clipping)
    sim_model: str = DEFAULT_SIM_MODEL  # simulator of the reward: "devplace" or "placeto-sim" (the seed study's)
    # "classic": start from the best classic placement (devplace.placers.rl.start): it is the best so far before
    # the first sample, and the decoder gets a learned logit bonus (initial value start_bias) for each node's
    # device there, so the samples explore around it; "none": neither (the plain ColocRL start)
    start: str = "classic"
    start_bias: float = 3.0


NUM_NUMERIC = 5  # compute, output bytes, param bytes, in-degree, out-degree


def _scaled(x: np.ndarray) -> np.ndarray:
    top = float(x.max()) if x.size else 0.0
    return x / top if top > 0 else np.zeros_like(x)


def node_features(graph: CompGraph, op_buckets: int = Seq2SeqConfig.op_buckets) -> tuple[np.ndarray, np.ndarray]:
    """Per node (graph index order): the op-type bucket (int64[V]) and the numeric features (float32[V, 5]):
    compute time, output bytes, param bytes, in-degree, out-degree, each divided by its graph maximum."""
    n = graph.num_nodes
    buckets = np.array([zlib.crc32(op.encode()) % op_buckets for op in graph.op], dtype=np.int64)
    indeg = np.bincount(graph.edge_dst, minlength=n).astype(np.float64)
    outdeg = np.bincount(graph.edge_src, minlength=n).astype(np.float64)
    numeric = np.stack([_scaled(graph.compute_s), _scaled(graph.output_bytes), _scaled(graph.param_bytes),
                        _scaled(indeg), _scaled(outdeg)], axis=1) if n else np.zeros((0, NUM_NUMERIC))
    return buckets, numeric.astype(np.float32)


def encode_order(graph: CompGraph, order: np.ndarray,
                 op_buckets: int = Seq2SeqConfig.op_buckets) -> tuple[np.ndarray, np.ndarray]:
    """The encoder's input sequence: the features of `order[0]`, `order[1]`, ... (row t is node order[t])."""
    order = np.asarray(order, dtype=np.int64)
    buckets, numeric = node_features(graph, op_buckets)
    return buckets[order], numeric[order]


class ColocPolicy(nn.Module):
    """Bidirectional LSTM encoder + attentional LSTM decoder emitting one device per input node.
    The parameter count depends on the config and the number of devices only, not on the graph."""

    def __init__(self, cfg: Seq2SeqConfig, num_devices: int) -> None:
        super().__init__()
        h = cfg.hidden
        self.num_devices = num_devices
        self.op_embedding = nn.Embedding(cfg.op_buckets, cfg.op_embed)
        self.encoder = nn.LSTM(cfg.op_embed + NUM_NUMERIC, h, batch_first=True, bidirectional=True)
        self.device_embedding = nn.Embedding(num_devices + 1, cfg.device_embed)  # last row: start token
        self.decoder = nn.LSTMCell(cfg.device_embed + 2 * h, h)
        self.att_enc = nn.Linear(2 * h, cfg.attention, bias=False)
        self.att_dec = nn.Linear(h, cfg.attention)
        self.out = nn.Linear(h + 2 * h, num_devices)
        # learned only when switched on, so that stay_bias = 0 is exactly the plain decoder
        stay = torch.tensor(float(cfg.stay_bias))
        if cfg.stay_bias:
            self.stay = nn.Parameter(stay)
        else:
            self.register_buffer("stay", stay)
        self.logit_clip = cfg.logit_clip
        start = torch.tensor(float(cfg.start_bias if cfg.start == "classic" else 0.0))
        if float(start):
            self.start_bonus = nn.Parameter(start)
        else:
            self.register_buffer("start_bonus", start)

    def encode(self, buckets: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        """[V] buckets, [V, 5] features (in traversal order) -> encoder states [V, 2h]."""
        x = torch.cat([self.op_embedding(buckets), numeric], dim=1).unsqueeze(0)
        states, _ = self.encoder(x)
        return states[0]

    def forward(self, buckets: torch.Tensor, numeric: torch.Tensor, samples: int,
                generator: torch.Generator | None, greedy: bool = False,
                links: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                actions: torch.Tensor | None = None,
                prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample `samples` placements. Returns devices [K, V] (position t = node order[t]), the summed
        log-probability [K] and the summed entropy [K] of each. `links[t]`, when given, are the earlier
        positions joined to position t by an edge and their weights (summing to 1): the stay bonus goes to
        their devices instead of the previous position's. `actions` [K, V], when given, are taken instead of sampled
        (teacher forcing: the log-probabilities of given placements, to check what an update did). `prior` [V],
        when given, is a start placement (position t = node order[t]): its device gets the `start_bonus`."""
        enc = self.encode(buckets, numeric)  # [V, 2h]
        v = enc.shape[0]
        keys = self.att_enc(enc)  # [V, A], computed once
        h = enc.new_zeros(samples, self.decoder.hidden_size)
        c = torch.zeros_like(h)
        prev = torch.full((samples,), self.num_devices, dtype=torch.long)
        devices, logp, ent = [], enc.new_zeros(samples), enc.new_zeros(samples)
        placed = torch.zeros(samples, v, dtype=torch.long)  # the picks so far, for the graph-neighbour bonus
        for t in range(v):
            x = torch.cat([self.device_embedding(prev), enc[t].expand(samples, -1)], dim=1)
            h, c = self.decoder(x, (h, c))
            scores = self.att_dec(h) @ keys.T  # [K, V]
            context = torch.softmax(scores, dim=1) @ enc  # [K, 2h]
            logits = self.out(torch.cat([h, context], dim=1))
            if self.logit_clip > 0:
                logits = self.logit_clip * torch.tanh(logits / self.logit_clip)
            if links is not None:
                idx, w = links[t]
                if idx.numel():
                    near = (nn.functional.one_hot(placed[:, idx], self.num_devices) * w[None, :, None]).sum(1)
                    logits = logits + self.stay * near
            elif t > 0:
                logits = logits + self.stay * nn.functional.one_hot(prev, self.num_devices)
            if prior is not None:
                logits = logits + self.start_bonus * nn.functional.one_hot(prior[t], self.num_devices)
            log_probs = torch.log_softmax(logits, dim=1)
            probs = log_probs.exp()
            if actions is not None:
                pick = actions[:, t]
            elif greedy:
                pick = log_probs.argmax(dim=1)
            else:
                pick = torch.multinomial(probs.detach(), 1, generator=generator).squeeze(1)
            logp = logp + log_probs.gather(1, pick.unsqueeze(1)).squeeze(1)
            ent = ent - (probs * log_probs).sum(dim=1)
            devices.append(pick)
            placed[:, t] = pick
            prev = pick
        return torch.stack(devices, dim=1), logp, ent


@dataclass
class Seq2SeqResult:
    """The best feasible placement (device per node, graph index order) and the learning curve: per
    iteration the mean sampled step time, the best feasible step time so far (inf until one fits), the
    batch's mean cost, the baseline and the mean entropy per node; and the wall time at the end of each
    iteration (kept apart: the curve is deterministic for a seed, wall times are not)."""

    devices: np.ndarray
    best_step_time_s: float
    fallback: bool  # True when no sample fit and m-etf's placement was returned
    curve: list[dict[str, float]] = field(default_factory=list)
    num_parameters: int = 0
    wall_s: list[float] = field(default_factory=list)
    start: np.ndarray | None = None  # the best classic placement the samples were centred on (start "classic")


def _sample_cost(result, serial_s: float, penalty: float, kind: str = "sqrt") -> float:
    ratio = result.step_time_s / serial_s
    cost = math.sqrt(ratio) if kind == "sqrt" else math.log(ratio)
    if not result.feasible:
        over = np.maximum(result.peak_memory_bytes - result.memory_bytes, 0.0) / result.memory_bytes
        cost += penalty * float(over.sum())
    return cost


def earlier_links(graph: CompGraph, order: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per position t: the earlier positions joined to node order[t] by an edge (either direction) and their
    weights, the edges' bytes normalised to sum 1 (equal weights when all carry 0 bytes)."""
    n = order.size
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    ps, pd = pos[graph.edge_src], pos[graph.edge_dst]
    later, earlier = np.maximum(ps, pd), np.minimum(ps, pd)
    by = np.argsort(later, kind="stable")  # group the edges by their later end: O(E log E), not O(V E)
    bounds = np.searchsorted(later[by], np.arange(n + 1))
    links = []
    for t in range(n):
        sel = by[bounds[t]:bounds[t + 1]]
        idx, w = earlier[sel], graph.edge_bytes[sel].astype(np.float64)
        w = w / w.sum() if w.sum() > 0 else np.full(idx.size, 1.0 / max(idx.size, 1))
        links.append((torch.from_numpy(idx), torch.from_numpy(w.astype(np.float32))))
    return links


def reinforce_step(policy: nn.Module, optimizer: torch.optim.Optimizer, cfg: Seq2SeqConfig, cost: torch.Tensor,
                   baseline: float, logp: torch.Tensor, ent: torch.Tensor) -> None:
    """One policy-gradient update: descending (cost - baseline) x log p makes cheaper-than-baseline samples more
    likely and dearer ones less likely; the entropy bonus slows the collapse onto one placement."""
    advantage = cost - baseline
    if cfg.scale_advantage:
        advantage = advantage / (float(cost.std()) + 1e-3 * abs(baseline) + 1e-12)
    loss = (advantage * logp).mean() - cfg.entropy_coef * ent.mean()
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
    optimizer.step()


def train_seq2seq(graph: CompGraph, cluster: Cluster, order: np.ndarray, *, seed: int = 0,
                  config: Seq2SeqConfig | None = None, progress: Progress | None = None) -> Seq2SeqResult:
    """Train the ColocRL policy on one graph with REINFORCE; the best feasible sampled placement and the curve.

    Runs torch single-threaded (restored afterwards): the model's ops are small, so threads only add
    overhead, and oversubscribe a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(graph, cluster, order, seed, config or Seq2SeqConfig(), progress)
    finally:
        torch.set_num_threads(threads)


def _train(graph: CompGraph, cluster: Cluster, order: np.ndarray, seed: int, cfg: Seq2SeqConfig,
           progress: Progress | None) -> Seq2SeqResult:
    n, nd = graph.num_nodes, cluster.num_devices
    order = np.asarray(order, dtype=np.int64)
    if sorted(order.tolist()) != list(range(n)):
        raise PlacerError("seq2seq: order must be a permutation of the node indices")
    for name, value, allowed in (("baseline", cfg.baseline, ("ema", "batch")), ("cost", cfg.cost, ("sqrt", "log")),
                                 ("stay_target", cfg.stay_target, ("graph", "previous")),
                                 ("start", cfg.start, ("classic", "none"))):
        if value not in allowed:
            raise PlacerError(f"seq2seq: unknown {name} {value!r}; choose one of: {', '.join(allowed)}")
    rng = np.random.Generator(np.random.PCG64(seed))  # the seed's streams: one for the weights, one for sampling
    init_seed, sample_seed = (int(s) for s in rng.integers(0, 2**62, size=2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        policy = ColocPolicy(cfg, nd)
    nparams = sum(p.numel() for p in policy.parameters())
    if n == 0 or nd == 1:
        return Seq2SeqResult(np.zeros(n, dtype=np.int64), math.nan, False, [], nparams)
    generator = torch.Generator().manual_seed(sample_seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    # rewards from the chosen model; a sample becomes the answer only if it also fits under devplace (`place`'s check)
    ref = DevplaceModel(graph, cluster)
    model = ref if sim_model_name(cfg.sim_model) == SIM_DEVPLACE else PlacetoSimModel(graph, cluster)
    serial_s = max(float(op_times(graph, cluster).sum(axis=0).min()), 1e-30)
    b_np, x_np = encode_order(graph, order, cfg.op_buckets)
    buckets, numeric = torch.from_numpy(b_np), torch.from_numpy(x_np)
    links = earlier_links(graph, order) if cfg.stay_target == "graph" else None
    best, best_t, prior, start = None, math.inf, None, None
    if cfg.start == "classic":
        best, start_result, _ = best_classic(graph, cluster, model, seed)
        start = best
        best_t = start_result.step_time_s
        prior = torch.from_numpy(best[order])
    baseline: float | None = None
    curve: list[dict[str, float]] = []
    wall: list[float] = []
    t_start = time.perf_counter()
    for it in range(cfg.episodes):
        if progress is not None:
            progress(it, cfg.episodes)
        seq, logp, ent = policy(buckets, numeric, cfg.samples, generator, links=links, prior=prior)
        seq_np = seq.numpy()
        costs, times = [], []
        for k in range(cfg.samples):
            devices = np.empty(n, dtype=np.int64)
            devices[order] = seq_np[k]
            res = model.run(devices)
            costs.append(_sample_cost(res, serial_s, cfg.memory_penalty, cfg.cost))
            times.append(res.step_time_s)
            if res.step_time_s < best_t and (res.feasible if model is ref else ref.run(devices).feasible):
                best, best_t = devices, res.step_time_s
        cost = torch.tensor(costs, dtype=torch.float32)
        mean_cost = float(cost.mean())
        if baseline is None or cfg.baseline == "batch":
            baseline = mean_cost
        reinforce_step(policy, optimizer, cfg, cost, baseline, logp, ent)
        curve.append({"iteration": float(it), "mean_step_time_s": float(np.mean(times)), "best_step_time_s": best_t,
                      "mean_cost": mean_cost, "baseline": baseline, "entropy": float(ent.detach().mean()) / n})
        wall.append(time.perf_counter() - t_start)
        baseline = cfg.baseline_decay * baseline + (1.0 - cfg.baseline_decay) * mean_cost
    if progress is not None:
        progress(cfg.episodes, cfg.episodes)
    if best is None:
        return Seq2SeqResult(np.full(n, -1, dtype=np.int64), math.inf, True, curve, nparams, wall)
    return Seq2SeqResult(best, best_t, False, curve, nparams, wall, start=start)


def _check_settings(episodes: int, samples: int, hidden: int, memory_penalty: float, sim_model: str) -> None:
    for name, value, low, high in (("episodes", episodes, 0, MAX_EPISODES), ("samples", samples, 1, MAX_SAMPLES),
                                   ("hidden", hidden, 1, MAX_SEQ2SEQ_HIDDEN)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not low <= value <= high:
            raise PlacerError(f"seq2seq: {name} must be an integer >= {low} and at most {high:,}, got {value!r}")
    if not (isinstance(memory_penalty, int | float) and memory_penalty >= 0 and math.isfinite(memory_penalty)):
        raise PlacerError(f"seq2seq: memory_penalty must be a number >= 0, got {memory_penalty!r}")
    if sim_model_name(sim_model) not in SIM_MODELS:
        raise PlacerError(f"seq2seq: unknown sim_model {sim_model!r}; choose one of: {', '.join(SIM_MODELS)}")


@register("seq2seq", uses_order=True, check=_check_settings)
def seq2seq(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int = 0,
            episodes: int = Seq2SeqConfig.episodes, samples: int = Seq2SeqConfig.samples,
            hidden: int = Seq2SeqConfig.hidden, memory_penalty: float = Seq2SeqConfig.memory_penalty,
            sim_model: str = Seq2SeqConfig.sim_model, start: str = Seq2SeqConfig.start, log: str | None = None,
            progress: Progress | None = None, full: FullGraph | None = None) -> np.ndarray:
    """ColocRL one-shot RL: a bidirectional LSTM reads the nodes in the order, an LSTM decoder emits their devices.

    REINFORCE on sqrt(simulated step time) with a moving-average baseline, `samples` placements per
    iteration for `episodes` iterations, the decoder starting biased to keep graph neighbours together;
    infeasible samples pay `memory_penalty` x their relative memory overflow. `sim_model` ("devplace" or
    "placeto-sim", old name "placeto") is the simulator of the reward; the answer always fits under the
    devplace model. `start` "classic": the samples are centred on the best classic placement, which is also the
    best so far before the first sample; "none": the plain ColocRL decoder. Returns the best feasible placement
    seen (m-etf's when none fits), judged on `full` (given by `devplace.place`: the graph this one's nodes
    stand for) against the start and each single device that fits. `log`: write the learning curve there
    (CSV, one row per iteration: mean sampled step time, best so far, entropy; `devplace plot-curve`). Deterministic
    for a seed (the curve's wall times aside). Trains on one graph only (`devplace train` is placeto-only). About
    0.25 s per iteration for 300 nodes on 2 CPU cores; coarsen graphs of thousands of nodes first.
    """
    _check_settings(episodes, samples, hidden, memory_penalty, sim_model)
    cfg = Seq2SeqConfig(episodes=int(episodes), samples=int(samples), hidden=int(hidden),
                        memory_penalty=float(memory_penalty), sim_model=sim_model, start=start)
    result = train_seq2seq(graph, cluster, order, seed=seed, config=cfg, progress=progress)
    if log is not None:
        write_curve(log, ({"episode": int(c["iteration"]), "graph": graph.name, "step_time_s": c["mean_step_time_s"],
                           "best_step_time_s": c["best_step_time_s"], "entropy": c["entropy"], "wall_s": w,
                           "greedy": 0} for c, w in zip(result.curve, result.wall_s, strict=True)))
    if not result.fallback:
        candidates = [result.devices] + ([result.start] if result.start is not None else [])
        return judged_best(full or FullGraph.same(graph), cluster, sim_model_name(sim_model), candidates)[0]
    fallback = np.asarray(get_placer("m-etf").func(graph, cluster, order=order, seed=seed), dtype=np.int64)
    if not DevplaceModel(graph, cluster).run(fallback).feasible:
        raise no_fit_error(graph, cluster, "seq2seq", "no sampled placement and not m-etf's fits in memory")
    return fallback

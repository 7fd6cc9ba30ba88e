"""`placeto` ✱: Placeto-style reinforcement learning (Addanki et al., NeurIPS 2019), visiting nodes in `order`.

Read it as the paper (REFERENCES.md, "Placeto"); every hyperparameter is in `PlacetoHyper` below.

State (per node, one row each; every column divided by its largest absolute value over the graph, a column
of zeros left as is): compute time, output bytes, parameter bytes, the node's current device (one-hot),
its simulated start time under the current placement minus the current node's start time, a "done" bit
(visited in this episode) and a "current" bit.

Embedding: an MLP lifts the features to d (`hidden`); then k (`rounds`) rounds of
`x <- relu(g(A . relu(f(x)))) + h0` with sum aggregation, weights shared across rounds and a residual to the
lifted features h0, once forward along the edges (a node sums its parents) and once, with its own f and g,
backward (a node sums its children); the node embedding is the two concatenated (2d). Parallel edges
between one pair of nodes count once: the aggregation follows the graph's structure, not its tensors.
The message passing is plain torch (one sparse CSR product per round for both directions) rather than a
torch_geometric `MessagePassing` subclass: the same sum, but it runs unchanged on a batch of states of one
graph (`[steps, V, d]`), which the learning step needs (it re-embeds all the states of an episode at once),
and it avoids torch_geometric's per-call dispatch, which dominates at this size (one embedding per step, V per
episode). The sparse product on CPU is deterministic.

Policy: for the current node v, three pooled summaries -- over v's ancestors, its descendants and the nodes
parallel to it (no path either way) -- each `relu(g(sum(relu(f(x)))))` with its own f and g, concatenated
with v's embedding, then an MLP gives one logit per device. No weight depends on the graph (only the last
layer on the number of devices). Reachability is computed once per graph as bitsets (one row of V bits per
node, ancestors in topological order, descendants in reverse): O(E * V / 8) byte operations and V^2 / 8 bytes
of memory (12.5 MB at 10,000 nodes). On graphs with more than `pool_exact_max_nodes` nodes each of the three
sets is cut to its `pool_nearest` members closest to v in simulated start time (the paper's option).

Episode (iterative improvement): start from the best feasible placement so far -- first the best of the
classic placers' placements (`start="classic"`, the default) or all on device 0 (`start="device0"`; m-etf's
placement when that does not fit); visit every node once, in the traversal `order`; for each, sample its
device from the policy (the argmax in the final evaluation episode), re-simulate the whole placement (`devplace`
model; skipped when the device did not change) and reward the decrease of the log step time; a state over
memory also costs `memory_penalty x` its relative overflow (the largest over devices of bytes over / bytes
available, capped at `overflow_cap`). V actions and at most V + 1 simulations per episode.

Learning: REINFORCE with discount `discount` (0.5); `parallel` (1) episodes are sampled side by side from the same
start with the same weights, their states embedded in one batched product per step, then each episode makes one
update in turn (the later ones a few updates off-policy), re-embedding `update_fraction` (all) of its states,
drawn uniformly (an unbiased estimate of the mean over all its steps); the baseline for step t is the mean return
at step t over the last `baseline_window` episodes (this one included); the advantages (return - baseline) are
divided by their std over the episode (`normalize_advantage`); loss = -mean_t(advantage_t log pi(a_t)) -
entropy_weight mean_t(entropy_t) (a mean over steps, not a sum, so the gradient does not grow with the graph;
entropy weight 0.1); gradient clipped to global norm 1.25; Adam (lr 1e-3), one update per episode.
Why not discount 1 and raw advantages (the earlier defaults): on the study's family graphs (100 groups,
3xGPU-placeto) the policy then stayed near uniform (entropy 0.8-1.09 nats after 50 episodes in 11 of 12 runs,
ln 3 = 1.10) and episodes ended 1.2-4.7x the start, a random placement: the return of step t summed the noise of ~V
later random actions, and rewards are log ratios of ~0.01, as small as the entropy term. With the new
defaults the entropy falls (to 0.0-0.46) and the last episodes end at or below the start (0.90-1.00x);
see docs/learned-placers.md for the measured before/after. After `episodes` training episodes one
argmax episode is run. The answer is the best feasible placement seen in any state of any episode, judged
once more on the graph that runs (the full graph a folded one stands for, `devplace.placers.rl.start`) against
the start and every single device that fits: never worse than either there.

Hyperparameter sets (`HYPER_SETS`, the placer's `hyper` setting): the numbers above are the "devplace" set.
"placeto-paper" is the seed study's (Placeto's code as the seed ran it): discount 1, entropy weight 1, raw
advantages summed over the steps, a per-step baseline over all past episodes, no memory penalty, width 8, from all
on device 0, and a greedy evaluation every 5 episodes (episode 0, 5, ...) that neither learns nor changes the best;
`episodes` then counts them all and there is no final argmax episode. Sources: `HYPER_SETS` and
docs/learned-placers.md.

Encoders (`encoder`): "placeto-gnn" (above; old name "placeto"); "sage" -- GraphSAGE (torch_geometric's
`SAGEConv`, mean aggregation, separate root and neighbour weights) and "gat" -- one-head graph attention
(GATConv's form, with self loops, written with torch_geometric's segment softmax so it runs on a batch of
states). Both replace the f/g round by `x <- relu(conv(x)) + h0` with one conv per direction shared across
rounds; lift, pooling and head are the same, so the parameter count depends on `hidden` and the device count
only (weights are shared across rounds). Measured on a 300-node graph (rollout + learning step, one thread):
placeto-gnn 0.63 + 0.94 s, sage 1.37 + 1.04 s, gat 2.46 + 1.52 s per episode.

Simulation model (`sim_model`): "devplace" (the reference model) or "placeto-sim" (old name "placeto";
sim/placeto.py, the seed study's simulator). Rewards, states and the memory penalty use that model; the answer
must also fit under the devplace model (checked when a state improves on the best), because that is what `place` checks.

Training over a family of graphs and rollout workers live in `devplace.placers.rl.trainer`, checkpoints in
`devplace.placers.rl.checkpoint`.

Cost: per step one embedding of the graph without gradients (k rounds of two [2V, d] x [d, d] products and
one sparse product) and one simulation; per episode one batched re-embedding of its V states with
gradients, O(V (V + E) d k) -- quadratic in V, about 6 GFLOP forward for 300 nodes at d = 32, k = 8. The
embedding is recomputed from scratch at every step: every node's relative start time changes with each
re-simulation, so there is no cheap incremental update. See `train_placeto` for measured episode times.
The rollout's forward (placeto-gnn encoder, d <= 8) is one numba call per step (`devplace.placers.rl.rollout`: the
same function in float32, about a hundred torch calls fewer; 0.35 -> 0.17 ms per step on ptb/0 at d = 8); wider
policies and the sage and gat encoders run the torch forward, whose rounds run in place without gradients and
whose three pools' layers are one product each. With gradients the placeto-gnn rounds are one autograd function
(`_Rounds`) whose backward is autograd's own sequence of torch operations (the same gradients to the bit) on a
forward that runs in place (0.203 -> 0.177 s per learning step on ptb/0 at d = 8; larger update chunks were slower
at d = 32: 0.94 s at 1e6 floats, 1.07 s at 4e6, 1.98 s at 16e6), and whose neighbour sums are one numba pass
(`_sum_neighbours`, torch's CSR product to the bit from 32 columns on; 0.193 -> 0.164 s on ptb/0).
Memory per episode: the V states (V x V x features float32) and pooling masks (V x 3 x V bytes).

Determinism: weights are initialised under `torch.manual_seed(seed)` (inside `torch.random.fork_rng`, so
the caller's global generator is left alone) and actions are sampled with a `torch.Generator` seeded from
`seed`; the same seed, order and inputs give the same placement and the same learning curve on one machine
and thread count. The compiled rollout forward's logits differ from torch's in the last bits, so an action could
differ from the torch forward's where a uniform draw falls within ~1e-7 of a cumulative probability; on the graphs
checked (docs/performance.md) every action, curve and placement was the same.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch
from numba import njit
from torch import nn

from devplace.defaults import (
    DEFAULT_SIM_MODEL,
    ENCODER_ALIASES,
    ENCODER_PLACETO,
    ENCODERS,
    MAX_EPISODES,
    MAX_HIDDEN,
    MAX_PARALLEL,
    MAX_ROUNDS,
    SIM_DEVPLACE,
    SIM_MODEL_ALIASES,
    SIM_MODELS,
    encoder_name,
    sim_model_name,
)
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.placers.registry import FullGraph, PlacerError, Progress, get_placer, register
from devplace.placers.rl.rollout import (
    COMPILED_MAX_HIDDEN,
    RolloutGraph,
    rollout_graph,
    rollout_logits,
    rollout_weights,
)
from devplace.placers.rl.start import best_classic, judged_best
from devplace.sim.devplace_model import DevplaceModel
from devplace.sim.placeto import PlacetoModel
from devplace.sim.result import SimResult

# where the first episode starts: the best of the classic placers' placements (devplace.placers.rl.start, ranked
# under the reward's simulation model), or all on device 0 (m-etf's placement when that does not fit)
STARTS = ("classic", "device0")


@dataclass(frozen=True)
class PlacetoHyper:
    """Every hyperparameter of the placer, the one place their defaults live: the `placeto` placer's settings
    (episodes ... start) and `devplace.placers.rl.train`'s keyword arguments default to these fields."""

    episodes: int = 50  # training episodes (then one argmax episode)
    memory_penalty: float = 1.0  # reward -= memory_penalty * relative overflow of an over-memory state
    rounds: int = 8  # k: rounds of message passing per direction
    hidden: int = 32  # d: embedding width (node embeddings are 2d: forward ++ backward)
    encoder: str = ENCODER_PLACETO  # or an alias (defaults.ENCODER_ALIASES), stored by its name
    sim_model: str = DEFAULT_SIM_MODEL  # the simulator of rewards and states: "devplace" or "placeto-sim"
    lr: float = 1e-3  # Adam
    # "classic": start from the best classic placement (Placeto improves a given placement; from all on one
    # device placeto ended 10-21% behind heft / m-sct on ptb/0 and nmt/0 after 50 episodes); "device0": all on
    # device 0, or m-etf's placement when that does not fit
    start: str = "classic"
    # entropy bonus, per step (mean over steps). Against unit-std advantages 0.01 let the policy collapse to
    # "keep every device" within ~20 episodes; 0.1 explores longer (nmt/0, 30 episodes, discount 0.9: best
    # 0.966x the start at 0.01, 0.863x at 0.1)
    entropy_weight: float = 0.1
    grad_clip: float = 1.25  # global gradient norm
    baseline_window: int = 10  # episodes averaged by the per-step baseline (this one included)
    # training episodes sampled side by side from the same start (the best so far) with the same weights, their
    # states embedded in one batched product per step; then one Adam step per episode, in order (one step on the
    # batch's mean gradient learnt too little in 50 episodes: 7 updates). Off by default: faster per episode
    # but the policy learns slower per episode (docs/learned-placers.md, "Cost": 8 -> entropy 1.09 -> 0.58
    # after 25 episodes where 1 reaches 0.08)
    parallel: int = 1
    # the fraction of an episode's steps whose states the learning step re-embeds with gradients, drawn
    # uniformly (an unbiased estimate of the mean over all of them; the re-embedding is ~2/3 of an episode).
    # 1: all, the default, for the same reason (0.25 -> entropy 0.92 after 25 episodes)
    update_fraction: float = 1.0
    overflow_cap: float = 4.0  # cap on the relative overflow in the memory penalty
    pool_exact_max_nodes: int = 2000  # above this, pool only the `pool_nearest` closest in start time
    pool_nearest: int = 256
    # states re-embedded at once in the update: chunk * E * d <= this. All of an episode's states in one pass
    # was slower (300 groups: 0.91 s vs 0.65-0.69 s at 2.5e5-1e6; its activations miss the L2 cache)
    update_chunk_floats: int = 1_000_000
    # return_t = sum_k discount^k r_{t+k}. At 1 the return of step t carries the noise of all later random
    # actions (~V of them) and the policy stayed uniform; 0.5 credits an action with ~2 steps of consequences.
    # Placeto's released code has this knob (`disc_factor`); the seed study read 1.0.
    discount: float = 0.5
    # divide the episode's advantages by their std over the episode: log-ratio rewards are ~0.01, so the
    # REINFORCE term was as small as the entropy term and Adam's steps followed noise
    normalize_advantage: bool = True
    # the loss sums over the episode's steps (Placeto's: it adds every step's gradient) instead of taking the mean
    loss_sum: bool = False
    # k > 0: episode i is a greedy (argmax) evaluation when i % k == 0 -- it neither learns nor changes the best
    # placement -- and `episodes` counts every episode (Placeto's `--eval-freq`, `--n-eps`); there is then no
    # final argmax episode. 0: `episodes` training episodes, then one argmax episode whose states may become
    # the best
    eval_every: int = 0

    def __post_init__(self) -> None:
        # old names stored as the names they stand for, so comparisons, checkpoints and logs see one spelling
        if isinstance(self.encoder, str):
            object.__setattr__(self, "encoder", encoder_name(self.encoder))
        if isinstance(self.sim_model, str):
            object.__setattr__(self, "sim_model", sim_model_name(self.sim_model))


# The named hyperparameter sets (the `placeto` placer's `hyper` setting). "devplace": this project's, tuned so that
# the policy learns within 50 episodes (see the fields' comments). "placeto-paper": the seed study's, read from its
# code (github.com/bwhub/Graph_Traversal_Order_in_Device_Placement at commit 0e9df248fd1e3e8e4ddf908a80ed89e7c6c2c227,
# "SEED" below) where it sets them, else from Placeto's (github.com/aravic/generalizable-device-placement at
# d9a81a9f6cb05bfc94773722a4e7ead793ca7fd1, "PLACETO"); docs/learned-placers.md lists every value with its source.
HYPER_DEVPLACE = "devplace"
HYPER_PLACETO_PAPER = "placeto-paper"
HYPER_SETS: dict[str, PlacetoHyper] = {
    HYPER_DEVPLACE: PlacetoHyper(),
    HYPER_PLACETO_PAPER: PlacetoHyper(
        episodes=50,  # SEED config/config_base.txt `--n-eps 50` (evaluations included)
        eval_every=5,  # SEED config_base.txt `--eval-freq 5`; model/progressive_placer.py `ep % eval_freq == 0`
        start="device0",  # SEED `--init-best-pl`, progressive_placer.py `best_pl = zero_placement`
        discount=1.0,  # PLACETO model/progressive_placer_test.py `--disc-factor` default 1.
        # PLACETO model/rl_params.py `--ent-dec-init 1.`, decay from step `--ent-start-dec-step 1e9`: constant
        entropy_weight=1.0,
        normalize_advantage=False,  # raw return - baseline (SEED progressive_placer.py `adv = rew - bl`)
        loss_sum=True,  # SEED progressive_placer.py improve_placement: `sum_grads[i] += g` over the steps
        baseline_window=1000,  # `--turn-based-baseline` (SEED), over `--bl-n-rnds` 1000 episodes (PLACETO)
        memory_penalty=0.0,  # `--mem-penalty` default 0. (PLACETO progressive_placer_test.py), not set by SEED
        # Placeto's message width is its feature count, 5 + devices (SEED model/pgraph.py get_emb_size,
        # mp_progressive_nn.py `d_msg = emb_size`): 8 at the seed's 3 devices
        hidden=8,
        lr=1e-3,  # PLACETO rl_params.py `--lr-init 1e-3`, decay from step 1e9: constant
        grad_clip=1.25,  # SEED model/rl_agent.py `grad_bound=1.25`
        rounds=8,  # SEED model/hyperparameters.txt "Number of propogation rounds 8"
    ),
}


def hyper_set(name: str) -> PlacetoHyper:
    """The named hyperparameter set `name` (`HYPER_SETS`); a PlacerError naming the choices otherwise."""
    if not isinstance(name, str) or name not in HYPER_SETS:
        raise PlacerError(f"placeto: unknown hyperparameter set {name!r}; choose one of: {', '.join(HYPER_SETS)}")
    return HYPER_SETS[name]


def resolve_hyper(name: str, **given: Any) -> PlacetoHyper:
    """The set `name` with every setting in `given` that is not None put in place of the set's value."""
    return replace(hyper_set(name), **{k: v for k, v in given.items() if v is not None})


def _choices(names: tuple[str, ...], aliases: dict[str, str]) -> str:
    return ", ".join(names) + "".join(f" ({old}: same as {new})" for old, new in aliases.items())


# --------------------------------------------------------------------------- the network


class _Rounds(torch.autograd.Function):
    """The placeto encoder's `rounds` rounds `h <- relu(g(A . relu(f(h)))) + h0`, both directions stacked, with a
    hand-written backward: the same torch operations as autograd's graph of those rounds (so the same gradients to
    the bit), but the forward runs in place and saves only what the backward reads (per round h, relu(f(h)),
    A . relu(f(h)) and relu(g(.))), and the sparse product's backward uses the transpose built once (torch's own CSR
    backward transposes `adj` on every call, about 4x slower here). Half the learning step's time went to autograd's
    version (ptb/0, width 8: forward 0.107 s against 0.047 s without gradients)."""

    @staticmethod
    def forward(ctx, h0: torch.Tensor, wf: torch.Tensor, bf: torch.Tensor, wg: torch.Tensor, bg: torch.Tensor,
                adj: torch.Tensor, adj_t: torch.Tensor, rounds: int) -> torch.Tensor:
        rows, d = h0.shape
        n2 = adj.shape[0]
        h = h0.expand(2, rows, d)
        saved = []
        for _ in range(rounds):
            m = torch.bmm(h, wf).add_(bf).relu_()
            agg = _sum_neighbours(adj, m.reshape(n2, -1)).reshape(2, rows, d)
            r = torch.bmm(agg, wg).add_(bg).relu_()
            saved.append((h, m, agg, r))
            h = r + h0
        ctx.saved, ctx.adj_t = saved, adj_t
        ctx.save_for_backward(wf, wg)
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        wf, wg = ctx.saved_tensors
        n2 = ctx.adj_t.shape[0]
        g_h0 = g_wf = g_bf = g_wg = g_bg = None
        for h, m, agg, r in reversed(ctx.saved):  # contributions summed in the order autograd's engine sums them
            g_h0 = grad.sum(0) if g_h0 is None else g_h0 + grad.sum(0)
            g_r = torch.ops.aten.threshold_backward(grad, r, 0)
            g_wg = _acc(g_wg, agg.transpose(1, 2).bmm(g_r))
            g_bg = _acc(g_bg, g_r.sum(1, keepdim=True))
            g_agg = g_r.bmm(wg.transpose(1, 2))
            g_m = _sum_neighbours(ctx.adj_t, g_agg.reshape(n2, -1)).reshape(g_agg.shape)
            g_m = torch.ops.aten.threshold_backward(g_m, m, 0)
            g_wf = _acc(g_wf, h.transpose(1, 2).bmm(g_m))
            g_bf = _acc(g_bf, g_m.sum(1, keepdim=True))
            grad = g_m.bmm(wf.transpose(1, 2))
        g_h0 = grad.sum(0) if g_h0 is None else g_h0 + grad.sum(0)
        ctx.saved = None
        return g_h0, g_wf, g_bf, g_wg, g_bg, None, None, None


# the narrowest dense operand `_sum_neighbours` sums in numba: from this width on, torch's CSR product on CPU (torch
# 2.14, MKL 2024.2, AVX-512) adds each row's terms one after another in CSR order, as the kernel does, so the sums are
# the same to the bit (tests/test_placer_placeto.py checks it); below it torch adds them in another order (results
# differ in the last bits at 8, 16 and 24 columns), so narrow products stay torch's. Only a learning step's last
# chunk of fewer than 4 states is that narrow at width 8.
_NUMBA_SUM_MIN_WIDTH = 32


def _sum_neighbours(adj: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`adj @ m` for the 0/1 CSR sum matrix `adj` [R, R] and a dense float32 `m` [R, w]: torch's product, to the bit.

    From `_NUMBA_SUM_MIN_WIDTH` columns on, one numba pass (`_csr_sum`) instead of torch's sparse product (which
    allocates, zero-fills and copies around its sum), about 2-3x faster at a learning step's widths (ptb/0, width 8:
    376 and 144 columns; docs/performance.md)."""
    if m.shape[1] < _NUMBA_SUM_MIN_WIDTH or m.dtype != torch.float32:
        return torch.matmul(adj, m)
    out = np.empty((adj.shape[0], m.shape[1]), dtype=np.float32)
    _csr_sum(adj.crow_indices().numpy(), adj.col_indices().numpy(), m.contiguous().numpy(), out)
    return torch.from_numpy(out)


@njit(cache=True)
def _csr_sum(crow, col, m, out):  # pragma: no cover - compiled
    # row r of out = 0 + m[col[crow[r]]] + m[col[crow[r] + 1]] + ..., left to right (the inner loop vectorises)
    w = out.shape[1]
    for r in range(out.shape[0]):
        o = out[r]
        for j in range(w):
            o[j] = 0.0
        for k in range(crow[r], crow[r + 1]):
            src = m[col[k]]
            for j in range(w):
                o[j] += src[j]


def _acc(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))


class Structure(NamedTuple):
    """A graph's edges as the encoders need them (parallel edges merged): the block-diagonal [2V, 2V] CSR sum
    matrix and its transpose (placeto encoder), and edge indices [2, E] parent -> child and child -> parent."""

    adj: torch.Tensor
    adj_t: torch.Tensor
    fwd: torch.Tensor
    bwd: torch.Tensor


class Stacked(NamedTuple):
    """A policy's weights stacked for its batched products (`PlacetoPolicy.stacked`); the message-passing four
    are None for the sage and gat encoders."""

    wf: torch.Tensor | None
    bf: torch.Tensor | None
    wg: torch.Tensor | None
    bg: torch.Tensor | None
    pool_wf: torch.Tensor
    pool_bf: torch.Tensor
    pool_wg: torch.Tensor
    pool_bg: torch.Tensor


class _GATLayer(nn.Module):
    """One-head graph attention (GATConv's form: shared linear map, additive attention with LeakyReLU 0.2,
    softmax over each node's in-edges and a self loop) on node-major features [V, batch, d]. torch_geometric's
    GATConv flattens its input to [N, heads, d] and so cannot take a batch of states of one graph; the
    segment softmax is torch_geometric's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, d))
        self.att_dst = nn.Parameter(torch.empty(1, d))
        self.bias = nn.Parameter(torch.zeros(d))
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """h [V, batch, d] -> [V, batch, d]: each node's attention-weighted sum over its in-neighbours and itself."""
        with warnings.catch_warnings():  # torch_geometric's import warns about torch.jit.script
            warnings.simplefilter("ignore", FutureWarning)
            from torch_geometric.utils import softmax

        n = h.shape[0]
        loops = torch.arange(n)
        src = torch.cat([edge_index[0], loops])
        dst = torch.cat([edge_index[1], loops])
        wh = self.lin(h)  # [V, batch, d]
        score = torch.nn.functional.leaky_relu((wh * self.att_src).sum(-1)[src] + (wh * self.att_dst).sum(-1)[dst],
                                               0.2)  # [E + V, batch]
        alpha = softmax(score, dst, num_nodes=n, dim=0)
        return torch.zeros_like(wh).index_add(0, dst, alpha.unsqueeze(-1) * wh[src]) + self.bias


class PlacetoPolicy(nn.Module):
    """Node features -> node embeddings (k rounds forward and backward) -> device logits for the current node.

    `encoder` picks the message passing: "placeto-gnn" (f/g sums; old name "placeto"), "sage" (SAGEConv) or
    "gat" (graph attention).
    No weight depends on the graph; only the head's last layer on the number of devices."""

    def __init__(self, num_features: int, num_devices: int, hidden: int = PlacetoHyper.hidden,
                 rounds: int = PlacetoHyper.rounds, encoder: str = PlacetoHyper.encoder) -> None:
        super().__init__()
        encoder = encoder_name(encoder)
        d = hidden
        self.rounds, self.encoder, self.hidden = rounds, encoder, hidden
        self.num_features, self.num_devices = num_features, num_devices
        self.lift = _mlp(num_features, d, d)
        if encoder == ENCODER_PLACETO:
            self.f_fwd, self.g_fwd = nn.Linear(d, d), nn.Linear(d, d)
            self.f_bwd, self.g_bwd = nn.Linear(d, d), nn.Linear(d, d)
        elif encoder == "sage":
            with warnings.catch_warnings():  # torch_geometric's import warns about torch.jit.script
                warnings.simplefilter("ignore", FutureWarning)
                from torch_geometric.nn import SAGEConv

            # node_dim=0: node-major [V, batch, d] input, so one call embeds a batch of states of one graph
            self.convs = nn.ModuleList(SAGEConv(d, d, node_dim=0) for _ in range(2))
        elif encoder == "gat":
            self.convs = nn.ModuleList(_GATLayer(d) for _ in range(2))
        else:
            raise PlacerError(f"placeto: unknown encoder {encoder!r}; choose one of: "
                              f"{_choices(ENCODERS, ENCODER_ALIASES)}")
        # pooled summaries of ancestors, descendants, parallel nodes: relu(g(sum(relu(f(x)))))
        self.pool_f = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(3))
        self.pool_g = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = _mlp(2 * d + 3 * d, d, num_devices)

    def stacked(self) -> Stacked:
        """The weights as the batched products read them (the two directions' f and g, the three pools' f
        and g, stacked). Built once per episode for the rollout (the weights do not change during it), once
        per call with gradients."""
        pool_wf = torch.cat([f.weight for f in self.pool_f])  # [3d, 2d]
        pool_bf = torch.cat([f.bias for f in self.pool_f])
        pool_wg = torch.stack([g.weight.T for g in self.pool_g])  # [3, d, d]
        pool_bg = torch.stack([g.bias for g in self.pool_g])[:, None]
        if self.encoder != ENCODER_PLACETO:
            return Stacked(None, None, None, None, pool_wf, pool_bf, pool_wg, pool_bg)
        return Stacked(torch.stack([self.f_fwd.weight.T, self.f_bwd.weight.T]),
                       torch.stack([self.f_fwd.bias, self.f_bwd.bias])[:, None],
                       torch.stack([self.g_fwd.weight.T, self.g_bwd.weight.T]),
                       torch.stack([self.g_fwd.bias, self.g_bwd.bias])[:, None], pool_wf, pool_bf, pool_wg, pool_bg)

    def embed(self, x: torch.Tensor, adj: Structure, w: Stacked | None = None) -> torch.Tensor:
        """x [batch, V, features] -> node-major embeddings [V, batch, 2d] (forward ++ backward); `w`: this
        policy's `stacked()` weights when the caller holds them.

        placeto encoder: `adj.adj` is the block-diagonal [2V, 2V] sum-aggregation matrix (rows 0..V-1 sum a
        node's parents, rows V..2V-1 its children). Both directions run as one batched product per layer, with
        their own weights stacked: `x <- relu(g(A . relu(f(x)))) + h0`, `rounds` times. Node-major (node, state)
        rows keep every reshape a view: the sparse product reads [2V, batch * d].
        """
        b, n, _ = x.shape
        d = self.hidden
        h0 = self.lift(x.transpose(0, 1).reshape(n * b, -1))  # [(node, state), d]
        if self.encoder != ENCODER_PLACETO:
            h0 = h0.reshape(n, b, d)
            hf = hb = h0
            for _ in range(self.rounds):
                hf = torch.relu(self.convs[0](hf, adj.fwd)) + h0
                hb = torch.relu(self.convs[1](hb, adj.bwd)) + h0
            return torch.cat([hf, hb], dim=-1)
        wf, bf, wg, bg = (w or self.stacked())[:4]
        h = h0.expand(2, n * b, d)  # direction, (node, state), feature
        if not torch.is_grad_enabled():  # rollout: the same sums, in place (saves an allocation per op)
            # bmm then the bias in place: baddbmm first copies the broadcast bias into its output, which cost more
            # than the product itself at a rollout's size (300 nodes, d = 8: 8.0 us against 2.8 + 0.7 us)
            for _ in range(self.rounds):
                m = torch.bmm(h, wf).add_(bf).relu_()
                agg = torch.matmul(adj.adj, m.reshape(2 * n, b * d)).reshape(2, n * b, d)
                h = torch.bmm(agg, wg).add_(bg).relu_().add_(h0)
            return torch.cat([h[0], h[1]], dim=-1).reshape(n, b, 2 * d)
        h = _Rounds.apply(h0, wf, bf, wg, bg, adj.adj, adj.adj_t, self.rounds)
        return torch.cat([h[0], h[1]], dim=-1).reshape(n, b, 2 * d)

    def forward(self, x: torch.Tensor, adj: Structure, current: torch.Tensor, pools: torch.Tensor,
                w: Stacked | None = None) -> torch.Tensor:
        """Device logits [batch, devices]; `current` [batch] node indices, `pools` [batch, 3, V] 0/1 masks;
        `w`: this policy's `stacked()` weights when the caller holds them (the rollout, once per episode)."""
        w = w or self.stacked()
        emb = self.embed(x, adj, w)  # [V, batch, 2d]
        b = emb.shape[1]
        d = self.hidden
        own = emb[current, torch.arange(b)]
        # the three pools' f layers as one product, their g layers as one batched product (same sums as three
        # separate Linear calls, a third of the calls)
        z = torch.relu(nn.functional.linear(emb, w.pool_wf, w.pool_bf))  # [V, batch, 3d]
        # every pool's mask against all three pools' features in one batched product over states, reading z in
        # place (a strided view); pool s keeps its own block. Three times the multiply-adds of the three sums
        # alone (a few thousand per state), but no permuted copy of z forward or backward, which an einsum made
        summed = torch.bmm(pools, z.transpose(0, 1)).reshape(b, 3, 3, d).diagonal(dim1=1, dim2=2)  # [batch, d, 3]
        summaries = torch.relu(torch.baddbmm(w.pool_bg, summed.permute(2, 0, 1), w.pool_wg))  # [3, batch, d]
        return self.head(torch.cat([own, summaries.transpose(0, 1).reshape(b, 3 * d)], dim=-1))


def num_parameters(policy: nn.Module) -> int:
    """The number of trainable numbers in `policy`."""
    return sum(p.numel() for p in policy.parameters())


# --------------------------------------------------------------------------- the graph's fixed data


def _reachability(graph: CompGraph) -> tuple[np.ndarray, np.ndarray]:
    """Ancestor and descendant bitsets: uint8[V, ceil(V / 8)], bit u of row v (little bit order) set when
    u is an ancestor (descendant) of v. Built in (reverse) topological order, one OR per edge."""
    n = graph.num_nodes
    width = (n + 7) // 8
    anc = np.zeros((n, width), dtype=np.uint8)
    desc = np.zeros((n, width), dtype=np.uint8)
    topo = graph.topo_order.tolist()
    for v in topo:
        for u in graph.predecessors(v):
            anc[v] |= anc[u]
            anc[v, u >> 3] |= np.uint8(1 << (u & 7))
    for v in reversed(topo):
        for w in graph.successors(v):
            desc[v] |= desc[w]
            desc[v, w >> 3] |= np.uint8(1 << (w & 7))
    return anc, desc


class _GraphContext:
    """What an episode needs of one graph and cluster, computed once: edges, static features, reachability."""

    def __init__(self, graph: CompGraph, cluster: Cluster, hyper: PlacetoHyper) -> None:
        self.graph, self.cluster, self.hyper = graph, cluster, hyper
        self.n, self.nd = graph.num_nodes, cluster.num_devices
        # `ref` decides feasibility of the answer (what `place` checks); `model` gives rewards and states
        self.ref = DevplaceModel(graph, cluster)
        self.model: DevplaceModel | PlacetoModel = self.ref if hyper.sim_model == SIM_DEVPLACE else \
            PlacetoModel(graph, cluster)
        pairs = np.unique(np.stack([graph.edge_src, graph.edge_dst], axis=1), axis=0) if graph.num_edges else \
            np.zeros((0, 2), dtype=np.int64)
        self.num_edges = len(pairs)
        n = self.n
        # block-diagonal sum aggregation: row w (< V) sums w's parents, row V + u sums u's children
        rows = np.concatenate([pairs[:, 1], n + pairs[:, 0]])
        cols = np.concatenate([pairs[:, 0], n + pairs[:, 1]])
        edge_index = torch.as_tensor(pairs.T.copy(), dtype=torch.long)
        self.adj = Structure(_csr(rows, cols, 2 * n), _csr(cols, rows, 2 * n), edge_index, edge_index.flip(0))
        self.num_features = 3 + self.nd + 3
        static = np.stack([graph.compute_s, graph.output_bytes, graph.param_bytes], axis=1)
        self.static = (static / _col_scale(static)).astype(np.float32)
        self.anc, self.desc = _reachability(graph)
        self.memory = cluster.memory.astype(np.float64)
        self._rollout_graph: RolloutGraph | None = None

    def rollout_graph(self) -> RolloutGraph:
        """The aggregation as the compiled rollout forward reads it (built on first use)."""
        if self._rollout_graph is None:
            self._rollout_graph = rollout_graph(self.adj.adj.crow_indices().numpy(), self.adj.adj.col_indices().numpy())
        return self._rollout_graph

    def features(self, devices: np.ndarray, start_s: np.ndarray, done: np.ndarray, v: int) -> np.ndarray:
        """The state with v the current node: float32[V, features], each column scaled by its max |value|."""
        x = np.zeros((self.n, self.num_features), dtype=np.float32)
        x[:, :3] = self.static
        x[np.arange(self.n), 3 + devices] = 1.0
        rel = start_s - start_s[v]
        scale = float(np.abs(rel).max())
        x[:, 3 + self.nd] = rel / scale if scale > 0 else rel
        x[:, 4 + self.nd] = done
        x[v, 5 + self.nd] = 1.0
        return x

    def pools(self, v: int, start_s: np.ndarray) -> np.ndarray:
        """bool[3, V]: v's ancestors, descendants and parallel nodes (cut to the nearest in start time on big
        graphs)."""
        a = np.unpackbits(self.anc[v], bitorder="little")[: self.n].astype(bool)
        d = np.unpackbits(self.desc[v], bitorder="little")[: self.n].astype(bool)
        p = ~(a | d)
        p[v] = False
        masks = np.stack([a, d, p])
        if self.n > self.hyper.pool_exact_max_nodes:
            k = self.hyper.pool_nearest
            dist = np.abs(start_s - start_s[v])
            for s in range(3):
                members = np.flatnonzero(masks[s])
                if members.size > k:
                    keep = members[np.argsort(dist[members], kind="stable")[:k]]
                    masks[s] = False
                    masks[s, keep] = True
        return masks

    def overflow(self, result: SimResult) -> float:
        """Largest relative overflow over devices (bytes over / bytes available), capped."""
        over = np.maximum(result.peak_memory_bytes - self.memory, 0.0)
        rel = np.where(np.isfinite(self.memory) & (self.memory > 0), over / np.maximum(self.memory, 1e-300),
                       np.where(over > 0, np.inf, 0.0))
        return float(min(rel.max(), self.hyper.overflow_cap)) if rel.size else 0.0


def _csr(rows: np.ndarray, cols: np.ndarray, n: int) -> torch.Tensor:
    """A 0/1 sparse CSR matrix [n, n] with ones at (rows, cols) (pairs distinct)."""
    order = np.lexsort((cols, rows))
    crow = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=crow[1:])
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(torch.as_tensor(crow), torch.as_tensor(cols[order], dtype=torch.long),
                                       torch.ones(len(rows)), (n, n), check_invariants=True)


def _col_scale(a: np.ndarray) -> np.ndarray:
    m = np.abs(a).max(axis=0) if a.shape[0] else np.ones(a.shape[1])
    return np.where(m > 0, m, 1.0)


def _log_time(t: float) -> float:
    return math.log(max(t, 1e-15))


# --------------------------------------------------------------------------- episodes and learning


@dataclass
class EpisodeLog:
    """One episode: the nodes in the order they were visited, actions, rewards, and the stored states."""

    visited: list[int]
    actions: list[int]
    rewards: list[float]
    final_step_time_s: float
    entropies: list[float] = field(default_factory=list)  # policy entropy (nats) at each step
    states: np.ndarray | None = None  # float32[V, V, features] (training episodes only)
    pool_masks: np.ndarray | None = None  # bool[V, 3, V]


@dataclass
class PlacetoRun:
    """`train_placeto`'s result: the best feasible placement, and the learning curve."""

    devices: np.ndarray
    step_time_s: float
    start_step_time_s: float
    start: np.ndarray | None = None  # the first episode's placement
    curve: list[float] = field(default_factory=list)  # step time at the end of each training episode
    best_curve: list[float] = field(default_factory=list)  # best feasible step time after each episode
    eval_step_time_s: float = math.nan  # the final argmax episode's end state
    visits: list[list[int]] = field(default_factory=list)  # nodes in visiting order, per episode
    num_parameters: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)  # the learning curve (devplace.placers.rl.curve)
    policy: PlacetoPolicy | None = None  # the trained policy


class _Best:
    """The best placement seen that fits under the devplace model; step times in the context's sim model."""

    def __init__(self, devices: np.ndarray, step_time_s: float, ref: DevplaceModel | None = None) -> None:
        self.devices, self.step_time_s = devices.copy(), step_time_s
        self.ref = ref  # set when rewards come from another model: feasibility is re-checked under this one

    def offer(self, devices: np.ndarray, result: SimResult) -> None:
        if result.step_time_s < self.step_time_s and (result.feasible if self.ref is None else
                                                      self.ref.run(devices).feasible):
            self.devices, self.step_time_s = devices.copy(), result.step_time_s


def run_episode(policy: PlacetoPolicy, ctx: _GraphContext, start: np.ndarray, start_result: SimResult,
                order: np.ndarray, best: _Best, gen: torch.Generator | None, *, memory_penalty: float,
                keep_states: bool) -> EpisodeLog:
    """One pass over `order` from placement `start`: sample (gen given) or argmax (gen None) each node's device."""
    return run_episodes(policy, ctx, start, start_result, order, best, gen, 1, memory_penalty=memory_penalty,
                        keep_states=keep_states)[0]


def run_episodes(policy: PlacetoPolicy, ctx: _GraphContext, start: np.ndarray, start_result: SimResult,
                 order: np.ndarray, best: _Best | None, gen: torch.Generator | None, count: int, *,
                 memory_penalty: float, keep_states: bool) -> list[EpisodeLog]:
    """`count` episodes side by side, each one pass over `order` from placement `start`: at every step the
    `count` states are embedded in one batched product (the same sums as one at a time, a fraction of the
    calls), then each samples (gen given; one draw per episode from `gen`) or takes the argmax (gen None). Every
    state is offered to `best` (None: an evaluation that leaves the best alone)."""
    n = ctx.n
    devices = [start.copy() for _ in range(count)]
    results = [start_result] * count
    done = np.zeros(n, dtype=np.float32)
    logs = [EpisodeLog([], [], [], start_result.step_time_s) for _ in range(count)]
    if keep_states:
        for log in logs:
            log.states = np.empty((n, n, ctx.num_features), dtype=np.float32)
            log.pool_masks = np.empty((n, 3, n), dtype=np.bool_)
    # the weights do not change during the episodes: take them once, as the compiled forward reads them (the
    # placeto-gnn encoder, `devplace.placers.rl.rollout`) or stacked for torch's batched products (the others)
    compiled = policy.encoder == ENCODER_PLACETO and policy.hidden <= COMPILED_MAX_HIDDEN
    with torch.inference_mode():
        w = rollout_weights(policy) if compiled else policy.stacked()
    current = np.zeros(count, dtype=np.int64)
    x = np.empty((count, n, ctx.num_features), dtype=np.float32)
    masks = np.empty((count, 3, n), dtype=np.bool_)
    # the pools depend on start times only on graphs cut to the nearest members; else one set serves all
    shared_pools = n <= ctx.hyper.pool_exact_max_nodes
    for t, v in enumerate(np.asarray(order, dtype=np.int64).tolist()):
        for k in range(count):
            x[k] = ctx.features(devices[k], results[k].start_s, done, v)
            if k == 0 or not shared_pools:
                masks[k] = ctx.pools(v, results[k].start_s)
            else:
                masks[k] = masks[0]
            if keep_states:
                logs[k].states[t], logs[k].pool_masks[t] = x[k], masks[k]
        current[:] = v
        with torch.inference_mode():
            logits = torch.from_numpy(rollout_logits(w, x, current, masks, ctx.rollout_graph(), policy.rounds)) \
                if compiled else policy(torch.from_numpy(x), ctx.adj, torch.from_numpy(current),
                                        torch.from_numpy(masks.astype(np.float32)), w)
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            entropies = (-(p * logp).sum(dim=-1)).tolist()
            # argmax in evaluation (gen None), else a sample
            actions = (torch.argmax(logits, dim=-1) if gen is None else
                       torch.multinomial(p, 1, generator=gen)[:, 0]).tolist()
        for k, (a, log) in enumerate(zip(actions, logs, strict=True)):
            prev_t = results[k].step_time_s
            if a != devices[k][v]:
                devices[k][v] = a
                results[k] = ctx.model.run(devices[k])
                if best is not None:
                    best.offer(devices[k], results[k])
            reward = _log_time(prev_t) - _log_time(results[k].step_time_s)
            if not results[k].feasible:
                reward -= memory_penalty * ctx.overflow(results[k])
            log.entropies.append(entropies[k])
            log.visited.append(v)
            log.actions.append(a)
            log.rewards.append(reward)
        done[v] = 1.0
    for log, result in zip(logs, results, strict=True):
        log.final_step_time_s = result.step_time_s
    return logs


def _update(policy: PlacetoPolicy, opt: torch.optim.Optimizer, ctx: _GraphContext, log: EpisodeLog,
            advantage: np.ndarray, hyper: PlacetoHyper, rng: np.random.Generator) -> None:
    """One REINFORCE step on the episode's `update_steps` states, re-embedded in chunks with the current weights
    (those of the rollout, or a few updates later for the later episodes of a `parallel` batch)."""
    opt.zero_grad()
    accumulate_gradient(policy, ctx, log, advantage, hyper, steps=update_steps(len(log.actions), hyper, rng))
    apply_gradient(policy, opt, hyper)


def update_steps(count: int, hyper: PlacetoHyper, rng: np.random.Generator) -> np.ndarray | None:
    """The steps of a `count`-step episode whose states the learning step re-embeds: `update_fraction` of them
    drawn from `rng` without replacement, in order (None: all of them)."""
    if hyper.update_fraction >= 1.0 or count == 0:
        return None
    size = max(1, round(count * hyper.update_fraction))
    return np.sort(rng.choice(count, size=size, replace=False))


def apply_gradient(policy: PlacetoPolicy, opt: torch.optim.Optimizer, hyper: PlacetoHyper) -> None:
    """Clip the accumulated gradient to `grad_clip` (global norm) and take one Adam step."""
    nn.utils.clip_grad_norm_(policy.parameters(), hyper.grad_clip)
    opt.step()


def accumulate_gradient(policy: PlacetoPolicy, ctx: _GraphContext, log: EpisodeLog, advantage: np.ndarray,
                        hyper: PlacetoHyper, weight: float = 1.0, steps: np.ndarray | None = None) -> None:
    """Add `weight` x the REINFORCE gradient of one episode to the policy's .grad (states re-embedded in chunks):
    the mean over the episode's steps, or over `steps` (step indices) only -- an unbiased estimate of it when
    they are drawn uniformly."""
    chosen_steps = np.arange(len(log.actions)) if steps is None else np.asarray(steps, dtype=np.int64)
    count = len(chosen_steps)
    chunk = max(1, hyper.update_chunk_floats // max(1, (ctx.num_edges + ctx.n) * 2 * hyper.hidden))
    visited = torch.as_tensor(log.visited, dtype=torch.long)
    actions = torch.as_tensor(log.actions, dtype=torch.long)
    adv = torch.as_tensor(advantage, dtype=torch.float32)
    for lo in range(0, count, chunk):
        idx = chosen_steps[lo:lo + chunk]
        at = torch.from_numpy(idx)
        logits = policy(torch.from_numpy(log.states[idx]), ctx.adj, visited[at],
                        torch.from_numpy(log.pool_masks[idx].astype(np.float32)))
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, actions[at, None]).squeeze(1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        scale = 1.0 if hyper.loss_sum else 1.0 / count
        loss = (-(adv[at] * chosen).sum() - hyper.entropy_weight * entropy.sum()) * scale
        (loss * weight).backward()


def start_placement(ctx: _GraphContext, order: np.ndarray, seed: int) -> tuple[np.ndarray, SimResult]:
    """The first episode's placement (`PlacetoHyper.start`), with its result under the context's sim model.

    "classic": the fastest classic placement under the context's sim model (`best_classic`; it fits under
    devplace). "device0": all on device 0 when that fits (devplace model), else m-etf's placement at `order`."""
    if ctx.hyper.start == "classic":
        devices, result, _ = best_classic(ctx.graph, ctx.cluster, ctx.model, seed)
        return devices, result
    devices = np.zeros(ctx.n, dtype=np.int64)
    if not ctx.ref.run(devices).feasible:
        devices = np.asarray(get_placer("m-etf").func(ctx.graph, ctx.cluster, order=order, seed=seed),
                             dtype=np.int64)
    return devices, ctx.model.run(devices)


def new_best(ctx: _GraphContext, devices: np.ndarray, step_time_s: float) -> _Best:
    """A best-so-far tracker for the context (re-checking feasibility under devplace when rewards use placeto)."""
    return _Best(devices, step_time_s, None if ctx.model is ctx.ref else ctx.ref)


def returns_of(log: EpisodeLog, discount: float = 1.0) -> np.ndarray:
    """The return at every step: the sum of this and later rewards, reward k steps later weighted discount^k."""
    rewards = np.asarray(log.rewards, dtype=np.float64)
    out = np.empty_like(rewards)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + discount * acc
        out[t] = acc
    return out


def advantages_of(returns: np.ndarray, recent: deque[np.ndarray], hyper: PlacetoHyper) -> np.ndarray:
    """Append `returns` to `recent`, subtract the per-step baseline (mean over `recent`) and, when asked,
    divide by the advantages' std over the episode."""
    recent.append(returns)
    adv = returns - np.mean(np.stack(recent), axis=0)
    if hyper.normalize_advantage:
        adv = adv / (float(adv.std()) + 1e-8)
    return adv


def new_policy(num_features: int, num_devices: int, hyper: PlacetoHyper, seed: int) -> PlacetoPolicy:
    """A fresh policy, initialised under `torch.manual_seed(seed)` without touching the caller's generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PlacetoPolicy(num_features, num_devices, hyper.hidden, hyper.rounds, hyper.encoder)


def check_settings(hyper: PlacetoHyper) -> None:
    """Raise a PlacerError naming the first bad setting."""
    if hyper.encoder not in ENCODERS:
        raise PlacerError(f"placeto: unknown encoder {hyper.encoder!r}; choose one of: "
                          f"{_choices(ENCODERS, ENCODER_ALIASES)}")
    if hyper.sim_model not in SIM_MODELS:
        raise PlacerError(f"placeto: unknown sim_model {hyper.sim_model!r}; choose one of: "
                          f"{_choices(SIM_MODELS, SIM_MODEL_ALIASES)}")
    if hyper.start not in STARTS:
        raise PlacerError(f"placeto: unknown start {hyper.start!r}; choose one of: {', '.join(STARTS)}")
    # parallel: episodes embedded side by side, bounded like the episodes they sample
    for name, high in (("episodes", MAX_EPISODES), ("rounds", MAX_ROUNDS), ("hidden", MAX_HIDDEN),
                       ("parallel", MAX_PARALLEL)):
        value = getattr(hyper, name)
        low = 0 if name == "episodes" else 1
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not low <= value <= high:
            raise PlacerError(f"placeto: {name} must be an integer from {low} to {high:,}, got {value!r}")
    if isinstance(hyper.eval_every, bool) or not isinstance(hyper.eval_every, int | np.integer) or hyper.eval_every < 0:
        raise PlacerError(f"placeto: eval_every must be an integer >= 0, got {hyper.eval_every!r}")
    if not (isinstance(hyper.memory_penalty, int | float) and 0 <= hyper.memory_penalty < math.inf):
        raise PlacerError(f"placeto: memory_penalty must be a number >= 0, got {hyper.memory_penalty!r}")
    if not (isinstance(hyper.discount, int | float) and 0 <= hyper.discount <= 1):
        raise PlacerError(f"placeto: discount must be a number in [0, 1], got {hyper.discount!r}")
    if not (isinstance(hyper.update_fraction, int | float) and 0 < hyper.update_fraction <= 1):
        raise PlacerError(f"placeto: update_fraction must be a number in (0, 1], got {hyper.update_fraction!r}")
    if not (isinstance(hyper.lr, int | float) and 0 < hyper.lr < math.inf):
        raise PlacerError(f"placeto: lr must be a number > 0, got {hyper.lr!r}")


def train_placeto(graph: CompGraph, cluster: Cluster, order: np.ndarray, seed: int = 0,
                  hyper: PlacetoHyper | None = None, progress: Progress | None = None,
                  policy: PlacetoPolicy | None = None, full: FullGraph | None = None) -> PlacetoRun:
    """Train a policy on `graph` for `hyper.episodes` episodes, then one argmax episode; the best feasible
    placement seen and the learning curve. `policy` (e.g. loaded from a checkpoint) is trained further in place
    (with a fresh Adam); without it a fresh one is made from `seed`. The answer (`devices`, `step_time_s`) is
    the best seen judged on `full` (the graph `graph`'s nodes stand for; default `graph` itself) against the
    start and every single device that fits (`devplace.placers.rl.start.judged_best`): never worse than either
    there.

    Measured (a shared 2-core CPU, torch 2.14, defaults, `layered_graph(300, width=12)`, 3 devices): about
    1.0-1.3 s of CPU per training episode -- 0.35 s for the rollout (300 embeddings without gradients, about
    1 ms each, and the simulations, 0.1-0.2 ms each) and the rest for the learning step -- and 0.35 s for
    the argmax episode; on the contract tests' 120-node graph the default 50 episodes take 8-12 s.
    torch runs single-threaded in here (the caller's thread count is restored after): with 2 threads on a
    busy 2-core machine the small per-step products were 10-100x slower, the learning step 2-3x.
    """
    hyper = hyper or PlacetoHyper()
    check_settings(hyper)
    with single_thread():
        run = _train(graph, cluster, order, seed, hyper, progress, policy)
    if run.start is not None:
        run.devices, run.step_time_s = judged_best(full or FullGraph.same(graph), cluster, hyper.sim_model,
                                                   [run.devices, run.start])
    return run


class single_thread:
    """Run torch on one thread inside the block, restoring the caller's thread count after (why: see
    `train_placeto`)."""

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.threads)


def _train(graph: CompGraph, cluster: Cluster, order: np.ndarray, seed: int, hyper: PlacetoHyper,
           progress: Progress | None, policy: PlacetoPolicy | None) -> PlacetoRun:
    t0 = time.perf_counter()
    n = graph.num_nodes
    order = np.asarray(order, dtype=np.int64)
    ctx = _GraphContext(graph, cluster, hyper)
    start, start_result = start_placement(ctx, order, seed)
    run = PlacetoRun(devices=start.copy(), step_time_s=start_result.step_time_s,
                     start_step_time_s=start_result.step_time_s, start=start.copy())
    if policy is None:
        policy = new_policy(ctx.num_features, ctx.nd, hyper, seed)
    elif (policy.num_features, policy.num_devices) != (ctx.num_features, ctx.nd):
        raise PlacerError(f"placeto: the policy was made for {policy.num_devices} devices; the cluster has {ctx.nd}")
    run.num_parameters = num_parameters(policy)
    run.policy = policy
    if n == 0 or ctx.nd == 1:
        return run
    gen = torch.Generator().manual_seed(seed)
    steps_rng = np.random.Generator(np.random.PCG64([seed, 1]))  # the update's steps (`update_steps`)
    opt = torch.optim.Adam(policy.parameters(), lr=hyper.lr)
    best = new_best(ctx, start, start_result.step_time_s)
    recent: deque[np.ndarray] = deque(maxlen=hyper.baseline_window)
    total = episode_count(hyper)
    ep = 0
    while ep < total:  # batches of `parallel` training episodes, and greedy ones (evaluations, the final argmax)
        if progress is not None:
            progress(ep, total)
        training = not is_greedy(hyper, ep)
        count = 1
        while training and count < hyper.parallel and ep + count < total and not is_greedy(hyper, ep + count):
            count += 1
        begin = best.devices
        begin_result = ctx.model.run(begin)
        # an evaluation (eval_every) leaves the best alone; the final argmax episode may improve it
        logs = run_episodes(policy, ctx, begin, begin_result, order, best if training or not hyper.eval_every
                            else None, gen if training else None, count, memory_penalty=hyper.memory_penalty,
                            keep_states=training)
        for j, log in enumerate(logs):
            if progress is not None and j:  # the batch's later episodes: reported as their updates run
                progress(ep, total)
            run.visits.append(log.visited)
            if training:
                _update(policy, opt, ctx, log, advantages_of(returns_of(log, hyper.discount), recent, hyper), hyper,
                        steps_rng)
                run.curve.append(log.final_step_time_s)
                run.best_curve.append(best.step_time_s)
            else:
                run.eval_step_time_s = log.final_step_time_s
            run.rows.append({"episode": ep, "graph": graph.name, "step_time_s": log.final_step_time_s,
                             "best_step_time_s": best.step_time_s, "entropy": float(np.mean(log.entropies)),
                             "wall_s": time.perf_counter() - t0, "greedy": int(not training)})
            ep += 1
    run.devices, run.step_time_s = best.devices.copy(), best.step_time_s
    return run


def episode_count(hyper: PlacetoHyper) -> int:
    """Every episode of a run: `episodes` with evaluations among them (eval_every > 0), else `episodes` training
    episodes and the final argmax one."""
    return hyper.episodes if hyper.eval_every else hyper.episodes + 1


def is_greedy(hyper: PlacetoHyper, ep: int) -> bool:
    """True when episode `ep` (0-based) takes the argmax instead of sampling and does not learn."""
    return ep % hyper.eval_every == 0 if hyper.eval_every else ep == hyper.episodes


def _check_placer_settings(episodes: int, memory_penalty: float | None, rounds: int | None, hidden: int | None,
                           encoder: str, sim_model: str, lr: float | None, start: str | None, parallel: int,
                           update_fraction: float, hyper: str) -> None:
    """The `placeto` placer's settings checked as `train_placeto` checks them (for a study file, before any cell
    runs)."""
    check_settings(resolve_hyper(hyper, episodes=episodes, memory_penalty=memory_penalty, rounds=rounds,
                                 hidden=hidden, encoder=encoder, sim_model=sim_model, lr=lr, start=start,
                                 parallel=parallel, update_fraction=update_fraction))


@register("placeto", uses_order=True, check=_check_placer_settings)
def placeto(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int = 0,
            episodes: int = PlacetoHyper.episodes, memory_penalty: float | None = None, rounds: int | None = None,
            hidden: int | None = None, encoder: str = PlacetoHyper.encoder, sim_model: str = PlacetoHyper.sim_model,
            lr: float | None = None, start: str | None = None, parallel: int = PlacetoHyper.parallel,
            update_fraction: float = PlacetoHyper.update_fraction, hyper: str = HYPER_DEVPLACE,
            policy: str | None = None, log: str | None = None, progress: Progress | None = None,
            full: FullGraph | None = None) -> np.ndarray:
    """Placeto-style RL: a GNN policy improves the best placement node by node, visiting nodes in the order.

    `hyper` names the hyperparameter set (`HYPER_SETS`): "devplace" (this project's) or "placeto-paper" (the seed
    study's: discount 1, entropy weight 1, raw advantages, no memory penalty, width 8, from all on device 0, a
    greedy evaluation every 5 episodes); a setting given here replaces the set's value (None: the set's).
    Each episode starts from the best feasible placement so far (first: `start` "classic", the best of the
    classic placers' placements, or "device0", all on device 0 or m-etf's when that does not fit), visits
    every node once in the traversal order and samples its device; the reward is the decrease of the
    simulated log step time (`sim_model` "devplace" or "placeto-sim"), minus `memory_penalty` x relative
    overflow when over memory. REINFORCE with a per-step baseline, Adam (`lr`); "devplace": `episodes` training
    episodes, then one argmax episode; "placeto-paper": `episodes` in all, every 5th (0, 5, ...) a greedy
    evaluation. The graph embedding is `rounds` rounds of message passing forward and
    backward, width `hidden`, `encoder` "placeto-gnn", "sage" (GraphSAGE) or "gat" (graph attention). `policy`: a
    checkpoint from `devplace train` to start from (its encoder, hidden and rounds win; `episodes=0` applies it
    zero-shot). `parallel` episodes are sampled side by side (one batched embedding per step) and each update
    re-embeds `update_fraction` of an episode's states: faster per episode, slower to learn per episode (see
    `PlacetoHyper`). `log`: write the learning curve CSV there. Returns the best feasible placement seen, judged on
    `full` (given by `devplace.place`: the graph this one's nodes stand for) against the start and each single
    device.
    Deterministic for a seed. See `devplace.placers.rl.placeto` for the full description and costs.
    """
    settings = resolve_hyper(hyper, episodes=episodes, memory_penalty=memory_penalty, rounds=rounds, hidden=hidden,
                             encoder=encoder, sim_model=sim_model, lr=lr, start=start, parallel=parallel,
                             update_fraction=update_fraction)
    net = None
    if policy is not None:
        from devplace.placers.rl.checkpoint import load_policy

        net, _ = load_policy(policy, num_devices=cluster.num_devices)
        settings = replace(settings, encoder=net.encoder, hidden=net.hidden, rounds=net.rounds)
    run = train_placeto(graph, cluster, order, seed, settings, progress, policy=net, full=full)
    if log is not None:
        from devplace.placers.rl.curve import write_curve

        write_curve(log, run.rows)
    return run.devices

"""The rollout's policy forward (placeto-gnn encoder) as one compiled call per step.

`PlacetoPolicy.forward` is about a hundred small torch calls per step (lift, 8 rounds of message passing in two
directions, three pools, the head); on a 300-node graph at width 8 those calls cost far more than their
arithmetic (0.38 ms per step, of it 0.28 ms for the embedding; the arithmetic is under a million multiply-adds).
The rollout needs no gradient, so `rollout_logits` computes the same function in one numba call over plain
float32 arrays (`RolloutWeights`, taken from the policy once per episode: the weights do not change during it),
for policies up to `COMPILED_MAX_HIDDEN` wide (placeto-paper's 8; wider ones are faster in torch).

Same function, not the same bits: the sums are float32 like torch's, but in this code's order and without the
fused multiply-adds of torch's matrix products, so logits differ from `PlacetoPolicy.forward` in the last bits
(tests/test_placer_placeto.py compares them). Actions are sampled from these logits by the same torch calls with
the same generator as before, so a run stays deterministic for a seed; the learning step re-embeds the stored
states with torch (with gradients), unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import njit

# the widest embedding (`hidden`) the compiled forward is used for: its products are plain loops, which beat torch's
# dispatch only while they are small (ptb/0, one state, one thread: d = 8 174 against 354 us per step; d = 16 429
# against 334; d = 32 1,330 against 624). Wider policies run the torch forward.
COMPILED_MAX_HIDDEN = 8


class RolloutWeights(NamedTuple):
    """A placeto-gnn policy's weights as `rollout_logits` reads them: float32, every matrix laid out [in, out]."""

    lift_w0: np.ndarray  # [features, d]
    lift_b0: np.ndarray
    lift_w2: np.ndarray  # [d, d]
    lift_b2: np.ndarray
    wf: np.ndarray  # [2, d, d]: f of the forward and of the backward direction
    bf: np.ndarray  # [2, d]
    wg: np.ndarray  # [2, d, d]
    bg: np.ndarray  # [2, d]
    pool_wf: np.ndarray  # [2d, 3d]: the three pools' f side by side
    pool_bf: np.ndarray  # [3d]
    pool_wg: np.ndarray  # [3, d, d]
    pool_bg: np.ndarray  # [3, d]
    head_w0: np.ndarray  # [5d, d]
    head_b0: np.ndarray
    head_w2: np.ndarray  # [d, devices]
    head_b2: np.ndarray


def rollout_weights(policy: torch.nn.Module) -> RolloutWeights:
    """The weights of a placeto-gnn `PlacetoPolicy` (its `lift`, `f_fwd` ... `head`) as `rollout_logits` reads
    them."""

    # copies, never views of the parameters: an optimiser step while these are in use must not change them
    def mat(lin: torch.nn.Linear) -> np.ndarray:
        return np.array(lin.weight.detach().numpy().T, dtype=np.float32, order="C", copy=True)

    def vec(lin: torch.nn.Linear) -> np.ndarray:
        return np.array(lin.bias.detach().numpy(), dtype=np.float32, copy=True)

    p = policy
    return RolloutWeights(
        mat(p.lift[0]), vec(p.lift[0]), mat(p.lift[2]), vec(p.lift[2]),
        np.stack([mat(p.f_fwd), mat(p.f_bwd)]), np.stack([vec(p.f_fwd), vec(p.f_bwd)]),
        np.stack([mat(p.g_fwd), mat(p.g_bwd)]), np.stack([vec(p.g_fwd), vec(p.g_bwd)]),
        np.ascontiguousarray(np.concatenate([mat(f) for f in p.pool_f], axis=1)),
        np.concatenate([vec(f) for f in p.pool_f]),
        np.stack([mat(g) for g in p.pool_g]), np.stack([vec(g) for g in p.pool_g]),
        mat(p.head[0]), vec(p.head[0]), mat(p.head[2]), vec(p.head[2]))


class RolloutGraph(NamedTuple):
    """A graph's sum aggregation in jagged-diagonal form, per direction r (0: a node sums its parents, 1: its
    children): the nodes sorted by their number of neighbours, most first (`perm[r]`; `pos[r]` its inverse);
    slot k holds the k-th neighbour of each node that has more than k, so that a slot is one contiguous run of the
    sorted nodes (`ptr[r, k]` .. `ptr[r, k + 1]` in `col[r]`, the neighbours' positions in the sorted order). The
    kernel then sums each slot with one loop over nodes, which vectorises; a node's neighbours are still added in
    CSR order."""

    perm: np.ndarray  # int64[2, V]
    pos: np.ndarray  # int64[2, V]
    ptr: np.ndarray  # int64[2, slots + 1]
    col: np.ndarray  # int64[2, max nnz]


def rollout_graph(crow: np.ndarray, col: np.ndarray) -> RolloutGraph:
    """The jagged-diagonal form of the block-diagonal [2V, 2V] 0/1 CSR sum matrix (`crow`, `col`;
    `placeto.Structure.adj`)."""
    n = (len(crow) - 1) // 2
    deg = np.diff(crow).reshape(2, n)
    slots = int(deg.max()) if n else 0
    perm = np.empty((2, n), dtype=np.int64)
    pos = np.empty((2, n), dtype=np.int64)
    ptr = np.zeros((2, slots + 1), dtype=np.int64)
    out = np.zeros((2, max(1, int(deg.sum(axis=1).max()) if n else 1)), dtype=np.int64)
    for r in range(2):
        perm[r] = np.argsort(-deg[r], kind="stable")
        pos[r, perm[r]] = np.arange(n)
        sorted_deg = deg[r, perm[r]]
        k = 0
        for s in range(slots):
            members = perm[r, sorted_deg > s]  # a prefix of the sorted nodes
            out[r, k:k + len(members)] = pos[r, col[crow[r * n + members] + s] - r * n]
            k += len(members)
            ptr[r, s + 1] = k
    return RolloutGraph(perm, pos, ptr, out)


def rollout_logits(w: RolloutWeights, x: np.ndarray, current: np.ndarray, pools: np.ndarray, graph: RolloutGraph,
                   rounds: int) -> np.ndarray:
    """Device logits float32[batch, devices] of `PlacetoPolicy.forward` (placeto-gnn encoder) for states
    x float32[batch, V, features] with current nodes `current` int64[batch] and pools bool[batch, 3, V]."""
    return _logits(x, current, pools, graph.perm, graph.pos, graph.ptr, graph.col, rounds, *w)


@njit(cache=True)
def _affine(v, w, b, out, relu):  # pragma: no cover - compiled
    # feature-major: out[c, i] = sum_k v[k, i] w[k, c] + b[c] (relu'd when asked) for every node i; the inner loops
    # run over the nodes, contiguous, so that they vectorise (node-major rows of d = 8 did not: 5x slower)
    n = v.shape[1]
    for c in range(out.shape[0]):
        o = out[c]
        for i in range(n):
            o[i] = 0.0
        for k in range(v.shape[0]):
            wkc = w[k, c]
            vk = v[k]
            for i in range(n):
                o[i] += vk[i] * wkc
        bc = b[c]
        if relu:
            for i in range(n):
                o[i] = max(o[i] + bc, np.float32(0.0))
        else:
            for i in range(n):
                o[i] += bc


@njit(cache=True)
def _logits(x, current, pools, perm, pos, ptr, col, rounds, lift_w0, lift_b0, lift_w2, lift_b2, wf, bf, wg, bg, pool_wf,
            pool_bf, pool_wg, pool_bg, head_w0, head_b0, head_w2, head_b2):  # pragma: no cover - compiled
    batch, n, nf = x.shape
    d = lift_b0.shape[0]
    out = np.empty((batch, head_b2.shape[0]), dtype=np.float32)
    # activations feature-major [.., d, V]; h, m, agg of direction r in that direction's sorted node order
    xt = np.empty((nf, n), dtype=np.float32)
    t = np.empty((d, n), dtype=np.float32)
    h0 = np.empty((d, n), dtype=np.float32)
    h0s = np.empty((2, d, n), dtype=np.float32)
    h = np.empty((2, d, n), dtype=np.float32)
    m = np.empty((2, d, n), dtype=np.float32)
    agg = np.empty((d, n), dtype=np.float32)
    emb = np.empty((2 * d, n), dtype=np.float32)
    z = np.empty((3 * d, n), dtype=np.float32)
    summed = np.empty((3, d, 1), dtype=np.float32)
    head_in = np.empty((5 * d, 1), dtype=np.float32)
    hidden = np.empty((d, 1), dtype=np.float32)
    logits = np.empty((head_b2.shape[0], 1), dtype=np.float32)
    for s in range(batch):
        for i in range(n):
            for k in range(nf):
                xt[k, i] = x[s, i, k]
        _affine(xt, lift_w0, lift_b0, t, True)  # lift: relu(x W0 + b0) W2 + b2
        _affine(t, lift_w2, lift_b2, h0, False)
        for r in range(2):
            for c in range(d):
                for i in range(n):
                    h0s[r, c, i] = h0[c, perm[r, i]]
        h[:] = h0s
        for _ in range(rounds):  # x <- relu(g(A relu(f(x)))) + h0, both directions
            for r in range(2):
                _affine(h[r], wf[r], bf[r], m[r], True)
                for c in range(d):  # sum each node's parents (children), slot by slot
                    mc = m[r, c]
                    ac = agg[c]
                    for i in range(n):
                        ac[i] = 0.0
                    for k in range(ptr.shape[1] - 1):
                        lo = ptr[r, k]
                        for i in range(ptr[r, k + 1] - lo):
                            ac[i] += mc[col[r, lo + i]]
                _affine(agg, wg[r], bg[r], h[r], True)
                for c in range(d):
                    for i in range(n):
                        h[r, c, i] += h0s[r, c, i]
        for r in range(2):
            for c in range(d):
                for i in range(n):
                    emb[r * d + c, i] = h[r, c, pos[r, i]]
        # pools: relu(g(sum over the pool's nodes of relu(f(embedding))))
        _affine(emb, pool_wf, pool_bf, z, True)
        for q in range(3):
            for c in range(d):
                acc = np.float32(0.0)
                zc = z[q * d + c]
                for i in range(n):
                    if pools[s, q, i]:
                        acc += zc[i]
                summed[q, c, 0] = acc
        v = current[s]
        for c in range(2 * d):
            head_in[c, 0] = emb[c, v]
        for q in range(3):
            _affine(summed[q], pool_wg[q], pool_bg[q], head_in[2 * d + q * d:2 * d + (q + 1) * d], True)
        _affine(head_in, head_w0, head_b0, hidden, True)
        _affine(hidden, head_w2, head_b2, logits, False)
        out[s] = logits[:, 0]
    return out

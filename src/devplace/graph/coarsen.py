"""Colocation and coarsening: merge the ops of a training graph into fewer groups, keeping a DAG.

`colocate(graph)` merges every op into its colocation `group` (an empty group means the op's own id, so ops
that name a forward op's id join that op). Where merging a whole group would make the quotient graph cyclic
-- always the case for a forward op and its backward ops: the gradient reaches the backward op through the
later layers and the loss -- the group is split, greedily and deterministically:

    ops are visited in the canonical topological order; an op joins the newest part of its group that it can
    join without creating a cycle, else the next newest, ...; if none accepts it, it opens a new part.

`coarsen(graph, max_nodes)` colocates, then merges further, stage by stage, stopping as soon as at most
`max_nodes` groups remain:

    2. chains: a -> b where a has one distinct successor and b one distinct predecessor;
    3. single consumer (Baechi): a -> b where a has one distinct successor, repeated until stable;
    4. pairwise: the lightest group merges with a neighbour, the one that keeps the group's span of
       earliest start times smallest (then the lightest) among those that keep the graph acyclic; a group
       without neighbours (an isolated op, a separate component) merges with the next lightest group.

Weights are shares of the total compute plus shares of the total memory (`merge_weight`). Stages 2 and 3 only
merge while the merged group weighs at most total / max_nodes, so they never build one giant group; stage 4
always finds a merge, so `max_nodes` (>= 1) is always reached. With
`max_nodes=None`, coarsen is colocation plus chain fusion (which costs no parallelism).

Merging groups a and b is safe iff no path joins them through a third group. The test and the upkeep of a
topological order of the coarse graph follow Pearce & Kelly's dynamic topological sort: searches bounded to
the region between a and b in the current order, and a reorder of the nodes found there. See
docs/coarsen.md for the rules, the coarse attributes and the complexity.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from devplace.errors import GraphError, PlacementError
from devplace.graph.compgraph import KIND_COMPUTE_KEY, CompGraph
from devplace.graph.heap import heap_pop, heap_push
from devplace.graph.io import load_graph, save_graph
from devplace.graph.jsonio import dump_number
from devplace.graph.modules import SEGMENTS_KEY, group_segments, segment_spans
from devplace.graph.phases import accumulation_record, merged_accumulation, merged_step_compute, step_record
from devplace.graph.placement import Placement
from devplace.graph.ties import SUMMED_EXTRAS, TIE_KEY, tie_classes

META_KEY = "coarsening"
GROUP_OP = "group"  # the `op` of a coarse node with more than one member

# --------------------------------------------------------------------------- the merge engine (numba)
# State of the coarse graph: an int64 matrix N[node, field] (indexed by original node; only the rows of roots
# -- a group's smallest member index -- are meaningful; one row per node keeps a node's fields in one cache
# line), an int64 matrix Ed[edge, field], and scratch rows S[list, i] (two stacks, neighbours, dF, dB).
# A group's out-edges (in-edges) are a linked list of original edge indices; merging two groups splices their
# lists in O(1); walking a list drops the edges that became internal or that duplicate an earlier edge to the
# same neighbour group, for good (groups never split). A union-find maps an op to its group's root.

_PARENT, _OHEAD, _OTAIL, _IHEAD, _ITAIL, _POS, _CNT, _VER, _ALIVE, _MADJ, _MVIS, _MTGT = range(12)
_W, _LO, _HI = range(3)  # float fields F[node, field]: merge weight, earliest and latest start level
_NFIELDS = 12
_STACK, _BSTACK, _NBR, _DF, _DB = range(5)
_SRC, _DST, _ONEXT, _INEXT = range(4)

_CHAINS, _SINGLE = 1, 2


@njit(cache=True)
def _find(N, x):  # pragma: no cover - compiled
    root = x
    while N[root, _PARENT] != root:
        root = N[root, _PARENT]
    while N[x, _PARENT] != root:
        nxt = N[x, _PARENT]
        N[x, _PARENT] = root
        x = nxt
    return root


@njit(cache=True)
def _scan(N, S, Ed, stamp, x, out):  # pragma: no cover - compiled
    """Distinct neighbour groups of root x (successors if `out`, else predecessors) into S[_NBR, :k], in
    list order; internal and duplicate edges are unlinked from x's list. Returns k."""
    stamp[0] += 1
    s = stamp[0]
    if out:
        head, tail, nxt_row, end_row = _OHEAD, _OTAIL, _ONEXT, _DST
    else:
        head, tail, nxt_row, end_row = _IHEAD, _ITAIL, _INEXT, _SRC
    k = 0
    prev = -1
    e = N[x, head]
    while e >= 0:
        nxt = Ed[e, nxt_row]
        y = _find(N, Ed[e, end_row])
        if y == x or N[y, _MADJ] == s:
            if prev < 0:
                N[x, head] = nxt
            else:
                Ed[prev, nxt_row] = nxt
        else:
            N[y, _MADJ] = s
            S[_NBR, k] = y
            k += 1
            prev = e
        e = nxt
    N[x, tail] = prev
    return k


@njit(cache=True)
def _union(N, Ed, F, a, b, newpos):  # pragma: no cover - compiled
    """Merge roots a and b; the survivor is the smaller index (= the group's first member in insertion order)."""
    if b < a:
        a, b = b, a
    N[b, _PARENT] = a
    for head, tail, nxt_row in ((_OHEAD, _OTAIL, _ONEXT), (_IHEAD, _ITAIL, _INEXT)):
        if N[b, head] >= 0:
            if N[a, head] < 0:
                N[a, head] = N[b, head]
            else:
                Ed[N[a, tail], nxt_row] = N[b, head]
            N[a, tail] = N[b, tail]
    N[a, _CNT] += N[b, _CNT]
    F[a, _W] += F[b, _W]
    F[a, _LO] = min(F[a, _LO], F[b, _LO])
    F[a, _HI] = max(F[a, _HI], F[b, _HI])
    N[a, _VER] += 1
    N[b, _VER] += 1
    N[b, _ALIVE] = 0
    N[a, _POS] = newpos
    return a


@njit(cache=True)
def _fwd_step(N, S, Ed, stamp, sp, t, vis, maxpred):  # pragma: no cover - compiled
    """Expand the top of the forward stack. Returns the new stack size, or -1 if it reached a node marked t."""
    sp -= 1
    x = S[_STACK, sp]
    k = _scan(N, S, Ed, stamp, x, True)
    sp0 = sp
    for i in range(k):
        y = S[_NBR, i]
        if N[y, _MTGT] == t:
            return -1
        if N[y, _POS] < maxpred and N[y, _MVIS] != vis:
            N[y, _MVIS] = vis
            j = sp  # keep the latest-placed successor on top: it is usually the nearest to a target
            while j > sp0 and N[S[_STACK, j - 1], _POS] > N[y, _POS]:
                S[_STACK, j] = S[_STACK, j - 1]
                j -= 1
            S[_STACK, j] = y
            sp += 1
    return sp


@njit(cache=True)
def _bwd_step(N, S, Ed, stamp, sp, t, vis, a, pa):  # pragma: no cover - compiled
    """Expand the top of the backward stack. Returns the new stack size, or -1 if it reached a or a node
    marked vis."""
    sp -= 1
    x = S[_BSTACK, sp]
    k = _scan(N, S, Ed, stamp, x, False)
    for i in range(k):
        y = S[_NBR, i]
        if y == a or N[y, _MVIS] == vis:
            return -1
        if N[y, _POS] > pa and N[y, _MTGT] != t:
            N[y, _MTGT] = t
            S[_BSTACK, sp] = y
            sp += 1
    return sp


@njit(cache=True)
def _try_merge(N, S, Ed, F, stamp, a, b):  # pragma: no cover - compiled
    """Merge roots a != b unless a path joins them through a third group (that would close a cycle).

    With pos(a) < pos(b) in the maintained topological order, the targets are b's predecessors placed after
    a, and the merge is unsafe iff a reaches a target. A bidirectional search decides it: forward from a's
    other successors (never past the last target's position, marked vis) and backward from the targets
    (never before a, marked t), one node at a time from the side that has visited fewer; the merge is unsafe
    iff they meet, safe as soon as one side runs out. If safe, the merged group takes a's position when there
    is no target, b's when no other successor of a lies before b, and otherwise both searches are completed --
    dF: a's descendants up to the last target, dB: b's ancestors after a -- and these nodes are reordered
    within their own pool of positions: dB, the merged group, dF (as in Pearce & Kelly's dynamic topological
    sort). Returns the survivor, or -1 if unsafe (then nothing but scratch marks changed).
    """
    if N[a, _POS] > N[b, _POS]:
        a, b = b, a
    pa = N[a, _POS]
    pb = N[b, _POS]
    k = _scan(N, S, Ed, stamp, b, False)
    stamp[0] += 1
    t = stamp[0]
    maxpred = -1
    sb = 0
    for i in range(k):
        y = S[_NBR, i]
        if y != a and N[y, _POS] > pa:
            N[y, _MTGT] = t
            S[_BSTACK, sb] = y
            sb += 1
            maxpred = max(maxpred, N[y, _POS])
    if sb == 0:
        return _union(N, Ed, F, a, b, pa)
    stamp[0] += 1
    vis = stamp[0]
    minsucc = N.shape[0]
    S[_STACK, 0] = a
    sf = _fwd_step(N, S, Ed, stamp, 1, t, vis, maxpred)
    if sf < 0:
        return -1
    k = _scan(N, S, Ed, stamp, a, True)
    for i in range(k):
        if S[_NBR, i] != b:
            minsucc = min(minsucc, N[S[_NBR, i], _POS])
    nf = 0
    nb = 0
    while sf > 0 and sb > 0:
        if nf <= nb:
            S[_DF, nf] = S[_STACK, sf - 1]
            nf += 1
            sf = _fwd_step(N, S, Ed, stamp, sf, t, vis, maxpred)
            if sf < 0:
                return -1
        else:
            S[_DB, nb] = S[_BSTACK, sb - 1]
            nb += 1
            sb = _bwd_step(N, S, Ed, stamp, sb, t, vis, a, pa)
            if sb < 0:
                return -1
    # safe (one side ran out without meeting the other)
    if minsucc > pb:
        return _union(N, Ed, F, a, b, pb)
    while sf > 0:
        S[_DF, nf] = S[_STACK, sf - 1]
        nf += 1
        sf = _fwd_step(N, S, Ed, stamp, sf, t, vis, maxpred)
    while sb > 0:
        S[_DB, nb] = S[_BSTACK, sb - 1]
        nb += 1
        sb = _bwd_step(N, S, Ed, stamp, sb, t, vis, a, pa)
    # reorder within the pool of positions of {a} + dB + dF: dB (in order), merged group, dF (in order)
    tot = nb + nf + 1
    nodes = np.empty(tot, dtype=np.int64)
    nodes[0] = a
    nodes[1:nb + 1] = S[_DB, :nb]
    nodes[nb + 1:] = S[_DF, :nf]
    poss = np.empty(tot, dtype=np.int64)
    for i in range(tot):
        poss[i] = N[nodes[i], _POS]
    order = np.argsort(poss)
    j = 0
    for i in order:
        if 1 <= i <= nb:
            N[nodes[i], _POS] = poss[order[j]]
            j += 1
    newpos = poss[order[j]]
    j += 1
    for i in order:
        if i > nb:
            N[nodes[i], _POS] = poss[order[j]]
            j += 1
    return _union(N, Ed, F, a, b, newpos)


@njit(cache=True)
def _colocate(N, S, Ed, F, stamp, topo, label, n_labels):  # pragma: no cover - compiled
    """Stage 1: each op, in topological order, joins the newest part of its label that accepts it.
    Returns (first member of each part, label of each part), parts in creation order."""
    n = topo.shape[0]
    lab_head = np.full(n_labels, -1, dtype=np.int64)
    part_node = np.empty(n, dtype=np.int64)
    part_label = np.empty(n, dtype=np.int64)
    part_next = np.empty(n, dtype=np.int64)
    n_parts = 0
    for i in range(n):
        v = topo[i]
        g = label[v]
        p = lab_head[g]
        while p >= 0:
            if _try_merge(N, S, Ed, F, stamp, _find(N, part_node[p]), v) >= 0:
                break
            p = part_next[p]
        if p < 0:
            part_node[n_parts] = v
            part_label[n_parts] = g
            part_next[n_parts] = lab_head[g]
            lab_head[g] = n_parts
            n_parts += 1
    return part_node[:n_parts].copy(), part_label[:n_parts].copy()


@njit(cache=True)
def _candidates(N, S, Ed, F, stamp, rule, cap):  # pragma: no cover - compiled
    """Stages 2 and 3: the edges a -> b that may be merged now: a has one distinct successor b, the merged
    weight is at most `cap`, and (chains) b has one distinct predecessor. At most one per group a."""
    n = N.shape[0]
    ca = np.empty(n, dtype=np.int64)
    cb = np.empty(n, dtype=np.int64)
    k = 0
    for x in range(n):
        if N[x, _ALIVE] == 0 or _scan(N, S, Ed, stamp, x, True) != 1:
            continue
        y = S[_NBR, 0]
        if F[x, _W] + F[y, _W] <= cap and (rule == _SINGLE or _scan(N, S, Ed, stamp, y, False) == 1):
            ca[k] = x
            cb[k] = y
            k += 1
    return ca[:k].copy(), cb[:k].copy()


@njit(cache=True)
def _merge_listed(N, S, Ed, F, stamp, rule, cap, ca, cb, count, target):  # pragma: no cover - compiled
    """Merge the listed edges in order, each between the current groups of its ends if still eligible (so a
    chain fuses in one pass), while count > target. Returns (count, merges)."""
    merges = 0
    for i in range(ca.shape[0]):
        if count <= target:
            break
        a = _find(N, ca[i])
        b = _find(N, cb[i])
        if a == b or F[a, _W] + F[b, _W] > cap:
            continue
        if _scan(N, S, Ed, stamp, a, True) != 1 or S[_NBR, 0] != b:
            continue
        if rule == _CHAINS and _scan(N, S, Ed, stamp, b, False) != 1:
            continue
        if _try_merge(N, S, Ed, F, stamp, a, b) >= 0:  # always safe: every path from a passes b
            count -= 1
            merges += 1
    return count, merges


@njit(cache=True)
def _merge_lightest(N, S, Ed, F, stamp, count, target):  # pragma: no cover - compiled
    """Stage 4: take the lightest group (weight, member count, root) and merge it with the best neighbour
    (`_better`) that can be merged without a cycle -- a group with a neighbour always has one: its successor
    placed first, or its predecessor placed last, in a topological order -- or, if it has no neighbour, with
    the next lightest group (always safe). Repeats while count > target; returns the new count."""
    n = N.shape[0]
    # groups in a heap keyed by (weight, member count * n + root), i.e. (weight, member count, root), with the
    # group's version as payload: an entry whose group has merged since (a new version) is stale and skipped
    cap = 2 * n + 1  # each group enters the heap once per version: at most n at the start, one per merge
    hw = np.empty(cap, dtype=np.float64)
    hcx = np.empty(cap, dtype=np.int64)
    hv = np.empty(cap, dtype=np.int64)
    hs = 0
    for x in range(n):
        if N[x, _ALIVE] == 1:
            hs = heap_push(hw, hcx, hv, 0, hs, F[x, _W], N[x, _CNT] * n + x, N[x, _VER])
    while count > target and hs > 0:
        x, ver = hcx[0] % n, hv[0]
        hs = heap_pop(hw, hcx, hv, 0, hs)
        if N[x, _ALIVE] == 0 or N[x, _VER] != ver:
            continue
        k = _scan(N, S, Ed, stamp, x, False)
        cand = S[_NBR, :k].copy()
        k = _scan(N, S, Ed, stamp, x, True)
        cand = np.concatenate((cand, S[_NBR, :k]))
        m = -1
        if cand.shape[0] == 0:  # no neighbour: the next lightest group
            while hs > 0 and (N[hcx[0] % n, _ALIVE] == 0 or N[hcx[0] % n, _VER] != hv[0]):
                hs = heap_pop(hw, hcx, hv, 0, hs)
            if hs == 0:
                break
            y = hcx[0] % n
            hs = heap_pop(hw, hcx, hv, 0, hs)
            m = _try_merge(N, S, Ed, F, stamp, x, y)
        tried = np.zeros(cand.shape[0], dtype=np.bool_)
        for _ in range(cand.shape[0]):
            best = -1
            for i in range(cand.shape[0]):
                if not tried[i] and (best < 0 or _better(N, F, x, cand[i], cand[best])):
                    best = i
            tried[best] = True
            m = _try_merge(N, S, Ed, F, stamp, x, cand[best])
            if m >= 0:
                break
        if m < 0:
            continue
        count -= 1
        hs = heap_push(hw, hcx, hv, 0, hs, F[m, _W], N[m, _CNT] * n + m, N[m, _VER])
    return count


@njit(cache=True, inline="always")
def _better(N, F, x, y, z):  # pragma: no cover - compiled
    """Is y a better partner for x than z? Smaller time span of the merged group first (its members' earliest
    start times stay close, so running it as one op delays little), then lighter, fewer members, smaller root."""
    sy = max(F[x, _HI], F[y, _HI]) - min(F[x, _LO], F[y, _LO])
    sz = max(F[x, _HI], F[z, _HI]) - min(F[x, _LO], F[z, _LO])
    if sy != sz:
        return sy < sz
    if F[y, _W] != F[z, _W]:
        return F[y, _W] < F[z, _W]
    if N[y, _CNT] != N[z, _CNT]:
        return N[y, _CNT] < N[z, _CNT]
    return y < z


@njit(cache=True)
def _dfs_order(succ_ptr, succ_edges, edge_dst, indeg):  # pragma: no cover - compiled
    """Reverse postorder of a depth-first walk from the sources (insertion order, successors in edge order):
    a topological order that keeps chains and nested paths close together, so the regions searched and
    reordered by `_try_merge` stay small (Kahn's breadth-first order interleaves a backward pass badly)."""
    n = succ_ptr.shape[0] - 1
    seen = np.zeros(n, dtype=np.bool_)
    post = np.empty(n, dtype=np.int64)
    stack = np.empty(n, dtype=np.int64)
    it = np.empty(n, dtype=np.int64)
    npost = 0
    for s in range(n):
        if indeg[s] != 0:
            continue
        seen[s] = True
        stack[0] = s
        it[0] = succ_ptr[s]
        sp = 1
        while sp > 0:
            x = stack[sp - 1]
            if it[sp - 1] < succ_ptr[x + 1]:
                y = edge_dst[succ_edges[it[sp - 1]]]
                it[sp - 1] += 1
                if not seen[y]:
                    seen[y] = True
                    stack[sp] = y
                    it[sp] = succ_ptr[y]
                    sp += 1
            else:
                post[npost] = x
                npost += 1
                sp -= 1
    pos = np.empty(n, dtype=np.int64)
    for i in range(n):
        pos[post[i]] = n - 1 - i
    return pos


@njit(cache=True)
def _start_levels(topo, pred_ptr, pred_edges, edge_src, compute_s):  # pragma: no cover - compiled
    """Earliest start of each op with unlimited devices and free communication (its top level), in units
    of the mean op time; each op counts at least 1/1000 of the mean so that zero-cost ops still have an order
    (with no compute at all this is the plain level, the longest path in edges)."""
    n = topo.shape[0]
    mean = compute_s.sum() / n
    if mean == 0:
        mean = 1.0
    start = np.zeros(n, dtype=np.float64)
    for i in range(n):
        v = topo[i]
        for k in range(pred_ptr[v], pred_ptr[v + 1]):
            u = edge_src[pred_edges[k]]
            start[v] = max(start[v], start[u] + max(compute_s[u] / mean, 1e-3))
    return start


@njit(cache=True)
def _roots(N):  # pragma: no cover - compiled
    n = N.shape[0]
    out = np.empty(n, dtype=np.int64)
    for v in range(n):
        out[v] = _find(N, v)
    return out


@njit(cache=True)
def _working_set(topo, cidx, external, output_bytes, temp_bytes, pred_ptr, pred_edges, edge_src, n_groups,
                 internal_uses):  # pragma: no cover - compiled
    """Peak memory of running each group's members one at a time in topological order: the running
    member's temp_bytes plus the outputs of members consumed only inside the group, each live from its
    producer's start until its last consumer in the group has finished."""
    live = np.zeros(n_groups, dtype=np.float64)
    peak = np.zeros(n_groups, dtype=np.float64)
    rem = internal_uses.copy()
    for i in range(topo.shape[0]):
        v = topo[i]
        g = cidx[v]
        if not external[v]:
            live[g] += output_bytes[v]
        if live[g] + temp_bytes[v] > peak[g]:
            peak[g] = live[g] + temp_bytes[v]
        for k in range(pred_ptr[v], pred_ptr[v + 1]):
            u = edge_src[pred_edges[k]]
            if cidx[u] == g:
                rem[u] -= 1
                if rem[u] == 0 and not external[u]:
                    live[g] -= output_bytes[u]
    return peak


# --------------------------------------------------------------------------- Python side


@dataclass(frozen=True, eq=False)
class Coarsening:
    """A coarse graph and the mapping of its nodes (groups) back to the ops of the graph it came from.

    `graph` is the coarse `CompGraph` (its meta carries the mapping under "coarsening", so it survives
    `save`/`load`); `members[coarse id]` lists the original op ids of that group in insertion order.
    """

    graph: CompGraph
    original: str
    members: dict[str, tuple[str, ...]]
    max_nodes: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    bundle_tensors: bool = False

    @property
    def num_groups(self) -> int:
        return self.graph.num_nodes

    @property
    def num_original_nodes(self) -> int:
        return sum(len(m) for m in self.members.values())

    @property
    def reached(self) -> bool:
        """True unless `max_nodes` was given and more groups than that remain."""
        return self.max_nodes is None or self.num_groups <= self.max_nodes

    @property
    def group_of(self) -> dict[str, str]:
        """Original op id -> coarse node id."""
        return {op: gid for gid, ops in self.members.items() for op in ops}

    def expand(self, placement: Placement | np.ndarray | Sequence[int] | Mapping[str, int],
               cluster: str | None = None) -> Placement:
        """The placement of the original graph that puts every op on its group's device.

        `placement` is a `Placement` of the coarse graph, a device index per coarse node (coarse node order),
        or a mapping coarse id -> device index.
        """
        if isinstance(placement, Placement):
            assignment: Mapping[str, int] = placement.assignment
            cluster = placement.cluster if cluster is None else cluster
        elif isinstance(placement, Mapping):
            assignment = placement
        else:
            assignment = Placement.from_array(self.graph, placement).assignment
        unknown = [k for k in assignment if k not in self.members]
        if unknown:
            raise PlacementError(f"placement names {len(unknown)} node(s) not in coarse graph {self.graph.name!r}, "
                                 f"e.g. {unknown[0]!r}; expand a placement of the coarse graph")
        out: dict[str, int] = {}
        for gid, ops in self.members.items():
            d = assignment.get(gid)
            if d is None:
                missing = sum(1 for g in self.members if g not in assignment)
                raise PlacementError(f"placement gives no device for {missing} group(s) of coarse graph "
                                     f"{self.graph.name!r}, e.g. {gid!r}; every group needs one")
            if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0:
                raise PlacementError(f"group {gid!r} is placed on {d!r}; device indices are integers >= 0")
            for op in ops:
                out[op] = int(d)
        return Placement(out, graph=self.original, cluster=cluster or "")

    def to_dict(self) -> dict[str, Any]:
        """The mapping as stored in the coarse graph's meta under "coarsening"."""
        return {"from": self.original, "max_nodes": self.max_nodes, "bundle_tensors": self.bundle_tensors,
                "stats": dict(self.stats),
                "groups": {gid: list(ops) for gid, ops in self.members.items()}}

    def save(self, path: str | Path) -> None:
        """Write the coarse graph (`devplace.graph/1`, mapping in its meta)."""
        save_graph(self.graph, path)

    @classmethod
    def from_graph(cls, coarse: CompGraph) -> Coarsening:
        """Rebuild the Coarsening from a coarse graph whose meta holds "coarsening" (e.g. after `load_graph`)."""
        doc = coarse.meta.get(META_KEY)
        where = f"graph {coarse.name!r}"
        if not isinstance(doc, Mapping):
            raise GraphError(f"{where} has no \"{META_KEY}\" mapping; it is not the output of devplace coarsen")
        groups = doc.get("groups")
        if not isinstance(groups, Mapping) or set(groups) != set(coarse.ids):
            raise GraphError(f"{where}: \"{META_KEY}\".\"groups\" must map every coarse node id to its member ids")
        members: dict[str, tuple[str, ...]] = {}
        seen: set[str] = set()
        for gid in coarse.ids:
            ops = groups[gid]
            if not isinstance(ops, list) or not ops or not all(isinstance(o, str) for o in ops):
                raise GraphError(f"{where}: group {gid!r} must list its member op ids (a non-empty list of strings)")
            dup = next((o for o in ops if o in seen), None)
            if dup is not None or len(set(ops)) != len(ops):
                raise GraphError(f"{where}: op {dup or ops[0]!r} is listed in two groups; every op is in one group")
            seen.update(ops)
            members[gid] = tuple(ops)
        max_nodes = doc.get("max_nodes")
        if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int)):
            raise GraphError(f"{where}: \"{META_KEY}\".\"max_nodes\" must be an integer or null, got {max_nodes!r}")
        return cls(coarse, str(doc.get("from", "")), members, max_nodes, dict(doc.get("stats") or {}),
                   bool(doc.get("bundle_tensors", False)))

    @classmethod
    def load(cls, path: str | Path) -> Coarsening:
        return cls.from_graph(load_graph(path))

    def summary(self) -> str:
        """One line: how many ops became how many groups, and what each stage did."""
        s = self.stats
        text = (f"{self.num_original_nodes} ops -> {self.num_groups} groups (colocation: "
                f"{s.get('colocate', self.num_groups)} groups, {s.get('groups_split', 0)} of "
                f"{s.get('labels', 0)} colocation groups split to keep a DAG)")
        if self.max_nodes is not None and not self.reached:
            text += f"; max_nodes={self.max_nodes} not reached: no safe merge left"
        return text

    def __repr__(self) -> str:
        return f"Coarsening({self.original!r}: {self.num_original_nodes} ops -> {self.num_groups} groups)"


def colocate(graph: CompGraph, *, bundle_tensors: bool = False) -> Coarsening:
    """Merge every op into its colocation group (an empty `group` means the op's own id), splitting a group
    where merging it whole would create a cycle. See the module docstring for the rule, and `coarsen` for
    `bundle_tensors`."""
    return _run(graph, max_nodes=None, merge=False, bundle=bundle_tensors)


def coarsen(graph: CompGraph, max_nodes: int | None = None, *, bundle_tensors: bool = False) -> Coarsening:
    """Colocate, then fuse chains, merge single-consumer ops into their consumer (both only into groups of at
    most total weight / max_nodes), then repeatedly merge the lightest group with a neighbour that keeps the
    graph acyclic (or, without neighbours, with the next lightest group), stopping as soon as at most
    `max_nodes` groups remain (always possible for max_nodes >= 1). With `max_nodes=None`: colocation and
    chain fusion only.

    The coarse graph has one edge per (coarse producer, coarse consumer, original tensor), with the tensor's
    exact bytes. With `bundle_tensors`, the tensors of a coarse producer that go to the same set of coarse
    consumers become one tensor (summed bytes): the same bytes move between the same devices under every
    placement, with one latency per bundle instead of one per tensor, and far fewer edges (4-6x fewer at
    100 groups of a 100k-op graph)."""
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int | np.integer)
                                  or max_nodes < 1):
        raise GraphError(f"max_nodes must be a positive integer (or None for no target), got {max_nodes!r}")
    return _run(graph, max_nodes=None if max_nodes is None else int(max_nodes), merge=True, bundle=bundle_tensors)


def _init_state(graph: CompGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n, n_e = graph.num_nodes, graph.num_edges
    N = np.zeros((n, _NFIELDS), dtype=np.int64)
    N[:, _PARENT] = np.arange(n)
    N[:, _POS] = _dfs_order(graph.succ_ptr, graph.succ_edges, graph.edge_dst,
                            np.bincount(graph.edge_dst, minlength=n)) if n else 0
    N[:, _CNT] = 1
    N[:, _ALIVE] = 1
    Ed = np.empty((n_e, 4), dtype=np.int64)
    Ed[:, _SRC] = graph.edge_src
    Ed[:, _DST] = graph.edge_dst
    for ptr, lst, head, tail, nxt in ((graph.succ_ptr, graph.succ_edges, _OHEAD, _OTAIL, _ONEXT),
                                      (graph.pred_ptr, graph.pred_edges, _IHEAD, _ITAIL, _INEXT)):
        deg = np.diff(ptr)
        has = deg > 0
        N[:, head] = np.where(has, lst[np.minimum(ptr[:-1], max(n_e - 1, 0))] if n_e else -1, -1)
        N[:, tail] = np.where(has, lst[np.maximum(ptr[1:] - 1, 0)] if n_e else -1, -1)
        link = np.full(n_e, -1, dtype=np.int64)
        if n_e:
            link[lst[:-1]] = lst[1:]
            link[lst[ptr[1:][has] - 1]] = -1
        Ed[:, nxt] = link
    S = np.empty((5, n), dtype=np.int64)
    F = np.empty((n, 3), dtype=np.float64)
    F[:, _W] = merge_weight(graph)
    F[:, _LO] = F[:, _HI] = _start_levels(graph.topo_order, graph.pred_ptr, graph.pred_edges, graph.edge_src,
                                          graph.compute_s) if n else 0.0
    return N, S, Ed, F, np.zeros(1, dtype=np.int64)


def merge_weight(graph: CompGraph) -> np.ndarray:
    """Per op: its share of the graph's total compute_s plus its share of the total memory it holds
    (param_bytes + output_bytes); a term is left out when its total is 0. Merges take the smallest combined
    weight first, so groups grow evenly in time and in memory."""
    w = np.zeros(graph.num_nodes, dtype=np.float64)
    mem = graph.param_bytes + graph.output_bytes
    for x in (graph.compute_s, mem):
        total = float(x.sum())
        if total > 0:
            w += x / total
    return w


def _run(graph: CompGraph, max_nodes: int | None, merge: bool, bundle: bool) -> Coarsening:
    n = graph.num_nodes
    labels: dict[str, int] = {}
    label = np.empty(n, dtype=np.int64)
    for v in range(n):
        label[v] = labels.setdefault(graph.group[v] or graph.ids[v], len(labels))
    label_names = list(labels)
    N, S, Ed, F, stamp = _init_state(graph)
    stats: dict[str, Any] = {"labels": len(labels)}
    if n:
        part_node, part_label = _colocate(N, S, Ed, F, stamp, graph.topo_order, label, len(labels))
    else:
        part_node = part_label = np.zeros(0, dtype=np.int64)
    count: int = int(part_node.shape[0])
    parts_per_label = np.bincount(part_label, minlength=len(labels))
    stats["groups_split"] = int((parts_per_label > 1).sum())
    stats["colocate"] = count
    stage1_root = _roots(N) if n else np.zeros(0, dtype=np.int64)
    if merge:
        target = 0 if max_nodes is None else max_nodes
        cap = math.inf if max_nodes is None else float(F[:, _W].sum()) / max_nodes
        for name, rule in (("chains", _CHAINS), ("single_consumer", _SINGLE)):
            if rule == _SINGLE and max_nodes is None:
                break
            while count > target:  # rounds: candidates sorted by weight at the start of the round
                ca, cb = _candidates(N, S, Ed, F, stamp, rule, cap)
                if not ca.size:
                    break
                order = np.lexsort((np.maximum(ca, cb), np.minimum(ca, cb), N[ca, _CNT] + N[cb, _CNT],
                                    F[ca, _W] + F[cb, _W]))
                count, merges = _merge_listed(N, S, Ed, F, stamp, rule, cap, ca[order], cb[order], count, target)
                if not merges:
                    break
            stats[name] = int(count)
        if max_nodes is not None:
            if count > target:
                count = _merge_lightest(N, S, Ed, F, stamp, count, target)
            stats["pairwise"] = int(count)
    root = _roots(N) if n else np.zeros(0, dtype=np.int64)
    names = _part_names(part_node, part_label, label_names, stage1_root)
    coarse, members = _build(graph, root, stage1_root, names, max_nodes, stats, merge, bundle)
    return Coarsening(coarse, graph.name, members, max_nodes, stats, bundle)


def _part_names(part_node: np.ndarray, part_label: np.ndarray, label_names: list[str],
                stage1_root: np.ndarray) -> dict[int, str]:
    """Stage-1 root -> readable unique name: a group's first part is named by the group, later parts
    (created by splits, in creation order) `<group>#1`, `<group>#2`, ..."""
    used = set(label_names)
    seen: dict[int, int] = {}
    names: dict[int, str] = {}
    for p, g in zip(part_node.tolist(), part_label.tolist(), strict=True):
        k = seen.get(g, 0)
        seen[g] = k + 1
        name = label_names[g]
        if k:
            j = k
            while f"{name}#{j}" in used:
                j += 1
            name = f"{name}#{j}"
            used.add(name)
        names[int(stage1_root[p])] = name
    return names


def _build(graph: CompGraph, root: np.ndarray, stage1_root: np.ndarray, names: dict[int, str],
           max_nodes: int | None, stats: dict[str, Any], merged: bool,
           bundle: bool) -> tuple[CompGraph, dict[str, tuple[str, ...]]]:
    """The coarse CompGraph from the final group of each op (root = the group's first member index)."""
    n = graph.num_nodes
    uniq = np.unique(root)
    cidx = np.searchsorted(uniq, root)
    n_g = int(uniq.shape[0])
    order = np.argsort(cidx, kind="stable")
    bounds = np.searchsorted(cidx[order], np.arange(n_g + 1))
    group_members = [order[bounds[g]:bounds[g + 1]].tolist() for g in range(n_g)]
    gids = [names[int(stage1_root[r])] for r in uniq.tolist()]

    src, dst = graph.edge_src, graph.edge_dst
    cross = cidx[src] != cidx[dst]
    outdeg = np.bincount(src, minlength=n)
    external = (outdeg == 0) | (np.bincount(src[cross], minlength=n) > 0)
    internal_uses = np.bincount(src[~cross], minlength=n).astype(np.int64)
    temp = _working_set(graph.topo_order, cidx.astype(np.int64), external, graph.output_bytes, graph.temp_bytes,
                        graph.pred_ptr, graph.pred_edges, src, n_g, internal_uses) if n else np.zeros(0)
    out_bytes = np.bincount(cidx, weights=np.where(external, graph.output_bytes, 0.0), minlength=n_g)

    step = merged_step_compute(graph, cidx, n_g)
    acc = merged_accumulation(graph, cidx, n_g)
    spans = segment_spans(graph)
    nodes: list[dict[str, Any]] = []
    members: dict[str, tuple[str, ...]] = {}
    for g, mem in enumerate(group_members):
        gid = gids[g]
        members[gid] = tuple(graph.ids[v] for v in mem)
        # where the forward program may be cut for a pipeline: a coarse node is no longer an op of that program
        segments = group_segments(spans, mem)
        if len(mem) == 1:
            rec = graph.node_record(mem[0])
            rec["id"] = gid
            if segments is not None:
                rec[SEGMENTS_KEY] = segments
            nodes.append(rec)
            continue
        kinds = {graph.kind[v] for v in mem}
        kind = next((k for k in ("forward", "backward", "optimizer") if k in kinds), graph.kind[mem[0]])
        groups = {graph.group[v] or graph.ids[v] for v in mem}  # colocation labels (empty = own id)
        rec = {"id": gid, "op": GROUP_OP, "kind": kind, "group": groups.pop() if len(groups) == 1 else "",
               "compute_s": dump_number(math.fsum(graph.compute_s[mem].tolist())),
               "output_bytes": dump_number(float(out_bytes[g])),
               "param_bytes": dump_number(math.fsum(graph.param_bytes[mem].tolist())),
               "temp_bytes": dump_number(float(temp[g]))}
        if graph.kind_compute:
            rec[KIND_COMPUTE_KEY] = {k: dump_number(math.fsum(col[mem].tolist()))
                                     for k, col in graph.kind_compute.items()}
        rec.update(step_record(step, g, kind))  # a backward group holding optimizer updates: which run once
        rec.update(accumulation_record(acc, g))  # its members' adds of their gradients into .grad
        for key in SUMMED_EXTRAS:
            vals = [graph.node_extra[v].get(key) for v in mem] if graph.node_extra else []
            nums = [x for x in vals if isinstance(x, int | float) and not isinstance(x, bool)]
            if nums:
                rec[key] = sum(nums) if all(isinstance(x, int) for x in nums) else math.fsum(nums)
        if segments is not None:
            rec[SEGMENTS_KEY] = segments
        nodes.append({k: v for k, v in rec.items() if v or k == "id"})

    _label_ties(graph, cidx, nodes)
    edges = _coarse_edges(graph, cidx, cross, gids)
    if bundle:
        edges = _bundle_tensors(edges)
    meta = {k: v for k, v in graph.meta.items() if k != META_KEY}
    doc = {"from": graph.name, "max_nodes": max_nodes, "bundle_tensors": bundle, "stats": dict(stats),
           "groups": {gid: list(ops) for gid, ops in members.items()}}
    meta[META_KEY] = doc
    suffix = "coarse" if merged else "colocated"
    coarse = CompGraph.build(f"{graph.name}.{suffix}{n_g}", nodes, edges, meta=meta)
    return coarse, members


def _label_ties(graph: CompGraph, cidx: np.ndarray, nodes: list[dict[str, Any]]) -> None:
    """Give coarse nodes that hold ops of one tie class (`devplace.graph.ties`) a common "tie" label (the id of
    the class's first coarse node), so a placer of the coarse graph keeps a backward op with its forward op."""
    classes = tie_classes(graph)
    parent = list(range(len(nodes)))
    owner: dict[int, int] = {}
    for v in range(graph.num_nodes):
        g = int(cidx[v])
        first = owner.setdefault(int(classes[v]), g)
        ra, rb = _root(parent, first), _root(parent, g)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = [_root(parent, g) for g in range(len(nodes))]
    size = np.bincount(np.asarray(roots, dtype=np.int64), minlength=len(nodes)) if nodes else np.zeros(0)
    for g, rec in enumerate(nodes):
        rec.pop(TIE_KEY, None)
        if size[roots[g]] > 1:
            rec[TIE_KEY] = nodes[roots[g]]["id"]


def _root(parent: list[int], x: int) -> int:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _coarse_edges(graph: CompGraph, cidx: np.ndarray, cross: np.ndarray, gids: list[str]) -> list[dict[str, Any]]:
    """One edge per distinct (coarse src, coarse dst, original tensor (producer, output index)), in the order of
    its first original edge, with that tensor's bytes. Tensors are renumbered per coarse producer in order of
    (producer insertion index, output index); a coarse producer whose crossing tensors all come from one op
    keeps that op's output indices."""
    e_idx = np.flatnonzero(cross)
    if not e_idx.size:
        return []
    u = graph.edge_src[e_idx]
    t = graph.edge_tensor[e_idx]
    y = cidx[graph.edge_dst[e_idx]]
    # first edge of each (u, t, coarse dst)
    key_order = np.lexsort((e_idx, y, t, u))
    ku, kt, ky = u[key_order], t[key_order], y[key_order]
    new = np.ones(key_order.size, dtype=bool)
    new[1:] = (ku[1:] != ku[:-1]) | (kt[1:] != kt[:-1]) | (ky[1:] != ky[:-1])
    firsts = e_idx[key_order[new]]
    # renumber tensors per coarse producer: distinct (u, t) ranked by (u, t) inside each producer
    fu, ft = graph.edge_src[firsts], graph.edge_tensor[firsts]
    fx = cidx[fu]
    ord2 = np.lexsort((ft, fu, fx))
    sx, su, st = fx[ord2], fu[ord2], ft[ord2]
    start_x = np.ones(ord2.size, dtype=bool)
    start_x[1:] = sx[1:] != sx[:-1]
    new_t = np.ones(ord2.size, dtype=bool)
    new_t[1:] = (su[1:] != su[:-1]) | (st[1:] != st[:-1]) | start_x[1:]
    run = np.cumsum(new_t) - 1  # global tensor counter
    x_base = np.maximum.accumulate(np.where(start_x, run, 0))
    rank = run - x_base
    # producers whose crossing tensors all come from one op keep the original indices
    x_first_u = np.maximum.accumulate(np.where(start_x, np.arange(ord2.size), 0))
    one_op = np.ones(ord2.size, dtype=bool)
    diff_u = su != su[x_first_u]
    if diff_u.any():
        bad_x = np.unique(sx[diff_u])
        one_op = ~np.isin(sx, bad_x)
    tensor_new = np.empty(ord2.size, dtype=np.int64)
    tensor_new[ord2] = np.where(one_op, st, rank)
    ks = np.argsort(firsts, kind="stable")
    es = firsts[ks]
    nbytes = graph.edge_bytes[es]
    integral = (nbytes == np.floor(nbytes)) & (nbytes < 2.0**63)
    out: list[dict[str, Any]] = []
    for x, y, b, whole, t, e in zip(fx[ks].tolist(), cidx[graph.edge_dst[es]].tolist(), nbytes.tolist(),
                                    integral.tolist(), tensor_new[ks].tolist(), es.tolist(), strict=True):
        rec: dict[str, Any] = {"src": gids[x], "dst": gids[y], "bytes": int(b) if whole else b}
        if t:
            rec["tensor"] = t
        if graph.edge_extra and graph.edge_extra[e]:
            rec.update(graph.edge_extra[e])
        out.append(rec)
    return out


def _bundle_tensors(edges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bundle the tensors of each coarse producer that go to the same set of coarse consumers into one tensor
    whose bytes are their sum: every placement then moves exactly the same bytes between the same devices,
    in one transfer (one latency) per bundle instead of one per tensor. One edge per (bundle, consumer), in
    the order of the bundle's first edge to that consumer; bundles numbered per producer in order of their
    first edge."""
    consumers: dict[tuple[str, int], list[str]] = defaultdict(list)
    nbytes: dict[tuple[str, int], float] = {}
    extra: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in edges:
        key = (rec["src"], rec.get("tensor", 0))
        consumers[key].append(rec["dst"])
        nbytes[key] = rec["bytes"]
        extra.setdefault(key, {k: v for k, v in rec.items() if k not in ("src", "dst", "bytes", "tensor")})
    bundle_of: dict[tuple[str, int], tuple[str, frozenset[str]]] = {}
    members: dict[tuple[str, frozenset[str]], list[tuple[str, int]]] = defaultdict(list)
    for key, dsts in consumers.items():
        b = (key[0], frozenset(dsts))
        bundle_of[key] = b
        members[b].append(key)
    index: dict[tuple[str, frozenset[str]], int] = {}
    per_src: dict[str, int] = defaultdict(int)
    out: list[dict[str, Any]] = []
    seen: set[tuple[tuple[str, frozenset[str]], str]] = set()
    for rec in edges:
        b = bundle_of[rec["src"], rec.get("tensor", 0)]
        if (b, rec["dst"]) in seen:
            continue
        seen.add((b, rec["dst"]))
        if b not in index:
            index[b] = per_src[b[0]]
            per_src[b[0]] += 1
        keys = members[b]
        total = math.fsum(nbytes[k] for k in keys)
        new: dict[str, Any] = {"src": b[0], "dst": rec["dst"], "bytes": dump_number(total)}
        if index[b]:
            new["tensor"] = index[b]
        if len(keys) == 1:
            new.update(extra[keys[0]])
        out.append(new)
    return out


__all__ = ["Coarsening", "coarsen", "colocate"]

"""`contiguous` ✱: cut the traversal order into at most k consecutive chunks, chunk i on device i.

What a human expert or a pipeline framework does: the order is split at k - 1 cut points into chunks
S_0, S_1, ... (a chunk may be empty), and chunk i runs on device i, in device index order (devices may
differ in speed and memory). Uses `order`: the chunks are runs of consecutive nodes of the order.

Optimises: the bottleneck max_i time(S_i), time(S) = the sum of S's ops' seconds on its device (`op_times`:
compute_s / speed, or the op's time on the device's kind where the graph was costed per kind),
subject to every chunk fitting its device's memory. Setting `devices` (default None = all k): use at
most that many devices, the first ones by index.

Memory of a chunk. Two estimates, both computed for every chunk in O(1) amortised:

- U(S), a *guaranteed* upper bound of the peak the `devplace` simulator measures on the chunk's device,
  whatever the other chunks are and however the step is scheduled (DESIGN.md section 4 rule 7):
  U(S) = params(S) + sum over nodes of S with consumers of out'(v) + the bytes of every distinct tensor
  (producer, output index) that S receives from outside + max over v in S of (temp(v), plus output(v)
  for a node without consumers). Why it bounds: persistent memory is params(S); each output of S lives
  at most once, each received tensor arrives once per device; a device runs one op at a time, so at most
  one op's temp (and the output of a consumer-less op, freed when it finishes) is held at once.
  out'(v) = max(output_bytes, sum of v's distinct out-tensor bytes) makes U monotone (a sub-chunk never
  has a larger U), which the search below needs; the two are equal in well-formed graphs.
- L(S) = params(S) + max over v in S of (temp(v) + out'(v)): parameters plus one op at work.

U is safe but pessimistic (it holds every activation of the chunk at once; on the 10k-op benchmark graph
it rules out any split on 4x16 GB where the simulator measures 13-14 GB per device). So a chunk fits
device i when est_i(S) = min(U(S), L(S) + a_i) <= memory of i, where a_i >= 0 is device i's activation
allowance, learned with the simulator:

1. a_i = 0 for every device (so at first est = L, parameters plus the largest op).
2. Find the exact optimum (below) under est; none: NoFitError. Simulate it; feasible: return it.
3. For every device over memory: a_i = (simulated peak) - L(chunk on i), which is strictly larger than
   before (the chunk passed est, so L + a_i <= capacity < peak <= U); after `LEARNED_ROUNDS` rounds,
   a_i = infinity instead, so est_i = U, which the simulator can never exceed. Go to 2.

This ends after at most `LEARNED_ROUNDS` + k rounds with a feasible placement or NoFitError, and the
result is **exact under the estimate**: no split of the order has a smaller bottleneck with every
chunk satisfying est for the final allowances. As est <= U, it is never worse than the optimum under
the guaranteed bound U alone, and NoFitError means that no split satisfies est, so none satisfies U.

Exact search. For a bound B, "is there a split with every chunk time <= B and every chunk fitting?" is
answered greedily: each device in turn takes the longest prefix of the rest that keeps both; this is
exact because both constraints are monotone (a sub-interval of a fitting chunk fits), so the greedy end
after device i is never before the end of any valid split's chunk i. The optimum B* is the smallest
float64 B with a yes, found by bisection over the ordered bit patterns of non-negative doubles (at most
64 tests); the split returned is the greedy one at B*, which fills lower-index devices first. Chunk
times are computed as C_i[e] - C_i[s] from the prefix sums C_i of the ops' seconds on device i in order, the
same way everywhere, so the bisection is exact in floating point.

Complexity: O(V + E log E) to prepare; the longest fitting chunk from every start, by a two-pointer
sweep, O(V + E) per distinct device capacity for U and O(V) per device and round for L; the search
O(64 k log V) per round; one simulation per round. Byte sums are exact for integer byte counts below
2^53, as in the simulator.
"""

from __future__ import annotations

import struct

import numpy as np
from numba import njit

from devplace.graph.compgraph import CompGraph
from devplace.graph.tensors import tensor_groups
from devplace.hardware.cluster import Cluster, op_times
from devplace.placers.common import describe_oom, positive_int
from devplace.placers.memory import no_fit_error
from devplace.placers.registry import register
from devplace.sim.devplace_model import DevplaceModel

LEARNED_ROUNDS = 10  # rounds that learn activation allowances from the simulator before falling back to U


# --------------------------------------------------------------------------- the memory estimates, per node set


def _tensors(graph: CompGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct tensors (producer, output index): per edge its tensor id, and per tensor producer and bytes."""
    groups = tensor_groups(graph)
    return groups.edge_group, graph.edge_src[groups.first_edge], graph.edge_bytes[groups.first_edge]


def _node_terms(graph: CompGraph, key_prod: np.ndarray, key_bytes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per node: out' (0 for a node without consumers), the U run term, the L run term."""
    has_out = np.diff(graph.succ_ptr) > 0
    key_sum = np.bincount(key_prod, weights=key_bytes, minlength=graph.num_nodes)
    out_prime = np.maximum(graph.output_bytes, key_sum)
    kept = np.where(has_out, out_prime, 0.0)
    run_u = graph.temp_bytes + np.where(has_out, 0.0, graph.output_bytes)
    run_l = graph.temp_bytes + out_prime
    return kept, run_u, run_l


def chunk_memory_bound(graph: CompGraph, nodes: np.ndarray | list[int]) -> float:
    """U(S) for the node set `nodes`: a guaranteed upper bound of the simulated peak memory of the device
    that holds exactly these nodes (see the module docstring). Plain set arithmetic, for checks and tests."""
    members = np.zeros(graph.num_nodes, dtype=bool)
    members[np.asarray(nodes, dtype=np.int64)] = True
    if not members.any():
        return 0.0
    edge_key, key_prod, key_bytes = _tensors(graph)
    kept, run_u, _ = _node_terms(graph, key_prod, key_bytes)
    received = np.zeros(key_prod.shape[0], dtype=bool)
    inbound = members[graph.edge_dst] & ~members[graph.edge_src]
    received[edge_key[inbound]] = True
    return float(graph.param_bytes[members].sum() + kept[members].sum() + key_bytes[received].sum()
                 + run_u[members].max())


def chunk_memory_lower(graph: CompGraph, nodes: np.ndarray | list[int]) -> float:
    """L(S): parameters of `nodes` plus the largest temp + out' of one of them (0 for no nodes)."""
    nodes = np.asarray(nodes, dtype=np.int64)
    if nodes.size == 0:
        return 0.0
    _, key_prod, key_bytes = _tensors(graph)
    _, _, run_l = _node_terms(graph, key_prod, key_bytes)
    return float(graph.param_bytes[nodes].sum() + run_l[nodes].max())


# --------------------------------------------------------------------------- longest fitting chunk from every start


@njit(cache=True)
def _ends_upper(cap, pre_param, pre_kept, run, in_ptr, in_key, out_ptr, out_key, key_bytes,
                key_prod_pos):  # pragma: no cover - compiled
    """ends[s] = the largest e with U(order[s:e]) <= cap (two pointers; U is monotone on intervals).

    The window [s, e) keeps: cnt[k] = its nodes consuming tensor k; recv = bytes of the tensors with
    cnt > 0 whose producer is outside the window; a deque of positions with decreasing run for the max.
    """
    n = pre_param.shape[0] - 1
    ends = np.empty(n, dtype=np.int64)
    cnt = np.zeros(key_bytes.shape[0], dtype=np.int64)
    dq = np.empty(max(n, 1), dtype=np.int64)
    head = 0
    tail = 0
    recv = 0.0
    e = 0
    for s in range(n):
        if e < s:  # the window was empty
            e = s
        while e < n:
            d_recv = 0.0
            for j in range(in_ptr[e], in_ptr[e + 1]):
                k = in_key[j]
                if cnt[k] == 0 and not (s <= key_prod_pos[k] < e):
                    d_recv += key_bytes[k]
            for j in range(out_ptr[e], out_ptr[e + 1]):
                k = out_key[j]
                if cnt[k] > 0:
                    d_recv -= key_bytes[k]
            mx = run[e]
            if head < tail and run[dq[head]] > mx:
                mx = run[dq[head]]
            total = (pre_param[e + 1] - pre_param[s]) + (pre_kept[e + 1] - pre_kept[s]) + (recv + d_recv) + mx
            if total > cap:
                break
            for j in range(in_ptr[e], in_ptr[e + 1]):
                cnt[in_key[j]] += 1
            recv += d_recv
            while head < tail and run[dq[tail - 1]] <= run[e]:
                tail -= 1
            dq[tail] = e
            tail += 1
            e += 1
        ends[s] = e
        if e == s:
            continue
        # drop s: the window becomes [s + 1, e)
        for j in range(in_ptr[s], in_ptr[s + 1]):
            k = in_key[j]
            cnt[k] -= 1
            if cnt[k] == 0 and not (s + 1 <= key_prod_pos[k] < e):
                recv -= key_bytes[k]
        for j in range(out_ptr[s], out_ptr[s + 1]):
            k = out_key[j]
            if cnt[k] > 0:
                recv += key_bytes[k]
        if dq[head] == s:
            head += 1
    return ends


@njit(cache=True)
def _ends_lower(limit, pre_param, run):  # pragma: no cover - compiled
    """ends[s] = the largest e with params(order[s:e]) + max run over it <= limit (empty chunks always fit)."""
    n = pre_param.shape[0] - 1
    ends = np.empty(n, dtype=np.int64)
    dq = np.empty(max(n, 1), dtype=np.int64)
    head = 0
    tail = 0
    e = 0
    for s in range(n):
        if e < s:
            e = s
        while e < n:
            mx = run[e]
            if head < tail and run[dq[head]] > mx:
                mx = run[dq[head]]
            if (pre_param[e + 1] - pre_param[s]) + mx > limit:
                break
            while head < tail and run[dq[tail - 1]] <= run[e]:
                tail -= 1
            dq[tail] = e
            tail += 1
            e += 1
        ends[s] = e
        if e > s and dq[head] == s:
            head += 1
    return ends


class _Split:
    """The graph's arrays laid out in traversal-order positions, and the exact search over cut points."""

    def __init__(self, graph: CompGraph, cluster: Cluster, order: np.ndarray, num_devices: int) -> None:
        n = graph.num_nodes
        self.n, self.m = n, num_devices
        self.order = order
        self.memory = cluster.memory[:num_devices]
        pos = np.empty(n, dtype=np.int64)
        pos[order] = np.arange(n, dtype=np.int64)

        def prefix(values: np.ndarray) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(values[order])])

        edge_key, key_prod, key_bytes = _tensors(graph)
        kept, self.run_u, self.run_l = (x[order] for x in _node_terms(graph, key_prod, key_bytes))
        # [devices, n + 1]: prefix sums of the ops' seconds on each device, in order positions
        self.pre_time = np.stack([prefix(col) for col in op_times(graph, cluster)[:, :num_devices].T])
        self.pre_param = prefix(graph.param_bytes)
        self.pre_kept = np.concatenate([[0.0], np.cumsum(kept)])
        # tensors consumed at each position (one per in-edge), and distinct tensors produced there
        by_dst = np.argsort(pos[graph.edge_dst], kind="stable")
        self.in_ptr = np.concatenate([[0], np.cumsum(np.bincount(pos[graph.edge_dst], minlength=n))]).astype(np.int64)
        self.in_key = edge_key[by_dst]
        key_pos = pos[key_prod]
        self.out_ptr = np.concatenate([[0], np.cumsum(np.bincount(key_pos, minlength=n))]).astype(np.int64)
        self.out_key = np.argsort(key_pos, kind="stable").astype(np.int64)
        self.key_bytes, self.key_prod_pos = key_bytes, key_pos
        self._upper: dict[float, np.ndarray] = {}

    def ends_upper(self, cap: float) -> np.ndarray:
        """Longest chunk from every start with U <= cap (cached per capacity)."""
        if cap not in self._upper:
            self._upper[cap] = _ends_upper(cap, self.pre_param, self.pre_kept, self.run_u, self.in_ptr, self.in_key,
                                           self.out_ptr, self.out_key, self.key_bytes, self.key_prod_pos)
        return self._upper[cap]

    def ends(self, allowance: np.ndarray) -> list[np.ndarray]:
        """Per device i, the longest chunk from every start with min(U, L + a_i) <= memory of i."""
        out = []
        for i in range(self.m):
            cap = float(self.memory[i])
            ends = self.ends_upper(cap)
            if np.isfinite(allowance[i]):
                ends = np.maximum(ends, _ends_lower(cap - float(allowance[i]), self.pre_param, self.run_l))
            out.append(ends)
        return out

    def greedy(self, bound: float, ends: list[np.ndarray]) -> list[int] | None:
        """Chunk ends when each device takes the longest prefix of the rest with time <= bound that fits;
        None when nodes are left over."""
        s, cuts = 0, []
        for i in range(self.m):
            if s == self.n:
                cuts.append(s)
                continue
            lo, hi, c = s, int(ends[i][s]), self.pre_time[i]
            while lo < hi:  # the largest e in [s, hi] with c[e] - c[s] <= bound (device i's seconds)
                mid = (lo + hi + 1) // 2
                if c[mid] - c[s] <= bound:
                    lo = mid
                else:
                    hi = mid - 1
            s = lo
            cuts.append(s)
        return cuts if s == self.n else None

    def best(self, allowance: np.ndarray) -> tuple[list[int], float] | None:
        """The optimal split under the estimate (chunk ends and bottleneck), or None if none fits."""
        ends = self.ends(allowance)
        top = float(self.pre_time[:, -1].max()) if self.n else 0.0
        if self.greedy(top, ends) is None:  # no chunk time exceeds `top`: only memory can fail
            return None
        lo, hi = 0, _bits(top)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.greedy(_float(mid), ends) is None:
                lo = mid + 1
            else:
                hi = mid
        bound = _float(hi)
        cuts = self.greedy(bound, ends)
        assert cuts is not None
        return cuts, bound

    def devices(self, cuts: list[int]) -> np.ndarray:
        """Device per node for chunk ends `cuts`."""
        devices = np.empty(self.n, dtype=np.int64)
        devices[self.order] = np.searchsorted(np.asarray(cuts), np.arange(self.n), side="right")
        return devices

    def lower(self, cuts: list[int], i: int) -> float:
        """L of chunk i."""
        s = cuts[i - 1] if i else 0
        e = cuts[i]
        return float(self.pre_param[e] - self.pre_param[s] + self.run_l[s:e].max()) if e > s else 0.0


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _float(b: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", b))[0])


def best_split(graph: CompGraph, cluster: Cluster, order: np.ndarray, *, devices: int | None = None,
               allowance: np.ndarray | None = None) -> tuple[list[int], float] | None:
    """The exact optimum under the estimate min(U, L + allowance_i) (allowance None: infinite, i.e. the
    guaranteed bound U alone): chunk ends (positions in `order`, one per device used) and the bottleneck,
    or None when no split fits."""
    m = min(devices or cluster.num_devices, cluster.num_devices)
    split = _Split(graph, cluster, np.asarray(order, dtype=np.int64), m)
    return split.best(np.full(m, np.inf) if allowance is None else np.asarray(allowance, dtype=np.float64))


@register("contiguous", uses_order=True, cheap=True)
def contiguous(graph: CompGraph, cluster: Cluster, *, order: np.ndarray, seed: int,
               devices: int | None = None) -> np.ndarray:
    """Exact balanced split of the traversal order into at most k consecutive chunks, chunk i on device i,
    minimising the largest chunk compute time under each device's memory.

    Uses the traversal order. Settings: `devices` (int >= 1 or None: use at most that many devices, the
    first ones by index). Memory per chunk: a guaranteed bound, relaxed by activation allowances learned
    from the simulator (see the module docstring); the result is simulator-feasible.
    """
    m = cluster.num_devices if devices is None else min(positive_int(devices, "devices", "contiguous"),
                                                        cluster.num_devices)
    split = _Split(graph, cluster, np.asarray(order, dtype=np.int64), m)
    model = DevplaceModel(graph, cluster)
    allowance = np.zeros(m)
    for rnd in range(LEARNED_ROUNDS + m + 1):
        found = split.best(allowance)
        if found is None:
            raise no_fit_error(graph, cluster, "contiguous", _why_none(rnd, m))
        cuts, _ = found
        placement = split.devices(cuts)
        result = model.run(placement)
        if result.feasible:
            return placement
        for d in result.oom:
            allowance[d] = (float(result.peak_memory_bytes[d]) - split.lower(cuts, d) if rnd < LEARNED_ROUNDS
                            else np.inf)
    raise RuntimeError(f"contiguous: still over memory on {describe_oom(result)} with the guaranteed bound")


def _why_none(rnd: int, m: int) -> str:
    what = f"no split of the order into at most {m} consecutive chunks (chunk i on device i) fits memory"
    if rnd == 0:
        return what + ": even the parameters plus the largest op of some chunk exceed its device"
    return what + " once the activation memory the simulator measured is reserved"

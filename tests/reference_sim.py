"""A plain-Python, heapq-based implementation of DESIGN.md section 4, written independently of
`devplace.sim.devplace_model` from the text of the design, to check the compiled simulator against.

It reads only plain lists (no devplace arrays), so a bug in CompGraph's CSR cannot hide in both.
The cascade at one time t follows docs/simulation.md: events at t, then idle devices in index order, and
when no op finishes at t any more, the transfers of the ops that finished at t in (rank, tensor, device)
order.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass


@dataclass
class RefResult:
    step_time_s: float
    start: dict[str, float]
    finish: dict[str, float]
    peak: list[float]
    comm_bytes: float
    transfers: list[tuple[str, int, int, float, float]]  # (producer, tensor, dst device, start, arrival)


def reference_simulate(nodes: list[dict], edges: list[dict], speeds: list[float],
                       link: dict[tuple[int, int], tuple[float, float]], placement: dict[str, int],
                       rank: dict[str, int] | None = None) -> RefResult:
    """`nodes`/`edges` in the JSON shapes of devplace.graph/1; `link[(a, b)] = (bandwidth, latency)`.
    `rank` overrides the canonical rank (used to check a masked run against its subgraph)."""
    ids = [n["id"] for n in nodes]
    node = {n["id"]: n for n in nodes}
    out: dict[str, list[dict]] = {i: [] for i in ids}
    inc: dict[str, list[dict]] = {i: [] for i in ids}
    for e in edges:
        out[e["src"]].append(e)
        inc[e["dst"]].append(e)

    # canonical rank: Kahn with a FIFO queue over distinct successors in first-edge order
    succ = {i: list(dict.fromkeys(e["dst"] for e in out[i])) for i in ids}
    indeg = {i: len({e["src"] for e in inc[i]}) for i in ids}
    queue = deque(i for i in ids if indeg[i] == 0)
    canonical: dict[str, int] = {}
    while queue:
        u = queue.popleft()
        canonical[u] = len(canonical)
        for w in succ[u]:
            indeg[w] -= 1
            if indeg[w] == 0:
                queue.append(w)
    rank = canonical if rank is None else rank

    dev = placement
    ndev = len(speeds)
    dur = {i: node[i].get("compute_s", 0.0) / speeds[dev[i]] for i in ids}
    waiting = {i: len(inc[i]) for i in ids}
    ready: list[list[tuple[float, int, str]]] = [[] for _ in range(ndev)]
    for i in ids:
        if waiting[i] == 0:
            heapq.heappush(ready[dev[i]], (0.0, rank[i], i))
    events: list[tuple[float, int, tuple]] = []
    seq = 0
    busy = [False] * ndev
    channel_free: dict[tuple[int, int], float] = {}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    transfers: list[tuple[str, int, int, float, float]] = []

    def satisfied(v: str, t: float) -> None:
        waiting[v] -= 1
        if waiting[v] == 0:
            heapq.heappush(ready[dev[v]], (t, rank[v], v))

    t = 0.0
    finished_at_t: list[str] = []
    while True:
        progressed = True
        while progressed:
            progressed = False
            while events and events[0][0] == t:
                _, _, ev = heapq.heappop(events)
                if ev[0] == "finish":
                    u = ev[1]
                    busy[dev[u]] = False
                    finished_at_t.append(u)
                    for e in out[u]:
                        if dev[e["dst"]] == dev[u]:
                            satisfied(e["dst"], t)
                else:
                    _, u, tensor, b = ev
                    for e in out[u]:
                        if e.get("tensor", 0) == tensor and dev[e["dst"]] == b:
                            satisfied(e["dst"], t)
            for d in range(ndev):
                if not busy[d] and ready[d]:
                    _, _, v = heapq.heappop(ready[d])
                    busy[d] = True
                    start[v] = t
                    finish[v] = t + dur[v]
                    heapq.heappush(events, (finish[v], seq, ("finish", v)))
                    seq += 1
            if events and events[0][0] == t:
                progressed = True
                continue
            if finished_at_t:
                sends = set()
                for u in finished_at_t:
                    for e in out[u]:
                        b = dev[e["dst"]]
                        if b != dev[u]:
                            sends.add((rank[u], e.get("tensor", 0), b, u, e.get("bytes", 0.0)))
                finished_at_t = []
                for _, tensor, b, u, nbytes in sorted(sends):
                    a = dev[u]
                    bw, lat = link[(a, b)]
                    s = max(t, channel_free.get((a, b), 0.0))
                    f = s + lat + nbytes / bw
                    channel_free[(a, b)] = f
                    transfers.append((u, tensor, b, s, f))
                    heapq.heappush(events, (f, seq, ("arrive", u, tensor, b)))
                    seq += 1
                progressed = bool(events and events[0][0] == t)
        if not events:
            break
        t = events[0][0]

    # memory: half-open intervals, frees before allocations at equal times
    intervals: list[tuple[int, float, float, float]] = []  # (device, alloc, free, bytes)
    for u in ids:
        free = finish[u]
        for e in out[u]:
            if dev[e["dst"]] == dev[u]:
                free = max(free, finish[e["dst"]])
        for (p, _, _, _, f) in transfers:
            if p == u:
                free = max(free, f)
        intervals.append((dev[u], start[u], free, node[u].get("output_bytes", 0.0)))
        intervals.append((dev[u], start[u], finish[u], node[u].get("temp_bytes", 0.0)))
    for (u, tensor, b, s, _) in transfers:
        consumers = [finish[e["dst"]] for e in out[u] if e.get("tensor", 0) == tensor and dev[e["dst"]] == b]
        nbytes = next(e.get("bytes", 0.0) for e in out[u] if e.get("tensor", 0) == tensor)
        intervals.append((b, s, max([s, *consumers]), nbytes))
    peak = [0.0] * ndev
    for d in range(ndev):
        points = []
        for (dd, a, f, nbytes) in intervals:
            if dd == d and f > a and nbytes > 0:
                points.append((a, 1, nbytes))
                points.append((f, 0, -nbytes))
        live = best = 0.0
        for _, _, delta in sorted(points):
            live += delta
            best = max(best, live)
        persistent = sum(node[u].get("param_bytes", 0.0) for u in ids if dev[u] == d)
        peak[d] = persistent + best
    return RefResult(step_time_s=max(finish.values(), default=0.0), start=start, finish=finish, peak=peak,
                     comm_bytes=sum(nbytes for (u, tensor, _, _, _) in transfers
                                    for nbytes in [next(e.get("bytes", 0.0) for e in out[u]
                                                        if e.get("tensor", 0) == tensor)]),
                     transfers=transfers)

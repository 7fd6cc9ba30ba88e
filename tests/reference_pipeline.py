"""A plain-Python implementation of docs/simulation.md, "Pipeline schedules", written from that text to
check `devplace.sim.schedule` against: it builds the unrolled step as JSON-shaped lists and runs it through
the step model's own reference (reference_sim.py), so neither devplace's arrays nor its simulator are used.
"""

from __future__ import annotations

from collections import deque

from reference_sim import RefResult, reference_simulate


class RefScheduleError(Exception):
    """The placement is not a pipeline for the schedule (the real code raises ScheduleError)."""


def _topo(ids: list[str], edges: list[dict]) -> list[str]:
    succ: dict[str, list[str]] = {i: [] for i in ids}
    indeg = {i: 0 for i in ids}
    for e in edges:
        if e["dst"] not in succ[e["src"]]:
            succ[e["src"]].append(e["dst"])
            indeg[e["dst"]] += 1
    queue = deque(i for i in ids if indeg[i] == 0)
    out = []
    while queue:
        u = queue.popleft()
        out.append(u)
        for w in succ[u]:
            indeg[w] -= 1
            if indeg[w] == 0:
                queue.append(w)
    return out


def _ties(nodes: list[dict], edges: list[dict]) -> dict[str, str]:
    """Class label per node: a non-forward op with a forward op as its group joins it; an input joins its first
    consumer (the rules of devplace.graph.ties for a graph without tie labels)."""
    byid = {n["id"]: n for n in nodes}
    parent = {n["id"]: n["id"] for n in nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for n in nodes:
        kind, group = n.get("kind", ""), n.get("group", "")
        if kind and kind != "forward" and group in byid and group != n["id"] and byid[group].get("kind") == "forward":
            parent[find(n["id"])] = find(group)
        if n.get("op") == "input":
            first = next((e["dst"] for e in edges if e["src"] == n["id"]), None)
            if first is not None:
                parent[find(n["id"])] = find(first)
    return {i: find(i) for i in parent}


def schedule_actions(kind: str, m: int, v: int, p: int, r: int) -> list[tuple[str, int, int]]:
    """(phase "F"/"B", chunk, micro-batch) in the order position r of p runs them."""
    if kind == "gpipe":
        return [("F", 0, k) for k in range(m)] + [("B", 0, k) for k in range(m)]
    if kind == "1f1b":
        f = [("F", 0, k) for k in range(m)]
        b = [("B", 0, k) for k in range(m)]
        w = min(p - r - 1, m)
    else:
        if m % p != 0:
            raise RefScheduleError("M not a multiple of p")
        f, b = [], []
        for j in range(m * v):
            mb = (j // (p * v)) * p + j % p
            f.append(("F", (j // p) % v, mb))
            b.append(("B", v - 1 - (j // p) % v, mb))
        w = min(2 * (p - r - 1) + (v - 1) * p, m * v)
    seq = list(f[:w])
    rest_f, rest_b = f[w:], list(b)
    while rest_f:
        seq.append(rest_f.pop(0))
        seq.append(rest_b.pop(0))
    return seq + rest_b


def _tied_copies(nodes: list[dict], edges: list[dict], placement: dict[str, int], phase: dict[str, str],
                 stage: dict[str, int], topo: list[str], tie: dict[str, str]) -> tuple[list[dict], list[dict], dict]:
    """A tied parameter as the runtime runs it: a backward op reading only backward ops, of 2+ stages, and feeding
    only per-step ops (or such sums) runs once per step ("S"); every contributing stage but the one the sum stands
    for (its own, else the first on its device) gets a per-step copy on that stage's device: the sums' and
    the class's per-step ops' compute, their param_bytes, an edge from every contribution. Updates phase, stage."""
    byid = {n["id"]: n for n in nodes}
    summed: set[str] = set()
    root: dict[str, str] = {}
    for i in reversed(topo):
        succ = [e["dst"] for e in edges if e["src"] == i]
        pred = [e["src"] for e in edges if e["dst"] == i]
        if (phase[i] == "B" and succ and all(phase[x] == "S" or x in summed for x in succ) and pred
                and all(phase[x] == "B" for x in pred) and len({stage[x] for x in pred}) > 1):
            summed.add(i)
            later = [x for x in succ if x in summed]
            root[i] = root[later[0]] if later else i
    nodes, edges, placement = list(nodes), [dict(e) for e in edges], dict(placement)
    ids = [n["id"] for n in nodes]
    for a in [i for i in ids if i in summed and root[i] == i]:
        sums = [i for i in ids if i in summed and root[i] == a]
        sent: dict[tuple[str, int], float] = {}
        for w in sums:
            for e in edges:
                if e["dst"] == w and e["src"] not in summed:
                    sent.setdefault((e["src"], e.get("tensor", 0)), e.get("bytes", 0))
        update = [j for j in ids if phase[j] == "S" and tie[j] == tie[a]]
        on = {stage[x]: placement[x] for x, _ in sent}
        here = sorted(st for st, d in on.items() if d == placement[a])
        kept = stage[a] if stage[a] in here else (here[0] if here else -1)
        # each contributing stage adds its own gradient into its copy's .grad on later micro-batches: the sums'
        # accumulation moves to each stage's first contribution (in edge order)
        first: dict[int, str] = {}
        for x, _ in sent:
            first.setdefault(stage[x], x)
        for key in ("accumulate_s", "accumulate_bytes"):
            total = sum(byid[w].get(key, 0.0) for w in sums)
            for w in sums:
                byid[w] = {**byid[w], key: 0.0}
            for x in first.values():
                byid[x] = {**byid[x], key: byid[x].get(key, 0.0) + total}
        for st in sorted(set(on) - {kept}):
            c = f"{a}~tied-copy{st}"
            nodes.append({"id": c, "kind": "optimizer",
                          "compute_s": sum(byid[w].get("compute_s", 0.0) for w in sums + update),
                          "param_bytes": sum(byid[w].get("param_bytes", 0.0) for w in update)})
            edges += [{"src": x, "dst": c, "bytes": b, "tensor": t} for (x, t), b in sent.items()]
            phase[c], placement[c] = "S", on[st]
    for i in summed:
        phase[i] = "S"
        del stage[i]
    nodes = [byid.get(n["id"], n) for n in nodes]
    return nodes, edges, placement


def reference_schedule(nodes: list[dict], edges: list[dict], speeds: list[float],
                       link: dict[tuple[int, int], tuple[float, float]], placement: dict[str, int], kind: str,
                       m: int, v: int, microbatch_graph: bool = False, action_s: list[float] | None = None,
                       ) -> tuple[RefResult, list[dict], dict[str, int]]:
    """The pipelined step: (the step model's reference result on the unrolled graph, its nodes, stage per op).
    Each barrier on device d takes action_s[d] seconds (default 0)."""
    act = action_s or [0.0] * len(speeds)
    ids = [n["id"] for n in nodes]
    byid = {n["id"]: n for n in nodes}
    phase = {i: ("F" if byid[i].get("kind", "") in ("", "forward") else "B" if byid[i]["kind"] == "backward"
                 else "S") for i in ids}
    changed = True
    while changed:  # a forward op that depends on a backward op runs in the backward pass
        changed = False
        for e in edges:
            if phase[e["src"]] == "B" and phase[e["dst"]] == "F":
                phase[e["dst"]] = "B"
                changed = True
    for e in edges:
        if phase[e["src"]] == "S" and phase[e["dst"]] != "S":
            raise RefScheduleError("per-step op feeds a micro-batch op")
    pipe = sorted({placement[i] for i in ids if phase[i] != "S"})
    p = len(pipe)
    position = {d: pipe.index(d) for d in pipe}
    topo = _topo(ids, edges)
    chunk: dict[str, int] = {}
    for i in topo:
        if phase[i] != "F":
            continue
        c = 0
        for e in edges:
            if e["dst"] == i and phase[e["src"]] == "F":
                c = max(c, chunk[e["src"]] + (1 if position[placement[e["src"]]] > position[placement[i]] else 0))
        if c >= v:
            raise RefScheduleError("too many chunks")
        chunk[i] = c
    tie = _ties(nodes, edges)
    for i in topo:
        if phase[i] != "B":
            continue
        fwd = [chunk[j] for j in ids if phase[j] == "F" and tie[j] == tie[i]]
        if fwd:
            chunk[i] = max(fwd)
            continue
        chunk[i] = v - 1
        for e in edges:
            if e["dst"] == i and e["src"] in chunk and placement[e["src"]] == placement[i]:
                chunk[i] = chunk[e["src"]]
                break
    stage = {i: chunk[i] * p + position[placement[i]] for i in ids if phase[i] != "S"}
    nodes, edges, placement = _tied_copies(nodes, edges, placement, phase, stage, topo, tie)
    # a value read more than one stage on (or its gradient, more than one stage back) is passed on by every
    # stage between: one relay op per (value, stage), appended in edge order, on that stage's device
    nodes, edges, placement = list(nodes), [dict(e) for e in edges], dict(placement)
    for e in list(edges):
        s, d, t = e["src"], e["dst"], e.get("tensor", 0)
        if phase[s] == "S" or phase[d] == "S":
            continue
        if not ((phase[s] == "F" and stage[d] > stage[s] + 1) or (phase[s] == "B" and stage[d] < stage[s] - 1)):
            continue
        step = 1 if stage[d] > stage[s] else -1
        prev, prev_t = s, t
        for h in range(stage[s] + step, stage[d], step):
            r = f"{s}:{t}~relay{h}"
            if r not in phase:
                nodes.append({"id": r, "output_bytes": e.get("bytes", 0)})
                edges.append({"src": prev, "dst": r, "bytes": e.get("bytes", 0), "tensor": prev_t})
                phase[r], stage[r], placement[r] = phase[s], h, pipe[h % p]
            prev, prev_t = r, 0
        e["src"], e["tensor"] = prev, prev_t
    ids = [n["id"] for n in nodes]

    f = 1.0 if microbatch_graph else 1.0 / m
    un_nodes: list[dict] = []
    place: dict[str, int] = {}
    for k in range(m):
        for n in nodes:
            if phase[n["id"]] != "S":
                # a micro-batch after the first adds its gradients into .grad: their add's time, and the new
                # gradient held meanwhile
                later = 1.0 if k >= 1 else 0.0
                un_nodes.append({"id": f"{n['id']}|{k}",
                                 "compute_s": n.get("compute_s", 0.0) * f + later * n.get("accumulate_s", 0.0),
                                 "output_bytes": n.get("output_bytes", 0.0) * f,
                                 "temp_bytes": n.get("temp_bytes", 0.0) * f + later * n.get("accumulate_bytes", 0.0),
                                 "param_bytes": n.get("param_bytes", 0.0) if k == 0 else 0.0})
                place[f"{n['id']}|{k}"] = placement[n["id"]]
    for n in nodes:
        if phase[n["id"]] == "S":
            un_nodes.append({"id": f"{n['id']}|step", **{x: n.get(x, 0.0) for x in
                                                          ("compute_s", "output_bytes", "temp_bytes", "param_bytes")}})
            place[f"{n['id']}|step"] = placement[n["id"]]
    un_edges: list[dict] = []
    for e in edges:
        s, d, t = e["src"], e["dst"], e.get("tensor", 0)
        if phase[s] != "S" and phase[d] != "S":
            for k in range(m):
                un_edges.append({"src": f"{s}|{k}", "dst": f"{d}|{k}", "bytes": e.get("bytes", 0) * f, "tensor": t})
        elif phase[s] != "S":
            un_edges.append({"src": f"{s}|{m - 1}", "dst": f"{d}|step", "bytes": e.get("bytes", 0), "tensor": t})
        else:
            un_edges.append({"src": f"{s}|step", "dst": f"{d}|step", "bytes": e.get("bytes", 0), "tensor": t})
    for r, dev in enumerate(pipe):
        last: list[str] | None = None
        count = 0
        for ph, c, k in schedule_actions(kind, m, v, p, r):
            ops = [i for i in ids if phase[i] == ph and placement[i] == dev and stage[i] == c * p + r]
            if not ops:
                continue
            inner = [e for e in edges if e["src"] in ops and e["dst"] in ops]
            if last is not None:
                count += 1
                bar = f"barrier {dev} {count}"
                un_nodes.append({"id": bar, "compute_s": act[dev] * speeds[dev]})
                place[bar] = dev
                un_edges += [{"src": x, "dst": bar, "bytes": 0, "tensor": 10**9} for x in last]
                un_edges += [{"src": bar, "dst": f"{i}|{k}", "bytes": 0} for i in ops
                             if not any(e["dst"] == i for e in inner)]
            last = [f"{i}|{k}" for i in ops if not any(e["src"] == i for e in inner)]
        per_step = [i for i in ids if phase[i] == "S" and placement[i] == dev]
        if last and per_step:
            bar = f"barrier {dev} end"
            un_nodes.append({"id": bar, "compute_s": act[dev] * speeds[dev]})
            place[bar] = dev
            un_edges += [{"src": x, "dst": bar, "bytes": 0, "tensor": 10**9} for x in last]
            un_edges += [{"src": bar, "dst": f"{i}|step", "bytes": 0} for i in per_step]
    if len(_topo([n["id"] for n in un_nodes], un_edges)) < len(un_nodes):
        raise RefScheduleError("deadlock")
    return reference_simulate(un_nodes, un_edges, speeds, link, place), un_nodes, stage

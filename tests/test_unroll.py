"""The unrolled step of a schedule (`devplace.sim.schedule.unroll`, built as columns with `CompGraph.from_arrays`
on every pipelined simulation, so built for speed) against a plain build: the same step written node by node and
edge by edge in Python from docs/simulation.md's construction, built with `CompGraph.build` (every record
checked), its barriers found node by node; what `relay` carries over from the
graph (step compute, tie classes) and the compiled W rule against fresh computations; the compiled CSR and
parallel-edge marks against numpy's stable sort and a set."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cluster
from devplace.graph import CompGraph
from devplace.graph.compgraph import _first_of_parallel
from devplace.graph.parallel import ParallelPlan
from devplace.graph.phases import _step_column, accumulation, step_compute
from devplace.graph.schedule import V_SHAPED
from devplace.graph.ties import _tie_classes, tie_classes
from devplace.hardware.cluster import Cluster
from devplace.sim import Schedule, ScheduleError
from devplace.sim.parallel import stage_layout
from devplace.sim.schedule import (
    BACKWARD,
    BARRIER,
    BARRIER_TENSOR,
    FULL,
    PER_STEP,
    SPLIT_KINDS,
    WEIGHT,
    Stages,
    Unrolled,
    actions,
    op_phases,
    pipeline_stages,
    relay,
    tied_copies,
    tied_sums,
    unroll,
    weight_grad_ops,
)
from test_sim_schedule import pipelines, tied_lm
from test_zero_bubble import layer, zchain

KIND = "V100"  # the device kind of the per-kind compute column some cases carry


def reference_accumulation(g: CompGraph, stage: np.ndarray, total: int) -> tuple[list, dict, list, list, dict]:
    """(seconds, per kind, bytes, division seconds, per kind) of each node's gradient accumulation and division by
    M in the step as run (`total` nodes: `g`'s, then tied copies and relays, which add nothing), from `g`'s records:
    a node's own `accumulate_s` (per kind its `accumulate_s_by_kind`, else `accumulate_s` scaled as its compute is
    on that kind), `accumulate_bytes`, `scale_s` (likewise), except that a tied gradient sum's move to the first
    contribution (edge order) of each contributing stage."""
    n = g.num_nodes
    ext = g.node_extra or tuple({} for _ in range(n))
    pad = [0.0] * (total - n)

    def column(key: str) -> list[float]:
        return [float(ext[v].get(key, 0.0)) for v in range(n)] + pad

    def per_kind(key: str, ref: list[float]) -> dict[str, list[float]]:  # given, else as the node's compute scales
        return {kd: [float(ext[v].get(f"{key}_by_kind", {}).get(
            kd, ref[v] * (col[v] / g.compute_s[v]) if g.compute_s[v] > 0 else ref[v])) for v in range(n)] + pad
            for kd, col in g.kind_compute.items()}

    ref, nbytes, scale = column("accumulate_s"), column("accumulate_bytes"), column("scale_s")
    by_kind, scale_kind = per_kind("accumulate_s", ref), per_kind("scale_s", scale)
    summed, root = reference_tied_sums(fresh_copy(g), stage)
    for a in [v for v in range(n) if summed[v] and root[v] == v]:
        sums = [w for w in range(n) if summed[w] and root[w] == a]
        firsts: dict[int, int] = {}
        for w in sums:
            for e in g.in_edges(w).tolist():
                x = int(g.edge_src[e])
                if not summed[x]:
                    firsts.setdefault(int(stage[x]), x)
        for col in (ref, nbytes, *by_kind.values(), scale, *scale_kind.values()):
            moved = sum(col[w] for w in sums)
            for w in sums:
                col[w] = 0.0
            for x in firsts.values():
                col[x] += moved
    return ref, by_kind, nbytes, scale, scale_kind


def reference_unroll(g: CompGraph, devices: np.ndarray, schedule: Schedule, stages, c,
                     acc: tuple[list, dict, list]) -> Unrolled:
    """The unrolled step record by record (docs/simulation.md, "Pipeline schedules"): micro-batch ops k = 0..M-1
    in node order, per-step ops, the once-per-step parts, barriers (`reference_barriers`); every edge
    in edge order, a micro-batch edge once per micro-batch, then the barriers' (a once-per-step part waits for its
    device's last barrier only). A run of micro-batch k >= 1 also adds its gradients into .grad: `acc`'s seconds
    more, and its bytes held meanwhile (`reference_accumulation`)."""
    m, n = schedule.microbatches, g.num_nodes
    acc_s, acc_kind, acc_bytes, scale_s, scale_kind = acc
    scale = 1.0 if schedule.microbatch_graph else 1.0 / m
    once = _step_column(g)  # computed here, not read from the graph's cache
    once_kind = {k: _step_column(g, k) for k in g.kind_compute}
    # a mean loss's gradients are divided by M once per step: with the once-per-step part of the ops that make them
    divides = m > 1 and g.meta.get("capture", {}).get("loss_reduction") == "mean"
    part_s = [once[v] + (scale_s[v] if divides else 0.0) for v in range(n)]
    part_kind = {k: [col[v] + (scale_kind[k][v] if divides else 0.0) for v in range(n)] for k, col in once_kind.items()}
    mb = [v for v in range(n) if stages.phase[v] != PER_STEP]
    per_step = [v for v in range(n) if stages.phase[v] == PER_STEP]
    split = [v for v in mb if part_s[v] > 0]
    rows = [(f"{v}@{k}", v, k, False) for k in range(m) for v in mb]
    rows += [(f"{v}", v, -1, False) for v in per_step] + [(f"{v}+step", v, -1, True) for v in split]
    at = {(v, k): i for i, (_, v, k, part) in enumerate(rows) if not part}

    def seconds(total: np.ndarray, step: np.ndarray, v: int, k: int, part: bool, adds: list, parts: list) -> float:
        if part:
            return float(parts[v])
        if k < 0:
            return float(total[v])
        return float((total[v] - step[v]) * scale) + (adds[v] if k >= 1 else 0.0)

    nodes = []
    for nid, v, k, part in rows:
        rec = {"id": nid, "op": g.op[v], "kind": g.kind[v],
               "compute_s": seconds(g.compute_s, once, v, k, part, acc_s, part_s),
               "output_bytes": 0.0 if part else float(g.output_bytes[v] * (scale if k >= 0 else 1.0)),
               "temp_bytes": 0.0 if part else float(g.temp_bytes[v] * (scale if k >= 0 else 1.0))
               + (acc_bytes[v] if k >= 1 else 0.0),
               "param_bytes": float(g.param_bytes[v]) if k <= 0 and not part else 0.0}
        if g.kind_compute:
            rec["compute_s_by_kind"] = {kd: seconds(col, once_kind[kd], v, k, part, acc_kind[kd], part_kind[kd])
                                        for kd, col in g.kind_compute.items()}
        nodes.append(rec)
    edges = []
    is_mb = stages.phase != PER_STEP
    for e in range(g.num_edges):
        u, v, t = int(g.edge_src[e]), int(g.edge_dst[e]), int(g.edge_tensor[e])
        if is_mb[u] and is_mb[v]:
            edges += [(at[u, k], at[v, k], float(g.edge_bytes[e] * scale), t) for k in range(m)]
        else:  # into a per-step op: the last micro-batch's accumulated value
            edges.append((at[u, m - 1 if is_mb[u] else -1], at[v, -1], float(g.edge_bytes[e]), t))
    slot = np.array([at[v, 0 if is_mb[v] else -1] for v in range(n)], dtype=np.int64)
    step_nodes = per_step + split
    bar_ids, bar_dev, bar_src, bar_dst, bar_tensor = reference_barriers(
        g, devices, schedule, stages, slot, len(mb), devices[step_nodes].astype(np.int64),
        np.array([at[v, -1] for v in per_step] + [len(rows) - len(split) + i for i in range(len(split))],
                 dtype=np.int64), len(rows))
    for nid, d in zip(bar_ids, bar_dev, strict=True):
        dev = c.devices[d]
        rec = {"id": nid, "op": BARRIER, "compute_s": dev.action_s * dev.speed}
        if g.kind_compute:
            rec["compute_s_by_kind"] = {kd: dev.action_s for kd in g.kind_compute}
        nodes.append(rec)
    edges += [(int(a), int(b), 0.0, int(t)) for a, b, t in zip(bar_src, bar_dst, bar_tensor, strict=True)]
    ids = [r["id"] for r in nodes]
    built = CompGraph.build(f"{g.name}-{schedule.kind}-m{m}", nodes,
                            [{"src": ids[a], "dst": ids[b], "bytes": x, "tensor": t} for a, b, x, t in edges])
    nb = len(bar_ids)
    return Unrolled(built, np.array([v for _, v, _, _ in rows] + [-1] * nb, dtype=np.int64),
                    np.array([k for _, _, k, _ in rows] + [-1] * nb, dtype=np.int64),
                    np.array([devices[v] for _, v, _, _ in rows] + list(bar_dev), dtype=np.int64),
                    np.array([part for *_, part in rows] + [False] * nb, dtype=bool))


def reference_barriers(g: CompGraph, devices: np.ndarray, schedule: Schedule, stages: Stages, slot: np.ndarray,
                       a: int, step_devices: np.ndarray, step_nodes: np.ndarray, first: int):
    """The barriers node by node (docs/simulation.md): per device, after each non-empty action a barrier that waits
    for the action's sinks and that the next action's sources (after the last, the device's once-per-step nodes)
    wait for; an action's ops are its stage's micro-batch ops on the device of its phase (B or W under a split
    schedule; FULL: the B ops, then the W ops), a source has no in-edge from its own part, a sink no out-edge."""
    n, p = g.num_nodes, len(stages.pipeline_devices)
    w = reference_weight_grad_ops(g) if schedule.kind in SPLIT_KINDS else np.zeros(n, dtype=bool)
    part = [WEIGHT if w[v] else int(stages.phase[v]) for v in range(n)]
    ids, dev, edges = [], [], []

    def barrier(name: str, d: int, before: list[int], after: list[int]) -> None:
        b = first + len(ids)
        ids.append(name)
        dev.append(d)
        edges.extend([(x, b, BARRIER_TENSOR) for x in before] + [(b, x, 0) for x in after])

    for r, d in enumerate(stages.pipeline_devices):
        prev: list[int] = []
        for j, (ph, c, k) in enumerate(actions(schedule, p, r)):
            groups = [[v for v in range(n) if stages.phase[v] != PER_STEP and devices[v] == d
                       and stages.stage[v] == c * p + r and part[v] == x]
                      for x in ((BACKWARD, WEIGHT) if ph == FULL else (ph,))]
            if not any(groups):
                continue
            sources = [int(slot[v]) + k * a for ops in groups for v in ops
                       if not any(int(g.edge_src[e]) in ops for e in g.in_edges(v))]
            if prev:
                barrier(f"#{d}.{j}", d, prev, sources)
            prev = [int(slot[v]) + k * a for ops in groups for v in ops
                    if not any(int(g.edge_dst[e]) in ops for e in g.out_edges(v))]
        mine = [int(x) for x, on in zip(step_nodes, step_devices, strict=True) if on == d]
        if prev and mine:
            barrier(f"#{d}.end", d, prev, mine)
    return ids, dev, [e[0] for e in edges], [e[1] for e in edges], [e[2] for e in edges]


def reference_weight_grad_ops(g: CompGraph) -> np.ndarray:
    """`weight_grad_ops`' rule in numpy, node by node, successors first (the code before it was compiled)."""
    phase, classes = op_phases(g), _tie_classes(g)
    w = np.zeros(g.num_nodes, dtype=bool)
    for v in g.topo_order[::-1].tolist():
        if phase[v] != BACKWARD:
            continue
        succ = g.edge_dst[g.out_edges(v)]
        bwd = succ[phase[succ] == BACKWARD]
        to_step = bool((phase[succ] == PER_STEP).any())
        w[v] = bool(w[bwd].all() and (classes[bwd] == classes[v]).all()) and (to_step or bool(bwd.size))
    return w


def assert_same(got: Unrolled, ref: Unrolled) -> None:
    """Every column of the two unrolled steps equal, dtype included; floats bit for bit."""
    a, b = got.graph, ref.graph
    assert (a.name, a.ids, a.op, a.kind, a.group) == (b.name, b.ids, b.op, b.kind, b.group)
    assert a.index == b.index and a.kind_compute.keys() == b.kind_compute.keys()
    pairs = [(getattr(a, k), getattr(b, k), k) for k in (
        "compute_s", "output_bytes", "param_bytes", "temp_bytes", "edge_src", "edge_dst", "edge_bytes", "edge_tensor",
        "succ_ptr", "succ_edges", "pred_ptr", "pred_edges", "topo_order")]
    pairs += [(a.kind_compute[k], b.kind_compute[k], k) for k in a.kind_compute]
    pairs += [(getattr(got, k), getattr(ref, k), k) for k in ("source", "microbatch", "devices", "step_part")]
    for x, y, what in pairs:
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), what


def reference_tied_sums(g: CompGraph, stage: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """`tied_sums` as a walk over every backward op (successors first), checking each one's neighbours."""
    phase = op_phases(g)
    summed, root = np.zeros(g.num_nodes, dtype=bool), np.arange(g.num_nodes)
    for a in g.topo_order[::-1].tolist():
        succ, pred = g.edge_dst[g.out_edges(a)], g.edge_src[g.in_edges(a)]
        if (phase[a] == BACKWARD and succ.size and ((phase[succ] == PER_STEP) | summed[succ]).all() and pred.size
                and (phase[pred] == BACKWARD).all()
                and np.unique(stage[pred] if stage is not None else pred).size > 1):
            summed[a] = True
            later = succ[summed[succ]]
            root[a] = root[later[0]] if later.size else a
    return summed, root


def fresh_copy(g: CompGraph) -> CompGraph:
    """`g` again, nothing derived from it cached yet."""
    return CompGraph.from_arrays(
        g.name, g.ids, g.op, g.kind, g.group, g.compute_s, g.output_bytes, g.param_bytes, g.temp_bytes, g.edge_src,
        g.edge_dst, g.edge_bytes, g.edge_tensor, meta=g.meta, kind_compute=g.kind_compute, node_extra=g.node_extra)


def check(g: CompGraph, devices: np.ndarray, schedule: Schedule, c, chunk_of: np.ndarray | None = None) -> None:
    stages = pipeline_stages(g, devices, int(schedule.chunks or 1), schedule.device_order, chunk_of)
    for stage in (stages.stage, None):  # under this placement; under any (what a lower bound counts)
        assert [x.tolist() for x in tied_sums(g, stage)] == [
            x.tolist() for x in reference_tied_sums(fresh_copy(g), stage)]
    tied = tied_copies(g, devices, stages)
    rel = relay(tied.graph, tied.devices, tied.stages, schedule.kind in V_SHAPED)
    # what tied_copies and relay store on their graphs instead of computing them (`step_compute_extended`,
    # `tie_classes_extended`)
    for made in (tied.graph, rel.graph):
        fresh = fresh_copy(made)
        assert tie_classes(made).tolist() == _tie_classes(fresh).tolist()
        assert step_compute(made).compute_s.tolist() == _step_column(fresh).tolist()
        for kind, col in step_compute(made).by_kind.items():
            assert col.tolist() == _step_column(fresh, kind).tolist()
    # the gradient accumulation they store (`accumulation_extended`): the graph's, a tied sum's moved to its stages
    acc = reference_accumulation(g, stages.stage, rel.graph.num_nodes)
    got = accumulation(rel.graph)
    assert (got.compute_s.tolist(), {k: x.tolist() for k, x in got.by_kind.items()}, got.nbytes.tolist(),
            got.scale_s.tolist(), {k: x.tolist() for k, x in got.scale_by_kind.items()}) == acc
    fresh = fresh_copy(rel.graph)
    assert weight_grad_ops(rel.graph).tolist() == reference_weight_grad_ops(fresh).tolist()
    assert_same(unroll(rel.graph, rel.devices, schedule, rel.stages, c),
                reference_unroll(fresh, rel.devices, schedule, rel.stages, c, acc))


@settings(max_examples=120, deadline=None)
@given(pipelines(), st.sampled_from(["as drawn", "zero-bubble"]), st.booleans(), st.sampled_from([0.0, 0.25]))
def test_unroll_is_the_plain_build_on_random_pipelines(case, kind, extras, action_s):
    nodes, edges, p, placement, drawn, m, v, bw, lat, micro = case
    kind = drawn if kind == "as drawn" else kind
    if extras:  # per-kind times, and backward ops with a once-per-step part (a coarse group's update)
        for node in nodes:
            node["compute_s_by_kind"] = {KIND: 2 * node.get("compute_s", 0)}
            if node.get("kind") == "backward":
                node["step_compute_s"] = node.get("compute_s", 0) / 4
            if node.get("accumulate_s") and node["id"].endswith("0"):  # its own time on the kind, not scaled
                node["accumulate_s_by_kind"] = {KIND: 3 * node["accumulate_s"]}
            if node.get("accumulate_s"):  # and a mean loss's division of its gradients by M, once per step
                node["scale_s"] = node["accumulate_s"] / 2
    g = CompGraph.build("t", nodes, edges, {"capture": {"loss_reduction": "mean"}} if extras else None)
    c = cluster(p, bw=bw, lat=lat)
    c = Cluster(c.name, tuple(dataclasses.replace(d, action_s=action_s) for d in c.devices), c.link, c.links)
    devs = np.array([placement[nid] for nid in g.ids])
    try:
        check(g, devs, Schedule(kind, m, chunks=v, microbatch_graph=micro), c)
    except ScheduleError:  # not a pipeline under this schedule: nothing unrolled
        return


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zero-bubble"])
def test_a_tied_parameters_copies_keep_the_classes_and_once_per_step_parts(p, kind):
    g, devs = tied_lm(p)
    check(g, devs, Schedule(kind, 4, microbatch_graph=True), cluster(p, bw=1e9))
    assert tied_sums(g, devs)[0].any()  # the case has a sum across stages


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_chain_of_tied_gradient_sums_is_found_as_by_the_walk_over_every_backward_op(kind):
    """A parameter used on three stages: its gradient sums `s1` (stages 0 and 1) then `s2` (with stage 2's), `s1`
    a sum only because `s2` is one (it feeds no per-step op itself)."""
    fwd = ["f0", "f1", "f2"]
    nodes = [{"id": f, "kind": "forward", "compute_s": 1.0, "output_bytes": 10} for f in fwd]
    nodes += [{"id": f"b{i}", "kind": "backward", "group": f"f{i}", "compute_s": 1.0, "output_bytes": 10}
              for i in (2, 1, 0)]
    nodes += [{"id": "w1", "kind": "backward", "group": "f1", "compute_s": 1.0, "output_bytes": 20},
              {"id": "w2", "kind": "backward", "group": "f2", "compute_s": 1.0, "output_bytes": 20},
              {"id": "s1", "kind": "backward", "group": "f0", "compute_s": 0.5, "output_bytes": 20},
              {"id": "s2", "kind": "backward", "group": "f0", "compute_s": 0.5, "output_bytes": 20},
              {"id": "opt", "kind": "optimizer", "group": "f0", "compute_s": 2.0, "param_bytes": 40}]
    pairs = [("f0", "f1"), ("f1", "f2"), ("f2", "b2"), ("b2", "b1"), ("b1", "b0"), ("b2", "w1"), ("f1", "w2"),
             ("b2", "w2"), ("b0", "s1"), ("w1", "s1"), ("s1", "s2"), ("w2", "s2"), ("s2", "opt")]
    g = CompGraph.build("chain", nodes, [{"src": a, "dst": b, "bytes": 10} for a, b in pairs])
    devs = np.array([int(g.group[v][-1]) if g.group[v] else int(nid[-1]) for v, nid in enumerate(g.ids)])
    check(g, devs, Schedule(kind, 4, microbatch_graph=True), cluster(3, bw=1e9))
    summed, root = tied_sums(g, devs)
    assert summed[[g.index["s1"], g.index["s2"]]].all() and root[g.index["s1"]] == g.index["s2"]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zero-bubble"])
def test_one_graph_unrolled_under_several_placements_is_each_ones_plain_build(kind):
    """What `unroll` keeps per graph across placements (all but the barriers) gives each placement's step as a
    build from scratch does; and under another micro-batch count or size, that one's."""
    g = zchain(6, 0.5, 1.0, 0.25)
    c = cluster(3, bw=1e9)
    for cuts, m, micro in (((2, 4), 4, True), ((1, 3), 4, True), ((3, 5), 4, True), ((1, 3), 6, True),
                           ((1, 3), 4, False), ((2, 4), 4, True)):
        devs = np.searchsorted(np.array(cuts), layer(g), side="right")
        schedule = Schedule(kind, m, microbatch_graph=micro)
        stages = pipeline_stages(g, devs, 1, None)
        assert_same(unroll(g, devs, schedule, stages, c), reference_unroll(
            fresh_copy(g), devs, schedule, stages, c, reference_accumulation(g, stages.stage, g.num_nodes)))


@pytest.mark.parametrize("kind", V_SHAPED)
def test_unroll_is_the_plain_build_on_a_v(kind):
    p, m = 2, 4
    g = zchain(2 * p, 0.5, 0.5, 0.5, microbatches=m)
    pos, chunk = stage_layout(ParallelPlan(dp=1, pp=p, microbatches=m, batch=m, schedule=kind), layer(g))
    check(g, pos, Schedule(kind, m, microbatch_graph=True), cluster(p, bw=1e9), chunk)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=20))))
def test_compiled_csr_and_parallel_edges_match_numpy(case):
    n, pairs = case
    pairs = [(min(a, b), max(a, b)) for a, b in pairs if a != b]  # acyclic; repeats are parallel edges
    src = np.array([a for a, _ in pairs], dtype=np.int64)
    dst = np.array([b for _, b in pairs], dtype=np.int64)
    g = CompGraph.from_arrays("t", [f"n{i}" for i in range(n)], [""] * n, [""] * n, [""] * n, np.zeros(n),
                              np.zeros(n), np.zeros(n), np.zeros(n), src, dst, np.zeros(src.size),
                              np.arange(src.size))  # a tensor per edge: parallel edges are not duplicates
    for keys, ptr, order in ((src, g.succ_ptr, g.succ_edges), (dst, g.pred_ptr, g.pred_edges)):
        assert order.tolist() == np.argsort(keys, kind="stable").tolist()
        assert ptr.tolist() == [0, *np.cumsum(np.bincount(keys, minlength=n)).tolist()]
    seen: set[tuple[int, int]] = set()
    first = [pair not in seen and not seen.add(pair) for pair in pairs]
    assert _first_of_parallel(g).tolist() == first


def test_an_input_relayed_by_its_first_edge_is_tied_to_its_relay():
    # x feeds f2 two stages on by its first edge: in the relayed graph that edge leaves the relay, and x's first
    # successor, which it is tied to, is f0: relay may not keep the graph's classes
    nodes = [{"id": "x", "op": "input", "kind": "forward", "output_bytes": 4}]
    nodes += [{"id": f"f{i}", "kind": "forward", "compute_s": 1.0} for i in range(3)]
    nodes += [{"id": f"b{i}", "kind": "backward", "group": f"f{i}", "compute_s": 1.0} for i in range(3)]
    edges = [{"src": "x", "dst": "f2", "bytes": 4}, {"src": "x", "dst": "f0", "bytes": 4}]
    edges += [{"src": f"f{i}", "dst": f"f{i + 1}", "bytes": 1} for i in range(2)]
    edges += [{"src": f"f{i}", "dst": f"b{i}", "bytes": 1} for i in range(3)]
    edges += [{"src": f"b{i + 1}", "dst": f"b{i}", "bytes": 1} for i in range(2)]
    g = CompGraph.build("x", nodes, edges)
    devices = np.array([0, 0, 1, 2, 0, 1, 2])
    rel = relay(g, devices, pipeline_stages(g, devices, 1))
    assert tie_classes(g)[0] == tie_classes(g)[3] and tie_classes(rel.graph)[0] == tie_classes(rel.graph)[1]
    check(g, devices, Schedule("zero-bubble", 2), cluster(3))

"""Timelines: the Chrome trace-event JSON and the Gantt PNG (results are built by hand, not simulated)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link
from devplace.sim.result import SimResult, Transfers
from devplace.sim.timeline import (
    channel_label,
    device_label,
    plot_timeline,
    trace_events,
    write_trace,
)
from devplace.units import fmt_bytes, fmt_time

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KINDS = ("forward", "backward", "optimizer", "")


def make_cluster(n_dev: int) -> Cluster:
    devs = tuple(Device(name=f"gpu{d}", memory_bytes=16e9) for d in range(n_dev))
    return Cluster(name=f"{n_dev}xTest", devices=devs, link=Link(bandwidth_Bps=1e10, latency_s=1e-5))


def make_case(n_ops: int, n_dev: int, seed: int, *, transfers: bool = True, bus: bool = False,
              zero_every: int = 0) -> tuple[CompGraph, Cluster, SimResult]:
    """A chain-with-skips graph, a random placement and a plausible hand-made schedule: each op starts
    when its device is free and its inputs have arrived; cross-device edges become FIFO transfers."""
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(n_ops):
        kind = KINDS[min(3 * i // max(n_ops, 1), 2)] if i % 17 else ""
        c = 0.0 if zero_every and i % zero_every == 0 else float(rng.uniform(1e-5, 5e-4))
        nodes.append({"id": f"op{i}", "op": "aten.mm" if i % 2 else "aten.add", "compute_s": c, "kind": kind,
                      "output_bytes": int(rng.integers(1, 1_000_000))})
    edges = []
    for i in range(1, n_ops):
        edges.append({"src": f"op{i - 1}", "dst": f"op{i}", "bytes": nodes[i - 1]["output_bytes"]})
        if i >= 3 and i % 3 == 0:
            edges.append({"src": f"op{i - 3}", "dst": f"op{i}", "bytes": nodes[i - 3]["output_bytes"]})
    graph = CompGraph.build(f"test-{n_ops}", nodes, edges)
    cluster = make_cluster(n_dev)
    dev = rng.integers(0, n_dev, size=n_ops) if transfers else np.zeros(n_ops, dtype=np.int64)

    start, finish = np.zeros(n_ops), np.zeros(n_ops)
    dev_free = np.zeros(n_dev)
    chan_free: dict[tuple[int, int], float] = {}
    arrive: dict[tuple[int, int], float] = {}
    rec: list[tuple[int, int, int, int, float, float, float]] = []
    for v in graph.topo_order.tolist():
        ready = 0.0
        for u in graph.predecessors(v):
            ready = max(ready, finish[u] if dev[u] == dev[v] else arrive[(u, int(dev[v]))])
        start[v] = max(ready, dev_free[dev[v]])
        finish[v] = start[v] + graph.compute_s[v]
        dev_free[dev[v]] = finish[v]
        targets = sorted({int(dev[w]) for w in graph.successors(v)} - {int(dev[v])})
        for b in ([-1] if bus and targets else targets):
            ch = (int(dev[v]), b)
            t0 = max(finish[v], chan_free.get(ch, 0.0))
            nbytes = float(graph.output_bytes[v])
            t1 = t0 + 1e-5 + nbytes / 1e10
            chan_free[ch] = t1
            for w in targets if b == -1 else [b]:
                arrive[(v, w)] = t1
            rec.append((v, 0, ch[0], ch[1], nbytes, t0, t1))
    order = sorted(range(len(rec)), key=lambda k: (rec[k][5], k))
    col = list(zip(*[rec[k] for k in order], strict=True)) if rec else [()] * 7
    tr = Transfers(node=np.array(col[0], dtype=np.int64), tensor=np.array(col[1], dtype=np.int64),
                   src_dev=np.array(col[2], dtype=np.int64), dst_dev=np.array(col[3], dtype=np.int64),
                   nbytes=np.array(col[4], dtype=np.float64), start_s=np.array(col[5], dtype=np.float64),
                   finish_s=np.array(col[6], dtype=np.float64))
    busy = np.bincount(dev, weights=finish - start, minlength=n_dev)
    result = SimResult(model="devplace", step_time_s=float(finish.max()), device=dev.astype(np.int64),
                       start_s=start, finish_s=finish, peak_memory_bytes=np.zeros(n_dev),
                       memory_bytes=cluster.memory, device_busy_s=busy, comm_bytes=float(tr.nbytes.sum()),
                       transfers=tr)
    return graph, cluster, result


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def thread_names(doc: dict) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def process_names(doc: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


# ----------------------------------------------------------------------------------------- trace
def test_trace_structure(tmp_path: Path) -> None:
    graph, cluster, result = make_case(60, 3, seed=1, zero_every=11)
    path = tmp_path / "t.json"
    write_trace(graph, cluster, result, path)
    doc = load(path)
    assert doc["displayTimeUnit"] in ("ms", "ns")
    assert doc["otherData"]["graph"] == graph.name and doc["otherData"]["cluster"] == cluster.name
    procs = process_names(doc)
    assert sorted(procs.values()) == ["channels", "devices"]
    dev_pid = next(p for p, n in procs.items() if n == "devices")
    chan_pid = next(p for p, n in procs.items() if n == "channels")
    names = thread_names(doc)

    # One named track per device, named after the device.
    dev_tracks = {n: key for key, n in names.items() if key[0] == dev_pid}
    assert sorted(dev_tracks) == sorted(device_label(cluster, d) for d in range(3))
    assert all(f"gpu{d}" in device_label(cluster, d) and str(d) in device_label(cluster, d) for d in range(3))

    # One named track per used channel, and only those.
    used = sorted({(int(a), int(b)) for a, b in zip(result.transfers.src_dev, result.transfers.dst_dev,
                                                    strict=True)})
    chan_tracks = {n: key for key, n in names.items() if key[0] == chan_pid}
    assert sorted(chan_tracks) == sorted(channel_label(cluster, a, b) for a, b in used)
    assert "gpu0 -> gpu1" in chan_tracks
    # tids never collide across processes (Perfetto keys threads by tid).
    assert len({tid for _, tid in names}) == len(names)

    # Every op exactly once, on its device's track, with ts/dur in microseconds.
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == dev_pid]
    assert Counter(e["name"] for e in ops) == Counter(graph.ids)
    for e in ops:
        v = graph.index[e["name"]]
        assert e["tid"] == dev_tracks[device_label(cluster, int(result.device[v]))][1]
        assert e["ts"] == pytest.approx(result.start_s[v] * 1e6, abs=1e-3)
        assert e["dur"] == pytest.approx((result.finish_s[v] - result.start_s[v]) * 1e6, abs=1e-3)
        assert e["cat"] == (graph.kind[v] or "op")
        assert e["args"]["op"] == graph.op[v] and e["args"]["kind"] == graph.kind[v]
        assert e["args"]["node"] == graph.ids[v]
        assert e["args"]["compute_s"] == graph.compute_s[v]
    zero = [e for e in ops if graph.compute_s[graph.index[e["name"]]] == 0]
    assert zero and all(e["dur"] == 0 for e in zero)

    # Every transfer on its channel's track.
    trs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == chan_pid]
    assert len(trs) == len(result.transfers)
    t = result.transfers
    want = Counter((f"{graph.ids[t.node[k]]}:{t.tensor[k]}", channel_label(cluster, t.src_dev[k], t.dst_dev[k]),
                    round(t.start_s[k] * 1e6, 3), int(t.nbytes[k])) for k in range(len(t)))
    got = Counter((e["name"], names[(e["pid"], e["tid"])], round(e["ts"], 3), e["args"]["bytes"]) for e in trs)
    assert got == want


def test_trace_slices_nest_on_every_track(tmp_path: Path) -> None:
    """Back-to-back events must not overlap after the microsecond conversion (Perfetto drops them)."""
    graph, cluster, result = make_case(500, 4, seed=2, zero_every=7)
    doc = trace_events(graph, cluster, result)
    by_track: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            a = round(e["ts"] * 1000)
            by_track.setdefault((e["pid"], e["tid"]), []).append((a, a + round(e["dur"] * 1000)))
    for spans in by_track.values():
        spans.sort()
        for (_, end), (nxt, _) in pairwise(spans):
            assert end <= nxt


def test_trace_is_deterministic(tmp_path: Path) -> None:
    graph, cluster, result = make_case(200, 3, seed=3)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_trace(graph, cluster, result, a)
    write_trace(graph, cluster, result, b)
    assert a.read_bytes() == b.read_bytes()
    graph2, cluster2, result2 = make_case(200, 3, seed=3)  # equal inputs built again
    c = tmp_path / "c.json"
    write_trace(graph2, cluster2, result2, c)
    assert a.read_bytes() == c.read_bytes()


def test_trace_without_transfers(tmp_path: Path) -> None:
    graph, cluster, result = make_case(40, 2, seed=4, transfers=False)
    assert len(result.transfers) == 0
    path = tmp_path / "t.json"
    write_trace(graph, cluster, result, path)
    doc = load(path)
    assert "channels" not in process_names(doc).values()
    assert len(thread_names(doc)) == 2  # both devices named, even the idle one
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == 40


def test_trace_bus_broadcast_track(tmp_path: Path) -> None:
    graph, cluster, result = make_case(80, 3, seed=5, bus=True)
    assert np.all(result.transfers.dst_dev == -1) and len(result.transfers)
    doc = trace_events(graph, cluster, result)
    chan = {n for (pid, _), n in thread_names(doc).items() if process_names(doc)[pid] == "channels"}
    assert chan and all(n.endswith(" bus") for n in chan)
    assert channel_label(cluster, 1, -1) == "gpu1 bus"


def test_trace_skips_ops_that_did_not_run(tmp_path: Path) -> None:
    graph, cluster, result = make_case(20, 2, seed=6, transfers=False)
    start = result.start_s.copy()
    start[5] = np.nan
    broken = SimResult(**{**result.__dict__, "start_s": start})
    path = tmp_path / "t.json"
    write_trace(graph, cluster, broken, path)  # valid JSON, no NaN
    doc = load(path)
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == 19
    assert doc["otherData"]["ops_not_scheduled"] == 1


def test_trace_rejects_result_of_another_graph(tmp_path: Path) -> None:
    from devplace.errors import DevplaceError

    graph, cluster, _ = make_case(20, 2, seed=7)
    _, _, other = make_case(30, 2, seed=7)
    with pytest.raises(DevplaceError, match="another graph"):
        write_trace(graph, cluster, other, tmp_path / "t.json")


# ----------------------------------------------------------------------------------------- plot
def rc_snapshot() -> dict:
    # dict.items avoids RcParams.__getitem__, which would resolve (and so change) the backend.
    return dict(dict.items(matplotlib.rcParams))


def test_plot_writes_png_and_leaves_matplotlib_alone(tmp_path: Path) -> None:
    graph, cluster, result = make_case(60, 3, seed=8, zero_every=9)
    had_pyplot = "matplotlib.pyplot" in sys.modules
    before = rc_snapshot()
    path = tmp_path / "t.png"
    plot_timeline(graph, cluster, result, path, lower_bound_s=result.step_time_s * 0.6)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert rc_snapshot() == before
    if not had_pyplot:
        assert "matplotlib.pyplot" not in sys.modules


def test_plot_is_deterministic(tmp_path: Path) -> None:
    graph, cluster, result = make_case(120, 3, seed=9)
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    plot_timeline(graph, cluster, result, a, title="custom title")
    plot_timeline(graph, cluster, result, b, title="custom title")
    assert a.read_bytes() == b.read_bytes()


def test_plot_without_transfers(tmp_path: Path) -> None:
    graph, cluster, result = make_case(30, 2, seed=10, transfers=False)
    path = tmp_path / "t.png"
    plot_timeline(graph, cluster, result, path)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_plot_bus_and_empty_graph(tmp_path: Path) -> None:
    graph, cluster, result = make_case(50, 3, seed=11, bus=True)
    plot_timeline(graph, cluster, result, tmp_path / "bus.png", lower_bound_s=0.0)
    assert (tmp_path / "bus.png").read_bytes().startswith(PNG_MAGIC)
    empty = CompGraph.build("empty", [], [])
    cl = make_cluster(2)
    none = np.zeros(0, dtype=np.int64)
    nothing = np.zeros(0)
    res = SimResult(model="devplace", step_time_s=0.0, device=none, start_s=nothing, finish_s=nothing,
                    peak_memory_bytes=np.zeros(2), memory_bytes=cl.memory, device_busy_s=np.zeros(2),
                    comm_bytes=0.0, transfers=Transfers(none, none, none, none, nothing, nothing, nothing))
    plot_timeline(empty, cl, res, tmp_path / "empty.png")
    write_trace(empty, cl, res, tmp_path / "empty.json")
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)
    assert load(tmp_path / "empty.json")["traceEvents"]


def test_larger_random_case(tmp_path: Path) -> None:
    graph, cluster, result = make_case(2000, 4, seed=12, zero_every=13)
    write_trace(graph, cluster, result, tmp_path / "big.json")
    doc = load(tmp_path / "big.json")
    dev_pid = next(p for p, n in process_names(doc).items() if n == "devices")
    assert sum(e["ph"] == "X" and e["pid"] == dev_pid for e in doc["traceEvents"]) == 2000
    plot_timeline(graph, cluster, result, tmp_path / "big.png", lower_bound_s=result.step_time_s / 3)
    assert (tmp_path / "big.png").read_bytes().startswith(PNG_MAGIC)


def test_formatters() -> None:
    """The timeline's labels: devplace.units' formatters in their compact style (significant digits)."""
    assert fmt_time(0.0123, digits=4) == "12.3 ms"
    assert fmt_time(2.5, digits=4) == "2.5 s"
    assert fmt_time(4.2e-5, digits=4) == "42 µs"
    assert fmt_bytes(1.5e9, digits=3) == "1.5 GB"
    assert fmt_bytes(12, digits=3) == "12 B"


# ----------------------------------------------------------------------------------------- pipelined steps
def pipelined_case(m: int = 4):
    """Three layers (forward, backward, an optimizer op each) on three devices under 1F1B with m micro-batches."""
    from devplace.sim import Schedule, simulate

    nodes, edges = [], []
    for i in range(3):
        nodes += [{"id": f"l{i}", "kind": "forward", "compute_s": 1.0, "output_bytes": 4.0, "param_bytes": 1.0},
                  {"id": f"g{i}", "kind": "backward", "group": f"l{i}", "compute_s": 2.0, "output_bytes": 1.0},
                  {"id": f"o{i}", "kind": "optimizer", "group": f"l{i}", "compute_s": 0.5}]
        edges += [{"src": f"l{i}", "dst": f"g{i}", "bytes": 4.0}, {"src": f"g{i}", "dst": f"o{i}", "bytes": 1.0}]
        if i:
            edges += [{"src": f"l{i - 1}", "dst": f"l{i}", "bytes": 4.0}, {"src": f"g{i}", "dst": f"g{i - 1}",
                                                                          "bytes": 1.0}]
    graph = CompGraph.build("pipe", nodes, edges)
    cluster = make_cluster(3)
    devices = [int(graph.ids[v][1]) for v in range(graph.num_nodes)]
    return graph, cluster, simulate(graph, cluster, devices, schedule=Schedule("1f1b", m))


def test_trace_of_a_pipelined_step_has_one_event_per_op_per_microbatch(tmp_path: Path) -> None:
    graph, cluster, result = pipelined_case(4)
    path = tmp_path / "p.json"
    write_trace(graph, cluster, result, path)
    doc = load(path)
    dev_pid = next(p for p, n in process_names(doc).items() if n == "devices")
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == dev_pid]
    runs = Counter((e["args"]["node"], e["args"].get("microbatch")) for e in ops)
    want = Counter({(nid, k): 1 for nid in graph.ids if nid[0] in "lg" for k in range(4)})
    want.update({(nid, None): 1 for nid in graph.ids if nid[0] == "o"})  # the optimizer once per step
    assert runs == want
    for e in ops:
        v, k = graph.index[e["args"]["node"]], e["args"].get("microbatch")
        assert e["name"] == (f"{graph.ids[v]} [mb {k}]" if k is not None else graph.ids[v])
        start = result.microbatch_start_s[k or 0, v]
        assert e["ts"] == pytest.approx(start * 1e6, abs=1e-3)
    trs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] != dev_pid]
    assert len(trs) == len(result.transfers)
    assert Counter(e["args"].get("microbatch") for e in trs) == Counter(
        k if k >= 0 else None for k in result.transfer_microbatch.tolist())
    assert doc["otherData"]["schedule"]["microbatches"] == 4


def test_plot_of_a_pipelined_step(tmp_path: Path) -> None:
    graph, cluster, result = pipelined_case(4)
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    plot_timeline(graph, cluster, result, a)
    plot_timeline(graph, cluster, result, b)
    assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and a.read_bytes() == b.read_bytes()

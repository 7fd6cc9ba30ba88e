"""Timelines of a simulated step: a Chrome trace-event file (Perfetto, chrome://tracing) and a Gantt PNG.

`write_trace` writes the JSON "traceEvents" object form: process "devices" with one track per device,
process "channels" with one track per channel that carried a transfer ("gpu0 -> gpu1", or "gpu0 bus" for
the placeto model's broadcasts). Timestamps are microseconds, rounded to whole nanoseconds *before*
conversion so that an op that ends exactly when the next one starts never overlaps it in the viewer
(Perfetto drops complete events that do not nest).

`plot_timeline` draws the same schedule with matplotlib's Agg canvas on a private `Figure` (no pyplot,
no global state), one unsnapped polygon collection per kind (touching bars merged), so 100k ops plot in
a couple of seconds and bars thinner than a pixel still shade their share of it.

A pipelined step (a `ScheduledResult`, `devplace.sim.schedule`) shows every run of an op: a forward or
backward op once per micro-batch (trace events named "<node id> [mb k]" with `args.microbatch` k; in the PNG
bars coloured by micro-batch, backward darker than forward, each action labelled "F k" / "B k"), once-per-step
ops (the optimizer) once.

Both outputs are deterministic: the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from devplace.errors import DevplaceError
from devplace.files import TRACE, save_png, write_output
from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.sim.result import SimResult
from devplace.sim.schedule import ScheduledResult
from devplace.units import fmt_bytes, fmt_time, time_unit

DEVICES_PID = 1
CHANNELS_PID = 2
FIRST_TID = 3  # tids are unique across both processes and never equal a pid (Perfetto keys threads by tid)

KINDS = ("forward", "backward", "optimizer")
KIND_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "other": "#8C8C8C"}
TRANSFER_COLOR = "#8172B3"
# micro-batch k's forward colour (cycled); its backward is the same hue darkened by BACKWARD_SHADE. None is
# the optimizer's, the transfers' or "other"'s colour, which per-step ops and channels keep
MICROBATCH_COLORS = ("#4C72B0", "#DD8452", "#C44E52", "#937860", "#DA8BC3", "#CCB974", "#64B5CD", "#2F4B7C",
                     "#A05195", "#F95D6A")
BACKWARD_SHADE = 0.55
ZERO_COLOR = "#222222"


# ----------------------------------------------------------------------------------------- shared
@dataclass(frozen=True)
class _Schedule:
    """The validated, drawable part of a result: op runs and transfers with finite times on known devices.
    For a pipelined step an op has one run per micro-batch (`op_mb` its micro-batch, -1 for once per step)."""

    ops: np.ndarray  # int64, node index of each run
    op_dev: np.ndarray  # int64
    op_start: np.ndarray  # float64 seconds
    op_finish: np.ndarray  # float64 seconds, >= op_start
    skipped_ops: int
    op_mb: np.ndarray  # int64, micro-batch of each run (-1: once per step or not pipelined)
    tr: np.ndarray  # int64, transfer indices
    tr_mb: np.ndarray  # int64, micro-batch of each shown transfer (-1: per step or not pipelined)
    tr_chan: np.ndarray  # int64, index into `channels`
    tr_start: np.ndarray
    tr_finish: np.ndarray
    channels: tuple[tuple[int, int], ...]  # (src, dst) in sorted order, dst -1 = bus broadcast
    skipped_transfers: int


def _schedule(graph: CompGraph, cluster: Cluster, result: SimResult) -> _Schedule:
    n = graph.num_nodes
    for name in ("device", "start_s", "finish_s"):
        shape = np.shape(getattr(result, name))
        if shape != (n,):
            raise DevplaceError(f"result.{name} has shape {shape} but graph {graph.name!r} has {n} nodes; "
                                "was the result simulated on another graph?")
    n_dev = cluster.num_devices
    dev = np.asarray(result.device, dtype=np.int64)
    if isinstance(result, ScheduledResult):  # one run per micro-batch of micro-batch ops, one of the others
        count = np.where(result.stage >= 0, result.schedule.microbatches, 1)
        run_node = np.repeat(np.arange(n, dtype=np.int64), count)
        run_mb = np.arange(run_node.size) - np.repeat(np.cumsum(count) - count, count)
        start = result.microbatch_start_s[run_mb, run_node]
        finish = result.microbatch_finish_s[run_mb, run_node]
        run_mb = np.where(result.stage[run_node] >= 0, run_mb, -1)
    else:
        run_node, run_mb = np.arange(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        start = np.asarray(result.start_s, dtype=np.float64)
        finish = np.asarray(result.finish_s, dtype=np.float64)
    ok = (dev[run_node] >= 0) & (dev[run_node] < n_dev) & np.isfinite(start) & np.isfinite(finish)
    runs = np.flatnonzero(ok)
    ops = run_node[runs]
    op_start = start[runs]
    op_finish = np.maximum(finish[runs], op_start)

    t = result.transfers
    m = len(t)
    src = np.asarray(t.src_dev, dtype=np.int64)
    dst = np.asarray(t.dst_dev, dtype=np.int64)
    ts = np.asarray(t.start_s, dtype=np.float64)
    tf = np.asarray(t.finish_s, dtype=np.float64)
    node = np.asarray(t.node, dtype=np.int64)
    tok = ((src >= 0) & (src < n_dev) & (dst >= -1) & (dst < n_dev) & (node >= 0) & (node < n)
           & np.isfinite(ts) & np.isfinite(tf)
           & np.isfinite(np.asarray(t.nbytes, dtype=np.float64))) if m else np.zeros(0, dtype=bool)
    tr = np.flatnonzero(tok).astype(np.int64)
    keys = src[tr] * (n_dev + 1) + (dst[tr] + 1)  # sorts by src, then bus (-1) first, then dst
    uniq, chan = np.unique(keys, return_inverse=True)
    channels = tuple((int(k // (n_dev + 1)), int(k % (n_dev + 1)) - 1) for k in uniq.tolist())
    tr_start = ts[tr]
    tr_mb = (np.asarray(result.transfer_microbatch, dtype=np.int64)[tr] if isinstance(result, ScheduledResult)
             else np.full(tr.size, -1, dtype=np.int64))
    return _Schedule(ops=ops, op_dev=dev[ops], op_start=op_start, op_finish=op_finish,
                     skipped_ops=int(np.unique(run_node[~ok]).size), op_mb=run_mb[runs], tr=tr, tr_mb=tr_mb,
                     tr_chan=chan.astype(np.int64).reshape(-1),
                     tr_start=tr_start, tr_finish=np.maximum(tf[tr], tr_start), channels=channels,
                     skipped_transfers=int(m - tr.size))


def device_label(cluster: Cluster, d: int) -> str:
    """A device's track name: its name and index, e.g. "gpu0 [0]"."""
    return f"{cluster.devices[d].name} [{d}]"


def channel_label(cluster: Cluster, src: int, dst: int) -> str:
    """A channel's track name: "gpu0 -> gpu1", or "gpu0 bus" for a broadcast (dst -1)."""
    if dst < 0:
        return f"{cluster.devices[src].name} bus"
    return f"{cluster.devices[src].name} -> {cluster.devices[dst].name}"


def _kind_name(kind: str) -> str:
    return kind if kind in KINDS else "other"


def _num(x: float) -> int | float:
    """An integral float as a JSON integer (byte counts), anything else as itself."""
    x = float(x)
    if math.isfinite(x) and x == int(x) and abs(x) < 2**53:
        return int(x)
    return x


# ----------------------------------------------------------------------------------------- trace
def _ns(seconds: np.ndarray) -> np.ndarray:
    """Times in whole nanoseconds. Rounding is monotone, so intervals that do not overlap in seconds do
    not overlap here either, and an op ending at t ends exactly where one starting at t starts."""
    return np.rint(np.asarray(seconds, dtype=np.float64) * 1e9).astype(np.int64)


def _us(ns: np.ndarray) -> list[int | float]:
    """Nanoseconds as microsecond JSON values: integers when whole, else with three decimals."""
    whole = (ns % 1000 == 0).tolist()
    return [q if w else v for q, w, v in zip((ns // 1000).tolist(), whole, (ns / 1000.0).tolist(), strict=True)]


def _trace_lines(graph: CompGraph, cluster: Cluster, result: SimResult) -> list[str]:
    """The trace file, one event per line. Built as text (strings JSON-quoted once each, numbers as
    Python's shortest round-trip repr, which is what `json` writes) because 100k+ events as dicts cost
    several times more to build and encode."""
    s = _schedule(graph, cluster, result)
    n_dev = cluster.num_devices
    q = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
    events: list[str] = []

    def meta(name: str, pid: int, tid: int | None, key: str, value: str | int) -> None:
        where = f'"pid":{pid}' + (f',"tid":{tid}' if tid is not None else "")
        events.append(f'{{"name":"{name}","ph":"M","ts":0,{where},"args":{{"{key}":{q(value)}}}}}')

    meta("process_name", DEVICES_PID, None, "name", "devices")
    meta("process_sort_index", DEVICES_PID, None, "sort_index", 0)
    for d in range(n_dev):
        meta("thread_name", DEVICES_PID, FIRST_TID + d, "name", device_label(cluster, d))
        meta("thread_sort_index", DEVICES_PID, FIRST_TID + d, "sort_index", d)
    if s.channels:
        meta("process_name", CHANNELS_PID, None, "name", "channels")
        meta("process_sort_index", CHANNELS_PID, None, "sort_index", 1)
        for k, (a, b) in enumerate(s.channels):
            meta("thread_name", CHANNELS_PID, FIRST_TID + n_dev + k, "name", channel_label(cluster, a, b))
            meta("thread_sort_index", CHANNELS_PID, FIRST_TID + n_dev + k, "sort_index", k)

    # Ops, by track, then start, then finish (a zero-length op before the op that starts when it ends).
    s_ns, f_ns = _ns(s.op_start), _ns(s.op_finish)
    s_us, d_us = _us(s_ns), _us(f_ns - s_ns)
    order = np.lexsort((s.op_mb, s.ops, f_ns, s_ns, s.op_dev)).tolist()
    ops, devs, mbs = s.ops.tolist(), s.op_dev.tolist(), s.op_mb.tolist()
    start, finish = s.op_start.tolist(), s.op_finish.tolist()
    compute = graph.compute_s.tolist()
    cache: dict[str, str] = {}
    for i in order:
        v, k = ops[i], mbs[i]
        nid = q(graph.ids[v])
        name, mb = (q(f"{graph.ids[v]} [mb {k}]"), f',"microbatch":{k}') if k >= 0 else (nid, "")
        op = cache.get(graph.op[v]) or cache.setdefault(graph.op[v], q(graph.op[v]))
        kind = cache.get(graph.kind[v]) or cache.setdefault(graph.kind[v], q(graph.kind[v]))
        cat = kind if graph.kind[v] else '"op"'
        events.append(
            f'{{"name":{name},"cat":{cat},"ph":"X","ts":{s_us[i]},"dur":{d_us[i]},"pid":{DEVICES_PID},'
            f'"tid":{FIRST_TID + devs[i]},"args":{{"node":{nid},"index":{v},"op":{op},"kind":{kind}{mb},'
            f'"compute_s":{compute[v]!r},"start_s":{start[i]!r},"finish_s":{finish[i]!r}}}}}'
        )

    # Transfers, by channel, then start.
    t = result.transfers
    s_ns, f_ns = _ns(s.tr_start), _ns(s.tr_finish)
    s_us, d_us = _us(s_ns), _us(f_ns - s_ns)
    order = np.lexsort((s.tr, f_ns, s_ns, s.tr_chan)).tolist()
    tr, chan, tr_mbs = s.tr.tolist(), s.tr_chan.tolist(), s.tr_mb.tolist()
    node, tensor = np.asarray(t.node).tolist(), np.asarray(t.tensor).tolist()
    nbytes = [_num(x) for x in np.asarray(t.nbytes, dtype=np.float64).tolist()]
    src, dst = np.asarray(t.src_dev).tolist(), np.asarray(t.dst_dev).tolist()
    labels = [q(device_label(cluster, d)) for d in range(n_dev)] + ['"broadcast"']  # [-1]: dst -1
    start, finish = s.tr_start.tolist(), s.tr_finish.tolist()
    for i in order:
        j, k = tr[i], tr_mbs[i]
        nid = graph.ids[node[j]]
        label, mb = (f"{nid}:{tensor[j]} [mb {k}]", f',"microbatch":{k}') if k >= 0 else (f"{nid}:{tensor[j]}", "")
        events.append(
            f'{{"name":{q(label)},"cat":"transfer","ph":"X","ts":{s_us[i]},"dur":{d_us[i]},'
            f'"pid":{CHANNELS_PID},"tid":{FIRST_TID + n_dev + chan[i]},"args":{{"node":{q(nid)},'
            f'"tensor":{tensor[j]},"bytes":{nbytes[j]!r},"src":{labels[src[j]]},"dst":{labels[dst[j]]}{mb},'
            f'"start_s":{start[i]!r},"finish_s":{finish[i]!r}}}}}'
        )

    step = float(result.step_time_s)
    other: dict[str, Any] = {
        "generator": "devplace", "graph": graph.name, "cluster": cluster.name, "model": result.model,
        "step_time_s": step if math.isfinite(step) else None, "feasible": result.feasible,
        "num_ops": graph.num_nodes, "num_transfers": len(t),
    }
    if isinstance(result, ScheduledResult):
        other["schedule"] = result.schedule.to_dict()
    if s.skipped_ops:
        other["ops_not_scheduled"] = s.skipped_ops
    if s.skipped_transfers:
        other["transfers_not_shown"] = s.skipped_transfers
    lines = ['{"traceEvents":[']
    lines.extend(ev + "," for ev in events[:-1])
    lines.append(events[-1])
    lines.append(f'],"displayTimeUnit":"ms","otherData":{q(other)}}}')
    return lines


def trace_events(graph: CompGraph, cluster: Cluster, result: SimResult) -> dict[str, Any]:
    """The Chrome trace-event document that `write_trace` writes, parsed back into a dict."""
    return json.loads("\n".join(_trace_lines(graph, cluster, result)))  # type: ignore[no-any-return]


def write_trace(graph: CompGraph, cluster: Cluster, result: SimResult, path: str | Path) -> None:
    """Write the step as a Chrome trace-event JSON file that opens in Perfetto (ui.perfetto.dev) and
    chrome://tracing: process "devices" (a track per device, each op an "X" event named by node id,
    `cat` its kind) and process "channels" (a track per channel used, each transfer an "X" event named
    "<node id>:<tensor>" with its bytes in `args`). One event per line; same input, same bytes.
    Ops that did not run (non-finite times or no device) are left out and counted in `otherData`."""
    write_output(path, "\n".join(_trace_lines(graph, cluster, result)) + "\n", "--trace", TRACE)


# ----------------------------------------------------------------------------------------- plot
def _shade(color: str, factor: float) -> str:
    """`color` ("#rrggbb") with each channel scaled by `factor` (< 1: darker)."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * factor):02X}" for c in rgb)


def _bar_groups(graph: CompGraph, s: _Schedule) -> list[tuple[str | None, str, np.ndarray]]:
    """(legend label or None, colour, runs) per colour of bar: by kind; for a pipelined step micro-batch
    runs by micro-batch (colours cycle after len(MICROBATCH_COLORS), backward darker), per-step runs by kind."""
    kind_of = np.array([_kind_name(graph.kind[v]) for v in s.ops.tolist()], dtype=object)
    groups: list[tuple[str | None, str, np.ndarray]] = []
    pipelined = s.op_mb >= 0
    n_col = len(MICROBATCH_COLORS)
    if pipelined.any():
        backward = kind_of == "backward"
        top = int(s.op_mb.max()) + 1
        for c in range(min(top, n_col)):
            of_c = pipelined & (s.op_mb % n_col == c)
            label = f"mb {c}" if top <= n_col else f"mb {c} (mod {n_col})"
            groups.append((label, MICROBATCH_COLORS[c], np.flatnonzero(of_c & ~backward)))
            groups.append((None, _shade(MICROBATCH_COLORS[c], BACKWARD_SHADE), np.flatnonzero(of_c & backward)))
    for kind in (*KINDS, "other"):
        groups.append((kind, KIND_COLORS[kind], np.flatnonzero(~pipelined & (kind_of == kind))))
    return [(label, color, sel) for label, color, sel in groups if sel.size]


def _action_spans(graph: CompGraph, result: ScheduledResult, s: _Schedule) -> list[tuple[int, float, float, str]]:
    """(device, start, finish, "F k" or "B k") of each action of a pipelined step: the runs of one stage's
    forward or backward ops for micro-batch k."""
    mb = s.op_mb >= 0
    back = np.array([graph.kind[v] == "backward" for v in s.ops.tolist()], dtype=bool)
    keys = np.stack([s.op_dev, result.stage[s.ops], back.astype(np.int64), s.op_mb], axis=1)[mb]
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    lo = np.full(len(uniq), np.inf)
    hi = np.full(len(uniq), -np.inf)
    np.minimum.at(lo, inv, s.op_start[mb])
    np.maximum.at(hi, inv, s.op_finish[mb])
    return [(int(d), float(a), float(b), f"{'B' if ph else 'F'} {k}")
            for (d, _, ph, k), a, b in zip(uniq.tolist(), lo.tolist(), hi.tolist(), strict=True)]


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 1, 1)] + "…"


def _merge(x0: np.ndarray, x1: np.ndarray, gap: float) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals [x0, x1) whose gaps are under `gap` (a fraction of a pixel): same picture,
    far fewer polygons. With gap 0 only overlapping intervals merge, so op boundaries stay visible."""
    if x0.size < 2:
        return x0, x1
    order = np.argsort(x0, kind="stable")
    x0, x1 = x0[order], x1[order]
    reach = np.maximum.accumulate(x1)
    new = np.empty(x0.size, dtype=bool)
    new[0] = True
    new[1:] = x0[1:] >= reach[:-1] + gap if gap == 0 else x0[1:] > reach[:-1] + gap
    idx = np.flatnonzero(new)
    return x0[idx], np.maximum.reduceat(x1, idx)


def _rects(x0: np.ndarray, x1: np.ndarray, yc: np.ndarray, half: np.ndarray) -> np.ndarray:
    """(N, 4, 2) vertices of axis-aligned rectangles."""
    v = np.empty((x0.size, 4, 2), dtype=np.float64)
    v[:, 0, 0] = v[:, 1, 0] = x0
    v[:, 2, 0] = v[:, 3, 0] = x1
    v[:, 0, 1] = v[:, 3, 1] = yc - half
    v[:, 1, 1] = v[:, 2, 1] = yc + half
    return v


DETAIL_BARS = 3000  # up to this many bars: every op drawn with an outline, zero-length ops as ticks
MAX_LABELS = 120  # op names written inside the widest bars, at most this many
LABEL_CHARS = 24


def plot_timeline(graph: CompGraph, cluster: Cluster, result: SimResult, path: str | Path, *,
                  lower_bound_s: float | None = None, title: str | None = None) -> None:
    """Write a Gantt chart PNG of the step: a row per device (ops coloured by kind), below it a thinner
    row per channel that carried transfers, a solid line at the step time and a dashed one at
    `lower_bound_s` if given. Uses a private Agg-backed `Figure`; matplotlib's global state is untouched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    s = _schedule(graph, cluster, result)
    n_dev, n_chan = cluster.num_devices, len(s.channels)
    step = float(result.step_time_s)
    lb = float(lower_bound_s) if lower_bound_s is not None else math.nan
    extent = max([x for x in (step, lb) if math.isfinite(x)]
                 + [float(s.op_finish.max()) if s.ops.size else 0.0,
                    float(s.tr_finish.max()) if s.tr.size else 0.0])
    if extent <= 0:
        extent = 1e-6
    unit, scale = time_unit(extent)
    xmax = extent * scale * 1.02

    # Row geometry: devices on top (pitch 1), channels below (pitch 0.6), a gap between.
    dev_y = np.arange(n_dev, dtype=np.float64)
    chan_y = n_dev + 0.3 + 0.6 * np.arange(n_chan, dtype=np.float64)
    bottom = (float(chan_y[-1]) + 0.4) if n_chan else n_dev - 0.5
    n_rows = n_dev + n_chan
    height_in = min(2.2 + 0.42 * n_dev + 0.24 * n_chan, 40.0)
    width_in, dpi = 14.0, 100
    fig = Figure(figsize=(width_in, height_in), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    px_per_unit = (width_in - 2.6) * dpi / xmax  # about the axes' width in pixels

    n_bars = s.ops.size + s.tr.size
    detail = n_bars <= DETAIL_BARS
    gap = 0.0 if detail else 0.01 / px_per_unit  # 1/100 pixel: idle time still shows

    def bars(verts: list[np.ndarray], color: str) -> PolyCollection:
        """One collection of rectangles; unsnapped, so bars thinner than a pixel still add their share
        of colour. In detail mode bars at least 3 px wide get a white outline that separates neighbours
        (thinner ones none, or the outline would wash them out)."""
        v = np.concatenate(verts)
        if not detail:
            return PolyCollection(v, facecolors=color, linewidths=0.0, snap=False, zorder=2)
        wide = (v[:, 2, 0] - v[:, 0, 0]) * px_per_unit >= 3
        edges = np.zeros((v.shape[0], 4))
        edges[wide] = (1.0, 1.0, 1.0, 1.0)
        return PolyCollection(v, facecolors=color, edgecolors=edges, linewidths=0.5, snap=False, zorder=2)

    for d in range(n_dev):  # shade each device row over the step, so idle time reads as gaps
        ax.axhspan(d - 0.42, d + 0.42, xmin=0, xmax=(step * scale / xmax) if math.isfinite(step) else 1,
                   color="#F2F2F2", lw=0, zorder=0)

    x0_all = s.op_start * scale
    x1_all = s.op_finish * scale
    handles: list[Any] = []
    zero_ops = False
    for label, color, sel in _bar_groups(graph, s):
        if label:
            handles.append(Patch(facecolor=color, label=label))
        verts = []
        for d in range(n_dev):
            on = sel[s.op_dev[sel] == d]
            if on.size == 0:
                continue
            x0, x1 = _merge(x0_all[on], x1_all[on], gap)
            verts.append(_rects(x0, x1, np.full(x0.size, dev_y[d]), np.full(x0.size, 0.38)))
        ax.add_collection(bars(verts, color))
        if detail:  # zero-length ops: a dark tick, so they are not lost next to a bar of their colour
            z = sel[x1_all[sel] <= x0_all[sel]]
            if z.size:
                segs = np.empty((z.size, 2, 2))
                segs[:, :, 0] = x0_all[z, None]
                segs[:, 0, 1] = dev_y[s.op_dev[z]] - 0.38
                segs[:, 1, 1] = dev_y[s.op_dev[z]] + 0.38
                ax.add_collection(LineCollection(segs, colors=ZERO_COLOR, linewidths=1.0, zorder=3))
                zero_ops = True

    if zero_ops:
        handles.append(Line2D([], [], color=ZERO_COLOR, lw=1.0, label="zero-length op"))
    if s.tr.size:
        handles.append(Patch(facecolor=TRANSFER_COLOR, label="transfer"))
        t0, t1 = s.tr_start * scale, s.tr_finish * scale
        verts = []
        for k in range(n_chan):
            on = np.flatnonzero(s.tr_chan == k)
            x0, x1 = _merge(t0[on], t1[on], gap)
            verts.append(_rects(x0, x1, np.full(x0.size, chan_y[k]), np.full(x0.size, 0.2)))
        ax.add_collection(bars(verts, TRANSFER_COLOR))

    # Op names inside the widest bars that can hold them (at most MAX_LABELS, widest first); for a pipelined
    # step, each action's phase and micro-batch ("F 3", "B 3") across its span instead.
    if isinstance(result, ScheduledResult) and s.ops.size:
        fs = 7 if n_rows <= 24 else 6
        char_px = 0.6 * fs * dpi / 72
        for d, x0, x1, text in _action_spans(graph, result, s):
            if (x1 - x0) * scale * px_per_unit >= len(text) * char_px + 4:
                ax.text((x0 + x1) / 2 * scale, dev_y[d], text, ha="center", va="center", fontsize=fs,
                        color="white", clip_on=True, zorder=4)
    elif s.ops.size:
        fs = 7 if n_rows <= 24 else 6
        char_px = 0.6 * fs * dpi / 72
        width_px = (x1_all - x0_all) * px_per_unit
        cand = np.flatnonzero(width_px >= 3 * char_px + 4)
        cand = cand[np.lexsort((s.ops[cand], -width_px[cand]))][:MAX_LABELS]
        for i in np.sort(cand).tolist():
            name = graph.ids[s.ops[i]]
            chars = min(LABEL_CHARS, int((width_px[i] - 4) / char_px))
            if chars < min(len(name), 3):
                continue
            ax.text((x0_all[i] + x1_all[i]) / 2, dev_y[s.op_dev[i]], _shorten(name, chars), ha="center",
                    va="center", fontsize=fs, color="white", clip_on=True, zorder=4)

    # Step time and lower bound.
    top = blended_transform_factory(ax.transData, ax.transAxes)
    lines = []
    if math.isfinite(step):
        lines.append((step, "black", "-", f"step {fmt_time(step, digits=4)}"))
    if math.isfinite(lb):
        ratio = f", step/LB {step / lb:.3g}" if math.isfinite(step) and lb > 0 else ""
        lines.append((lb, "#C44E52", "--", f"lower bound {fmt_time(lb, digits=4)}{ratio}"))
    lines.sort(key=lambda item: item[0])
    for level, (x, color, style, label) in enumerate(lines):
        ax.axvline(x * scale, color=color, ls=style, lw=1.3, zorder=5)
        near = level > 0 and abs(x - lines[0][0]) * scale * px_per_unit < 220
        ax.annotate(label, xy=(x * scale, 1.0), xycoords=top, xytext=(-3, 2 + 11 * near),
                    textcoords="offset points", ha="right", va="bottom", fontsize=8, color=color,
                    annotation_clip=False)
        handles.append(Line2D([], [], color=color, ls=style, lw=1.3, label=label))

    # Right-hand notes: how busy each device is, how much each channel carried.
    right = blended_transform_factory(ax.transAxes, ax.transData)
    busy = np.bincount(s.op_dev, weights=s.op_finish - s.op_start, minlength=n_dev)
    for d in range(n_dev):
        note = f"{busy[d] / step:.0%} busy" if math.isfinite(step) and step > 0 else fmt_time(busy[d], digits=4)
        ax.text(1.005, dev_y[d], note, transform=right, ha="left", va="center", fontsize=7, color="#444444")
    if n_chan:
        nbytes = np.asarray(result.transfers.nbytes, dtype=np.float64)[s.tr]
        per_chan = np.bincount(s.tr_chan, weights=nbytes, minlength=n_chan)
        for k in range(n_chan):
            ax.text(1.005, chan_y[k], fmt_bytes(per_chan[k], digits=3), transform=right, ha="left", va="center",
                    fontsize=6, color="#666666")
        ax.axhline(n_dev - 0.35, color="#999999", lw=0.6, zorder=1)

    ax.set_xlim(0, xmax)
    ax.set_ylim(bottom, -0.6)
    ax.set_yticks(np.concatenate([dev_y, chan_y]))
    labels = [_shorten(device_label(cluster, d), 28) for d in range(n_dev)]
    labels += [_shorten(channel_label(cluster, a, b), 28) for a, b in s.channels]
    ax.set_yticklabels(labels)
    for k, tick in enumerate(ax.get_yticklabels()):
        tick.set_fontsize(9 if k < n_dev else (7 if n_chan <= 24 else 5.5))
        if k >= n_dev:
            tick.set_color("#555555")
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#DDDDDD", lw=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    head = title if title is not None else f"{graph.name} on {cluster.name}: step {fmt_time(step, digits=4)}"
    info = [f"model {result.model}", f"{graph.num_nodes} ops on {n_dev} devices",
            *([f"{result.schedule.kind}, {result.schedule.microbatches} micro-batches"]
              if isinstance(result, ScheduledResult) else []),
            f"{len(result.transfers)} transfers ({fmt_bytes(float(result.comm_bytes), digits=3)})"]
    if title is not None:
        info.insert(0, f"step {fmt_time(step, digits=4)}")
    if not result.feasible:
        info.append("INFEASIBLE: out of memory on " + ", ".join(cluster.devices[d].name for d in result.oom))
    if s.skipped_ops:
        info.append(f"{s.skipped_ops} ops not scheduled")
    fig.suptitle(_shorten(head, 140), fontsize=12)
    ax.set_title(_shorten(" · ".join(info), 200), fontsize=8, color="#444444", loc="left", pad=28)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8,
               frameon=False)
    save_png(fig, path, "--plot")

"""The result table that `devplace simulate`, `devplace demo` (and later `devplace place`) print.

Its number formats are `devplace.units`' (`fmt_bytes`, `fmt_time`)."""

from __future__ import annotations

import numpy as np
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.sim.bounds import LowerBound
from devplace.sim.result import SimResult
from devplace.sim.schedule import ScheduledResult
from devplace.units import fmt_bytes, fmt_time


def result_view(graph: CompGraph, cluster: Cluster, result: SimResult, bound: LowerBound, *,
                pipelined: bool = True, moved: str = "") -> Group:
    """A headline (step time, lower bound, ratio, feasibility), the schedule of a pipelined step (unless not
    `pipelined`: a parallel plan of one stage is no pipeline) and one row per device; user-given names are
    printed as text, never read as markup. `moved` says whose transfers the headline counts, where they are not
    all of the step's (a parallel plan's: replica 0's, its collectives apart)."""
    ratio = result.step_time_s / bound.value_s if bound.value_s > 0 else float("nan")
    status = "[green]feasible[/]" if result.feasible else "[bold red]INFEASIBLE (out of memory)[/]"
    head = Text.from_markup(
        f"[bold]{escape(graph.name)}[/] on [bold]{escape(cluster.name)}[/] ({result.model} model): step time "
        f"[bold]{fmt_time(result.step_time_s)}[/], lower bound {fmt_time(bound.value_s)} "
        f"({bound.limited_by}), step/LB = {ratio:.3f}; {status}; "
        f"{fmt_bytes(result.comm_bytes)} moved in {len(result.transfers)} transfers{escape(moved)}"
    )
    table = Table(show_edge=False, header_style="bold")
    for col, justify in (("device", "left"), ("ops", "right"), ("busy", "right"), ("util", "right"),
                         ("peak memory", "right"), ("capacity", "right"), ("", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    counts = [0] * cluster.num_devices
    for d in result.device.tolist():
        counts[d] += 1
    oom = result.oom
    for d, dev in enumerate(cluster.devices):
        busy = float(result.device_busy_s[d])
        util = busy / result.step_time_s if result.step_time_s > 0 else 0.0
        note = f"[red]over by {fmt_bytes(oom[d])}[/]" if d in oom else ""
        table.add_row(Text(f"{d} {dev.name}"), str(counts[d]), fmt_time(busy), f"{util:.0%}",
                      fmt_bytes(float(result.peak_memory_bytes[d])), fmt_bytes(dev.memory_bytes), note)
    return Group(head, *([schedule_line(result)] if pipelined and isinstance(result, ScheduledResult) else []),
                 table)


def pipeline_bubble(result: ScheduledResult) -> tuple[int, float, float]:
    """(p, ideal, idle) of a pipelined step: p the devices holding pipeline stages, `ideal` the bubble of an
    even pipeline of p devices under the schedule, (p - 1) / (V M + p - 1) (V chunks per device, M
    micro-batches), and `idle` the share of those devices' time that they do not compute in this step
    (bubble, uneven stages and waits for transfers together)."""
    s = result.schedule
    used = np.unique(result.device[result.stage >= 0])
    p = int(used.size)
    v = int(s.chunks or 1)
    ideal = (p - 1) / (v * s.microbatches + p - 1) if p else 0.0
    busy = float(result.device_busy_s[used].sum())
    idle = 1.0 - busy / (p * result.step_time_s) if p and result.step_time_s > 0 else 0.0
    return p, ideal, idle


def schedule_line(result: ScheduledResult) -> Text:
    """The schedule of a pipelined step, its micro-batches and stages, and its bubble."""
    s = result.schedule
    p, ideal, idle = pipeline_bubble(result)
    stages = int(result.stage.max()) + 1 if result.stage.size else 0
    chunks = f", {s.chunks} chunks per device" if (s.chunks or 1) > 1 else ""
    return Text(f"schedule {s.kind}: M = {s.microbatches} micro-batches, {stages} stages on {p} devices{chunks}; "
                f"bubble {ideal:.1%} for even stages ((p-1)/({'VM' if chunks else 'M'}+p-1)), stage devices idle "
                f"{idle:.1%} of the step")

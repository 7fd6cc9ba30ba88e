"""The result table that `devplace simulate`, `devplace demo` (and later `devplace place`) print.

Its number formats are `devplace.units`' (`fmt_bytes`, `fmt_time`)."""

from __future__ import annotations

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from devplace.graph.compgraph import CompGraph
from devplace.hardware.cluster import Cluster
from devplace.sim.bounds import LowerBound
from devplace.sim.result import SimResult
from devplace.units import fmt_bytes, fmt_time


def result_view(graph: CompGraph, cluster: Cluster, result: SimResult, bound: LowerBound) -> Group:
    """A headline (step time, lower bound, ratio, feasibility) and one row per device; user-given names are
    printed as text, never read as markup."""
    ratio = result.step_time_s / bound.value_s if bound.value_s > 0 else float("nan")
    status = "[green]feasible[/]" if result.feasible else "[bold red]INFEASIBLE (out of memory)[/]"
    head = Text.from_markup(
        f"[bold]{escape(graph.name)}[/] on [bold]{escape(cluster.name)}[/] ({result.model} model): step time "
        f"[bold]{fmt_time(result.step_time_s)}[/], lower bound {fmt_time(bound.value_s)} "
        f"({bound.limited_by}), step/LB = {ratio:.3f}; {status}; "
        f"{fmt_bytes(result.comm_bytes)} moved in {len(result.transfers)} transfers"
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
    return Group(head, table)

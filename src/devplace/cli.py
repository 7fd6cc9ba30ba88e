"""The `devplace` command. User errors print one line and exit 2; `--json` gives machine-readable output."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from devplace.errors import DevplaceError
from devplace.graph import load_graph, load_placement
from devplace.graph.info import graph_info
from devplace.hardware.cluster import load_cluster
from devplace.sim import MODELS, lower_bound, simulate
from devplace.sim.summary import fmt_bytes, fmt_time, result_view

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Device placement for model-parallel training.")
console = Console()

GraphArg = Annotated[Path, typer.Argument(help="graph file (devplace.graph/1 JSON), or `example` for the bundled one")]
ClusterArg = Annotated[str, typer.Argument(help="cluster preset name (see `devplace clusters`) or cluster JSON file")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")


def _write_timelines(graph: Any, cluster: Any, result: Any, bound_s: float, trace: Path | None,
                     plot: Path | None) -> None:
    if trace is None and plot is None:
        return
    from devplace.sim.timeline import plot_timeline, write_trace

    if trace is not None:
        write_trace(graph, cluster, result, trace)
    if plot is not None:
        plot_timeline(graph, cluster, result, plot, lower_bound_s=bound_s)


def _simulate_and_report(graph_path: Path, cluster_name: str, placement_path: Path, model: str, as_json: bool,
                         trace: Path | None, plot: Path | None, per_op: bool) -> None:
    graph = load_graph(_graph_path(graph_path))
    cluster = load_cluster(cluster_name)
    placement = load_placement(placement_path)
    result = simulate(graph, cluster, placement, model=model)
    bound = lower_bound(graph, cluster)
    _write_timelines(graph, cluster, result, bound.value_s, trace, plot)
    if as_json:
        doc = result.to_dict(graph.ids, per_op=per_op)
        doc.update(graph=graph.name, cluster=cluster.name, lower_bound_s=bound.value_s,
                   step_over_lower_bound=result.step_time_s / bound.value_s if bound.value_s else None)
        _print_json(doc)
        return
    console.print(result_view(graph, cluster, result, bound))
    for what, path in (("trace", trace), ("timeline", plot)):
        if path is not None:
            console.print(f"wrote {what} to {path}")


@app.command("simulate")
def simulate_cmd(
    graph: GraphArg,
    cluster: ClusterArg,
    placement: Annotated[Path, typer.Argument(help="placement file (devplace.placement/1 JSON)")],
    model: Annotated[str, typer.Option(help=f"simulation model: {' or '.join(MODELS)}")] = "devplace",
    as_json: JsonOpt = False,
    trace: Annotated[Path | None, typer.Option(help="write a Chrome trace-event JSON (Perfetto)")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a Gantt chart PNG")] = None,
    per_op: Annotated[bool, typer.Option("--per-op", help="with --json: each op's device, start, finish")] = False,
) -> None:
    """Simulate one training step of GRAPH on CLUSTER under PLACEMENT."""
    _simulate_and_report(graph, cluster, placement, model, as_json, trace, plot, per_op)


@app.command("bound")
def bound_cmd(graph: GraphArg, cluster: ClusterArg, as_json: JsonOpt = False) -> None:
    """Lower bound on the step time of GRAPH on CLUSTER, valid for every placement and schedule."""
    g = load_graph(_graph_path(graph))
    c = load_cluster(cluster)
    lb = lower_bound(g, c)
    if as_json:
        _print_json({"graph": g.name, "cluster": c.name, "lower_bound_s": lb.value_s, "work_s": lb.work_s,
                     "critical_path_s": lb.critical_path_s, "limited_by": lb.limited_by,
                     "critical_path": [g.ids[v] for v in lb.critical_path]})
        return
    console.print(f"[bold]{g.name}[/] on [bold]{c.name}[/]: lower bound [bold]{fmt_time(lb.value_s)}[/] "
                  f"({lb.limited_by})")
    console.print(f"  total work / total speed : {fmt_time(lb.work_s)}")
    console.print(f"  critical path (fastest device, no communication): {fmt_time(lb.critical_path_s)}, "
                  f"{len(lb.critical_path)} ops")


@app.command("info")
def info_cmd(graph: GraphArg, as_json: JsonOpt = False) -> None:
    """Size and shape of GRAPH: counts, total compute and bytes, depth."""
    info = graph_info(load_graph(_graph_path(graph)))
    if as_json:
        _print_json(info)
        return
    table = Table(show_header=False, show_edge=False)
    for key, value in info.items():
        if key.endswith("_bytes"):
            value = fmt_bytes(value)
        elif key.endswith("_s"):
            value = fmt_time(value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        table.add_row(key, str(value))
    console.print(table)


@app.command("clusters")
def clusters_cmd(as_json: JsonOpt = False) -> None:
    """List the built-in cluster presets."""
    from devplace.hardware.presets import PRESETS

    clusters = [factory() for factory in PRESETS.values()]
    if as_json:
        _print_json([c.to_dict() for c in clusters])
        return
    table = Table(header_style="bold", show_edge=False)
    table.add_column("name", no_wrap=True)
    for col in ("devices", "memory each", "speed", "default link", "per-pair links"):
        table.add_column(col)
    for c in clusters:
        kinds = sorted({d.kind or d.name for d in c.devices})
        table.add_row(c.name, f"{c.num_devices} x {'/'.join(kinds)}",
                      "/".join(sorted({fmt_bytes(d.memory_bytes) for d in c.devices})),
                      "/".join(sorted({f"{d.speed:g}" for d in c.devices})),
                      f"{c.link.bandwidth_Bps / 1e9:g} GB/s, {c.link.latency_s * 1e6:g} µs",
                      str(len(c.links)))
    console.print(table)


def _parse_settings(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values are read as JSON when they parse (numbers, true/false, null), else text."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise DevplaceError(f"--set expects key=value, got {pair!r} (e.g. --set steps=2000)")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    return settings


ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="zoo model to capture (see `devplace zoo list`)")]
BatchOpt = Annotated[int | None, typer.Option(help="batch size (default: the model's)")]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="sequence length (default: the model's)")]
MaxNodesOpt = Annotated[int | None, typer.Option("--max-nodes", help="coarsen to at most this many groups")]
OptimizerOpt = Annotated[str, typer.Option(help="optimizer of the captured step: adam, sgd or none")]


@app.command("place")
def place_cmd(
    graph: Annotated[Path | None, typer.Argument(help="graph file, or `example`; or use --model")] = None,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="cluster preset name or cluster JSON file")] = "",
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    optimizer: OptimizerOpt = "adam",
    placer: Annotated[str, typer.Option(help="placer name (see `devplace placers`)")] = "m-etf",
    order: Annotated[str, typer.Option(help="traversal order for sequential placers (see `devplace orders`), or "
                                            "`auto`: picked from the graph's features (see `devplace recommend`)")
                     ] = "auto",
    try_k: Annotated[int | None, typer.Option("--try", help="with --order auto: run the K most promising orders and "
                                                            "keep the best (K times the placement time)")] = None,
    try_with: Annotated[str | None, typer.Option("--try-with", help="with --try K: try the orders with this cheap "
                                                                   "placer, then run --placer once")] = None,
    seed: Annotated[int, typer.Option(help="seed for every random choice")] = 0,
    setting: Annotated[list[str] | None, typer.Option("--set", help="placer setting key=value (repeatable)")] = None,
    episodes: Annotated[int | None, typer.Option(help="learned placers: training episodes (0 with --policy: apply "
                                                      "it zero-shot); same as --set episodes=N")] = None,
    policy: Annotated[Path | None, typer.Option(help="learned placers: start from this trained policy (`devplace "
                                                     "train -o`); same as --set policy=FILE")] = None,
    log: Annotated[Path | None, typer.Option(help="learned placers: write the learning curve CSV here (see "
                                                  "`devplace plot-curve`); same as --set log=FILE")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write the placement JSON here")] = None,
    as_json: JsonOpt = False,
    trace: Annotated[Path | None, typer.Option(help="write a Chrome trace-event JSON (Perfetto)")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a Gantt chart PNG")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar while placing")] = False,
) -> None:
    """Place GRAPH (or a zoo --model, captured on the fly) on a cluster and print the predicted step time and
    memory per device.

    GRAPH `example` is the bundled 16-layer MLP training step (too big for one 16 GB GPU). With --model, the
    training step is captured, costed for the cluster's first device, colocated (and coarsened to
    --max-nodes); the placement of the groups is expanded to every op, and the table reports that full graph.
    """
    if not cluster:
        raise DevplaceError("--cluster is required (a preset from `devplace clusters` or a cluster JSON file)")
    c = load_cluster(cluster)
    settings = _parse_settings(setting or [])
    for key, value in (("episodes", episodes), ("policy", policy), ("log", log)):
        if value is not None:
            if key in settings:
                raise DevplaceError(f"--{key} and --set {key}=... both given; keep one")
            settings[key] = value if key == "episodes" else str(value)
    if (graph is None) == (model is None):
        raise DevplaceError("give either a GRAPH file or --model NAME (see `devplace zoo list`)")
    if model is not None:
        prepared = _prepare_model(model, batch, seq_len, max_nodes, optimizer, c.devices[0], quiet or as_json)
        _place_and_report(prepared.graph, c, placer, order, seed, settings, output, as_json, trace, plot, quiet,
                          prepared=prepared, try_orders=try_k, try_with=try_with)
        return
    assert graph is not None
    _place_and_report(load_graph(_graph_path(graph)), c, placer, order, seed, settings, output, as_json, trace, plot,
                      quiet, try_orders=try_k, try_with=try_with)


def _prepare_model(model: str, batch: int | None, seq_len: int | None, max_nodes: int | None, optimizer: str,
                   device: Any, quiet: bool) -> Any:
    from devplace.capture.pipeline import zoo_prepared

    busy = nullcontext() if quiet else console.status(f"capturing the training step of {model}")
    with busy:
        return zoo_prepared(model, batch=batch, seq_len=seq_len, optimizer=optimizer, max_nodes=max_nodes,
                            device=device)


def _place_and_report(g: Any, c: Any, placer: str, order: str, seed: int, settings: dict[str, Any],
                      output: Path | None, as_json: bool, trace: Path | None, plot: Path | None,
                      quiet: bool, prepared: Any = None, try_orders: int | None = None,
                      try_with: str | None = None) -> Any:
    """Place, simulate, print the table (or JSON), write the files asked for; returns the SimResult.

    With `prepared` (a captured model), `g` is its coarse graph: the placement is expanded to every op of
    `prepared.full`, which is what is simulated and reported."""
    import time

    from devplace.graph import save_placement
    from devplace.placers import place, place_expanded
    from devplace.sim import DevplaceModel

    def place_it(**kw: Any) -> Any:
        # a captured model: placed on its coarse graph, checked (and placed again if need be) on the full graph
        if prepared is not None:
            return place_expanded(prepared.coarsening, prepared.full, c, **kw).placement
        return place(g, c, **kw)

    t0 = time.perf_counter()
    if quiet or as_json:
        placement = place_it(placer=placer, order=order, seed=seed, try_orders=try_orders, try_with=try_with,
                             **settings)
    else:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        columns = (TextColumn("placing {task.description}"), BarColumn(), TaskProgressColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(f"{g.name} with {placer}", total=None)
            placement = place_it(placer=placer, order=order, seed=seed, try_orders=try_orders, try_with=try_with,
                                 progress=lambda done, total: bar.update(task, completed=done, total=total),
                                 **settings)
    elapsed = time.perf_counter() - t0
    groups = g.num_nodes
    if prepared is not None:
        g = prepared.full
    if output is not None:
        save_placement(placement, output)
    model = DevplaceModel(g, c)
    result = simulate(g, c, placement)
    bound = lower_bound(g, c)
    single = model.best_single_device()
    _write_timelines(g, c, result, bound.value_s, trace, plot)
    speedup = single[1] / result.step_time_s if result.step_time_s > 0 else float("nan")
    runtime = _runtime_view(g, c, placement, result) if prepared is not None else None
    if as_json:
        doc = result.to_dict()
        doc.update(graph=g.name, cluster=c.name, placer=placer, order=placement.meta.get("order"), seed=seed,
                   settings=settings, placement_time_s=elapsed, lower_bound_s=bound.value_s,
                   step_over_lower_bound=result.step_time_s / bound.value_s if bound.value_s else None,
                   best_single_device={"device": single[0], "step_time_s": single[1], "fits": single[2]},
                   speedup_over_single_device=speedup, placed_groups=groups, assignment=placement.assignment)
        if "order_auto" in placement.meta:
            doc["order_auto"] = placement.meta["order_auto"]
        if runtime is not None:
            doc["as_run"] = {"ops_moved": runtime[0], "step_time_s": runtime[1].step_time_s,
                             "feasible": runtime[1].feasible}
        _print_json(doc)
        return result
    console.print(result_view(g, c, result, bound))
    fits = "" if single[2] else ", which does not fit in its memory"
    placed = f" ({groups} groups of {g.num_nodes} ops)" if groups != g.num_nodes else ""
    auto = placement.meta.get("order_auto")
    if isinstance(auto, dict):
        console.print(f"order auto -> {auto['order']} ({auto.get('why') or auto['rule']})", highlight=False)
    console.print(f"placer {placer}" + (f", order {placement.meta['order']}" if placement.meta.get("order")
                                        else " (no order)")
                  + f", seed {seed}: placed{placed} in {elapsed:.2f} s; best single device "
                  f"({c.devices[single[0]].name}{fits}) {fmt_time(single[1])}, speed-up {speedup:.2f}x")
    if runtime is not None and runtime[0]:
        moved, rt = runtime
        console.print(f"as devplace.runtime runs it ({moved} backward/optimizer ops with their forward op, as "
                      f"autograd does): step time {fmt_time(rt.step_time_s)}, "
                      f"{'feasible' if rt.feasible else 'OVER MEMORY'}", highlight=False)
    for what, path in (("placement", output), ("trace", trace), ("timeline", plot)):
        if path is not None:
            console.print(f"wrote {what} to {path}")
    return result


def _runtime_view(g: Any, c: Any, placement: Any, result: Any) -> tuple[int, Any]:
    """(ops that autograd would run elsewhere, the simulation of the placement as it runs): a placer may put a
    backward op on another device than its forward op; devplace.runtime cannot run it there."""
    from devplace.graph.placement import runtime_placement

    rp = runtime_placement(g, placement)
    moved = sum(1 for k, d in rp.assignment.items() if placement.assignment[k] != d)
    return moved, (simulate(g, c, rp) if moved else result)


@app.command("placers")
def placers_cmd(as_json: JsonOpt = False) -> None:
    """List the placers, whether they walk the graph in the traversal order, and their settings."""
    from devplace.placers import get_placer, placer_names

    specs = [get_placer(n) for n in placer_names()]
    if as_json:
        _print_json({s.name: {"uses_order": s.uses_order, "summary": s.summary,
                              "settings": {k: repr(v) for k, v in s.settings.items()}} for s in specs})
        return
    table = Table(header_style="bold", show_edge=False)
    table.add_column("placer", no_wrap=True)
    table.add_column("order")
    table.add_column("settings")
    table.add_column("what it does")
    for s in specs:
        table.add_row(s.name, "uses order" if s.uses_order else "ignores order",
                      ", ".join(f"{k}={v!r}" for k, v in s.settings.items()), s.summary)
    console.print(table)


zoo_app = typer.Typer(no_args_is_help=True, help="Named models and the seed study's graph families.")
app.add_typer(zoo_app, name="zoo")


@zoo_app.command("list")
def zoo_list_cmd(as_json: JsonOpt = False) -> None:
    """The zoo's named models and the study's families."""
    from devplace.zoo.families import FAMILIES, FAMILY_SIZE
    from devplace.zoo.models import MODELS

    if as_json:
        _print_json({"models": {n: {"batch": m.batch, "seq_len": m.seq_len, "params": m.params,
                                    "description": m.description} for n, m in MODELS.items()},
                     "families": {f: FAMILY_SIZE for f in FAMILIES}})
        return
    table = Table(header_style="bold", show_edge=False)
    for col in ("model", "parameters", "batch", "seq len", "what"):
        table.add_column(col)
    for n, m in MODELS.items():
        table.add_row(n, f"{m.params / 1e6:,.1f} M", str(m.batch), str(m.seq_len or "-"), m.description)
    console.print(table)
    console.print(f"families (devplace zoo family NAME --index I): {', '.join(FAMILIES)}, {FAMILY_SIZE} graphs each")


@zoo_app.command("family")
def zoo_family_cmd(
    name: Annotated[str, typer.Argument(help="cifar10, ptb or nmt")],
    index: Annotated[int, typer.Option(help="graph index, 0-31")] = 0,
    max_nodes: Annotated[int | None, typer.Option("--max-nodes", help="coarsen to at most this many groups")] = 300,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write the graph JSON here")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Capture graph INDEX of a study family, coarsened to --max-nodes, and print its size (or save it)."""
    from devplace.capture.pipeline import family_graph

    g = family_graph(name, index, max_nodes=max_nodes)
    if output is not None:
        from devplace.graph import save_graph

        save_graph(g, output)
    info = graph_info(g)
    if as_json:
        _print_json(info)
    else:
        console.print(f"{g.name}: {info['nodes']} groups, {info['edges']} edges, "
                      f"{fmt_time(info['total_compute_s'])} of compute" + (f"; wrote {output}" if output else ""))


DEVICE_KIND_HELP = "device to cost for: K80, V100, V100-PCIe, A100, H100, or cpu (this machine's, measured)"


@app.command("capture")
def capture_cmd(
    output: Annotated[Path, typer.Option("-o", "--output", help="write the graph JSON here")],
    model: ModelOpt = None,
    onnx: Annotated[Path | None, typer.Option("--onnx", help="an ONNX forward graph to import instead")] = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    optimizer: OptimizerOpt = "adam",
    costs: Annotated[Path | None, typer.Option("--costs", help="cost table from `devplace profile`")] = None,
    device_kind: Annotated[str, typer.Option("--device-kind", help=DEVICE_KIND_HELP)] = "V100",
    full: Annotated[Path | None, typer.Option("--full", help="also write the uncoarsened graph here")] = None,
) -> None:
    """Capture a training step (forward + backward + optimizer) and write its costed, colocated graph.

    The written graph's nodes are colocation groups (coarsened to --max-nodes if given); its meta holds the
    members of every group. Op times: the analytic roofline for --device-kind, or a --costs table.
    """
    from devplace.capture.pipeline import prepare, zoo_prepared
    from devplace.graph import save_graph
    from devplace.hardware.cost import CostTable
    from devplace.hardware.presets import device_kind as kind_device

    if (model is None) == (onnx is None):
        raise DevplaceError("give either --model NAME (see `devplace zoo list`) or --onnx FILE")
    if device_kind == "cpu":
        from devplace.capture.profile import local_cpu_device

        device = local_cpu_device()
    else:
        device = kind_device(device_kind)
    table = CostTable.load(costs) if costs is not None else None
    with console.status("capturing"):
        if model is not None:
            prepared = zoo_prepared(model, batch=batch, seq_len=seq_len, optimizer=optimizer, max_nodes=max_nodes,
                                    device=device, costs=table)
        else:
            from devplace.capture.onnx_import import load_onnx

            dims = {"seq": seq_len} if seq_len else None
            prepared = prepare(load_onnx(onnx, optimizer=optimizer, batch=batch, dims=dims), device=device,
                               costs=table, max_nodes=max_nodes)
    save_graph(prepared.graph, output)
    if full is not None:
        save_graph(prepared.full, full)
    console.print(prepared.report.format())
    console.print(f"{prepared.full.name}: {prepared.full.num_nodes} ops -> {prepared.graph.num_nodes} groups; "
                  f"wrote {output}" + (f" and {full}" if full else ""))


@app.command("profile")
def profile_cmd(
    output: Annotated[Path, typer.Option("-o", "--output", help="write the cost table JSON here")],
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    device: Annotated[str, typer.Option(help="where to run the ops: cpu or cuda[:i]")] = "cpu",
    repeats: Annotated[int, typer.Option(help="timed runs per op (after 3 warm-up runs)")] = 10,
    max_ops: Annotated[int | None, typer.Option("--max-ops", help="profile at most this many distinct ops")] = None,
) -> None:
    """Run every distinct op of a zoo model's training step for real and write their times as a cost table."""
    from devplace.capture.pipeline import capture_zoo_model
    from devplace.capture.profile import profile_graph

    if model is None:
        raise DevplaceError("--model NAME is required (see `devplace zoo list`)")
    graph = capture_zoo_model(model, batch=batch, seq_len=seq_len)
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"profiling {graph.name} on {device}", total=None)
        table = profile_graph(graph, device, repeats=repeats, max_ops=max_ops,
                              progress=lambda done, total, _t: bar.update(task, completed=done, total=total))
    table.save(output)
    console.print(f"{graph.name}: {len(table)} distinct ops timed on {device}"
                  f"{f', {len(table.skipped)} skipped (listed in the table)' if table.skipped else ''}; wrote {output}")


@app.command("calibrate")
def calibrate_cmd(
    costs: Annotated[Path | None, typer.Option("--costs", help="cost table from `devplace profile`")] = None,
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    runs: Annotated[Path | None, typer.Option("--runs", help="records of `devplace run` (JSON lines) to fold: "
                                              "measured / simulated step time per device kind")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare the analytic cost model with a profiled cost table, per op class (--costs), and/or fold the
    measured step times of `devplace run` into measured/simulated ratios (--runs)."""
    from devplace.capture.pipeline import capture_zoo_model
    from devplace.capture.profile import calibrate, format_calibration, local_cpu_roofline
    from devplace.hardware.cost import CostTable

    if runs is not None:
        from devplace.capture.profile import fold_runs, format_runs, read_runs

        folded = fold_runs(read_runs(runs))
        if costs is None:
            if as_json:
                _print_json(folded)
            else:
                console.print(format_runs(folded), highlight=False, soft_wrap=True)
            return
        console.print(format_runs(folded), highlight=False)
    if costs is None:
        raise DevplaceError("give --costs TABLE (from `devplace profile`) and/or --runs FILE (from `devplace run`)")
    if model is None:
        raise DevplaceError("--model NAME is required: the model whose ops the table timed")
    table = CostTable.load(costs)
    graph = capture_zoo_model(model, batch=batch, seq_len=seq_len)
    roofline = local_cpu_roofline() if table.device is not None and table.device.name.startswith("cpu") else None
    cal = calibrate(graph, table, roofline=roofline)
    if as_json:
        _print_json(cal)
    else:
        console.print(format_calibration(cal), highlight=False)


@app.command("order")
def order_cmd(
    graph: GraphArg,
    order: Annotated[str, typer.Option("--order", help="traversal order name (see `devplace orders`)")] = "topo",
    seed: Annotated[int, typer.Option(help="seed of the `random` order")] = 0,
    cluster: Annotated[str | None, typer.Option(help="cluster for `critical-path` costs")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the traversal ORDER of GRAPH, one node id per line."""
    from devplace.orders import check_order_name, traversal_order

    check_order_name(order)
    g = load_graph(_graph_path(graph))
    ids = traversal_order(g, order, seed, cluster=load_cluster(cluster) if cluster else None)
    if as_json:
        _print_json({"graph": g.name, "order": order, "seed": seed, "nodes": ids})
    else:
        sys.stdout.write("".join(f"{nid}\n" for nid in ids))


@app.command("features")
def features_cmd(
    graph: GraphArg,
    cluster: Annotated[str | None, typer.Option(help="cluster for the communication-to-computation ratio")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Graph features (docs/features.md): the inputs of the traversal-order recommendation."""
    import math

    from devplace.graph.features import FEATURE_DESCRIPTIONS
    from devplace.hardware.features import graph_features

    feats = graph_features(load_graph(_graph_path(graph)), load_cluster(cluster) if cluster else None)
    if as_json:  # JSON has no NaN: undefined features are null; counts are integers
        _print_json({k: None if math.isnan(v) else int(v) if v == int(v) and abs(v) < 2**53 else v
                     for k, v in feats.items()})
        return
    table = Table(header_style="bold", show_edge=False)
    for col in ("feature", "value", "definition"):
        table.add_column(col)
    for key, value in feats.items():
        table.add_row(key, f"{value:.6g}", FEATURE_DESCRIPTIONS[key])
    console.print(table)


@app.command("orders")
def orders_cmd(as_json: JsonOpt = False) -> None:
    """List the traversal orders and their definitions."""
    from devplace.orders import ORDER_DEFINITIONS, TOPOLOGICAL_ORDERS

    if as_json:
        _print_json({name: {"definition": d, "topological": name in TOPOLOGICAL_ORDERS}
                     for name, d in ORDER_DEFINITIONS.items()})
        return
    table = Table(header_style="bold", show_edge=False)
    table.add_column("order", no_wrap=True)
    table.add_column("topological")
    table.add_column("definition")
    for name, definition in ORDER_DEFINITIONS.items():
        table.add_row(name, "yes" if name in TOPOLOGICAL_ORDERS else "", definition)
    console.print(table)
    console.print("`auto` (the default of `devplace place`) is not an order but a decision: the order the shipped "
                  "recommendation model picks from the graph's features (`devplace recommend`), or with --try K the "
                  "best of its K most promising orders.", highlight=False)


def _graph_path(path: Path) -> Path:
    """`example` names the bundled example graph (unless a file of that name exists)."""
    if str(path) == "example" and not path.exists():
        return Path(str(resources.files("devplace") / "data" / "example_mlp.json"))
    return path


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option(help="folder for the placement, trace and timeline")] = Path("out"),
    model: Annotated[str, typer.Option(help="zoo model")] = "inception_v3",
    cluster: Annotated[str, typer.Option(help="cluster preset")] = "4xV100-16GB",
    placer: Annotated[str, typer.Option(help="placer name (see `devplace placers`)")] = "m-etf",
    max_nodes: Annotated[int, typer.Option("--max-nodes", help="coarsen to at most this many groups")] = 300,
) -> None:
    """Capture a real model's training step (Inception-v3, batch 32), place it on 4xV100-16GB and report.

    Writes the placement, a Perfetto trace and a timeline PNG into OUT.
    """
    out.mkdir(parents=True, exist_ok=True)
    c = load_cluster(cluster)
    prepared = _prepare_model(model, None, None, max_nodes, "adam", c.devices[0], False)
    console.print(f"captured {prepared.full.name}: {prepared.full.num_nodes} ops, colocated and coarsened to "
                  f"{prepared.graph.num_nodes} groups; op times analytic for {c.devices[0].kind}")
    _place_and_report(prepared.graph, c, placer, "auto", 0, {}, out / f"{model}.placement.json", False,
                      out / f"{model}-trace.json", out / f"{model}-timeline.png", False, prepared=prepared)


study_app = typer.Typer(no_args_is_help=True, help="The traversal-order study: run a grid of cells, report on it.")
app.add_typer(study_app, name="study")


@study_app.command("run")
def study_run_cmd(
    study: Annotated[Path | None, typer.Argument(help="study definition (TOML); or use --preset")] = None,
    preset: Annotated[str | None, typer.Option("--preset", help="built-in study: quick, paper or extended")] = None,
    db: Annotated[Path, typer.Option("--db", help="SQLite results file (created; finished cells are skipped)")] = Path(
        "study.sqlite"),
    backend: Annotated[str, typer.Option("--backend", help="local (process pool) or ray")] = "local",
    workers: Annotated[int, typer.Option("--workers", help="parallel cells (processes or Ray CPUs)")] = 1,
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster address (ray backend only)")] = None,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="rerun cells recorded as failed")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="no progress bar")] = False,
) -> None:
    """Run every unfinished cell of a study and write one row per cell to --db; rerun to resume."""
    from devplace.study.runner import run_study
    from devplace.study.spec import StudyError, load_study

    if (study is None) == (preset is None):
        raise StudyError("give a study TOML file or --preset NAME (one of the two)")
    spec = load_study(study if study is not None else preset, preset=preset is not None)
    summary = run_study(spec, db, backend=backend, workers=workers, address=address, retry_failed=retry_failed,
                        progress=not quiet)
    console.print(f"{spec.name}: {summary.ran} cells run ({summary.failed} failed), {summary.skipped} already done; "
                  f"{summary.wall_s:.1f} s; results in {db}"
                  + ("; see the error column, rerun failed cells with --retry-failed" if summary.failed else ""))


@study_app.command("report")
def study_report_cmd(
    db: Annotated[Path, typer.Argument(help="results database written by `devplace study run`")],
    out: Annotated[Path, typer.Option("-o", "--output", help="folder for report.md, results.csv, plots")] = Path(
        "study-report"),
) -> None:
    """Write a study's report: report.md (results section), results.csv, PNG plots and the fitted order model."""
    from devplace.study.report import write_report

    written = write_report(db, out, command=f"devplace study report {db} -o {out}")
    console.print(f"wrote {len(written)} files to {out}: " + ", ".join(p.name for p in written))


@app.command("recommend")
def recommend_cmd(
    graph: Annotated[Path | None, typer.Argument(help="graph file, or `example`; or use --model")] = None,
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    cluster: Annotated[str | None, typer.Option("--cluster", "-c", help="cluster preset or JSON (default: the one "
                                                                        "the order model was fitted on)")] = None,
    placer: Annotated[str, typer.Option(help="the placer the order is for (see `devplace placers`)")] = "greedy",
    order_model: Annotated[Path | None, typer.Option("--order-model", help="order model JSON (default: shipped)")
                           ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Recommend a traversal order for GRAPH (or a zoo --model) and PLACER: the order, the rule that fired and
    the expected gain over `topo` (what `devplace place --order auto` uses)."""
    from devplace.orders.auto import load_order_model, recommend_order
    from devplace.placers import get_placer

    spec = get_placer(placer)
    om = load_order_model(order_model)
    c = load_cluster(cluster) if cluster else (load_cluster(om.cluster) if om.cluster else None)
    if (graph is None) == (model is None):
        raise DevplaceError("give either a GRAPH file or --model NAME (see `devplace zoo list`)")
    if model is not None:
        device = c.devices[0] if c is not None else None
        g = _prepare_model(model, batch, seq_len, max_nodes, "adam", device, as_json).graph
    else:
        assert graph is not None
        g = load_graph(_graph_path(graph))
    rec = recommend_order(g, c, placer=placer, model=om, uses_order=spec.uses_order)
    if as_json:
        _print_json({"graph": g.name, "cluster": c.name if c else None, **rec.to_dict(),
                     "model": om.source, "fitted_on": om.doc.get("fitted_on")})
        return
    console.print(f"[bold]{g.name}[/] with {placer} on {c.name if c else 'no cluster'}: order "
                  f"[bold]{rec.order}[/]", highlight=False)
    console.print(f"  rule: {rec.rule}", highlight=False)
    console.print(f"  expected gain over topo: {rec.expected_gain:+.2%} (mean over {rec.graphs} study graphs "
                  f"the rule covers); next best: {', '.join(rec.ranking[1:4]) or '-'}", highlight=False)


@app.command("train")
def train_cmd(
    graphs: Annotated[list[Path] | None, typer.Argument(help="graph files to train on (or use --family)")] = None,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="cluster preset name or cluster JSON file")] = "",
    placer: Annotated[str, typer.Option(help="the learned placer to train (placeto only)")] = "placeto",
    family: Annotated[str | None, typer.Option(help="train on a study family: cifar10, ptb or nmt")] = None,
    indices: Annotated[str, typer.Option("--graphs", help="family graph indices, e.g. 0-23 or 0,3,5-7")] = "0-23",
    max_nodes: Annotated[int, typer.Option("--max-nodes", help="coarsen family graphs to this many groups")] = 300,
    order: Annotated[str, typer.Option(help="traversal order of the episodes (see `devplace orders`)")] = "topo",
    episodes: Annotated[int, typer.Option(help="rounds: one sampling episode per graph each")] = 50,
    seed: Annotated[int, typer.Option(help="seed for every random choice")] = 0,
    encoder: Annotated[str, typer.Option(help="graph encoder: placeto, sage or gat")] = "placeto",
    hidden: Annotated[int, typer.Option(help="embedding width")] = 32,
    rounds: Annotated[int, typer.Option(help="message-passing rounds per direction")] = 8,
    memory_penalty: Annotated[float, typer.Option("--memory-penalty", help="reward penalty per relative overflow")]
    = 1.0,
    sim_model: Annotated[str, typer.Option("--sim-model", help="simulator of the reward: devplace or placeto")]
    = "devplace",
    lr: Annotated[float, typer.Option(help="Adam learning rate")] = 1e-3,
    output: Annotated[Path, typer.Option("-o", "--output", help="write the policy checkpoint here")] \
    = Path("policy.pt"),
    resume: Annotated[Path | None, typer.Option(help="continue training this checkpoint")] = None,
    log: Annotated[Path | None, typer.Option(help="write the learning curve CSV here")] = None,
    backend: Annotated[str, typer.Option(help="rollout workers: local (processes) or ray")] = "local",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: start Ray locally)")] = None,
    workers: Annotated[int, typer.Option(help="rollout workers (local: 1 runs in this process)")] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
) -> None:
    """Train one placeto policy over several graphs (a family's, or GRAPHS files) and save it for
    `devplace place --placer placeto --set policy=policy.pt` on graphs it never saw."""
    if placer != "placeto":
        raise DevplaceError(f"devplace train trains placeto only (got --placer {placer}); seq2seq trains per graph "
                            "inside `devplace place --placer seq2seq`")
    if not cluster:
        raise DevplaceError("--cluster is required (a preset from `devplace clusters` or a cluster JSON file)")
    if (family is None) == (not graphs):
        raise DevplaceError("give either GRAPH files or --family NAME (cifar10, ptb, nmt)")
    from devplace.placers.rl.trainer import mean_best_ratio, parse_indices, train

    c = load_cluster(cluster)
    if family is not None:
        from devplace.capture.pipeline import family_graph
        from devplace.zoo.families import FAMILY_SIZE

        picked = parse_indices(indices, FAMILY_SIZE)
        busy = nullcontext() if quiet else console.status(f"capturing {len(picked)} {family} graphs")
        with busy:
            gs = [family_graph(family, i, max_nodes=max_nodes) for i in picked]
    else:
        gs = [load_graph(_graph_path(p)) for p in graphs or []]
    settings = dict(order=order, episodes=episodes, seed=seed, encoder=encoder, hidden=hidden, rounds=rounds,
                    memory_penalty=memory_penalty, sim_model=sim_model, lr=lr, workers=workers, backend=backend,
                    address=address, resume=resume, output=output, log=log)
    if quiet:
        result = train(gs, c, **settings)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task(f"training on {len(gs)} graphs", total=episodes)

            def report(done: int, total: int, rows: list[dict[str, Any]]) -> None:
                best = sum(r["best_step_time_s"] for r in rows) / max(1, len(rows))
                bar.update(task, completed=done, description=f"training on {len(gs)} graphs, mean best "
                           f"{fmt_time(best)}")

            result = train(gs, c, progress=report, **settings)
    console.print(f"trained placeto ({result.num_parameters} parameters) for {result.episodes_done} rounds on "
                  f"{len(gs)} graphs; best / start step time (geometric mean) {mean_best_ratio(result):.3f}; "
                  f"wrote {result.output}" + (f" and {log}" if log else ""))


@app.command("plot-curve")
def plot_curve_cmd(
    curve: Annotated[Path, typer.Argument(help="learning curve CSV from `devplace train --log` or --set log=...")],
    output: Annotated[Path, typer.Option("-o", "--output", help="write the PNG here")] = Path("curve.png"),
) -> None:
    """Draw a learning curve: step time per episode and best so far (per graph), and the policy's entropy."""
    from devplace.placers.rl.curve import plot_curve, read_curve

    rows = read_curve(curve)
    plot_curve(rows, output, title=curve.stem)
    console.print(f"wrote {output} ({len(rows)} rows)")


@app.command("run")
def run_cmd(
    model: ModelOpt = None,
    plan_file: Annotated[Path | None, typer.Option("--plan", help="a plan file (devplace.plan/1), zoo model")] = None,
    devices: Annotated[str, typer.Option(help="real device per logical device, e.g. cuda:0,cuda:1 or cpu,cpu")] = "cpu",
    cluster: Annotated[str | None, typer.Option("--cluster", "-c", help="cluster to plan for (default: these "
                                                "devices, speeds measured)")] = None,
    steps: Annotated[int, typer.Option(help="timed training steps")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed warm-up steps")] = 2,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    placer: Annotated[str, typer.Option(help="placer name (see `devplace placers`)")] = "m-etf",
    order: Annotated[str, typer.Option(help="traversal order (see `devplace orders`), or auto")] = "auto",
    seed: Annotated[int, typer.Option(help="seed for every random choice")] = 0,
    record: Annotated[Path | None, typer.Option(help="append the calibration record (JSON lines) here")] = Path(
        "devplace-runs.jsonl"),
    save_plan: Annotated[Path | None, typer.Option("--save-plan", help="write the plan made for --model here")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run real training steps of a placed zoo model and compare measured with simulated step time and memory.

    With --model the step is captured and placed on --cluster (default: a cluster of the --devices, speeds
    measured on this machine); with --plan a saved plan is used. Logical device i runs on the i-th of --devices
    (a real device may repeat). Steps are timed with CUDA events where a GPU is used, wall clock otherwise.
    """
    from devplace.runtime.apply import normalize_devices
    from devplace.runtime.plan import load_plan, rebuild_zoo_model, zoo_plan
    from devplace.runtime.run import append_record, local_cluster, measure_plan

    if (model is None) == (plan_file is None):
        raise DevplaceError("give either --model NAME (see `devplace zoo list`) or --plan FILE")
    real = normalize_devices(devices)
    if plan_file is not None:
        p = load_plan(plan_file)
        module, inputs = rebuild_zoo_model(p)
    else:
        assert model is not None
        c = load_cluster(cluster) if cluster else local_cluster(real)
        with nullcontext() if as_json else console.status(f"capturing and placing {model}"):
            p, module, inputs = zoo_plan(model, c, batch=batch, seq_len=seq_len, placer=placer, order=order,
                                         max_nodes=max_nodes, seed=seed)
        if save_plan is not None:
            p.save(save_plan)
    with nullcontext() if as_json else console.status(f"running {steps} timed steps on {devices}"):
        placed, run, rec = measure_plan(p, module, inputs, real, steps=steps, warmup=warmup)
    if record is not None:
        append_record(record, rec)
    if as_json:
        _print_json(rec)
        return
    console.print(p.summary())
    ratio = rec["ratio"]
    console.print(f"measured step {fmt_time(run.step_time_s)} (median of {steps}, {run.timer}) vs simulated "
                  f"{fmt_time(p.runtime_result.step_time_s)} as run: measured/simulated = {ratio:.2f}; placed at "
                  f"{placed.granularity} granularity, {placed.crossings} device crossings per forward")
    table = Table(header_style="bold", show_edge=False)
    for col in ("real device", "logical devices", "simulated peak", "measured peak"):
        table.add_column(col)
    for dev in dict.fromkeys(placed.devices):
        logical = [i for i, d in enumerate(placed.devices) if d == dev and i < p.cluster.num_devices]
        sim = sum(float(p.runtime_result.peak_memory_bytes[i]) for i in logical)
        meas = run.peak_memory_bytes.get(str(dev))
        table.add_row(str(dev), ",".join(map(str, logical)), fmt_bytes(sim),
                      fmt_bytes(meas) if meas is not None else "not measured (CPU)")
    console.print(table)
    if record is not None:
        console.print(f"appended the calibration record to {record} (fold it with `devplace calibrate --runs`)")


@app.command("export")
def export_cmd(
    plan_file: Annotated[Path, typer.Argument(help="a plan file (devplace.plan/1)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="pipeline, device-map or json")] = "json",
    devices: Annotated[str | None, typer.Option(help="real device names for the logical indices, e.g. "
                                                "cuda:0,cuda:1")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write the JSON here (default: stdout)")] = None,
) -> None:
    """Export a plan's placement: torch.distributed.pipelining split points (when the placement is contiguous
    along the program), a Hugging Face style device_map (module -> device, with the simulated step-time
    loss of that coarser mapping), or plain JSON."""
    from devplace.runtime.export import device_map, export_json, pipeline_split
    from devplace.runtime.plan import load_plan

    p = load_plan(plan_file)
    names = [d.strip() for d in devices.split(",")] if devices else None
    note = ""
    if fmt == "pipeline":
        split = pipeline_split(p.graph, p.placement)
        doc = split.to_dict()
        if names is not None:
            doc["stage_device_names"] = [names[d] for d in split.devices]
        note = f"{len(split.devices)} pipeline stage(s), split at {', '.join(split.split_points) or 'nothing'}"
    elif fmt == "device-map":
        dm = device_map(p.graph, p.placement, p.cluster)
        doc = {"format": "devplace.device_map/1", "device_map": dm.named(names),
               "step_time_s": dm.step_time_s, "op_level_step_time_s": dm.op_level_step_time_s,
               "slowdown": dm.slowdown}
        note = (f"{len(dm.mapping)} modules mapped; simulated step {fmt_time(dm.step_time_s)} vs "
                f"{fmt_time(dm.op_level_step_time_s)} at op granularity ({dm.slowdown:.3f}x)")
    elif fmt == "json":
        doc = export_json(p.graph, p.placement, names)
        note = f"{len(p.placement.assignment)} ops placed"
    else:
        raise DevplaceError(f"unknown export format {fmt!r}; choose pipeline, device-map or json")
    if output is None:
        _print_json(doc)
        Console(stderr=True).print(note, highlight=False)
    else:
        output.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        console.print(f"{note}; wrote {output}")


def main() -> None:
    """Entry point of the console script: DevplaceError -> one line on stderr, exit status 2."""
    try:
        app()
    except DevplaceError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)

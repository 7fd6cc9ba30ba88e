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
    order: Annotated[str, typer.Option(help="traversal order for sequential placers (see `devplace orders`)")] = "topo",
    seed: Annotated[int, typer.Option(help="seed for every random choice")] = 0,
    setting: Annotated[list[str] | None, typer.Option("--set", help="placer setting key=value (repeatable)")] = None,
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
    if (graph is None) == (model is None):
        raise DevplaceError("give either a GRAPH file or --model NAME (see `devplace zoo list`)")
    if model is not None:
        prepared = _prepare_model(model, batch, seq_len, max_nodes, optimizer, c.devices[0], quiet or as_json)
        _place_and_report(prepared.graph, c, placer, order, seed, settings, output, as_json, trace, plot, quiet,
                          prepared=prepared)
        return
    assert graph is not None
    _place_and_report(load_graph(_graph_path(graph)), c, placer, order, seed, settings, output, as_json, trace, plot,
                      quiet)


def _prepare_model(model: str, batch: int | None, seq_len: int | None, max_nodes: int | None, optimizer: str,
                   device: Any, quiet: bool) -> Any:
    from devplace.capture.pipeline import zoo_prepared

    busy = nullcontext() if quiet else console.status(f"capturing the training step of {model}")
    with busy:
        return zoo_prepared(model, batch=batch, seq_len=seq_len, optimizer=optimizer, max_nodes=max_nodes,
                            device=device)


def _place_and_report(g: Any, c: Any, placer: str, order: str, seed: int, settings: dict[str, Any],
                      output: Path | None, as_json: bool, trace: Path | None, plot: Path | None,
                      quiet: bool, prepared: Any = None) -> Any:
    """Place, simulate, print the table (or JSON), write the files asked for; returns the SimResult.

    With `prepared` (a captured model), `g` is its coarse graph: the placement is expanded to every op of
    `prepared.full`, which is what is simulated and reported."""
    import time

    from devplace.graph import save_placement
    from devplace.placers import place
    from devplace.sim import DevplaceModel

    t0 = time.perf_counter()
    if quiet or as_json:
        placement = place(g, c, placer=placer, order=order, seed=seed, **settings)
    else:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        columns = (TextColumn("placing {task.description}"), BarColumn(), TaskProgressColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(f"{g.name} with {placer}", total=None)
            placement = place(g, c, placer=placer, order=order, seed=seed,
                              progress=lambda done, total: bar.update(task, completed=done, total=total),
                              **settings)
    elapsed = time.perf_counter() - t0
    groups = g.num_nodes
    if prepared is not None:
        from devplace.graph import Placement

        expanded = prepared.coarsening.expand(placement)
        placement = Placement(expanded.assignment, graph=prepared.full.name, cluster=c.name, meta=placement.meta)
        g = prepared.full
    if output is not None:
        save_placement(placement, output)
    model = DevplaceModel(g, c)
    result = simulate(g, c, placement)
    bound = lower_bound(g, c)
    single = model.best_single_device()
    _write_timelines(g, c, result, bound.value_s, trace, plot)
    speedup = single[1] / result.step_time_s if result.step_time_s > 0 else float("nan")
    if as_json:
        doc = result.to_dict()
        doc.update(graph=g.name, cluster=c.name, placer=placer, order=placement.meta.get("order"), seed=seed,
                   settings=settings, placement_time_s=elapsed, lower_bound_s=bound.value_s,
                   step_over_lower_bound=result.step_time_s / bound.value_s if bound.value_s else None,
                   best_single_device={"device": single[0], "step_time_s": single[1], "fits": single[2]},
                   speedup_over_single_device=speedup, placed_groups=groups, assignment=placement.assignment)
        _print_json(doc)
        return result
    console.print(result_view(g, c, result, bound))
    fits = "" if single[2] else ", which does not fit in its memory"
    placed = f" ({groups} groups of {g.num_nodes} ops)" if groups != g.num_nodes else ""
    console.print(f"placer {placer}" + (f", order {order}" if placement.meta.get("order") else " (no order)")
                  + f", seed {seed}: placed{placed} in {elapsed:.2f} s; best single device "
                  f"({c.devices[single[0]].name}{fits}) {fmt_time(single[1])}, speed-up {speedup:.2f}x")
    for what, path in (("placement", output), ("trace", trace), ("timeline", plot)):
        if path is not None:
            console.print(f"wrote {what} to {path}")
    return result


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
    costs: Annotated[Path, typer.Option("--costs", help="cost table from `devplace profile`")],
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare the analytic cost model with a profiled cost table, per op class."""
    from devplace.capture.pipeline import capture_zoo_model
    from devplace.capture.profile import calibrate, format_calibration, local_cpu_roofline
    from devplace.hardware.cost import CostTable

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
    _place_and_report(prepared.graph, c, placer, "topo", 0, {}, out / f"{model}.placement.json", False,
                      out / f"{model}-trace.json", out / f"{model}-timeline.png", False, prepared=prepared)


def main() -> None:
    """Entry point of the console script: DevplaceError -> one line on stderr, exit status 2."""
    try:
        app()
    except DevplaceError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)

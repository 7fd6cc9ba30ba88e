"""Placement commands: simulate, bound, info, clusters, place, placers, order, features, orders, recommend, demo."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from devplace import app
from devplace.cli.common import (
    SIM_MODEL_HELP,
    AmpOpt,
    BatchOpt,
    ChunksOpt,
    ClusterArg,
    CostsOpt,
    DtypeOpt,
    ForceOpt,
    GraphArg,
    JsonOpt,
    MaxNodesOpt,
    MicrobatchesOpt,
    ModelOpt,
    OptimizerOpt,
    PlacerOpt,
    PlotOpt,
    ScheduleOpt,
    SeedOpt,
    SemanticsOpt,
    SeqOpt,
    TraceOpt,
    busy,
    console,
    one_line,
    output_path,
    parse_settings,
    print_json,
    progress_bar,
    require_cluster,
    say,
    warn,
)
from devplace.defaults import (
    AUTO_PLACER,
    CANONICAL_ORDER,
    DEFAULT_ORDER,
    DEFAULT_PLACER,
    DEFAULT_SEED,
    DEFAULT_SIM_MODEL,
    RECOMMEND_PLACER,
)
from devplace.errors import DevplaceError
from devplace.graph.features import FEATURE_DESCRIPTIONS
from devplace.graph.info import graph_info
from devplace.graph.parallel import ParallelAsk
from devplace.hardware.cluster import load_cluster
from devplace.hardware.features import graph_features
from devplace.hardware.presets import PRESETS
from devplace.orders import ORDER_DEFINITIONS, TOPOLOGICAL_ORDERS, check_order_name, traversal_order
from devplace.planning import check_seed
from devplace.units import fmt_bytes, fmt_time


def simulate_cmd(
    graph: Annotated[Path, typer.Argument(help="graph file (devplace.graph/1 JSON), or `example` for the bundled "
                                               "one; or a saved plan (devplace.plan/1, `place --save-plan`) alone")],
    cluster: Annotated[str | None, typer.Argument(help="cluster preset name (see `devplace clusters`) or cluster "
                                                       "JSON file")] = None,
    placement: Annotated[Path | None, typer.Argument(help="placement file (devplace.placement/1 JSON)")] = None,
    model: Annotated[str, typer.Option(help=SIM_MODEL_HELP)] = DEFAULT_SIM_MODEL,
    as_json: JsonOpt = False,
    trace: TraceOpt = None,
    plot: PlotOpt = None,
    per_op: Annotated[bool, typer.Option("--per-op", help="with --json: each op's device, start, finish")] = False,
    force: ForceOpt = False,
) -> None:
    """Simulate one training step of GRAPH on CLUSTER under PLACEMENT, or of a saved PLAN (its graph, cluster and
    placement; a parallel plan's whole step, as its search judged it)."""
    sim = app.simulate_file(graph, cluster, placement, model=model, trace=trace, plot=plot)
    for message in sim.warnings:
        warn(message)
    if as_json:
        print_json(sim.to_dict(per_op=per_op))
    else:
        console.print(sim)


def bound_cmd(graph: GraphArg, cluster: ClusterArg, as_json: JsonOpt = False,
              schedule: Annotated[str | None, typer.Option(
                  help="bound the step under this micro-batch schedule (gpipe, 1f1b, interleaved-1f1b); needs "
                       "--microbatches")] = None,
              microbatches: Annotated[int | None, typer.Option(help="micro-batches per step of --schedule")] = None,
              chunks: Annotated[int | None, typer.Option(help="model chunks per device of --schedule "
                                                             "interleaved-1f1b (default 2)")] = None) -> None:
    """Lower bound on the step time of GRAPH on CLUSTER for every placement and schedule (or, with --schedule and
    --microbatches, under that schedule), with the higher bound without micro-batches."""
    bounded = app.bound(graph, cluster, schedule=schedule, microbatches=microbatches, chunks=chunks)
    if as_json:
        print_json(bounded.to_dict())
    else:
        console.print(bounded)


def info_cmd(graph: GraphArg, as_json: JsonOpt = False) -> None:
    """Size and shape of GRAPH: counts, total compute and bytes, depth."""
    info = graph_info(app.load_graph_arg(graph))
    if as_json:
        print_json(info)
        return
    table = Table(show_header=False, show_edge=False)
    for key, value in info.items():
        if key.endswith("_bytes"):
            value = fmt_bytes(value)
        elif key.endswith("_s"):
            value = fmt_time(value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        table.add_row(key, one_line(str(value)))  # the graph's name and kinds come from the file: never markup
    console.print(table)


def clusters_cmd(as_json: JsonOpt = False) -> None:
    """List the built-in cluster presets."""
    clusters = [factory() for factory in PRESETS.values()]
    if as_json:
        print_json([c.to_dict() for c in clusters])
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


def place_cmd(
    graph: Annotated[Path | None, typer.Argument(help="graph file, or `example`; or use --model")] = None,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="cluster preset name or cluster JSON file")] = "",
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    optimizer: OptimizerOpt = "adam",
    placer: PlacerOpt = DEFAULT_PLACER,
    order: Annotated[str, typer.Option(help="traversal order for sequential placers (see `devplace orders`), or "
                                            "`auto`: a cheap placer tries every order and keeps the best, another "
                                            "takes the order the graph's features suggest (see `devplace recommend`)")
                     ] = DEFAULT_ORDER,
    try_k: Annotated[int | None, typer.Option("--try", help="with --order auto: run the K most promising orders and "
                                                            "keep the best (K times the placement time)")] = None,
    try_with: Annotated[str | None, typer.Option("--try-with", help="with --try K: try the orders with this cheap "
                                                                   "placer, then run --placer once")] = None,
    seed: SeedOpt = DEFAULT_SEED,
    semantics: SemanticsOpt = None,
    setting: Annotated[list[str] | None, typer.Option("--set", help="placer setting key=value (repeatable)")] = None,
    episodes: Annotated[int | None, typer.Option(help="learned placers: training episodes (0 with --policy: apply "
                                                      "it zero-shot); same as --set episodes=N")] = None,
    policy: Annotated[Path | None, typer.Option(help="learned placers: start from this trained policy (`devplace "
                                                     "train -o`); same as --set policy=FILE")] = None,
    log: Annotated[Path | None, typer.Option(parser=output_path,
                                             help="learned placers: write the learning curve CSV here (see "
                                                  "`devplace plot-curve`); same as --set log=FILE")] = None,
    schedule: ScheduleOpt = None,
    microbatches: MicrobatchesOpt = None,
    chunks: ChunksOpt = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", parser=output_path,
                                                help="write the placement JSON here")] = None,
    as_json: JsonOpt = False,
    trace: TraceOpt = None,
    plot: PlotOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar while placing")] = False,
    dtype: DtypeOpt = None,
    amp: AmpOpt = False,
    module_map: Annotated[Path | None, typer.Option("--map", help="place by this hand-made module map instead of a "
                                                    "placer: a JSON device_map (module -> device), a list of "
                                                    "split points, or a `devplace export` file; with --schedule "
                                                    "and --microbatches, judged as that pipeline")] = None,
    save_plan: Annotated[Path | None, typer.Option("--save-plan", help="write the plan (placement, schedule, graph, "
                                                   "cluster, model, precision) here, for `devplace export` and "
                                                   "`devplace run --plan`")] = None,
    costs: CostsOpt = None,
    force: ForceOpt = False,
    parallel: Annotated[bool, typer.Option(
        "--parallel", help="with --model: search parallel plans (data-parallel replicas x pipeline stages, ZeRO, "
                           "recomputation, zero-bubble schedules) instead of placements of one replica; devplace run "
                           "runs them under GPipe, 1F1B or zero bubble (dp x pp CPU processes). The default searches "
                           "those beside the pipelines")] = False,
    dp: Annotated[int | None, typer.Option("--dp", help="parallel plans: fix the data-parallel degree (dp x pp = the "
                                                        "devices; implies --parallel)")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="parallel plans: fix the pipeline stages (implies "
                                                        "--parallel)")] = None,
    zero: Annotated[int | None, typer.Option("--zero", help="parallel plans: fix the ZeRO stage, 0-3 (implies "
                                                            "--parallel)")] = None,
    recompute: Annotated[str | None, typer.Option("--recompute", help="parallel plans: none, full or auto (the "
                                                                      "search chooses, a number of each stage's "
                                                                      "blocks included; implies --parallel)")] = None,
) -> None:
    """Place GRAPH (or a zoo or custom --model, captured on the fly) on a cluster and print the predicted step
    time and memory per device, with the best single device and the even split as baselines.

    GRAPH `example` is the bundled 16-layer MLP training step (too big for one 16 GB GPU). With --model, the
    training step is captured (in --dtype / --amp), costed for the cluster's first device, colocated (and
    coarsened to --max-nodes); the placement of the groups is expanded to every op, and the table reports that
    full graph. With --map, the captured graph is placed by the map, as autograd runs it.
    """
    require_cluster(cluster)
    asked = parallel or any(v is not None for v in (dp, pp, zero, recompute))
    ask = ParallelAsk(dp, pp, zero, recompute or "auto") if asked else None
    c = load_cluster(cluster)
    settings = parse_settings(setting or [])
    for key, value in (("episodes", episodes), ("policy", policy), ("log", log), ("schedule", schedule),
                       ("microbatches", microbatches), ("chunks", chunks)):
        if value is not None:
            if key in settings:
                raise DevplaceError(f"--{key} and --set {key}=... both given; keep one")
            settings[key] = str(value) if isinstance(value, Path) else value
    placed = app.place_task(c, graph=graph, model=model, batch=batch, seq_len=seq_len, max_nodes=max_nodes,
                            optimizer=optimizer, placer=placer, order=order, try_orders=try_k, try_with=try_with,
                            seed=seed, semantics=semantics, settings=settings, module_map=module_map, output=output,
                            trace=trace, plot=plot, save_plan=save_plan, dtype=dtype, amp=amp, costs=costs,
                            parallel=ask, busy=lambda message: busy(message, quiet or as_json),
                            progress=lambda what: progress_bar(what, quiet or as_json))
    if as_json:
        print_json(placed.to_dict())
    else:
        console.print(placed)


def placers_cmd(as_json: JsonOpt = False) -> None:
    """List the placers, whether they walk the graph in the traversal order, and their settings."""
    specs = app.placer_specs()
    if as_json:
        print_json({s.name: {"uses_order": s.uses_order, "cheap": s.cheap, "summary": s.summary,
                             "settings": {k: repr(v) for k, v in s.settings.items()}} for s in specs})
        return
    table = Table(header_style="bold", show_edge=False)
    table.add_column("placer", no_wrap=True)
    table.add_column("order")
    table.add_column("settings")
    table.add_column("what it does")
    for s in specs:
        table.add_row(s.name, ("uses order" + (", cheap" if s.cheap else "")) if s.uses_order else "ignores order",
                      ", ".join(f"{k}={v!r}" for k, v in s.settings.items()), s.summary)
    console.print(table)
    console.print("cheap: `--order auto` places it under every order (but `random`) and keeps the best simulated step",
                  highlight=False)


def order_cmd(
    graph: GraphArg,
    order: Annotated[str, typer.Option("--order", help="traversal order name (see `devplace orders`)")
                     ] = CANONICAL_ORDER,
    seed: Annotated[int, typer.Option(help="seed of the `random` order", callback=check_seed)] = DEFAULT_SEED,
    cluster: Annotated[str | None, typer.Option(help="cluster for `critical-path` costs")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the traversal ORDER of GRAPH, one node id per line."""
    check_order_name(order)
    g = app.load_graph_arg(graph)
    ids = traversal_order(g, order, seed, cluster=load_cluster(cluster) if cluster else None)
    if as_json:
        print_json({"graph": g.name, "order": order, "seed": seed, "nodes": ids})
    else:
        sys.stdout.write("".join(f"{one_line(nid).plain}\n" for nid in ids))  # one id per line, escaped


def features_cmd(
    graph: GraphArg,
    cluster: Annotated[str | None, typer.Option(help="cluster for the communication-to-computation ratio")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Graph features (docs/features.md): the inputs of the traversal-order recommendation."""
    feats = graph_features(app.load_graph_arg(graph), load_cluster(cluster) if cluster else None)
    if as_json:  # undefined features (NaN) print as null; counts are integers
        print_json({k: int(v) if math.isfinite(v) and v == int(v) and abs(v) < 2**53 else v for k, v in feats.items()})
        return
    table = Table(header_style="bold", show_edge=False)
    for col in ("feature", "value", "definition"):
        table.add_column(col)
    for key, value in feats.items():
        table.add_row(key, f"{value:.6g}", FEATURE_DESCRIPTIONS[key])
    console.print(table)


def orders_cmd(as_json: JsonOpt = False) -> None:
    """List the traversal orders and their definitions."""
    if as_json:
        print_json({name: {"definition": d, "topological": name in TOPOLOGICAL_ORDERS}
                    for name, d in ORDER_DEFINITIONS.items()})
        return
    table = Table(header_style="bold", show_edge=False)
    table.add_column("order", no_wrap=True)
    table.add_column("topological")
    table.add_column("definition")
    for name, definition in ORDER_DEFINITIONS.items():
        table.add_row(name, "yes" if name in TOPOLOGICAL_ORDERS else "", definition)
    console.print(table)
    console.print("`auto` (the default of `devplace place`) is not an order but a decision: a cheap placer (see "
                  "`devplace placers`) is placed under every order but `random` and the best simulated step kept; "
                  "another placer takes the order the shipped recommendation model picks from the graph's features "
                  "(`devplace recommend`), or with --try K the best of its K most promising orders.", highlight=False)


def recommend_cmd(
    graph: Annotated[Path | None, typer.Argument(help="graph file, or `example`; or use --model")] = None,
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    cluster: Annotated[str | None, typer.Option("--cluster", "-c", help="cluster preset or JSON (default: the one "
                                                                        "the order model was fitted on)")] = None,
    placer: Annotated[str, typer.Option(help="the placer the order is for (see `devplace placers`)")
                      ] = RECOMMEND_PLACER,
    order_model: Annotated[Path | None, typer.Option("--order-model", help="order model JSON (default: shipped)")
                           ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Recommend a traversal order for GRAPH (or a zoo --model) and PLACER: the order, the rule that fired and
    the expected gain over `topo` (what `devplace place --order auto` uses)."""
    with busy(f"capturing the training step of {model}", as_json or model is None):
        rec = app.recommend(graph, model=model, batch=batch, seq_len=seq_len, max_nodes=max_nodes, cluster=cluster,
                            placer=placer, order_model=order_model)
    if as_json:
        print_json(rec.to_dict())
    else:
        console.print(rec)


def demo_cmd(
    out: Annotated[Path, typer.Option(help="folder for the placement, trace and timeline")] = Path("out"),
    model: Annotated[str, typer.Option(help="zoo model (one that needs several devices)")] = "llama-1b",
    cluster: Annotated[str, typer.Option(help="cluster preset")] = "4xV100-16GB",
    schedule: Annotated[str, typer.Option(help="micro-batch schedule: gpipe, 1f1b or interleaved-1f1b")] = "1f1b",
    batch: Annotated[int, typer.Option(help="samples per step (the global batch), split into the micro-batches",
                                       min=1)] = 8,
    microbatches: Annotated[int, typer.Option(help="micro-batches per step (must divide --batch)")] = 8,
    chunks: ChunksOpt = None,
    baseline: Annotated[str, typer.Option(help="placer of the placement without micro-batches it is compared "
                                               f"with ({AUTO_PLACER}: devplace's default, the best of several, "
                                               "slower to give up)")
                        ] = "contiguous",
    max_nodes: MaxNodesOpt = None,
    force: ForceOpt = False,
) -> None:
    """Why devplace exists: capture a model that does not fit one device (Llama 1B, batch 8, 2048 tokens,
    Adam), place it on 4xV100-16GB with devplace's default search (pipelines, the parallel plans devplace runs:
    data-parallel replicas, ZeRO, recomputation; each micro-batch captured and costed at its own size) and
    print its step against the `pipeline` placer under --schedule with --microbatches (1F1B, 8 micro-batches of
    one sample), the even split under that schedule, a placement without micro-batches and the best single
    device.

    Writes the answer's placement, a Perfetto trace and a timeline PNG into OUT.
    """
    c = load_cluster(cluster)
    app.check_pipeline_settings("pipeline", c, {"schedule": schedule, "microbatches": microbatches,
                                                **({"chunks": chunks} if chunks is not None else {})}, batch=batch)
    if baseline != AUTO_PLACER:  # a placer's name, checked before the capture
        app.check_placer(baseline)
    app.output_folder(out, "--out")
    with busy(f"capturing the training step of {model}", False):
        prepared = app.torch_tasks().prepare_model(model, batch=batch, max_nodes=max_nodes, cluster=c)
    say(f"captured {prepared.full.name}: {prepared.full.num_nodes} ops, colocated into {prepared.graph.num_nodes} "
        f"groups; op times analytic for {', '.join(dict.fromkeys(d.kind for d in c.devices))}")
    with busy(f"placing {prepared.graph.name}, the pipeline placer and the baselines", False):
        demo = app.torch_tasks().demo(prepared, c, schedule=schedule, microbatches=microbatches,
                                               chunks=chunks, baseline=baseline, out=out, name=model)
    console.print(demo)

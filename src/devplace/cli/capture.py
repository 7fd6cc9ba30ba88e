"""Capture and zoo commands: zoo list, zoo family, capture, profile, calibrate (all need torch: they reach the
application layer through `devplace.app.torch_tasks()`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from devplace import app
from devplace.cli.common import (
    AmpOpt,
    BatchOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    MaxNodesOpt,
    ModelOpt,
    OptimizerOpt,
    SeqOpt,
    busy,
    console,
    output_path,
    print_json,
    progress_bar,
    say,
)
from devplace.defaults import FAMILY_MAX_NODES
from devplace.errors import DevplaceError
from devplace.graph.info import graph_info
from devplace.planning import precision_text
from devplace.units import fmt_time

zoo_app = typer.Typer(no_args_is_help=True, help="Named models and the seed study's graph families.")

DEVICE_KIND_HELP = "device to cost for: K80, V100, V100-PCIe, A100, H100, or cpu (this machine's, measured)"


@zoo_app.command("list")
def zoo_list_cmd(as_json: JsonOpt = False) -> None:
    """The zoo's named models and the study's families."""
    models, families, family_size = app.torch_tasks().zoo_catalogue()
    if as_json:
        print_json({"models": {n: {"batch": m.batch, "seq_len": m.seq_len, "params": m.params,
                                   "description": m.description} for n, m in models.items()},
                    "families": {f: family_size for f in families}})
        return
    table = Table(header_style="bold", show_edge=False)
    for col in ("model", "parameters", "batch", "seq len", "what"):
        table.add_column(col)
    for n, m in models.items():
        table.add_row(n, f"{m.params / 1e6:,.1f} M", str(m.batch), str(m.seq_len or "-"), m.description)
    console.print(table)
    say(f"families (devplace zoo family NAME --index I): {', '.join(families)}, {family_size} graphs each")


@zoo_app.command("family")
def zoo_family_cmd(
    name: Annotated[str, typer.Argument(help="cifar10, ptb or nmt")],
    index: Annotated[int, typer.Option(help="graph index, 0-31")] = 0,
    max_nodes: Annotated[int | None, typer.Option("--max-nodes", help="coarsen to at most this many groups")
                         ] = FAMILY_MAX_NODES,
    output: Annotated[Path | None, typer.Option("-o", "--output", parser=output_path,
                                                help="write the graph JSON here")] = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Capture graph INDEX of a study family, coarsened to --max-nodes, and print its size (or save it)."""
    g = app.torch_tasks().zoo_family_graph(name, index, max_nodes=max_nodes, output=output)
    info = graph_info(g)
    if as_json:
        print_json(info)
    else:
        say(f"{g.name}: {info['nodes']} groups, {info['edges']} edges, "
            f"{fmt_time(info['total_compute_s'])} of compute" + (f"; wrote {output}" if output else ""))


def capture_cmd(
    output: Annotated[Path, typer.Option("-o", "--output", parser=output_path, help="write the graph JSON here")],
    model: ModelOpt = None,
    onnx: Annotated[Path | None, typer.Option("--onnx", help="an ONNX forward graph to import instead")] = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    max_nodes: MaxNodesOpt = None,
    optimizer: OptimizerOpt = "adam",
    costs: Annotated[Path | None, typer.Option("--costs", help="cost table from `devplace profile`")] = None,
    device_kind: Annotated[str, typer.Option("--device-kind", help=DEVICE_KIND_HELP)] = "V100",
    full: Annotated[Path | None, typer.Option("--full", parser=output_path,
                                              help="also write the uncoarsened graph here")] = None,
    dtype: DtypeOpt = None,
    amp: AmpOpt = False,
    force: ForceOpt = False,
) -> None:
    """Capture a training step (forward + backward + optimizer) and write its costed, colocated graph.

    The written graph's nodes are colocation groups (coarsened to --max-nodes if given); its meta holds the
    members of every group and the precision (--dtype, --amp). Op times: the analytic roofline for
    --device-kind at each op's precision, or a --costs table.
    """
    app.check_outputs({"output": app.GRAPH_FILE}, inputs=[onnx, costs], output=output, full=full)
    tasks = app.torch_tasks()
    with busy("capturing", False):
        prepared = tasks.capture_graph(model=model, onnx=onnx, batch=batch, seq_len=seq_len, max_nodes=max_nodes,
                                       optimizer=optimizer, costs=costs, device_kind=device_kind, dtype=dtype,
                                       amp=amp)
    tasks.save_prepared(prepared, output, full)
    console.print(prepared.report.format(), markup=False)  # op names of an ONNX file are user text
    say(f"{prepared.full.name}: {prepared.full.num_nodes} ops -> {prepared.graph.num_nodes} groups"
        f"{precision_text(prepared.full)}; wrote {output}" + (f" and {full}" if full else ""))


def profile_cmd(
    output: Annotated[Path, typer.Option("-o", "--output", parser=output_path, help="write the cost table JSON here")],
    model: ModelOpt = None,
    batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    device: Annotated[str, typer.Option(help="where to run the ops: cpu or cuda[:i]")] = "cpu",
    repeats: Annotated[int, typer.Option(help="timed runs per op (after 3 warm-up runs)")] = 10,
    max_ops: Annotated[int | None, typer.Option("--max-ops", help="profile at most this many distinct ops")] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads for the ops (torch.set_num_threads; default: "
                                                "torch's); the table's device kind records the count, so give "
                                                "`devplace run` the same --threads")] = None,
    overheads: Annotated[bool, typer.Option("--overheads/--no-overheads", help="on the CPU, also measure this "
                                            "machine's per-op, per-action (pipelining) and per-transfer (gloo) "
                                            "overheads on a probe model (about half a minute)")] = True,
    in_step: Annotated[bool, typer.Option("--in-step", help="on the CPU, time each op again inside real training "
                                          "steps of the model (one device, as `devplace run --plan` runs it: "
                                          "inputs not hot in cache, the optimizer as the step runs it) and keep "
                                          "those times; the overheads are then measured beyond ops timed so")] = False,
    force: ForceOpt = False,
) -> None:
    """Run every distinct op of a zoo or custom model's training step for real and write their times as a cost
    table, with this machine's overheads beyond the ops (`place --costs` and `run --costs` charge them)."""
    if model is None:
        raise DevplaceError("--model NAME is required (see `devplace zoo list`)")
    with progress_bar(f"profiling {model} on {device}", False, label="{task.description}") as update:
        # no bar (update None) when the output is not a terminal: CI, a pipe, a redirect
        graph, table = app.torch_tasks().profile_model(
            model, output, batch=batch, seq_len=seq_len, device=device, repeats=repeats, max_ops=max_ops,
            threads=threads, overheads=overheads, in_step=in_step,
            progress=None if update is None else lambda done, total, _t: update(done, total))
    o = table.overheads
    say(f"{graph.name}: {len(table)} distinct ops timed on {device}{' (inside real steps)' if in_step else ''}"
        f"{f', {len(table.skipped)} skipped (listed in the table)' if table.skipped else ''}"
        + (f"; overheads: {o.op_s * 1e6:.1f} us per op, {o.action_s * 1e3:.2f} ms per pipeline action, "
           f"{o.transfer_latency_s * 1e6:.0f} us per transfer" if o.op_s or o.action_s or o.transfer_latency_s
           else "") + f"; wrote {output}")


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
    tasks = app.torch_tasks()
    if runs is not None:
        folded = tasks.fold_run_records(runs)
        if costs is None:
            if as_json:
                print_json(folded)
            else:
                console.print(tasks.format_runs(folded), markup=False, highlight=False, soft_wrap=True)
            return
        console.print(tasks.format_runs(folded), markup=False, highlight=False)
    if costs is None:
        raise DevplaceError("give --costs TABLE (from `devplace profile`) and/or --runs FILE (from `devplace run`)")
    if model is None:
        raise DevplaceError("--model NAME is required: the model whose ops the table timed")
    cal = tasks.model_calibration(costs, model, batch=batch, seq_len=seq_len)
    if as_json:
        print_json(cal)
    else:
        console.print(tasks.format_calibration(cal), markup=False, highlight=False)

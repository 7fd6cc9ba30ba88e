"""Runtime commands: run (real training steps against their simulation), export (a plan for other tools)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from devplace import app
from devplace.cli.common import (
    AmpOpt,
    BatchOpt,
    DtypeOpt,
    JsonOpt,
    MaxNodesOpt,
    ModelOpt,
    PlacerOpt,
    SeedOpt,
    SeqOpt,
    busy,
    console,
    print_json,
    say,
)
from devplace.defaults import DEFAULT_PLACER, DEFAULT_SEED


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
    placer: PlacerOpt = DEFAULT_PLACER,
    order: Annotated[str, typer.Option(help="traversal order (see `devplace orders`), or auto")] = "auto",
    seed: SeedOpt = DEFAULT_SEED,
    record: Annotated[Path | None, typer.Option(help="append the calibration record (JSON lines) here")] = Path(
        "devplace-runs.jsonl"),
    save_plan: Annotated[Path | None, typer.Option("--save-plan", help="write the plan made for --model here")] = None,
    as_json: JsonOpt = False,
    dtype: DtypeOpt = None,
    amp: AmpOpt = False,
) -> None:
    """Run real training steps of a placed zoo or custom model and compare measured with simulated step time
    and memory.

    With --model the step is captured (in --dtype / --amp) and placed on --cluster (default: a cluster of the
    --devices, speeds measured on this machine); with --plan a saved plan is used. Steps run in the plan's
    precision. Logical device i runs on the i-th of --devices
    (a real device may repeat). Steps are timed with CUDA events where a GPU is used, wall clock otherwise.
    """
    tasks = app.torch_tasks()
    with busy(f"capturing and placing {model}", as_json or model is None):
        p, module, inputs = tasks.plan_for_run(model=model, plan_file=plan_file, devices=devices, cluster=cluster,
                                               batch=batch, seq_len=seq_len, max_nodes=max_nodes, placer=placer,
                                               order=order, seed=seed, save_plan=save_plan, dtype=dtype, amp=amp)
    with busy(f"running {steps} timed steps on {devices}", as_json):
        measured = tasks.run_model(p, module, inputs, devices, steps=steps, warmup=warmup, record=record)
    if as_json:
        print_json(measured.to_dict())
    else:
        console.print(measured)


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
    doc, note = app.torch_tasks().export_plan(plan_file, fmt, devices)
    if output is None:
        print_json(doc)
        Console(stderr=True).print(note, highlight=False)
    else:
        output.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        say(f"{note}; wrote {output}")

"""Runtime commands: run (real training steps against their simulation), export (a plan for other tools)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from devplace import app
from devplace.cli.common import (
    AmpOpt,
    BatchOpt,
    ChunksOpt,
    CostsOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    MaxNodesOpt,
    MicrobatchesOpt,
    ModelOpt,
    PlacerOpt,
    ScheduleOpt,
    SeedOpt,
    SeqOpt,
    busy,
    console,
    guarded_console,
    output_path,
    print_json,
    say,
)
from devplace.defaults import DEFAULT_ORDER, DEFAULT_PLACER, DEFAULT_SEED
from devplace.errors import DevplaceError
from devplace.files import ANY_JSON
from devplace.graph.jsonio import write_json


def _one_thread(threads: int | None, what: str) -> None:
    """Refuse --threads N > 1 for a pipelined run (`what` says why it is one): its stages run 1 thread each."""
    if threads not in (None, 1):
        raise DevplaceError(f"{what}: each stage runs in its own process with 1 thread (the processes share the "
                            f"cores), so --threads {threads} would not be the steps' count; drop --threads or give "
                            "--threads 1")


def _in_processes(threads: int | None, why: str, label: str, as_json: bool, run: Callable[[], Any]) -> None:
    """Run `run` (a run of several processes, one thread each: `why` says what asked for it) while showing
    `label`, and show what it ran."""
    _one_thread(threads, why)
    with busy(label, as_json):
        ran = run()
    _show(ran, as_json)


def _show(result: Any, as_json: bool) -> None:
    """Print a run's result: its JSON form with --json, else its report."""
    if as_json:
        print_json(result.to_dict())
    else:
        console.print(result)


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
    order: Annotated[str, typer.Option(help="traversal order (see `devplace orders`), or auto")] = DEFAULT_ORDER,
    seed: SeedOpt = DEFAULT_SEED,
    record: Annotated[Path | None, typer.Option(parser=output_path,
                                                help="append the calibration record (JSON lines) here")] = Path(
        "devplace-runs.jsonl"),
    save_plan: Annotated[Path | None, typer.Option("--save-plan", parser=output_path,
                                                   help="write the plan made for --model here")] = None,
    pipeline: Annotated[Path | None, typer.Option("--pipeline", help="a pipeline export (devplace export --format "
                                                  "pipeline): run its stages in CPU processes with gloo")] = None,
    processes: Annotated[int | None, typer.Option(help="with --pipeline: processes, one per stage (default: the "
                                                  "export's stages)")] = None,
    parallel: Annotated[Path | None, typer.Option("--parallel", help="a parallel export (devplace export --format "
                                                  "parallel): run its dp x pp plan in dp*pp CPU processes with "
                                                  "gloo")] = None,
    as_json: JsonOpt = False,
    dtype: DtypeOpt = None,
    amp: AmpOpt = False,
    trust_model: Annotated[bool, typer.Option("--trust-model", help="with --plan/--pipeline: import and run the "
                                              "custom model (package.module:factory) the file names; same as "
                                              "repeating it as --model")] = False,
    force: ForceOpt = False,
    schedule: ScheduleOpt = None,
    microbatches: MicrobatchesOpt = None,
    chunks: ChunksOpt = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads for the steps (torch.set_num_threads; default: "
                                                "torch's); the report gives the number used")] = None,
    costs: CostsOpt = None,
) -> None:
    """Run real training steps of a placed zoo or custom model and compare measured with simulated step time
    and memory.

    With --model the step is captured (in --dtype / --amp), costed (with a --costs table of `devplace profile`:
    measured op times and overheads) and placed on --cluster (default: a cluster of the --devices, speeds
    measured on this machine, or the table's device); with --plan a saved plan is used. Steps run in the plan's
    precision. Logical device i runs on the i-th of --devices
    (a real device may repeat). Steps are timed with CUDA events where a GPU is used, wall clock otherwise.
    A plan or export that names a custom model (package.module:factory) runs its code only when you allow it:
    repeat the name as --model, or pass --trust-model.
    With --pipeline, the export's zoo model runs pipelined (torch.distributed.pipelining, its schedule and
    micro-batches), one CPU process per stage, and its first loss is shown next to the unpipelined one. A plan
    made for a schedule (--placer pipeline with --schedule/--microbatches, or a saved pipelined plan) runs so too.
    With --parallel, a parallel export's dp x pp plan runs in dp * pp CPU processes (replicas of the pipeline,
    ZeRO or FSDP per stage, per-block recomputation), its first loss shown next to the one-process loss.
    """
    tasks = app.torch_tasks()
    if parallel is not None:
        if pipeline is not None or plan_file is not None or costs is not None or processes is not None:
            raise DevplaceError("--parallel runs an export on its own (dp * pp processes): drop "
                                "--pipeline/--plan/--costs/--processes")
        _in_processes(threads, "--parallel", f"running {warmup + steps} parallel steps of {parallel}", as_json,
                      lambda: tasks.run_parallel_export(parallel, steps=steps, warmup=warmup,
                                                        trust_model=trust_model or (model or False)))
        return
    if pipeline is not None:
        if plan_file is not None or costs is not None:
            raise DevplaceError("--pipeline runs an export on its own, simulated when it was exported: drop "
                                "--plan/--costs")
        _in_processes(threads, "--pipeline", f"running {warmup + steps} pipelined steps of {pipeline}", as_json,
                      lambda: tasks.run_pipeline_export(pipeline, processes=processes, steps=steps, warmup=warmup,
                                                        trust_model=trust_model or (model or False)))
        return
    tasks.check_steps(steps, warmup)  # before capturing and placing
    tasks.check_threads(threads)
    if schedule not in (None, "none"):  # pipelined: its stages run 1 thread each, as the CPU is to be measured
        _one_thread(threads, f"--schedule {schedule}")
        threads = 1
    tasks.set_threads(threads)  # before placing too: the local cluster's CPU is measured at the steps' thread count
    pipelining = {k: v for k, v in (("schedule", schedule), ("microbatches", microbatches), ("chunks", chunks))
                  if v is not None}
    with busy(f"capturing and placing {model}", as_json or model is None):
        p, module, inputs = tasks.plan_for_run(model=model, plan_file=plan_file, devices=devices, cluster=cluster,
                                               batch=batch, seq_len=seq_len, max_nodes=max_nodes, placer=placer,
                                               order=order, seed=seed, save_plan=save_plan, dtype=dtype, amp=amp,
                                               trust_model=trust_model, record=record,
                                               settings=pipelining, costs=costs)
    if tasks.is_parallel(p):
        _in_processes(threads, "this parallel plan runs in several processes",
                      f"running {warmup + steps} parallel steps", as_json,
                      lambda: tasks.run_plan_parallel(p, module, inputs, steps=steps, warmup=warmup))
        return
    if tasks.is_pipelined(p):
        _in_processes(threads, "this plan runs pipelined", f"running {warmup + steps} pipelined steps", as_json,
                      lambda: tasks.run_plan_pipelined(p, module, inputs, steps=steps, warmup=warmup))
        return
    with busy(f"running {steps} timed steps on {devices}", as_json):
        measured = tasks.run_model(p, module, inputs, devices, steps=steps, warmup=warmup, record=record,
                                   threads=threads)
    _show(measured, as_json)


def export_cmd(
    plan_file: Annotated[Path, typer.Argument(help="a plan file (devplace.plan/1)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="pipeline, device-map, json, parallel or "
                                     "torchtitan")] = "json",
    devices: Annotated[str | None, typer.Option(help="real device names for the logical indices, e.g. "
                                                "cuda:0,cuda:1")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", parser=output_path,
                                                help="write the JSON here (default: stdout)")] = None,
    schedule: Annotated[str | None, typer.Option(help="pipeline, parallel, torchtitan: schedule kind, gpipe or "
                                                 "1f1b (default: the placement's, else 1f1b); parallel, torchtitan "
                                                 "of a plan placed with --chunks 2: also zbv or dualpipev (its "
                                                 "stages laid out as a V)")] = None,
    microbatches: Annotated[int | None, typer.Option(help="pipeline, parallel, torchtitan: micro-batches per step "
                                                     "(per replica; default: the placement's, else one per "
                                                     "stage)")] = None,
    dp: Annotated[int | None, typer.Option("--dp", help="parallel, torchtitan: data-parallel replicas of the "
                                           "plan's pipeline, sharing its batch (default 1)")] = None,
    zero: Annotated[int | None, typer.Option("--zero", help="parallel, torchtitan: ZeRO stage 0-3 over each "
                                             "stage's replicas (1: ZeroRedundancyOptimizer, 2/3: fully_shard; "
                                             "default 0)")] = None,
    recompute: Annotated[str | None, typer.Option("--recompute", help="parallel, torchtitan: none or full "
                                                  "(activation checkpointing per block; default none)")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="device-map: the custom model "
                                              "(package.module:factory) the plan names, repeated to allow "
                                              "importing it")] = None,
    trust_model: Annotated[bool, typer.Option("--trust-model", help="device-map: import the custom model the plan "
                                              "names to rebuild it; same as repeating it as --model")] = False,
    force: ForceOpt = False,
) -> None:
    """Export a plan's placement: torch.distributed.pipelining split points with the micro-batch schedule
    (devplace.pipeline/3; `devplace run --pipeline` runs it), a Hugging Face style device_map (module -> device,
    with the simulated step-time loss of that coarser mapping), or plain JSON; or --dp replicas of its pipeline
    with --zero and --recompute as a torch program configuration (devplace.parallel/2: pipelining stages, DDP,
    ZeroRedundancyOptimizer or fully_shard, activation checkpointing; `devplace run --parallel` runs it) or as
    the parallelism and activation-checkpoint sections of a torchtitan job config (--format torchtitan).

    A device-map rebuilds the plan's zoo or custom model, so that it covers every parameter and buffer (tied
    weights on one device) in the model's own names, as accelerate and from_pretrained(device_map=...) load it.
    A custom model is code: it is imported only when you repeat it as --model or pass --trust-model."""
    app.check_outputs({"output": ANY_JSON}, inputs=[plan_file], output=output)
    parallel = {k: v for k, v in (("dp", dp), ("zero", zero), ("recompute", recompute)) if v is not None}
    doc, note = app.torch_tasks().export_plan(plan_file, fmt, devices, schedule=schedule, microbatches=microbatches,
                                              trust_model=trust_model or (model or False), parallel=parallel)
    if output is None:
        print_json(doc)
        guarded_console(stderr=True).print(note, highlight=False)
    else:
        write_json(output, doc, "--output")
        say(f"{note}; wrote {output}")

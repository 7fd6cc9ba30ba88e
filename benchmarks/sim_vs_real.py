"""Measured vs simulated training steps on this CPU (issues 23 and 30): one device and a 2-process gloo pipeline.

    PYTHONPATH=$PWD/src nice -n 5 .venv/bin/python benchmarks/sim_vs_real.py [--models gpt2,cnn] [--steps 15]
        [--model package.module:factory --batch 8 ...] [--schedule 1f1b,zero-bubble] [--no-overheads]

For each model (small ones, built here in code, nothing downloaded, named to devplace as the custom models
`sim_vs_real:<factory>`; any other custom model with `--model`, e.g. `more_models:tiny_bart` from this folder),
with `--threads` CPU threads (default 1: what each process of a pipelined run uses):

0. once per run, this machine's overheads beyond the ops (`devplace profile`'s measurement on its probe model,
   `app.overheads.measure_overheads`: per op, per pipeline action, per gloo transfer), which every table below
   carries (`--no-overheads`: none, as before issue 30);

1. profile: every distinct op of the captured training step timed for real on this CPU (`devplace profile`'s
   task, `app.torch_tasks().profile_model`), at the whole batch and at the pipeline's micro-batch size; with
   `--profile in-step` (the default) each op is then timed again inside 5 real training steps of the model on one
   device (`devplace profile --in-step`, `runtime.in_step.profile_in_step`), in a run of its own on a model built
   afresh, apart from the measured steps, and the plans are made and simulated with those times and the overheads
   measured beyond them on the probe; every row also shows the same plan simulated with the isolated times and
   their overheads, and the ratios measured against that;
2. one device: the step captured and costed with that table for a cluster of this CPU (`local_cluster`, its
   device the one the table was measured on), placed (placer `single`), saved as a plan, read back and run as
   `devplace run --plan plan.json --threads N` runs it (`plan_for_run`, `run_model`);
3. pipeline: the same, on two logical CPUs, placed by the `pipeline` placer under each `--schedule` (one chunk per
   process: zero-bubble is ZB-H1, its backward split into input- and weight-gradient actions) with
   `--microbatches` (each micro-batch captured and costed at its own size), run as `devplace run --plan` runs a
   pipelined plan: one process per stage, gloo, `torch.distributed.pipelining` (`run_plan_pipelined`).

One run prints one table: model, setting, simulated step, measured median, spread ((max - min) / median of the
timed steps), fastest timed step, measured / simulated; and the machine, threads, date and load (`uptime`
before and after: the cores may be shared with other jobs, which the measured steps feel and the per-op
medians of the profile mostly do not). `--json FILE` also writes every figure, with the diagnostics the
docs/performance.md section reads (ops per step, the per-op overhead the profile misses, the gloo round trip).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are written below; nothing may be downloaded
BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:  # "sim_vs_real:<factory>" must import here and in the pipeline's stage processes
    sys.path.insert(0, BENCH)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# ------------------------------------------------------------------------------------------------ the models


class CausalLM(nn.Module):
    """A transformers causal LM, zoo-style: input_ids -> its own next-token loss (labels = the inputs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


class CNN(nn.Module):
    """A small CNN without batch norm (its statistics would be per micro-batch): images, labels -> loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                                    nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                                    nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
        self.block3 = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(128, 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.block3(self.block2(self.block1(self.stem(images)))).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), labels)


class MLP(nn.Module):
    """Four linear layers with ReLU: features, labels -> cross-entropy."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(512, width), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.layer3 = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.layer3(self.layer2(self.layer1(x)))), labels)


VOCAB = 1024


def tiny_gpt2(batch: int = 8, seq_len: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2 (transformers), 4 layers of width 128, 4 heads, vocabulary 1024, tied embeddings, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return CausalLM(GPT2LMHeadModel(cfg)), (torch.randint(0, VOCAB, (batch, seq_len)),)


def tiny_llama(batch: int = 8, seq_len: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Llama-style decoder (transformers LlamaConfig): 4 layers of width 128, 4 heads, 2 key/value heads,
    rotary positions, SwiGLU MLP of 256, vocabulary 1024."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return CausalLM(LlamaForCausalLM(cfg)), (torch.randint(0, VOCAB, (batch, seq_len)),)


def tiny_t5(batch: int = 8, seq_len: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A T5-style encoder-decoder (transformers T5Config): 2 + 2 layers of width 128, 4 heads, feed-forward 256,
    vocabulary 1024, target = input, no dropout."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return CausalLM(T5ForConditionalGeneration(cfg)), (torch.randint(1, VOCAB, (batch, seq_len)),)


def small_cnn(batch: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """`CNN` on 32x32 RGB images, 10 classes."""
    return CNN(), (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))


def mlp(batch: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """`MLP` on 512 features, 10 classes."""
    return MLP(), (torch.randn(batch, 512), torch.randint(0, 10, (batch,)))


# name in the table -> (custom model name, batch)
MODELS: dict[str, tuple[str, int]] = {
    "gpt2": ("sim_vs_real:tiny_gpt2", 8),
    "llama": ("sim_vs_real:tiny_llama", 8),
    "t5": ("sim_vs_real:tiny_t5", 8),
    "cnn": ("sim_vs_real:small_cnn", 16),
    "mlp": ("sim_vs_real:mlp", 64),
}


# ------------------------------------------------------------------------------------------------- the runs

def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "uptime: not available"


def _cpu_model() -> str:
    from devplace.capture.profile import measure_local_cpu

    return measure_local_cpu().model


def _ops_per_step(graph: Any) -> dict[str, int]:
    """Nodes of a captured step by op class (the simulated step is their profiled times, one after another)."""
    from devplace.hardware.cost import op_class

    counts: dict[str, int] = {}
    for v in range(graph.num_nodes):
        c = op_class(graph.op[v], graph.kind[v])
        counts[c] = counts.get(c, 0) + 1
    return counts


CLASSES = ("gemm", "convolution", "attention", "elementwise", "reduction", "embedding", "optimizer", "copy", "view",
           "other")


def simulated_by_class(p: Any) -> dict[str, float]:
    """Seconds per op class of a one-device plan's step as simulated: each node's cost (profiled, or analytic
    where the table lacks it) on the plan's device, less the per-op overhead the cost model adds to each op that
    is not a view (what the ops themselves were measured at)."""
    from devplace.hardware.cost import op_class

    speed = p.cluster.devices[0].speed
    op_s = float(p.graph.meta.get("cost", {}).get("op_overhead_s", 0.0))
    out: dict[str, float] = {}
    for v in range(p.graph.num_nodes):
        c = op_class(p.graph.op[v], p.graph.kind[v])
        out[c] = out.get(c, 0.0) + float(p.graph.compute_s[v]) / speed - (op_s if c != "view" else 0.0)
    return out


def in_step_by_class(p: Any, module: nn.Module, inputs: Any, steps: int = 3) -> dict[str, float]:
    """CPU seconds per op class of one real step of plan `p` (placed as `devplace run` places it), averaged over
    `steps` steps: each ATen op that the step dispatches (forward as the placed module runs it, backward, the
    optimizer's) timed by this thread's CPU clock (`time.thread_time_ns`) around its call, so that other
    processes on the cores do not count (torch.profiler's self times are wall-clock); an op under an optimizer's
    `step` is of class optimizer, as the capture marks it. "ATen ops": their total. The timer adds about a
    microsecond to each op it times (reading the clock), and its own Python runs outside the timed calls."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from devplace.hardware.cost import op_class
    from devplace.runtime.in_step import TimeEachOp
    from devplace.runtime.run import run_steps

    in_optimizer = [False]
    out: dict[str, float] = {}

    def record(func: Any, args: Any, kwargs: Any, seconds: float) -> None:
        c = op_class(func.__name__.split(".")[0], "optimizer" if in_optimizer[0] else "")
        out[c] = out.get(c, 0.0) + seconds / steps

    placed = p.apply(module, ["cpu"], example_inputs=inputs)
    run_steps(placed, inputs, steps=1, warmup=1, optimizer="adam", loss_fn=p.loss_fn)
    pre = register_optimizer_step_pre_hook(lambda *_: in_optimizer.__setitem__(0, True))
    post = register_optimizer_step_post_hook(lambda *_: in_optimizer.__setitem__(0, False))
    try:
        with TimeEachOp(record):
            run_steps(placed, inputs, steps=steps, warmup=0, optimizer="adam", loss_fn=p.loss_fn)
    finally:
        pre.remove()
        post.remove()
    out["ATen ops"] = sum(out.values())
    return out


def in_step_table(graph: Any, name: str, batch: int) -> Any:
    """Custom model `name`'s ops (those of its captured step `graph` at `batch`) timed inside real training steps
    on one device (`devplace profile --in-step`'s measurement, `runtime.in_step.profile_in_step`), on a model
    built afresh: a run of its own, apart from the measured steps."""
    from devplace.capture.custom import build_named_model
    from devplace.capture.profile import local_cpu_device
    from devplace.runtime.in_step import profile_in_step

    module, inputs, loss_fn = build_named_model(name, batch)
    return profile_in_step(graph, module, inputs, local_cpu_device(), loss_fn=loss_fn)


def resimulated(p: Any, table: Any, cluster: Any) -> float:
    """Plan `p`'s step simulated again with cost table `table` and its overheads on `cluster`: one device, the
    sum of its op times; a pipelined plan, its exported stages under its schedule (as `export` simulates them)."""
    from devplace.hardware.cost import apply_costs, apply_overheads
    from devplace.runtime.export import pipeline_split

    graph, report = apply_costs(p.graph, cluster.devices[0], table)
    if p.placement.schedule is None:
        return report.total_s
    split = pipeline_split(graph, p.placement, apply_overheads(cluster, table), schedule=p.placement.schedule)
    return float(split.pipelined_step_time_s)


def interpreter_cost(p: Any, module: nn.Module, inputs: Any, repeats: int = 20) -> dict[str, float]:
    """What the placed module's interpreter (`runtime.apply`, how `devplace run --plan` runs a one-device plan)
    adds to the forward: "calls", the calls of the traced program it runs (one per traced ATen call, views and
    `getitem` included, which the captured graph folds), and "call_s", (median CPU seconds of the placed forward -
    those of the module's own forward) / calls, both without grad, `repeats` times after 3 untimed."""
    from devplace.runtime.apply import trace_forward

    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else \
        (tuple(inputs), {}) if isinstance(inputs, tuple | list) else ((inputs,), {})
    calls = sum(1 for n in trace_forward(module, args, kwargs).gm.graph.nodes if n.op == "call_function")
    placed = p.apply(module, ["cpu"], example_inputs=inputs)

    def cpu(fn: Any) -> float:
        times = []
        with torch.no_grad():
            for i in range(repeats + 3):
                t0 = time.thread_time()
                fn(*args, **kwargs)
                if i >= 3:
                    times.append(time.thread_time() - t0)
        return statistics.median(times)

    return {"calls": calls, "call_s": (cpu(placed) - cpu(module)) / calls}


def run_model_case(label: str, name: str, batch: int, args: argparse.Namespace, folder: Path,
                   overheads: dict[str, Any]) -> list[dict[str, Any]]:
    """Profile, plan and run custom model `name` (table label `label`) at `batch` on one device and as a 2-process
    pipeline, costed with its op times profiled as `args.profile` says and the machine's overheads measured the
    same way (`overheads`: profile -> `hardware.cost.Overheads`, measured once per run on the probe model); each
    row also has the same plan simulated with the other profile ("other_simulated_s"); one row per setting."""
    from devplace import app
    from devplace.graph.phases import accumulation, scales_gradients
    from devplace.hardware.cost import apply_overheads, op_class, signature_key
    from devplace.runtime.export import pipeline_split
    from devplace.runtime.in_step import merge_tables
    from devplace.runtime.run import local_cluster
    from devplace.sim import simulate

    tasks = app.torch_tasks()
    m = args.microbatches
    t0 = time.perf_counter()
    profiles = [tasks.profile_model(name, folder / f"{label}-b{b}.costs.json", batch=b, repeats=args.repeats,
                                    threads=args.threads, overheads=False) for b in (batch, batch // m)]
    tables = {"isolated": merge_tables([t for _, t in profiles])}
    in_step_keys: set[str] = set()
    if "in-step" in overheads:
        timed = [in_step_table(g, name, b) for (g, _), b in zip(profiles, (batch, batch // m), strict=True)]
        in_step_keys = {k for t in timed for k in t.entries}
        tables["in-step"] = merge_tables([tables["isolated"], *timed])
    for kind, t in tables.items():
        t.overheads = overheads[kind]
    table = tables[args.profile]
    other = next((k for k in tables if k != args.profile), None)
    profile_s = time.perf_counter() - t0
    cpu = torch.device("cpu")
    rows = []

    # one device
    cluster = apply_overheads(local_cluster([cpu], specs={cpu: table.device}), table)
    prepared = tasks.prepare_model(name, batch=batch, cluster=cluster, costs=table)
    placed = tasks.place_prepared(prepared, cluster, placer="single")
    plan_path = folder / f"{label}-single.plan.json"
    tasks.save_placed_plan(placed, plan_path, model=name, batch=batch)
    p, module, inputs = tasks.plan_for_run(plan_file=plan_path, trust_model=True)
    measured = tasks.run_model(p, module, inputs, "cpu", steps=args.steps, warmup=args.warmup,
                               threads=args.threads)
    ops = _ops_per_step(p.graph)
    by_class = {"simulated": simulated_by_class(p), "in step": in_step_by_class(p, module, inputs)}
    interpreter = interpreter_cost(p, module, inputs)
    sim = float(measured.record["simulated_step_s"])
    charged = sum(1 for v in range(p.graph.num_nodes) if op_class(p.graph.op[v], p.graph.kind[v]) != "view")
    rows.append({"model": label, "setting": "1 device", "batch": batch, "simulated_s": sim, "profile": args.profile,
                 "simulated_without_overheads_s": sim - charged * table.overheads.op_s,  # one device: ops one by one
                 "other_profile": other, "other_simulated_s": other and resimulated(p, tables[other], cluster),
                 "in_step_nodes": sum(1 for x in p.graph.node_extra
                                      if isinstance(x.get("sig"), dict) and signature_key(x["sig"]) in in_step_keys),
                 "measured_s": measured.run.step_time_s, "steps_s": list(measured.run.step_times_s),
                 "spread": measured.run.spread, "fastest_s": min(measured.run.step_times_s),
                 "cpu_s": statistics.median(measured.run.cpu_times_s), "cores_busy": measured.run.cores_busy,
                 "ratio": measured.run.step_time_s / sim, "ops": sum(ops.values()), "ops_by_class": ops,
                 "seconds_by_class": by_class, "interpreter": interpreter,
                 "profiled_signatures": len(table), "skipped_signatures": len(table.skipped),
                 "profile_s": profile_s})

    # two processes, one stage each, gloo: each schedule of --schedule (zero-bubble with one chunk: ZB-H1)
    cluster2 = apply_overheads(local_cluster([cpu, cpu], specs={cpu: table.device}), table)
    prepared2 = tasks.prepare_model(name, batch=batch, cluster=cluster2, costs=table)
    for kind in args.schedule.split(","):
        placed2 = tasks.place_prepared(prepared2, cluster2, placer="pipeline",
                                       settings={"schedule": kind, "microbatches": m, "chunks": 1})
        plan_path = folder / f"{label}-pipeline-{kind}.plan.json"
        tasks.save_placed_plan(placed2, plan_path, model=name, batch=batch)
        p2, module2, inputs2 = tasks.plan_for_run(plan_file=plan_path, trust_model=True)
        ran = tasks.run_plan_pipelined(p2, module2, inputs2, steps=args.steps, warmup=args.warmup)
        sim2 = float(ran.export.doc["pipelined_step_time_s"])
        timed = ran.timed_s
        med = statistics.median(timed)
        median_step = sorted(range(len(timed)), key=timed.__getitem__)[len(timed) // 2]  # of the timed steps
        stages = [sum(1 for d in p2.runtime_placement.assignment.values() if d == s) for s in range(2)]
        # the stages the runtime runs (the export's split, which may move ops off the placement's cut), simulated
        split = pipeline_split(p2.graph, p2.placement, p2.cluster, schedule=p2.placement.schedule)
        res2 = simulate(p2.graph, p2.cluster, split.placement, schedule=split.schedule)
        rows.append({"model": label, "setting": f"2-proc {kind} M={m}", "batch": batch, "simulated_s": sim2,
                     "profile": args.profile, "other_profile": other,
                     "other_simulated_s": other and resimulated(p2, tables[other], cluster2),
                     "same_profile_resimulated_s": resimulated(p2, table, cluster2),
                     "measured_s": med, "steps_s": timed, "spread": (max(timed) - min(timed)) / med,
                     "fastest_s": min(timed), "ratio": med / sim2, "cores_busy": ran.cores_busy,
                     "cpu_s": statistics.median(ran.run.cpu_times_s[args.warmup:]),
                     "cpu_by_process_s": [statistics.median(c[args.warmup:]) for c in ran.run.process_cpu_times_s],
                     "split_points": list(ran.export.split_points),
                     "simulated_busy_s": [float(x) for x in res2.device_busy_s],
                     "simulated_transfers": len(res2.transfers.nbytes), "simulated_comm_bytes": res2.comm_bytes,
                     # of the busy time: the adds of micro-batches 2..M's gradients into .grad and a mean loss's
                     # division of them by M (graph.phases, gradient accumulation)
                     "simulated_accumulation_s": float(accumulation(p2.graph).compute_s.sum()) * (m - 1)
                     / table.device.speed,
                     "simulated_division_s": float(accumulation(p2.graph).scale_s.sum()) / table.device.speed
                     if m > 1 and scales_gradients(p2.graph) else 0.0,
                     "ops_per_stage": stages, "loss": ran.run.losses[0], "reference_loss": ran.reference_loss,
                     # the timed steps, action by action, per process (the median's index), and the simulated one
                     # per device
                     "timelines": [t[ran.warmup:] for t in ran.run.timelines], "median_step": median_step,
                     "simulated_timeline": simulated_timeline(res2, p2.graph)})
    return rows


def simulated_timeline(res: Any, graph: Any) -> list[list[tuple[str, float, float, float]]]:
    """Per device of pipelined result `res` (a `ScheduledResult` of `graph`), what the simulation has it do, named
    as the runtime's timelines name it (`PipelineRun.timelines`): each action "<stage><F|B><micro-batch>" from its
    first op's start to its last op's finish, with the seconds its ops ran (the simulation may run another
    action's ops in between), and the per-step ops (the optimizer, the division by M) as "update"; in order of
    start."""
    spans: dict[tuple[int, str], list[float]] = {}
    for v in range(graph.num_nodes):
        d, s = int(res.device[v]), int(res.stage[v])
        if s < 0:
            runs = [("update", float(res.start_s[v]), float(res.finish_s[v]))]
        else:
            kind = "B" if graph.kind[v] == "backward" else "F"
            runs = [(f"{s}{kind}{m}", float(res.microbatch_start_s[m, v]), float(res.microbatch_finish_s[m, v]))
                    for m in range(res.microbatch_start_s.shape[0])]
        for what, a, b in runs:
            if b > a:  # a view costs nothing and says nothing of when its action runs
                span = spans.setdefault((d, what), [a, b, 0.0])
                span[0], span[1], span[2] = min(span[0], a), max(span[1], b), span[2] + b - a
    devices = int(res.device.max()) + 1
    return [sorted(((w, a, b, busy) for (dd, w), (a, b, busy) in spans.items() if dd == d), key=lambda x: x[1])
            for d in range(devices)]


def action_totals(spans: list[Any]) -> dict[str, float]:
    """CPU seconds of one process's step (or a simulated device's busy seconds) in its forwards (with the loss),
    its backwards, the update, and the wall seconds it spent handing sends and receives to gloo and waiting for
    them."""
    out = {"F": 0.0, "B": 0.0, "update": 0.0, "wait": 0.0}
    for what, a, b, seconds in spans:
        key = ("wait" if what in ("post", "wait") else what if what == "update" else "F" if what == "loss"
               else "B" if what[1:2] in "BIW" else "F")
        out[key] += (b - a) if key == "wait" else seconds
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for profiling and the one-device steps")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per op when profiling")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedules, comma-separated (gpipe, 1f1b, zero-bubble: "
                                                       "one chunk per process), a row each")
    ap.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    ap.add_argument("--model", action="append", default=[], metavar="package.module:factory",
                    help="also any custom model (repeatable): a factory taking batch= and returning (module, "
                         "inputs[, loss_fn]), importable here and in the stage processes")
    ap.add_argument("--batch", type=int, default=8, help="batch of the --model ones (the micro-batches divide it)")
    ap.add_argument("--no-overheads", action="store_true", help="simulate without the measured overheads")
    ap.add_argument("--profile", choices=("in-step", "isolated"), default="in-step",
                    help="the op times plans are made and simulated with: timed inside real steps of each model, "
                         "in a run of their own (`devplace profile --in-step`, default), or alone (`devplace "
                         "profile`); each row also shows the same plan simulated with the isolated times")
    args = ap.parse_args(argv)
    labels = [s.strip() for s in args.models.split(",") if s.strip()]
    unknown = [s for s in labels if s not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    cases = [(label, *MODELS[label]) for label in labels]
    cases += [(spec.rpartition(":")[2], spec, args.batch) for spec in args.model]
    from devplace.app.overheads import gloo_round_trip, measure_overheads
    from devplace.hardware.cost import Overheads

    torch.set_num_threads(args.threads)
    started = datetime.datetime.now().astimezone()
    load_before = _uptime()
    cpu0 = time.process_time()
    kinds = ("isolated", "in-step") if args.profile == "in-step" else ("isolated",)
    runs = {k: None if args.no_overheads else measure_overheads(steps=args.steps, warmup=args.warmup,
                                                                microbatches=args.microbatches, repeats=args.repeats,
                                                                in_step=k == "in-step") for k in kinds}
    overheads = {k: r.overheads if r is not None else Overheads() for k, r in runs.items()}
    print(f"# overheads: {overheads}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sim-vs-real-") as tmp:
        for label, name, batch in cases:
            t0 = time.perf_counter()
            rows += run_model_case(label, name, batch, args, Path(tmp), overheads)
            print(f"# {label} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    gloo = gloo_round_trip([1, 2**10, 2**14, 2**17])
    load_after = _uptime()
    from devplace.capture.profile import measure_local_cpu

    cpu = measure_local_cpu()
    print(f"# measured vs simulated training steps, {started:%Y-%m-%d %H:%M %Z}")
    print(f"# machine: {platform.node()}, {cpu.model}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"{args.threads} thread(s) per process (profile and steps); CPU as measured: "
          f"{cpu.peak_flops / 1e9:.1f} GFLOP/s, {cpu.mem_bandwidth_Bps / 1e9:.1f} GB/s, one-element add "
          f"{cpu.launch_overhead_s * 1e6:.1f} us")
    print(f"# load before: {load_before}")
    print(f"# load after:  {load_after}")
    print(f"# this process's CPU time: {time.process_time() - cpu0:.0f} s")
    for kind, measured in runs.items():
        o = overheads[kind]
        print(f"# overheads beyond ops timed {kind} (measured on the probe model"
              f"{'' if measured else ', NOT: --no-overheads'}): {o.op_s * 1e6:.1f} us per op, "
              f"{o.action_s * 1e3:.2f} ms per pipeline action, {o.transfer_latency_s * 1e6:.0f} us per transfer"
              + (f" (probe: 1 device {measured.one_device_cpu_s * 1e3:.2f} CPU-ms vs "
                 f"{measured.one_device_simulated_s * 1e3:.2f} simulated over {measured.ops} ops; pipeline "
                 f"{measured.pipeline_measured_s * 1e3:.2f} ms measured; {measured.wall_s:.0f} s)"
                 if measured else ""))
    print(f"# {args.steps} timed steps after {args.warmup} warm-up; isolated profile: median of {args.repeats} "
          "runs per op" + ("; in-step profile (plans made and simulated with it): each op's mean thread CPU time "
                           "over 5 real steps (after 3) of the model on one device, a run of its own at each batch "
                           "size, apart from the measured steps" if args.profile == "in-step" else ""))
    print()
    other = next((r["other_profile"] for r in rows if r.get("other_profile")), None)
    print(f"| model | setting | simulated ({args.profile}) | measured (median) | spread | fastest | measured / "
          "simulated | cores busy | CPU time (median) | CPU time / simulated | measured / simulated without "
          "overheads |" + (f" simulated ({other}) | measured / simulated ({other}) | CPU time / simulated ({other}) |"
                           if other else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if other else ""))
    for r in rows:
        one = r["setting"] == "1 device"
        plain = r.get("simulated_without_overheads_s")
        alt = r.get("other_simulated_s")
        print(f"| {r['model']} | {r['setting']} | {_ms(r['simulated_s'])} | {_ms(r['measured_s'])} | "
              f"{r['spread']:.0%} | {_ms(r['fastest_s'])} | {r['ratio']:.2f} | {r['cores_busy']:.2f} | "
              f"{_ms(r['cpu_s'])}{'' if one else ' (2 procs)'} | "
              + (f"{r['cpu_s'] / r['simulated_s']:.2f} |" if one else "- |")
              + (f" {r['measured_s'] / plain:.2f} |" if plain else " - |")
              + (f" {_ms(alt)} | {r['measured_s'] / alt:.2f} | "
                 + (f"{r['cpu_s'] / alt:.2f} |" if one else "- |") if alt else ""))
    print()
    print("| model | ops per step | (measured - simulated) / op, 1 device | pipeline split | ops per stage | "
          "pipeline: simulated busy (2 devices) | of which gradient adds / division by M | measured CPU (2 procs) | "
          "CPU / simulated busy | per process: CPU / simulated busy of its device | transfers per step |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---|---:|")
    ones = {r["model"]: r for r in rows if r["setting"] == "1 device"}
    for two in (r for r in rows if r["setting"] != "1 device"):
        one = ones[two["model"]]
        per_op = (one["measured_s"] - one["simulated_s"]) / one["ops"]
        busy = sum(two["simulated_busy_s"])
        print(f"| {one['model']} {two['setting']} | {one['ops']} | {per_op * 1e6:.1f} us | "
              f"{', '.join(two['split_points'])} | "
              f"{two['ops_per_stage']} | {_ms(busy)} | {_ms(two['simulated_accumulation_s'])} / "
              f"{_ms(two['simulated_division_s'])} | "
              f"{_ms(two['cpu_s'])} | {two['cpu_s'] / busy:.2f} | "
              + ", ".join(f"{_ms(c)} / {_ms(b)}" for c, b in zip(two["cpu_by_process_s"], two["simulated_busy_s"],
                                                                   strict=False))
              + f" | {two['simulated_transfers']} |")
    print()
    print("Pipelines action by action (`PipelineRun.timelines`): per process, the CPU ms its thread spent in the "
          "forwards (with the loss), the backwards and the update of the median step, against the seconds the "
          "simulation has its device's ops run in them; waits: the wall ms it waited for sends and receives (the "
          "simulation: its device's idle ms); forwards per step: the forwards' CPU ms in the fastest and the slowest "
          "timed step (the same work: how much the machine's speed moved during the run)")
    print()
    print("| model | process | forwards: measured / simulated | backwards | update | waits | forwards per step, "
          "fastest - slowest |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for two in (r for r in rows if r["setting"] != "1 device"):
        for proc, (steps, sim) in enumerate(zip(two["timelines"], two["simulated_timeline"], strict=True)):
            real = steps[two["median_step"]]
            m, s = action_totals(real), action_totals(sim)
            idle = two["simulated_s"] - s["F"] - s["B"] - s["update"]
            per_step = [action_totals(t)["F"] for t in steps]
            print(f"| {two['model']} {two['setting']} | {proc} | "
                  + " | ".join(f"{_ms(m[k])} / {_ms(s[k])} ({m[k] / s[k]:.2f})" for k in ("F", "B", "update"))
                  + f" | {_ms(m['wait'])} / {_ms(idle)} | {_ms(min(per_step))} - {_ms(max(per_step))} |")
    print()
    print(f"One device, CPU ms per step by op class: simulated ({args.profile} op times, without the per-op "
          "overhead) / "
          "in a real step (each ATen op's CPU time, `in_step_by_class`; 'outside': the median step's CPU time less "
          "those: Python, the placed module's interpreter, nn.Module calls, the autograd engine between ops)")
    print()
    print("| model | " + " | ".join(CLASSES) + " | outside ATen ops | ops (not views) | traced calls | interpreter "
          "per call |")
    print("|---|" + "---:|" * (len(CLASSES) + 4))
    for r in ones.values():
        sim_c, real_c = r["seconds_by_class"]["simulated"], r["seconds_by_class"]["in step"]
        cells = [f"{sim_c.get(c, 0) * 1e3:.1f} / {real_c.get(c, 0) * 1e3:.1f}" if c in sim_c or c in real_c else "-"
                 for c in CLASSES]
        outside = r["cpu_s"] - real_c["ATen ops"]
        charged = r["ops"] - r["ops_by_class"].get("view", 0)
        print(f"| {r['model']} | " + " | ".join(cells) + f" | {outside * 1e3:.1f} | {charged} | "
              f"{r['interpreter']['calls']} | {r['interpreter']['call_s'] * 1e6:.1f} us |")
    print()
    print("# gloo send + recv round trip between two processes (median of 50): "
          + ", ".join(f"{int(n) * 4} B {t * 1e6:.0f} us" for n, t in gloo.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"started": started.isoformat(), "load_before": load_before,
                                         "load_after": load_after, "threads": args.threads, "cpu": cpu.model,
                                         "profile": args.profile,
                                         "overheads": {k: o.to_dict() for k, o in overheads.items()},
                                         "overheads_measured": {k: r.to_dict() if r else None
                                                                for k, r in runs.items()},
                                         "gloo_round_trip_s": gloo, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

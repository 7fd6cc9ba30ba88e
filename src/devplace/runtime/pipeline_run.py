"""Run a pipeline export for real: `torch.distributed.pipelining` stages in CPU processes with gloo
(docs/runtime.md, "Pipelined runs").

`run_pipeline(module, inputs, export)` traces the module once, split at the export's split points
(`pipeline()` with `SplitPoint.BEGINNING`), starts one process per stage (`torch.multiprocessing`'s
forkserver, a `file://` rendezvous in a temporary folder, the gloo backend), sends each its stage (pickled
by `_StagePickler`), and runs training steps under the export's schedule (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B` or `ScheduleInterleavedZeroBubble`, M micro-batches; zero bubble's split backward as
`split_backward` makes it give every gradient): forward and backward of every micro-batch, then the gradients of a
parameter held by several stages (tied weights: GPT-2's `wte` and `lm_head`) summed across those stages,
then the optimizer step on each stage.

The inputs go to the first stage as keyword arguments, and the traced forward begins with a view of each, so
a later stage that reads a model input (the labels of the loss the module returns, as the zoo's models do)
receives it from the first stage. torch's runtime sends a value to one stage only, and its interleaved schedules
only to the next stage, so a value read further on (Llama's rotary tables, BART's encoder output, those labels)
is passed on by every stage between (`_relay_skips`; the simulator costs the same hops). Each micro-batch is a
contiguous slice of the batch along dimension 0 of every tensor input.

The pipelined loss of a step is the mean of the micro-batch losses, and the gradients are averaged over the
micro-batches (the schedule's `scale_grads`): the same as one step on the whole batch when the module's loss
is a mean over equal-size micro-batches, which is why the batch must divide into M equal micro-batches. A
loss that is a sum over the batch is `loss_reduction="sum"`. Batch normalisation computes its statistics per
micro-batch, so such a model does not match its unpipelined step (that is pipelining, not this runner).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import io
import os
import pickle
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from devplace.errors import DevplaceError
from devplace.graph.schedule import stage_position
from devplace.runtime.export import PipelineExport, read_pipeline
from devplace.runtime.run import cpu_autocast
from devplace.sim.schedule import SPLIT_KINDS, V_SHAPED, Schedule

__all__ = ["TIMELINE_OTHER", "PipelineRun", "PipelineRunError", "accumulated_step", "one_core_each", "run_pipeline",
           "stage_ranks", "torch_schedule"]

# interleaved-1f1b and zero-bubble: V stages per process, stage s on process s mod p; zbv and dualpipev: two, in
# a V (`stage_ranks`)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", *V_SHAPED)


# a timeline's spans that are not compute actions: the loss, handing sends and receives to gloo, waiting for them
# to finish, the update (tied gradients and the optimizer)
TIMELINE_OTHER = ("loss", "post", "wait", "update")


class PipelineRunError(DevplaceError):
    """A pipeline export cannot run on this module and inputs (the message says why)."""


@dataclass
class PipelineRun:
    """Pipelined training steps: the loss of each step (before its optimizer update), each step's wall-clock
    seconds (the slowest process) and CPU seconds (`time.process_time`, summed over the processes; each
    process's own in `process_cpu_times_s`, by rank), the parameter
    gradients of the first step by name (every name of the
    module, tied names included; only with `return_grads=True`), the schedule and the number of processes; and
    under the schedules torch runs from an action list (interleaved 1F1B, zero bubble, ZBV, DualPipeV), per
    process the compute actions it ran, in order, as torch writes them ("2F0": stage 2's forward of micro-batch
    0; "I" input and "W" weight gradients, "B" a whole backward; DualPipeV's overlapped pair as its two), and
    per process and step the timeline of what it did (`timelines`)."""

    losses: list[float]
    step_times_s: list[float]
    schedule: Schedule
    processes: int
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    cpu_times_s: list[float] = field(default_factory=list)
    actions: list[list[str]] = field(default_factory=list)
    process_cpu_times_s: list[list[float]] = field(default_factory=list)
    # per process, per step, what it spent the step on: (what, start, end, CPU seconds of its thread), start and
    # end in seconds from the step's start (`_timeline`): compute actions as torch names them ("1F3", "0B2", "0I1",
    # "0W1"), and the spans of `TIMELINE_OTHER`
    timelines: list[list[list[tuple[str, float, float, float]]]] = field(default_factory=list)

    @property
    def step_time_s(self) -> float:
        """Median of the steps."""
        return statistics.median(self.step_times_s)


def stage_ranks(kind: str, stages: int, processes: int) -> list[int]:
    """The process (pipeline position, `graph.schedule.stage_position`) of each of `stages` stages under schedule
    `kind`: stage s on process s mod p, or in a V (zbv, dualpipev: stages s and 2p - 1 - s on process s)."""
    return [stage_position(kind, s, processes) for s in range(stages)]


def _named_inputs(module: nn.Module, inputs: Any) -> dict[str, Any]:
    """The inputs as keyword arguments of `module.forward` (positional ones bound to their parameter names)."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    args = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    sig = inspect.signature(module.forward)
    if any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        raise PipelineRunError(f"{type(module).__name__}.forward takes *args; a pipelined run passes the inputs to "
                               "every stage by name, so give them as a dict of keyword arguments")
    try:
        return dict(sig.bind(*args).arguments)
    except TypeError as exc:
        raise PipelineRunError(f"the inputs do not fit {type(module).__name__}.forward: {exc}") from None


def _microbatches(kwargs: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """`m` equal slices of every tensor input along dimension 0 (other inputs repeated)."""
    sizes = {k: v.shape[0] for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise PipelineRunError("no tensor input has a batch dimension to cut into micro-batches")
    batch = set(sizes.values())
    if len(batch) != 1:
        raise PipelineRunError(f"the tensor inputs disagree on the batch size (dimension 0): {sizes}")
    b = batch.pop()
    if b % m:
        raise PipelineRunError(f"batch {b} does not divide into {m} equal micro-batches; use a batch that is a "
                               f"multiple of {m} or another number of micro-batches (devplace export --microbatches)")
    return [{k: (v[i * (b // m):(i + 1) * (b // m)] if k in sizes else v) for k, v in kwargs.items()}
            for i in range(m)]


def _fed_from_first_stage(module: nn.Module) -> None:
    """Make every tensor input of `module` a value of the first stage: its forward now begins with a view of
    each tensor input, so a later stage that reads an input (the labels of the loss) receives it from the
    first stage like any activation (the pipelining runtime feeds model inputs to the first stage only)."""
    forward = module.forward

    @functools.wraps(forward)  # keeps the signature: torch.export names the inputs after it
    def fed(*args: Any, **kwargs: Any) -> Any:
        def own(x: Any) -> Any:
            return x.view_as(x) if isinstance(x, torch.Tensor) else x

        return forward(*(own(a) for a in args), **{k: own(v) for k, v in kwargs.items()})

    module.forward = fed  # type: ignore[method-assign]


def _trace(module: nn.Module, export: PipelineExport, mb_kwargs: dict[str, Any],
           autocast: torch.dtype | None = None) -> Any:
    from torch.distributed.pipelining import pipeline

    split = copy.deepcopy(module)  # pipeline() annotates the module it is given
    _fed_from_first_stage(split)
    try:
        with cpu_autocast(autocast):  # the casts autocast makes are traced; its leaf modules keep it (`autocast_stage`)
            pipe = pipeline(split, mb_args=(), mb_kwargs=mb_kwargs, split_spec=export.split_spec())
    except Exception as exc:  # torch.export's errors are of many types; its first line says what failed
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineRunError(f"{type(module).__name__} cannot be split for pipelining (torch.export could not "
                               f"trace it, or a split point is not a module it calls): {type(exc).__name__}: "
                               f"{first}") from exc
    if pipe.num_stages != export.num_stages:
        raise PipelineRunError(f"splitting {type(module).__name__} at {', '.join(export.split_points)} gave "
                               f"{pipe.num_stages} stages, not the export's {export.num_stages}: a split point "
                               "module is never called, or called twice")
    _relay_skips(pipe)
    for i in range(pipe.num_stages):
        _contiguous_boundaries(pipe.get_stage_module(i))
    return pipe


def autocast_stage(mod: nn.Module, dtype: torch.dtype | None) -> None:
    """Run stage module `mod`'s forward under the CPU's autocast to `dtype` (None: as it is): a stage traced under
    autocast keeps the modules it calls (a Linear), whose outputs are in the autocast dtype only when they run
    under it again, as the capture and the one-process step ran them."""
    if dtype is None:
        return
    forward = mod.forward

    def cast(*args: Any, **kwargs: Any) -> Any:
        with cpu_autocast(dtype):
            return forward(*args, **kwargs)
    mod.forward = cast  # type: ignore[method-assign]


def stage_loss(loss_fn: Callable[[Any], torch.Tensor] | None,
               autocast: torch.dtype | None) -> Callable[[Any, Any], torch.Tensor]:
    """The loss a pipelining schedule calls on the last stage's output: `loss_fn` (default: `default_loss`)
    under the CPU's autocast to `autocast` (None: none), as the capture computed it, summed to one value."""
    from devplace.capture.torch_capture import default_loss

    loss_of = loss_fn or default_loss

    def loss(output: Any, _target: Any) -> torch.Tensor:
        with cpu_autocast(autocast):
            value = loss_of(output)
        return value if value.numel() == 1 else value.sum()
    return loss


def _relay_skips(pipe: Any) -> None:
    """Make every stage send only to the next one: a value that a later, non-adjacent stage reads (Llama's
    rotary tables, BART's encoder output, the labels the last stage's loss reads), or that two later stages
    read, is passed on by every stage between, which takes it as one more input and returns it as one more
    output (a view, so its gradient flows back the same way). torch's runtime has no backward for a value
    sent to several stages ('Backward of skip connections not supported yet') and its interleaved schedules
    no sends past the next stage. `devplace.sim.schedule.relay` costs the same hops."""
    import operator

    graph: torch.fx.Graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    index = {c: i for i, c in enumerate(calls)}

    def source(arg: torch.fx.Node) -> int | None:
        while arg.op == "call_function" and arg.target is operator.getitem:
            arg = arg.args[0]  # type: ignore[assignment]
        return index.get(arg)

    def outputs(i: int) -> tuple[torch.fx.Graph, torch.fx.Node, list[Any]]:
        sub = pipe.split_gm.get_submodule(calls[i].target).graph
        out = next(n for n in sub.nodes if n.op == "output")
        vals = out.args[0]
        return sub, out, list(vals) if isinstance(vals, tuple | list) else [vals]

    def pass_on(i: int, arg: torch.fx.Node, val: Any) -> torch.fx.Node:
        """Stage i takes `arg` (a value of stage i-1, or stage i-1's copy of it) and returns it; its copy."""
        call = calls[i]
        sub, out, vals = outputs(i)
        holders = [n for n in sub.nodes if n.op == "placeholder"]
        if arg in call.args:
            ph = holders[list(call.args).index(arg)]
        else:
            with sub.inserting_after(holders[-1] if holders else None):
                ph = sub.placeholder(f"relayed_{len(holders)}")
            ph.meta["val"] = val
            call.args = (*call.args, arg)
        with sub.inserting_before(out):
            copy_ = sub.call_method("view_as", (ph, ph))
        copy_.meta["val"] = val
        single = not isinstance(out.args[0], tuple | list)
        out.args = ((*vals, copy_),)
        if single:  # the outer graph used the call itself as its one output: it is item 0 now
            with graph.inserting_after(call):
                first = graph.call_function(operator.getitem, (call, 0))
            call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
        with graph.inserting_after(call):
            item = graph.call_function(operator.getitem, (call, len(vals)))
        return item

    copies: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}  # (value, stage) -> the node stage i-1 sends
    for k, call in enumerate(calls):
        relayed: dict[int, torch.fx.Node] = {}
        for j, arg in enumerate(call.args):
            src = source(arg) if isinstance(arg, torch.fx.Node) else None
            if src is None or src >= k - 1:
                continue
            sub = pipe.split_gm.get_submodule(call.target).graph
            val = [n for n in sub.nodes if n.op == "placeholder"][j].meta.get("val")
            held = arg
            for i in range(src + 1, k):
                if (arg, i) not in copies:
                    copies[(arg, i)] = pass_on(i, held, val)
                held = copies[(arg, i)]
            relayed[j] = held
        # read the arguments again: passing a value on can have renamed one (a call's output became its item 0)
        call.args = tuple(relayed.get(j, a) for j, a in enumerate(call.args))
    for call in calls[1:]:
        _inputs_in_send_order(pipe.split_gm.get_submodule(call.target).graph, call)
    graph.lint()
    for call in calls:
        pipe.split_gm.get_submodule(call.target).recompile()
    pipe.split_gm.recompile()


def _inputs_in_send_order(sub: torch.fx.Graph, call: torch.fx.Node) -> None:
    """Order a stage's inputs (its placeholders and the call's arguments alike) as the previous stage sends them:
    the runtime sends a stage's outputs in output order and receives in input order, and gloo matches the
    messages between two processes in order, so the two orders must agree (model inputs first)."""
    import operator

    def sent_as(arg: Any) -> int:
        if isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is operator.getitem:
            return int(arg.args[1])  # type: ignore[arg-type]
        return 0 if isinstance(arg, torch.fx.Node) and arg.op == "call_module" else -1

    holders = [n for n in sub.nodes if n.op == "placeholder"]
    order = sorted(range(len(holders)), key=lambda j: (sent_as(call.args[j]), j))
    if order == list(range(len(holders))):
        return
    body = next(n for n in sub.nodes if n.op != "placeholder")
    for j in order:
        body.prepend(holders[j])
    call.args = tuple(call.args[j] for j in order)


def _contiguous_boundaries(stage: torch.fx.GraphModule) -> None:
    """Make every tensor a stage sends or receives contiguous: the runtime receives into a buffer with the traced
    strides, and gloo refuses a non-contiguous one ('input tensor has to be contiguous': T5's transposed
    position bias, a permuted attention output). Outputs go through `.contiguous()`; inputs are expected so."""
    graph = stage.graph
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and not val.is_contiguous():
            node.meta["val"] = val.contiguous()
    out = next(n for n in graph.nodes if n.op == "output")

    def contiguous(arg: Any) -> Any:
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.is_contiguous():
            return arg
        with graph.inserting_before(out):
            made = graph.call_method("contiguous", (arg,))
        made.meta["val"] = val.contiguous()
        return made

    out.args = torch.fx.node.map_arg(out.args, contiguous)
    stage.recompile()


@dataclass(frozen=True)
class _Job:
    """What every process of a multi-process run needs (pickled by torch.multiprocessing): a pipeline's
    (`run_pipeline`, one replica) or a dp x pp parallel plan's (`parallel_run.run_parallel`). `stages[i]` is stage
    i's module with the pipeline's graph, serialised by `_dump_stage`; replica r's processes are r * pp to
    r * pp + pp - 1, stage i on the replica's process `stage_ranks(...)[i]` (i mod pp, or in a V)."""

    folder: str
    stages: list[bytes]
    pp: int  # processes per replica
    tied: list[list[tuple[int, str]]]  # per tied parameter: (stage, name in that stage), by stage
    schedule: Schedule
    microbatches: list[list[dict[str, Any]]]  # per replica, its micro-batches
    steps: int
    optimizer: str
    loss_fn: Callable[[Any], torch.Tensor] | None
    loss_reduction: str
    return_grads: bool
    seed: int
    timeout_s: float
    autocast: torch.dtype | None = None  # the CPU autocast dtype the stages and the loss run under (amp plans)
    zero: tuple[int, ...] = ()  # a parallel plan's ZeRO stage per pipeline position
    recompute: tuple[str | int, ...] = ()  # a parallel plan's recomputation per pipeline position

    @property
    def dp(self) -> int:
        """The number of replicas."""
        return len(self.microbatches)


def _worker(rank: int, body: Callable[[int, Any], None], job: Any) -> None:
    """One process of a multi-process run: `body(rank, job)` (a pipeline's `_stage`, a parallel plan's
    `parallel_run._process`); a failure's traceback is saved where the parent reads it (`_failure`), since the
    processes that lose their peer then fail too, with only a connection error of their own."""
    try:
        body(rank, job)
    except BaseException:
        (Path(job.folder) / f"rank{rank}.err").write_text(traceback.format_exc(), encoding="utf-8")
        raise


def _failure(folder: str, n: int, fallback: str) -> str:
    """The failing stage's own error, with the end of its traceback: the first stage whose error is not a lost
    connection to a peer (gloo's 'Connection reset by peer', 'Connection closed'), else the first that failed."""
    errors = [(r, (Path(folder) / f"rank{r}.err").read_text(encoding="utf-8"))
              for r in range(n) if (Path(folder) / f"rank{r}.err").exists()]
    if not errors:
        return fallback
    lost = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout")
    rank, text = next(((r, t) for r, t in errors if not any(k in t for k in lost)), errors[0])
    lines = text.strip().splitlines()
    frames = [ln.strip() for ln in lines if ln.lstrip().startswith('File "')]
    return f"stage {rank}: {lines[-1]}" + (f" (raised at {frames[-1]})" if frames else "")


def _spawn(entry: Callable[[int, Any], None], job: Any, n: int, failed: str, unit: str) -> None:
    """Run `entry(rank, job)` in `n` processes (`_worker`) and wait for them; a PipelineRunError starting with
    `failed` where one raised (the failing `unit`'s own error, `_failure`) or was killed by a signal (SIGKILL is
    what the kernel's out-of-memory killer sends: every process holds its stages, their activations and
    optimizer state in this machine's memory)."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_worker, args=(entry, job), nprocs=n, join=True, start_method=_start_method())
    except mp.ProcessRaisedException as exc:
        why = _failure(job.folder, n, str(exc).strip().splitlines()[-1]).replace("stage", unit, 1)
        raise PipelineRunError(f"{failed}, {why}") from exc
    except mp.ProcessExitedException as exc:
        killed = f" by signal {exc.signal_name}" if exc.signal_name else f" with exit code {exc.exit_code}"
        hint = (": out of memory? run a smaller batch (--batch, --seq-len) or fewer processes"
                if exc.signal_name == "SIGKILL" else "")
        raise PipelineRunError(f"{failed}: {unit} process {exc.error_index} ended{killed}{hint}") from exc


def one_core_each(rank: int, processes: int) -> None:
    """Run process `rank` of `processes` (a stage's, a replica's) on one thread, and on cores of its own where the
    machine lets this process use at least one per process (Linux's `sched_setaffinity`; the cores split in
    order): each stage on a device of its own, as simulated. Unpinned on this 2-core VM, a receive posted after
    its sender had gone back to computing completed 3-4 ms late, against 0.14-0.46 ms pinned: the sender's gloo
    thread, woken to send, waited for its own process's time slice (docs/performance.md, "Action by action")."""
    torch.set_num_threads(1)
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= processes:
        share = len(cores) // processes
        os.sched_setaffinity(0, cores[rank * share:(rank + 1) * share])


def _stage(rank: int, job: _Job) -> None:
    """One process of the pipeline: join the gloo group, build its stages (`stage_ranks`: stage s on process
    s mod p, or in a V), run the steps, save what the parent reads."""
    import torch.distributed as dist
    from torch.distributed.pipelining.stage import _PipelineStage
    from torch.export.unflatten import InterpreterModule

    from devplace.runtime.run import _make_optimizer

    torch.manual_seed(job.seed)
    one_core_each(rank, job.pp)
    world = job.pp
    on = stage_ranks(job.schedule.kind, len(job.stages), world)
    mine = [s for s in range(len(job.stages)) if on[s] == rank]
    loaded = [pickle.loads(job.stages[i]) for i in mine]
    for mod, _ in loaded:
        for sub in mod.modules():  # pipelining's submodules interpret their graph node by node in Python: 20-30 us
            if isinstance(sub, InterpreterModule):  # an op; their generated code instead, as a GraphModule runs
                sub._run_with_interpreter = False
    dist.init_process_group("gloo", init_method=f"file://{job.folder}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.timeout_s))
    try:
        # every process creates every group, in the same order (new_group is collective); a tie held by one
        # stage only (T5's encoder and decoder embeddings, both before the cut) needs no group
        ties = []
        for users in job.tied:
            ranks = sorted({on[s] for s, _ in users})
            ties.append((dist.new_group(ranks) if len(ranks) > 1 else None,
                         [(s, n) for s, n in users if on[s] == rank]))
        # what Pipe.build_stage does, from the stage module and graph it sent (on the CPU, where they were traced)
        for mod, _ in loaded:
            autocast_stage(mod, job.autocast)
        stages = [_PipelineStage(mod, i, info, torch.device("cpu"))
                  for i, (mod, info) in zip(mine, loaded, strict=True)]
        spans: list[tuple[str, float, float, float]] = []
        sched = torch_schedule(job.schedule.kind, stages, job.schedule.microbatches,
                               _timed(stage_loss(job.loss_fn, job.autocast), "loss", spans),
                               job.loss_reduction == "mean")
        _timeline(stages, spans)
        order = getattr(sched, "pipeline_order_with_comms", None)  # what its runtime steps through, sends included
        # an overlapped action (DualPipeV's OVERLAP_F_B) as the two it runs, one after the other
        actions = ([str(x) for a in order[rank] if a.is_compute_op for x in (a.sub_actions or (a,))]
                   if order is not None else [])
        params = {(i, n): p for i, (mod, _) in zip(mine, loaded, strict=True) for n, p in mod.named_parameters()}
        # two optimizers (one per parameter: the same steps as one): the parameters of this process alone update
        # while the tied ones' gradients are summed across processes, as simulated (an update waits for its own
        # gradient only)
        tied = {key for _, names in ties for key in names}
        groups = [[p for k, p in params.items() if p.requires_grad and (k in tied) == t] for t in (False, True)]
        opts = [_make_optimizer(job.optimizer, group) if group else None for group in groups]
        m = job.schedule.microbatches
        first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
        losses: list[float] = []
        times: list[float] = []
        cpu_times: list[float] = []
        grads: dict[str, torch.Tensor] = {}
        timelines: list[list[tuple[str, float, float, float]]] = []
        for step in range(job.steps):
            dist.barrier()
            spans.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            mb_losses: list[torch.Tensor] = []
            sched.step(arg_mbs=[()] * m, kwarg_mbs=job.microbatches[0] if first else [{}] * m,
                       target_mbs=[None] * m, losses=mb_losses if first or last else None, return_outputs=False)
            t1, u1 = time.perf_counter(), time.thread_time()
            summing = []
            for group, names in ties:
                if not names:
                    continue
                # a tied parameter's gradient is the sum over its copies, here and in the other stages
                total = sum((params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])
                             for n in names[1:]), start=params[names[0]].grad
                            if params[names[0]].grad is not None else torch.zeros_like(params[names[0]]))
                summing.append((dist.all_reduce(total, group=group, async_op=True) if group is not None else None,
                                total, names))
            if opts[0] is not None:
                opts[0].step()
            for work, total, names in summing:
                if work is not None:
                    work.wait()
                for n in names:
                    params[n].grad = total.clone()
            if step == 0 and job.return_grads:
                grads = {n: p.grad.detach().clone() for (_, n), p in params.items() if p.grad is not None}
            if opts[1] is not None:
                opts[1].step()
            for mod, _ in loaded:
                mod.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            times.append(t2 - t0)
            cpu_times.append(time.process_time() - c0)
            spans.append(("update", t1, t2, time.thread_time() - u1))
            timelines.append([(what, a - t0, b - t0, cpu) for what, a, b, cpu in spans])
            if last:
                total = torch.stack([v.detach() for v in mb_losses]).sum()
                losses.append(float(total / m if job.loss_reduction == "mean" else total))
        torch.save({"losses": losses, "times": times, "cpu_times": cpu_times, "grads": grads, "actions": actions,
                    "timelines": timelines}, Path(job.folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _timed(fn: Callable[..., Any], what: str | Callable[..., str], spans: list[tuple[str, float, float, float]]
           ) -> Callable[..., Any]:
    """`fn`, appending (what, start, end, thread CPU seconds) of each call to `spans` (`what` a name, or made
    from the call's arguments)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        spans.append((what if isinstance(what, str) else what(*args, **kwargs), t0, time.perf_counter(),
                      time.thread_time() - c0))
        return out

    return run


def _timeline(stages: list[Any], spans: list[tuple[str, float, float, float]]) -> None:
    """Record in `spans` what this process's `stages` (torch `_PipelineStage`s, made ready by `torch_schedule`)
    compute, named as torch names the actions ("1F3": stage 1's forward of micro-batch 3; "B" a whole backward,
    "I" input and "W" weight gradients), and each time the schedule hands its sends and receives to gloo ("post")
    and waits for them ("wait"): the measured step, action by action, beside the simulated one. torch's schedules
    call their module's own `_batch_p2p` and `_wait_batch_p2p`, wrapped here (in this process only: each stage
    runs in a process of its own)."""
    from torch.distributed.pipelining import schedules

    for st in stages:
        st.forward_one_chunk = _timed(st.forward_one_chunk, _action_name(st.stage_index, "F"), spans)
        st.backward_one_chunk = _timed(st.backward_one_chunk, _action_name(st.stage_index, "B"), spans)
        st.backward_weight_one_chunk = _timed(st.backward_weight_one_chunk, _action_name(st.stage_index, "W"), spans)
    for attr, what in (("_wait_batch_p2p", "wait"), ("_batch_p2p", "post")):
        fn = getattr(schedules, attr)
        fn = getattr(fn, "__wrapped__", fn)
        setattr(schedules, attr, _timed(fn, what, spans))
        getattr(schedules, attr).__wrapped__ = fn


def _action_name(stage: int, kind: str) -> Callable[..., str]:
    """The name torch gives the action of a call of `stage`'s forward ("F"), backward ("B"; "I" where it computes
    input gradients only) or weight-gradient ("W") method: stage, kind, micro-batch."""

    def name(mb: int, loss: Any = None, full_backward: bool = True, *args: Any, **kwargs: Any) -> str:
        return f"{stage}{kind if kind != 'B' or full_backward else 'I'}{mb}"

    return name


def torch_schedule(kind: str, stages: list[Any], microbatches: int, loss: Callable[[Any, Any], torch.Tensor],
                   scale_grads: bool) -> Any:
    """torch's schedule of `kind` (one of `SCHEDULES`) over this process's `stages` (torch `_PipelineStage`s: one,
    or several under interleaved-1f1b, zero-bubble and the V-shaped kinds), the stages made ready for it: a
    stage after the first drops the model's inputs (they go to stage 0 only, but a multi-stage schedule gives them
    to every stage), a zero-bubble kind's split backward (`split_backward`), a V's turn without a warm-up send to
    its own process (`_no_self_warmup`)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    for st in stages:
        if not st.is_first:
            st.forward_one_chunk = _without_inputs(st.forward_one_chunk)
    if kind in SPLIT_KINDS:
        split_backward(stages)
    if kind in V_SHAPED:
        for st in stages:
            _no_self_warmup(st)
    multi = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    if kind in multi:
        return multi[kind](stages, microbatches, loss_fn=loss, scale_grads=scale_grads)
    single = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return single(stages[0], microbatches, loss_fn=loss, scale_grads=scale_grads)


def split_backward(stages: list[Any]) -> None:
    """Make this process's `stages` (torch `_PipelineStage`s) run a zero-bubble schedule's split backward (input
    gradients I, then weight gradients W) as they run a whole one: the same gradients, sent as gloo sends them.
    What each fix is for: `_outputs_of_their_own`, `_contiguous_input_grads`, `_split_backward`."""
    for st in stages:
        _outputs_of_their_own(st.submod)
        if not st.is_first:  # the first stage sends no input gradients (torch runs its whole backward in W)
            _contiguous_input_grads(st)
    _split_backward()


def _outputs_of_their_own(stage: nn.Module) -> None:
    """Make every output of `stage` a tensor that nothing else holds: a zero-bubble schedule's input-gradient
    action (torch's `stage_backward_input`) detaches the stage's outputs in place, which torch refuses for a
    view ("Can't detach views in-place": a relayed value, `_relay_skips`, or an input passed on) and which breaks
    the weight-gradient action where an op of the stage saved the output for its backward ("Trying to use a
    saved tensor that has been detached in-place": a ViT stage). An output that needs a gradient is cloned (its
    gradient flows back through the copy), a view that needs none detached (no copy)."""
    forward = stage.forward

    def own(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.clone() if x.requires_grad else x.detach() if x._is_view() else x

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        return tuple(own(x) for x in out) if isinstance(out, tuple | list) else own(out)

    stage.forward = run  # type: ignore[method-assign]


_REST = "devplace: weights outside torch's parameter groups"  # the key of the group `_split_backward` adds


def _split_backward() -> None:
    """Make torch's split backward (a zero-bubble schedule's input-gradient action I, then its weight-gradient
    action W; `torch.distributed.pipelining._backward`, as the stage calls it in this process) give every
    parameter its gradient. Two gaps of torch 2.x, each found on a zoo model:

    - W differentiates each group of parameters that share intermediates with the stage's inputs by itself and
      frees the graph as it goes; where two groups' paths share a node (a BART stage holding the encoder's end
      and a decoder layer whose cross-attention reads it) the second died with 'Trying to backward through the
      graph a second time'. W here keeps the graph until it is done (each parameter is in one group: nothing is
      counted twice; the graph goes when the action drops it).
    - A parameter whose path to the stage's outputs meets no input that needs a gradient is in no group, and W
      left it without a gradient, silently (BART's decoder embeddings in a stage whose inputs are the encoder's:
      the loss was right, those gradients missing). I keeps the outputs' gradient edges for them, and W
      differentiates the outputs with respect to them as well."""
    import torch.distributed.pipelining.stage as stage_module
    from torch.autograd.graph import get_gradient_edge
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        stage_backward_input,
        stage_backward_weight,
    )

    def backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None, input_values: list[Any],
                       weights: Any) -> Any:
        weights = list(weights)
        roots = [(get_gradient_edge(o), torch.ones_like(o) if output_grads is None else output_grads[i])
                 for i, o in enumerate(outputs) if o.requires_grad or o.grad_fn is not None]
        roots = [(edge, g) for edge, g in roots if g is not None]  # taken before I detaches the outputs
        dinputs, groups = stage_backward_input(outputs, output_grads, input_values, iter(weights))
        grouped = {p for group in groups for p in group["params"]}
        rest = [w for w in weights if w.requires_grad and _get_grad_fn_or_grad_acc(w) not in grouped]
        if rest and roots:
            groups.append({_REST: (rest, roots)})
        return dinputs, groups

    def backward_weight(weights: Any, param_groups: list[dict[str, Any]], retain_graph: bool = False) -> Any:
        done = stage_backward_weight(weights, [g for g in param_groups if _REST not in g], retain_graph=True)
        for rest, roots in (g[_REST] for g in param_groups if _REST in g):
            grads = torch.autograd.grad([edge for edge, _ in roots], rest, [g for _, g in roots],
                                        retain_graph=retain_graph, allow_unused=True)
            for w, g in zip(rest, grads, strict=True):
                if g is not None:
                    w.grad = g if w.grad is None else w.grad + g
        return done

    stage_module.stage_backward_input = backward_input
    stage_module.stage_backward_weight = backward_weight


def _no_self_warmup(stage: Any) -> None:
    """Drop from `stage`'s warm-up (`_get_init_p2p_neighbors_ops`, the first step's exchange with its neighbours)
    the sends and receives to its own process: in a V the turn's two stages share a process and hand their values
    over in memory, but torch's warm-up for a traced stage (`_PipelineStage`, not a `PipelineStage`) still sends
    to that neighbour, and gloo has no pair to itself ('Pair is not connected')."""
    ops = stage._get_init_p2p_neighbors_ops

    def run() -> list[Any]:
        return [op for op in ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = run


def _contiguous_input_grads(stage: Any) -> None:
    """Make the input gradients `stage` sends back contiguous: a zero-bubble schedule's input-gradient action
    takes them from `torch.autograd.grad` as autograd made them (a transposed one stays transposed; a whole
    backward accumulates them into `.grad`, which is contiguous), and gloo refuses to send a non-contiguous tensor
    ('input tensor has to be contiguous': a ViT's attention)."""
    backward = stage.backward_one_chunk

    def run(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = backward(bwd_chunk_id, *args, **kwargs)
        grads = stage.bwd_cache.get(bwd_chunk_id)
        if grads is not None:
            stage.bwd_cache[bwd_chunk_id] = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return out

    stage.backward_one_chunk = run


def _without_inputs(forward_one_chunk: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's `forward_one_chunk` that drops the step's keyword inputs (the model's own, for stage 0)."""

    def run(fwd_chunk_id: int, args: Any, kwargs: Any = None, save_forward_output: bool = True) -> Any:
        return forward_one_chunk(fwd_chunk_id, args, None, save_forward_output)

    return run


def _tied(pipe: Any, module: nn.Module) -> list[list[tuple[int, str]]]:
    """Each parameter of `module` that the stages hold as several copies, as (stage, name) pairs by stage: the
    copies in different stages (`Pipe.replicated_params` names one per stage) and those in one stage (a
    parameter under two names there, which the trace makes two parameters)."""
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    tied = [set(names) for names in names_of.values() if len(names) > 1]
    held = [[n for n, _ in pipe.get_stage_module(i).named_parameters()] for i in range(pipe.num_stages)]
    out = [[(i, n) for i in range(pipe.num_stages) for n in held[i] if n in names] for names in tied]
    return [users for users in out if len(users) > 1]


def _start_method() -> str:
    """"forkserver", with torch and the pipelining runtime imported in the server: it starts once per Python
    process and forks each stage from there, so later runs skip those imports. Not "fork": a process that ran
    autograd on another device than the CPU (as the capture does, on fake tensors) cannot run autograd in a
    forked child."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.pipelining", __name__])
    return "forkserver"


def _meta_tensor(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, grad: bool) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(grad)


def _aten_op(namespace: str, name: str, overload: str | None, home: str | None = None) -> Any:
    """The operator `namespace::name.overload`, after importing `home`, the module that registers it (a custom
    op such as transformers' `grouped_mm_fallback`, which a Mixtral MoE layer calls: a stage process has not
    run the model's code, so the op exists there only once its module is imported)."""
    if home is not None:
        importlib.import_module(home)
    packet = getattr(getattr(torch.ops, namespace), name)
    return getattr(packet, overload) if overload is not None else packet


@dataclass(frozen=True)
class _NodeRef:
    """A node named in another node's arguments, in a pickled graph."""

    name: str


def _graph_of(records: list[tuple[Any, ...]]) -> torch.fx.Graph:
    """The graph `_StagePickler` wrote: nodes in order, each value's metadata ("val") restored."""
    from torch.fx.node import map_aggregate

    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}

    def node(a: Any) -> Any:
        return made[a.name] if isinstance(a, _NodeRef) else a

    for name, op, target, args, kwargs, type_expr, val in records:
        made[name] = graph.create_node(op, target, map_aggregate(args, node), map_aggregate(kwargs, node), name=name,
                                       type_expr=type_expr)
        if val is not None:
            made[name].meta["val"] = val
    return graph


def _graph_module_of(body: dict[str, Any], graph: torch.fx.Graph) -> torch.fx.GraphModule:
    root = nn.Module()
    root.__dict__.update(body)
    return torch.fx.GraphModule(root, graph)


def _op_home(qualname: str) -> str | None:
    """The module that defines custom operator `qualname` (`torch.library.custom_op`), or None (a built-in)."""
    from torch._library.custom_ops import OPDEFS

    op = OPDEFS.get(qualname)
    return getattr(getattr(op, "_init_fn", None), "__module__", None) if op is not None else None


class _StagePickler(pickle.Pickler):
    """Pickles a traced stage for its process: a graph as its nodes with each value's metadata ("val", which the
    stage reads to allocate its receive buffers; the trace's fake tensors become meta tensors), operators by
    name. Tracing in every process instead costs seconds per stage."""

    def reducer_override(self, obj: Any) -> Any:
        from torch._ops import OpOverload, OpOverloadPacket
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx.node import map_arg

        if isinstance(obj, FakeTensor):
            return _meta_tensor, (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.requires_grad)
        if isinstance(obj, OpOverload):
            namespace, name = obj._schema.name.split("::")
            return _aten_op, (namespace, name, obj._overloadname, _op_home(obj._schema.name))
        if isinstance(obj, OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _aten_op, (namespace, name, None, _op_home(obj._qualified_op_name))
        if isinstance(obj, torch.fx.GraphModule):  # its code is generated again from the graph
            return _graph_module_of, ({k: v for k, v in obj.__dict__.items() if k != "_graph"}, obj.graph)
        if isinstance(obj, torch.fx.Graph):
            records = [(n.name, n.op, n.target, map_arg(n.args, lambda a: _NodeRef(a.name)),
                        map_arg(n.kwargs, lambda a: _NodeRef(a.name)), n.type, n.meta.get("val")) for n in obj.nodes]
            return _graph_of, (records,)
        return NotImplemented


def _dump_stage(pipe: Any, i: int) -> bytes:
    """Stage i's module and the pipeline's graph (`Pipe.info()`), what a process needs to build the stage."""
    buf = io.BytesIO()
    _StagePickler(buf).dump((pipe.get_stage_module(i), pipe.info()))
    return buf.getvalue()


def run_pipeline(module: nn.Module, inputs: Any, export: PipelineExport | Mapping[str, Any] | str | Path, *,
                 processes: int | None = None, steps: int = 1, optimizer: str = "sgd",
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, loss_reduction: str = "mean",
                 return_grads: bool = False, seed: int = 0, timeout_s: float = 300.0,
                 autocast: torch.dtype | None = None) -> PipelineRun:
    """Run `steps` pipelined training steps of `module` on `inputs` (a tuple of positional inputs or a dict of
    keyword inputs, the whole batch) as the pipeline `export` says (a `read_pipeline` result, its document or
    its file): one CPU process per stage, gloo, the export's schedule and micro-batch count.

    `processes` must be the number of stages (default); `optimizer` "sgd", "adam" or "none" (as for
    `run_steps`); `loss_fn` maps the module's output to its loss (default: `default_loss`, the module's own
    loss when it returns one; it is sent to the processes, so a module-level function, not a lambda);
    `loss_reduction` "mean" (the loss is a mean over the batch) or "sum". With `return_grads`, the first
    step's gradient of every parameter name of `module` is returned (tied parameters summed across their
    stages). `autocast`: the stages and the loss run under the CPU's autocast to this dtype (a plan captured
    with amp). The module itself is not changed. Errors: PipelineRunError (a user problem: input, schedule,
    split); a failing stage raises with its process's message.
    """
    ex = export if isinstance(export, PipelineExport) else read_pipeline(export)
    if ex.schedule.kind not in SCHEDULES:
        raise PipelineRunError(f"schedule {ex.schedule.kind!r} is not run here; choose one of {', '.join(SCHEDULES)}")
    n = ex.processes if processes is None else processes
    if n != ex.processes:
        raise PipelineRunError(f"the export has {ex.num_stages} stages on {ex.processes} devices, so it runs in "
                               f"{ex.processes} processes (one per device), not {n}")
    why = ex.schedule.unrunnable(n)
    if why is not None:
        raise PipelineRunError(f"{why} (devplace export --microbatches / --schedule)")
    if steps < 1:
        raise PipelineRunError(f"steps must be at least 1, got {steps}")
    if loss_reduction not in ("mean", "sum"):
        raise PipelineRunError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    known = dict(module.named_modules())
    missing = [pt for pt in ex.split_points if pt not in known]
    if missing:
        raise PipelineRunError(f"split point(s) {', '.join(missing)} are not modules of {type(module).__name__}; the "
                               "export was made for another model")
    if loss_fn is not None:
        try:  # the processes get it by pickle: a lambda or closure cannot go
            pickle.dumps(loss_fn)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise PipelineRunError(f"the model's loss function {getattr(loss_fn, '__qualname__', loss_fn)!r} cannot be "
                                   f"sent to the pipeline's processes ({exc}); define it as a module-level function "
                                   "(of the output alone, per micro-batch) and return it from the factory") from None
    mbs = _microbatches(_named_inputs(module, inputs), ex.schedule.microbatches)
    pipe = _trace(module, ex, mbs[0], autocast)
    with tempfile.TemporaryDirectory(prefix="devplace-pipe-") as folder:
        job = _Job(folder, [_dump_stage(pipe, i) for i in range(ex.num_stages)], n, _tied(pipe, module), ex.schedule,
                   [mbs], steps, optimizer, loss_fn, loss_reduction, return_grads, seed, timeout_s, autocast)
        _spawn(_stage, job, n, "a pipeline stage failed", "stage")
        results = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(n)]
    times = [max(r["times"][s] for r in results) for s in range(steps)]
    cpu_times = [sum(r["cpu_times"][s] for r in results) for s in range(steps)]
    grads: dict[str, torch.Tensor] = {}
    if return_grads:
        by_tensor = {id(p): name for name, p in module.named_parameters()}
        for r in results:
            for name, g in r["grads"].items():
                grads.setdefault(name, g)
        # a tied parameter has one gradient under each of its names
        for name, p in module.named_parameters(remove_duplicate=False):
            first = by_tensor[id(p)]
            for alias in (name, first):
                if alias in grads:
                    grads.setdefault(name, grads[alias])
                    grads.setdefault(first, grads[alias])
    last = stage_ranks(ex.schedule.kind, ex.num_stages, n)[-1]  # the process of the last stage, which has the loss
    return PipelineRun(results[last]["losses"], times, ex.schedule, n, grads, cpu_times,
                       [r["actions"] for r in results], [list(r["cpu_times"]) for r in results],
                       [r["timelines"] for r in results])


def accumulated_step(module: nn.Module, inputs: tuple[torch.Tensor, ...], microbatches: int = 1
                     ) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and parameter gradients (by name) of one unpipelined step of `module` on the positional `inputs` cut
    into `microbatches` equal slices along dimension 0, each slice's loss weighted 1/M (gradient accumulation):
    what a pipelined run's first step equals -- at M=1 for most models, at the run's own M where micro-batching
    changes the result (BatchNorm). The module's gradients are zeroed before and after."""
    module.zero_grad()
    size, total = inputs[0].shape[0] // microbatches, 0.0
    for k in range(microbatches):
        loss = module(*(x[k * size:(k + 1) * size] for x in inputs)) / microbatches
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    return total, grads

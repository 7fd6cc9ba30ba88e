"""Run a dp x pp parallel export for real: `dp` replicas of a `torch.distributed.pipelining` pipeline of `pp`
stages, one CPU process per (replica, stage), over gloo (docs/runtime.md, "Parallel plans").

`run_parallel(module, inputs, export)` traces the module once at the export's split points (as `run_pipeline`
does), and starts dp * pp processes; process `r * pp + s` runs stage s of replica r (the plan's device mesh
(dp, pp), row-major). `init_device_mesh("cpu", (dp, pp))` makes the process groups: one per replica for the
pipeline's sends and receives, one per stage for its data-parallel reduction. Replica r trains on the r-th of
dp equal slices of the batch, cut into the plan's M micro-batches, under its schedule (GPipe, 1F1B, or zero bubble
with one chunk per device, ZB-H1: torch's `ScheduleInterleavedZeroBubble`, its backward split as `split_backward`
says; one stage, schedule "none", runs them in GPipe's order: pure data parallelism with gradient accumulation).

Per stage, as the export's program configuration says (`parallel_export.data_parallel_of`):
- ZeRO-0: after the pipeline's backward, each gradient is all-reduced over the stage's group and divided by
  dp (what DDP computes; here after the backward, not overlapped with it in buckets);
- ZeRO-1: the same reduction, then `ZeroRedundancyOptimizer` (each replica updates its shard of the optimizer
  state and broadcasts the updated parameters);
- ZeRO-2 and 3: the stage module is `fully_shard`-ed over the stage's group (reshard after forward under
  ZeRO-3 only); the pipelining runtime reduce-scatters the gradients after the last micro-batch;
- recomputation "full": each numbered block of the stage (`numbered_block`: a transformer layer) runs under
  `torch.utils.checkpoint` (non-reentrant), the whole stage where it has none; k blocks: the stage's first k
  (the simulator's `recomputed_units`).

The loss of a step is the mean of the replicas' losses and the gradients are the replicas' mean: one step on
the whole batch when the module's loss is a mean over the batch (the micro-batches and slices are equal); for
a loss that is a sum over the batch (`loss_reduction="sum"`), sums.
"""

from __future__ import annotations

import math
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from devplace.graph.modules import numbered_block
from devplace.graph.parallel import runtime_gap
from devplace.runtime.export import PipelineExport
from devplace.runtime.parallel_export import ParallelExport, read_parallel
from devplace.runtime.pipeline_run import (
    PipelineRunError,
    _dump_stage,
    _Job,
    _microbatches,
    _named_inputs,
    _spawn,
    _tied,
    _trace,
    autocast_stage,
    one_core_each,
    stage_loss,
    stage_ranks,
    torch_schedule,
)
from devplace.sim.schedule import V_SHAPED, Schedule

__all__ = ["SCHEDULES", "ParallelRun", "checkpoint_blocks", "outer_blocks", "run_parallel"]

# one stage per process, or two in a V (zbv, dualpipev); graph.parallel.RUN_SCHEDULES names the same
SCHEDULES = ("gpipe", "1f1b", "zero-bubble", *V_SHAPED)


@dataclass
class ParallelRun:
    """Parallel training steps: the loss of each step (the replicas' mean, before the update), each step's
    wall-clock seconds (the slowest process), the first step's gradient of every parameter name of the module
    (with `return_grads=True`; the replicas' mean, gathered from the shards under ZeRO-2/3), the replicas'
    own first-step losses, the number of processes, and what each process set up (`setups[r * pp + s]`: the blocks
    it checkpointed, "" for the whole stage; its optimizer's class; whether its parameters are sharded
    DTensors)."""

    losses: list[float]
    step_times_s: list[float]
    processes: int
    replica_losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    setups: list[dict[str, Any]] = field(default_factory=list)

    @property
    def step_time_s(self) -> float:
        """Median of the steps."""
        return statistics.median(self.step_times_s)


def checkpoint_blocks(stage: nn.Module, count: int | None = None) -> list[str]:
    """Make each outermost numbered block of `stage` (a module whose name `numbered_block` recognises, e.g.
    `model.transformer.h.3`) run under non-reentrant `torch.utils.checkpoint`, or the whole stage where it has
    none; with `count`, only its first `count` blocks (in the module's order: the program's), none where it has
    no blocks. Returns the names wrapped ("" for the whole stage). The forward is replaced on the instance, so
    a traced stage's generated code, which calls its submodules, calls the checkpointed forward."""
    from torch.utils.checkpoint import checkpoint

    outer = outer_blocks(stage)
    chosen = (outer or [""]) if count is None else outer[:count]
    for name in chosen:
        sub = stage.get_submodule(name)
        forward = sub.forward

        def checkpointed(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        sub.forward = checkpointed  # type: ignore[method-assign]
    return chosen


def outer_blocks(stage: nn.Module) -> list[str]:
    """The names of `stage`'s outermost numbered blocks (modules `numbered_block` recognises, with a forward of
    their own), in the module's order."""
    # the dots: `numbered_block` reads op ids ("model.layers.3.mlp/mm#0"), where a stack name follows a dot
    blocks = [name for name, sub in stage.named_modules() if name and numbered_block(f".{name}.")
              and type(sub).forward is not nn.Module.forward]
    return [b for b in blocks if not any(b.startswith(o + ".") for o in blocks)]


def _checkpoint_position(stages: list[nn.Module], recompute: str | int) -> list[str]:
    """Checkpoint what one pipeline position recomputes (`recompute`: "none", "full" or its first k blocks,
    checked against its blocks by `run_parallel`) over its stages in pipeline order (two under a V); the names
    wrapped."""
    if recompute == "none":
        return []
    wrapped: list[str] = []
    for mod in stages:
        left = None if recompute == "full" else int(recompute) - len(wrapped)
        wrapped += checkpoint_blocks(mod, left) if left is None or left > 0 else []
    return wrapped


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain tensor (a sharded DTensor's gathered)."""
    from torch.distributed.tensor import DTensor

    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


def _process(rank: int, job: _Job) -> None:
    """Join the gloo world, make the mesh's groups, build the stages of position s of replica r as the plan says
    (stage s, and stage 2 pp - 1 - s under a V-shaped schedule), run the steps, save what the parent reads."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.pipelining.stage import _PipelineStage
    from torch.distributed.tensor import DTensor
    from torch.export.unflatten import InterpreterModule

    from devplace.runtime.run import _make_optimizer

    r, s = divmod(rank, job.pp)
    torch.manual_seed(job.seed)
    one_core_each(rank, job.dp * job.pp)
    on = stage_ranks(job.schedule.kind, len(job.stages), job.pp)  # each stage's position in the pipeline
    mine = [i for i in range(len(job.stages)) if on[i] == s]
    loaded = [pickle.loads(job.stages[i]) for i in mine]
    for mod, _ in loaded:
        for sub in mod.modules():  # their generated code, not the node-by-node interpreter (as run_pipeline does)
            if isinstance(sub, InterpreterModule):
                sub._run_with_interpreter = False
    dist.init_process_group("gloo", init_method=f"file://{job.folder}/rendezvous", rank=rank,
                            world_size=job.dp * job.pp, timeout=timedelta(seconds=job.timeout_s))
    try:
        params = {(i, n): p for i, (mod, _) in zip(mine, loaded, strict=True) for n, p in mod.named_parameters()}
        mesh = init_device_mesh("cpu", (job.dp, job.pp), mesh_dim_names=("dp", "pp"))
        dp_group = mesh.get_group("dp")
        # a tied parameter's copies in several stages of one replica: a group per replica (new_group is collective:
        # every process makes every group, in the same order)
        ties = []
        for users in job.tied:
            positions = sorted({on[st] for st, _ in users})
            groups = [dist.new_group([q * job.pp + pos for pos in positions]) if len(positions) > 1 else None
                      for q in range(job.dp)]
            # a name the unpickled stage no longer lists is the same tensor as another it does (pickling keeps
            # one object per storage): its gradient is that one's
            ties.append((groups[r], [(st, n) for st, n in users if on[st] == s and (st, n) in params]))
        checkpointed = _checkpoint_position([mod for mod, _ in loaded], job.recompute[s])
        zero, sharded = job.zero[s], job.dp > 1 and job.zero[s] >= 2
        mean = job.loss_reduction == "mean"
        stages = []
        for i, (mod, info) in zip(mine, loaded, strict=True):
            autocast_stage(mod, job.autocast)
            if sharded:
                fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=zero == 3)
            stages.append(_PipelineStage(mod, i, info, torch.device("cpu"), group=mesh.get_group("pp")))
        m = job.schedule.microbatches
        sched = torch_schedule(job.schedule.kind, stages, m, stage_loss(job.loss_fn, job.autocast), mean)
        # under fully_shard: its sharded parameters
        params = {(i, n): p for i, (mod, _) in zip(mine, loaded, strict=True) for n, p in mod.named_parameters()}
        trained = [p for p in params.values() if p.requires_grad]
        local = _make_optimizer(job.optimizer, trained)
        opt: Any = local
        if local is not None and zero == 1 and job.dp > 1:
            opt = ZeroRedundancyOptimizer(trained, optimizer_class=type(local), process_group=dp_group,
                                          **local.defaults)
        first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
        losses: list[float] = []
        times: list[float] = []
        grads: dict[str, torch.Tensor] = {}
        for step in range(job.steps):
            dist.barrier()
            t0 = time.perf_counter()
            mb_losses: list[torch.Tensor] = []
            sched.step(arg_mbs=[()] * m, kwarg_mbs=job.microbatches[r] if first else [{}] * m,
                       target_mbs=[None] * m, losses=mb_losses if last else None, return_outputs=False)
            for group, names in ties:  # a tied parameter's gradient is the sum over its copies in the replica
                if not names:
                    continue
                # a copy that no op of this stage read (GPT-2's wte where the stage only holds it) has no gradient
                own = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]
                total = sum(own[1:], start=own[0])
                if group is not None:
                    dist.all_reduce(total, group=group)
                for n in names:
                    params[n].grad = total.clone()
            if job.dp > 1:  # the replicas' mean (sum) gradient; fully_shard reduce-scattered the mean already
                for p in params.values():
                    if p.grad is not None and not sharded:
                        dist.all_reduce(p.grad, group=dp_group)
                        if mean:
                            p.grad.div_(job.dp)
                    elif p.grad is not None and not mean:  # gloo has no pre-multiplied sum to make it a sum
                        p.grad.mul_(job.dp)
            if step == 0 and job.return_grads:
                grads = {n: _full(p.grad) for (_, n), p in params.items() if p.grad is not None}
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                for mod, _ in loaded:
                    mod.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            if last:
                total = torch.stack([v.detach() for v in mb_losses]).sum()
                losses.append(float(total / m if mean else total))
        setup = {"checkpointed": checkpointed, "optimizer": type(opt).__name__ if opt is not None else None,
                 "sharded": any(isinstance(p, DTensor) for mod, _ in loaded for p in mod.parameters())}
        torch.save({"losses": losses, "times": times, "grads": grads, "setup": setup},
                   Path(job.folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _check(module: nn.Module, ex: ParallelExport, steps: int) -> None:
    plan = ex.plan
    gap = runtime_gap(plan)
    if gap is not None:
        raise PipelineRunError(f"devplace run does not run {gap}: a parallel run pipelines its stages under one of "
                               f"{', '.join(SCHEDULES)} (one stage: 'none'), one stage per process (two in a V), "
                               "ZeRO-3 not under a zero-bubble schedule (torch's split backward of a resharded stage "
                               "gives wrong gradients)")
    if plan.schedule != "none":
        why = plan.pipeline_schedule().unrunnable(plan.pp)
        if why is not None:
            raise PipelineRunError(why)
    if steps < 1:
        raise PipelineRunError(f"steps must be at least 1, got {steps}")
    known = dict(module.named_modules())
    missing = [pt for pt in ex.split_points if pt not in known]
    if missing:
        raise PipelineRunError(f"split point(s) {', '.join(missing)} are not modules of {type(module).__name__}; the "
                               "export was made for another model")


def run_parallel(module: nn.Module, inputs: Any, export: ParallelExport | Mapping[str, Any] | str | Path, *,
                 steps: int = 1, optimizer: str = "sgd", loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 loss_reduction: str = "mean", return_grads: bool = False, seed: int = 0,
                 timeout_s: float = 300.0, autocast: torch.dtype | None = None) -> ParallelRun:
    """Run `steps` training steps of `module` on `inputs` (the whole batch: a tuple of positional inputs or a
    dict of keyword inputs) as the parallel `export` says (a `read_parallel` result, its document or its file):
    dp * pp CPU processes over gloo (module docstring). `optimizer` "sgd", "adam" or "none" (as for
    `run_steps`); `loss_fn` maps the module's output to its loss (default: the module's own loss,
    `default_loss`; a module-level function, sent to the processes); `loss_reduction` "mean" (the loss is a mean
    over the batch: micro-batches and replicas averaged) or "sum" (summed). With `return_grads`, the first
    step's gradient of every parameter name of `module` (the replicas' mean, or sum). `autocast`: the stages and
    the loss run under the CPU's autocast to this dtype (a plan captured with amp). The module itself is not changed.
    PipelineRunError for a user problem (inputs, schedule, split, a batch that does not divide into dp * M
    equal micro-batches); a failing process raises with its own message."""
    ex = export if isinstance(export, ParallelExport) else read_parallel(export)
    _check(module, ex, steps)
    if loss_reduction not in ("mean", "sum"):
        raise PipelineRunError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    plan = ex.plan
    if loss_fn is not None:
        try:  # the processes get it by pickle
            pickle.dumps(loss_fn)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise PipelineRunError(f"the loss function {getattr(loss_fn, '__qualname__', loss_fn)!r} cannot be sent "
                                   f"to the processes ({exc}); define it at module level") from None
    # dp slices of the batch, each cut into M micro-batches: the batch's dp * M equal pieces, in order
    pieces = _microbatches(_named_inputs(module, inputs), plan.dp * plan.microbatches)
    replicas = [pieces[q * plan.microbatches:(q + 1) * plan.microbatches] for q in range(plan.dp)]
    # one stage ("none") runs its micro-batches one after another, all forwards then all backwards: GPipe's order
    schedule = Schedule("gpipe" if plan.schedule == "none" else plan.schedule, plan.microbatches,
                        plan.chunks if plan.schedule in V_SHAPED else 1)
    stages = len(ex.split_points) + 1  # pp, or 2 pp in a V
    on = stage_ranks(schedule.kind, stages, plan.pp)  # each stage's position in the pipeline
    replica = plan.replica(0)
    pipe = _trace(module, PipelineExport(ex.split_points, tuple(replica[pos] for pos in on), schedule, ex.source,
                                         ex.doc), pieces[0], autocast)
    for pos, k in enumerate(plan.recompute):
        held = sum(len(outer_blocks(pipe.get_stage_module(st))) for st in range(stages) if on[st] == pos)
        if isinstance(k, int) and k > held:
            raise PipelineRunError(f"pipeline position {pos} recomputes {k} blocks but its stages hold {held} "
                                   f"numbered blocks; give at most {held} (or 'full')")
    tied = _tied(pipe, module)
    shared = sorted({st for users in tied for st, _ in users if plan.zero[on[st]] >= 2})
    if shared and plan.dp > 1:
        raise PipelineRunError(f"stage(s) {shared} hold a copy of a tied parameter (held by several stages), which "
                               "a ZeRO-2/3 (fully_shard) stage does not run here; use zero 0 or 1 for them")
    n = plan.dp * plan.pp
    with tempfile.TemporaryDirectory(prefix="devplace-parallel-") as folder:
        job = _Job(folder, [_dump_stage(pipe, st) for st in range(stages)], plan.pp, tied, schedule, replicas, steps,
                   optimizer, loss_fn, loss_reduction, return_grads, seed, timeout_s, autocast, plan.zero,
                   plan.recompute)
        _spawn(_process, job, n, "a parallel process failed (process r * pp + s runs stage s of replica r)", "process")
        results = [torch.load(Path(folder) / f"rank{q}.pt") for q in range(n)]
    times = [max(res["times"][i] for res in results) for i in range(steps)]
    lasts = [results[q * plan.pp + on[-1]]["losses"] for q in range(plan.dp)]  # the processes of the last stage
    combine = statistics.fmean if loss_reduction == "mean" else math.fsum
    losses = [combine(lst[i] for lst in lasts) for i in range(steps)]
    grads: dict[str, torch.Tensor] = {}
    if return_grads:
        for res in results[:plan.pp]:  # replica 0's: every replica holds the mean
            for name, g in res["grads"].items():
                grads.setdefault(name, g)
        first = {id(p): name for name, p in module.named_parameters()}
        for name, p in module.named_parameters(remove_duplicate=False):  # a tied parameter under each name
            for alias in (name, first[id(p)]):
                if alias in grads:
                    grads.setdefault(name, grads[alias])
                    grads.setdefault(first[id(p)], grads[alias])
    return ParallelRun(losses, times, n, [lst[0] for lst in lasts], grads, [res["setup"] for res in results])

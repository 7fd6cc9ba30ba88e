"""A dp x pp parallel plan as a program other tools run (docs/runtime.md, "Parallel plans").

`parallel_export(plan, split_points, ...)` writes a `devplace.parallel/2` document: the `ParallelPlan` (its JSON
form), the pipeline's split points (stage s > 0 begins at module `split_points[s-1]`, as in a pipeline
export), and per stage the torch program configuration that runs it:
- the stage, built by `torch.distributed.pipelining` (`pipeline(..., split_spec)` at the split points) and run
  under the plan's schedule on a process group per replica;
- its data-parallel wrapping over a process group per stage: ZeRO-0 is DDP (gradients all-reduced and
  averaged), ZeRO-1 DDP with `torch.distributed.optim.ZeroRedundancyOptimizer` (optimizer state sharded),
  ZeRO-2 `fully_shard(reshard_after_forward=False)` and ZeRO-3 `fully_shard(reshard_after_forward=True)`;
- its activation checkpointing: "full" recomputation checkpoints each numbered block (a transformer layer:
  `devplace.graph.modules.numbered_block`) of the stage with `torch.utils.checkpoint` (non-reentrant), the
  whole stage where it has none, as the simulator's recomputation units are (`sim.parallel.recompute_units`);
  a stage that recomputes k blocks checkpoints its first k ("first k blocks", `checkpointing_of`).

`devplace run --parallel FILE` runs such a document (`runtime.parallel_run.run_parallel`); `torchtitan_config`
gives the same plan as the parallelism and activation-checkpoint sections of a torchtitan job config
(torchtitan 0.3: its config classes and command-line overrides; the optional extra `titan`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from devplace.graph.compgraph import CompGraph
from devplace.graph.parallel import STAGES_KEY, V_SHAPED, ParallelPlan, ParallelPlanError, recorded_stages
from devplace.graph.placement import Placement
from devplace.graph.schedule import Schedule, stage_position
from devplace.runtime.export import ExportError, pipeline_split, read_export_doc, read_precision

__all__ = ["PARALLEL_FORMAT", "TORCHTITAN_FORMAT", "ParallelExport", "checkpointing_of", "data_parallel_of",
           "parallel_export", "pipeline_stages", "read_parallel", "recorded_split", "torchtitan_config"]

PARALLEL_FORMAT = "devplace.parallel/2"  # /2 may carry "precision" (an older devplace would run it in fp32)
PARALLEL_OLDER = ("devplace.parallel/1",)  # read too: the same document, in fp32 where it records no precision


def data_parallel_of(zero: int, dp: int) -> dict[str, Any]:
    """How a stage with ZeRO stage `zero` over `dp` replicas is wrapped in a torch program (module docstring)."""
    if dp == 1:
        return {"wrapper": "none", "optimizer": "local"}
    if zero <= 1:
        return {"wrapper": "DistributedDataParallel",
                "optimizer": "ZeroRedundancyOptimizer" if zero == 1 else "local"}
    return {"wrapper": "fully_shard", "reshard_after_forward": zero == 3, "optimizer": "local"}


@dataclass(frozen=True)
class ParallelExport:
    """A `devplace.parallel/2` document read back and checked: the plan, the split points, the model `source`
    (as in a pipeline export; None when unknown) and the whole document."""

    plan: ParallelPlan
    split_points: tuple[str, ...]
    source: dict[str, Any] | None
    doc: dict[str, Any]

    @property
    def precision(self) -> dict[str, str]:
        """The precision the plan's steps run in (`read_precision`; empty: fp32)."""
        return read_precision(self.doc, "the parallel export")


def checkpointing_of(recompute: str | int) -> str:
    """A pipeline position's activation checkpointing in a torch program (module docstring): "per block" (full
    recomputation), "first k blocks" (k of them: a V's two stages count theirs in pipeline order) or "none"."""
    if isinstance(recompute, int):
        return f"first {recompute} blocks"
    return "per block" if recompute == "full" else "none"


def pipeline_stages(plan: ParallelPlan) -> int:
    """The pipeline stages of `plan`: pp, or 2 pp under a V-shaped schedule (zbv, dualpipev: position s of the
    pipeline runs stages s and 2 pp - 1 - s)."""
    return 2 * plan.pp if plan.schedule in V_SHAPED else plan.pp


def recorded_split(graph: CompGraph, placement: Placement) -> tuple[ParallelPlan, list[str]]:
    """The parallel plan a search recorded in `placement` (its "parallel") and where its pipeline is cut: the
    module at which each stage after the first begins, as `pipeline_split` cuts the program, of the stage of each
    op that the placement records (its "stages", `graph.parallel.stages_record`; a plan of one chunk per device
    saved without one: its devices' positions). Each stage is cut as a device of its own, so that a V's two stages
    on one device stay two. ExportError where the record does not cut into the plan's `pipeline_stages`."""
    plan = ParallelPlan.from_dict(placement.meta.get("parallel"))
    try:
        stage = recorded_stages(plan, graph.ids, placement.assignment, placement.meta.get(STAGES_KEY))
    except ParallelPlanError as exc:
        raise ExportError(str(exc)) from None
    # the cut only: the stages' schedule is the plan's, which pipeline_split need not simulate
    split = pipeline_split(graph, Placement.from_array(graph, np.asarray(stage, dtype=np.int64)),
                           schedule=Schedule("1f1b", plan.microbatches))
    k = pipeline_stages(plan)
    if len(split.devices) != k:
        raise ExportError(f"the plan's stages cut its program at module starts into {len(split.devices)} pipeline "
                          f"stages, not the {k} of its parallel plan ({plan.label}); place it again")
    return plan, list(split.split_points)


def parallel_export(plan: ParallelPlan, split_points: Sequence[str], *, source: Mapping[str, Any] | None = None,
                    simulated_step_s: float | None = None,
                    precision: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `devplace.parallel/2` document of `plan` with its pipeline cut at `split_points` (`pipeline_stages` - 1
    module names, in program order: pp - 1, or 2 pp - 1 under a V), the model `source` it was planned for (a zoo
    name with batch and sequence length, so that `devplace run --parallel` can rebuild it), its simulated step and
    the `precision` its steps run in (`runtime.run.precision_record`; none: fp32). ExportError when the points do
    not make that many stages."""
    points = list(split_points)
    k = pipeline_stages(plan)
    if len(points) != k - 1 or len(set(points)) != len(points):
        raise ExportError(f"a plan of {k} pipeline stages (pp={plan.pp}, {plan.schedule}) is cut at {k - 1} distinct "
                          f"module(s), got {points}")
    stages = [{"stage": s, "begins_at": points[s - 1] if s else None, "devices": list(plan.stage_group(pos)),
               "data_parallel": data_parallel_of(plan.zero[pos], plan.dp),
               "activation_checkpointing": checkpointing_of(plan.recompute[pos])}
              for s, pos in ((s, stage_position(plan.schedule, s, plan.pp)) for s in range(k))]
    doc: dict[str, Any] = {"format": PARALLEL_FORMAT, "parallel": plan.to_dict(),
                           "split_points": [{"module": m, "point": "beginning"} for m in points],
                           "stages": stages, "simulated_step_s": simulated_step_s}
    if source is not None:
        doc["source"] = dict(source)
    if precision:
        doc["precision"] = dict(precision)
    return doc


def read_parallel(source: str | Path | Mapping[str, Any]) -> ParallelExport:
    """A parallel export (a `devplace.parallel/2` or /1 file or its parsed document), checked: a valid `ParallelPlan`
    and `pipeline_stages` - 1 distinct split points. An ExportError says what is wrong."""
    doc, where = read_export_doc(source, PARALLEL_FORMAT, "parallel", older=PARALLEL_OLDER)
    try:
        plan = ParallelPlan.from_dict(doc.get("parallel"))
    except ParallelPlanError as exc:
        raise ExportError(f"{where}: {exc}") from None
    points = doc.get("split_points")
    if not isinstance(points, list) or not all(isinstance(p, dict) and isinstance(p.get("module"), str)
                                               and p.get("point") == "beginning" for p in points):
        raise ExportError(f"{where}: split_points must be a list of {{\"module\": NAME, \"point\": \"beginning\"}}, "
                          f"got {points!r}")
    names = tuple(p["module"] for p in points)
    k = pipeline_stages(plan)
    if len(names) != k - 1 or len(set(names)) != len(names):
        raise ExportError(f"{where}: a plan of {k} pipeline stages (pp={plan.pp}, {plan.schedule}) needs {k - 1} "
                          f"distinct split point(s), got {list(names)}")
    src = doc.get("source")
    if src is not None and not isinstance(src, dict):
        raise ExportError(f"{where}: source must be an object (the plan's model source), got {src!r}")
    read_precision(doc, where)
    return ParallelExport(plan, names, src, doc)


# ------------------------------------------------------------------------------------------ torchtitan
TORCHTITAN_FORMAT = "devplace.torchtitan/1"
# torch.distributed.pipelining's schedule names (`get_schedule_class`), which torchtitan's
# `parallelism.pipeline_parallel_schedule` takes
TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                   "zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def _flag(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def torchtitan_config(export: ParallelExport) -> dict[str, Any]:
    """A parallel export's plan as the parallelism, training-batch and activation-checkpoint sections of a
    torchtitan (0.3) job config, with the same as torchtitan's command-line overrides ("overrides":
    `--parallelism.NAME=VALUE` and the `activation_checkpoint:full` or `:none` choice), and "notes" where
    torchtitan cannot say what the plan says. torchtitan applies one data-parallel mode and one checkpointing
    policy to every stage, so a plan whose stages differ is an ExportError. Its data parallelism is DDP
    (`data_parallel_replicate_degree`, ZeRO-0) or FSDP (`data_parallel_shard_degree`): ZeRO-3 reshards after
    forward ("always"), ZeRO-2 does not ("never"), and ZeRO-1 (optimizer state sharded alone) has no
    counterpart: it is written as ZeRO-2, which holds no more memory, with a note. The stage cuts are not
    written: torchtitan cuts its own model definitions (`module_fqns_per_model_part` names their modules, not
    this model's), so a note gives devplace's."""
    plan = export.plan
    if len(set(plan.zero)) > 1 or len(set(plan.recompute)) > 1:
        raise ExportError(f"torchtitan applies one ZeRO stage and one recomputation to every pipeline stage; this "
                          f"plan has zero={list(plan.zero)}, recompute={list(plan.recompute)} (export it with "
                          "--format parallel, or give one --zero and --recompute)")
    partial = sorted({r for r in plan.recompute if isinstance(r, int)})
    if partial:
        raise ExportError(f"torchtitan checkpoints every layer ('full') or every Nth layer ('selective' with option "
                          f"N), not a stage's first {partial[0]} blocks as this plan does; export it with --format "
                          "parallel, or give --recompute none or full")
    zero, notes = plan.zero[0], []
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": plan.dp if zero == 0 else 1,
        "data_parallel_shard_degree": plan.dp if zero >= 1 else 1,
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": plan.pp}
    if zero >= 1:
        parallelism["fsdp_reshard_after_forward"] = "always" if zero == 3 else "never"
    if zero == 1:
        notes.append("ZeRO-1 is written as FSDP without resharding after forward (ZeRO-2): torchtitan does not "
                     "shard the optimizer state alone")
    if plan.pp > 1:
        parallelism["pipeline_parallel_schedule"] = TORCH_SCHEDULES[plan.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = plan.microbatch_size
        notes.append(f"devplace cuts this model's pipeline at {', '.join(export.split_points)}; torchtitan cuts its "
                     "own model definition: name the same layers in parallelism.module_fqns_per_model_part")
    training = {"local_batch_size": plan.batch // plan.dp, "global_batch_size": plan.batch}
    checkpointing = "full" if plan.recompute[0] == "full" else "none"
    doc = {"format": TORCHTITAN_FORMAT, "training": training, "parallelism": parallelism,
           "activation_checkpoint": checkpointing}
    doc["overrides"] = [f"--{section}.{k}={_flag(v)}" for section in ("training", "parallelism")
                        for k, v in doc[section].items()] + [f"activation_checkpoint:{checkpointing}"]
    doc["notes"] = notes
    return doc

"""`devplace export --format torchtitan` (issue 31 item 4): its sections load in torchtitan's own config classes
(`ParallelismConfig`, `TrainingConfig`, the activation-checkpointing choice) and its overrides parse with
torchtitan's command-line parser (tyro with torchtitan's rules). Skipped where the optional extra `titan` is
not installed (CI installs only `.[dev]`)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from devplace.graph.parallel import ParallelPlan
from devplace.runtime.parallel_export import (
    TORCH_SCHEDULES,
    parallel_export,
    pipeline_stages,
    read_parallel,
    torchtitan_config,
)

config = pytest.importorskip("torchtitan.config", reason="the optional extra `titan` (torchtitan) is not installed")
checkpointing = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
manager = pytest.importorskip("torchtitan.config.manager")
tyro = pytest.importorskip("tyro")

PLANS = [ParallelPlan(dp=2, pp=2, microbatches=2, batch=8, schedule="1f1b", zero=1, recompute="full"),
         ParallelPlan(dp=4, pp=1, microbatches=2, batch=16, schedule="none", zero=3),
         ParallelPlan(dp=2, pp=4, microbatches=4, batch=16, schedule="gpipe", zero=0, recompute="full"),
         ParallelPlan(dp=2, pp=2, microbatches=4, batch=16, schedule="zbv", zero=2)]


@dataclasses.dataclass
class _Job:
    """The sections of torchtitan's `Trainer.Config` that the export writes, typed as torchtitan types them."""

    training: config.TrainingConfig = dataclasses.field(default_factory=config.TrainingConfig)
    parallelism: config.ParallelismConfig = dataclasses.field(default_factory=config.ParallelismConfig)
    activation_checkpoint: checkpointing.ActivationCheckpointingConfig = dataclasses.field(
        default_factory=checkpointing.SelectiveAC.Config)


def _subcommands() -> dict[str, type | None]:
    """torchtitan's activation-checkpointing choices by name ("full" -> FullAC.Config, "none" -> None)."""
    out: dict[str, type | None] = {}
    for option in typing.get_args(checkpointing.ActivationCheckpointingConfig):
        cls, *marks = typing.get_args(option)
        out[next(m.name for m in marks if hasattr(m, "name"))] = None if cls is type(None) else cls
    return out


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label)
def test_the_sections_load_in_torchtitans_config_classes_and_its_parser(plan):
    points = [f"layers.{i}" for i in range(1, pipeline_stages(plan))]  # 2 stages per rank under zbv
    doc = torchtitan_config(read_parallel(parallel_export(plan, points)))
    parallelism = config.ParallelismConfig(**doc["parallelism"])  # unknown field names raise TypeError
    training = config.TrainingConfig(**doc["training"])
    assert parallelism.pipeline_parallel_degree == plan.pp and parallelism.tensor_parallel_degree == 1
    dp_fields = (parallelism.data_parallel_replicate_degree, parallelism.data_parallel_shard_degree)
    assert dp_fields == ((plan.dp, 1) if plan.zero[0] == 0 else (1, plan.dp))
    assert training.local_batch_size * plan.dp == training.global_batch_size == plan.batch
    if plan.pp > 1:
        from torch.distributed.pipelining.schedules import get_schedule_class

        assert get_schedule_class(parallelism.pipeline_parallel_schedule).__name__.lower().endswith(
            TORCH_SCHEDULES[plan.schedule].lower())
        assert parallelism.pipeline_parallel_microbatch_size * plan.microbatches == training.local_batch_size
    assert _subcommands()[doc["activation_checkpoint"]] == (checkpointing.FullAC.Config if plan.recompute[0] == "full"
                                                            else None)
    # the overrides, parsed as torchtitan parses its command line (ConfigManager registers its rules)
    manager.ConfigManager()
    job = tyro.cli(_Job, args=doc["overrides"], registry=manager.custom_registry)
    assert job.parallelism == parallelism and job.training == training
    expected = _subcommands()[doc["activation_checkpoint"]]
    assert (job.activation_checkpoint is None) if expected is None else isinstance(job.activation_checkpoint, expected)
    assert ("ZeRO-1" in " ".join(doc["notes"])) == (plan.zero[0] == 1)


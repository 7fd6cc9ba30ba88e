"""Runtime: from a plan to a running model (docs/runtime.md).

`plan(model, example_inputs, cluster, ...)` captures, costs, coarsens, places and simulates a module's training
step; `Plan.apply(model, devices)` returns the module with each forward op on its placed device
(`PlacedModule`); `run_steps` times real training steps; `export` turns a placement into pipeline split points,
a Hugging Face style device_map, or plain JSON; `run_pipeline` runs a pipeline export's stages in CPU processes
(torch.distributed.pipelining, gloo).
"""

from devplace.runtime.apply import ApplyError, PlacedModule, apply_placement
from devplace.runtime.pipeline_run import PipelineRun, run_pipeline
from devplace.runtime.plan import FORMAT, Plan, load_plan, plan, plan_from_prepared

__all__ = [
           "FORMAT",
           "ApplyError",
           "PipelineRun",
           "PlacedModule",
           "Plan",
           "apply_placement",
           "load_plan",
           "plan",
           "plan_from_prepared",
           "run_pipeline",
]

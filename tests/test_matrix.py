"""Issue 30's matrix, the cut CI runs (the whole matrix is `benchmarks/run_matrix.py`): every architecture of
`devplace.zoo.tiny`, every stage count (2, 3, 4) and every schedule at least once, each placed by the `pipeline`
placer, exported at its module starts and run in CPU processes with gloo; the loss and every parameter gradient
equal the unpipelined step's -- except for BatchNorm, whose statistics are per micro-batch: there they equal the
step accumulated over the same micro-batches, and differ from the whole batch's."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from devplace.graph.modules import module_of
from devplace.runtime import plan
from devplace.runtime.export import callable_modules, pipeline_split
from devplace.runtime.pipeline_run import accumulated_step, run_pipeline
from devplace.zoo import tiny

# (architecture, cluster, schedule, micro-batches): the stage count is the cluster's device count (times 2 chunks
# under interleaved-1f1b)
CASES = [("llama", "3xGPU-placeto", "1f1b", 4),  # every layer reads the rotary tables: relayed on 3 stages
         ("neox", "4xV100-16GB", "gpipe", 2),  # parallel residual, partial rotary, 4 stages
         ("bart", "2xK80", "interleaved-1f1b", 4),  # the decoder reads the encoder's output; 4 stages on 2
         ("mixtral", "2xK80", "1f1b", 2),  # a custom op (transformers' grouped_mm_fallback) in every stage
         ("cnn_bn", "2xK80", "gpipe", 2),  # BatchNorm
         ("vit", "3xGPU-placeto", "gpipe", 2)]


@pytest.mark.parametrize(("arch", "cluster", "kind", "microbatches"), CASES, ids=[c[0] for c in CASES])
def test_every_architecture_placed_pipelined_exports_and_runs_like_its_step(arch, cluster, kind, microbatches):
    model, inputs = tiny.ARCHITECTURES[arch]()
    p = plan(model, inputs, cluster, placer="pipeline", schedule=kind, microbatches=microbatches)
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    chunks = int(split.schedule.chunks or 1)
    assert len(split.devices) == chunks * p.cluster.num_devices and set(split.split_points) <= callable_modules(model)
    assert split.moved_fraction == 0.0 and split.pipelined_step_time_s == p.result.step_time_s
    ran = run_pipeline(model, inputs, json.loads(json.dumps(split.to_dict())), return_grads=True)
    assert ran.schedule.kind == kind and ran.schedule.microbatches == microbatches
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    loss, grads = accumulated_step(model, inputs, microbatches if batchnorm else 1)
    assert ran.losses[0] == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(ran.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if batchnorm:  # what micro-batching changes: the whole batch's step is another one
        assert accumulated_step(model, inputs, 1)[0] != pytest.approx(loss, rel=1e-5)


def test_an_interleaved_placement_exports_as_rounds_of_the_devices():
    """The pipeline placer's interleaved pipelines are ones the export can cut into V rounds of the devices: a
    stage holding only constants (sources, which the simulator puts in chunk 0) is no stage of the program
    (before: neox on 2xK80 exported as devices [1, 0, 1], an ExportError)."""
    model, inputs = tiny.neox()
    p = plan(model, inputs, "2xK80", placer="pipeline", schedule="interleaved-1f1b", microbatches=2)
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    assert len(split.devices) == 4 and split.devices[:2] == split.devices[2:] and len(set(split.devices)) == 2
    assert split.pipelined_step_time_s == p.result.step_time_s


def test_bart_interleaved_runs_its_decoder_embedding_in_the_chunk_the_program_runs_it():
    """BART's decoder embedding reads nothing from another device, so the simulator's data flow alone put it in
    chunk 0 of its device, where the program runs it in chunk 1 (after the encoder): every interleaved split the
    pipeline placer judged at M=4 on 2 devices then met its stages out of order along the program and was
    refused, reported as "no split ... fits memory". The simulator now takes each op's chunk from the program
    (its floor), so the split is a pipeline, exports as 2 rounds of the devices and simulates to the same step."""
    model, inputs = tiny.bart()
    p = plan(model, inputs, "2xK80", placer="pipeline", schedule="interleaved-1f1b", microbatches=4, order="topo")
    split = pipeline_split(p.graph, p.placement, p.cluster, model)
    assert len(split.devices) == 4 and split.devices[:2] == split.devices[2:] and len(set(split.devices)) == 2
    assert split.moved_fraction == 0.0 and split.pipelined_step_time_s == p.result.step_time_s
    graph, stage = p.graph, p.result.stage
    embed = [v for v in range(graph.num_nodes) if graph.kind[v] == "forward" and graph.compute_s[v] > 0
             and (module_of(graph, v) or "").endswith("decoder.embed_tokens")]
    # the third stage (device 0 again) begins before the decoder: at it, or at the encoder's last modules (where
    # the tied embedding's copies put the cut since the simulator sums their gradients once per step)
    assert split.split_points[1] == "model.model.decoder" or ".encoder." in split.split_points[1]
    assert embed and {int(stage[v]) for v in embed} == {2}, "the decoder embedding runs in the third stage"


def test_an_interleaved_pipeline_with_too_few_places_to_cut_says_so_not_no_fit():
    """Three module calls give two places where a stage may begin, fewer than the 3 cuts of 4 interleaved stages
    on 2 devices: the error says that (it said no split fits memory, on 1.3 kB against 24 GB)."""
    from devplace.placers.memory import NoFitError

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(NoFitError, match=r"4 interleaved-1f1b stages, but only 2 place\(s\) where a stage may end") \
            as caught:
        plan(model, (torch.randn(8, 8),), "2xK80", placer="pipeline", schedule="interleaved-1f1b", microbatches=2)
    assert not caught.value.memory and "fits" not in str(caught.value)

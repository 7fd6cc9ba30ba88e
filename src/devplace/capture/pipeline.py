"""From a model to a graph a placer can use: capture the training step, cost it for a device, coarsen it.

DESIGN.md section 2's first three stages in one call, for the zoo's named models, its families and ONNX
files. (These live in `capture/`, which may import `zoo/`, `hardware/` and `graph/`; the zoo itself only
defines models.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from devplace.capture.torch_capture import capture
from devplace.defaults import FAMILY_MAX_NODES
from devplace.errors import DevplaceError
from devplace.graph.batch import MICROBATCHES_META_KEY, divisors_text
from devplace.graph.coarsen import Coarsening, coarsen, colocate
from devplace.graph.compgraph import CompGraph
from devplace.graph.semantics import SEMANTICS_KEY, Semantics
from devplace.hardware.cluster import Device
from devplace.hardware.cost import CostReport, CostTable, apply_costs
from devplace.hardware.presets import device_kind


@dataclass(frozen=True)
class ModelRef:
    """How a prepared graph was made from a model, so that the same step can be captured again at another
    batch (one micro-batch of it): the model's name (zoo or `package.module:factory`), its capture settings,
    and the options of `prepare` (device, costs, max_nodes)."""

    name: str
    seq_len: int | None = None
    optimizer: str = "adam"
    seed: int = 0
    dtype: str | None = None
    amp: bool = False
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Prepared:
    """A captured graph costed for a device (`full`), its coarsening (`coarsening.graph` is what placers
    get; `coarsening.expand(...)` maps a coarse placement back to `full`), the cost report, and (for a
    captured model) the `ModelRef` that makes it again at another batch."""

    full: CompGraph
    coarsening: Coarsening
    report: CostReport
    model: ModelRef | None = None

    @property
    def graph(self) -> CompGraph:
        return self.coarsening.graph


def prepare(graph: CompGraph, *, device: Device | None = None, costs: CostTable | None = None,
            max_nodes: int | None = None, dtype: str | None = None, model: ModelRef | None = None,
            kinds: tuple[Device, ...] = ()) -> Prepared:
    """Cost `graph` for `device` (a V100 by default; from `costs` where the table has an op, analytic
    otherwise) and for each device kind of `kinds` (`hardware.cost.cost_devices`: a cluster of several kinds),
    then colocate it and, with `max_nodes`, coarsen it to at most that many groups.

    `dtype` is the precision assumed for nodes that carry none (graphs from ONNX or JSON files; a capture
    records every node's own), see `apply_costs`; `model` how the graph was captured (kept in the result)."""
    costed, report = apply_costs(graph, device or device_kind("V100"), costs if costs is not None else "analytic",
                                 dtype=dtype, kinds=kinds)
    return Prepared(costed, coarsen(costed, max_nodes) if max_nodes is not None else colocate(costed), report,
                    model)


def module_microbatch_graphs(model: torch.nn.Module, example_inputs: Any, batch: int, *,
                             loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: str = "adam",
                             dtype: str | None = None, amp: bool = False, **options: Any,
                             ) -> Callable[[int], tuple[CompGraph, Coarsening]]:
    """Where the search gets a micro-batch count's graph for a module captured on `example_inputs` at `batch`
    (`placers.search.MicrobatchGraph`; `devplace.plan`): M -> the step captured again on the first batch / M
    samples of every input tensor whose first dimension is `batch`, marked as one of M micro-batches
    (`graph_microbatches`) and prepared with `options` (device, kinds, max_nodes, as `prepare`), so every op is
    costed at the micro-batch's size. DevplaceError when M does not divide `batch`."""

    def graph_of(microbatches: int) -> tuple[CompGraph, Coarsening]:
        if microbatches < 1 or batch % microbatches:
            raise DevplaceError(f"{microbatches} micro-batches do not split the batch of {batch} into equal "
                                f"micro-batches; use one of {divisors_text(batch)}")
        size = batch // microbatches
        graph = capture(model, first_samples(example_inputs, batch, size), loss_fn=loss_fn, optimizer=optimizer,
                        dtype=dtype, amp=amp)
        graph.meta[MICROBATCHES_META_KEY] = microbatches  # a fresh capture's own dict: mark it before it is costed
        prepared = prepare(graph, **options)
        return prepared.full, prepared.coarsening
    return graph_of


def first_samples(inputs: Any, batch: int, size: int) -> Any:
    """`inputs` (a tensor, or tuples, lists and dicts of them) with every tensor whose first dimension is `batch`
    cut to its first `size` samples."""
    if isinstance(inputs, torch.Tensor):
        return inputs[:size] if inputs.dim() >= 1 and inputs.shape[0] == batch else inputs
    if isinstance(inputs, dict):
        return {k: first_samples(v, batch, size) for k, v in inputs.items()}
    if isinstance(inputs, tuple | list):
        return type(inputs)(first_samples(v, batch, size) for v in inputs)
    return inputs


def zoo_prepared(name: str, *, batch: int | None = None, seq_len: int | None = None, optimizer: str = "adam",
                 max_nodes: int | None = None, device: Device | None = None, costs: CostTable | None = None,
                 dtype: str | None = None, amp: bool = False) -> Prepared:
    """Capture zoo model `name` in precision `dtype` / `amp` (see `capture_zoo_model`) and prepare it (see
    `prepare`)."""
    graph = capture_zoo_model(name, batch=batch, seq_len=seq_len, optimizer=optimizer, dtype=dtype, amp=amp)
    return prepare(graph, device=device, costs=costs, max_nodes=max_nodes)


def capture_zoo_model(name: str, *, batch: int | None = None, seq_len: int | None = None,
                      optimizer: str = "adam", dtype: str | None = None, amp: bool = False) -> CompGraph:
    """The captured (uncosted, uncoarsened) training step of zoo model `name`; `dtype` ("fp32", "bf16",
    "fp16") and `amp` (autocast) as `devplace.capture.capture`. The zoo builds its models in fp32."""
    from devplace.zoo.models import build_model, get_spec

    spec = get_spec(name)
    # built on the meta device: parameters and inputs have shapes but no storage, so a 1.5B-parameter model
    # captures in a few GB of RAM (capture runs it on fake tensors anyway)
    with torch.device("meta"):
        module, inputs, loss_fn = build_model(name, batch, seq_len)
    b = spec.batch if batch is None else batch
    s = spec.seq_len if seq_len is None else seq_len
    label = f"{name}-b{b}" + (f"-s{s}" if s else "") + precision_suffix(dtype, amp)
    return capture(module, inputs, loss_fn=loss_fn, optimizer=optimizer, name=label, dtype=dtype, amp=amp)


def precision_suffix(dtype: str | None, amp: bool) -> str:
    """What a captured graph's name says about its precision: "-bf16", "-amp-bf16", or nothing (the model's own)."""
    return f"-amp-{dtype or 'bf16'}" if amp else (f"-{dtype}" if dtype else "")


def zoo_graph(name: str, **options: Any) -> CompGraph:
    """The costed, colocated (and, with `max_nodes`, coarsened) training graph of zoo model `name`; options as
    `zoo_prepared`."""
    return zoo_prepared(name, **options).graph


def family_graph(family: str, index: int, *, max_nodes: int | None = FAMILY_MAX_NODES, optimizer: str = "adam",
                 batch: int | None = None, seq_len: int | None = None, device: Device | None = None,
                 costs: CostTable | None = None, dtype: str | None = None, amp: bool = False) -> CompGraph:
    """Graph `index` (0-31) of the study family `family` (cifar10, ptb, nmt), coarsened to `max_nodes`;
    captured in fp32 unless `dtype` / `amp` say otherwise (as `devplace.capture.capture`). Its meta says it is
    placed op by op (`devplace.graph.semantics`), as the seed study placed its graphs."""
    from devplace.zoo.families import family_arch, family_model

    module, inputs, loss_fn = family_model(family, index, batch=batch, seq_len=seq_len)
    graph = capture(module, inputs, loss_fn=loss_fn, optimizer=optimizer, name=f"{family}-{index}", dtype=dtype,
                    amp=amp)
    out = prepare(graph, device=device, costs=costs, max_nodes=max_nodes).graph
    return CompGraph.build(out.name, [out.node_record(v) for v in range(out.num_nodes)],
                           [out.edge_record(e) for e in range(out.num_edges)],
                           meta={**out.meta, "family": {"name": family, "index": index,
                                                        "arch": family_arch(family, index)},
                                 # the seed study's setting: every op group a decision of its own
                                 SEMANTICS_KEY: Semantics.OP_BY_OP.value})


def onnx_graph(path: str | Path, *, batch: int | None = None, optimizer: str = "adam",
               max_nodes: int | None = None, device: Device | None = None, **dims: Any) -> CompGraph:
    """The costed, colocated (and coarsened) training graph mirrored from an ONNX forward graph."""
    from devplace.capture.onnx_import import load_onnx

    graph = load_onnx(path, optimizer=optimizer, batch=batch, dims=dims or None)
    return prepare(graph, device=device, max_nodes=max_nodes).graph

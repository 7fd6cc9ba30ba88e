"""devplace's placers against the stage-partitioning algorithms of other pipeline systems (issue 21, item 5).

    PYTHONPATH=$PWD/src:$PWD/benchmarks .venv/bin/python benchmarks/peers.py \
        [--models gpt2 t5-small ...] [--clusters 4xV100-16GB mixed-fast-first mixed-slow-first] [--microbatches 8] \
        [--cache DIR]

What is measured. For each model (batch chosen so that M divides it) and cluster, every row is simulated by
devplace (`devplace.sim.simulate`, the reference model) in this run:

- default: `place_prepared(prepared, cluster)` with no placer given (placer auto), on the whole step as captured
  and costed for every device kind of the cluster (`prepare_model(..., cluster=)`); its own schedule, if any;
- pipeline: `place_prepared(prepared, cluster, placer="pipeline")`, which tries each micro-batch count the batch
  allows, each on the model captured again at batch / M, and keeps the fastest (the M it kept is printed);
- even, and the peers below, at the benchmark's M (`--microbatches`, default 8) and at each M the two placers
  kept, each row at its fastest feasible M: each splits the same units (below) into one contiguous stage per
  device, stage k on device k, and the split is simulated on the micro-batch graph
  (`capture.custom.microbatch_prepared(prepared, M)`, every op costed at batch / M for every device kind) under
  `Schedule("1f1b", M, microbatch_graph=True)`;
- ideal 1F1B, per M: the lower bound's work term (total work over all devices, per device kind) x (M + p - 1) / M.

The units are those the `even` placer cuts (`devplace.placers.even`): the graph's tie classes (a forward op with
the backward and optimizer ops autograd runs with it) in program order, cut only where a module call begins;
a unit is the run of classes from one such cut point to the next. Per unit the benchmark takes its forward +
backward seconds on each device (`hardware.cluster.op_times`, the optimizer step left out, as the peers'
profilers measure a layer's forward and backward), its parameter bytes (`param_bytes`, weights with their
gradients and Adam state, proportional to the parameter count), its forward output bytes (the activations it
stashes) and whether a numbered block (`h.7`, `layers.3`, `encoder_layer_11`) begins there.
Every unit begins where a module call begins, so every peer split is one that devplace's pipeline export can
run (torch's pipelining splits at any module call's beginning) and that its placers may choose on a captured
model (`cuts=modules`, issue 23 item 1).

The peers, each written here after its published source (our code, no copied code; none of it in `src/`):

- ds-uniform, ds-params, ds-type: DeepSpeed `PipelineModule._partition_layers` with method `uniform`
  (`partition_uniform`: equal unit counts), `parameters` (`partition_balanced` over parameter counts) and
  `type:<regex>` (`partition_balanced` over 1 per unit where a block begins, i.e. `type:` naming the block
  class); microsoft/DeepSpeed, deepspeed/runtime/utils.py and deepspeed/runtime/pipe/module.py at
  38327e07f6cd39b63418f60cedd1651b0be3e7c3. `partition_balanced` there is the dynamic programme that
  minimises (largest part - smallest part), ties to the last split point.
- torchgpipe: `balance_by_time` = `blockpartition.solve` (Barany et al.'s block partition) over each unit's
  forward + backward time in integer microseconds on the cluster's first device (where torchgpipe profiles);
  kakaobrain/torchgpipe, torchgpipe/balance/blockpartition.py and balance/__init__.py, profile.py at
  a1b4ee25574864e7650e7905a69ce156da9752ec.
- pipedream: `compute_partitioning` of PipeDream's optimizer in the straight-pipeline mode (one device per
  stage, no replication), its command line's defaults otherwise (no memory constraint, no fewer machines, no
  activation compression ratio, so transfers do not enter the DP), on the first device's times; the stage
  boundaries are read back as `analyze_partitioning` does; msr-fiddle/pipedream,
  optimizer/optimizer_graph_hierarchical.py at 7db6a1c3e64996d5b319faec6ca38cb31bfea1c4. pipedream-mem: the
  same with its memory constraint (`--use_memory_constraint --memory_size` = the first device's memory): a
  stage that is the last of m + 1 machines is taken only if ceil(p - (m + 1)) x (its units' forward output
  bytes + weight bytes, as its profiler records them: `weight_share` of the parameter bytes) fits (weight
  stashing: a copy per micro-batch in flight; the last stage is never constrained).
- alpa: `training_dp` of Alpa's stage construction with one-device submeshes and one sharding configuration:
  for each bound t_max over the distinct stage costs (ascending, stopping once t_max * M reaches the best
  cost), a DP over (stages, first unit) minimising the sum of stage costs, with stage costs <= t_max and the
  memory rule `max_n_succ_stages` = floor((memory - parameters - activations) / activations) - 1 >= number of
  stages after it (get_merged_stages_memory_stats); the cost is sum + (M - 1) * the largest stage. Stage costs
  are the first device's times and memory (Alpa profiles on one mesh of identical devices); alpa-hetero
  (speed-aware form, ours): the same DP where stage k's cost and memory are those of device k, so the DP sees
  which device each stage runs on. alpa-projects/alpa, alpa/pipeline_parallel/stage_construction.py and
  stage_profiling.py at b8078a9f75cb4c90cabb4550ee48c99ef394e209. Bounds below the smallest feasible one
  (found by bisection: feasibility only grows with t_max) are not run; where every device has the same stage
  costs the sum is the same for every split, so the first feasible bound's split is final (Alpa would run on
  without improving it). The DP table is float64 (Alpa's is float32): where several splits have the same
  cost, the one kept can differ from Alpa's by rounding (checked against Alpa's code on small random cases:
  equal costs, and with a float32 table and no early stop the same splits).

Clusters: `4xV100-16GB` (preset) and two of the same four GPUs: 2x V100-SXM2-32GB and 2x T4-16GB (65 TFLOPS fp16
tensor, 8.1 TFLOPS fp32, 320 GB/s, 16 GB; docs/clusters.md conventions: speed 65/125 = 0.52, TF32 and BF16 at
the FP32 rate on Turing) on PCIe gen3 x16, fast GPUs first (`mixed-fast-first`) or slow first
(`mixed-slow-first`).

Printed: per (model, cluster) and method the step time (s), the peak memory of the fullest device against its
capacity (over-memory rows are marked and never taken as the best), the placement time (placers: wall clock of
the search as `place_prepared` runs it, captures of micro-batches included; peers: the algorithm on the unit
costs), and each step over the best step of every feasible row; then a summary with default / best.

`--cache DIR` keeps every capture (the whole batch's and each micro-batch count's, uncosted) as a graph file in
DIR, named by model, batch and micro-batch count (`capture_file`), and reads it back on later runs instead of
capturing: then a placer's time excludes capturing but includes reading its micro-batches' graph files and costing
them for the cluster's device kinds (done on every run, so a changed cost model is seen); the first run fills the
cache (its times include the captures) and the table says which. A file is used only where the model's capture
settings and the capturing code match (the key hashes them: `capture_code`, devplace's capture and graph
modules, torch's and transformers' versions); a change there makes new files beside the old. Every run, cached or
not, places the graphs as read back from a file where it has one (a capture written and read again), so a
cached run answers what the run that filled it answered.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs are written in beyond_zoo; nothing may be downloaded

import numpy as np
from numba import njit

from devplace.app.with_torch import prepare_model
from devplace.capture.custom import (
    capture_named_model,
    microbatch_capture,
    microbatch_prepared,
    prepare_microbatch,
    prepare_named,
)
from devplace.capture.pipeline import Prepared
from devplace.errors import DevplaceError
from devplace.graph import load_graph, save_graph
from devplace.graph.batch import graph_batch
from devplace.graph.coarsen import Coarsening
from devplace.graph.compgraph import CompGraph
from devplace.graph.modules import forward_ops, module_of, module_starts
from devplace.graph.ties import tie_classes
from devplace.hardware.cluster import Cluster, op_times
from devplace.hardware.cost import cost_devices
from devplace.hardware.presets import GB, PCIE3_X16, PRESETS, TFLOPS, V100_SXM2_32GB, GpuSpec, gpus
from devplace.placers.even import _sequence, even_devices
from devplace.planning import place_graph
from devplace.sim import Schedule, ScheduleError, SimResult, lower_bound, simulate

# ------------------------------------------------------------------------------------------ models, clusters

# NVIDIA T4 (Turing): 65 TFLOPS fp16 tensor, 8.1 TFLOPS fp32, no TF32 or BF16 units (those at the fp32 rate)
T4_16GB = GpuSpec("T4-16GB", 16 * GB, 65 * TFLOPS, 320 * GB, 8.1 * TFLOPS, 8.1 * TFLOPS, 8.1 * TFLOPS, 65 * TFLOPS)


def mixed(fast_first: bool) -> Cluster:
    """2x V100-SXM2-32GB and 2x T4-16GB on PCIe gen3 x16, the V100s first or the T4s first."""
    fast, slow = gpus(V100_SXM2_32GB, 2, prefix="v100_"), gpus(T4_16GB, 2, prefix="t4_")
    name = "mixed-fast-first" if fast_first else "mixed-slow-first"
    return Cluster(name, fast + slow if fast_first else slow + fast, PCIE3_X16,
                   meta={"description": "2x V100-SXM2-32GB + 2x T4-16GB, PCIe gen3 x16 (benchmarks/peers.py)"})


CLUSTERS: dict[str, Callable[[], Cluster]] = {"mixed-fast-first": lambda: mixed(True),
                                              "mixed-slow-first": lambda: mixed(False), **PRESETS}


def vit_b_16(batch: int = 128) -> tuple[Any, ...]:
    """torchvision ViT-B/16 with its cross-entropy (benchmarks/beyond_zoo.py's case), as a custom-model factory
    (`peers:vit_b_16`), so that its micro-batches can be captured at their own size."""
    from beyond_zoo import _tv

    return _tv("vit_b_16", batch)()


def clip_b16(batch: int = 96) -> tuple[Any, ...]:
    """CLIP-B/16 with its contrastive loss (benchmarks/beyond_zoo.py's case), as a custom-model factory."""
    from beyond_zoo import _clip_b16

    return _clip_b16(batch)()


# name in the table -> (model name for prepare_model, batch); a count of micro-batches that does not divide the
# batch is left out
MODELS: dict[str, tuple[str, int]] = {
    "gpt2-xl": ("gpt2-xl", 8), "llama-1b": ("llama-1b", 8), "t5-small": ("t5-small", 32),
    "bert-base": ("bert-base", 32), "vit_b_16": ("peers:vit_b_16", 128), "clip-b16": ("peers:clip_b16", 96),
    "gpt2": ("gpt2", 8), "gpt2-xl-b4": ("gpt2-xl", 4), "llama-1b-b4": ("llama-1b", 4)}

# ---------------------------------------------------------------------------------------------- the captures


def capture_code() -> bytes:
    """What a capture depends on besides its settings: devplace's capture code (the files of `devplace.capture`
    and the graph format's), torch's and transformers' versions."""
    import torch
    import transformers

    import devplace.capture as capture_package
    import devplace.graph as graph_package

    files = [f for pkg in (capture_package, graph_package) for f in sorted(Path(pkg.__file__).parent.glob("*.py"))]
    return b"".join([f.read_bytes() for f in files] + [torch.__version__.encode(), transformers.__version__.encode()])


def capture_file(cache: Path, model: str, batch: int, microbatches: int) -> Path:
    """Where `--cache` keeps the capture of `model` at `batch` split into `microbatches` (1: the whole batch): the
    name says which, and a hash of the capture settings this script uses and of the code that captures
    (`capture_code`) keeps a file made with other settings or by other code from being read."""
    settings = repr((model, batch, microbatches, None, "adam", 0, None, False, "devplace.graph/1"))
    digest = hashlib.sha256(settings.encode() + capture_code()).hexdigest()[:12]
    return cache / f"{model.replace(':', '_')}-b{batch}-m{microbatches}-{digest}.json"


class Captures:
    """The prepared models of a run and their micro-batches (`microbatch_prepared`), each captured at its own size;
    with `cache` (`--cache DIR`) each capture is a graph file there, read back instead of captured where it exists
    (module docstring). `filled` counts the captures this run made and wrote."""

    def __init__(self, cache: Path | None) -> None:
        self.cache, self.filled = cache, 0
        if cache is not None:
            cache.mkdir(parents=True, exist_ok=True)

    def _graph(self, model: str, batch: int, m: int, capture: Callable[[], CompGraph]) -> CompGraph | None:
        """The capture read from the cache (made and written first where it is not there); None without a cache."""
        if self.cache is None:
            return None
        path = capture_file(self.cache, model, batch, m)
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            save_graph(capture(), tmp)
            tmp.replace(path)
            self.filled += 1
        return load_graph(path)

    def prepared(self, model: str, batch: int, cluster: Cluster) -> Prepared:
        """`prepare_model(model, batch=, cluster=)`, from the cache's capture where there is one."""
        graph = self._graph(model, batch, 1, lambda: capture_named_model(model, batch=batch))
        if graph is None:
            return prepare_model(model, batch=batch, cluster=cluster)
        device, kinds = cost_devices(cluster)
        # the options `prepare_model` passes, so that the micro-batches are prepared alike
        return prepare_named(graph, model, max_nodes=None, device=device, costs=None, kinds=kinds)

    def microbatch(self, prepared: Prepared, m: int) -> Prepared:
        """`microbatch_prepared(prepared, m)`, from the cache's capture where there is one (read again on every
        call: a placer's time includes reading and costing it)."""
        assert prepared.model is not None
        batch = graph_batch(prepared.full)
        graph = None if m == 1 or batch is None else self._graph(prepared.model.name, batch, m,
                                                                 lambda: microbatch_capture(prepared, m))
        return microbatch_prepared(prepared, m) if graph is None else prepare_microbatch(prepared, graph)

    def provider(self, prepared: Prepared) -> Callable[[int], tuple[CompGraph, Coarsening]]:
        """The micro-batch graphs the search asks for (`capture.custom.microbatch_graphs`), through the cache."""
        def graph_of(m: int) -> tuple[CompGraph, Coarsening]:
            micro = self.microbatch(prepared, m)
            return micro.full, micro.coarsening
        return graph_of


# ------------------------------------------------------------------------------------------------- the units

# a numbered block: its stack (the text before the number: t5's encoder and decoder, CLIP's towers) and number
BLOCK = re.compile(r"^(.*?(?:\.(?:h|layers?|blocks?)\.|encoder_layer_))(\d+)(?:[./]|$)")


@dataclass(frozen=True)
class Units:
    """The even placer's cut points as units (module docstring). `node_unit`: unit of each node; per unit:
    `times` [U, D] forward + backward seconds on each device, `params` parameter bytes (with gradients and
    optimizer state), `weights` the weights' bytes alone (what PipeDream's profiler records), `acts` forward output
    bytes, `blocks` 1 where a numbered block begins; `names`: the module that begins each unit."""

    node_unit: np.ndarray
    times: np.ndarray
    params: np.ndarray
    weights: np.ndarray
    acts: np.ndarray
    blocks: np.ndarray
    names: list[str]

    @property
    def count(self) -> int:
        return len(self.names)

    def devices(self, bounds: Sequence[int]) -> np.ndarray:
        """Device per node of a split given as unit boundaries [0, b1, ..., U]: stage k on device k."""
        part = np.zeros(self.count, dtype=np.int64)
        for k, b in enumerate(bounds[1:-1], start=1):
            part[b:] = k
        return part[self.node_unit]


def units_of(graph: CompGraph, cluster: Cluster) -> Units:
    """The units of `graph` (module docstring) and their costs on `cluster`'s devices."""
    classes = tie_classes(graph)
    seq, allowed = _sequence(graph, classes)  # what even cuts: classes in program order, where a part may begin
    labels: dict[int, str] = {}
    for v in forward_ops(graph):
        labels.setdefault(int(classes[v]), module_of(graph, v) or "")
    seq_labels = [labels.get(c, "") for c in seq]
    starts = module_starts([labels[c] for c in seq if c in labels])
    begin = [0] + [i for i, ok in enumerate(allowed) if ok and i > 0]
    unit_of_pos = np.cumsum([i in set(begin) for i in range(len(seq))]) - 1
    pos_of_class = np.empty(len(seq), dtype=np.int64)
    pos_of_class[np.asarray(seq, dtype=np.int64)] = np.arange(len(seq))
    node_unit = unit_of_pos[pos_of_class[classes]]
    n = len(begin)
    times_all = op_times(graph, cluster) * np.array([k != "optimizer" for k in graph.kind])[:, None]
    times = np.stack([np.bincount(node_unit, weights=times_all[:, d], minlength=n)
                      for d in range(cluster.num_devices)], axis=1)
    params = np.bincount(node_unit, weights=graph.param_bytes, minlength=n)
    fwd = np.zeros(graph.num_nodes)
    fwd[forward_ops(graph)] = 1.0
    acts = np.bincount(node_unit, weights=graph.output_bytes * fwd, minlength=n)
    names = [starts.get(i, seq_labels[i]) for i in begin]
    seen: set[tuple[str, int]] = set()
    blocks = np.zeros(n, dtype=np.int64)
    for u, name in enumerate(names):
        found = BLOCK.search(name)
        if found and (found.group(1), int(found.group(2))) not in seen:
            seen.add((found.group(1), int(found.group(2))))
            blocks[u] = 1
    return Units(node_unit, times, params, params * weight_share(graph), acts, blocks, names)


def weight_share(graph: CompGraph) -> float:
    """The weights' share of the parameter bytes (`param_bytes` also holds gradients and optimizer state): the
    captured parameter count times its element size over the captured parameter bytes (0.25 under fp32 Adam);
    1 where the capture does not record them."""
    cap = graph.meta.get("capture")
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
    if not isinstance(cap, dict) or not cap.get("param_bytes") or cap.get("dtype") not in sizes:
        return 1.0
    return float(cap["params"]) * sizes[cap["dtype"]] / float(cap["param_bytes"])


# -------------------------------------------------------------------------------------------------- DeepSpeed

def ds_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's `partition_uniform`: boundaries of `num_parts` parts of near-equal item counts, the
    remainder given one item each to the first parts."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def ds_partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` (the linear partition DP as written there): over prefixes i and part
    counts j, the split whose (largest part - smallest part) is least, each new part's start k taken as the last
    one of least spread; boundaries read back from the last prefix."""
    n, m = len(weights), num_parts
    if n <= m:
        return ds_partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    spread = [[inf] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0], spread[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], part), min(lo[k][j - 1], part)
                if spread[i][j] >= top - bottom:
                    spread[i][j], hi[i][j], lo[i][j], where[i][j] = top - bottom, top, bottom, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(where[bounds[-1]][j])
    return bounds[::-1]


# ------------------------------------------------------------------------------------------------- torchgpipe

def gpipe_solve(sequence: Sequence[int], partitions: int) -> list[int]:
    """torchgpipe's `blockpartition.solve` (Barany et al., "Block partitions of sequences"), returned as
    boundaries: values normalised to [0, 1] by min and range, equal-count blocks to start; while the largest
    block exceeds the smallest by more than 1, the smallest block nearest the largest takes one element from
    its neighbour on the largest one's side."""
    n = len(sequence)
    if n < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({n} < {partitions})")
    low, span = min(sequence), max(sequence) - min(sequence)
    norm = [0.0] * n if span == 0 else [(x - low) / span for x in sequence]
    ends = [n // partitions * (x + 1) for x in range(partitions - 1)] + [n]

    def sizes() -> list[tuple[float, int]]:
        return [(sum(norm[(ends[i - 1] if i else 0):ends[i]]), i) for i in range(partitions)]

    while True:
        largest, p = max(sizes())
        while True:
            smallest, q = min(sizes())
            if largest <= smallest + 1:
                return [0, *ends]
            if p < q:  # the block before q gives q its last element
                h = q - 1
                ends[h] -= 1
            else:  # the block after q gives q its first element
                h = q + 1
                ends[q] += 1
            if p == h:
                break


# -------------------------------------------------------------------------------------------------- PipeDream

def pipedream_straight(times: Sequence[float], machines: int, acts: Sequence[float] | None = None,
                       params: Sequence[float] | None = None, memory: float | None = None) -> list[int] | None:
    """PipeDream's `compute_partitioning` for a straight pipeline (`--straight_pipeline`, one machine per stage)
    with its other defaults (no fewer machines, no activation compression ratio: no transfer terms), over the
    chain of units (each unit's antichain predecessors are all units before it); A[j][m] = the least
    slowest-stage time of units 0..j on m + 1 machines, the last stage's first unit taken as the first k of
    least time; boundaries read back as `analyze_partitioning` does.

    With `memory` (`--use_memory_constraint --memory_size`), a stage that is the last of m + 1 machines stashes
    ceil((machines - (m + 1)) / 1) copies of its activations and parameters (`acts`, `params` per unit;
    PipeDream's weight stashing), and a stage over `memory` is not taken; None when no split meets it."""
    n = len(times)

    def prefix(values: Sequence[float]) -> list[float]:
        out = [0.0]
        for t in values:
            out.append(out[-1] + float(t))
        return out

    pre_t = prefix(times)
    held = prefix([a + b for a, b in zip(acts or [0.0] * n, params or [0.0] * n, strict=True)])

    def fits(first: int, last: int, used: int) -> bool:
        """Units first..last as the last stage of `used` machines, within the memory constraint."""
        return memory is None or (held[last + 1] - held[first]) * math.ceil((machines - used) / 1) <= memory

    # A[j][m] = (time, split k: last unit of the stages before, machines of the last stage)
    best: list[list[tuple[float | None, int | None]]] = [[(None, None)] * machines for _ in range(n)]
    for j in range(n):
        best[j][0] = (pre_t[j + 1], None) if fits(0, j, 1) else (None, None)
    for m in range(1, machines):
        for j in range(1, n):
            time_jm: float | None = None
            split: int | None = None
            for k in range(j):  # all predecessors of state j
                if not fits(k + 1, j, m + 1):
                    continue
                last = pre_t[j + 1] - pre_t[k + 1]
                before = best[k][m - 1][0]
                if before is None:
                    continue
                stage = max(before, last)
                if time_jm is None or time_jm > stage:
                    time_jm, split = stage, k
            best[j][m] = (time_jm, split)
    if best[n - 1][machines - 1][0] is None:
        return None
    bounds = [n]
    j, m = n - 1, machines - 1
    while best[j][m][1] is not None:
        k = best[j][m][1]
        assert k is not None
        bounds.append(k + 1)
        j, m = k, m - 1
    bounds.append(0)
    return bounds[::-1]


# ------------------------------------------------------------------------------------------------------- Alpa

@njit(cache=True)
def _alpa_dp(cost: np.ndarray, succ: np.ndarray, t_max: float) -> tuple[float, float, np.ndarray]:
    """One run of Alpa's `training_dp_impl` with one-device submeshes: cost[d, i, k] the stage of units i..k on
    the device of position d (stages in order), succ[d, i, k] its `max_n_succ_stages`. f[s, i]: s stages from
    unit i on the last s devices, least sum of stage costs <= t_max; k scanned from the last unit down, strict
    improvement. Returns (sum, largest stage of that solution, next[s, i]) or (inf, 0, ...)."""
    p, n = cost.shape[0], cost.shape[1]
    f = np.full((p + 1, n + 1), np.inf)
    top = np.zeros((p + 1, n + 1))
    nxt = np.full((p + 1, n + 1), -1, dtype=np.int64)
    f[0, n] = 0.0
    for s in range(1, p + 1):
        d = p - s
        for i in range(n - 1, -1, -1):
            for k in range(n, i, -1):
                if s - 1 > succ[d, i, k - 1]:
                    continue
                c = cost[d, i, k - 1]
                if c > t_max:
                    continue
                new = f[s - 1, k] + c
                if new < f[s, i]:
                    f[s, i] = new
                    top[s, i] = max(top[s - 1, k], c)
                    nxt[s, i] = k
    return f[p, 0], top[p, 0], nxt


def alpa_training_dp(times: np.ndarray, params: np.ndarray, acts: np.ndarray, memory: np.ndarray,
                     microbatches: int, gap: float = 1e-6) -> list[int] | None:
    """Alpa's `training_dp` (module docstring) on units with per-position costs: `times` [U, p] the units'
    seconds on the device of each stage position, `memory` [p] that device's bytes. Boundaries of the best
    split, or None when no split meets the memory rule."""
    n, p = times.shape
    pre_t = np.vstack([np.zeros((1, p)), np.cumsum(times, axis=0)])
    pre_p = np.concatenate([[0.0], np.cumsum(params)])
    pre_a = np.concatenate([[0.0], np.cumsum(acts)])
    i, k = np.triu_indices(n)  # stage of units i..k
    cost = np.full((p, n, n), np.inf)
    succ = np.full((p, n, n), -1, dtype=np.int64)
    for d in range(p):
        cost[d, i, k] = pre_t[k + 1, d] - pre_t[i, d]
        weights, act = pre_p[k + 1] - pre_p[i], pre_a[k + 1] - pre_a[i]
        room = np.floor((memory[d] - weights - act) / np.maximum(act, 1e-8)) - 1
        succ[d, i, k] = np.clip(room, -1, 10**6).astype(np.int64)
    values = np.unique(cost[np.isfinite(cost)])
    lo, hi = 0, len(values)  # bisection for the least feasible bound
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(_alpa_dp(cost, succ, float(values[mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(values):
        return None
    same = bool(np.all(times == times[:, :1]))  # every stage position costs alike: the sum never changes
    best_cost, best_next, last = math.inf, None, 0.0
    for t_max in values[lo:]:
        if t_max * microbatches >= best_cost:
            break
        if t_max - last < gap:
            continue
        total, top, nxt = _alpa_dp(cost, succ, float(t_max))
        cost_here = total + (microbatches - 1) * top
        if cost_here < best_cost:
            best_cost, best_next = cost_here, nxt
        last = float(t_max)
        if same:
            break
    assert best_next is not None
    bounds, at = [0], 0
    for s in range(p, 0, -1):
        at = int(best_next[s, at])
        bounds.append(at)
    return bounds


# --------------------------------------------------------------------------------------------------- the run

@dataclass
class Row:
    """One method's placement of one model on one cluster, simulated."""

    method: str
    step_s: float | None  # None: no placement (why says why)
    feasible: bool = False
    peak: str = "-"
    took_s: float = 0.0
    note: str = ""


def peak_text(result: SimResult, cluster: Cluster) -> str:
    """The fullest device's peak against its capacity, in GB."""
    d = int(np.argmax(result.peak_memory_bytes / cluster.memory))
    return f"{result.peak_memory_bytes[d] / 1e9:.1f}/{cluster.memory[d] / 1e9:.0f}"


def sim_row(method: str, graph: CompGraph, cluster: Cluster, devices: np.ndarray | None, schedule: Schedule,
            took_s: float, note: str = "") -> Row:
    """A split simulated under `schedule`."""
    if devices is None:
        return Row(method, None, note=note or "no split")
    try:
        result = simulate(graph, cluster, devices, schedule=schedule)
    except ScheduleError as exc:
        return Row(method, None, took_s=took_s, note=f"not a pipeline ({exc})"[:80])
    return Row(method, result.step_time_s, result.feasible, peak_text(result, cluster), took_s, note)


def placer_row(method: str, prepared: Prepared, cluster: Cluster, captures: Captures, **how: Any) -> Row:
    """The search as `place_prepared` runs it (placer auto without `how`), its micro-batches from `captures`."""
    t0 = time.perf_counter()
    try:
        placed = place_graph(prepared.graph, cluster, coarsening=prepared.coarsening, full=prepared.full,
                             microbatch_graph=captures.provider(prepared), **how)
    except DevplaceError as exc:
        return Row(method, None, took_s=time.perf_counter() - t0, note=f"{type(exc).__name__}")
    took = time.perf_counter() - t0
    sched = placed.placement.schedule
    auto = placed.placement.meta.get("placer_auto")  # placer auto: the candidate kept ("pipeline 1f1b")
    made = auto.get("placer", placed.placer) if isinstance(auto, dict) else placed.placer
    note = f"{made}" + (f", {sched.label}" if sched is not None else ", no micro-batches")
    return Row(method, placed.result.step_time_s, placed.result.feasible, peak_text(placed.result, cluster), took,
               note)


def peer_rows(micro: Prepared, cluster: Cluster, m: int) -> tuple[list[Row], float, int]:
    """even and the peers on the micro-batch graph under 1F1B with M = m; the ideal 1F1B step; the units."""
    graph, p = micro.full, cluster.num_devices
    schedule = Schedule("1f1b", m, microbatch_graph=True)
    ideal = lower_bound(graph, cluster, schedule).work_s * (m + p - 1) / m
    units = units_of(graph, cluster)
    rows = [sim_row("even", graph, cluster, even_devices(graph, cluster), schedule, 0.0)]
    first = units.times[:, 0]
    memory = cluster.memory
    splits: list[tuple[str, Callable[[], list[int] | None]]] = [
        ("ds-uniform", lambda: ds_partition_uniform(units.count, p)),
        ("ds-params", lambda: ds_partition_balanced(units.params.tolist(), p)),
        ("ds-type", lambda: ds_partition_balanced(units.blocks.tolist(), p)),
        ("torchgpipe", lambda: gpipe_solve([int(t * 1e6) for t in first], p)),
        ("pipedream", lambda: pipedream_straight(first.tolist(), p)),
        ("pipedream-mem", lambda: pipedream_straight(first.tolist(), p, units.acts.tolist(),
                                                     units.weights.tolist(), float(memory[0]))),
        ("alpa", lambda: alpa_training_dp(np.repeat(first[:, None], p, axis=1), units.params, units.acts,
                                          np.full(p, memory[0]), m)),
        ("alpa-hetero", lambda: alpa_training_dp(units.times, units.params, units.acts, memory, m)),
    ]
    for name, split in splits:
        t0 = time.perf_counter()
        bounds = split()
        took = time.perf_counter() - t0
        devices = None if bounds is None else units.devices(bounds)
        note = "" if bounds is None else "units " + "/".join(str(b - a) for a, b in itertools.pairwise(bounds))
        rows.append(sim_row(name, graph, cluster, devices, schedule, took,
                            note if bounds is not None else "no split fits its memory rule"))
    for r in rows:
        r.note = f"M={m}" + (f", {r.note}" if r.note else "")
    return rows, ideal, units.count


def kept_m(row: Row) -> int | None:
    """The micro-batch count a placer's row kept (its note), None without micro-batches."""
    found = re.search(r" M=(\d+)", row.note)
    return int(found.group(1)) if found else None


def run(name: str, cluster: Cluster, ms: list[int], cache: dict[Any, Prepared], captures: Captures
        ) -> tuple[list[Row], dict[int, float], int]:
    """Every row of one model on one cluster: the placers, then even and each peer at its fastest M of `ms` and
    of the counts the placers kept (over-memory only where no M fits); the ideal 1F1B step per M; the units."""
    model, batch = MODELS[name]
    ref, kinds = cost_devices(cluster)
    key = (model, batch, ref.kind, tuple(k.kind for k in kinds))
    if key not in cache:
        cache[key] = captures.prepared(model, batch, cluster)
    prepared = cache[key]
    rows = [placer_row("default", prepared, cluster, captures),
            placer_row("pipeline", prepared, cluster, captures, placer="pipeline")]
    counts = sorted(m for m in {*ms, *(m for m in map(kept_m, rows) if m is not None and m > 1)} if batch % m == 0)
    best: dict[str, Row] = {}
    ideal: dict[int, float] = {}
    count = 0
    for m in counts:
        if (*key, m) not in cache:
            cache[(*key, m)] = captures.microbatch(prepared, m)
        peers, ideal[m], count = peer_rows(cache[(*key, m)], cluster, m)
        for r in peers:
            old = best.get(r.method)
            if old is None or _rank(r) < _rank(old):
                best[r.method] = r
    return rows + list(best.values()), ideal, count


def _rank(row: Row) -> tuple[int, float]:
    """Order of rows: feasible before over memory before no placement, then by step time."""
    if row.step_s is None:
        return (2, math.inf)
    return (0 if row.feasible else 1, row.step_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--clusters", nargs="+", default=["4xV100-16GB", "mixed-fast-first", "mixed-slow-first"],
                    choices=list(CLUSTERS))
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8],
                    help="M of even, the peers and the ideal 1F1B (also run at the M the placers keep)")
    ap.add_argument("--cache", type=Path, default=None, metavar="DIR",
                    help="keep the captures as graph files in DIR and read them back on later runs (placing times "
                         "then exclude capturing)")
    args = ap.parse_args()
    cache: dict[Any, Prepared] = {}
    captures = Captures(args.cache)
    summary: list[str] = []
    print(f"1F1B; even and the peers at M in {args.microbatches} and the M the placers kept, each at its fastest; "
          "steps in s; peak GB / capacity of the fullest device; 'over' marks a row over memory (never the best)\n")
    print("| model | cluster | method | step (s) | / best | peak GB | placing (s) | how |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for name in args.models:
        for cname in args.clusters:
            cluster = CLUSTERS[cname]()
            rows, ideal, count = run(name, cluster, args.microbatches, cache, captures)
            fits = [r for r in rows if r.step_s is not None and r.feasible]
            best = min(fits, key=lambda r: r.step_s or math.inf) if fits else None
            for r in rows:
                step = "-" if r.step_s is None else f"{r.step_s:.4f}" + ("" if r.feasible else " over")
                ratio = (f"{r.step_s / best.step_s:.3f}" if best and best.step_s and r.step_s is not None
                         and r.feasible else "-")
                print(f"| {name} | {cname} | {r.method} | {step} | {ratio} | {r.peak} | {r.took_s:.2f} | "
                      f"{r.note} |", flush=True)
            for m, at in ideal.items():
                print(f"| {name} | {cname} | ideal 1F1B | {at:.4f} | "
                      f"{at / best.step_s if best and best.step_s else math.nan:.3f} | | | M={m}, {count} units |")
            default = rows[0]
            behind = (f"{default.step_s / best.step_s:.3f}" if best and best.step_s and default.step_s is not None
                      and default.feasible else "-")
            pipe = rows[1]
            summary.append(
                f"| {name} | {cname} | "
                + ("-" if default.step_s is None else f"{default.step_s:.4f}" + ("" if default.feasible else " over"))
                + f" | {default.note} | "
                + ("-" if pipe.step_s is None else f"{pipe.step_s:.4f}")
                + f" | {best.method if best else '-'} {best.step_s if best else math.nan:.4f} | "
                + ", ".join(f"M={m} {at:.4f}" for m, at in ideal.items()) + " | "
                f"{behind} | {default.took_s:.1f} |")
    print("\n| model | cluster | default (s) | default's answer | pipeline (s) | best of all (s) | ideal 1F1B (s) "
          "| default / best | default placing (s) |")
    print("|---|---|---:|---|---:|---|---:|---:|---:|")
    print("\n".join(summary))
    if args.cache is None:
        print("\nPlacing times include capturing each micro-batch count (no --cache).")
    else:
        print(f"\nCaptures from {args.cache}: {captures.filled} made and written by this run (the rows that made "
              "them include capturing in their placing time); the others read back, placing times excluding capture "
              "but including reading and costing the micro-batches' graph files.")


if __name__ == "__main__":
    main()

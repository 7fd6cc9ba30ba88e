"""What a graph's metadata says about its batch: the batch it was captured at, and whether it is one
micro-batch of a larger step (a model captured at batch / M to be run M times per step under a schedule)."""

from __future__ import annotations

import numbers
from typing import Any

from devplace.graph.compgraph import CompGraph

MICROBATCHES_META_KEY = "microbatches"  # graph meta: this graph is one micro-batch of a step that runs it M times
# ops whose result depends on the whole batch they see: training-mode batch normalisation (statistics of its batch)
BATCH_STATISTICS_OPS = frozenset({
    "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_functional", "aten.native_batch_norm",
    "aten._batch_norm_with_update", "aten._batch_norm_with_update_functional", "aten.cudnn_batch_norm",
    "aten.miopen_batch_norm"})


def _count(value: Any) -> int | None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
    return int(value) if ok else None


def graph_batch(graph: CompGraph) -> int | None:
    """The batch size the graph was captured at (meta["capture"]["batch"]), or None when it records none (a
    hand-written JSON graph, or one without capture metadata)."""
    cap = graph.meta.get("capture")
    return _count(cap.get("batch")) if isinstance(cap, dict) else None


def graph_microbatches(graph: CompGraph) -> int | None:
    """M when `graph` is one micro-batch of a step (meta["microbatches"], written where a model is captured at
    batch / M), else None: the graph is the whole step."""
    return _count(graph.meta.get(MICROBATCHES_META_KEY))


def microbatch_counts(batch: int | None, choices: tuple[int, ...]) -> tuple[int, ...]:
    """The counts of `choices` that split `batch` into equal micro-batches (all of them when the batch is not
    known)."""
    return choices if batch is None else tuple(m for m in choices if batch % m == 0)


def divisors_text(batch: int) -> str:
    """"1, 2, 4": the micro-batch counts that split `batch` into equal micro-batches, for messages."""
    return ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)


def batch_statistics_ops(graph: CompGraph) -> list[int]:
    """The ops of `graph` whose result depends on every sample of the batch they see (`BATCH_STATISTICS_OPS`:
    BatchNorm in training mode; not in eval mode, not LayerNorm or GroupNorm). Under a micro-batch schedule each
    normalises its micro-batch alone, so a pipelined step of such a graph is not the step of the whole batch
    (its loss and gradients differ)."""
    return [v for v, op in enumerate(graph.op) if op.rpartition(".")[0] in BATCH_STATISTICS_OPS
            or op in BATCH_STATISTICS_OPS]


def microbatching_note(graph: CompGraph) -> str | None:
    """One sentence saying that micro-batching changes `graph`'s result, and why (None when it does not)."""
    ops = batch_statistics_ops(graph)
    if not ops:
        return None
    return (f"micro-batching changes this model's result: its {len(ops)} BatchNorm op(s) normalise each micro-batch "
            "by that micro-batch's own statistics, so a pipelined step computes another loss and other gradients "
            "than the step of the whole batch")

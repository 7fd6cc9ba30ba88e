"""What a graph's metadata says about its batch: the batch it was captured at, and whether it is one
micro-batch of a larger step (a model captured at batch / M to be run M times per step under a schedule)."""

from __future__ import annotations

import numbers
from typing import Any

from devplace.graph.compgraph import CompGraph

MICROBATCHES_META_KEY = "microbatches"  # graph meta: this graph is one micro-batch of a step that runs it M times


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

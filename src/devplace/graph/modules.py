"""Module paths of a captured graph's ops, and where in the forward program a module call begins.

The capture names every op `<module path>/<aten op>#<n>` and records its module path as the "module" extra key
(docs/capture-format.md); a coarse node of one colocation group keeps its forward op's id as its `group`, so
its module is that id's prefix. These helpers are shared by the `even` and `pipeline` placers, hand-made module
maps, coarsening and the exports (pipeline split points, device maps), which all cut the forward program at
module boundaries.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from devplace.errors import GraphError
from devplace.graph.compgraph import CompGraph

__all__ = ["SEGMENTS_KEY", "ancestors", "forward_ops", "group_segments", "has_modules", "module_of", "module_starts",
           "numbered_block", "segment_spans"]

SEGMENTS_KEY = "segments"  # node extra key of a coarse node: [first, last] segment of its forward ops
# a numbered block: `h.7`, `layers.3`, `block.0`, torchvision's `encoder_layer_11`; the text before the number
# names its stack (t5's encoder and decoder, CLIP's two towers have blocks of the same numbers)
LAYER = re.compile(r"^(.*?(?:\.(?:h|layers?|blocks?)\.|encoder_layer_))(\d+)[./]")


def numbered_block(name: str) -> tuple[str, int] | None:
    """(stack, number) of the numbered block (a transformer layer, a ResNet block) an op id or module path
    names, or None: "model.layers.3.mlp/mm#0" -> ("model.layers.", 3)."""
    found = LAYER.search(name)
    return (found.group(1), int(found.group(2))) if found else None


def module_of(graph: CompGraph, v: int) -> str | None:
    """Module path of node v: its "module" extra key; for a coarse node without one, the module of the forward
    op id it is grouped with (`group`, else its "tie" label). None when the graph says nothing."""
    extra = graph.node_extra[v] if graph.node_extra else {}
    m = extra.get("module")
    if isinstance(m, str):
        return m
    for ref in (graph.group[v], extra.get("tie")):
        if isinstance(ref, str) and "/" in ref and not ref.startswith("input/"):
            return ref.rpartition("/")[0]
    return None


def has_modules(graph: CompGraph) -> bool:
    """True when some forward op has a non-empty module path (a captured graph, or a coarsening of one)."""
    return any(graph.kind[v] == "forward" and module_of(graph, v) for v in range(graph.num_nodes))


def forward_ops(graph: CompGraph) -> list[int]:
    """Forward op nodes (not inputs) in program order: the capture records them in execution order, so node
    index order is the forward program."""
    return [v for v in range(graph.num_nodes) if graph.kind[v] == "forward" and graph.op[v] != "input"]


def ancestors(module: str) -> list[str]:
    """`module` and every enclosing module, outermost first, the root "" included: "a.b" -> ["", "a", "a.b"]."""
    parts = module.split(".") if module else []
    return [""] + [".".join(parts[:j]) for j in range(1, len(parts) + 1)]


def module_starts(modules: Sequence[str], callable_modules: Collection[str] | None = None) -> dict[int, str]:
    """Positions of a forward op sequence (its ops' module paths, in program order) where a module's first call
    begins: position -> the outermost module (not the root) whose first op is there.

    These are the places where `torch.distributed.pipelining` can split (at a module call's beginning) and
    where a module-granular device map can change device without splitting a module. Only called modules
    are candidates: a path prefix such as a `ModuleList` ("layers" of "layers.0") is a container that is
    never called, so no split can be hooked on it. `callable_modules` names them (from the model: modules
    with a forward); without it, only modules that some op names as its own count (so an `nn.Sequential`
    without ops of its own gives way to its first child, which begins at the same op), and only modules
    called once (Swin's `stochastic_depth` runs twice per block). Position 0 is never a split point and is
    left out.
    """
    called = set(modules) | set(callable_modules or ())
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, m in enumerate(modules):
        for name in ancestors(m)[1:]:
            first.setdefault(name, i)
            last[name] = i
            count[name] = count.get(name, 0) + 1
    # one call of a module runs one contiguous stretch of the program (every op meanwhile is inside it); a
    # module whose ops lie in several stretches is called several times, and a split at its beginning would
    # split at every call
    once = {n for n in first if last[n] - first[n] + 1 == count[n]}
    out: dict[int, str] = {}
    for i, m in enumerate(modules):
        if i == 0:
            continue
        name = next((n for n in ancestors(m)[1:] if first[n] == i and n in called and n in once), None)
        if name is not None:
            out[i] = name
    return out


def segment_spans(graph: CompGraph) -> np.ndarray:
    """int64[nodes, 2]: per node, the first and last *segment* its forward ops lie in; (-1, -1) for a node without
    forward ops, and for every node of a graph without module paths.

    Segments are the stretches of the forward program between consecutive `module_starts` of the forward ops'
    module paths (without the model: modules with ops of their own), numbered from 0: where a pipeline export
    can cut (`devplace.runtime.export.pipeline_split`), since torch's pipelining splits at a module call's
    beginning (a decoder layer's, its attention's or one projection's alike: tests/test_pipeline_run.py). A
    coarse graph's nodes record their members' span (the "segments" extra key, written by coarsening: the ops
    of a coarse graph are not the forward program); any other graph's spans are computed from its ops' module
    paths."""
    spans = np.full((graph.num_nodes, 2), -1, dtype=np.int64)
    extra = graph.node_extra or []
    nodes = [v for v, x in enumerate(extra) if SEGMENTS_KEY in x]
    stored = [extra[v][SEGMENTS_KEY] for v in nodes]
    if stored and not _stored_spans(stored, spans, nodes):
        for v, span in zip(nodes, stored, strict=True):  # the rule node by node: the first wrong one named
            ints = isinstance(span, list) and len(span) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                      for i in span)
            if not ints or not 0 <= span[0] <= span[1] < 2**63:
                raise GraphError(f"graph {graph.name!r}, node {graph.ids[v]!r}: \"{SEGMENTS_KEY}\" must be [first, "
                                 f"last] segment indices (0 <= first <= last < 2**63), got {span!r}; coarsen the "
                                 "capture again")
            spans[v] = span
    if stored or not has_modules(graph):
        return spans
    fwd = forward_ops(graph)
    mods = [module_of(graph, v) or "" for v in fwd]
    cuts = np.asarray(sorted(module_starts(mods)), dtype=np.int64)
    spans[fwd] = np.searchsorted(cuts, np.arange(len(fwd)), side="right")[:, None]
    return spans


def _stored_spans(stored: list[Any], spans: np.ndarray, nodes: list[int]) -> bool:
    """Write the stored spans of `nodes` into `spans` as one array where each is a list of two plain ints, first
    <= last, within int64 and first >= 0 (what a coarsening writes: one per coarse node, read on every placement
    of a view); False, writing nothing, where any is not (`segment_spans` then checks them one by one)."""
    if set(map(type, stored)) != {list} or set(map(len, stored)) != {2} or set(
            map(type, itertools.chain.from_iterable(stored))) != {int}:
        return False
    try:
        arr = np.array(stored, dtype=np.int64)
    except OverflowError:
        return False
    if not ((arr[:, 0] >= 0) & (arr[:, 0] <= arr[:, 1])).all():
        return False
    spans[nodes] = arr
    return True


def group_segments(spans: np.ndarray, members: Sequence[int]) -> list[int] | None:
    """The span of a group of nodes (a coarse node, a folded tie class): [first, last] over its members'
    `segment_spans`; None when no member has forward ops in a segment."""
    own = spans[np.asarray(members, dtype=np.int64)]
    own = own[own[:, 0] >= 0]
    return [int(own[:, 0].min()), int(own[:, 1].max())] if own.size else None

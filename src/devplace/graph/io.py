"""Load and save `devplace.graph/1` files."""

from __future__ import annotations

from pathlib import Path

from devplace.errors import GraphError
from devplace.graph.compgraph import DOC_KEYS, FORMAT, CompGraph
from devplace.graph.jsonio import read_json, write_json


def load_graph(path: str | Path, *, max_bytes: int | None = None) -> CompGraph:
    """Read and validate a `devplace.graph/1` file; errors name the file and what is wrong.

    A file longer than the input limit (`max_bytes`, default DEVPLACE_MAX_INPUT_BYTES or 256 MiB) is refused.
    """
    doc = read_json(path, FORMAT, max_bytes=max_bytes)
    nodes, edges = doc.get("nodes"), doc.get("edges", [])
    for key, val in (("nodes", nodes), ("edges", edges)):
        if not isinstance(val, list):
            got = "missing" if val is None and key not in doc else f"got {val!r}"[:80]
            raise GraphError(f"{path}: \"{key}\" must be a JSON list of objects ({got})")
    name = doc.get("name", Path(path).stem)
    if not isinstance(name, str):
        raise GraphError(f"{path}: \"name\" must be a string, got {name!r}")
    meta = {k: v for k, v in doc.items() if k not in DOC_KEYS}
    try:
        return CompGraph.build(name, nodes, edges, meta=meta)
    except GraphError as exc:
        raise GraphError(f"{path}: {exc}") from None


def save_graph(graph: CompGraph, path: str | Path) -> None:
    """Write `graph` as `devplace.graph/1`; load_graph(save_graph(g)) gives an equal graph."""
    write_json(path, graph.to_dict())

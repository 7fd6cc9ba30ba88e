"""Load and save `devplace.graph/1` files."""

from __future__ import annotations

from pathlib import Path

from devplace.errors import GraphError
from devplace.graph.compgraph import FORMAT, CompGraph
from devplace.graph.jsonio import read_json, write_json


def load_graph(path: str | Path) -> CompGraph:
    """Read and validate a `devplace.graph/1` file; errors name the file and what is wrong."""
    doc = read_json(path, FORMAT)
    nodes, edges = doc.get("nodes"), doc.get("edges", [])
    if not isinstance(nodes, list) or not isinstance(edges, list):
        raise GraphError(f"{path}: \"nodes\" and \"edges\" must be JSON lists")
    name = doc.get("name", Path(path).stem)
    if not isinstance(name, str):
        raise GraphError(f"{path}: \"name\" must be a string, got {name!r}")
    meta = {k: v for k, v in doc.items() if k not in ("format", "name", "nodes", "edges")}
    try:
        return CompGraph.build(name, nodes, edges, meta=meta)
    except GraphError as exc:
        raise GraphError(f"{path}: {exc}") from None


def save_graph(graph: CompGraph, path: str | Path) -> None:
    """Write `graph` as `devplace.graph/1`; load_graph(save_graph(g)) gives an equal graph."""
    write_json(path, graph.to_dict())

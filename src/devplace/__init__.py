"""devplace: device placement for model-parallel training, with the graph traversal order as a parameter.

The public API: load graphs, clusters and placements, place (`order="auto"` picks the order), simulate a
placement, compute the lower bound; `plan` a module's training step and `apply` it (devplace.runtime); `train` a
learned placer's policy over many graphs. Studies: `devplace.study.run_study`.
"""

from typing import Any

from devplace.errors import DevplaceError
from devplace.graph import CompGraph, Placement, Semantics, load_graph, load_placement, save_graph, save_placement
from devplace.hardware import Cluster, load_cluster, save_cluster
from devplace.hardware.features import graph_features
from devplace.orders import traversal_order
from devplace.placers import place, placer_names
from devplace.sim import SimResult, lower_bound, simulate

__version__ = "0.1.0"


# Imported on first use (PEP 562), so that `import devplace` does not load torch: name -> module.
_LAZY = {"train": "devplace.placers.rl.trainer", "plan": "devplace.runtime.plan",
         "load_plan": "devplace.runtime.plan", "placement_from_module_map": "devplace.runtime.module_map"}


def __getattr__(name: str) -> Any:
    """`devplace.train` (one placeto policy over many graphs), `devplace.plan` (capture, cost, coarsen, place and
    simulate a module's training step), `devplace.load_plan` and `devplace.placement_from_module_map` (a hand-made
    device_map or split list as a placement), imported when first used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'devplace' has no attribute {name!r}")


__all__ = ["Cluster", "CompGraph", "DevplaceError", "Placement", "Semantics", "SimResult", "graph_features",
           "load_cluster", "load_graph", "load_placement", "load_plan", "lower_bound", "place",
           "placement_from_module_map", "placer_names", "plan", "save_cluster", "save_graph", "save_placement",
           "simulate", "train", "traversal_order"]

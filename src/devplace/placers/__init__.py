"""Placers behind one interface: `place(graph, cluster, *, placer, order, seed, **settings)`.

Each placer is one module of this package, registered by name with `@register`; `placer_names()` lists
them and `devplace placers` shows which ones walk the graph in the traversal order. `place` and
`place_expanded` run the one search (`devplace.placers.search`).
"""

from devplace.placers.memory import MemoryNeeds, NoFitError, memory_needs, no_fit_error
from devplace.placers.registry import (
    PlacerError,
    PlacerOutput,
    PlacerSpec,
    get_placer,
    placer_names,
    register,
)
from devplace.placers.search import SearchProgress, SearchResult, Tried, place, place_expanded, search_placement

__all__ = ["MemoryNeeds", "NoFitError", "PlacerError", "PlacerOutput", "PlacerSpec", "SearchProgress",
           "SearchResult", "Tried", "get_placer", "memory_needs", "no_fit_error", "place", "place_expanded",
           "placer_names", "register", "search_placement"]

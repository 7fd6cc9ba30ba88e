"""The traversal-order study (DESIGN.md section 9): a TOML grid of graphs x clusters x placers x orders x seeds,
run cell by cell on a local process pool or Ray, one SQLite row per cell.

`run_study(spec_or_path, db, backend="local", workers=1)` runs it; `load_study` reads a definition or a preset;
`read_cells(db)` gives the rows. Names are imported lazily, so `import devplace.study` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StudySpec", "expand", "load_study", "read_cells", "run_study"]


def __getattr__(name: str) -> Any:
    if name in ("StudySpec", "load_study"):
        from devplace.study import spec

        return getattr(spec, name)
    if name == "expand":
        from devplace.study.grid import expand

        return expand
    if name == "read_cells":
        from devplace.study.store import read_cells

        return read_cells
    if name == "run_study":
        from devplace.study.runner import run_study

        return run_study
    raise AttributeError(f"module 'devplace.study' has no attribute {name!r}")

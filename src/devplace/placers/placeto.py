"""Registers `placeto`, which lives in `devplace.placers.rl.placeto` (the registry imports only top-level modules)."""

from devplace.placers.rl.placeto import placeto  # noqa: F401

"""Built-in cluster presets (placeholder: the full set and docs/clusters.md are being written)."""

from __future__ import annotations

from collections.abc import Callable

from devplace.hardware.cluster import Cluster, Device, Link

GB = 1e9


def _k80x2() -> Cluster:
    devs = tuple(Device(f"gpu{i}", 12 * GB * 1.0, 1.0, kind="K80") for i in range(2))
    return Cluster("2xK80", devs, Link(6e9, 1e-5))


PRESETS: dict[str, Callable[[], Cluster]] = {"2xK80": _k80x2}

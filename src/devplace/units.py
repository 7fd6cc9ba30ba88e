"""Sizes and durations as people read them, for messages and tables at every layer; imports nothing."""

from __future__ import annotations


def fmt_bytes(x: float) -> str:
    """Bytes in decimal units (GB = 1e9), as the cluster presets state capacities: "1.50 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_time(s: float) -> str:
    """Seconds with a unit chosen by magnitude: "1.250 s", "12.345 ms", "3.2 µs"."""
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"

"""Sizes and durations as people read them, for messages, tables and chart labels at every layer; imports
nothing.

Two styles of the same units: the default, fixed decimals for tables and messages ("1.50 GB", "12.500 ms"),
and `digits=N` significant digits for compact labels such as the timeline's ("1.5 GB", "12.5 ms").
"""

from __future__ import annotations

import math

_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_BYTE_UNITS_COMPACT = (("TB", 1e12), *_BYTE_UNITS)


def fmt_bytes(x: float, digits: int | None = None) -> str:
    """Bytes in decimal units (GB = 1e9), as the cluster presets state capacities: "1.50 GB"; with `digits`,
    that many significant digits, up to TB: "1.5 GB" (digits=3)."""
    if digits is None:
        for unit, scale in _BYTE_UNITS:
            if abs(x) >= scale:
                return f"{x / scale:.2f} {unit}"
        return f"{x:.0f} B"
    # a value that rounds up to the next unit takes it: 999.7 MB at 3 digits is "1 GB", not "1e+03 MB"
    rounds_up = 1.0 - 0.5 * 10.0 ** -digits
    for unit, scale in _BYTE_UNITS_COMPACT:
        if abs(x) >= scale * rounds_up:
            return f"{x / scale:.{digits}g} {unit}"
    return f"{x:.0f} B"


def time_unit(extent_s: float) -> tuple[str, float]:
    """The unit for durations up to `extent_s` seconds and its scale: ("ms", 1e3) for 0.0125."""
    if extent_s >= 1.0:
        return "s", 1.0
    if extent_s >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def fmt_time(s: float, digits: int | None = None) -> str:
    """Seconds with a unit chosen by magnitude: "1.250 s", "12.345 ms", "3.2 µs"; with `digits`, that many
    significant digits: "12.35 ms" (digits=4), and a non-finite value as Python writes it."""
    if digits is None:
        unit, scale = time_unit(s)
        return f"{s * scale:.1f} {unit}" if unit == "µs" else f"{s * scale:.3f} {unit}"
    if not math.isfinite(s):
        return str(s)
    unit, scale = time_unit(abs(s))
    return f"{s * scale:.{digits}g} {unit}"

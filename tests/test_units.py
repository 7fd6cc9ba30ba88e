"""`devplace.units`: the size and duration formats of messages and tables."""

from __future__ import annotations

import math

import pytest

from devplace.units import fmt_bytes, fmt_time


@pytest.mark.parametrize(("x", "text"), [(0, "0 B"), (999, "999 B"), (1000, "1.00 kB"), (1.5e6, "1.50 MB"),
                                         (16e9, "16.00 GB"), (-2e9, "-2.00 GB")])
def test_fmt_bytes_decimal_units(x: float, text: str) -> None:
    assert fmt_bytes(x) == text


@pytest.mark.parametrize(("s", "text"), [(2.0, "2.000 s"), (0.0125, "12.500 ms"), (1e-3, "1.000 ms"),
                                         (3.2e-6, "3.2 µs"), (0.0, "0.0 µs")])
def test_fmt_time_unit_by_magnitude(s: float, text: str) -> None:
    assert fmt_time(s) == text


@pytest.mark.parametrize(("x", "text"), [(0, "0 B"), (999, "999 B"), (999.7e6, "1 GB"), (999.4e6, "999 MB"),
                                         (1.5e9, "1.5 GB"), (2.5e12, "2.5 TB"), (-2e9, "-2 GB")])
def test_fmt_bytes_significant_digits(x: float, text: str) -> None:
    assert fmt_bytes(x, digits=3) == text


@pytest.mark.parametrize(("s", "text"), [(2.5, "2.5 s"), (0.012345, "12.35 ms"), (4.2e-5, "42 µs"),
                                         (-0.5, "-500 ms"), (math.inf, "inf"), (0.0, "0 µs")])
def test_fmt_time_significant_digits(s: float, text: str) -> None:
    assert fmt_time(s, digits=4) == text


def test_the_timeline_has_no_formatters_of_its_own() -> None:
    from devplace.sim import timeline

    assert not hasattr(timeline, "format_time") and not hasattr(timeline, "format_bytes")
    assert timeline.fmt_time is fmt_time and timeline.fmt_bytes is fmt_bytes


def test_summary_keeps_the_names_for_the_cli() -> None:
    from devplace.sim import summary

    assert summary.fmt_bytes is fmt_bytes and summary.fmt_time is fmt_time

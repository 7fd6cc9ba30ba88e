"""`devplace.units`: the size and duration formats of messages and tables."""

from __future__ import annotations

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


def test_summary_keeps_the_names_for_the_cli() -> None:
    from devplace.sim import summary

    assert summary.fmt_bytes is fmt_bytes and summary.fmt_time is fmt_time

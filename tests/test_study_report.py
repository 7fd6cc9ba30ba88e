"""Study analysis and report from a small fixture database with a known answer (tests/study_fixture.py)."""

from __future__ import annotations

import csv
import math
import sys

import pytest

from devplace.cli import main
from devplace.study import analysis as an
from devplace.study.report import ReportError, write_report
from study_fixture import EFFECT, GRAPHS, fixture_rows, write_fixture_db


@pytest.fixture
def rows() -> list[dict]:
    from devplace.study.store import decode_row

    return [decode_row(r) for r in fixture_rows()]


def test_units_group_by_graph_and_skip_orderless_placers(rows) -> None:
    units = an.build_units(rows)
    assert {u.placer for u in units} == {"greedy", "m-topo", "placeto"}  # m-etf ignores the order
    assert len(units) == 2 * GRAPHS * 3
    u = next(u for u in units if u.graph == "fa/0" and u.placer == "greedy")
    assert u.missing == {"bfs": 1} and len(u.times["bfs"]) == 1  # the failed seed is counted, not used
    assert u.best_order() == "bfs"
    assert u.relative()["topo"] == pytest.approx(EFFECT["fa"]["topo"], rel=0.01)


def test_cell_counts_report_failed_and_infeasible(rows) -> None:
    counts = an.cell_counts(rows)
    assert (counts["failed"], counts["infeasible"]) == (2, 1)
    assert counts["ok"] + 3 == counts["cells"] == len(rows)
    assert counts["by_placer"]["greedy"] == {"cells": 2 * GRAPHS * 4 * 2, "failed": 1, "infeasible": 1}
    assert counts["errors"][0][1] == 2 and "NoFitError" in counts["errors"][0][0]


def test_family_summary_finds_each_familys_best_order(rows) -> None:
    summary = {(s["family"], s["placer"]): s for s in an.family_summary(an.build_units(rows))}
    assert summary[("fa", "greedy")]["best"] == "bfs"
    assert summary[("fb", "greedy")]["best"] == "topo"
    # random is left out of best/worst/spread when deterministic walks exist
    assert summary[("fa", "greedy")]["worst"] == "topo"
    assert summary[("fa", "greedy")]["spread"] == pytest.approx(0.25, abs=0.01)
    top = summary[("fb", "m-topo")]["orders"]["topo"]
    assert top["low"] <= top["mean"] <= top["high"] and top["mean"] == pytest.approx(1.0, abs=0.002)
    assert summary[("fa", "greedy")]["wins"] == {"bfs": GRAPHS}


def test_friedman_one_order_always_best() -> None:
    # bfs best and random worst in every graph of both families: rank 1 and a tiny p
    effect = {f: {"bfs": 1.0, "topo": 1.2, "dfs-preorder": 1.1, "random": 1.5} for f in ("fa", "fb")}
    units = [u for u in an.build_units(fixture_rows(order_effect=effect)) if u.placer == "placeto"]
    fr = an.friedman(units)
    assert fr["ranks"]["bfs"] == 1.0 and fr["ranks"]["random"] == 4.0
    assert fr["n"] == 2 * GRAPHS and fr["dropped"] == 0
    assert fr["p"] < 1e-4
    assert fr["cd"] == pytest.approx(2.569 * math.sqrt(4 * 5 / (6 * fr["n"])))


def test_friedman_no_difference_gives_p_one_and_counts_dropped(rows) -> None:
    effect = {f: {"bfs": 1.0, "topo": 1.0, "dfs-preorder": 1.0} for f in ("fa", "fb")}
    units = [u for u in an.build_units(fixture_rows(order_effect=effect)) if u.placer == "placeto"]
    assert an.friedman(units)["p"] == 1.0
    units = an.build_units(rows)
    units[0].times["bfs"] = []  # an order with no usable seed: the unit leaves the test, counted
    fr = an.friedman([u for u in units if u.placer == units[0].placer])
    assert fr["dropped"] == 1 and fr["n"] == 2 * GRAPHS - 1


def test_nemenyi_constants_match_the_studentized_range() -> None:
    assert an.nemenyi_q(10) == 3.164
    # the table (Demšar 2006) and scipy's studentized range agree where both exist
    from scipy import stats

    assert stats.studentized_range.ppf(0.95, 10, 1e6) / math.sqrt(2) == pytest.approx(3.164, abs=2e-3)
    assert an.nemenyi_q(11) == pytest.approx(3.219, abs=2e-3)


def test_features_separate_the_winning_orders(rows) -> None:
    units = [u for u in an.build_units(rows) if u.placer == "greedy"]
    sep = an.feature_separation(units)
    assert sep[0]["feature"] == "branching_share" and sep[0]["p"] < 0.01
    corr = an.feature_correlations(units, ["branching_share", "sources"])
    assert corr["branching_share"]["topo"][0] < -0.5  # topo falls behind less as branching grows
    assert corr["branching_share"]["bfs"][0] > 0.5
    assert math.isnan(corr["sources"]["topo"][0])  # a constant feature has no correlation


def test_report_has_every_section_and_plot(tmp_path) -> None:
    db = write_fixture_db(tmp_path / "fixture.sqlite")
    out = tmp_path / "report"
    written = write_report(db, out, command="devplace study report fixture.sqlite -o report")
    names = {p.name for p in written}
    for f in ("report.md", "results.csv", "order_model.json", "heatmap.png", "bars_fa.png", "bars_fb.png",
              "cd_greedy.png", "cd_m-topo.png", "cd_placeto.png", "curves_placeto.png"):
        assert f in names and (out / f).stat().st_size > 0, f
    assert (out / "bars_fa.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    for heading in ("## Setting", "## Cells", "## Per-family results", "## Do the orders differ?",
                    "## Graph features and the winning order", "## Recommendation rules and their validation",
                    "## Does the best order depend on the family?", "## The paper's question, tested",
                    "## Learned placers against the classic placers and one device", "## Learning curves"):
        assert heading in md, heading
    assert "2 failed, 1 infeasible" in md
    assert "branching_share" in md  # the rule the tree found
    assert "![critical difference, greedy](cd_greedy.png)" in md and "curves_placeto.png" in md
    # the fixture's families rank the orders differently (bfs best in fa, topo in fb): the interaction survives
    assert "- **greedy**: the order matters on the graphs studied in 2 of 2 families (fa, fb)" in md
    assert "The best order depends on the family: **yes**" in md
    with (out / "results.csv").open() as fh:
        table = list(csv.reader(fh))
    assert len(table) == len(fixture_rows()) + 1 and table[0][0] == "key" and "features" not in table[0]
    with (out / "features.csv").open() as fh:
        feats = list(csv.reader(fh))
    assert feats[0][:2] == ["graph", "cluster"] and "branching_share" in feats[0]
    assert len(feats) - 1 == len({(r["graph"], r["cluster"]) for r in fixture_rows()})
    # the same database gives the same report
    write_report(db, tmp_path / "again", command="devplace study report fixture.sqlite -o report")
    assert (tmp_path / "again" / "report.md").read_text() == md


def test_report_of_empty_or_orderless_study_is_an_error(tmp_path) -> None:
    with pytest.raises(ReportError, match="no result rows"):
        write_report(write_fixture_db(tmp_path / "empty.sqlite", []), tmp_path / "r")
    orderless = [r for r in fixture_rows() if r["placer"] == "m-etf"]
    with pytest.raises(ReportError, match="sequential placers"):
        write_report(write_fixture_db(tmp_path / "o.sqlite", orderless), tmp_path / "r")


def test_cli_study_report(tmp_path, capsys, monkeypatch) -> None:
    db = write_fixture_db(tmp_path / "fixture.sqlite")
    monkeypatch.setattr(sys, "argv", ["devplace", "study", "report", str(db), "-o", str(tmp_path / "out")])
    try:
        main()
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert (tmp_path / "out" / "report.md").exists()
    assert "report.md" in capsys.readouterr().out


def test_statistics_keep_two_settings_of_a_placer_apart(rows) -> None:
    """A placer run under two settings (placeto's two hyperparameter sets) is two learners in the report's
    statistics: each family test and the interaction test count every graph once per learner, never twice."""
    from devplace.study.report import _question_tests

    second = [{**r, "key": r["key"] + "/paper", "settings": {"episodes": 8}} for r in rows if r["placer"] == "placeto"]
    units = an.build_units(rows + second)
    labels = an.units_by_label(units)
    assert set(labels) == {"greedy", "m-topo", 'placeto {"episodes": 4}', 'placeto {"episodes": 8}'}
    assert len(an.units_by_placer(units)["placeto"]) == 2 * len(labels['placeto {"episodes": 4}'])  # order model's
    tests = _question_tests(units)
    for label in ('placeto {"episodes": 4}', 'placeto {"episodes": 8}'):
        assert tests[label]["interaction"]["blocks"] == 2 * GRAPHS
        assert [f["graphs"] for f in tests[label]["families"]] == [GRAPHS, GRAPHS]
    assert {s["placer"] for s in an.family_summary(units)} == set(labels)
    # one setting only: the placer's own name, as before
    assert set(an.units_by_label(an.build_units(rows))) == {"greedy", "m-topo", "placeto"}


def test_comparison_says_what_holds_by_construction(rows) -> None:
    """The learned placer against one device is counted from the data and labelled as holding by construction;
    the comparison without one device, and where one device beats every classic placer, are computed too."""
    from devplace.study.report import _comparison_section

    # one device: 5% slower than each graph's base time, but 1% faster on graph 0 of each family (there it beats
    # every classic placer, and the learned placer's 1.001 x base is above it)
    single = [{**r, "key": r["key"] + "/single", "placer": "single", "order_name": "-", "episodes": None,
               "curve": None, "settings": {},
               "step_time_s": (0.99 if r["graph"].endswith("/0") else 1.05) * r["step_time_s"] / 1.001}
              for r in rows if r["placer"] == "m-etf" and r["seed"] == 1]
    md = "\n".join(_comparison_section(rows + single))
    assert "| fastest other | fastest other but one device |" in md
    assert f"at most one device's step time on {2 * GRAPHS - 2} of {2 * GRAPHS} graphs" in md
    assert f"faster than every classic placer the study ran on 2 of {2 * GRAPHS} graphs" in md
    assert "Not a finding" in md
    assert "Not a finding" not in "\n".join(_comparison_section(rows))  # no one-device cells: nothing to say


def test_claims_line_gives_effect_against_noise(rows) -> None:
    """The "which claims survive" line of a placer with replicates states each family's spread and order SD against
    its seed noise SD, from the tests' numbers (the fixture's seeds differ by 0.2%: noise SD about 0.14%)."""
    from devplace.study.report import _question_section, _question_tests

    tests = _question_tests(an.build_units(rows))
    line = next(x for x in _question_section(tests) if x.startswith("- **placeto**"))
    fa = next(f for f in tests["placeto"]["families"] if f["family"] == "fa")
    assert f"fa spread {fa['spread'][0]:+.2%}" in line and f"against seed noise SD {fa['noise'][0]:.2%}" in line
    assert 0.001 < fa["noise"][0] < 0.002 and "Effect against noise: fa" in line and "; fb spread" in line


def test_report_of_a_placer_under_two_settings_names_its_tree_and_plots(tmp_path) -> None:
    """A placer under two settings: each setting's line in "Does the best order depend on the family?" gives the
    held-out regret of the placer's one tree (it was n/a: looked up under the setting's label), and each
    setting's critical-difference plot has a file name without runs of underscores."""
    import json

    raw = fixture_rows()
    second = [{**r, "key": r["key"] + "/paper", "settings": json.dumps({"episodes": 8})}
              for r in raw if r["placer"] == "placeto"]
    db = write_fixture_db(tmp_path / "two.sqlite", [*raw, *second])
    written = write_report(db, tmp_path / "out")
    names = {p.name for p in written}
    assert {"cd_placeto_episodes_4.png", "cd_placeto_episodes_8.png"} <= names, names
    md = (tmp_path / "out" / "report.md").read_text()
    for label in ('placeto {"episodes": 4}', 'placeto {"episodes": 8}'):
        line = next(x for x in md.splitlines() if x.startswith(f"- **{label}**: the best order"))
        assert "held-out families the tree's regret is n/a" not in line, line
        assert "held-out families the tree's regret is +" in line, line


def test_runs_that_stay_at_one_device_are_counted_per_order(rows) -> None:
    """A learned placer's run whose answer is one device's step found nothing faster: counted per family and
    order from the rows (to 1e-9 relative), and shown in the comparison section."""
    from devplace.study.report import _comparison_section

    single = [{**r, "key": r["key"] + "/single", "placer": "single", "order_name": "-", "episodes": None,
               "curve": None, "settings": {}, "step_time_s": 1.05 * r["step_time_s"]}
              for r in rows if r["placer"] == "m-etf" and r["seed"] == 1]
    one = {r["graph"]: r["step_time_s"] for r in single}
    learned = [r for r in rows if r["placer"] == "placeto"]
    order = learned[0]["order_name"]
    stayed = [r for r in learned if r["order_name"] == order and r["family"] == learned[0]["family"]][:3]
    moved = [{**r, "step_time_s": one[r["graph"]]} if r in stayed else r for r in rows]
    counts = an.runs_at_one_device(moved + single)
    ((name, family),) = {k for k in counts if k[1] == learned[0]["family"]}
    assert name.startswith("placeto") and counts[(name, family)][order][0] == 3
    assert all(a == 0 for o, (a, _) in counts[(name, family)].items() if o != order)
    assert sum(n for v in counts.values() for _, n in v.values()) == sum(an.usable(r) for r in learned)
    assert an.runs_at_one_device(rows) == {}  # no one-device cells: nothing to count
    assert "Runs whose answer is one device's step" in "\n".join(_comparison_section(moved + single))

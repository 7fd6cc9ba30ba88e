"""Shared test helpers: small graphs and clusters written inline."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

from devplace.graph import CompGraph
from devplace.hardware.cluster import Cluster, Device, Link

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def graph(nodes: list, edges: list, name: str = "t") -> CompGraph:
    """Nodes as dicts or (id, compute_s) pairs; edges as dicts or (src, dst, bytes[, tensor]) tuples."""
    recs = [n if isinstance(n, dict) else {"id": n[0], "compute_s": n[1]} for n in nodes]
    erecs = []
    for e in edges:
        if isinstance(e, dict):
            erecs.append(e)
        else:
            rec = {"src": e[0], "dst": e[1], "bytes": e[2]}
            if len(e) > 3:
                rec["tensor"] = e[3]
            erecs.append(rec)
    return CompGraph.build(name, recs, erecs)


def cluster(n: int = 2, *, bw: float = 10.0, lat: float = 0.0, speeds: list[float] | None = None,
            mem: float = 1e12, links: dict | None = None) -> Cluster:
    speeds = speeds or [1.0] * n
    devs = tuple(Device(f"gpu{i}", mem, speeds[i]) for i in range(n))
    return Cluster("test", devs, Link(bw, lat), {k: Link(*v) for k, v in (links or {}).items()})


@pytest.fixture
def tmp_json(tmp_path):
    """Write a string to a file and return its path."""
    def write(text: str, name: str = "f.json"):
        p = tmp_path / name
        p.write_text(text)
        return p
    return write


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """Run `devplace ARGS` in-process through the console entry point; (exit status, stdout, stderr)."""
    from devplace.cli import main

    monkeypatch.setattr(sys, "argv", ["devplace", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def python_package(tmp_path, monkeypatch) -> Iterator[Callable[[str, str], str]]:
    """`make(package, source)` writes `source` as the importable module `package.nets` (for custom
    `package.nets:factory` models) and returns its name; the modules are forgotten after the test."""
    made: list[str] = []

    def make(package: str, source: str) -> str:
        folder = tmp_path / package
        folder.mkdir()
        (folder / "__init__.py").write_text("")
        (folder / "nets.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        made.append(package)
        return f"{package}.nets"

    yield make
    for name in [n for n in sys.modules if n.split(".")[0] in made]:
        del sys.modules[name]

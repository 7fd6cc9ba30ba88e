"""The layer table of DEVELOPERS.md, checked on the source: no module imports a layer it may not, `cli/` has no
function-local imports, and `devplace --help`, the graph-only commands and placing with a classic placer do not
load torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "devplace"
DEVELOPERS = Path(__file__).resolve().parent.parent / "DEVELOPERS.md"

# The bottom helpers every layer may import (DEVELOPERS.md: "imports nothing" / "nothing of devplace").
BOTTOM = frozenset({"errors", "defaults", "units", "files", "graph.heap"})
# Layer -> the layers it may import besides itself, as DEVELOPERS.md's "may import" column states them.
# graph/ may import only errors, files and defaults (which import nothing), and heap, which lives in it.
BELOW_PLANNING = frozenset({"placers", "sim", "orders", "capture", "zoo", "hardware", "graph"})
ALLOWED: dict[str, frozenset[str]] = {
    # the CLI reaches the placers only through `app` (issue 29)
    "cli": frozenset({"app", "study", "runtime", "planning"}) | BELOW_PLANNING - {"placers"} | BOTTOM,
    "app": frozenset({"study", "runtime", "planning"}) | BELOW_PLANNING | BOTTOM,
    "study": frozenset({"planning"}) | BELOW_PLANNING | BOTTOM,
    "runtime": frozenset({"planning"}) | BELOW_PLANNING | BOTTOM,
    "planning": frozenset({"placers", "sim", "orders", "hardware", "graph"}) | BOTTOM,
    "placers": frozenset({"sim", "orders", "hardware", "graph"}) | BOTTOM,
    "sim": frozenset({"hardware", "graph"}) | BOTTOM,
    "orders": frozenset({"hardware", "graph"}) | BOTTOM,
    "capture": frozenset({"zoo", "hardware", "graph"}) | BOTTOM,
    "zoo": frozenset({"graph"}) | BOTTOM,
    "hardware": frozenset({"graph"}) | BOTTOM,
    "graph": frozenset({"errors", "files", "defaults", "graph.heap"}),
    "graph.heap": frozenset(),
    "units": frozenset(),
    "errors": frozenset(),
    "files": frozenset({"errors"}),
    "defaults": frozenset(),
}
# Above the table: the package's public API (`devplace/__init__.py`) and `python -m devplace`.
TOP = {"devplace": frozenset(ALLOWED) - {"cli", "app"}, "__main__": frozenset({"cli"})}


def layer(module: str) -> str:
    """The layer of a dotted module name under `devplace` (its row in the table)."""
    parts = module.split(".")[1:]
    if not parts:
        return "devplace"
    if parts[:2] == ["graph", "heap"]:
        return "graph.heap"
    return parts[0].removesuffix(".py")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    base = SRC.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every devplace module that `path` (or `source` read as if it were at `path`) imports,
    anywhere in it (function bodies and TYPE_CHECKING blocks included); `from X import name` counts as X.name
    where that is a module."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    text = path.read_text(encoding="utf-8") if source is None else source
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((node.lineno, sub if is_module(sub) else target))
    return [(line, name) for line, name in found if name == "devplace" or name.startswith("devplace.")]


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    rows = set(ALLOWED) | set(TOP)
    unknown = sorted({module_name(p) for p in SOURCES if layer(module_name(p)) not in rows})
    assert not unknown, f"modules in no row of the layer table (add them to DEVELOPERS.md and here): {unknown}"


def test_developers_md_lists_the_same_layers() -> None:
    """The table in DEVELOPERS.md names every package and bottom module this test checks, and nothing else."""
    text = DEVELOPERS.read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in re.findall(r"^\| (.+?) \|", section, flags=re.M):
        for name in re.findall(r"`([\w/.]+)`", row):
            named.add(name.removesuffix("/").removesuffix(".py").replace("/", "."))
    assert named == set(ALLOWED)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down_the_layer_table(path: Path) -> None:
    module = module_name(path)
    here = layer(module)
    allowed = TOP.get(here, ALLOWED.get(here, frozenset()))
    wrong = []
    for line, target in imported(path):
        # the bare root package: it is imported before any submodule anyway (the study runner reads __version__)
        if target == "devplace" and here != "devplace":
            continue
        there = layer(target)
        if there != here and there not in allowed:
            wrong.append(f"line {line}: {target} (layer {there})")
    assert not wrong, f"{module} (layer {here}) imports up or across the table: {wrong}"


def test_the_checker_sees_an_upward_import() -> None:
    """The parser finds function-local, relative and `from devplace import x` imports, so a violation cannot
    hide there."""
    source = "def f():\n    from devplace import app\n    from ..placers import registry\n"
    targets = [t for _, t in imported(PACKAGE / "sim" / "summary.py", source)]
    assert targets == ["devplace.app", "devplace.placers.registry"]
    assert {layer(t) for t in targets} - ALLOWED["sim"] == {"app", "placers"}


def test_cli_has_no_function_local_imports() -> None:
    local = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                local += [f"{path.name}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not local, f"function-local imports in cli/ (import at module level; torch via app.torch_tasks()): {local}"


@pytest.mark.parametrize(("args", "shows"), [(["--help"], "Device placement"),
                                             (["bound", "example", "4xV100-16GB"], "lower bound"),
                                             (["place", "example", "-c", "4xV100-16GB", "-q"], "order auto")])
def test_help_graph_commands_and_classic_placers_do_not_load_torch(args: list[str], shows: str) -> None:
    """torch is loaded only by what needs it: capture, the learned placers, studies (`app.torch_tasks()`, and
    `get_placer` importing a classic placer's own module first)."""
    code = (f"import sys\nsys.argv = ['devplace', *{args!r}]\nimport devplace.cli\n"
            "try:\n    devplace.cli.main()\nexcept SystemExit:\n    pass\n"
            "sys.exit(3 if 'torch' in sys.modules else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr or f"devplace {' '.join(args)} imported torch"
    assert shows in done.stdout


# ------------------------------------------------------------------------------ one place for each default
def _literal_defaults(tree: ast.AST) -> list[tuple[int, object]]:
    """(line, value) of every literal default of a function parameter (typer options included)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if isinstance(d, ast.Constant):
                    out.append((d.lineno, d.value))
    return out


def test_defaults_are_written_once():
    """No parameter defaults to a literal copy of a value `devplace.defaults` holds: it names the constant."""
    from devplace import defaults

    held = {getattr(defaults, n) for n in ("DEFAULT_PLACER", "DEFAULT_ORDER", "CANONICAL_ORDER", "RECOMMEND_PLACER",
                                           "SIM_DEVPLACE", "SIM_PLACETO", "LEARNED_PLACER", "ENCODER_PLACETO",
                                           "FAMILY_MAX_NODES", "TRAIN_FAMILY_GRAPHS")}
    copies = [f"{path.relative_to(SRC)}:{line}: {value!r}"
              for path in sorted(PACKAGE.rglob("*.py")) if path.name != "defaults.py"
              for line, value in _literal_defaults(ast.parse(path.read_text()))
              if isinstance(value, str | int) and not isinstance(value, bool) and value in held]
    assert not copies, "defaults written outside devplace/defaults.py:\n" + "\n".join(copies)


def test_the_policy_network_defaults_to_placeto_hyper():
    import inspect

    pytest.importorskip("torch")
    from devplace.placers.rl.placeto import PlacetoHyper, PlacetoPolicy

    params = inspect.signature(PlacetoPolicy).parameters
    hyper = PlacetoHyper()
    assert {n: params[n].default for n in ("hidden", "rounds", "encoder")} == {
        "hidden": hyper.hidden, "rounds": hyper.rounds, "encoder": hyper.encoder}

"""Dependencies point one way, checked on the source, not by convention:

* between packages, ``schemas`` <- ``models`` <- ``pipeline``;
* inside ``models`` and ``pipeline``, the sub-packages import each other only along the
  edges of ``GRAPH`` below: the real graph of the code, which must have no cycle. An edge
  nothing uses any more is taken out, so the graph stays a picture of the code.

README's "Where things live" lists the same sub-packages and modules, and ``pyproject.toml``
every package.
"""

from __future__ import annotations

import ast
import doctest
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "models", "pipeline")
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

# What each package may import beyond the standard library and servewatch's lower packages
# (so no Kafka, Faust or HTTP below ``pipeline``).
ALLOWED = {
    "schemas": {"pydantic", "pydantic_core", "typing_extensions"},
    # scipy: distribution tails only (Student-t in stats/tails.py, negative binomial in
    # stats/traffic.py); river depends on it anyway
    "models": {"pydantic", "numpy", "river", "scipy"},
}

#: Which sub-packages each sub-package imports ("" is the package's own root modules; the
#: package's facade, its ``__init__``, may import any of them).
GRAPH: dict[str, dict[str, set[str]]] = {
    "schemas": {"": set()},
    "models": {
        "": set(),
        "stats": set(),
        "windows": {"stats"},
        "workload": set(),
        "explain": {"stats", "windows"},
        "detect": {"stats", "windows", "explain"},
        "compare": {"windows", "explain", "detect"},
    },
    "pipeline": {
        "": set(),
        "messages": set(),  # where a message came from, dead letters, decoding, partitions
        "streams": {""},  # the Faust app and its plumbing
        "worker": {"", "messages", "streams"},
        "ingest": {"", "messages"},
        "replay": {"", "messages", "ingest", "worker"},
        "loadgen": set(),
        "notify": {"", "messages", "streams"},
        "changes": {"", "messages"},
        "web": {""},
        "dev": {"", "changes", "replay"},
        "cli": {"", "streams", "worker", "ingest", "replay", "loadgen", "notify", "changes", "web", "dev"},
    },
}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imports(path: Path) -> list[str]:
    """Absolute module names ``path`` imports (``from a.b import c`` gives ``a.b``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.relative_to(ROOT)}: use absolute servewatch.* imports"
            module = node.module or ""
            for alias in node.names:  # ``from servewatch.pipeline import topics`` imports a module
                folder = ROOT.joinpath(*module.split(".")[1:], alias.name)
                is_module = module.startswith("servewatch.") and (folder.is_dir() or folder.with_suffix(".py").exists())
                names.append(f"{module}.{alias.name}" if is_module else module)
    return names


def sub_package_of(path_or_module: Path | str) -> tuple[str, str | None]:
    """(package, sub-package) of a file or a ``servewatch.*`` module name: "" for the
    package's root modules, None for its facade (its ``__init__``)."""
    if isinstance(path_or_module, Path):
        parts = path_or_module.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
    else:
        parts = tuple(path_or_module.split(".")[1:])
    if len(parts) == 1:
        return parts[0], None
    return parts[0], parts[1] if len(parts) > 2 or parts[1] in GRAPH[parts[0]] else ""


def edges(package: str) -> dict[str, set[str]]:
    """The sub-packages each sub-package of ``package`` imports, read from the source."""
    found: dict[str, set[str]] = {sub: set() for sub in GRAPH[package]}
    for path in modules(package):
        _, here = sub_package_of(path)
        for name in imports(path):
            if name.startswith(f"servewatch.{package}."):
                _, there = sub_package_of(name)
                if here is not None and there is not None and there != here:
                    found[here].add(there)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of ``graph`` (as the nodes along it), or [] if it has none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for target in sorted(graph.get(node, ())):
            if found := visit(target, [*path, node]):
                return found
        done.add(node)
        return []

    return next((found for node in sorted(graph) if (found := visit(node, []))), [])


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_down_and_nothing_foreign(package: str) -> None:
    upward, foreign = [], []
    for path in modules(package):
        for name in imports(path):
            root = name.split(".")[0]
            if root == "servewatch":
                if name != "servewatch" and PACKAGES.index(name.split(".")[1]) > PACKAGES.index(package):
                    upward.append(f"{path.relative_to(ROOT)} imports {name}")
            elif root not in STDLIB and package in ALLOWED and root not in ALLOWED[package]:
                foreign.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward
    assert not foreign, foreign


@pytest.mark.parametrize("package", PACKAGES)
def test_sub_packages_import_along_the_graph_only(package: str) -> None:
    found = edges(package)
    unlisted = {sub: sorted(targets - GRAPH[package][sub]) for sub, targets in found.items()}
    unused = {sub: sorted(GRAPH[package][sub] - targets) for sub, targets in found.items()}
    assert not {sub: t for sub, t in unlisted.items() if t}, "imports outside GRAPH (add the edge, or don't)"
    assert not {sub: t for sub, t in unused.items() if t}, "edges of GRAPH nothing uses (take them out)"


@pytest.mark.parametrize("package", PACKAGES)
def test_the_graph_has_no_cycle(package: str) -> None:
    assert cycle(GRAPH[package]) == []


def test_a_cycle_is_found() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_the_workers_app_is_wiring_no_function_of_it_over_60_lines() -> None:
    tree = ast.parse((ROOT / "pipeline" / "worker" / "app.py").read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    long = [f"{f.name}: {f.end_lineno - f.lineno + 1} lines" for f in functions if f.end_lineno - f.lineno + 1 > 60]
    assert functions and long == []


def test_only_the_workers_own_modules_and_its_entry_point_reach_its_app() -> None:
    """The worker's app is wiring: what other commands share lives in ``messages`` and ``streams``."""
    reaching = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in PACKAGES
        for path in modules(package)
        if path.relative_to(ROOT).parts[:2] != ("pipeline", "worker")
        for name in imports(path)
        if name == "servewatch.pipeline.worker.app"
    ]
    assert reaching == []


def test_the_two_shippers_do_not_lean_on_each_other() -> None:
    """``ingest/ship`` and ``ingest/scrape`` share only what is below ``ingest``."""
    for ours, theirs in (("ship", "scrape"), ("scrape", "ship")):
        for path in sorted((ROOT / "pipeline" / "ingest" / ours).glob("*.py")):
            assert not [n for n in imports(path) if n.startswith(f"servewatch.pipeline.ingest.{theirs}")], path


def test_every_folder_is_a_listed_package_in_the_graph() -> None:
    """A new sub-package is placed in the graph here and shipped in the wheel (pyproject)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            assert "servewatch." + ".".join(parts) in listed, f"add {'.'.join(parts)} to pyproject's packages"
            assert len(parts) <= 3, f"{init.parent}: two levels of sub-packages at most"
            if len(parts) > 1:
                assert parts[1] in GRAPH[package], f"place {init.parent.relative_to(ROOT)} in GRAPH"


@pytest.mark.parametrize("package", PACKAGES)
def test_one_import_name_per_module_doctests_included(package: str) -> None:
    """``servewatch.models.x`` only, never ``models.x``: the checkout's root is on the path in
    tests, so the short name would import a second copy of the module, with classes of its own."""
    short = []
    parser = doctest.DocTestParser()
    for path in modules(package):
        text = path.read_text()
        examples = [example.source for example in parser.get_examples(text)]  # the file's doctests
        for source in [text, *examples]:
            try:
                tree = ast.parse(source)
            except SyntaxError:  # a continuation of a doctest example, read whole in ``text``
                continue
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                short += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert sorted(set(short)) == []


def test_only_the_command_line_prints() -> None:
    """Everything else logs (``logging.getLogger(__name__)``); doctests may print."""
    printing = []
    for package in PACKAGES:
        for path in modules(package):
            if path.relative_to(ROOT).parts[:2] == ("pipeline", "cli"):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
            printing += [f"{path.relative_to(ROOT)}:{call.lineno}" for call in calls]
    assert printing == []


def test_the_readmes_map_lists_every_module_under_its_folder() -> None:
    """A newcomer finds each module on its package's row of "Where things live"."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Where things live")[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        folder = re.match(r"\| `([a-z/_]+)/`", line)
        if folder:
            rows[folder.group(1)] = set(re.findall(r"`([a-z_]+)`", line))
    for package in PACKAGES:
        for path in modules(package):
            if path.stem == "__init__":
                continue
            folder = path.parent.relative_to(ROOT).as_posix()
            assert folder in rows, f"README's map has no row for {folder}/"
            assert path.stem in rows[folder], f"{path.relative_to(ROOT)} missing from README's {folder}/ row"

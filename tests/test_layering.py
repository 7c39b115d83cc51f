"""Dependencies point one way, checked on the source, not by convention:

* between packages, ``schemas`` <- ``models`` <- ``pipeline``;
* inside ``models``, the order of ``LAYERS["models"]`` below (``stats`` <- ``windows`` <- ... <- ``compare``);
* inside ``pipeline``, the order of ``LAYERS["pipeline"]`` (its root modules <- ``worker`` <- ... <- ``cli``).

A module imports from its own layer or lower ones only. README's "Where things live" lists
the same sub-packages and modules, and ``pyproject.toml`` every package.
"""

from __future__ import annotations

import ast
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

#: Sub-packages of each package, lowest first ("" is the package's own root modules).
LAYERS = {
    "schemas": ("",),
    "models": ("", "stats", "windows", "workload", "explain", "detect", "compare"),
    "pipeline": ("", "worker", "ingest", "replay", "loadgen", "notify", "changes", "web", "dev", "cli"),
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


def layer_of(path_or_module: Path | str) -> tuple[int, int]:
    """(package rank, sub-package rank) of a file or a ``servewatch.*`` module name."""
    if isinstance(path_or_module, Path):
        parts = path_or_module.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
    else:
        parts = tuple(path_or_module.split(".")[1:])
    package = parts[0]
    if len(parts) == 1:  # the package's facade (``models.REGISTRY``) sits above its sub-packages
        return PACKAGES.index(package), len(LAYERS[package]) - 1
    # (package, module) is a root module, layer ""; (package, sub, ...) is in layer sub
    sub = parts[1] if len(parts) > 2 or parts[1] in LAYERS[package] else ""
    return PACKAGES.index(package), LAYERS[package].index(sub)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down(package: str) -> None:
    upward, foreign = [], []
    for path in modules(package):
        here = layer_of(path)
        for name in imports(path):
            root = name.split(".")[0]
            if root == "servewatch":
                if name == "servewatch":
                    continue  # the version
                if layer_of(name) > here:
                    upward.append(f"{path.relative_to(ROOT)} imports {name}")
            elif root not in STDLIB and package in ALLOWED and root not in ALLOWED[package]:
                foreign.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward
    assert not foreign, foreign


def test_the_two_shippers_do_not_lean_on_each_other() -> None:
    """``ingest/ship`` and ``ingest/scrape`` share only what is below ``ingest``."""
    for ours, theirs in (("ship", "scrape"), ("scrape", "ship")):
        for path in sorted((ROOT / "pipeline" / "ingest" / ours).glob("*.py")):
            assert not [n for n in imports(path) if n.startswith(f"servewatch.pipeline.ingest.{theirs}")], path


def test_every_folder_is_a_listed_package_of_one_layer() -> None:
    """A new sub-package is placed in a layer here and shipped in the wheel (pyproject)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            assert "servewatch." + ".".join(parts) in listed, f"add {'.'.join(parts)} to pyproject's packages"
            assert len(parts) <= 3, f"{init.parent}: two levels of sub-packages at most"
            if len(parts) > 1:
                assert parts[1] in LAYERS[package], f"place {init.parent.relative_to(ROOT)} in a layer"


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

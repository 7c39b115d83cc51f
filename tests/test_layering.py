"""Dependencies point one way: schemas <- models <- pipeline. Checked on the source, not by convention."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What each package may import beyond the standard library and itself.
ALLOWED = {
    "schemas": {"pydantic", "pydantic_core", "typing_extensions"},
    # scipy: distribution tails only (Student-t in models/tails.py, negative binomial in
    # models/traffic.py); river depends on it anyway
    "models": {"schemas", "numpy", "river", "scipy"},
}
FORBIDDEN_EVERYWHERE_BUT_PIPELINE = {"faust", "aiokafka", "mode", "httpx", "pipeline", "prometheus_client"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    import sys

    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in sorted((ROOT / package).rglob("*.py")):
        roots = imported_roots(path) - stdlib - {package}
        assert not roots & FORBIDDEN_EVERYWHERE_BUT_PIPELINE, (
            f"{path.name} imports {roots & FORBIDDEN_EVERYWHERE_BUT_PIPELINE}"
        )
        assert roots <= ALLOWED[package], f"{path.relative_to(ROOT)} imports {roots - ALLOWED[package]}"


def test_only_the_command_line_prints() -> None:
    """Everything else logs (``logging.getLogger(__name__)``); doctests may print."""
    printing = []
    for package in ("schemas", "models", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.parent.name == "pipeline" and path.name.startswith("cli"):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
            printing += [f"{path.relative_to(ROOT)}:{call.lineno}" for call in calls]
    assert printing == []


def test_every_module_is_on_the_readmes_map() -> None:
    """A newcomer finds each module under its concept in README's "Where things live"; a new
    module must be placed there (issue #17)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Where things live")[1].split("\n## ")[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    for package in ("schemas", "models", "pipeline"):
        modules = {path.stem for path in (ROOT / package).glob("*.py")} - {"__init__"}
        assert modules <= named, f"{package}: {sorted(modules - named)} missing from README's map"


#: ``models``' concepts, lowest first: a module imports from its own layer or lower ones only
#: (README's "Where things live" lists the same modules; issue #17 will make them packages).
MODEL_LAYERS = {
    "statistics": {"latency", "tails", "rates", "share", "cache_hits", "capacity", "traffic", "baseline", "sketch",
                   "compact", "params"},
    "windows": {"batch", "rows", "excerpt", "segments", "signal_columns", "open_window", "windowing", "window", "wire",
                "engine_window"},
    "explanation": {"hints", "wording", "facets", "evidence_sample", "faulty_requests"},
    "detection": {"signals", "signal_detector", "detector", "summary", "lifecycle", "grouping", "silence",
                  "traffic_watch", "headroom", "series"},
}  # fmt: skip


def test_models_layers_point_one_way() -> None:
    layer_of = {module: rank for rank, modules in enumerate(MODEL_LAYERS.values()) for module in modules}
    on_disk = {path.stem for path in (ROOT / "models").glob("*.py")} - {"__init__"}
    assert on_disk == set(layer_of), f"place {sorted(on_disk - set(layer_of))} in a layer"
    upward = []
    for path in sorted((ROOT / "models").glob("*.py")):
        if path.stem == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("models."):
                used = node.module.split(".")[1]
                if layer_of[used] > layer_of[path.stem]:
                    upward.append(f"{path.stem} imports {used}")
    assert not upward, upward
    readme = (ROOT / "README.md").read_text()
    for concept, modules in MODEL_LAYERS.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| {concept} (`models/`)"))
        assert set(re.findall(r"`([a-z_]+)`", row)) - {"models"} == modules, concept

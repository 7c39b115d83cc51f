"""ruff (lint and format) and mypy over the checkout, as part of the README's test command:
a change that breaks them fails the suite, not only a reviewer's eye.

Each tool runs from the same interpreter as the tests, with the settings in
``pyproject.toml``; its own output is the failure message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [("ruff", "check", "."), ("ruff", "format", "--check", "."), ("mypy",)],
    ids=["ruff check", "ruff format", "mypy"],
)
def test_the_checkout_passes(command: tuple[str, ...]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}"

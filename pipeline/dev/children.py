"""Child processes that announce themselves: started, and waited for until they print the
line that says where they listen (the demo's receiver, its triage page)."""

from __future__ import annotations

import os
import subprocess
import sys


def start_announcing(
    args: list[str], prefix: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``python -m <args>`` as a child; returns it and what follows ``prefix`` on its first line."""
    process = subprocess.Popen(
        [sys.executable, "-m", *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith(prefix):
        process.kill()
        process.wait()
        raise RuntimeError(f"{' '.join(args)} did not start (it said {line!r})")
    return process, line.removeprefix(prefix)


def stop(process: subprocess.Popen[str], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

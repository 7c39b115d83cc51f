"""Process-level tuning for the long-running commands (worker, replay), applied once at start."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

logger = logging.getLogger(__name__)

#: glibc's mallopt parameter number for the mmap threshold.
_M_MMAP_THRESHOLD = -3
#: 0: glibc's own, dynamic mmap threshold (the default; see ``tune_malloc``).
MMAP_THRESHOLD_BYTES = 0
#: Seconds between heap trims in the worker (see ``trim_heap``).
HEAP_TRIM_INTERVAL_S = 5.0


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for a process that allocates a dict per record.

    The hot path creates and drops hundreds of thousands of small containers per second; with
    CPython's default thresholds the cyclic collector then runs thousands of times a second
    and, now and then, traverses every long-lived object: with the collector off, replay ran
    ~20 % faster. Freezing what exists after start-up (imports, settings) and raising the
    young-generation threshold recovers part of that; reference counting still frees rows
    at once, only cycles wait longer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the only one with ``mallopt``/``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def tune_malloc(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold (0, the default: leave glibc's dynamic one). Returns whether
    a pin applied (glibc only; elsewhere nothing changes).

    Pinned low (128 KiB was the default until the fourth session), every Kafka message value
    and fetch buffer above it is mapped, page-faulted in and unmapped again: a worker ran
    ~10 % slower for it. What the pin bought, a steady RSS, ``trim_heap`` now gives at a
    fraction of the cost (figures in ``bench/README.md``).
    """
    if threshold_bytes <= 0:
        return False
    libc = _libc()
    try:
        applied = bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except AttributeError:
        applied = False
    if not applied:
        logger.debug("mallopt unavailable: keeping the C allocator's defaults")
    return applied


def trim_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``); whether it could.

    A window's tables and a bundle of encoded partials are a few hundred KiB each and live
    for one window. Under glibc's dynamic mmap threshold they come from the heap, and the
    free space they leave between live objects stays resident: RSS then drifts up to ~1.3x
    the live data (``bench/scale.py``: 2.4 against 1.8 KiB per live segment). The worker
    calls this every ``heap_trim_interval_s``; it takes a few milliseconds on a worker's heap.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def tune_process(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> None:
    tune_gc()
    tune_malloc(mmap_threshold_bytes)

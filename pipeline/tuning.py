"""Process-level tuning for the long-running commands (worker, replay), applied once at start."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

#: glibc's mallopt parameter number for the mmap threshold.
_M_MMAP_THRESHOLD = -3
#: Allocations from this size up get their own mapping, returned to the OS when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024


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


def tune_malloc(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold so large, short-lived buffers go back to the OS when freed.

    A window's tables and a bundle of encoded partials are a few hundred KiB each and live
    for one window. glibc raises its mmap threshold after the first such buffer is freed,
    so later ones come from the heap, where they fragment it: the worker's RSS then varied
    by ~1.5x from run to run for the same live data (``bench/scale.py``). Returns whether
    it applied (glibc only; elsewhere nothing changes; 0 keeps glibc's own, dynamic threshold).

    The price is throughput: every Kafka message value and fetch buffer above the threshold
    is then mapped, page-faulted in and unmapped again. Measured in ``bench/README.md``: a
    worker ran ~10 % faster unpinned, with ~0.5 KiB more RSS per live segment.
    """
    if threshold_bytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        applied = bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        applied = False
    if not applied:
        logger.debug("mallopt unavailable: keeping the C allocator's defaults")
    return applied


def tune_process(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> None:
    tune_gc()
    tune_malloc(mmap_threshold_bytes)

"""Derive the small trace samples bundled in ``pipeline/dev/trace_samples/`` from the public traces.

    python -m bench.derive_trace_samples [--source /work/shared/data] [--out pipeline/dev/trace_samples]

The simulator (``pipeline/dev/serving_sim.py``) and the real-run replays (``pipeline/dev/real_runs.py``)
must work on a clean clone, without the shared data folder, so what they need is committed as
gzip-compressed CSV files: a few columns per request, one comment line naming the source and
its licence, written byte-for-byte reproducibly (gzip mtime 0). Run this script to regenerate
them; a reviewer can diff the output against the committed files.

* ``mooncake_conversation.csv.gz`` (Apache-2.0, kvcache-ai/Mooncake, FAST25-release
  conversation trace): all 12,031 requests. ``reused_prefix_tokens`` is what an unbounded
  prefix cache would serve: 512 tokens per leading ``hash_ids`` block already seen in an
  earlier request, capped at the prompt. ``first_block_id`` is the id of the prompt's first
  block: requests with the same id share a system prompt (in this trace all do: id 0).
* ``azure_conv.csv.gz`` and ``azure_code.csv.gz`` (CC-BY-4.0, Azure/AzurePublicDataset, LLM
  inference trace 2023): the first 45 minutes of the chat trace (15,877 of 19,366 requests:
  the whole hour would take the samples past 400 KB) and the whole hour of the code trace
  (8,819 requests); no prefix information in the source.
* ``real_runs.csv.gz`` (Apache-2.0, callanjfox/kv-cache-tester): every request of the three
  detailed load-test runs, times relative to each run's first launch.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 512  # Mooncake's hash_ids each name one block of 512 prompt tokens
AZURE_CONV_S = 45 * 60.0  # the chat trace is the densest: a 45-minute cut keeps the samples small

#: The three kv-cache-tester runs with per-request rows, by the short name the package uses.
REAL_RUNS = {
    "cacherate_sustained": "cacherate_sustained-10__detailed_results_32000_20251219_215421.csv",
    "dram_only": "dram_only_tp4_8125_2s__detailed_results_64000_20260310_175707.csv",
    "gds_dram": "gds_dram_tp4_8126__detailed_results_64000_20260310_153016.csv",
}
REAL_RUN_COLUMNS = (
    "run", "launch_s", "finish_s", "prompt_tokens", "cached_tokens", "output_tokens",
    "ttft_s", "total_s", "concurrency",
)  # fmt: skip


def write_sample(path: Path, comment: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> int:
    """Write one gzip CSV (a ``# comment`` line, then the header and rows); returns its size in bytes."""
    text = io.StringIO()
    text.write(f"# {comment}\n")
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    # mtime=0 and no file name in the header: the same input gives the same bytes.
    data = gzip.compress(text.getvalue().encode(), compresslevel=9, mtime=0)
    path.write_bytes(data)
    return len(data)


def mooncake(source: Path) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    seen: set[int] = set()
    with (source / "mooncake_conversation_trace.jsonl").open() as lines:
        for line in lines:
            request = json.loads(line)
            prompt = int(request["input_length"])
            blocks: list[int] = request["hash_ids"]
            reused = 0
            for block in blocks:  # only a *leading* run of known blocks is a reusable prefix
                if block not in seen:
                    break
                reused += 1
            seen.update(blocks)
            rows.append(
                (
                    f"{request['timestamp'] / 1000:.3f}",
                    prompt,
                    int(request["output_length"]),
                    min(reused * BLOCK_TOKENS, prompt),
                    blocks[0] if blocks else -1,
                )
            )
    return rows


def azure(path: Path, keep_s: float = float("inf")) -> list[tuple[object, ...]]:
    with path.open() as f:
        raw = list(csv.DictReader(f))
    # Timestamps carry 7 fractional digits; fromisoformat takes at most 6.
    times = [datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in raw]
    t0 = times[0]
    return [
        (f"{t - t0:.3f}", int(r["ContextTokens"]), int(r["GeneratedTokens"]))
        for t, r in zip(times, raw, strict=True)
        if t - t0 < keep_s
    ]


def real_runs(source: Path) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for run, name in REAL_RUNS.items():
        with (source / "real" / name).open() as f:
            raw = sorted(csv.DictReader(f), key=lambda r: float(r["launch_time"]))
        t0 = float(raw[0]["launch_time"])
        for r in raw:
            ttft, total = float(r["ttft"]), float(r["total_time"])
            rows.append(
                (
                    run,
                    f"{float(r['launch_time']) - t0:.3f}",
                    f"{float(r['finish_time']) - t0:.3f}",
                    int(r["context_size"]),
                    int(r["cached_tokens"]),
                    int(r["output_tokens"]),
                    f"{ttft:.4f}",
                    f"{max(total, ttft):.4f}",
                    int(r["concurrency_level"]),
                )
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=Path("/work/shared/data"))
    parser.add_argument("--out", type=Path, default=ROOT / "pipeline" / "trace_samples")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    derived = "derived by bench/derive_trace_samples.py"
    sizes = {
        "mooncake_conversation.csv.gz": write_sample(
            out / "mooncake_conversation.csv.gz",
            "source: kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl (Apache-2.0); "
            f"{derived}; reused_prefix_tokens = 512 x leading hash_ids blocks seen before, capped at the prompt",
            ("t_s", "prompt_tokens", "output_tokens", "reused_prefix_tokens", "first_block_id"),
            mooncake(args.source),
        ),
        "azure_conv.csv.gz": write_sample(
            out / "azure_conv.csv.gz",
            "source: Azure/AzurePublicDataset data/AzureLLMInferenceTrace_conv.csv (CC-BY-4.0); "
            f"{derived}; the first {AZURE_CONV_S / 60:.0f} minutes",
            ("t_s", "prompt_tokens", "output_tokens"),
            azure(args.source / "azure_llm_2023_conv.csv", AZURE_CONV_S),
        ),
        "azure_code.csv.gz": write_sample(
            out / "azure_code.csv.gz",
            "source: Azure/AzurePublicDataset data/AzureLLMInferenceTrace_code.csv (CC-BY-4.0); " + derived,
            ("t_s", "prompt_tokens", "output_tokens"),
            azure(args.source / "azure_llm_2023_code.csv"),
        ),
        "real_runs.csv.gz": write_sample(
            out / "real_runs.csv.gz",
            "source: callanjfox/kv-cache-tester detailed_results CSVs (Apache-2.0, see LICENSE-kv-cache-tester); "
            f"{derived}; times in s from each run's first launch",
            REAL_RUN_COLUMNS,
            real_runs(args.source),
        ),
    }
    for name, size in sizes.items():
        print(f"{name:32s} {size / 1024:7.1f} KiB")
    print(f"{'total':32s} {sum(sizes.values()) / 1024:7.1f} KiB")


if __name__ == "__main__":
    main()

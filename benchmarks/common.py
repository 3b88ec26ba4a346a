"""Shared benchmark plumbing: timing, read bandwidth, result files, tables, worker
subprocesses, the transformers checkpoint, and prompts from the Debian license texts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
LICENSES = Path("/usr/share/common-licenses")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` unmeasured ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(nbytes: int = 400_000_000, repeats: int = 5) -> float:
    """Bytes/s of a plain torch sum over a float32 buffer of ``nbytes`` (far larger than the
    CPU's caches) with torch's current thread count: the machine's read bandwidth."""
    buffer = torch.ones(nbytes // 4)  # touched once: no page faults in the timed sums
    seconds = median_seconds(buffer.sum, repeats)
    return buffer.numel() * 4 / seconds


def machine() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }


def write_json(name: str, payload: dict[str, object]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """A plain-text table of ``rows`` (dicts) with the given column order."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, "-" * len(line), *body])


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


# ---- worker subprocesses (one measurement per process: clean peak RSS) ---------------
def spawn_worker(
    script: str, args: list[str], threads: int, label: str, echo: bool = False
) -> dict[str, Any]:
    """Run ``python script args`` with ``threads`` OpenMP threads; its last ``RESULT {json}``
    line, parsed. Raises RuntimeError with the worker's stderr tail when it fails.
    ``echo``: the worker's stderr goes straight to ours (progress of a long worker)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, script, *args],
        stdout=subprocess.PIPE,
        stderr=None if echo else subprocess.PIPE,
        text=True,
        env=env,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "(its stderr is above)" if echo else proc.stderr[-3000:]
        raise RuntimeError(f"worker {label} failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def hf_checkpoint(folder: Path) -> Path:
    """Convert the GGUF to a transformers checkpoint once (dequantizing takes ~15-40 s)."""
    if (folder / "model.safetensors").is_file():
        return folder
    import transformers

    from kvcache.weights.gguf import smollm2_path

    gguf = smollm2_path()
    print(f"converting {gguf.name} for transformers into {folder} (once)", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # type: ignore[assignment]  # else save_pretrained refuses
    model.save_pretrained(folder)
    return folder


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two greedy continuations."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def token_clock() -> Any:
    """A transformers streamer that records the time of each put: the prompt first, then
    one per new token (``.times``)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Clock()


def license_tokens(tokenizer: Any, count: int) -> list[int]:
    """The first ``count`` tokens (no BOS) of the Debian license texts (regular files of
    /usr/share/common-licenses concatenated in sorted name order): real English text that
    every Debian machine has. ``tokenizer``: anything with ``encode(text, add_bos=False)``."""
    files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    text = "".join(p.read_text(errors="replace") for p in files)
    ids: list[int] = tokenizer.encode(text, add_bos=False)
    if len(ids) < count:
        raise SystemExit(f"only {len(ids)} tokens in {LICENSES}, need {count}")
    return ids[:count]

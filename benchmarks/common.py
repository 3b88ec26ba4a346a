"""What the benchmarks feed the models: prompts from the Debian license texts, the
transformers checkpoint, greedy agreement and a token clock (how runs are run and recorded
is ``harness``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

# re-exported for the scripts that still import them from here (whisper.py, hf_generate.py)
from harness import (  # noqa: F401
    RESULTS,
    median_seconds,
    read_bandwidth,
    spawn_worker,
    table,
    write_json,
)

LICENSES = Path("/usr/share/common-licenses")


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

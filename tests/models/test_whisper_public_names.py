"""The documented public Whisper names import from ``kvcache.models.whisper``, whichever
module a program imports first (cached decoding lives in ``whisper_decode``, which imports
``whisper``: a re-export must not close an import cycle)."""

from __future__ import annotations

import subprocess
import sys

import pytest

IMPORT = (
    "from kvcache.models.whisper import WhisperConfig, Whisper, WhisperKVCache, "
    "forward_decoder_cached"
)
CHECK = (
    "import kvcache.models.whisper_decode as d\n"
    "assert WhisperKVCache is d.WhisperKVCache\n"
    "assert forward_decoder_cached is d.forward_decoder_cached\n"
    "assert Whisper is d.Whisper and WhisperConfig.tiny_en().n_text_layer == 4\n"
)


@pytest.mark.parametrize("first", ["", "import kvcache.models.whisper_decode"])
def test_documented_names_import_from_models_whisper(first: str) -> None:
    """In a fresh interpreter (nothing imported before but ``first``)."""
    code = f"{first}\n{IMPORT}\n{CHECK}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_star_import_and_unknown_name() -> None:
    import kvcache.models.whisper as w

    assert {"Whisper", "WhisperConfig", "WhisperKVCache", "forward_decoder_cached"} <= set(
        w.__all__
    )
    with pytest.raises(ImportError):
        exec("from kvcache.models.whisper import NoSuchName", {})

"""``import kvcache`` loads the caches only: the server stack (fastapi, uvicorn, starlette,
redis, prometheus_client) and the speech stack (soundfile, scipy) load where they are used.

Checked in a fresh interpreter, since this test session has imported them all already."""

from __future__ import annotations

import json
import subprocess
import sys

SERVER = ("fastapi", "uvicorn", "starlette", "redis", "prometheus_client")
AUDIO = ("soundfile", "scipy")


def loaded_after(statement: str) -> set[str]:
    """Top-level modules of SERVER + AUDIO that ``statement`` imports in a new interpreter."""
    probe = (
        f"import sys, json\n{statement}\n"
        f"print(json.dumps([m for m in {list(SERVER + AUDIO)!r} if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_kvcache_loads_neither_the_server_nor_the_audio_stack():
    assert loaded_after("import kvcache") == set()
    # the engine and the generate facade need neither
    assert loaded_after("import kvcache.engine, kvcache.generate") == set()


def test_the_probe_sees_imports_and_lazy_names_resolve():
    assert {"fastapi", "starlette", "prometheus_client"} <= loaded_after(
        "import kvcache.engine.server"
    )
    assert "scipy" in loaded_after(
        "import numpy, kvcache.audio.io as a; a.resample(numpy.ones(8), 8000)"
    )
    import kvcache
    import kvcache.transcription

    assert kvcache.transcribe is kvcache.transcription.transcribe
    assert "transcribe" in kvcache.__all__

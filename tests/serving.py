"""Test helper: the OpenAI-compatible app over an engine, behind uvicorn in a thread on
127.0.0.1 (port chosen by the OS), always stopped (imported by the serving tests)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import uvicorn

from kvcache.engine.loop import EngineLoop
from kvcache.engine.scheduler import Engine
from kvcache.engine.server import ServerState, create_app
from kvcache.text.tokenizer import Tokenizer

TIMEOUT = 60.0  # seconds any one HTTP call may take before the test fails (never a hang)


@dataclass
class Served:
    """A running server: its URL and the engine behind it (inspected directly by tests)."""

    url: str
    engine: Engine
    loop: EngineLoop
    state: ServerState

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
        )

    def cancelled(self) -> int:
        return self.state.prometheus.finishes().get("cancelled", 0)

    def wait_idle(self, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.busy:
            assert time.monotonic() < deadline, "the engine is still busy"
            time.sleep(0.05)


@contextlib.contextmanager
def serving(engine: Engine, tokenizer: Tokenizer, model_name: str) -> Iterator[Served]:
    """uvicorn on 127.0.0.1 in a thread; stopped (and the loop closed) whatever happens."""
    loop = EngineLoop(engine)
    app = create_app(loop, tokenizer, model_name=model_name)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive(), "uvicorn exited at start-up"
            assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield Served(f"http://127.0.0.1:{port}", engine, loop, app.state.kvcache)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        loop.close()
        assert not thread.is_alive(), "uvicorn did not stop"

"""An engine stepping on a background thread (what the server runs).

``submit`` from any thread; the thread steps while there is work and sleeps otherwise.
After every step it publishes ``snapshot`` (``Engine.metrics()``, swapped whole, never
mutated), which other threads read instead of walking engine state while it changes. A step
that raises ends every request with an ``error: ...`` event and frees their cells; the loop
keeps serving new requests.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvcache.engine.params import RequestParams
from kvcache.engine.request import Event, Request
from kvcache.engine.scheduler import Engine, Prompt

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs an engine's steps on a background thread; ``submit`` from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self.snapshot: dict[str, float] = engine.metrics()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvcache-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether requests submitted now will be stepped (a server's liveness check)."""
        return self._thread.is_alive() and not self._stop

    def submit(
        self,
        prompt: Prompt,
        params: RequestParams | None = None,
        listener: Callable[[Event], None] | None = None,
    ) -> Request:
        """Queue a request; ``listener`` is called on the engine thread with each event."""
        request = self.engine.submit(prompt, params, listener)
        self._wake.set()
        return request

    def wake(self) -> None:
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the engine thread between two steps (engine state is that thread's)."""
        future: Future[Any] = Future()
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)
            self.snapshot = self.engine.metrics()

    def _run(self) -> None:
        while not self._stop:
            self._run_calls()
            if not self.engine.busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except BaseException as e:  # noqa: BLE001 - kept for the server to report
                log.exception("engine step failed")
                self.error = e
                self.engine.fail_all(e)
            self.snapshot = self.engine.metrics()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

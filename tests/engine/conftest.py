"""A real redis-server on 127.0.0.1 (Debian package), started and stopped by the tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from kvcache.deploy import free_port, wait_for_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed: scripts/setup.sh installs it (apt-get)"
    port = free_port()
    work = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(work),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10

        def check() -> None:
            assert proc.poll() is None, "redis-server exited at start-up"
            assert time.monotonic() < deadline, "redis-server did not start in 10 s"

        wait_for_port(port, check)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)

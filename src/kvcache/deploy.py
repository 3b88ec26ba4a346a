"""Many replicas behind a router on loopback: N ``kvcache serve`` processes sharing prefix
blocks through one Redis, behind sglang-router, started and stopped by one command::

    python -m kvcache.deploy up --replicas 2 --port 8000 --policy cache_aware
    python -m kvcache.deploy up --replicas 2 --detach ... ; python -m kvcache.deploy down

    router   127.0.0.1:PORT        sglang-router launch --policy POLICY --worker-urls ...
    replica  127.0.0.1:PORT+1..N   kvcache serve --prefix-store redis://... [--kv-events ...]
    redis    127.0.0.1:(free)      redis-server, nothing saved to disk

``up`` waits until every replica and the router answer, then (in the foreground) serves
until Ctrl-C and stops everything; ``--detach`` leaves them running and records their
process ids in ``--state`` for ``down``. Replica i's KV events (``--kv-events``) are on
127.0.0.1:(EVENTS + 2i), its replay socket on the next port. Options after ``--`` go to
every ``kvcache serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvcache.errors import InvalidArgumentError

START_TIMEOUT_S = 300.0  # loading the weights on a busy machine
STOP_TIMEOUT_S = 30.0
DEFAULT_STATE = Path(".kvcache-deploy.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, check: Callable[[], None]) -> None:
    """Until 127.0.0.1:``port`` accepts a connection; ``check`` raises when waiting is hopeless."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            check()
            time.sleep(0.05)


def _tool(name: str) -> str:
    """An executable of this environment (the venv's bin first), or a typed error."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise InvalidArgumentError(name, None, f"{name} installed (pip / apt-get)")
    return found


@dataclass
class Deployment:
    """The processes of one deployment; ``start`` then ``stop`` (or use ``with``)."""

    replicas: int = 2
    port: int = 8000
    policy: str = "cache_aware"
    redis: bool = True
    threads: int | None = None
    kv_events: int | None = None  # first port of the replicas' KV-event sockets
    serve_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    logs: Path = Path("deploy-logs")
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    redis_url: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(self.replicas)]

    def events_endpoint(self, i: int) -> tuple[str, str]:
        """Replica i's KV-events and replay endpoints (with ``kv_events``)."""
        assert self.kv_events is not None, "no --kv-events port"
        base = self.kv_events + 2 * i
        return f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"

    def start(self) -> Deployment:
        """Start Redis, the replicas, then the router; wait until all answer."""
        if self.replicas < 1:
            raise InvalidArgumentError("replicas", self.replicas, "at least 1")
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            if self.redis:
                self._start_redis()
            for i in range(self.replicas):
                self._spawn(f"replica{i}", self._serve_command(i))
            for i, url in enumerate(self.replica_urls):
                self._wait(f"replica{i}", f"{url}/health")
            self._spawn("router", self._router_command())
            self._wait("router", f"{self.url}/v1/models")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        port = free_port()
        folder = self.logs / "redis"
        folder.mkdir(exist_ok=True)
        command = [_tool("redis-server"), "--bind", "127.0.0.1", "--port", str(port)]
        command += ["--save", "", "--appendonly", "no", "--dir", str(folder)]
        self._spawn("redis", command)
        deadline = time.monotonic() + 10
        wait_for_port(port, lambda: self._check_alive("redis", deadline))
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def _serve_command(self, i: int) -> list[str]:
        command = [sys.executable, "-m", "kvcache.cli", "serve", "--host", "127.0.0.1"]
        command += ["--port", str(self.port + 1 + i)]
        if self.threads is not None:
            command += ["--threads", str(self.threads)]
        if self.redis_url is not None:
            command += ["--prefix-store", self.redis_url]
        if self.kv_events is not None:
            events, replay = self.events_endpoint(i)
            command += ["--kv-events", events, "--kv-events-replay", replay]
        return command + self.serve_args

    def _router_command(self) -> list[str]:
        command = [_tool("sglang-router"), "launch", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--policy", self.policy]
        command += ["--worker-urls", *self.replica_urls]
        if "--prometheus-port" not in self.router_args:  # its default, 29000, may be taken
            command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return command + self.router_args

    def _spawn(self, name: str, command: list[str]) -> None:
        env = dict(os.environ)
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        with (self.logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def _check_alive(self, name: str, deadline: float) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {self.logs}/{name}.log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start; see {self.logs}/{name}.log")

    def _wait(self, name: str, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive(name, deadline)
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crashed replica), leaving the others running."""
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Stop the router, then the replicas, then Redis (SIGTERM, SIGKILL if it hangs)."""
        for name in sorted(self.procs, key=_stop_order):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=STOP_TIMEOUT_S)
        self.procs.clear()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_order(name: str) -> int:
    """The router first (no new requests), then the replicas, Redis last."""
    return 0 if name == "router" else 2 if name == "redis" else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvcache.deploy", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the router, the replicas and Redis")
    up.add_argument("--replicas", type=int, default=2, help="kvcache serve processes (2)")
    up.add_argument("--port", type=int, default=8000, help="router port; replicas follow (8000)")
    up.add_argument(
        "--policy",
        default="cache_aware",
        choices=("cache_aware", "round_robin", "random", "power_of_two"),
        help="sglang-router policy (cache_aware)",
    )
    up.add_argument("--threads", type=int, default=None, help="torch threads per replica")
    up.add_argument("--no-redis", action="store_true", help="no shared block store")
    up.add_argument("--kv-events", type=int, default=None, metavar="PORT", help="KV events")
    up.add_argument("--logs", type=Path, default=Path("deploy-logs"), help="log folder")
    up.add_argument("--detach", action="store_true", help="leave running; stop with down")
    up.add_argument("--state", type=Path, default=DEFAULT_STATE, help="process-id file")
    up.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- kvcache serve options")
    down = sub.add_parser("down", help="stop what up --detach started")
    down.add_argument("--state", type=Path, default=DEFAULT_STATE, help="process-id file")
    return parser


def _down(state: Path) -> int:
    if not state.is_file():
        print(f"nothing to stop: no {state}", file=sys.stderr)
        return 1
    pids: dict[str, int] = json.loads(state.read_text())
    for name in sorted(pids, key=_stop_order):
        try:
            os.killpg(pids[name], signal.SIGTERM)  # its session: the process and children
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(pids[name], 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.killpg(pids[name], signal.SIGKILL)
        print(f"stopped {name} ({pids[name]})")
    state.unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "down":
        return _down(args.state)
    extra = [a for a in args.serve_args if a != "--"]
    deployment = Deployment(
        replicas=args.replicas,
        port=args.port,
        policy=args.policy,
        redis=not args.no_redis,
        threads=args.threads,
        kv_events=args.kv_events,
        serve_args=extra,
        logs=args.logs,
    )
    deployment.start()
    print(f"router {deployment.url} -> " + " ".join(deployment.replica_urls), flush=True)
    if args.detach:
        args.state.write_text(json.dumps({n: p.pid for n, p in deployment.procs.items()}))
        print(f"running; stop with: python -m kvcache.deploy down --state {args.state}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() runs either way
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        deployment.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

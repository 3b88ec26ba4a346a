"""Prometheus text exposition (format 0.0.4) of the engine's counters and gauges.

The engine counts (``Engine.metrics()``, published after every step as
``EngineLoop.snapshot``); this module names, types and documents those numbers, adds the
per-second rates the issue asks for (a scrape is often read by people, not only by a
Prometheus that could compute ``rate()``), and the server-side tally of how requests ended.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PREFIX = "kvcache"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Metric:
    """One exported number: its Prometheus name (without prefix), type, help and source key."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    key: str  # key of the engine snapshot (or of the rates)


ENGINE_METRICS: tuple[Metric, ...] = (
    Metric("cells_total", "gauge", "Cells in the K/V pool.", "cells_total"),
    Metric("cells_used", "gauge", "Cells holding K/V (requests and prefix holders).", "cells_used"),
    Metric("cells_free", "gauge", "Free cells.", "cells_free"),
    Metric("prefix_blocks", "gauge", "Token blocks held by the prefix cache.", "prefix_blocks"),
    Metric("requests_running", "gauge", "Requests in the running batch.", "running"),
    Metric("requests_queued", "gauge", "Requests waiting for a slot.", "queued"),
    Metric(
        "prefix_hit_rate",
        "gauge",
        "Prompt tokens served from the prefix cache / prompt tokens.",
        "prefix_hit_rate",
    ),
    Metric("prompt_tokens_total", "counter", "Prompt tokens submitted.", "prompt_tokens_total"),
    Metric(
        "prefix_reused_tokens_total",
        "counter",
        "Prompt tokens taken from the prefix cache instead of computed.",
        "prefix_reused_tokens_total",
    ),
    Metric(
        "prefix_store_tokens_total",
        "counter",
        "Prompt tokens loaded from the block store (e.g. computed by another replica).",
        "prefix_store_tokens_total",
    ),
    Metric(
        "computed_tokens_total",
        "counter",
        "Tokens run through the model (prefill and decode).",
        "computed_tokens_total",
    ),
    Metric("generated_tokens_total", "counter", "Tokens generated.", "generated_tokens_total"),
    Metric("forwards_total", "counter", "Batched forward passes.", "forwards_total"),
    Metric("evictions_total", "counter", "Prefix holders evicted for room.", "evictions_total"),
    Metric(
        "preemptions_total",
        "counter",
        "Running requests preempted for room (recomputed later).",
        "preemptions_total",
    ),
    Metric(
        "store_published_blocks_total",
        "counter",
        "Blocks written to the block store.",
        "store_published_total",
    ),
    Metric(
        "store_rejected_blocks_total",
        "counter",
        "Block-store entries rejected as corrupt or mismatched.",
        "store_rejected_total",
    ),
    Metric(
        "store_errors_total",
        "counter",
        "Block-store calls that failed (store unreachable), treated as misses.",
        "store_errors_total",
    ),
)

RATE_METRICS: tuple[Metric, ...] = (
    Metric(
        "prompt_tokens_per_second",
        "gauge",
        "Prompt tokens submitted per second (sliding window).",
        "prompt_tokens_total",
    ),
    Metric(
        "generated_tokens_per_second",
        "gauge",
        "Tokens generated per second (sliding window).",
        "generated_tokens_total",
    ),
)


class RateMeter:
    """Per-second rates of counters over a sliding window of observed samples."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, Mapping[str, float]]] = deque()

    def observe(self, counters: Mapping[str, float]) -> None:
        """Record the counters now; samples older than the window (but the newest such) go."""
        t = self.clock()
        self._samples.append((t, counters))
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window_s:
            self._samples.popleft()

    def rate(self, key: str) -> float:
        """Increase of ``key`` per second between the oldest and newest samples (0 if < 2)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return 0.0
        return max(0.0, (last.get(key, 0.0) - first.get(key, 0.0)) / (t1 - t0))


class FinishTally:
    """How requests ended (stop, length, cancelled, error), counted from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _family(metric: Metric, samples: list[tuple[str, float]]) -> list[str]:
    name = f"{PREFIX}_{metric.name}"
    lines = [f"# HELP {name} {metric.help}", f"# TYPE {name} {metric.kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return lines


def render(
    snapshot: Mapping[str, float],
    rates: RateMeter,
    finishes: Mapping[str, int],
    *,
    up: bool,
) -> str:
    """The ``/metrics`` body."""
    lines: list[str] = []
    up_metric = Metric("engine_up", "gauge", "1 while the engine thread is stepping.", "")
    lines += _family(up_metric, [("", 1 if up else 0)])
    for m in ENGINE_METRICS:
        lines += _family(m, [("", snapshot.get(m.key, 0))])
    for m in RATE_METRICS:
        lines += _family(m, [("", rates.rate(m.key))])
    finished = Metric("requests_finished_total", "counter", "Requests ended, by finish reason.", "")
    lines += _family(
        finished, [(f'{{reason="{reason}"}}', n) for reason, n in sorted(finishes.items())]
    )
    return "\n".join(lines) + "\n"

"""The ``/metrics`` exposition, written by ``prometheus_client`` (as vLLM does).

The engine counts (``Engine.metrics()``, published after every step as
``EngineLoop.snapshot``); :class:`EngineCollector` names, types and documents those numbers
at scrape time and adds per-second rates (a scrape is often read by people, not only by a
Prometheus that could compute ``rate()``). How requests ended is a labelled
``prometheus_client.Counter`` incremented by the server's handlers::

    kvcache_preemptions_total 3.0
    kvcache_prefix_miss_total{reason="no_holder"} 12.0
    kvcache_requests_finished_total{reason="length"} 40.0

The load gauges the Gateway API Inference Extension's model-server protocol reads
(TotalQueuedRequests, KVCacheUtilization) are ours and, for scrapers configured for vLLM,
also under vLLM's names with its ``model_name`` label::

    kvcache_requests_queued 2.0           vllm:num_requests_waiting{model_name="m"} 2.0
    kvcache_requests_running 8.0          vllm:num_requests_running{model_name="m"} 8.0
    kvcache_kv_cache_usage_perc 0.75      vllm:kv_cache_usage_perc{model_name="m"} 0.75
                                          vllm:gpu_cache_usage_perc{model_name="m"} 0.75

Utilisation is a fraction (1 = full, as vLLM's): cells the running requests use over all
cells. Idle prefix holders do not count: like vLLM's cached free blocks, they are evicted
for the first request that needs their room.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvcache.engine.stats import MISS_REASONS

PREFIX = "kvcache"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes


@dataclass(frozen=True)
class Exported:
    """One exported number: its name (without prefix or _total), type, help and source key."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    key: str  # key of the engine snapshot (or of the rates)


ENGINE_METRICS: tuple[Exported, ...] = (
    Exported("cells_total", "gauge", "Cells in the K/V pool.", "cells_total"),
    Exported(
        "cells_used", "gauge", "Cells holding K/V (requests and prefix holders).", "cells_used"
    ),
    Exported("cells_free", "gauge", "Free cells.", "cells_free"),
    Exported("cells_running", "gauge", "Cells the running requests use.", "cells_running"),
    Exported(
        "held_bytes", "gauge", "Bytes the cells in use hold (codes, scales, windows).", "held_bytes"
    ),
    Exported(
        "pressed_cells", "counter", "Cells freed by --press after prefills.", "pressed_cells_total"
    ),
    Exported(
        "press_skipped",
        "counter",
        "Prefills left unpressed: no free cells for kvzip's repeat of the context.",
        "press_skipped_total",
    ),
    Exported("prefix_blocks", "gauge", "Token blocks held by the prefix cache.", "prefix_blocks"),
    Exported(
        "checkpoints",
        "gauge",
        "Local-layer checkpoints held (hybrid models: sliding-window layers' last window).",
        "checkpoints",
    ),
    Exported("checkpoint_bytes", "gauge", "Bytes the checkpoints hold.", "checkpoint_bytes"),
    Exported(
        "checkpoint_restores",
        "counter",
        "Prefix hits whose local layers were restored from a checkpoint.",
        "checkpoint_restores_total",
    ),
    Exported("requests_running", "gauge", "Requests in the running batch.", "running"),
    Exported("requests_queued", "gauge", "Requests waiting for a slot.", "queued"),
    Exported(
        "prefix_hit_rate",
        "gauge",
        "Prompt tokens served from the prefix cache / prompt tokens.",
        "prefix_hit_rate",
    ),
    Exported("prompt_tokens", "counter", "Prompt tokens submitted.", "prompt_tokens_total"),
    Exported(
        "prefix_reused_tokens",
        "counter",
        "Prompt tokens taken from the prefix cache instead of computed.",
        "prefix_reused_tokens_total",
    ),
    Exported(
        "prefix_store_tokens",
        "counter",
        "Prompt tokens loaded from the block store (e.g. computed by another replica).",
        "prefix_store_tokens_total",
    ),
    Exported(
        "computed_tokens",
        "counter",
        "Tokens run through the model (prefill, recompute and decode).",
        "computed_tokens_total",
    ),
    Exported("generated_tokens", "counter", "Tokens generated.", "generated_tokens_total"),
    Exported("forwards", "counter", "Batched forward passes.", "forwards_total"),
    Exported(
        "context_shifts",
        "counter",
        "Context shifts (a middle range dropped, later keys re-rotated).",
        "context_shifts_total",
    ),
    Exported("evictions", "counter", "Idle prefix holders evicted for room.", "evictions_total"),
    Exported("preemptions", "counter", "Running requests preempted for room.", "preemptions_total"),
    Exported(
        "restores",
        "counter",
        "Readmitted requests whose kept cells were restored.",
        "restores_total",
    ),
    Exported(
        "spills",
        "counter",
        "Preempted requests whose cells were moved into a host-memory or disk snapshot.",
        "spills_total",
    ),
    Exported(
        "spilled_bytes",
        "counter",
        "Bytes of K/V cells moved into spill snapshots.",
        "spilled_bytes_total",
    ),
    Exported(
        "store_published_blocks",
        "counter",
        "Blocks written to the block store.",
        "store_published_total",
    ),
    Exported(
        "store_rejected_blocks",
        "counter",
        "Block-store entries rejected as corrupt or mismatched.",
        "store_rejected_total",
    ),
    Exported(
        "store_errors",
        "counter",
        "Block-store calls that failed (store unreachable), treated as misses.",
        "store_errors_total",
    ),
)

RATE_METRICS: tuple[Exported, ...] = (
    Exported(
        "prompt_tokens_per_second",
        "gauge",
        "Prompt tokens submitted per second (sliding window).",
        "prompt_tokens_total",
    ),
    Exported(
        "generated_tokens_per_second",
        "gauge",
        "Tokens generated per second (sliding window).",
        "generated_tokens_total",
    ),
)

USAGE_HELP = "K/V-cache utilisation: cells the running requests use / all cells (1 = full)."
# vLLM's names for the load gauges (vllm:gpu_cache_usage_perc: its name before 0.10)
VLLM_ALIASES: tuple[tuple[str, str, str], ...] = (
    ("vllm:num_requests_waiting", "Requests waiting to be processed.", "queued"),
    ("vllm:num_requests_running", "Requests running.", "running"),
    ("vllm:kv_cache_usage_perc", USAGE_HELP, "kv_cache_usage"),
    ("vllm:gpu_cache_usage_perc", USAGE_HELP, "kv_cache_usage"),
)

MISS_HELP = "Requests that started without reusing all of their prompt, by why reuse stopped: " + (
    "; ".join(f"{reason}: {text}" for reason, text in MISS_REASONS.items())
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


def _family(name: str, kind: str, help_text: str, value: float) -> Metric:
    family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return family(f"{PREFIX}_{name}", help_text, value=value)


class EngineCollector:
    """A prometheus_client collector over an engine snapshot, read at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, float]],
        rates: RateMeter,
        up: Callable[[], bool],
        model_name: str = "",
    ) -> None:
        self._snapshot = snapshot
        self._rates = rates
        self._up = up
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        self._rates.observe(snap)
        yield _family("engine_up", "gauge", "1 while the engine thread is stepping.", self._up())
        for m in ENGINE_METRICS:
            yield _family(m.name, m.kind, m.help, snap.get(m.key, 0))
        total = snap.get("cells_total", 0)
        usage = snap.get("cells_running", 0) / total if total else 0.0
        yield _family("kv_cache_usage_perc", "gauge", USAGE_HELP, usage)
        loads = {**snap, "kv_cache_usage": usage}
        for name, help_text, key in VLLM_ALIASES:
            alias = GaugeMetricFamily(name, help_text, labels=["model_name"])
            alias.add_metric([self._model], loads.get(key, 0))
            yield alias
        for m in RATE_METRICS:
            yield _family(m.name, m.kind, m.help, self._rates.rate(m.key))
        misses = CounterMetricFamily(f"{PREFIX}_prefix_miss", MISS_HELP, labels=["reason"])
        for reason in MISS_REASONS:
            misses.add_metric([reason], snap.get(f"prefix_miss_total:{reason}", 0))
        yield misses


class ServerMetrics:
    """The registry of one server: the engine collector and the finish-reason counter."""

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, float]],
        rates: RateMeter,
        up: Callable[[], bool],
        model_name: str = "",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(snapshot, rates, up, model_name))
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "Requests ended, by finish reason.",
            ["reason"],
            registry=self.registry,
        )

    def finish(self, reason: str) -> None:
        """Count one request's end (any thread)."""
        self.finished.labels(reason).inc()

    def finishes(self) -> dict[str, int]:
        """Requests ended so far, by reason."""
        return {
            s.labels["reason"]: int(s.value)
            for metric in self.finished.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        }

    def render(self) -> bytes:
        """The ``/metrics`` body."""
        return generate_latest(self.registry)

"""The one engine behind ``kvcache generate`` and ``kvcache serve``: continuous batching over
one cell cache, prefix reuse, block stores, the HTTP server.

Layout (each module imports only the ones above it)::

    pressure.py context.py   what gives way when the pool is full; when a context is full
    params.py                EngineConfig, RequestParams (validated)
    stats.py                 EngineStats, prefix-miss reasons
    request.py               Request (one request's state and events), Event
    store.py                 block stores: memory, disk, Redis (safetensors blocks)
    reuse.py                 prefix reuse: index lookups, waits, store loads, holders
    scheduler.py             Engine: admit, plan, forward, sample, finish
    loop.py                  EngineLoop: an engine stepping on a background thread
    metrics.py               the Prometheus exposition (prometheus_client)
    protocol.py server.py    the OpenAI wire format and the FastAPI app (``kvcache serve``)

Importing this package loads neither the server stack nor a store client.
"""

from kvcache.engine.loop import EngineLoop
from kvcache.engine.params import EngineConfig, RequestParams
from kvcache.engine.request import Event, Request
from kvcache.engine.scheduler import Engine

__all__ = ["Engine", "EngineConfig", "EngineLoop", "Event", "Request", "RequestParams"]

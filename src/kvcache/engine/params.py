"""What the engine is asked to do: its sizes (EngineConfig) and one request's options
(RequestParams). Both validate on construction, so a bad value fails where it is written
with a typed error naming it, never deep inside a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.engine.context import POLICIES as CONTEXT_POLICIES
from kvcache.engine.pressure import HOLDER_EVICTIONS, PREEMPTIONS
from kvcache.engine.spill import spill_tier
from kvcache.errors import InvalidArgumentError, InvalidConfigError
from kvcache.models.sampling import SamplingParams
from kvcache.validate import config_int, is_int, optional_config_int


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and policies of one engine: context per request, parallel requests, reuse."""

    capacity: int = 4096  # positions one request may hold (prompt + generated)
    max_sequences: int = 8  # requests running at once
    max_batch: int = 256  # tokens per forward (decode tokens + prompt chunks)
    pool_sequences: int | None = None  # cells = pool_sequences * capacity (default max_sequences)
    block_size: int = 16  # tokens per prefix-cache block
    prefix_cache: bool = True
    codec: str | None = None  # cell codec (None: the model's dtype)
    window: int | None = None  # sliding-window attention: the cache forgets, nothing shifts
    context: str = "reject"  # "reject": prompt + max_tokens must fit; "shift": drop the middle
    keep: int | None = None  # tokens a context shift keeps at the start (default min(4, C/4))
    preemption: str = "spill"  # kvcache.engine.pressure.PREEMPTIONS: "spill" | "recompute"
    spill: str = "memory"  # where spilled cells wait: "memory" | "disk:PATH" (engine/spill.py)
    holder_eviction: str = "demote"  # kvcache.engine.pressure.HOLDER_EVICTIONS
    press: str | None = None  # kvcache.press spec applied after each prefill (no prefix reuse)
    press_cells: int | None = None  # with press: each request pressed back to this many cells
    press_every: int = 16  # ... every this many decode steps, once it holds more
    checkpoints: int = 4  # hybrid models: local-layer checkpoints a sequence keeps (a ring)
    checkpoint_every: int = 16  # ... one after each prompt chunk and every this many positions

    def __post_init__(self) -> None:
        config_int("capacity", self.capacity, 2)
        config_int("max_sequences", self.max_sequences, 1)
        config_int("max_batch", self.max_batch, 1)
        config_int("block_size", self.block_size, 1)
        optional_config_int("pool_sequences", self.pool_sequences, 1)
        optional_config_int("window", self.window, 1)
        if not isinstance(self.prefix_cache, bool):
            raise InvalidConfigError("prefix_cache", self.prefix_cache, "a bool")
        if self.context not in CONTEXT_POLICIES:
            raise InvalidConfigError("context", self.context, f"one of {list(CONTEXT_POLICIES)}")
        if self.keep is not None:
            config_int("keep", self.keep, 0)
            if self.keep >= self.capacity // 2:
                raise InvalidConfigError(
                    "keep", self.keep, f"an int < capacity // 2 = {self.capacity // 2}"
                )
        optional_config_int("press_cells", self.press_cells, 1)
        config_int("press_every", self.press_every, 1)
        config_int("checkpoints", self.checkpoints, 1)
        config_int("checkpoint_every", self.checkpoint_every, 1)
        if self.press is not None:
            from kvcache.press import make_press

            press = make_press(self.press)  # InvalidArgumentError naming the spec
            if self.press_cells is not None and press.reconstructs:
                raise InvalidConfigError(
                    "press_cells",
                    self.press_cells,
                    f"None with {self.press!r} (kvzip presses "
                    "once, after a prefill: it repeats the context through the model)",
                )
        elif self.press_cells is not None:
            raise InvalidConfigError(
                "press_cells", self.press_cells, "None without a press (press='snapout:0' ...)"
            )
        if self.preemption not in PREEMPTIONS:
            raise InvalidConfigError("preemption", self.preemption, f"one of {list(PREEMPTIONS)}")
        spill_tier(self.spill)  # raises InvalidConfigError for a bad spec
        if self.holder_eviction not in HOLDER_EVICTIONS:
            raise InvalidConfigError(
                "holder_eviction", self.holder_eviction, f"one of {list(HOLDER_EVICTIONS)}"
            )

    @property
    def kept_tokens(self) -> int:
        """Tokens a context shift keeps at the start (the "attention sink")."""
        return min(4, self.capacity // 4) if self.keep is None else self.keep

    @property
    def pool(self) -> int:
        """Sequences' worth of cells in the pool."""
        return self.pool_sequences or self.max_sequences


MAX_CACHE_SALT = 256  # characters: a tenant id or a secret, not a document


@dataclass(frozen=True)
class RequestParams:
    """One request's options (OpenAI's, and ``generate``'s): length, sampling, stop strings.

    ``stop`` may be given as a list; it is kept as a tuple. ``cache_salt`` (vLLM's field)
    puts the request's prefix blocks in a namespace of their own: they are shared only with
    requests carrying the same salt (None: the shared namespace).
    """

    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens", self.max_tokens, "an int >= 1")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentError("sampling", self.sampling, "a SamplingParams")
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, tuple | list):
            raise InvalidArgumentError("stop", stop, "a tuple of non-empty str")
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgumentError("stop", stop, "a tuple of non-empty str")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError("ignore_eos", self.ignore_eos, "a bool")
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT):
            raise InvalidArgumentError(
                "cache_salt", salt, f"None or a non-empty str of at most {MAX_CACHE_SALT} chars"
            )

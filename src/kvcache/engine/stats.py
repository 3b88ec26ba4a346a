"""The engine's counters: tokens, forwards and their time, reuse, memory pressure.

Counted on the stepping thread; ``Engine.metrics()`` turns them into the flat snapshot that
``/metrics`` exports and the ``kvcache generate`` stats line reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a prompt's reusable part (all of it but its last token) was not all reused: the reason
# the reuse stopped, counted once per request when it starts (kvcache_prefix_miss_total).
MISS_REASONS: dict[str, str] = {
    "no_holder": "no cached sequence or stored block holds the next block of the prompt",
    "evicted": "the next block's holder was evicted for room, or a sliding window forgot it",
    "partial_block": "the rest of the prompt is shorter than a block (only whole blocks are "
    "shared)",
    "model_mismatch": "the block store's entry was written by another model",
    "codec_mismatch": "the block store's entry holds another codec's K/V",
    "corrupt": "the block store's entry failed its format or checksum checks",
    "store_unavailable": "the block store could not be reached",
    "no_checkpoint": "the holder's local (sliding-window) layers forgot the hit and no "
    "checkpoint of theirs lies at or before it with the window before it held: all computed",
    "checkpoint_behind": "the nearest local-layer checkpoint lies before the hit: the tokens "
    "between it and the hit are computed",
}


@dataclass
class EngineStats:
    """Counters since start (a forward with any prompt or recompute rows counts as prefill)."""

    prompt_tokens: int = 0  # tokens of all prompts submitted
    prefill_tokens: int = 0  # prompt (and recompute) tokens run through the model
    prefill_seconds: float = 0.0
    decode_tokens: int = 0  # tokens sampled in decode-only forwards
    decode_seconds: float = 0.0
    computed_tokens: int = 0  # every token run through the model (prefill + decode)
    generated_tokens: int = 0
    forwards: int = 0
    shifts: int = 0  # context shifts (a middle range removed, later keys re-rotated)
    reused_tokens: int = 0  # prompt tokens served from the prefix cache (local or store)
    store_tokens: int = 0  # ... of which loaded from the block store
    evictions: int = 0  # idle prefix holders evicted for room
    preemptions: int = 0  # running requests preempted for room
    restores: int = 0  # readmitted requests whose cells a preemption policy kept and restored
    spills: int = 0  # preempted requests whose cells were moved into a snapshot (spill tier)
    spilled_bytes: int = 0  # bytes of those snapshots' cells
    store_published: int = 0
    store_rejected: int = 0  # block-store entries refused (corrupt, other model or codec)
    store_errors: int = 0  # block-store calls that failed (treated as a miss)
    finished: int = 0
    pressed_cells: int = 0  # cells a press freed after prefills
    press_skipped: int = 0  # prefills left unpressed: no room for kvzip's repeat
    history_fp16_bytes: int = 0  # finished requests: fp16 bytes of the tokens they saw
    held_bytes: int = 0  # ... and the bytes their cells held at the end

    @property
    def total_compression(self) -> float:
        """fp16 bytes of finished requests' histories / the bytes their cells held."""
        return self.history_fp16_bytes / self.held_bytes if self.held_bytes else 0.0

    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens computed per second of prefill."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_rate(self) -> float:
        """Tokens generated per second of decode-only forwards (all sequences together)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

"""What a request does when its context would pass ``capacity`` positions.

reject   submit refuses prompt + max_tokens > capacity (a server's contract)
shift    keep the first ``keep`` tokens, and any prefix whose cells another sequence
         shares (shared cells cannot move); drop half of the rest with
         ``cache.remove(seq, keep, keep + discard)``, which re-rotates the later keys
         through RoPE; continue at the lower positions (llama.cpp's context shift)::

             before  [ k k | a a a a | b b b b ] + new token  (capacity 10, keep 2)
             after   [ k k | b b b b ] + new token             discard (8 - 2) // 2 = 3

window   sliding-window attention: the cache forgets old cells itself, positions grow
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvcache.errors import InvalidArgumentError


class ContextPolicy(Protocol):
    """Checks a request at submission and makes room for its next tokens."""

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise InvalidArgumentError if the request could never run."""
        ...

    def cut(self, held: int, count: int, pinned: int) -> tuple[int, int]:
        """(keep, discard): drop positions [keep, keep + discard) before feeding ``count``
        more tokens to a sequence holding ``held``; ``pinned`` positions may not move."""
        ...

    def room(self, held: int, count: int) -> int:
        """How many of ``count`` tokens fit after ``held`` positions (0: the context is full)."""
        ...


class Reject:
    """prompt + max_tokens must fit ``capacity``: checked once, never shifted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def check(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.capacity:
            raise InvalidArgumentError(
                "prompt",
                f"<{prompt_len} tokens + max_tokens {max_tokens}>",
                f"at most {self.capacity} tokens in all (the context length)",
            )

    def cut(self, held: int, count: int, pinned: int) -> tuple[int, int]:
        return 0, 0

    def room(self, held: int, count: int) -> int:
        assert held + count <= self.capacity, f"{held} + {count} > {self.capacity}: not checked"
        return count


class Shift:
    """Context shift: any length, the middle of the context goes when it is full."""

    def __init__(self, capacity: int, keep: int) -> None:
        self.capacity = capacity
        self.keep = keep

    def check(self, prompt_len: int, max_tokens: int) -> None:
        return None

    def cut(self, held: int, count: int, pinned: int) -> tuple[int, int]:
        if held + count <= self.capacity:
            return 0, 0
        keep = max(self.keep, pinned)
        return keep, max(0, (held - keep) // 2)

    def room(self, held: int, count: int) -> int:
        return max(0, min(count, self.capacity - held))


class Window:
    """Sliding window: the cache evicts what no token can see; nothing to check or cut."""

    def check(self, prompt_len: int, max_tokens: int) -> None:
        return None

    def cut(self, held: int, count: int, pinned: int) -> tuple[int, int]:
        return 0, 0

    def room(self, held: int, count: int) -> int:
        return count


# EngineConfig.context -> the policy, given (capacity, keep); a window overrides the choice
POLICIES: dict[str, Callable[[int, int], ContextPolicy]] = {
    "reject": lambda capacity, keep: Reject(capacity),
    "shift": Shift,
}


def context_policy(name: str, capacity: int, keep: int, window: int | None) -> ContextPolicy:
    """The policy a request runs under (with a sliding window the cache forgets instead)."""
    return Window() if window is not None else POLICIES[name](capacity, keep)

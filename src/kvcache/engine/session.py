"""Sessions (llama.cpp's ``--prompt-cache``): a prompt's cells saved to a file after a run
and restored into the engine's prefix index before the next one, which then computes only
what follows the longest common prefix of the saved tokens and its prompt::

    run 1   prompt [a b c d e]          computed; the cells of a..e saved with their tokens
    run 2   prompt [a b c x y]          a b c restored (the snapshot's head: nothing is
                                        re-encoded) as an idle prefix holder; the request
                                        shares them (an ordinary prefix hit), computes x y

A session file is a :class:`~kvcache.snapshot.Snapshot` whose token ids sit at positions
0..n-1 (a hybrid cache's: a :class:`~kvcache.snapshot.HybridSnapshot`, the global layers'
cells and the local layers' checkpoint at n); restoring checks the model, codec and every
byte as any snapshot restore does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache.engine.reuse import PrefixReuse
from kvcache.errors import InvalidArgumentError, NotSupportedError
from kvcache.snapshot import HybridSnapshot, Snapshot

if TYPE_CHECKING:
    from kvcache.engine.scheduler import Engine


def restore_session(
    engine: Engine, snapshot: Snapshot | HybridSnapshot, prompt: Sequence[int]
) -> int:
    """Restore the cells of ``snapshot`` whose tokens start ``prompt`` (their longest common
    prefix; the file's tail is cut off, not restored) as an idle prefix holder of
    ``engine``; returns the tokens restored.

    Raises the snapshot's typed errors (another model or codec, a full pool), changing
    nothing, and InvalidArgumentError for a snapshot that is not a session's."""
    reuse = _reuse(engine)
    tokens = snapshot.tokens
    if tokens is None or snapshot.positions != list(range(len(tokens))):
        raise InvalidArgumentError(
            "snapshot", f"<{len(snapshot)} cells>", "a session: token ids at positions 0..n-1"
        )
    common = next((i for i, (a, b) in enumerate(zip(tokens, prompt, strict=False)) if a != b), None)
    common = min(len(tokens), len(prompt)) if common is None else common
    if isinstance(snapshot, HybridSnapshot) and not snapshot.local.resumes(common):
        return 0  # the local layers' window before the common prefix is not in the file
    if common == 0:
        return 0
    if common < len(snapshot):
        snapshot = snapshot.head(common)
    seq = engine.new_sequence()
    engine.cache.restore(snapshot, seq, model_id=engine.model.model_id)  # type: ignore[arg-type]
    return reuse.adopt(seq, tokens[:common], snapshot)


def session_snapshot(engine: Engine, tokens: list[int]) -> Snapshot | HybridSnapshot | None:
    """The cells of the longest prefix of ``tokens`` that the engine holds at positions
    0..n-1 (None: it holds none), to save as a session."""
    reuse = _reuse(engine)
    match = reuse.index.lookup(tokens)
    if match.holder is None or engine.cache.positions(match.holder)[:1] != [0]:
        return None  # nothing held, or a sliding window forgot the start
    held = tokens[: match.tokens]
    return reuse.resumer.session(match.holder, held, engine.new_sequence())


def _reuse(engine: Engine) -> PrefixReuse:
    if not isinstance(engine.reuse, PrefixReuse):
        raise NotSupportedError("sessions need the prefix cache (EngineConfig.prefix_cache)")
    return engine.reuse

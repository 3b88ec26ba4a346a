"""Decoding one window as a step machine, so that many windows share one batched forward.

A search owns a few sequences of a :class:`~kvcache.models.whisper_decode.WhisperKVCache`
(ids handed to it) and is driven from outside::

    tokens, seqs, rows = search.rows()      # what it feeds next (the prompt first)
    logits = forward_decoder_step(model, tokens, seqs, cache, logits_rows=rows)
    done = search.advance(logits, cache)    # pick tokens; fork / free sequences
    search.result()                         # once done: tokens, log-probs, no-speech prob

The prompt is fed once, on the first sequence; other sequences share its cells
(``copy_prefix``). :class:`SampleSearch` is greedy at temperature 0 and draws ``n``
independent samples above it; :class:`BeamSearch` keeps beams as sequences (children share
their parent's cells, pruned beams free theirs). Scores are OpenAI's: log-probabilities of
the rule-filtered logits, eot included; the best candidate maximises sum / length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvcache.models.whisper import Whisper
from kvcache.models.whisper_decode import WhisperKVCache, forward_decoder_step
from kvcache.transcription.rules import LogitRules


@dataclass(frozen=True)
class Decoded:
    """One decode of one window: its tokens (no prompt, no eot) and its scores."""

    tokens: list[int]
    sum_logprob: float
    no_speech_prob: float
    temperature: float

    @property
    def avg_logprob(self) -> float:
        """Sum of log-probabilities over the tokens and eot (OpenAI's ``avg_logprob``)."""
        return self.sum_logprob / (len(self.tokens) + 1)


@dataclass(frozen=True)
class SearchSpec:
    """What a search decodes: after ``prompt``, at most ``max_new`` tokens."""

    prompt: list[int]
    rules: LogitRules
    max_new: int
    temperature: float = 0.0

    @property
    def sot_index(self) -> int:
        """The prompt row whose logits give the no-speech probability."""
        return self.prompt.index(self.rules.sp.sot)


class Search(ABC):
    """A window's decode over cache sequences ``seqs`` (the first holds the prompt)."""

    def __init__(self, spec: SearchSpec, seqs: list[int]) -> None:
        assert seqs, "a search needs at least one sequence"
        self.spec = spec
        self.seqs = seqs
        self.no_speech_prob = 0.0
        self._prefilled = False

    def rows(self) -> tuple[list[int], list[int], list[int]]:
        """Tokens and their sequences to feed next, and the rows whose logits are needed."""
        if not self._prefilled:
            p = self.spec.prompt
            wanted = sorted({self.spec.sot_index, len(p) - 1})
            return list(p), [self.seqs[0]] * len(p), wanted
        tokens, seqs = self._step_rows()
        return tokens, seqs, list(range(len(tokens)))

    def advance(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool:
        """Take the logits [R, V] of the rows asked for; True once the search is done."""
        if not self._prefilled:
            self._prefilled = True
            no_speech = self.spec.rules.sp.no_speech
            if no_speech is not None:  # raw logits at <|startoftranscript|>, as CTranslate2
                self.no_speech_prob = float(logits[0].float().softmax(-1)[no_speech])
            return self._first(logits[-1:].clone(), cache)
        return self._next(logits, cache)

    def _logprobs(self, logits: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:
        """Rule-filtered log-probabilities [R, V] (logits filtered in place)."""
        self.spec.rules.apply(logits, histories)
        return logits.float().log_softmax(-1)

    @abstractmethod
    def _step_rows(self) -> tuple[list[int], list[int]]: ...

    @abstractmethod
    def _first(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool: ...

    @abstractmethod
    def _next(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool: ...

    @abstractmethod
    def result(self) -> Decoded: ...


@dataclass
class _Sample:
    seq: int
    tokens: list[int]
    logprob: float = 0.0
    done: bool = False


class SampleSearch(Search):
    """``len(seqs)`` candidates, each its own sequence: argmax at temperature 0, else samples
    from softmax(logits / T) drawn with ``generator`` (deterministic for a seed)."""

    def __init__(
        self, spec: SearchSpec, seqs: list[int], generator: torch.Generator | None = None
    ) -> None:
        super().__init__(spec, seqs)
        self.generator = generator
        self.samples = [_Sample(s, []) for s in seqs]

    def _live(self) -> list[_Sample]:
        return [s for s in self.samples if not s.done]

    def _step_rows(self) -> tuple[list[int], list[int]]:
        live = self._live()
        return [s.tokens[-1] for s in live], [s.seq for s in live]

    def _first(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool:
        for s in self.samples[1:]:
            cache.copy_prefix(self.samples[0].seq, s.seq)  # the prompt's cells, shared
        return self._choose(logits.expand(len(self.samples), -1).clone(), self.samples)

    def _next(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool:
        return self._choose(logits, self._live())

    def _choose(self, logits: torch.Tensor, live: list[_Sample]) -> bool:
        logp = self._logprobs(logits, [s.tokens for s in live])  # [R, V]
        t = self.spec.temperature
        if t == 0:
            picked = logits.argmax(-1)  # [R]
        else:
            # a draw from softmax(logits / t) by the Gumbel-max trick (multinomial is slow here)
            u = torch.rand(logits.shape, generator=self.generator).clamp_(min=1e-30)  # [R, V]
            picked = (logits.float() / t - (-u.log()).log()).argmax(-1)  # [R]
        eot = self.spec.rules.sp.eot
        for s, token, row in zip(live, picked.tolist(), logp, strict=True):
            s.logprob += float(row[token])
            if token == eot:
                s.done = True
                continue
            s.tokens.append(token)
            s.done = len(s.tokens) >= self.spec.max_new
        return not self._live()

    def result(self) -> Decoded:
        best = max(self.samples, key=lambda s: s.logprob / max(1, len(s.tokens)))
        return Decoded(best.tokens, best.logprob, self.no_speech_prob, self.spec.temperature)


@dataclass
class _Beam:
    seq: int  # sequence id in the cell cache
    tokens: list[int]
    score: float  # sum of log-probabilities


class BeamSearch(Search):
    """Beam search (temperature 0) with ``len(seqs) >= 2 * beam_size`` sequences; stops once
    ``round(beam_size * patience)`` hypotheses ended (CTranslate2's / OpenAI's rule)."""

    def __init__(
        self, spec: SearchSpec, seqs: list[int], beam_size: int, patience: float = 1.0
    ) -> None:
        assert len(seqs) >= 2 * beam_size, (len(seqs), beam_size)
        super().__init__(spec, seqs)
        self.beam_size = beam_size
        self.want_finished = max(1, round(beam_size * patience))
        self.beams = [_Beam(seqs[0], [], 0.0)]
        self.finished: list[tuple[list[int], float]] = []
        self.steps = 0

    def _step_rows(self) -> tuple[list[int], list[int]]:
        return [b.tokens[-1] for b in self.beams], [b.seq for b in self.beams]

    def _first(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool:
        return self._next(logits, cache)

    def _next(self, logits: torch.Tensor, cache: WhisperKVCache) -> bool:
        eot = self.spec.rules.sp.eot
        logp = self._logprobs(logits, [b.tokens for b in self.beams])  # [B, V]
        logp = logp + torch.tensor([b.score for b in self.beams])[:, None]
        scores, flat = logp.flatten().topk(min(2 * self.beam_size, logp.numel()))
        live: list[tuple[int, int, float]] = []  # (parent index, token, score), best first
        for score, idx in zip(scores.tolist(), flat.tolist(), strict=True):
            parent, token = divmod(idx, logp.shape[1])
            if score == -float("inf") or len(live) == self.beam_size:
                break
            if token == eot:
                self.finished.append((self.beams[parent].tokens, score))
            else:
                live.append((parent, token, score))
        self.steps += 1
        if len(self.finished) >= self.want_finished or not live:
            return True
        if self.steps == self.spec.max_new:  # out of length: the live beams compete as they are
            self.finished.extend((self.beams[p].tokens + [t], s) for p, t, s in live)
            return True
        self.beams = self._reassign(cache, live)
        return False

    def _reassign(self, cache: WhisperKVCache, live: list[tuple[int, int, float]]) -> list[_Beam]:
        """New beams: a parent's first child keeps its sequence, other children share its cells
        through copy_prefix, childless parents are removed (their unshared cells freed)."""
        parents = {b.seq for b in self.beams}
        free = iter(s for s in self.seqs if s not in parents)
        used: set[int] = set()
        out = []
        for parent, token, score in live:
            src = self.beams[parent]
            if src.seq not in used:
                seq = src.seq
            else:
                seq = next(free)
                cache.copy_prefix(src.seq, seq)
            used.add(seq)
            out.append(_Beam(seq, [*src.tokens, token], score))
        for seq in parents - used:
            cache.remove(seq)
        return out

    def result(self) -> Decoded:
        if not self.finished:
            return Decoded([], 0.0, self.no_speech_prob, 0.0)
        tokens, score = max(self.finished, key=lambda f: f[1] / max(1, len(f[0])))
        return Decoded(tokens, score, self.no_speech_prob, 0.0)


@torch.inference_mode()
def run_search(model: Whisper, search: Search, cache: WhisperKVCache) -> Decoded:
    """Drive one search alone to its end on ``cache`` (its sequences attached already)."""
    done = False
    while not done:
        tokens, seqs, rows = search.rows()
        logits = forward_decoder_step(model, tokens, seqs, cache, logits_rows=rows)
        done = search.advance(logits, cache)
    return search.result()

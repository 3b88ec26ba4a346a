"""Reference Whisper decoding with no cache: ``forward_decoder`` over the whole sequence at
every step (greedy and beam search). The cached searches of ``kvcache.transcription`` must
reproduce these token for token; benchmarks/whisper.py times them as the uncached baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.models.whisper import Whisper
from kvcache.transcription.rules import LogitRules


def _last_logits(model: Whisper, audio: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return model.forward_decoder(torch.tensor([tokens]), audio)[0, -1:]  # [1, V]


@torch.inference_mode()
def greedy_uncached(
    model: Whisper, audio: torch.Tensor, prompt: Sequence[int], rules: LogitRules, max_new: int
) -> list[int]:
    """Greedy tokens after ``prompt`` (eot excluded) for one window's audio states [1, S, n]."""
    out: list[int] = []
    while len(out) < max_new:
        logits = _last_logits(model, audio, [*prompt, *out]).clone()
        rules.apply(logits, [out])
        token = int(logits[0].argmax())
        if token == rules.sp.eot:
            break
        out.append(token)
    return out


@torch.inference_mode()
def beam_uncached(
    model: Whisper,
    audio: torch.Tensor,
    prompt: Sequence[int],
    rules: LogitRules,
    max_new: int,
    beam_size: int,
    patience: float = 1.0,
) -> list[int]:
    """Beam search (eot excluded) scoring every beam with a full forward_decoder."""
    eot = rules.sp.eot
    want_finished = max(1, round(beam_size * patience))
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for step in range(max_new):
        batch = torch.tensor([[*prompt, *b] for b, _ in beams])
        logits = model.forward_decoder(batch, audio.expand(len(beams), -1, -1))[:, -1].clone()
        rules.apply(logits, [b for b, _ in beams])
        logp = logits.float().log_softmax(-1) + torch.tensor([s for _, s in beams])[:, None]
        scores, flat = logp.flatten().topk(min(2 * beam_size, logp.numel()))
        live: list[tuple[list[int], float]] = []
        for score, idx in zip(scores.tolist(), flat.tolist(), strict=True):
            parent, token = divmod(idx, logp.shape[1])
            if score == -float("inf") or len(live) == beam_size:
                break
            if token == eot:
                finished.append((beams[parent][0], score))
            else:
                live.append(([*beams[parent][0], token], score))
        if len(finished) >= want_finished or not live:
            break
        if step == max_new - 1:
            finished.extend(live)
            break
        beams = live
    if not finished:
        return []
    return max(finished, key=lambda f: f[1] / max(1, len(f[0])))[0]

"""Whisper's logit rules, as CTranslate2 applies them (so transcripts compare with it).

``suppress_ids`` every step, ``suppress_ids_begin`` at the first step, and, when timestamps
are decoded, the timestamp rules: <|notimestamps|> never; the first token a timestamp
<= <|1.00|>; timestamps in pairs (after a pair: text or eot; after a lone timestamp that
follows text: a timestamp or eot); never decreasing; a timestamp forced when the timestamps'
total probability beats every text token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.text.whisper_tokenizer import SpecialTokens

MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp is at most <|1.00|>


class LogitRules:
    """Whisper's suppress-token and timestamp rules, applied in place to rows of logits."""

    def __init__(
        self,
        special: SpecialTokens,
        n_vocab: int,
        suppress: Sequence[int],
        suppress_begin: Sequence[int],
        timestamps: bool,
    ) -> None:
        self.sp = special
        self.n_vocab = n_vocab
        self.suppress = torch.tensor(sorted(set(suppress)), dtype=torch.int64)
        self.suppress_begin = torch.tensor(sorted(set(suppress_begin)), dtype=torch.int64)
        self.timestamps = timestamps

    def apply(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> None:
        """Row i of logits [T, n_vocab] follows generated tokens ``histories[i]``."""
        if len(self.suppress):
            logits[:, self.suppress] = -torch.inf
        check = []  # rows whose timestamps may be forced by their total probability
        for i, (row, hist) in enumerate(zip(logits, histories, strict=True)):
            if not hist and len(self.suppress_begin):
                row[self.suppress_begin] = -torch.inf
            if self.timestamps and self._timestamp_rules(row, hist):
                check.append(i)
        if check:  # one log-softmax for all those rows, after every other rule
            tb = self.sp.timestamp_begin
            logp = logits[check].float().log_softmax(-1)  # [C, V]
            forced = logp[:, tb:].logsumexp(-1) > logp[:, :tb].max(-1).values  # [C]
            for i in torch.tensor(check)[forced].tolist():
                logits[i, :tb] = -torch.inf

    def _timestamp_rules(self, row: torch.Tensor, hist: Sequence[int]) -> bool:
        """Mask ``row`` in place; True when the timestamp-probability check applies to it."""
        tb, eot = self.sp.timestamp_begin, self.sp.eot
        row[self.sp.no_timestamps] = -torch.inf
        if not hist:  # begin with a timestamp, and an early one
            row[:tb] = -torch.inf
            row[tb + MAX_INITIAL_TIMESTAMP_INDEX + 1 :] = -torch.inf
            return False
        check_probability = True
        if hist[-1] >= tb:
            penultimate = hist[-2] if len(hist) >= 2 else hist[-1]
            if penultimate >= tb:  # a pair just closed: text (or eot) must follow
                row[tb:] = -torch.inf
                check_probability = False
            else:  # an open segment: its end timestamp (or eot) must follow
                row[:eot] = -torch.inf
        last_ts = next((t for t in reversed(hist) if t >= tb), None)
        if last_ts is not None:  # timestamps never decrease
            row[tb:last_ts] = -torch.inf
        return check_probability

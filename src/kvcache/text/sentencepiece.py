"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``) as ``tokenizers`` BPE.

A SentencePiece BPE model merges, at each step, the adjacent pair whose joined piece scores
best. That is BPE whose merges are every split ``(left, right)`` of a vocabulary piece into
two pieces, ranked by the joined piece's score; GGUF stores no merges, so they are derived
here. Gemma's scores fall with the token index, so the index is the rank (as transformers
builds it from the same file). Text is normalised by writing spaces as ``▁`` (no prefix
space: ``tokenizer.ggml.add_space_prefix`` is false for Gemma), characters outside the
vocabulary fall back to their UTF-8 bytes (the ``<0xNN>`` pieces), and decoding reverses both.

Gemma stores its pieces of several spaces as real spaces ("  ") where the normalised text
spells them ``▁▁``: they are respelled so that they match (and merge).
"""

from __future__ import annotations

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space
UNKNOWN = "<unk>"


def respell(tokens: list[str]) -> list[str]:
    """Pieces of real spaces spelled as ``▁`` runs (how the normalised text spells them)."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]


def derive_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best joined piece first (lowest index), and
    within one piece the longer left part first (the order transformers gives ties)."""
    rank = {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last index
    merges: list[tuple[int, int, str, str]] = []
    for piece, index in rank.items():
        for cut in range(len(piece) - 1, 0, -1):  # longer left part first
            left, right = piece[:cut], piece[cut:]
            if left in rank and right in rank:
                merges.append((index, -cut, left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def sentencepiece_backend(tokens: list[str]) -> Backend:
    """A ``tokenizers`` pipeline for a GGUF SentencePiece vocabulary (``tokens`` in id order)."""
    spelled = respell(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    model = models.BPE(
        vocab=vocab,
        merges=derive_merges(spelled),
        unk_token=UNKNOWN if UNKNOWN in vocab else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend

"""Options shared by the commands that run a model on the cell cache."""

from __future__ import annotations

import argparse


def add_kv_codec(parser: argparse.ArgumentParser) -> None:
    """``--kv-codec SPEC``: how the cache stores K/V (a ``kvcache.codecs`` spec)."""
    parser.add_argument(
        "--kv-codec",
        default=None,
        metavar="SPEC",
        help="how the cache stores K/V: fp32, fp16, bf16, int8, int4, kivi4, turbo4, turbo3, "
        "kivi2, or KEY/VALUE such as int8/int4 (default: the weights' dtype)",
    )


def add_press(parser: argparse.ArgumentParser) -> None:
    """``--press SPEC``: evict cells of each request after its prefill (``kvcache.press``)."""
    parser.add_argument(
        "--press",
        default=None,
        metavar="SPEC",
        help="after each prompt's prefill keep (1 - RATIO) of its cells: NAME:RATIO with NAME "
        "streaming, snapkv, snapout, knorm, tova, expected, adakv, chunkkv or kvzip, e.g. "
        "chunkkv:0.5; "
        "chunkkv:0.5,inner=kvzip keeps what the model needs to repeat the prompt (a second "
        "pass over it) (turns prefix reuse off)",
    )


def check_press(spec: str | None) -> None:
    """Raise InvalidArgumentError for a bad ``--press`` before any weights load."""
    from kvcache.press import make_press

    if spec is not None:
        make_press(spec)


def check_kv_codec(spec: str | None) -> None:
    """Raise InvalidConfigError for a bad ``--kv-codec`` before any weights load."""
    from kvcache.codecs import make_codec

    if spec is not None:
        make_codec(spec, "key")
        make_codec(spec, "value")

"""Options shared by the commands that run a model on the cell cache."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from kvcache.models.llama import WeightKind


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
    """``--press SPEC`` (evict cells of each request after its prefill, ``kvcache.press``),
    ``--press-cells N`` and ``--press-every K`` (and during decode)."""
    parser.add_argument(
        "--press",
        default=None,
        metavar="SPEC",
        help="after each prompt's prefill keep (1 - RATIO) of its cells: NAME:RATIO with NAME "
        "streaming, snapkv, snapout, knorm, tova, expected, adakv, chunkkv or kvzip, e.g. "
        "chunkkv:0.5; chunkkv:0.5,inner=kvzip keeps what the model needs to repeat the prompt "
        "(a second pass over it) (turns prefix reuse off)",
    )
    parser.add_argument(
        "--press-cells",
        type=int,
        default=None,
        metavar="N",
        help="with --press: during decode, press each request back to N cells every "
        "--press-every steps once it holds more (snapout:0 presses during decode only)",
    )
    parser.add_argument(
        "--press-every",
        type=int,
        default=16,
        metavar="K",
        help="with --press-cells: decode steps between presses (default 16)",
    )


def check_press(spec: str | None, cells: int | None = None, every: int = 16) -> None:
    """Raise InvalidArgumentError for a bad ``--press`` / ``--press-cells`` /
    ``--press-every`` before any weights load (EngineConfig's rules, named as options)."""
    from kvcache.engine.params import EngineConfig
    from kvcache.errors import InvalidArgumentError, InvalidConfigError

    try:
        EngineConfig(press=spec, press_cells=cells, press_every=every)
    except InvalidConfigError as err:
        option = "--" + err.name.replace("_", "-")
        raise InvalidArgumentError(option, err.value, err.allowed) from None


def check_kv_codec(spec: str | None) -> None:
    """Raise InvalidConfigError for a bad ``--kv-codec`` before any weights load."""
    from kvcache.codecs import make_codec

    if spec is not None:
        make_codec(spec, "key")
        make_codec(spec, "value")


WEIGHTS_HELP = (
    "how the GGUF's weights are held: native = its quantized blocks as stored (~1/5 of "
    "fp32's memory and bytes read a token), fp32 = dequantized to float32 (the reference "
    "path), bf16 = dequantized to bfloat16 (default native)"
)
_DTYPE_WEIGHTS = {"float32": "fp32", "bfloat16": "bf16"}  # the older --dtype's values


def add_weights(parser: argparse.ArgumentParser) -> None:
    """``--weights native|fp32|bf16`` (and the older ``--dtype``, now a hidden alias)."""
    parser.add_argument(
        "--weights", choices=("native", "fp32", "bf16"), default=None, help=WEIGHTS_HELP
    )
    parser.add_argument("--dtype", choices=tuple(_DTYPE_WEIGHTS), help=argparse.SUPPRESS)


def weights_kind(args: argparse.Namespace) -> WeightKind:
    """The weight kind the options ask for (InvalidArgumentError if --dtype contradicts it)."""
    from kvcache.errors import InvalidArgumentError

    if args.dtype is None:
        return cast("WeightKind", "native" if args.weights is None else args.weights)
    kind = _DTYPE_WEIGHTS[args.dtype]
    if args.weights not in (None, kind):
        raise InvalidArgumentError("--dtype", args.dtype, f"--weights {kind} (or no --dtype)")
    return cast("WeightKind", kind)

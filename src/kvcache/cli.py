"""`kvcache` command line: one subcommand per module, imported only when it runs.

Each command module exposes ``register(parser: argparse.ArgumentParser) -> None`` (adds its
arguments) and ``run(args: argparse.Namespace) -> int`` (does the work, returns the exit
code). Heavy imports (torch models, tokenizers) stay inside those modules so that
``kvcache --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvcache.commands.demo", "show the cell cache at work on a toy model (no weights)"),
    "generate": ("kvcache.commands.generate", "generate text with SmolLM2 on the cell cache"),
    "transcribe": ("kvcache.commands.transcribe", "transcribe audio with Whisper tiny.en"),
    "serve": ("kvcache.commands.serve", "OpenAI-compatible HTTP server (continuous batching)"),
}


def _available() -> dict[str, tuple[str, str]]:
    return {
        name: spec
        for name, spec in COMMANDS.items()
        if importlib.util.find_spec(spec[0]) is not None
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="kvcache: the key/value cache of transformer inference, with real models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).register(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

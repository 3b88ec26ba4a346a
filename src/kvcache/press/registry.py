"""Presses by name, built from specs like codecs: ``make_press("snapkv:0.5,window=32")``.

spec = ``NAME:RATIO[,OPTION=VALUE...]``; RATIO is the fraction of cells removed (kvpress's
``compression_ratio``), 0 <= RATIO < 1. Options are the press's constructor arguments
(ints, floats, booleans as 0/1; ``inner`` names a press that scores cells itself, not a
wrapper):

    name       press                                   options (default)
    streaming  sinks + newest (StreamingLLM)           sinks (4)
    snapkv     pooled window attention (SnapKV)        window (64), kernel (5, odd)
    snapout    the window's output moves, summed over  window (64)
               layers and heads (needs ``bind(model)``, see snapout.py)
    knorm      lowest key norm (kvpress Knorm)         -
    tova       newest query's attention (TOVA)         -
    expected   expected future attention (kvpress)     rows (64), future (512), sinks (4),
                                                       cov (1), vnorm (1)
    adakv      head-adaptive over an inner press       inner (snapkv), alpha (0.2)
    chunkkv    whole chunks ranked by an inner press   inner (knorm), chunk (32)
    kvzip      attention while repeating the context   chunk (2048 tokens a repeat), sinks (4);
               (KVzip; needs ``bind``, see kvzip.py)
    every one                                          compact (0: mask only, 1: renumber)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from kvcache.errors import InvalidArgumentError
from kvcache.press.adakv import AdaKV
from kvcache.press.base import Press, Wrapper
from kvcache.press.chunkkv import ChunkKV
from kvcache.press.expected import ExpectedAttention
from kvcache.press.knorm import KeyNorm
from kvcache.press.kvzip import KVzip
from kvcache.press.snapkv import SnapKV
from kvcache.press.snapout import SnapOut
from kvcache.press.streaming import StreamingLLM
from kvcache.press.tova import TOVA

PRESSES: dict[str, Callable[..., Press]] = {
    "streaming": StreamingLLM,
    "snapkv": SnapKV,
    "snapout": SnapOut,
    "knorm": KeyNorm,
    "tova": TOVA,
    "expected": ExpectedAttention,
    "adakv": AdaKV,
    "chunkkv": ChunkKV,
    "kvzip": KVzip,
}
# presses over an inner press (never an inner one themselves)
WRAPPERS = {n for n, f in PRESSES.items() if isinstance(f, type) and issubclass(f, Wrapper)}
# option -> (check, what is allowed), beyond the type of its default
RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "window": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
    "rows": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
    "kernel": (lambda v: isinstance(v, int) and v >= 1 and v % 2 == 1, "an odd int >= 1"),
    "sinks": (lambda v: isinstance(v, int) and v >= 0, "an int >= 0"),
    "future": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
    "alpha": (lambda v: isinstance(v, float) and 0.0 <= v <= 1.0, "a float in [0, 1]"),
    "chunk": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
}


def make_press(spec: str) -> Press:
    """A press from ``NAME:RATIO[,OPTION=VALUE...]`` (see the module docstring); a bad name,
    ratio or option raises InvalidArgumentError naming the spec and what is allowed."""
    if not isinstance(spec, str):
        raise InvalidArgumentError("press", spec, 'a spec "name:ratio[,option=value...]"')
    name, _, rest = spec.partition(":")
    factory = PRESSES.get(name.strip())
    if factory is None:
        raise InvalidArgumentError("press", spec, f"a name in {sorted(PRESSES)} (name:ratio)")
    ratio_text, *opts = rest.split(",")
    ratio = _ratio(spec, ratio_text)
    params = {k: p for k, p in inspect.signature(factory).parameters.items() if k != "ratio"}
    kwargs: dict[str, object] = {}
    for opt in opts:
        key, eq, value = (part.strip() for part in opt.partition("="))
        if key not in params or not eq:
            raise InvalidArgumentError(
                "press", spec, f"options of {name} as option=value: {sorted(params)}"
            )
        kwargs[key] = _option(spec, key, value, params[key].default, ratio)
    return factory(ratio, **kwargs)


def _ratio(spec: str, text: str) -> float:
    try:
        ratio = float(text)
    except ValueError:
        ratio = float("nan")
    if not 0.0 <= ratio < 1.0:
        raise InvalidArgumentError(
            "press", spec, "a ratio (fraction removed) in [0, 1) after the name: name:0.5"
        )
    return ratio


def _option(spec: str, key: str, text: str, default: object, ratio: float) -> object:
    """``text`` parsed as the type of ``default`` and checked by RULES."""
    value: object
    try:
        if key == "inner":
            if text not in PRESSES or text in WRAPPERS:
                raise ValueError(text)
            value = PRESSES[text](ratio)
        elif isinstance(default, bool):
            if text not in ("0", "1"):
                raise ValueError(text)
            value = text == "1"
        elif isinstance(default, int):
            value = int(text)
        else:
            value = float(text)
    except ValueError:
        allowed = {"inner": f"a press name in {sorted(set(PRESSES) - WRAPPERS)}"}.get(
            key, f"a {type(default).__name__}" + (" (0 or 1)" if isinstance(default, bool) else "")
        )
        raise InvalidArgumentError("press", spec, f"{key}: {allowed}") from None
    check, allowed = RULES.get(key, (lambda v: True, ""))
    if not check(value):
        raise InvalidArgumentError("press", spec, f"{key}: {allowed}")
    return value

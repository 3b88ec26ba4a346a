"""Argument checks shared by the caches: typed errors that name the argument and the rule."""

from __future__ import annotations

import numpy as np

from kvcache.errors import InvalidArgumentError, InvalidConfigError


def is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def int_arg(name: str, v: object, minimum: int = 0) -> int:
    """``v`` as an int >= minimum, or InvalidArgumentError."""
    if not is_int(v) or int(v) < minimum:  # type: ignore[call-overload]
        raise InvalidArgumentError(name, v, f"an int >= {minimum}")
    return int(v)  # type: ignore[call-overload]


def config_int(name: str, v: object, minimum: int) -> int:
    """A constructor int >= minimum, or InvalidConfigError."""
    if not is_int(v) or int(v) < minimum:  # type: ignore[call-overload]
        raise InvalidConfigError(name, v, f"an int >= {minimum}")
    return int(v)  # type: ignore[call-overload]


def optional_config_int(name: str, v: object, minimum: int) -> int | None:
    return None if v is None else config_int(name, v, minimum)

"""Small helpers every layer uses: checks of user input that name the field, ceiling division, the cache folder."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: the environment variable that moves paged_hf's cache folder (converted default model, compiled kernels)
CACHE_ENV_VAR = "PAGED_HF_CACHE"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that `a` tokens fill at `b` per block."""
    return -(-a // b)


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def field_checker(owner: str):
    """-> check(ok, name, value, expected): a ValueError that names the field when `ok` is false,
    "{owner}.{name} must be {expected}, got {value!r}"."""

    def check(ok: bool, name: str, value, expected: str) -> None:
        if not ok:
            raise ValueError(f"{owner}.{name} must be {expected}, got {value!r}")

    return check


def cache_root() -> Path:
    """paged_hf's cache folder: ``$PAGED_HF_CACHE``, else ``$XDG_CACHE_HOME/paged_hf`` or ``~/.cache/paged_hf``."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "paged_hf"

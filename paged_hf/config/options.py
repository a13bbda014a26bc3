"""An engine field written once: `option(default, help, check, flags)` declares its type and default (the dataclass
field and its annotation), its bounds (`check`), what it means (`help`) and its command-line flags (`Flag`). The
groups' checks (`OptionGroup.__post_init__`) and the `paged-hf` flags (entrypoints/cli_args.py) are made from the
declarations, so a new field is one declaration (and its docs).

A check takes (name, value) and returns the value to keep (it may normalise it) or raises the ValueError a user
sees, naming the field; the constructors below make the common ones.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Check = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Flag:
    """One command-line spelling of a field. `names`: "--max-num-seqs" and aliases; `type`, `choices`, `metavar`,
    `nargs` and `action` as argparse takes them (action "store_true": the flag gives the field `given`); `parse`
    turns the parsed value into the field's (NAME=PATH lists into a dict, JSON text into a dict); `dest`: where
    argparse keeps it, when two flags feed one field."""
    names: tuple[str, ...]
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    nargs: str | None = None
    action: str | None = None
    given: Any = None
    parse: Callable[[Any], Any] | None = None
    dest: str | None = None


def option(default: Any = None, help: str = "", check: Check | None = None, flags: tuple[Flag, ...] = (),
           factory: Callable[[], Any] | None = None) -> Any:
    """A field of an `OptionGroup` (`factory` instead of `default` for a mutable default)."""
    metadata = {"help": help, "check": check, "flags": flags}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class OptionGroup:
    """A dataclass of `option` fields: each is checked when the group is made (the field's own check), then the
    group's `check_together` relates them."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check = field.metadata.get("check")
            if check is not None:
                object.__setattr__(self, field.name, check(field.name, getattr(self, field.name)))
        self.check_together()

    def check_together(self) -> None:
        """Checks across fields; none by default."""


# --- checks ---------------------------------------------------------------------------------------------------
def integer(minimum: int = 1, optional: bool = False) -> Check:
    """An int >= minimum (not a bool); None too where `optional`."""
    def check(name: str, value):
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")
        return value
    return check


def number(minimum: float = 0.0, strict: bool = False, optional: bool = False, unit: str = "a number") -> Check:
    """An int or float >= minimum (> minimum where `strict`), not a bool; None too where `optional`."""
    def check(name: str, value):
        if value is None and optional:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            value > minimum if strict else value >= minimum)
        if not ok:
            bound = f"{'>' if strict else '>='} {minimum:g}"
            raise ValueError(f"{name} must be {unit} {bound}{' or None' if optional else ''}, got {value!r}")
        return value
    return check


def one_of(*choices, aliases: dict | None = None) -> Check:
    """One of `choices`; an alias stands for its choice ("fp8" for "fp8_e4m3")."""
    def check(name: str, value):
        value = (aliases or {}).get(value, value)
        if value not in choices:
            named = ", ".join(map(repr, [c for c in choices if c is not None]))
            raise ValueError(f"{name} must be {'None or ' if None in choices else ''}one of {named}, got {value!r}")
        return value
    return check


def boolean(name: str, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def text(optional: bool = True) -> Check:
    """A non-empty string (a path, a name); None too where `optional`."""
    def check(name: str, value):
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string{' or None' if optional else ''}, got {value!r}")
        return value
    return check


# --- flag parsers ---------------------------------------------------------------------------------------------
def name_equals(items: list[str], flag: str, value_type: Callable = str) -> dict:
    """["NAME=VALUE", ...] -> {NAME: value_type(VALUE)}; vLLM's JSON form {"name": ..., "path": ...} too."""
    found = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                found[spec["name"]] = value_type(spec["path"])
                continue
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{flag} expects NAME=VALUE or {{\"name\": ..., \"path\": ...}}, got {item!r}") from None
        name, sep, value = item.rpartition("=") if value_type is not str else item.partition("=")
        try:
            if not sep or not name or not value:
                raise ValueError
            found[name] = value_type(value)
        except ValueError:
            raise ValueError(f"{flag} expects NAME=VALUE, got {item!r}") from None
    return found

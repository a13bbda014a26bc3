"""API keys with names: each key is a tenant (fair scheduling, per-tenant metrics).

`--api-key KEY` may be repeated; `--api-key NAME=KEY` names a key (NAME: letters, digits, `_.-`, at most 64; a
value whose part after the first `=` is empty or starts with `=`, as base64 padding does, is a plain key). A
plain key is named `key1`, `key2`... by its place among the flags. `--api-key-file FILE` holds more: a JSON
object {"name": "key"}, or lines `NAME=KEY` (blank lines and `#` comments skipped; the key is everything
after the first `=`).

Keys with names are tenants whose stored responses, adapters and metrics are kept apart (tenancy.py).

A client sends its key as OpenAI's SDK does (`Authorization: Bearer KEY`) or as Anthropic's does
(`x-api-key: KEY`). Every configured key is compared in constant time, so the answer's timing does not tell
which prefix of which key was right.
"""

from __future__ import annotations

import hmac
import json
import re

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def split_named_key(value: str) -> tuple[str | None, str]:
    """'NAME=KEY' -> (NAME, KEY); a plain key -> (None, key)."""
    name, sep, key = value.partition("=")
    if sep and _NAME.fullmatch(name) and key and not key.startswith("="):
        return name, key
    return None, value


def named_api_keys(api_key, file_keys: dict | None = None) -> dict[str, str]:
    """name -> key from `api_key` (None, one key, or a list of `KEY` / `NAME=KEY`) and a keys file's names.
    ValueError for an empty key, or a name or key given twice."""
    values = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    keys: dict[str, str] = {}
    for index, value in enumerate(values, start=1):
        name, key = split_named_key(value) if isinstance(value, str) else (None, value)
        _add(keys, name or f"key{index}", key)
    for name, key in (file_keys or {}).items():
        _add(keys, name, key)
    return keys


def has_tenants(api_key, file_keys: dict | None = None) -> bool:
    """Whether the keys make tenants whose data is kept apart (tenancy.py): any named key, or several keys. No
    key, or a single plain one, is the single-tenant server of before."""
    values = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    if file_keys or len(values) > 1:
        return True
    return bool(values) and isinstance(values[0], str) and split_named_key(values[0])[0] is not None


def _add(keys: dict[str, str], name, key) -> None:
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"API key {name!r} is empty or not a string")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"API key name {name!r}: use letters, digits, '_', '.', '-' (at most 64)")
    if name in keys:
        raise ValueError(f"API key name {name!r} is given twice")
    if key in keys.values():
        raise ValueError(f"API key {name!r} is the same key as another name's")
    keys[name] = key


def read_api_key_file(path: str | None) -> dict[str, str]:
    """--api-key-file: a JSON object {name: key}, or NAME=KEY lines; ValueError naming the bad line."""
    if path is None:
        return {}
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if text.lstrip().startswith("{"):
        try:
            keys = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--api-key-file {path}: invalid JSON ({exc})") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise ValueError(f"--api-key-file {path}: expected {{\"name\": \"key\"}} with string values")
        return keys
    keys = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--api-key-file {path}, line {number}: expected NAME=KEY")
        if name.strip() in keys:
            raise ValueError(f"--api-key-file {path}: name {name.strip()!r} is given twice")
        keys[name.strip()] = key.strip()
    return keys


def presented_key(headers: dict) -> str | None:
    """The key a request carries (`headers`: lower-cased names): a Bearer token, else `x-api-key`."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


def key_name(keys: dict[str, str], headers: dict) -> str | None:
    """The name of the configured key the request presents; None when it presents none of them."""
    token = presented_key(headers)
    if token is None:
        return None
    found = None
    for name, key in keys.items():  # all of them, whatever matched: constant time in the position
        if hmac.compare_digest(token.encode(), key.encode()):
            found = name
    return found

"""The `paged-hf` flags of the engine, made from the fields' declarations (config/groups.py, config/engine.py): each
field's `Flag`s become argparse arguments in its group (`add_engine_args`), the given ones become PagedConfig
keyword arguments (`engine_config`), and keyword arguments become flags again (`engine_flags`: a bench starts a
server with the engine it measured in-process). No flag is written by hand."""

from __future__ import annotations

import argparse
import dataclasses
import json

from paged_hf.config.engine import DECLARED


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every PagedConfig field that declares a flag (config/groups.py), in its group; unset flags keep the engine's
    defaults. (`--enable-lora`: vLLM's flag, accepted; adapters always work.)"""
    for group_name, fields in _flagged_fields():
        group = parser.add_argument_group(f"engine: {group_name} (paged_hf.wrap's PagedConfig)")
        for field in fields:
            for flag in field.metadata["flags"]:
                group.add_argument(*flag.names, **_argparse_options(field, flag))
    parser.add_argument("--enable-lora", action="store_true", help="(vLLM's flag; adapters always work)")


def engine_config(args: argparse.Namespace) -> dict:
    """Only the flags that were given, as PagedConfig keyword arguments."""
    config = {}
    for _, fields in _flagged_fields():
        for field in fields:
            for flag in field.metadata["flags"]:
                value = getattr(args, _dest(field, flag), None)
                if value is None or value is False or value == []:
                    continue
                value = flag.given if flag.action == "store_true" else value
                value = flag.parse(value) if flag.parse is not None else value
                config[field.name] = {**config[field.name], **value} if isinstance(value, dict) and \
                    field.name in config else value
    return config


def engine_flags(config: dict) -> list[str]:
    """PagedConfig keyword arguments -> the `paged-hf serve` flags that give them; ValueError for a field that no
    flag gives (it cannot reach a server started from the command line)."""
    flags = []
    for name, value in config.items():
        declared = DECLARED[name][1].metadata["flags"] if name in DECLARED else ()
        if not declared:
            raise ValueError(f"{name}: no `paged-hf serve` flag gives this engine field")
        flag = declared[0]
        if flag.action == "store_true":
            flag = next((f for f in declared if f.given == value), None)
            flags += [] if flag is None else [flag.names[0]]  # None: the default, which no flag spells
        elif flag.action == "append":  # NAME=VALUE pairs, one flag each
            flags += [part for key, item in value.items() for part in (flag.names[0], f"{key}={item}")]
        elif value is not None:
            flags += [flag.names[0], json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def _flagged_fields():
    """(group title, its fields that have flags), in PagedConfig's order."""
    by_group: dict[str, list] = {}
    for name, (group, field) in DECLARED.items():
        if field.metadata.get("flags"):
            by_group.setdefault(group or "model", []).append(field)
    return list(by_group.items())


def _dest(field, flag) -> str:
    return flag.dest or field.name


def _argparse_options(field, flag) -> dict:
    options = {"dest": _dest(field, flag), "help": field.metadata["help"]}
    if flag.action is not None:
        options["action"] = flag.action
        if flag.action == "append":
            options["default"] = []
    for name in ("type", "choices", "metavar", "nargs"):
        if getattr(flag, name) is not None:
            options[name] = getattr(flag, name)
    if flag.nargs is not None:
        options["default"] = []
    if field.default is not None and field.default is not dataclasses.MISSING and flag.action != "store_true":
        options["help"] += f" (default: {field.default})"
    return options

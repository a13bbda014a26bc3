"""Recognising transformers' code in a live model: which function a name runs, and whether a module runs the
forward its class defines, compared by bytecode. A fast path or a stand-in is taken only where this says yes.

transformers changes how its modeling code is wrapped from release to release: decorators (`functools.wraps`),
hub kernels (`use_kernel_forward_from_hub` turns a function such as `apply_rotary_pos_emb` into an `nn.Module`
instance whose forward calls it; `use_kernelized_func` wraps a class's forward and gives each instance private
copies of those modules), compiled functions. Everything here answers what it cannot read with None or False,
never an exception: a model whose code is not recognised runs its own forward through the paged attention, or
is refused by the engine probe naming why.

A hub kernel that `kernels.kernelize` (or `from_pretrained(use_kernels=True)`) installed replaces a forward on
the instance (`module.forward`, or the forward of one of the module's private kernel functions): the module no
longer computes its class's code, so it is not recognised as that code.
"""

from __future__ import annotations

import functools
import inspect
from types import FunctionType

import torch

_MAX_WRAPPINGS = 4  # decorators around a hub-kernel module around a function, and so on: more is not transformers

def plain_function(obj) -> FunctionType | None:
    """The Python function that `obj` runs when called: itself or what its decorators wrap (`__wrapped__`), or
    the function inside a hub-kernel module (a `Func`) that no kernel replaced, in any nesting of the two; None
    for anything else (a C function, another callable object, a hub-kernel module with a kernel installed)."""
    for _ in range(_MAX_WRAPPINGS):
        if isinstance(obj, torch.nn.Module):
            obj = _hub_function(obj)
        try:
            obj = inspect.unwrap(obj) if obj is not None else None
        except ValueError:  # a cycle of __wrapped__
            return None
        if not isinstance(obj, torch.nn.Module):
            return obj if isinstance(obj, FunctionType) else None
    return None


def same_code(function, expected) -> bool:
    """Both run the same Python code (bytecode and the global names it reads), each as `plain_function` reads it;
    False where either is not a plain function."""
    a, b = plain_function(function), plain_function(expected)
    if a is None or b is None:
        return False
    return a.__code__.co_code == b.__code__.co_code and a.__code__.co_names == b.__code__.co_names


def runs_own_class_code(module: torch.nn.Module) -> bool:
    """The module computes what its class's forward says: no hooks of its own or of accelerate, no forward set
    on the instance (a user's patch, a kernel from `kernelize`), no kernel installed in its private hub-kernel
    functions."""
    if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
        return False
    if "forward" in module.__dict__ or "_kernel_repo" in module.__dict__:
        return False
    private = module.__dict__.get("_kernel_funcs")
    return not private or all(plain_function(function) is not None for function in private.values())


def runs_forward_of(module: torch.nn.Module | None, reference: type) -> bool:
    """The module runs `reference`'s forward code (the same bytecode and names, under the same outer decorator
    code), as its class defines it (`runs_own_class_code`)."""
    return module is not None and runs_own_class_code(module) and class_defines_forward_of(type(module), reference)


def defines_forward_of(module: torch.nn.Module | None, reference: type) -> bool:
    """The module's class defines `reference`'s forward code and the instance has no forward of its own; hooks
    are the business of whoever swaps it (worker/stand_ins.py skips a hooked module in a step)."""
    return (module is not None and "forward" not in module.__dict__
            and class_defines_forward_of(type(module), reference))


@functools.lru_cache(maxsize=4096)
def class_defines_forward_of(cls: type, reference: type) -> bool:
    """`cls.forward` is `reference.forward`'s code, at both ends of any decorators."""
    forward, expected = getattr(cls, "forward", None), getattr(reference, "forward", None)
    return _same_outer_code(forward, expected) and same_code(forward, expected)


def forward_globals(module: torch.nn.Module) -> dict:
    """The globals of the module's modeling file, read from its class's forward under any decorator; {} where
    the forward is not a plain function."""
    forward = plain_function(type(module).forward)
    return forward.__globals__ if forward is not None else {}


def reads_name(module: torch.nn.Module, name: str) -> bool:
    """The module's class forward reads the global `name` (it calls it, in the code transformers ships)."""
    forward = plain_function(type(module).forward)
    return forward is not None and name in forward.__code__.co_names


def code_reads(functions, names: frozenset[str], depth: int = 2) -> bool:
    """Some plain function among `functions`, or a module-level function one calls (followed `depth` calls deep
    through its module's globals), reads one of `names` (a global or an attribute: `cache.update_conv_state`).
    transformers moves shared steps of a layer into such helpers (Mamba2's `causal_conv1d` from 5.25 on)."""
    seen: set[int] = set()
    frontier = [f for f in map(plain_function, functions) if f is not None]
    for _ in range(depth + 1):
        following = []
        for function in frontier:
            if id(function) in seen:
                continue
            seen.add(id(function))
            code_names = function.__code__.co_names
            if names.intersection(code_names):
                return True
            space = function.__globals__
            following += [f for f in (plain_function(space.get(name)) for name in code_names) if f is not None]
        frontier = following
    return False


def _same_outer_code(function, expected) -> bool:
    """The outermost layer of both (a decorator's wrapper, or the function) is the same code: two decorated
    forwards share the wrapper's code, so this and `same_code` together compare both ends."""
    a, b = getattr(function, "__code__", None), getattr(expected, "__code__", None)
    return a is not None and b is not None and a.co_code == b.co_code and a.co_names == b.co_names


def _hub_function(module: torch.nn.Module):
    """The function a hub-kernel `Func` module (kernels' `use_kernel_forward_from_hub` on a function) calls,
    read from its class's forward closure; None when a kernel replaced its forward or it is another module."""
    if not runs_own_class_code(module):
        return None
    forward = type(module).forward
    closure, names = getattr(forward, "__closure__", None), getattr(getattr(forward, "__code__", None),
                                                                      "co_freevars", ())
    cells = dict(zip(names, closure or ()))
    try:
        function = cells["func"].cell_contents if "func" in cells else None
    except ValueError:  # an empty cell
        return None
    return function if callable(function) and not isinstance(function, torch.nn.Module) else None

"""What a family module declares (`Family`) and how it names what it serves (`Recognised`): a transformers class
whose code a module (or a cache class) must have, never a class name."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_hf.worker.code_match import defines_forward_of


@dataclass(frozen=True)
class Recognised:
    """`make` serves a module whose class defines the forward of `reference` ("transformers.models.x.modeling_x:
    ClassName"), where `when` (if given) also holds; for a cache class, the class itself."""
    reference: str
    make: Callable
    when: Callable[[torch.nn.Module], bool] | None = None

    def reference_class(self) -> type | None:
        """The reference class in the installed transformers; None where this release has none."""
        return _import(self.reference)

    def recognises(self, module: torch.nn.Module) -> bool:
        reference = self.reference_class()
        return (reference is not None and defines_forward_of(module, reference)
                and (self.when is None or self.when(module)))


@dataclass(frozen=True)
class Family:
    """What the engine does for one family (or one mechanism several share) beyond the model's own code."""
    name: str  # its module's name in worker/families/
    serves: str  # one line: which architectures, and what about them needs code of its own
    stand_ins: tuple[Recognised, ...] = ()  # modules swapped for a stand-in in a step: make(module, config, model)
    state_keepers: tuple[Recognised, ...] = ()  # blocks keeping recurrent states outside the cache: make(block, idx)
    cache_classes: tuple[Recognised, ...] = ()  # a cache class a forward insists on: make is the class answering it
    refusal: Callable[[torch.nn.Module, object], str | None] | None = None  # (model, config) -> why it is not served
    step_overrides: Callable[[torch.nn.Module], list] | None = None  # model -> [(owner, attribute, value)]


@functools.cache
def _import(reference: str) -> type | None:
    module_name, _, class_name = reference.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):  # a release without that model or class
        return None

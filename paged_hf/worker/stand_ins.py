"""Stand-ins: modules swapped into the model for the duration of a step (`parent._modules[name]`), and always put
back, so that outside a step the user's model is exactly what it was. The families' attention code of their own
(worker/families/), a hybrid's recurrent mixers (worker/hybrid/) and the CPU fast paths (worker/fast_paths/) are
all stand-ins; worker/step_swaps.py enters them in one declared order.
"""

from __future__ import annotations

import torch

from paged_hf.worker.code_match import forward_globals


class StandIn(torch.nn.Module):
    """A module swapped in for `original` during a step. What it does not have itself is read from `original`:
    models read their modules' `.weight.dtype`, `.variance_epsilon`, ... inside their own forward."""

    score_terms: frozenset[str] = frozenset()  # what its attention calls add to the scores (kernels/spec.py)

    def __init__(self, original: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "original", original)  # not a submodule: nothing registered twice

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)

    @property
    def training(self) -> bool:  # the original's mode, whatever `eval()`/`train()` did since
        return self.__dict__["original"].training

    @training.setter
    def training(self, value: bool) -> None:
        pass  # nn.Module.__init__ sets it; the mode is the original's


def modeling_global(module: torch.nn.Module, name: str):
    """What `module`'s modeling file calls `name` (its forward's globals, under any decorator), or None."""
    return forward_globals(module).get(name)


class ModuleSwaps:
    """Modules swapped for stand-ins for the duration of a step (`parent._modules[name]`) and always put back.

    The engine runs what the model runs: a module the user hooked, gave an instance `forward`, whose class's
    forward was replaced, or that is no longer at its place since these swaps were first made, keeps its own
    forward (its site is skipped, checked at every step: ~0.5 us a site). A later step of a call whose model runs
    no code of its own (`settled`, worker/call_scope.py) swaps the sites its first step found as they were."""

    sites: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]  # (parent, name, original, stand-in)
    settled: object | None = None  # the running call's token, set by the runner for each step (step_swaps.py)

    def __enter__(self) -> None:
        last = self.__dict__.get("_last")  # (the token of the step that checked, the sites it swapped)
        if last is not None and self.settled is not None and last[0] is self.settled:
            for modules, name, _, stand_in in last[1]:
                modules[name] = stand_in
            self._swapped = last[1]
            return
        if "_checks" not in self.__dict__:  # made once: what each step reads to know a site is as it was
            self._checks = [(parent._modules, name, original, original.__dict__, type(original).forward, stand_in)
                            for parent, name, original, stand_in in self.sites]
        self._swapped = swapped = []
        for modules, name, original, attributes, forward, stand_in in self._checks:
            if (modules.get(name) is original and not attributes["_forward_hooks"]
                    and not attributes["_forward_pre_hooks"] and "forward" not in attributes
                    and type(original).forward is forward):
                modules[name] = stand_in
                swapped.append((modules, name, original, stand_in))
        self._last = (self.settled, swapped)

    def __exit__(self, *exc) -> None:
        for modules, name, original, stand_in in self._swapped:
            if modules.get(name) is stand_in:  # (what code of the user's put there inside the step stays)
                modules[name] = original
        self._swapped = []

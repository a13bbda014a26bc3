"""The steps of one call that runs its requests to the end (`generate()`), back to back: between them only the
engine's own code runs, so the model is as the call's first step found it unless code of the user's runs inside a
step (a module hook, accelerate's hooks, an instance forward or hub kernel, a class's forward patched since the
engine was made).
Where none can, what the call's first step checked its later steps take as it is: the CPU fast path's kept plan
(every module, tensor, version and address it was made from: `lean_layers.StackPlan.holds`), the decoder stack's
stand-ins in place (`decoder_layers.DecoderStack.installed`), and which sites the step's swaps find as they were
(`stand_ins.ModuleSwaps`: the same stand-ins go to the same places, unchecked).

Why: those checks read a few thousand objects after the weights' read evicted them from the caches: ~0.6 ms of a
~10 ms batch-1 bf16 token and ~1 ms of an int8 one on an AMD EPYC Zen 4, where llama.cpp, which owns its weights,
checks nothing. A step where control returns to the user in between (`step()`, `stream()`, a server's
loop), a call whose model runs code of its own, and a step with adapters or pooled rows check everything, as before.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.modules import module as torch_module

from paged_hf.worker.code_match import runs_own_class_code


class CallScope:
    """The token of the running call whose steps may take what its first step checked (`settled`), else None."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # each module class's forward when the engine was made: one patched since runs code of the user's
        self.forwards = {cls: cls.forward for cls in {type(module) for module in model.modules()}}
        self.settled: object | None = None

    @contextlib.contextmanager
    def call(self):
        """For the steps of one call: a new token where the model runs no code of its own, else None."""
        previous = self.settled
        self.settled = object() if self._runs_only_its_classes_code() else None
        try:
            yield
        finally:
            self.settled = previous

    def _runs_only_its_classes_code(self) -> bool:
        """No global module hook, and every module runs its class's code (`code_match.runs_own_class_code`: no
        hooks, accelerate's or its own, no instance forward or hub kernel) with the class forward it had when the
        engine was made."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        forwards = self.forwards
        return all(runs_own_class_code(module) and forwards.get(type(module)) is type(module).forward
                   for module in self.model.modules())

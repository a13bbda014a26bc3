"""What a step swaps into the model for its one forward, in one declared order: entered first to last, left last to
first, each put back whatever the forward raises. Outside a step the user's model is exactly what it was.

The order (`StepSwaps.around`), and why:
1. step scope: attention calls find the step's `PagedCache` (a context variable of this thread);
2. attention switch: every attention module's implementation is the paged one (`attention_switch.py`);
3. family stand-ins: the attention code of families that compute it themselves (`families/`); before the fast
   paths, which qualify a module by what is installed at its place;
4. recurrent mixers: a hybrid's recurrent layers, request by request (`hybrid/`);
5. packed linears and 6. fused layers: the CPU fast paths (`fast_paths/`; the fused projections' linears are
   left out of the packed ones);
7. LoRA routing: the adapters' wrappers go over whatever 5 and 6 installed at their linears' places, and compute
   with them (integrations/lora.py);
8. hidden-state capture: the rows of embedding requests (`pooling.py`), around everything that computes them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from paged_hf.integrations.transformers import step_scope
from paged_hf.worker.stand_ins import ModuleSwaps

@dataclass
class StepSwaps:
    """The model's swaps that last for the runner's life (2-6); the step's own (1, 7, 8) are given per step."""
    attention_switch: contextlib.AbstractContextManager
    family_stand_ins: contextlib.AbstractContextManager
    recurrent_mixers: contextlib.AbstractContextManager
    packed_linears: contextlib.AbstractContextManager
    fused_layers: contextlib.AbstractContextManager

    @contextlib.contextmanager
    def around(self, cache, lora_routing: contextlib.AbstractContextManager,
               capture: contextlib.AbstractContextManager, settled: object | None = None):
        """All eight, in the module docstring's order, for one forward over `cache`; `settled`: the token of a
        call whose model runs no code of its own (worker/call_scope.py), or None."""
        swaps = (step_scope(cache), self.attention_switch, self.family_stand_ins, self.recurrent_mixers,
                 self.packed_linears, self.fused_layers, lora_routing, capture)
        for swap in swaps[2:6]:
            if isinstance(swap, ModuleSwaps):
                swap.settled = settled
        with contextlib.ExitStack() as stack:
            for swap in swaps:
                stack.enter_context(swap)
            yield

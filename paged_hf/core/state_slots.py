"""Recurrent-state slots of a hybrid model: one per running request, beside its KV blocks.

A hybrid model's linear-attention, SSM and convolution layers keep a fixed-size state per sequence instead of
per-token K/V (vLLM's hybrid KV-cache manager keeps one such slot per request too). A request takes a slot when
it first gets blocks and gives it back with them (finished, aborted, preempted: a preempted request recomputes
its state from its first token, as it recomputes its K/V). A forked child (`n > 1`, beams) gets a slot of its
own holding a copy of its parent's state: the copy, like a copy-on-write block copy, is made by the model runner
before the step's forward (`take_copies`). The slots' tensors live in the worker (worker/hybrid/recurrent_state.py);
this pool only hands out their indices.
"""

from __future__ import annotations

from paged_hf.core.request import Request


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._copies: list[tuple[int, int]] = []  # (src, dst) slot copies of this step

    @property
    def num_free(self) -> int:
        return len(self._free)

    def needs_slot(self, request: Request) -> bool:
        return request.state_slot is None

    def take(self, request: Request) -> None:
        """Give the request a slot; the caller checked `num_free` (all-or-nothing allocation)."""
        if request.state_slot is None:
            request.state_slot = self._free.pop()

    def fork(self, parent: Request, child: Request) -> None:
        """The child's slot starts as a copy of the parent's state (the runner copies it before the forward)."""
        assert parent.state_slot is not None, f"fork from {parent.request_id}, which holds no state slot"
        self.take(child)
        self._copies.append((parent.state_slot, child.state_slot))

    def release(self, request: Request) -> None:
        """Return the request's slot; a copy into it that the runner has not made yet is dropped."""
        slot, request.state_slot = request.state_slot, None
        if slot is None:
            return
        self._copies = [(src, dst) for src, dst in self._copies if dst != slot]
        self._free.append(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) slot copies the runner must make before this step's forward; resets the list."""
        copies, self._copies = self._copies, []
        return copies

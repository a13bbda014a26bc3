"""Per-token multi-LoRA routing: many adapters, one base model, one packed step.

- `LoRALinear` wraps one targeted nn.Linear with its adapters by slot (`SlotWeights`: A [r, in] and B transposed,
  Bt [r, out], read where they lie: on a CPU the adapter's host copy, on a GPU a copy there). In a step it computes
  `y = base(x) + B[slot] @ (A[slot] @ x)` for each token with one call for all adapters (`kernels/lora.py`: the
  compiled SGMV kernel on CPU, torch ops per slot elsewhere); the tokens are grouped by slot once per step. Without
  routing it is exactly the base Linear, and the base weights are never modified.
- `LoRAGroup`: the wrappers of one module that read the same input tensor (q/k/v, gate/up; learnt from the first
  adapter step) share that call: the first one called computes all their outputs.
- `LoRAManager` holds the adapters in host memory (what new requests get, by name), takes the ones a step needs
  into its slots (least recently used slot reused first; on a GPU that is a copy to the device) and installs the
  wrappers around the forward. An adapter's version follows its content: the same files read again are the same
  version (the same slot, the same prefix-cache blocks), changed files a new one. Which adapters stay in host
  memory, and reading them from disk off the engine thread, is the engine's adapter store
  (`paged_hf.engine.adapter_store`).

The wrappers are installed lazily, only for the duration of an engine step that has adapter tokens
(`LoRAManager.step`), by swapping entries of the parents' `_modules` (cheap: a dict assignment per module).
Why: outside a step the user's model is untouched: a plain forward, `named_modules()`, `state_dict()`, a
training loop or `PagedModel.unwrap()` see the original modules, with nothing to remove. Steps with only
base-model tokens install nothing and cost nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from paged_hf.integrations.accelerate import execution_device
from paged_hf.integrations.peft import (
    AdapterFiles,
    LoRAAdapter,
    adapters_from_peft_model,
    build_adapter,
    is_peft_lora_layer,
    read_adapter_files,
)
from paged_hf.kernels.lora import (
    LoRASegments,
    SlotWeights,
    apply_lora,
    apply_lora_group,
    kernel_call,
    lora_segments,
)
from paged_hf.kernels.quant_linear import linear_device, linear_dtype


class LoRARouting:
    """One step's routing: the adapter slot of every token of the packed row (-1 = base model).

    The tokens grouped by slot are built once per step and per device, and shared by every wrapped layer on
    that device."""

    def __init__(self, token_slots: torch.Tensor):
        self.token_slots = token_slots  # [num_tokens] int64 on CPU
        self.num_tokens = token_slots.numel()
        self._segments: dict[torch.device, LoRASegments] = {}

    def segments(self, device: torch.device) -> LoRASegments:
        segments = self._segments.get(device)
        if segments is None:
            segments = self._segments[device] = lora_segments(self.token_slots, device)
        return segments


class LoRAContext:
    """Shared by all wrappers of one engine: the runner sets `routing` before a step's forward and clears it."""

    routing: LoRARouting | None = None
    probing: bool = False  # this step records the input each wrapper sees (LoRAManager forms groups from it)


class LoRAGroup:
    """Wrapped Linears of one module that read the same input tensor in a step (q/k/v, gate/up): the first of
    them called with an x computes every member's base output and adds all their updates in one kernel call; the
    others then return their output, already updated. Why: one call instead of one per Linear (a call costs
    several us of fixed work: ctypes, the checks, the parallel region), and x is read once for all.

    Safe for any call order: a member called with another x (by identity) computes the group again; a member's
    output left unclaimed when another x comes means the members do not share inputs, and the group is undone
    (each member computes alone from then on)."""

    def __init__(self, members: list[LoRALinear]):
        self.members = members
        self.weights = [m.weights for m in members]
        self.kernel_call = kernel_call([w.kernel for w in self.weights])
        self._input: torch.Tensor | None = None
        self._pending: dict[LoRALinear, torch.Tensor] = {}  # outputs computed for `_input`, not yet returned

    def forward(self, member: LoRALinear, x: torch.Tensor, routing: LoRARouting) -> torch.Tensor:
        if x is self._input:
            y = self._pending.pop(member, None)
            if y is not None:
                return y
        elif self._pending:  # siblings' outputs for another x were never asked for: the inputs are not shared
            self.dissolve()
            return member.forward(x)
        outputs = [m.base_output(x) for m in self.members]
        self.add_updates(outputs, x, routing)
        self._input = x
        self._pending = {m: y for m, y in zip(self.members, outputs) if m is not member}
        return outputs[self.members.index(member)]

    def add_updates(self, outputs: list[torch.Tensor], x: torch.Tensor, routing: LoRARouting) -> None:
        """outputs[i] [..., out_i] += member i's update of x, in place, in one kernel call for all members."""
        apply_lora_group([y.view(-1, y.shape[-1]) for y in outputs], self.members[0].rows(x, routing), self.weights,
                         routing.segments(x.device), self.kernel_call)

    def release(self) -> None:
        """Hold no tensor past the step."""
        self._input, self._pending = None, {}

    def dissolve(self) -> None:
        self.release()
        for member in self.members:
            member.group = None


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, context: LoRAContext, num_slots: int, device: torch.device):
        """`device`: where the base Linear computes (its weights' device, or accelerate's execution device
        when the weights are offloaded): where the slots' factors are read."""
        super().__init__()
        self.base = base
        self.packed_base = None  # set for each step (LoRAManager.step)
        self.wrapped = None  # the module this wrapper stood in for in the last step (packed_base follows it)
        self.context = context
        self.weights = SlotWeights(num_slots, base.in_features, base.out_features, linear_dtype(base), device)
        self.kernel_call = kernel_call([self.weights.kernel])
        self.group: LoRAGroup | None = None  # siblings that read the same x (LoRAManager forms them)
        self.seen_input: torch.Tensor | None = None  # the first x of a probing step

    def set_slot(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """`slot` computes with an adapter's (A [r, in], Bt [r, out]) from now on (None: this adapter does not
        touch the module)."""
        self.weights.set(slot, pair)

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        return (self.packed_base or self.base)(x)  # [..., out]

    def rows(self, x: torch.Tensor, routing: LoRARouting) -> torch.Tensor:
        """x as [num_tokens, in], checked against the step."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] != routing.num_tokens:
            raise RuntimeError(f"a LoRA layer got {x2.shape[0]} tokens in a step of {routing.num_tokens}")
        return x2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = self.context
        routing = context.routing
        if routing is None:
            return self.base_output(x)
        if context.probing and self.seen_input is None:
            self.seen_input = x
        if self.group is not None:
            return self.group.forward(self, x, routing)
        y = self.base_output(x)
        self.add_update(y, x, routing)
        return y

    def add_update(self, y: torch.Tensor, x: torch.Tensor, routing: LoRARouting) -> None:
        """y [..., out] (this Linear's base output of x) += the update of x, in place."""
        apply_lora(y.view(-1, y.shape[-1]), self.rows(x, routing), self.weights, routing.segments(x.device),
                   self.kernel_call)


def updates_over(installed: tuple[torch.nn.Module, ...], bases: tuple[torch.nn.Module, ...]):
    """For the modules `installed` in a step where `bases` stood (a fused layer's projection stand-ins), each one
    either bases[i] itself or a LoRA wrapper computing on top of it: a function `add(outputs, x)` that adds the
    wrappers' updates to outputs[i] (bases[i]'s outputs of x, computed by the caller, e.g. as slices of one packed
    matmul) in one call; None where the wrappers must run themselves (a probing step: they record their input;
    wrappers that are not one group).
    Why: the fused layer's one matmul and one LoRA call, without a module call, a slice and a group lookup per
    projection (~210 wrapper calls a step on the default model)."""
    wrapped = [(i, m) for i, m in enumerate(installed) if m is not bases[i]]
    if not wrapped or any(not isinstance(m, LoRALinear) or m.packed_base is not bases[i] for i, m in wrapped):
        return None
    members = [m for _, m in wrapped]
    context = members[0].context
    routing = context.routing
    if routing is None or context.probing:
        return None
    indices = [i for i, _ in wrapped]
    if len(members) == 1 and members[0].group is None:
        return lambda outputs, x: members[0].add_update(outputs[indices[0]], x, routing)
    group = members[0].group
    if group is None or group.members != members:
        return None
    return lambda outputs, x: group.add_updates([outputs[i] for i in indices], x, routing)


class LoRAManager:
    """Loaded adapters (CPU), device slots (LRU), the wrappers, and installing them around a step."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_rank: int):
        """num_slots: distinct adapters a step can hold (`paged_hf.engine.adapters.adapter_slots`)."""
        self.model = model
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.context = LoRAContext()
        self.adapters: dict[str, LoRAAdapter] = {}  # in host memory, by name: what new requests get
        self.wrappers: dict[str, LoRALinear] = {}  # module path -> wrapper
        self._sites: dict[str, tuple[torch.nn.Module, str]] = {}  # module path -> (parent, attribute)
        # what a step swaps, as (parent's module dict, attribute, wrapper): the per-step loop does no lookup
        self._installs: list[tuple[dict, str, LoRALinear]] = []
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter version -> slot, least recent first
        # the resident adapters' names, replaced whole on each swap: what another thread may read (the Ray
        # replica's routing stats) while the engine thread reorders `resident` every step
        self.resident_names: frozenset[str] = frozenset()
        self._slot_names: dict[int, str] = {}  # slot -> the name its adapter was loaded under
        self._versions: dict[str, int] = {}  # content hash -> version
        self._num_versions = 0
        self.num_swaps = 0  # adapters copied into a device slot so far
        # serving a PeftModel: its own LoRA layers must be bypassed in every step, also without adapter tokens
        self.always_route = False
        self.groups: list[LoRAGroup] = []
        self._probe = True  # the next step records which wrappers read the same input (new wrappers: again)

    # --- loading --------------------------------------------------------------------------------------
    def load(self, name: str, path) -> LoRAAdapter:
        """Read, validate and register an adapter (a new version when the name exists with other weights).
        ValueError and no change at all if the folder is unusable."""
        return self.add(read_adapter_files(name, path, self.max_rank))

    def add(self, files: AdapterFiles) -> LoRAAdapter:
        """Match an adapter read from disk to the model and serve it under its name (on the engine thread)."""
        self._check_not_sharded()
        version = self._versions.get(files.content_hash, self._num_versions + 1)
        adapter = build_adapter(files, self.model, self.max_rank, version)
        self._versions[files.content_hash] = version
        self._register(adapter)
        return adapter

    def _check_not_sharded(self) -> None:
        """Tensor-parallel Linears hold weight shards; full-size LoRA factors would not line up with them."""
        tp_size = getattr(self.model, "tp_size", None) or 1
        if tp_size > 1:
            raise ValueError(f"LoRA adapters are not supported on a tensor-parallel model (tp_size={tp_size}) yet")

    def add_peft_model(self, peft_model) -> None:
        """Serve the adapters loaded in a PeftModel (whose base model is `self.model`) under their names."""
        self._check_not_sharded()
        adapters = adapters_from_peft_model(peft_model, self.max_rank, self._num_versions + 1)
        for adapter in adapters:
            self._register(adapter)
        self.always_route = True

    def _register(self, adapter: LoRAAdapter) -> None:
        self._num_versions = max(self._num_versions, adapter.version)
        new_paths = [path for path in adapter.weights if path not in self.wrappers]
        modules = dict(self.model.named_modules()) if new_paths else {}
        for module_path in new_paths:
            self._add_wrapper(module_path, modules)
        self.adapters[adapter.name] = adapter

    def _add_wrapper(self, module_path: str, modules: dict[str, torch.nn.Module]) -> None:
        """A wrapper around the Linear at `module_path` (a peft LoRA layer there: around its base layer)."""
        parent_path, _, attribute = module_path.rpartition(".")
        parent = modules[parent_path]
        module = parent._modules[attribute]
        base = module.base_layer if is_peft_lora_layer(module) else module
        device = execution_device(modules, module_path) or linear_device(base)
        self.wrappers[module_path] = LoRALinear(base, self.context, self.num_slots, device)
        self._sites[module_path] = (parent, attribute)
        self._installs.append((parent._modules, attribute, self.wrappers[module_path]))
        self._probe = True

    def unload(self, name: str) -> None:
        """New requests can no longer use it; requests already running keep their weights until they finish."""
        if name not in self.adapters:
            raise ValueError(f"unknown adapter {name!r}; loaded: {sorted(self.adapters)}")
        del self.adapters[name]

    # --- slots ----------------------------------------------------------------------------------------
    def assign_slots(self, adapters: list[LoRAAdapter | None]) -> list[int] | None:
        """The device slot of each scheduled request's adapter (-1 = base), swapping adapters in as needed;
        None when the step has no adapter at all. The scheduler guarantees <= num_slots distinct adapters."""
        needed = {a.version: a for a in adapters if a is not None}  # one adapter (the weights) per version
        if not needed:
            return [-1] * len(adapters) if self.always_route else None
        assert len(needed) <= self.num_slots, f"{len(needed)} adapters in one step, {self.num_slots} slots"
        slot_of = {}
        for version, adapter in needed.items():
            slot = self.resident.get(version)
            if slot is None:
                slot = self._swap_in(adapter, needed.keys())
            self.resident.move_to_end(version)
            slot_of[version] = slot
        return [-1 if a is None else slot_of[a.version] for a in adapters]

    @torch.inference_mode()  # the slot buffers are only ever written here: always inference tensors then
    def _swap_in(self, adapter: LoRAAdapter, keep: set) -> int:
        """A free slot, else the least recently used one whose adapter this step does not need."""
        taken = set(self.resident.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        if free:
            slot = free[0]
        else:
            served = {a.version for a in self.adapters.values()}
            victims = [version for version in self.resident if version not in keep]
            unloaded = [version for version in victims if version not in served]  # only old requests use these
            slot = self.resident.pop((unloaded or victims)[0])
        for module_path, wrapper in self.wrappers.items():
            wrapper.set_slot(slot, adapter.weights.get(module_path))
        self.resident[adapter.version] = slot
        self._slot_names[slot] = adapter.name
        self.resident_names = frozenset(self._slot_names[s] for s in self.resident.values())
        self.num_swaps += 1
        return slot

    # --- one step -------------------------------------------------------------------------------------
    @contextmanager
    def step(self, token_slots: torch.Tensor | None):
        """Install the wrappers and set the routing for one forward; always undone, also on errors."""
        if token_slots is None:
            yield
            return
        originals = []
        probing = self._probe
        try:
            for modules, attribute, wrapper in self._installs:
                original = modules[attribute]
                originals.append(original)
                if original is not wrapper.wrapped:  # the stand-ins in place change rarely: looked at then only
                    # the engine's packed stand-in of the base layer (paged_hf.worker.fast_paths.packed_linears or
                    # fused_layers), when one is in place; a plain attribute, not a registered submodule
                    # (state_dict and forward's lookups stay as they are)
                    object.__setattr__(wrapper, "packed_base",
                                       original if getattr(original, "base", None) is wrapper.base else None)
                    object.__setattr__(wrapper, "wrapped", original)
                modules[attribute] = wrapper
            self.context.routing = LoRARouting(token_slots)
            self.context.probing = probing
            yield
            if probing:
                self._form_groups()
        finally:
            self.context.routing = None
            self.context.probing = False
            for group in self.groups:
                group.release()
            for (modules, attribute, wrapper), original in zip(self._installs, originals):
                modules[attribute] = original
            if probing:
                for wrapper in self.wrappers.values():
                    wrapper.seen_input = None

    def _form_groups(self) -> None:
        """Group the wrappers of one parent module that read the same input tensor in the step just run."""
        for group in self.groups:
            group.dissolve()
        by_input: dict[tuple, list[LoRALinear]] = {}
        for module_path, wrapper in self.wrappers.items():
            if wrapper.seen_input is not None:  # held until the step's end: its id is not reused before
                key = (id(self._sites[module_path][0]), id(wrapper.seen_input), wrapper.weights.device)
                by_input.setdefault(key, []).append(wrapper)
        self.groups = [LoRAGroup(members) for members in by_input.values() if len(members) > 1]
        for group in self.groups:
            for member in group.members:
                member.group = group
        self._probe = False

"""A hybrid model's recurrent layers on the packed row: the model's own layer code, called per request group.

A linear-attention, SSM or convolution mixer reads its input as one sequence per batch row, so the packed row
of a step (many requests' tokens one after the other) must not reach it whole. Its stand-in splits the row:
- the step's continuing one-token queries (decodes) go in one call as a batch, `[num_decodes, 1, hidden]`, with
  their slots' states gathered: the mixer's own single-token path;
- each prompt chunk goes in a call of its own, `[1, chunk, hidden]`, starting from its slot's state when it
  continues a prompt (the mixer's own chunked path carries it), from none when it starts one;
and the outputs are put back in row order. (A mixer whose multi-token path ignores the state, as Mamba's
selective scan does, computes continuing chunks token by token in lockstep with the decodes instead.) Each call
sees a `StateView` of its slots (worker/hybrid/recurrent_state.py) in place of the paged cache. Mixers are found
by what their code calls: the cache's state API (`update_conv_state`, `update_recurrent_state`, ...), in their
methods or the modeling helpers those call, on a module with a `layer_idx` of a state layer; a block that keeps its
states outside the cache (RecurrentGemma's, RWKV's) gets them around each call the way its own code reads them
(worker/families/own_states.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_hf.integrations.transformers import UnservedAttention, step_cache
from paged_hf.worker.code_match import code_reads
from paged_hf.worker.stand_ins import ModuleSwaps, StandIn
from paged_hf.worker.hybrid.recurrence_kernels import RecurrenceKernels
from paged_hf.worker.families.own_states import OwnStates, UncutRows
from paged_hf.worker.families.registry import own_state_blocks
from paged_hf.worker.hybrid.recurrent_state import RecurrentStates, StateView

STATE_CALLS = frozenset({"get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state",
                         "get_linear_cache", "set_linear_cache"})  # the last two: MiniMax's own cache


@dataclass
class RecurrentStep:
    """How a step's packed row splits for the mixers: (first row, length, slot) of each query."""
    continuing: list[tuple[int, int, int]]  # queries after a computed past (decodes, later prompt chunks)
    fresh: list[tuple[int, int, int]]  # first chunks of prompts

    @classmethod
    def of(cls, query_start_loc: list[int], context_lens: list[int], slots: list[int | None]) -> RecurrentStep:
        continuing, fresh = [], []
        for i, slot in enumerate(slots):
            start, length = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
            assert slot is not None, "a hybrid model's request without a state slot"
            (continuing if context_lens[i] > length else fresh).append((start, length, slot))
        return cls(continuing, fresh)

    def lockstep(self, whole_chunks: bool) -> list[tuple[list[int], list[int]]]:
        """(rows, slots) of the calls over continuing queries: the one-token queries in one batch and each longer
        one whole (`whole_chunks`), or every query token by token, its t-th token in the t-th batch."""
        if whole_chunks:
            singles = [(start, slot) for start, length, slot in self.continuing if length == 1]
            calls = [([row for row, _ in singles], [slot for _, slot in singles])] if singles else []
            return calls + [(list(range(start, start + length)), [slot])
                            for start, length, slot in self.continuing if length > 1]
        calls = []
        for t in range(max((length for _, length, _ in self.continuing), default=0)):
            batch = [(start + t, slot) for start, length, slot in self.continuing if t < length]
            calls.append(([row for row, _ in batch], [slot for _, slot in batch]))
        return calls


def calls_state_api(module: torch.nn.Module) -> bool:
    """Some method of the module's class, or a modeling-file helper it calls, reads or writes the cache's
    recurrent states."""
    mro = type(module).__mro__
    own = mro[:mro.index(torch.nn.Module)] if torch.nn.Module in mro else mro
    return code_reads([function for klass in own for function in vars(klass).values()], STATE_CALLS)


class MixerStandIn(StandIn):
    """`original`'s forward, called per group of the step's queries (module docstring). `mode.whole_chunks`:
    a continuing prompt chunk in one call (the mixer's chunked path starts from its state), else token by
    token in lockstep with the decodes (for a mixer whose multi-token path starts from no state: Mamba's)."""

    def __init__(self, original: torch.nn.Module, mode: RecurrentMixers, own_states: OwnStates | None = None):
        super().__init__(original)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "own_states", own_states)  # a block's that keeps them outside the cache

    def forward(self, *args, **kwargs):
        args, kwargs = list(args), dict(kwargs)
        cache = _paged_cache_in(args, kwargs)
        step: RecurrentStep = cache.recurrent_step
        hidden = args[0] if args else kwargs["hidden_states"]  # [1, num_tokens, hidden]
        pieces = []  # (rows of the packed row, the call's outputs)
        for rows, slots in self._calls(step):
            if len(slots) == 1:  # one sequence: its rows as [1, tokens, hidden]
                select = lambda t, rows=rows: t[:, rows[0]: rows[-1] + 1]  # noqa: E731
            else:  # one token of each sequence: [batch, 1, hidden]
                index = torch.tensor(rows, device=hidden.device)
                select = lambda t, index=index: t[0].index_select(0, index)[:, None]  # noqa: E731
            pieces.append((rows, self._call(args, kwargs, cache, select(hidden), slots, True, select)))
        for start, length, slot in step.fresh:
            select = lambda t, start=start, length=length: t[:, start: start + length]  # noqa: E731
            pieces.append((list(range(start, start + length)),
                           self._call(args, kwargs, cache, select(hidden), [slot], False, select)))
        first = pieces[0][1]
        if isinstance(first, torch.Tensor):
            return _packed(pieces, hidden.shape[1])
        # a tuple (a projection's query, key and value; an attention's output and weights): its per-token
        # tensors put back in row order, anything else (a call's own state, weights) dropped
        return type(first)(_packed([(rows, output[i]) for rows, output in pieces], hidden.shape[1])
                           if all(_per_call_token(output[i], len(rows)) for rows, output in pieces) else None
                           for i in range(len(first)))

    def _calls(self, step: RecurrentStep) -> list[tuple[list[int], list[int]]]:
        """(rows, slots) of the calls over continuing queries; a block whose one-token path reads a batch wrongly
        (RWKV's) gets one sequence a call."""
        calls = step.lockstep(self.mode.whole_chunks)
        if self.own_states is None or self.own_states.batches:
            return calls
        split = []
        for rows, slots in calls:  # a batch holds one row of each sequence; a longer call is one sequence
            split += [([row], [slot]) for row, slot in zip(rows, slots)] if len(slots) > 1 else [(rows, slots)]
        return split

    def _call(self, args, kwargs, cache, hidden, slots, continuing, select):
        """The original mixer on `hidden` [batch, tokens, hidden] with a view of `slots`; per-token tensors of
        the packed row among its other arguments are selected the same way (`select`)."""
        view = StateView(cache.states, slots, continuing)
        num_tokens = cache.metadata.slot_mapping.shape[0]
        pick = lambda v: view if v is cache else select(v) if _per_token(v, num_tokens) else v  # noqa: E731
        call_args = [pick(a) for a in args]
        if call_args:
            call_args[0] = hidden
        # no padding mask: each call's rows are whole sequences (None, not absent: some mixers require it)
        call_kwargs = {k: None if k == "attention_mask" else pick(v) for k, v in kwargs.items()}
        if not args:
            call_kwargs["hidden_states"] = hidden
        if self.own_states is not None:
            self.own_states.load(view, call_args, call_kwargs)
        output = self.original(*call_args, **call_kwargs)
        if self.own_states is not None:
            self.own_states.store(view, output)
        view.write_back()
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return output
        if not isinstance(output, torch.Tensor):
            raise UnservedAttention(f"{type(self.original).__name__} returns {type(output).__name__}, not a tensor")
        return output


def _per_call_token(value, num_rows: int) -> bool:
    """A tensor of one call's tokens: [batch, tokens, ...] over the call's `num_rows` rows of the packed row."""
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] * value.shape[1] == num_rows


def _packed(pieces: list[tuple[list[int], torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """The calls' outputs [batch, tokens, ...] back in the packed row's order: [1, num_tokens, ...]."""
    rest = pieces[0][1].shape[2:]
    output = pieces[0][1].new_empty(num_tokens, *rest)
    for rows, piece in pieces:
        output[rows] = piece.reshape(len(rows), *rest)
    return output[None]


def _per_token(value, num_tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == num_tokens


def _paged_cache_in(args: list, kwargs: dict):
    """The step's paged cache: among the call's arguments, else the step's own (a block the model's forward hands
    no cache, as RWKV's)."""
    for value in (*args, *kwargs.values(), step_cache()):
        if getattr(value, "recurrent_step", None) is not None:
            return value
    raise UnservedAttention("a recurrent mixer was called without the paged cache")


class RecurrentMixers(ModuleSwaps):
    """Every module that computes a state layer with the cache's state API, swapped for its stand-in in a step,
    and the reference recurrences their modeling modules call swapped for faster ones (recurrence_kernels.py).
    `whole_chunks`: how continuing prompt chunks run (MixerStandIn); the engine probe turns it off for mixers
    whose multi-token path ignores the state."""

    def __init__(self, model: torch.nn.Module, states: RecurrentStates | None):
        self.sites = []
        self.whole_chunks = True
        self.kernels = RecurrenceKernels([])
        self.uncut_rows = UncutRows(model)
        if states is None:
            return
        layers = states.layer_indices
        own = {id(keeper.block): keeper for layer_idx, keeper in own_state_blocks(model).items() if layer_idx in layers}
        for parent in model.modules():
            for name, child in parent._modules.items():
                if child is not None and id(child) in own:
                    self.sites.append((parent, name, child, MixerStandIn(child, self, own[id(child)])))
                elif child is not None and getattr(child, "layer_idx", None) in layers and calls_state_api(child):
                    self.sites.append((parent, name, child, MixerStandIn(child, self)))
        self.kernels = RecurrenceKernels([original for _, _, original, _ in self.sites])

    def __enter__(self) -> None:
        super().__enter__()
        self.kernels.__enter__()
        self.uncut_rows.__enter__()

    def __exit__(self, *exc) -> None:
        self.uncut_rows.__exit__(*exc)
        self.kernels.__exit__(*exc)
        super().__exit__(*exc)

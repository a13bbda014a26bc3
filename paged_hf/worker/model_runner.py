"""Runs the HF model once per step on the packed row, with the `PagedCache` holding the step's metadata."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from paged_hf.config import PagedConfig
from paged_hf.core.scheduler_output import SchedulerOutput
from paged_hf.integrations.transformers import ATTENTION_NAME, STEP_MASK_SENTINEL, register
from paged_hf.kernels.selection import select_kernels
from paged_hf.kernels.quant import storage_dtype
from paged_hf.loader.mapped_weights import copy_out_of_files
from paged_hf.multimodal.embeddings import has_images, step_embeds
from paged_hf.multimodal.encoder_cache import EncoderCache
from paged_hf.multimodal.registry import vision_family
from paged_hf.profiling import span
from paged_hf.utils import trim_heap
from paged_hf.worker.attention_switch import AttentionSwitch
from paged_hf.worker.call_scope import CallScope
from paged_hf.worker.probes.engine_probe import verify_engine
from paged_hf.worker.fast_paths.fused_layers import FusedLayers
from paged_hf.worker.fast_paths.llama_forward import LlamaForward
from paged_hf.worker.kv_tier.offload import make_kv_offload
from paged_hf.worker.model_info import ModelInfo, text_config
from paged_hf.worker.families.registry import FamilyStandIns
from paged_hf.worker.huge_pages import into_huge_pages
from paged_hf.worker.hybrid.recurrent_mixers import RecurrentMixers
from paged_hf.worker.hybrid.recurrent_state import RecurrentStates
from paged_hf.worker.cache_sizing import state_slot_count
from paged_hf.worker.fast_paths.packed_linears import PackedLinears, PackingSwitch
from paged_hf.worker.probes.model_probe import own_cache_class
from paged_hf.worker.paged_cache import paged_cache_class
from paged_hf.worker.pipeline import stage_links
from paged_hf.worker.pooling import HiddenStateCapture, pooling_rows, pooling_spans
from paged_hf.worker.step_inputs import StepInputs, build_step_inputs
from paged_hf.worker.step_swaps import StepSwaps


class ModelRunner:
    def __init__(self, model: torch.nn.Module, info: ModelInfo, num_blocks: int, config: PagedConfig):
        register()
        self.model = model
        self.info = info
        self.block_size = config.block_size
        kv_dtype = storage_dtype(config.kv_cache_dtype, info.dtype)
        self.family_stand_ins = FamilyStandIns(model, text_config(model.config))  # attention code of their own
        self.vision = vision_family(model)  # the family that encodes a vision-language model's images, else None
        # as this cache stores them; a family whose image tokens see each other needs a kernel that computes that
        bidirectional = self.vision is not None and self.vision.bidirectional_images
        specs = [dataclasses.replace(spec, dtype=info.dtype, kv_dtype=None if kv_dtype == info.dtype else kv_dtype,
                                     bidirectional_spans=bidirectional) for spec in info.attention_layers]
        # the kernel of every step, and where it cannot compute an image step's spans the torch kernel for those
        self.kernel, span_kernel = select_kernels(config.attention_backend, specs)
        states = RecurrentStates(info.state_layers, state_slot_count(config)) if info.is_hybrid else None
        self.cache = paged_cache_class(own_cache_class(model))(num_blocks, config.block_size, specs, info.dtype,
                                                               self.kernel, kv_dtype, states, span_kernel)
        self.recurrent_mixers = RecurrentMixers(model, states)  # a hybrid's recurrent layers, request by request
        self.logits_device = info.logits_device  # seeded requests' generators live there
        self.attention_switch = AttentionSwitch(model, ATTENTION_NAME)
        self.lora = None  # a LoRAManager once adapters are loaded (paged_hf.integrations.lora)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes) if self.vision is not None else None
        self.packing = PackingSwitch()  # the packed copies are made once a step's batch is past the few-row loops
        fused_layers = FusedLayers(model, config.pack_linear_weights, self.packing) if config.fuse_layers else None
        self.fused_layers = fused_layers or contextlib.nullcontext()
        # the weights (and the quantized groups' stacks, made now) into 2 MB pages, before anything holds them
        stacked = fused_layers.stacked_weights() if fused_layers is not None else []
        self.huge_page_bytes = into_huge_pages([*model.parameters(), *model.buffers(), *stacked])
        if self.huge_page_bytes:  # what stays in a checkpoint's mapping (a norm) would keep every page read of it
            copy_out_of_files(model)
        fused = fused_layers.fused_linears if fused_layers is not None else set()
        self.packed_linears = (PackedLinears(model, fused, self.packing) if config.pack_linear_weights
                               else contextlib.nullcontext())
        # Llama's forward without transformers' wrappers, where the fused layers serve the model (else None)
        self.llama_forward = LlamaForward.of(model, fused_layers.lean) if fused_layers is not None else None
        self.lean = fused_layers.lean if fused_layers is not None else None
        self.call_scope = CallScope(model)  # a generate() call's steps, which may take what its first one checked
        self.swaps = StepSwaps(self.attention_switch, self.family_stand_ins, self.recurrent_mixers,
                               self.packed_linears, self.fused_layers)
        self.kv_offload = None
        self.links = stage_links(model)  # a pipeline stage's messages to its neighbours; None for a whole model
        if self.links is None:  # (a stage's forward is not the model's; the pipeline is tested against it instead)
            verify_engine(self)  # the engine computes the model's own forward, or the model is refused here
        # the KV tier under the prefix cache (host memory, a directory): None unless configured
        self.kv_offload = make_kv_offload(model, info.dtype, self.cache, config)
        self.kv_tier = self.kv_offload.tier if self.kv_offload is not None else None
        trim_heap()  # what loading freed (float weights a quantization replaced, the probe's) back to the system

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """-> logits [num_kept, vocab_size] (the sampled requests' rows, and prompt-logprob rows), the step's inputs
        (with embedding requests: their rows' final hidden states in `inputs.pooled_hidden_states`)."""
        self.packing.see_step(len(out.scheduled))
        transfers = self.kv_offload.save_blocks() if self.kv_offload is not None else None  # before any write
        self.cache.copy_blocks([src for src, _ in out.block_copies], [dst for _, dst in out.block_copies])
        if self.cache.states is not None:
            self.cache.states.copy_slots(out.state_copies)  # forked children start from their parent's state
        if transfers is not None:
            self.kv_offload.load_blocks(transfers)
        request_slots = None
        if self.lora is not None:  # the adapters of this step go to device slots (swapped in if needed)
            request_slots = self.lora.assign_slots([s.request.lora for s in out.scheduled])
        with span("step_inputs"):
            inputs = build_step_inputs(out, self.block_size, request_slots)
        device = self.info.input_device
        kwargs = dict(
            **self._stage_input(inputs.input_ids.to(device)[None]),  # [1, num_tokens]
            position_ids=self._position_ids(out, inputs.positions).to(device),
            attention_mask=STEP_MASK_SENTINEL,
            cache=self.cache,
            use_cache=True,
        )
        if self.info.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = inputs.logits_indices.to(device)
        if self.vision is not None and has_images(out):  # images' features over their placeholders
            with span("vision"):
                kwargs["inputs_embeds"] = step_embeds(self.vision, out, kwargs.pop("input_ids"),
                                                      inputs.attention.query_start_loc, self.encoder_cache)
        inputs.pooling_spans = pooling_spans(out, inputs.attention.query_start_loc)
        capture = (HiddenStateCapture(self.model, pooling_rows(inputs.pooling_spans)) if inputs.pooling_spans
                   else contextlib.nullcontext())
        # what a call's first step checked, its later ones take (adapters' wrappers and pooled rows: checked)
        settled = self.call_scope.settled if self.lora is None and not inputs.pooling_spans else None
        if self.lean is not None:
            self.lean.native.settled = settled
        self.cache.begin_step(inputs.attention)
        try:
            with self.swaps.around(self.cache, self._lora_step(inputs.adapter_slots), capture, settled), span("model"):
                logits = self._call_model(kwargs)  # [num_kept, vocab_size]; None before a pipeline's last stage
            self.cache.check_step()  # every layer went through the paged attention, or the step fails
        finally:
            self.cache.end_step()
        if inputs.pooling_spans:  # [num_rows, hidden_size] -> one [count, hidden_size] per span
            inputs.pooled_hidden_states = list(capture.hidden_states.split([s.count for s in inputs.pooling_spans]))
        if logits is None:
            return None, inputs
        if not self.info.accepts_logits_to_keep:
            logits = logits[inputs.logits_indices.to(logits.device)]
        return logits.to(self.logits_device), inputs  # a hook may hand them back elsewhere (io_same_device)

    def _position_ids(self, out: SchedulerOutput, positions: torch.Tensor) -> torch.Tensor:
        """[1, num_tokens], the token indices; a family's own rows where a request holds them (Qwen-VL's 3-D rotary
        positions: [3, 1, num_tokens])."""
        own = self.vision.step_position_ids(out, positions) if self.vision is not None else None
        return positions[None] if own is None else own

    def _stage_input(self, input_ids: torch.Tensor) -> dict:
        """The token ids; on a pipeline stage after the first, the previous stage's hidden states instead."""
        if self.links is None or self.links.stage.is_first:
            return {"input_ids": input_ids}
        hidden_size = text_config(self.model.config).hidden_size
        hidden = self.links.receive_hidden(input_ids.shape[1], hidden_size, self.info.dtype, input_ids.device)
        return {"inputs_embeds": hidden[None]}

    def _call_model(self, kwargs: dict) -> torch.Tensor | None:
        """The logits rows; a pipeline rank that does not sample runs the decoder only and returns None: before the
        last stage it hands its hidden states on, on the last stage (its other tensor ranks) no LM head runs."""
        if self.links is None and self.llama_forward is not None and self.llama_forward.serves(kwargs):
            return self.llama_forward(**kwargs)[0]
        if self.links is None or self.links.samples:
            return self.model(**kwargs).logits[0]
        kwargs.pop("logits_to_keep", None)
        hidden = self.model.get_decoder()(**kwargs).last_hidden_state[0]  # [num_tokens, hidden_size]
        if not self.links.stage.is_last:
            self.links.send_hidden(hidden)
        return None

    def _lora_step(self, adapter_slots: torch.Tensor | None):
        """Per-token LoRA routing for this forward only (a no-op without adapter tokens)."""
        return self.lora.step(adapter_slots) if self.lora is not None else contextlib.nullcontext()

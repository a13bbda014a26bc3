"""`paged_hf.LLM`: vLLM's offline entry point, for users who start from a model name rather than a live model.

    llm = paged_hf.LLM("HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=2048)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    replies = llm.chat([{"role": "user", "content": "Hi!"}])

It loads the checkpoint (`--device auto`/`--dtype auto` rules, device_dtype.py) and wraps it (`paged_hf.wrap`);
everything else is the generator's: the same outputs, errors and configuration (PagedConfig's fields).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial

from transformers.utils import logging

from paged_hf.hf.paged_model import wrap
from paged_hf.llm_stages import PipelineStages, load_stage_model, stage_generator
from paged_hf.loader.device_dtype import checkpoint_dtype, resolve_device, resolve_dtype
from paged_hf.multimodal.media import MediaLimits, load_image, part_url
from paged_hf.multimodal.registry import served_processor, split_processor
from paged_hf.outputs import EmbeddingRequestOutput, RequestOutput
from paged_hf.pooling_params import PoolingParams
from paged_hf.sampling_params import SamplingParams

logger = logging.get_logger(__name__)


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 pipeline_parallel_size: int = 1, **config):
        """`model`: an HF folder or hub id (None: the default model); `config`: PagedConfig fields (vLLM's
        `speculative_config` is accepted as `speculative`). `pipeline_parallel_size` N > 1: the model's layers in
        N processes, this one and N - 1 spawned ones, each holding only its layers (`close()` stops them)."""
        from paged_hf.loader.default_model import load_model, with_processor  # noqa: PLC0415

        if not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {pipeline_parallel_size!r}")
        if "speculative_config" in config:
            if "speculative" in config:
                raise ValueError("give speculative or speculative_config, not both")
            config["speculative"] = config.pop("speculative_config")

        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device, lambda: checkpoint_dtype(model))
        self.stages = self.paged_model = self.processor = None
        if pipeline_parallel_size > 1:
            self.stages = PipelineStages(pipeline_parallel_size, partial(load_stage_model, model, torch_dtype, device),
                                         partial(stage_generator, config))
            self.generator, self.tokenizer = self.stages.generator, self.stages.tokenizer
            weakref.finalize(self, self.stages.close)
            return
        hf_model, tokenizer = load_model(model, torch_dtype, device)
        tokenizer, text_only = served_processor(hf_model, with_processor(model, tokenizer))  # a vision folder's
        if text_only is not None:
            logger.warning("%s: only its text is served: %s", model, text_only)
        self.paged_model = wrap(hf_model, tokenizer, **config)
        self.generator = self.paged_model.generator
        self.tokenizer, self.processor = split_processor(tokenizer)

    def close(self) -> None:
        """Stop a pipeline's other stages (a no-op without them)."""
        if self.stages is not None:
            self.stages.close()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, adapter: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """`prompts`: a string, a list of strings or token-id lists, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts, with `"multi_modal_data": {"image": ...}` for a vision-language model's
        folder (docs/vision.md). One RequestOutput per prompt, in order."""
        if self.stages is not None:
            return self.stages.call("generate", _prompts(prompts), sampling_params, adapters=adapter, use_tqdm=use_tqdm)
        return self.generator.generate(_prompts(prompts), sampling_params, adapters=adapter, use_tqdm=use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, adapter: str | Sequence[str | None] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`output.outputs.embedding`), pooled as the model folder's
        sentence-transformers config says (`modules.json`, `1_Pooling/config.json`, a `Normalize` module), else
        at the last token and normalized. `pooling_params`: `PoolingParams(dimensions=..., normalize=...)`."""
        return self.generator.embed(_prompts(prompts), pooling_params, adapters=adapter, use_tqdm=use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, adapter: str | Sequence[str | None] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {"role", "content"}) or a list of them; each goes through
        the chat template, then generates as `generate` does. A vision-language model's folder takes
        `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` content parts (the processor's
        chat template puts an image where each is)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        prompts = []
        for conversation in conversations:
            urls = _image_urls(conversation)
            prompts.append(self._image_chat(conversation, urls, template) if urls else list(
                self.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **template)))
        return self.generate(prompts, sampling_params, use_tqdm, adapter)

    def _image_chat(self, conversation, urls: list[tuple[str, str]], template: dict):
        """A conversation with `image_url` parts (data: URLs; multimodal/media.py's checks and limits) -> the
        processor's chat template with an image where each part is, processed as a prompt dict with its images."""
        if self.processor is None:
            raise ValueError("image_url parts need a vision-language model served with its processor (docs/vision.md)")
        images = [load_image(url, where, MediaLimits()) for where, url in urls]
        parts = [{**message, "content": [{"type": "image"} if part.get("type") == "image_url" else part
                                         for part in message["content"]]} if isinstance(message["content"], list)
                 else message for message in conversation]
        text = self.processor.apply_chat_template(parts, tokenize=False, **template)
        return self.generator.process_prompt({"prompt": text, "multi_modal_data": {"image": images}}, False)


def _image_urls(conversation) -> list[tuple[str, str]]:
    """(where, url) of each `image_url` part of a conversation, in order."""
    found = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}]"
                found.append((where, part_url(part, where)))
    return found


def _prompts(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    result = []
    for prompt in prompts:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            pass  # the engine's processor takes it whole (engine/image_prompts.py)
        elif isinstance(prompt, dict):
            if set(prompt) - {"prompt", "prompt_token_ids"} or len(prompt) != 1:
                raise ValueError(f"a prompt dict has one key, 'prompt' or 'prompt_token_ids'; got {sorted(prompt)}")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        result.append(prompt)
    return result

"""`paged-hf serve` on a hybrid model's folder (Qwen3-Next: Gated DeltaNet and attention layers), through the real
`openai` client: each answer is HF's greedy continuation of the same prompt, with requests served together."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

openai = pytest.importorskip("openai")

from serve_process import MODEL, ServerProcess  # noqa: E402
from tiny_server import tiny_tokenizer  # noqa: E402

PROMPTS = ["<user> the cat sat on the mat", "<user> a", "<user> one two three four five six seven eight nine ten"]
MAX_TOKENS = 6


def tiny_hybrid(vocab_size: int) -> torch.nn.Module:
    config = transformers.Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def test_a_hybrid_folder_is_served_with_hfs_greedy_answers(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_hybrid(len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))  # as the server
    with ServerProcess(str(tmp_path), "--dtype", "float32", "--max-num-batched-tokens", "8") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

        def complete(prompt: str) -> str:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(complete, PROMPTS))
    assert [a.split() for a in answers] == [e.split() for e in expected]

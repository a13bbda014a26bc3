"""Structured outputs in the engine: a tiny random Llama with the default model's real tokenizer (49,152
tokens), so the grammar, not the model, decides what can come out."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import assert_no_leak, real_tokenizer, tiny_model_for

import paged_hf
from paged_hf import SamplingParams, StructuredOutputsParams
from paged_hf.sample.structured_output import GrammarCompiler, apply_grammar_masks

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "ok", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
SPECS = [dict(json=SCHEMA), dict(regex=r"[0-9]{3}-[a-z]{2}"), dict(choice=["yes", "no", "maybe"]),
         dict(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"')]


@pytest.fixture(scope="module")
def tokenizer():
    return real_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model_for(tokenizer, 256)


def make_generator(model, tokenizer, **config):
    config = {"num_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 128, **config}
    return paged_hf.wrap(model, tokenizer=tokenizer, **config).generator


def conforms(spec: dict, text: str) -> bool:
    if "json" in spec:
        value = json.loads(text)
        return (set(value) == {"kind", "ok", "n"} and value["kind"] in ("cat", "dog")
                and isinstance(value["ok"], bool) and isinstance(value["n"], int) and 0 <= value["n"] <= 99)
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    return re.fullmatch(r"\([a-c]{1,3}\)", text) is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_conforms_for_each_child(model, tokenizer, temperature):
    gen = make_generator(model, tokenizer)
    params = [SamplingParams(temperature=temperature, seed=1, max_new_tokens=60, n=2, structured_outputs=spec)
              for spec in SPECS]
    outs = gen.generate(["Answer:"] * len(SPECS), params, use_tqdm=False)
    for spec, out in zip(SPECS, outs):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", (spec, c)
            assert conforms(spec, c.text), (spec, c.text)
    assert_no_leak(gen)


def test_requests_without_a_grammar_are_untouched(model, tokenizer):
    prompts = ["one two", "three", "four five six"]
    plain = SamplingParams(temperature=0, max_new_tokens=8)
    alone = make_generator(model, tokenizer).generate(prompts, plain, use_tqdm=False)
    mixed = make_generator(model, tokenizer).generate(
        prompts + ["x", "y"], [plain] * 3 + [SamplingParams(temperature=0, max_new_tokens=8, structured_outputs=s)
                                             for s in SPECS[:2]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]


def test_max_tokens_cut_is_length_and_a_prefix(model, tokenizer):
    gen = make_generator(model, tokenizer)
    out = gen.generate(["x"], SamplingParams(temperature=0, max_new_tokens=3, structured_outputs=dict(json=SCHEMA)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert '{"kind": "'.startswith(out.text) and len(out.text) > 1


def test_ignore_eos_still_ends_with_the_grammar(model, tokenizer):
    gen = make_generator(model, tokenizer)
    out = gen.generate(["x"], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True,
                                             structured_outputs=dict(choice=["yes", "no"])), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].text in ("yes", "no")


def test_preemption_keeps_the_grammar_in_step(model, tokenizer):
    """Recompute after preemption: same tokens as a roomy cache (the matcher stays with the kept tokens)."""
    prompts = [f"prompt number {i} " * 3 for i in range(4)]
    specs = [SPECS[0], SPECS[0], SPECS[1], SPECS[0]]  # long enough outputs to outgrow a small cache
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=24, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    roomy = make_generator(model, tokenizer).generate(prompts, params, use_tqdm=False)
    tight_gen = make_generator(model, tokenizer, num_blocks=10, block_size=4, max_num_batched_tokens=32)
    tight = tight_gen.generate(prompts, params, use_tqdm=False)
    assert tight_gen.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert_no_leak(tight_gen)


def test_invalid_spec_is_a_value_error_and_queues_nothing(model, tokenizer):
    gen = make_generator(model, tokenizer)
    with pytest.raises(ValueError, match='invalid structured_outputs.json: .*Unsupported type "strin"'):
        gen.add_request("x", SamplingParams(structured_outputs=dict(json={"type": "strin"})))
    with pytest.raises(ValueError, match="invalid structured_outputs.regex: .*Unclosed"):
        gen.add_request("x", SamplingParams(structured_outputs=dict(regex="[a-")))
    with pytest.raises(ValueError, match="invalid structured_outputs.grammar: .*foo"):
        gen.add_request("x", SamplingParams(structured_outputs=dict(grammar="root ::= foo")))
    assert not gen.has_unfinished_requests() and not gen.groups


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"), (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{not json"), "not valid JSON"), (dict(choice=[]), "choice must be"),
    (dict(choice=["a", ""]), "choice must be"), (dict(json=[1]), "json must be"),
])
def test_params_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_min_new_tokens_conflicts_with_a_grammar():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=2, structured_outputs=dict(choice=["a"]))
    assert SamplingParams(structured_outputs=dict(choice=["a"])).structured_outputs.choice == ["a"]


def test_compiled_grammars_are_cached_per_spec(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [2])
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    other = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False))
    assert first is again and other is not first and compiler.num_compiled == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the numpy path and the torch path
def test_mask_applies_to_grammar_rows_only_and_copies(tokenizer, dtype):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [2])
    state = compiler.matcher(compiler.compile(StructuredOutputsParams(choice=["yes", "no"])))
    logits = torch.randn(3, len(tokenizer), generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    masked = apply_grammar_masks(logits, [1], [state])
    assert torch.equal(logits, before) and torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = masked[1].isfinite().nonzero()[:, 0].tolist()
    assert allowed and all(("yes".startswith(t) or "no".startswith(t)) and t
                           for t in (tokenizer.decode([a]) for a in allowed))
    assert torch.equal(masked[1][allowed], logits[1][allowed])


def test_a_token_outside_the_grammar_fails_only_its_request(model, tokenizer):
    """Should another constraint leave a grammar row all -inf, the drawn token is refused by the matcher: the
    stop check fails that request alone (the engine reports it with `error`) instead of the whole step."""
    gen = make_generator(model, tokenizer)
    request_id = gen.add_request("x", SamplingParams(temperature=0, max_new_tokens=8,
                                                     structured_outputs=dict(choice=["yes", "no"])))
    (request,) = gen.groups[request_id].children
    request.append_token(tokenizer.convert_tokens_to_ids("maybe") or 5)
    with pytest.raises(ValueError, match="outside the request's grammar"):
        gen.stop_checker.check(request)
    gen.abort(request_id)

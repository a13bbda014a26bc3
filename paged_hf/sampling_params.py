"""Per-request sampling parameters, validated when they are made (a bad field never reaches the engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from paged_hf.utils import field_checker, is_int, is_number

#: a temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would overflow
GREEDY_TEMPERATURE = 1e-5
#: the kinds of constraint a request's structured_outputs may name (exactly one)
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")

_check = field_checker("SamplingParams")
_check_structured = field_checker("structured_outputs")
_check_beam = field_checker("BeamSearchParams")


@dataclass
class SamplingParams:
    """How one request samples its tokens; the fields follow vLLM's and HF's names and meanings."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # A grammar the output must follow (JSON schema, regex, choice...); a dict is read as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None  # logprobs of each prompt token (and the top-k), computed in prefill
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be drawn
    bad_words: list[str] | None = None  # never completed: a word's last token is masked once the rest is there
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # in the decoded text
    kept_special_tokens: list[str] | None = None  # special tokens the text keeps all the same (a format's markers)
    # A thinking model's marker that ends its thinking (token ids: Qwen3's and DeepSeek-R1's `</think>`): the
    # grammar holds from the token after it (the thinking is free), and thinking_token_budget closes it.
    thinking_end_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None  # (vLLM's) past this many tokens of thinking the marker is forced
    thinking_start_token_id: int | None = None  # the thinking is optional: it is one only if it opens with this
    # Not in the public contract: extra token ids that end the request like EOS (HF's eos_token_id list).
    eos_token_ids: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an int >= 1")
        _check(isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", self.min_new_tokens, "an int in [0, max_new_tokens]")
        _check(is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k, "an int >= -1 (0 or -1 = off)")
        _check(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an int >= 1")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an int or None")
        _check(self.stop is None or all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "a list of non-empty strings")
        _check(self.stop_token_ids is None or all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "a list of token ids")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams, a dict of its fields or None")
        _check(self.structured_outputs is None or self.min_new_tokens == 0, "min_new_tokens", self.min_new_tokens,
               "0 with structured_outputs (the grammar decides where the output ends)")
        _check(self.kept_special_tokens is None or (isinstance(self.kept_special_tokens, (list, tuple))
               and all(isinstance(t, str) and t for t in self.kept_special_tokens)), "kept_special_tokens",
               self.kept_special_tokens, "a list of token strings or None")
        _check(self.thinking_end_token_ids is None or (isinstance(self.thinking_end_token_ids, (list, tuple))
               and self.thinking_end_token_ids and all(is_int(t) and t >= 0 for t in self.thinking_end_token_ids)),
               "thinking_end_token_ids", self.thinking_end_token_ids, "a non-empty list of token ids or None")
        _check(self.thinking_start_token_id is None or (is_int(self.thinking_start_token_id)
               and self.thinking_start_token_id >= 0 and self.thinking_end_token_ids is not None),
               "thinking_start_token_id", self.thinking_start_token_id,
               "a token id, with thinking_end_token_ids (the marker that closes the thinking)")
        _check(self.thinking_token_budget is None or (is_int(self.thinking_token_budget)
               and self.thinking_token_budget >= 0 and self.thinking_end_token_ids is not None),
               "thinking_token_budget", self.thinking_token_budget,
               "an int >= 0, with thinking_end_token_ids (the marker that closes the thinking)")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs", self.logprobs, "an int >= 0 or None")
        _check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0), "prompt_logprobs", self.prompt_logprobs, "an int >= 0 or None")
        _check_token_constraints(self)

    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    @property
    def min_tokens(self) -> int:
        return self.min_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def check_stop_limits(stop: list[str] | None, max_stop_strings: int, max_stop_string_chars: int) -> None:
    """Stop strings within the engine's bounds (PagedConfig): every one of them is searched at every step of
    the request, so an unbounded list would slow the whole batch."""
    if not stop:
        return
    if len(stop) > max_stop_strings:
        raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most max_stop_strings={max_stop_strings} "
                         "are accepted (a PagedConfig field)")
    longest = max(stop, key=len)
    if len(longest) > max_stop_string_chars:
        raise ValueError(f"SamplingParams.stop holds a string of {len(longest)} characters; at most "
                         f"max_stop_string_chars={max_stop_string_chars} are accepted (a PagedConfig field)")


def _check_token_constraints(params: SamplingParams) -> None:
    bias = params.logit_bias
    _check(bias is None or (isinstance(bias, dict) and all(is_int(t) and t >= 0 and is_number(v) for t, v in bias.items())),
           "logit_bias", bias, "a dict {token_id: bias}")
    allowed = params.allowed_token_ids
    _check(allowed is None or (isinstance(allowed, (list, tuple)) and allowed and all(is_int(t) and t >= 0 for t in allowed)),
           "allowed_token_ids", allowed, "a non-empty list of token ids")
    bad = params.bad_words
    _check(bad is None or (isinstance(bad, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in bad)),
           "bad_words", bad, "a list of non-empty strings")


@dataclass
class StructuredOutputsParams:
    """The constraint of one request (vLLM's `StructuredOutputsParams`): exactly one field of STRUCTURED_OUTPUT_KINDS.

    `json`: a JSON schema (dict or JSON text). `json_object`: any JSON object. `regex`: a regular expression
    the whole output matches. `choice`: the output is one of these strings. `grammar`: an EBNF grammar
    (GBNF, with a `root` rule). `disable_any_whitespace` (default True, vLLM's default is False): JSON is
    written compactly, with no free whitespace between tokens; small models otherwise tend to emit
    whitespace until max_tokens.
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        chosen = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, got {chosen or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        _check_structured(self.json is None or isinstance(self.json, dict), "json", self.json, "a JSON schema object")
        _check_structured(self.json_object in (None, True, False), "json_object", self.json_object, "a bool")
        _check_structured(self.regex is None or (isinstance(self.regex, str) and self.regex), "regex", self.regex,
               "a non-empty string")
        _check_structured(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "choice", self.choice, "a non-empty list of non-empty strings")
        _check_structured(self.grammar is None or (isinstance(self.grammar, str) and self.grammar), "grammar", self.grammar,
               "a non-empty string")
        _check_structured(isinstance(self.disable_any_whitespace, bool), "disable_any_whitespace",
               self.disable_any_whitespace, "a bool")
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple:
        """What the compiled grammar depends on (the cache key)."""
        value = getattr(self, self.kind)
        text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
        return self.kind, text, self.disable_any_whitespace


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams` names plus HF's beam-search settings (same meanings as HF's `generate`).

    `length_penalty`: a hypothesis scores sum(logprobs) / num_generated_tokens ** length_penalty.
    `early_stopping`: True stops once beam_width hypotheses are finished; False stops when the heuristic says
    no running beam can beat them; "never" only when that is certain (HF's three values).
    `num_return_sequences`: how many of the best hypotheses come back (default: beam_width).
    """

    beam_width: int
    max_tokens: int = 16
    min_tokens: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_beam(is_int(self.beam_width) and self.beam_width >= 1, "beam_width", self.beam_width, "an int >= 1")
        _check_beam(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an int >= 1")
        _check_beam(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               "an int in [0, max_tokens]")
        _check_beam(is_number(self.length_penalty), "length_penalty", self.length_penalty, "a number")
        _check_beam(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
               self.early_stopping, 'True, False or "never"')
        if self.num_return_sequences is None:
            self.num_return_sequences = self.beam_width
        _check_beam(is_int(self.num_return_sequences) and 1 <= self.num_return_sequences <= self.beam_width,
               "num_return_sequences", self.num_return_sequences, "an int in [1, beam_width]")
        _check_beam(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        _check_beam(self.stop_token_ids is None or all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids")
        _check_beam(is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "> 0")


_dataclass_init = SamplingParams.__init__  # the dataclass's own __init__ (a class-body __init__ would replace it)


def _init(self, *args, max_tokens: int | None = None, min_tokens: int | None = None, **kwargs):
    """vLLM's names `max_tokens`/`min_tokens` set `max_new_tokens`/`min_new_tokens`."""
    for alias, name, value in (("max_tokens", "max_new_tokens", max_tokens), ("min_tokens", "min_new_tokens", min_tokens)):
        if value is None:
            continue
        if name in kwargs and kwargs[name] != value:
            raise ValueError(f"SamplingParams: {alias}={value!r} and {name}={kwargs[name]!r} disagree; give one")
        kwargs[name] = value
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init

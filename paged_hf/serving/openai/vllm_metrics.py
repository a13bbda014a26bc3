"""The /metrics samples again under vLLM's names (`vllm:...`, with a `model_name` label), so dashboards and
routers built for vLLM read paged_hf unchanged. Same values, one source: the paged_hf exposition's lines."""

from __future__ import annotations

#: paged_hf name -> vLLM name (histograms: their _bucket/_sum/_count samples follow)
VLLM_NAMES = {
    "paged_hf_num_requests_running": "vllm:num_requests_running",
    "paged_hf_num_requests_waiting": "vllm:num_requests_waiting",
    "paged_hf_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "paged_hf_num_preemptions_total": "vllm:num_preemptions_total",
    "paged_hf_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "paged_hf_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "paged_hf_prompt_tokens_total": "vllm:prompt_tokens_total",
    "paged_hf_generation_tokens_total": "vllm:generation_tokens_total",
    "paged_hf_sequences_finished_total": "vllm:request_success_total",
    "paged_hf_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "paged_hf_inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
    "paged_hf_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "paged_hf_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "paged_hf_lora_requests_info": "vllm:lora_requests_info",
    "paged_hf_external_prefix_cache_queries_total": "vllm:external_prefix_cache_queries_total",
    "paged_hf_external_prefix_cache_hits_total": "vllm:external_prefix_cache_hits_total",
    "paged_hf_spec_decode_num_drafts_total": "vllm:spec_decode_num_drafts_total",
    "paged_hf_spec_decode_num_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
    "paged_hf_spec_decode_num_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total",
    "paged_hf_spec_decode_num_accepted_tokens_per_pos_total": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}
_SUFFIXES = ("", "_bucket", "_sum", "_count")


def vllm_aliases(exposition: str, model_name: str) -> str:
    """The lines of `exposition` whose metric has a vLLM name, renamed and labelled with `model_name`."""
    label = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    out = []
    for line in exposition.splitlines():
        if line.startswith("# "):
            kind, name, rest = line[2:].split(" ", 2)
            if name in VLLM_NAMES:
                out.append(f"# {kind} {VLLM_NAMES[name]} {rest}")
            continue
        name, _, rest = line.partition(" ")
        name, brace, labels = name.partition("{")
        renamed = _rename(name)
        if renamed is None:
            continue
        if name.startswith("paged_hf_sequences_finished"):  # vLLM's label name
            labels = labels.replace("finish_reason=", "finished_reason=")
        labels = f"{label},{labels}" if brace else f"{label}}}"
        out.append(f"{renamed}{{{labels} {rest}")
    return "\n".join(out) + "\n" if out else ""


def _rename(name: str) -> str | None:
    for ours, theirs in VLLM_NAMES.items():
        for suffix in _SUFFIXES:
            if name == ours + suffix:
                return theirs + suffix
    return None

"""`EngineStep`: one iteration of the engine, in nano-vllm's shape.

Before it, queued requests whose adapter's folder was read get its weights (engine/adapter_store.py). Then
schedule -> run the model once on the packed row -> postprocess (hand beam rows to their searches, pool and
finish embedding requests, sample or verify drafts, append the tokens, check the stops, drop what finished).
The model runner never touches the block manager. The generator owns the parts and the per-call bookkeeping;
this module only steps them.
"""

from __future__ import annotations

import time

import torch

from paged_hf.beam.group import BeamGroup
from paged_hf.core.request import Request
from paged_hf.core.scheduler import Scheduler
from paged_hf.core.scheduler_output import SchedulerOutput
from paged_hf.engine.adapter_store import AdapterStore
from paged_hf.engine.beam_search import route_beam_rows
from paged_hf.engine.embedding import finish_pooled
from paged_hf.engine.request_group import RequestGroup
from paged_hf.engine.stopping import StopChecker
from paged_hf.outputs import FinishReason
from paged_hf.profiling import span
from paged_hf.sample.prompt_logprobs import record_prompt_logprobs
from paged_hf.sample.sampler import Sampler, SamplingRow
from paged_hf.spec_decode import Speculator
from paged_hf.worker.distributed import broadcast_tokens
from paged_hf.worker.model_runner import ModelRunner
from paged_hf.worker.step_inputs import StepInputs


class EngineStep:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, stop_checker: StopChecker,
                 speculator: Speculator | None, groups: dict[str, RequestGroup | BeamGroup],
                 max_num_batched_tokens: int, adapter_store: AdapterStore):
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.stop_checker = stop_checker
        self.speculator = speculator
        self.groups = groups  # the generator's unfinished requests by id (the same dict: a finished one is dropped)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.adapter_store = adapter_store
        self.errors: dict[str, Exception] = {}  # request id -> what failed it alone (reported with its output)

    def run(self) -> list[RequestGroup | BeamGroup]:
        """One schedule -> run -> postprocess; -> the requests that changed."""
        touched: dict[RequestGroup | BeamGroup, None] = self._bind_adapters()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._may_speculate, self.max_num_batched_tokens)
        with span("schedule"):
            out = self.scheduler.schedule()
        if not out.scheduled:
            return self._drop_finished(touched)
        logits, spec_logits, inputs = self._forward(out)
        requests = [scheduled.request for scheduled in inputs.sampled]
        requests, logits, beam_groups = route_beam_rows(self.groups, self.scheduler, requests, logits)
        touched.update(dict.fromkeys(beam_groups))  # beam searches that ended
        if inputs.pooling_spans:  # embedding requests: pooled once their prompt is computed, and finished
            touched.update(dict.fromkeys(finish_pooled(inputs, self.groups, self.scheduler, time.monotonic())))
        if requests:
            with span("sample_and_stop"):
                self._postprocess(requests, logits, spec_logits, touched)
        return self._drop_finished(touched)

    def has_work(self) -> bool:
        """Work begun in earlier steps that later steps finish (a pipeline's micro-batches in flight)."""
        return False

    def _bind_adapters(self) -> dict:
        """Queued requests whose adapter's folder was read get its weights; those whose read failed fail
        (reported with their output, as a request's own error) -> those requests."""
        failed = {}
        for request, error in self.adapter_store.poll(self.scheduler.waiting):
            self.errors[request.request_id] = error
            failed[self.groups[request.request_id]] = None
        return failed

    def _forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor | None, StepInputs]:
        """Run the model on the scheduled tokens and advance them -> (the sampled rows' logits, the drafts'
        logits or None, the step's inputs)."""
        logits, inputs = self.runner.run(out)  # [num_kept, vocab_size]
        if inputs.prompt_logprob_spans:
            record_prompt_logprobs(logits, inputs.prompt_logprob_spans)
            logits = logits[inputs.sample_rows.to(logits.device)]  # [num_sampled (+ num_spec_rows), vocab_size]
        spec_logits = None
        if inputs.num_spec_rows:  # the drafts' rows come last
            logits, spec_logits = logits[: -inputs.num_spec_rows], logits[-inputs.num_spec_rows:]
        for scheduled in out.scheduled:
            self.scheduler.advance(scheduled)
        if self.runner.kv_offload is not None:
            self.runner.kv_offload.save_computed_blocks()
        return logits, spec_logits, inputs

    def _postprocess(self, requests: list[Request], logits: torch.Tensor, spec_logits: torch.Tensor | None,
                     touched: dict) -> None:
        """Sample (or verify the drafts of) every row, append the tokens and check the stops."""
        emitted = self._sample(requests, logits, spec_logits)
        now = time.monotonic()
        for request, tokens in zip(requests, emitted):  # one token each; more where drafts were accepted
            for token_id, logprobs in tokens:
                if self._append_token(request, token_id, logprobs, now):
                    break
            else:
                if spec_logits is not None:
                    self.speculator.commit(request, len(tokens))
            touched[self.groups[request.request_id]] = None

    def _sample(self, requests: list[Request], logits: torch.Tensor, spec_logits: torch.Tensor | None) -> list:
        """-> per request, its [(token_id, logprobs)]: one pair, or more where drafts were accepted."""
        rows = self._sampling_rows(requests)
        if spec_logits is not None:
            return self.speculator.verify(self.sampler, requests, rows, logits, spec_logits)
        sampled = self.sampler(logits, rows)
        token_ids = broadcast_tokens(sampled.token_ids, logits.device)  # tensor parallel: rank 0's tokens
        return [[pair] for pair in zip(token_ids, sampled.logprobs)]

    @staticmethod
    def _sampling_rows(requests: list[Request]) -> list[SamplingRow]:
        return [SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.rng, r.grammar,
                            r.bad_words_token_ids)
                for r in requests]

    def _append_token(self, request: Request, token_id: int, logprobs, now: float) -> bool:
        """Append one generated token and check the stop conditions -> whether the request finished."""
        request.append_token(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        try:
            reason = self.stop_checker.check(request)
        except Exception as exc:  # noqa: BLE001 - this request's own (its stop strings' text): fail only it
            self.errors[request.request_id] = exc
            reason = FinishReason.ABORT
        if reason is None:
            return False
        request.finish_time = now
        self.scheduler.finish(request, reason)
        return True

    def _may_speculate(self, request: Request) -> bool:
        """Beams of a beam search choose among all their continuations: no drafts for them."""
        return isinstance(self.groups.get(request.request_id), RequestGroup)

    def _drop_finished(self, touched: dict) -> list:
        for group in touched:
            if group.finished:
                del self.groups[group.request_id]
        return list(touched)

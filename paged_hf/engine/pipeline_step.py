"""`PipelineStep`: the engine's step on a pipeline stage, with micro-batches in flight (vLLM's batch queue).

Every stage runs the same steps on the same requests (each stage's scheduler makes the same choices; the server
mirrors every request onto every stage, serving/lockstep.py). A step schedules a micro-batch and runs this
stage's layers on it; the last stage samples it and sends the result to the other stages
(worker/pipeline.py). The batch completes (tokens appended, stops checked, on every stage) only when the queue
holds `depth` batches, so while the last stage works on batch t the first already works on t + 1.

What keeps the stages exact: every stage runs the batches in the same order, so a batch always finds the K/V of
the batches before it. A request whose token is in flight has no token to compute (all its tokens are computed)
and `Request.in_flight` keeps it from starting again if it was preempted meanwhile (core/admission.py), so it is in no other batch until its
token is back; the chunks of a prompt that sample nothing go on at once. Prompt logprobs join their request when
the batch completes, on every stage alike. Each micro-batch takes at most its share of the unfinished requests,
so `depth` batches split them evenly.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from paged_hf.config import PagedConfig
from paged_hf.core.request import Request, RequestStatus
from paged_hf.engine.step import EngineStep
from paged_hf.profiling import span
from paged_hf.loader.pipeline_stage import StageLayout
from paged_hf.sample.prompt_logprobs import record_prompt_logprobs
from paged_hf.worker.model_info import ModelInfo
from paged_hf.worker.pipeline import StageLinks


@dataclass
class StepResult:
    """What the last stage sends back for one micro-batch (small: no logits)."""
    token_ids: list[int]  # one per sampled request, in the batch's order
    logprobs: list  # the sampler's, per sampled request
    prompt_logprobs: dict[str, dict[int, dict[int, float]]]  # request id -> {position: {token_id: logprob}}


@dataclass
class MicroBatch:
    sampled: list[Request]  # the requests that sample in it, in order
    result: StepResult | None = None  # the last stage's at once; the others' when the batch completes


def pipeline_config(config: PagedConfig, info: ModelInfo, stage: StageLayout) -> PagedConfig:
    """The engine config of a pipeline stage; ValueError for what a pipeline does not serve."""
    if info.is_hybrid:
        raise ValueError("a hybrid model (recurrent layers) is not served pipeline-parallel")
    if config.speculative is not None:
        raise ValueError("speculative decoding is not served pipeline-parallel: leave `speculative` unset")
    if config.kv_offloading_size or config.kv_cache_dir or config.kv_transfer_config is not None:
        raise ValueError("kv_offloading_size / kv_cache_dir / kv_transfer_config are not served pipeline-parallel "
                         "(each stage holds other layers' blocks)")
    depth = config.pipeline_batches_in_flight or stage.count
    return config.replace(pipeline_batches_in_flight=depth)


class PipelineStep(EngineStep):
    def __init__(self, *args, links: StageLinks, depth: int):
        super().__init__(*args)
        self.links = links
        self.depth = depth
        self.in_flight: deque[MicroBatch] = deque()  # launched, not completed, oldest first

    def run(self) -> list:
        """Launch a micro-batch if any request has work; complete the oldest once `depth` are in flight (or
        nothing new could start) -> the requests that changed."""
        touched = self._bind_adapters()
        with span("schedule"):
            out = self.scheduler.schedule()
        if out.scheduled:
            self.in_flight.append(self._launch(out))
        if self.in_flight and (len(self.in_flight) >= self.depth or not out.scheduled):
            with span("sample_and_stop"):
                self._complete(self.in_flight.popleft(), touched)
        return self._drop_finished(touched)

    def has_work(self) -> bool:
        return bool(self.in_flight)

    def _launch(self, out) -> MicroBatch:
        logits, inputs = self.runner.run(out)  # None on every rank but the sampling one
        for scheduled in out.scheduled:
            self.scheduler.advance(scheduled)
        batch = MicroBatch([scheduled.request for scheduled in inputs.sampled])
        for request in batch.sampled:
            request.in_flight = True
        if logits is not None:  # the sampling rank's (the others receive the result when the batch completes)
            batch.result = self._sample_result(batch.sampled, logits, inputs)
            self.links.send_result(batch.result)
        return batch

    def _sample_result(self, requests: list[Request], logits, inputs) -> StepResult:
        prompt_logprobs: dict = {}
        if inputs.prompt_logprob_spans:
            record_prompt_logprobs(logits, inputs.prompt_logprob_spans, into=prompt_logprobs)
            logits = logits[inputs.sample_rows.to(logits.device)]
        if not requests:
            return StepResult([], [], prompt_logprobs)
        sampled = self.sampler(logits, self._sampling_rows(requests))
        return StepResult(list(sampled.token_ids), list(sampled.logprobs), prompt_logprobs)

    def _complete(self, batch: MicroBatch, touched: dict) -> None:
        result = batch.result if batch.result is not None else self.links.receive_result()
        for request_id, entries in result.prompt_logprobs.items():
            group = self.groups.get(request_id)
            if group is not None:
                group.children[0].prompt_logprobs.update(entries)
        now = time.monotonic()
        for request, token_id, logprobs in zip(batch.sampled, result.token_ids, result.logprobs, strict=True):
            request.in_flight = False
            if request.status is RequestStatus.FINISHED:  # aborted while its token was computed
                continue
            self._append_token(request, token_id, logprobs, now)  # also to a request preempted meanwhile
            touched[self.groups[request.request_id]] = None

"""Engine core for embedding models: requests wait in arrival order and each step runs as many whole
inputs as fit the token budget and sequence cap through the model in one packed batch (no KV kept);
implements engine.core.engine_core.EngineCore, publishing an EngineSnapshot after each step."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from engine.core.config import EngineConfig, Task
from engine.core.errors import InvalidRequestError, WrongTaskError
from engine.core.lora import LoRAInfo
from engine.core.outputs import EmbeddingOutput
from engine.core.sampling_params import (
    SamplingParams,
    StructuredOutputs,
    check_input_length,
    check_token_ids,
)
from engine.core.snapshot import EngineSnapshot, RequestProgress, plain_snapshot
from engine.core.stats import EngineTotals, FinishedRequestStats, StepStats
from engine.embeddings.embedding_model import EmbeddingModel
from engine.executor.lora_adapters import LoRAAdapters
from engine.models.lora_apply import lora_batch
from engine.models.lora_weights import LoRAAdapter
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _EmbedRequest:
    request_id: str
    token_ids: list[int]
    arrival_time: float
    lora_id: int | None = None  # its LoRA adapter (a decoder model's; None: the base model)
    lora_name: str | None = None

    @property
    def num_new_tokens(self) -> int:  # a row run of the packed batch (engine.models.lora_apply)
        return len(self.token_ids)


class EmbeddingEngine:
    task: Task = "embed"

    def __init__(self, config: EngineConfig, model_dir: Path, model_name: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self.model_name = model_name
        mc = config.model
        self.model = EmbeddingModel.load(model_dir, mc.dtype, mc.device, mc.pooling)
        self.tokenizer = Tokenizer.from_pretrained(model_dir, mc.chat_template)
        self.vocab_size = int(self.model.hf_config.vocab_size)
        self.max_model_len = min(
            mc.max_model_len or self.model.max_model_len, self.model.max_model_len
        )
        self.waiting: deque[_EmbedRequest] = deque()  # arrival order; aborted entries are skipped
        self.live: dict[str, _EmbedRequest] = {}  # the waiting requests not aborted
        # A decoder's LoRA adapters (an encoder takes none: the registry refuses its loads).
        self.adapters = LoRAAdapters(self.model.model, config.lora, self.model.is_encoder)
        self.adapters.load_all()
        self.totals = EngineTotals()
        self.last_step: StepStats | None = None
        self.publish()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        if params is not None:
            raise InvalidRequestError(
                "this model embeds text: an embedding input takes no sampling parameters"
            )
        check_token_ids(prompt_token_ids, self.vocab_size, "input")
        check_input_length(len(prompt_token_ids), self.max_model_len, "input")
        return 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,  # an encoder caches no prefix: nothing to salt
    ) -> None:
        if request_id in self.live:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        request = _EmbedRequest(request_id, list(prompt_token_ids), arrival)
        if lora is not None:
            adapter = self.adapters.selected(lora)
            request.lora_id, request.lora_name = adapter.lora_id, lora
            self.adapters.pin_id(adapter.lora_id)
        self.waiting.append(request)
        self.live[request_id] = request

    def abort_request(self, request_id: str) -> None:
        # O(1): the step skips it when it reaches the queue's head
        request = self.live.pop(request_id, None)
        if request is not None:
            self.adapters.release_id(request.lora_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def add_score_request(
        self,
        request_id: str,
        context_token_ids: list[int],
        choices: list[list[int]],
        num_top_logprobs: int = 0,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> None:
        raise WrongTaskError(self.task, "generate")

    def compile_constraint(self, constraint: StructuredOutputs) -> None:
        raise WrongTaskError(self.task, "generate")

    # -- LoRA adapters (a decoder model's) --------------------------------------------------------
    def loras(self) -> tuple[LoRAInfo, ...]:
        return self.adapters.infos()

    def read_lora(self, name: str, path: str) -> LoRAAdapter:
        return self.adapters.read(name, path)

    def install_lora(self, adapter: LoRAAdapter) -> LoRAInfo:
        return self.adapters.install(adapter)

    def unload_lora(self, name: str) -> None:
        self.adapters.unload(name)

    def reset_prefix_cache(self) -> bool:
        """An encoder keeps no prefix cache: there is nothing to drop."""
        return True

    def publish(self, detail: bool = False) -> EngineSnapshot:
        """Build the state now and publish it: the one writer of `snapshot` (a detailed build, with
        one row per input, is returned to its caller; the published one has the counts)."""
        built = self.build_snapshot(detail)
        self.snapshot = plain_snapshot(built)
        return built

    def build_snapshot(self, detail: bool = False) -> EngineSnapshot:
        """Counts and rows of the waiting inputs (nothing stays running between steps; no KV)."""
        rows = tuple(
            RequestProgress(
                r.request_id, "waiting", 1, len(r.token_ids), 0, 0, 0, r.arrival_time, r.lora_name
            )
            for r in self.live.values()
        )
        t = self.totals
        return EngineSnapshot(
            task=self.task,
            num_steps=t.num_steps,
            time=time.monotonic(),
            num_waiting=len(rows),
            num_requests_waiting=len(rows),
            num_waiting_tokens=sum(row.num_prompt_tokens for row in rows),
            num_prompt_tokens=t.num_prompt_tokens,
            num_finished=t.num_finished,
            waiting_loras=tuple(sorted({r.lora for r in rows if r.lora is not None})),
            max_loras=self.config.lora.max_loras,
            requests=rows if detail else (),
        )

    def _schedule(self) -> list[_EmbedRequest]:
        """Whole inputs in arrival order within the token budget (the first always goes)."""
        sc = self.config.scheduler
        batch: list[_EmbedRequest] = []
        tokens = 0
        while self.waiting and len(batch) < sc.max_num_seqs:
            head = self.waiting[0]
            if self.live.get(head.request_id) is not head:
                self.waiting.popleft()  # aborted
                continue
            n = len(head.token_ids)
            if batch and tokens + n > sc.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            del self.live[head.request_id]
            tokens += n
        batch.sort(key=lambda r: -1 if r.lora_id is None else r.lora_id)  # adapter segments
        return batch

    def step(self) -> list[EmbeddingOutput]:
        t0 = time.monotonic()
        batch = self._schedule()
        if not batch:
            self.publish()
            return []
        try:
            lora = lora_batch(batch, self.adapters.by_id)
            # [batch, hidden] float32
            vectors = self.model.embed([r.token_ids for r in batch], lora)
        except Exception as e:  # fail this batch's requests, keep serving
            logger.exception("embedding step failed for %d requests", len(batch))
            for r in batch:
                self.adapters.release_id(r.lora_id)
            self.publish()
            return [
                EmbeddingOutput(r.request_id, [], len(r.token_ids), error=f"embedding failed: {e}")
                for r in batch
            ]
        for r in batch:
            self.adapters.release_id(r.lora_id)
        now = time.monotonic()
        num_tokens = sum(len(r.token_ids) for r in batch)
        stats = StepStats(
            "prefill",
            duration=now - t0,
            num_batched_tokens=num_tokens,
            num_prefill_tokens=num_tokens,
            num_waiting=len(self.live),
            num_new_prompt_tokens=num_tokens,
        )
        outputs = []
        for r, vector in zip(batch, vectors, strict=True):
            outputs.append(EmbeddingOutput(r.request_id, vector.tolist(), len(r.token_ids)))
            stats.finished.append(
                FinishedRequestStats(
                    r.request_id,
                    "stop",
                    len(r.token_ids),
                    0,
                    0,
                    r.arrival_time,
                    t0,
                    now,
                    now,
                    lora=r.lora_name,
                )
            )
        self.totals.num_steps += 1
        self.totals.num_prompt_tokens += num_tokens
        self.totals.num_finished += len(batch)
        self.last_step = stats
        self.publish()
        return outputs

"""Engine core for embedding models: requests wait in arrival order and each step runs as many whole
inputs as fit the token budget and sequence cap through the model in one packed batch (no KV kept)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.outputs import EmbeddingOutput
from engine.core.sampling_params import ContextLengthError, check_token_ids
from engine.core.stats import EngineTotals, FinishedRequestStats, StepStats
from engine.embeddings.embedding_model import EmbeddingModel
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _EmbedRequest:
    request_id: str
    token_ids: list[int]
    arrival_time: float


class EmbeddingEngine:
    task = "embed"

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
        self.waiting: deque[_EmbedRequest] = deque()
        self.totals = EngineTotals()
        self.last_step: StepStats | None = None

    def validate(self, prompt_token_ids: list[int], params: object = None) -> int:
        check_token_ids(prompt_token_ids, self.vocab_size, "input")
        if len(prompt_token_ids) > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your input has "
                f"{len(prompt_token_ids)} tokens. Shorten it or ask for truncation (truncate_prompt_tokens).",
                param="input",
            )
        return 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: object = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.validate(prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.waiting.append(_EmbedRequest(request_id, list(prompt_token_ids), arrival))

    def abort_request(self, request_id: str) -> None:
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    num_running_seqs = 0  # inputs never stay in the engine between steps

    @property
    def num_waiting_requests(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.waiting)

    def _schedule(self) -> list[_EmbedRequest]:
        """Whole inputs in arrival order within the token budget (the first always goes)."""
        sc = self.config.scheduler
        batch: list[_EmbedRequest] = []
        tokens = 0
        while self.waiting and len(batch) < sc.max_num_seqs:
            n = len(self.waiting[0].token_ids)
            if batch and tokens + n > sc.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    def step(self) -> list[EmbeddingOutput]:
        t0 = time.monotonic()
        batch = self._schedule()
        if not batch:
            return []
        try:
            vectors = self.model.embed([r.token_ids for r in batch])  # [batch, hidden] float32
        except Exception as e:  # fail this batch's requests, keep serving
            logger.exception("embedding step failed for %d requests", len(batch))
            return [
                EmbeddingOutput(r.request_id, [], len(r.token_ids), error=f"embedding failed: {e}")
                for r in batch
            ]
        now = time.monotonic()
        num_tokens = sum(len(r.token_ids) for r in batch)
        stats = StepStats(
            "prefill",
            duration=now - t0,
            num_batched_tokens=num_tokens,
            num_prefill_tokens=num_tokens,
            num_waiting=len(self.waiting),
            num_new_prompt_tokens=num_tokens,
        )
        outputs = []
        for r, vector in zip(batch, vectors, strict=True):
            outputs.append(EmbeddingOutput(r.request_id, vector.tolist(), len(r.token_ids)))
            stats.finished.append(
                FinishedRequestStats(
                    r.request_id, "stop", len(r.token_ids), 0, 0, r.arrival_time, t0, now, now
                )
            )
        self.totals.num_steps += 1
        self.totals.num_prompt_tokens += num_tokens
        self.totals.num_finished += len(batch)
        self.last_step = stats
        return outputs

"""The synchronous engine core: add requests, then step() = schedule -> run -> update -> detokenize ->
outputs -> publish an EngineSnapshot. Owns the scheduler, the KV cache manager, the model runner and the
tokenizer; implements engine.core.engine_core.EngineCore."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections import deque
from pathlib import Path

import torch

from engine.core.block_hashes import DEFAULT_SEED
from engine.core.cache_namespace import cache_namespace, check_cache_salt
from engine.core.config import EngineConfig, Task, served_model_name
from engine.core.errors import ContextLengthError, InvalidRequestError, StartupError
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_offload import KVTiers
from engine.core.lora import LoRAInfo
from engine.core.outputs import RequestOutput
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.sampling_params import (
    SamplingParams,
    StructuredOutputs,
    check_token_ids,
    resolve_max_tokens,
)
from engine.core.scheduler import Scheduler
from engine.core.sequence_update import SequenceUpdater, finished_stats
from engine.core.snapshot import (
    BlockHolders,
    EngineSnapshot,
    RequestProgress,
    RequestState,
    SnapshotDetail,
    StepRecord,
    plain_snapshot,
)
from engine.core.spec_config import DRAFT_METHODS
from engine.core.speculator import Speculator
from engine.core.stats import EngineTotals, FinishedRequestStats, StepStats
from engine.core.step_budget import StepBudget, StepLoad, resolve_target_step_ms
from engine.executor.draft_model import build_drafter
from engine.executor.kv_store import TieredKVStore, model_fingerprint, open_kv_store
from engine.executor.lora_adapters import LoRAAdapters
from engine.executor.model_runner import ModelRunner, model_kv_spec, prepare_model
from engine.executor.sampler import make_generator
from engine.faults import FaultInjectingRunner, fault_injection_enabled
from engine.kernels.attention import attention_backend
from engine.kernels.kv_dtype import dtype_name, resolve_kv_cache_dtype
from engine.kv_event_publisher import KVEventStream
from engine.models.loader import load_model, resolve_model
from engine.models.lora_weights import LoRAAdapter
from engine.models.quantization import served_formats
from engine.output_processor import OutputProcessor
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.structured import GrammarCompiler
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_GiB = 1 << 30
RECENT_STEPS = 240  # steps the detailed snapshot's timeline keeps


class LLMEngine:
    task: Task = "generate"

    def __init__(
        self, config: EngineConfig, model_dir: Path | None = None, model_name: str | None = None
    ) -> None:
        self.config = config
        mc = config.model
        self.model_dir = model_dir or resolve_model(mc.model, mc.cache_dir)
        self.model_name = model_name or served_model_name(mc.model)
        torch.manual_seed(mc.seed)
        loaded = load_model(self.model_dir, mc.dtype, mc.device, mc.quantization)
        self.model = loaded.model
        quantization = loaded.weight_format.quantization if loaded.weight_format else None
        # Threads, quantization and compilation.
        prepare_model(self.model, mc, quantization, loaded.gguf_file)
        self.device = loaded.device
        self.dtype = loaded.dtype
        try:
            backend = attention_backend(self.device.type, self.dtype, config.cache.block_size)
            self.kv_dtype = resolve_kv_cache_dtype(
                config.cache.kv_cache_dtype, self.device, self.dtype, quantization, backend
            )
        except ValueError as e:
            raise StartupError(f"KV cache: {e}") from e
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir, mc.chat_template)
        self.eos_token_ids = frozenset(loaded.eos_token_ids) | self.tokenizer.eos_token_ids
        self.vocab_size: int = self.model.vocab_size
        self.max_model_len = min(mc.max_model_len or loaded.max_model_len, loaded.max_model_len)
        if mc.max_model_len and mc.max_model_len > loaded.max_model_len:
            logger.warning(
                "max_model_len %d exceeds the model's %d; using %d",
                mc.max_model_len,
                loaded.max_model_len,
                loaded.max_model_len,
            )
        self.model.limit_context(self.max_model_len)

        block_size = config.cache.block_size
        self.kv_spec = model_kv_spec(self.model, self.max_model_len)
        num_blocks = self._num_kv_blocks(block_size)
        self.kv = KVCacheManager(
            num_blocks, block_size, config.cache.enable_prefix_caching, self.kv_spec.windows
        )
        events = config.kv_events_config
        self.kv_events: KVEventStream | None = None
        if events is not None and events.enabled:  # like vLLM, its hashes follow PYTHONHASHSEED
            seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED
            self.kv_events = KVEventStream.start(events, self.kv, seed)
        spec = config.speculative_config
        drafter = None
        if spec is not None and spec.method in DRAFT_METHODS:
            drafter = build_drafter(
                spec, self.model, self.device, self.dtype, self.tokenizer, mc, num_blocks,
                block_size, self.max_model_len, config.scheduler.max_num_batched_tokens,
                self.kv, lambda: self.runner.kv_caches, config.cache.kv_cache_dtype, self.kv_dtype,
            )  # fmt: skip
        speculator = Speculator(spec, self.max_model_len, drafter) if spec is not None else None
        updater = SequenceUpdater(self.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(
            config.scheduler, self.kv, speculator, updater, config.lora.max_loras
        )
        self.target_step_ms = resolve_target_step_ms(
            config.scheduler.target_step_ms, self.device.type == "cpu", quantization is not None
        )
        if self.target_step_ms > 0:  # CPU only (GPUs: the fixed budget)
            self.scheduler.step_budget = StepBudget(
                self.target_step_ms / 1000, config.scheduler.max_num_batched_tokens
            )
        self.output_processor = OutputProcessor()
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.vocab_size, self.eos_token_ids)
        # Test-only fault hooks are a runner subclass chosen here, never a check inside a step.
        runner_class = FaultInjectingRunner if fault_injection_enabled() else ModelRunner
        self.runner = runner_class(
            self.model, self.device, self.dtype, num_blocks, block_size,
            cuda_graphs=mc.cuda_graphs, max_graph_batch=config.scheduler.max_num_seqs,
            grammars=self.grammars, kv_spec=self.kv_spec, kv_dtype=self.kv_dtype,
        )  # fmt: skip
        self.adapters = LoRAAdapters(self.model, config.lora)
        self.adapters.load_all()  # a bad start-up adapter raises LoRAError here
        self.runner.loras = self.adapters.by_id
        if self.kv_events is not None:  # BlockStored names the adapter of a namespaced chain
            self.kv_events.recorder.lora_names = self.adapters.namespace_names
        self._open_kv_tiers(quantization)
        self.groups: dict[str, RequestGroup] = {}
        self.totals = EngineTotals()
        # Requests aborted since the last step: their records ride on the next step's stats.finished
        # (so the metrics count finish_reason "abort"; with no step after them, at the next one).
        self._aborted: list[FinishedRequestStats] = []
        self.last_step: StepStats | None = None
        self.recent_steps: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self.publish()
        logger.info(
            "engine ready: model=%s dtype=%s device=%s max_model_len=%d kv_blocks=%d x %d tokens "
            "(%s, %.0f MiB), step budget: %s",
            self.model_dir.name,
            self.dtype,
            self.device,
            self.max_model_len,
            num_blocks,
            block_size,
            dtype_name(self.kv_dtype),
            num_blocks
            * ModelRunner.kv_bytes_per_block(self.model, block_size, self.kv_dtype, self.kv_spec)
            / (1 << 20),
            f"{self.target_step_ms:g} ms a step while streams decode"
            if self.target_step_ms > 0
            else f"{config.scheduler.max_num_batched_tokens} tokens a step",
        )

    def _open_kv_tiers(self, weight_format: str | None) -> None:
        """The KV offload tiers, when configured: the pool's evictions feed them, lookups read them."""
        cache, bs, m = self.config.cache, self.config.cache.block_size, self.model
        self.kv_store: TieredKVStore | None = None
        if not (cache.kv_offload_memory or cache.kv_offload_dir):
            return
        if weight_format is not None:  # which block format serves each weight (K-quants: as stored)
            weight_format = f"{weight_format}:{served_formats(m)}"
        fingerprint = model_fingerprint(
            self.model_dir,
            weight_format,
            self.kv_dtype,
            bs,
            self.kv_spec,
            m.num_kv_heads,
            m.head_dim,
        )
        shape = (m.num_kv_heads, m.head_dim)
        store = open_kv_store(
            cache, fingerprint, self.kv_spec, bs, shape, self.kv_dtype, self.device
        )
        self.kv_store = store
        if store is not None:
            self.kv.tiers = KVTiers(store, bs)
            self.kv.pool.on_evict = self.kv.tiers.on_evict
            self.runner.attach_kv_store(store)
            if self.kv_events is not None:  # tier blocks publish events with their medium
                store.record_events()
                self.kv_events.tiers = store

    def _num_kv_blocks(self, block_size: int) -> int:
        cc = self.config.cache
        if cc.num_blocks is not None:
            return cc.num_blocks
        per_block = ModelRunner.kv_bytes_per_block(
            self.model, block_size, self.kv_dtype, self.kv_spec
        )
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8)
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            # ~46k bf16 tokens of SmolLM2: more than a CPU can keep busy.
            budget = min(_GiB, total // 16)
        num_blocks = max(2, budget // per_block)
        # No point holding more than every running sequence at full length, in every group.
        per_seq = len(self.kv_spec.groups) * -(-self.max_model_len // block_size)
        cap = self.config.scheduler.max_num_seqs * per_seq + 1
        return int(min(num_blocks, max(cap, 2)))

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int:
        """Check a request against this model; returns the resolved max output tokens."""
        if params is None:
            raise InvalidRequestError(
                "this model generates text: a generation request needs sampling parameters"
            )
        check_token_ids(prompt_token_ids, self.vocab_size, "prompt")
        params.validate_for_vocab(self.vocab_size)
        num_prompt = len(prompt_token_ids)
        max_tokens = resolve_max_tokens(num_prompt, params.max_tokens, self.max_model_len)
        self._check_fits_pool(num_prompt + max_tokens, "prompt")
        return max_tokens

    def _check_fits_pool(self, num_tokens: int, param: str) -> None:
        """The one check only the engine can make: a request's whole length fits the KV cache pool."""
        chunk = self.config.scheduler.max_num_batched_tokens
        needed = self.kv.max_blocks_held(num_tokens, chunk)  # a sliding window holds less
        if needed > self.kv.num_blocks:
            raise ContextLengthError(
                f"This request needs {needed} KV cache blocks ({num_tokens} tokens) but the pool "
                f"holds only {self.kv.num_blocks}",
                param,
                limit=self.kv.num_blocks * self.kv.block_size,
                needed=num_tokens,
                kv_pool=True,
            )

    def compile_constraint(self, constraint: StructuredOutputs) -> None:
        """Compile (and cache) a constraint; blocking, so the async engine calls it off the step
        thread. Raises SamplingParamsError when it does not compile."""
        self.grammars.compile(constraint)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """`arrival_time` (time.monotonic()) is when the caller received the request, if earlier;
        `lora` names the LoRA adapter it runs on (None: the base model); `cache_salt` (vLLM's
        field) roots its prefix-cache chain apart, shared only with requests of the same salt."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        assert params is not None  # validate() refuses a generation request without params
        sample_params = params
        if params.num_samples > params.n and params.logprobs is None:
            # best_of ranks samples by cumulative logprob, so the sampler must report them.
            sample_params = dataclasses.replace(params, logprobs=0)
        group = RequestGroup(
            request_id,
            prompt,
            list(prompt_token_ids),
            sample_params,
            max_tokens,
            user_params=params,
        )
        self.adapters.select(group, lora)
        if cache_salt is not None:
            check_cache_salt(cache_salt)
            group.cache_namespace = cache_namespace(group.cache_namespace, cache_salt)
        if arrival_time is not None:
            group.metrics.arrival_time = arrival_time
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        for i in range(params.num_samples):
            seq = Sequence(
                f"{request_id}/{i}", group, i, list(prompt_token_ids), len(prompt_token_ids)
            )
            if params.seed is not None:
                seq.generator = make_generator(sample_seed(params.seed, i), self.device)
            if params.structured_outputs is not None:  # compiled once, then copied per sample
                seq.matcher = self.grammars.new_matcher(params.structured_outputs)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
                params.reasoning,
            )
            group.seqs.append(seq)
        self._add_group(group)

    def _add_group(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        self.adapters.pin(group)
        self.scheduler.add_group(group)

    def validate_score(self, context_token_ids: list[int], choices: list[list[int]]) -> None:
        """Check a score request against this model: a context, 1+ non-empty choices, and the context
        plus the longest choice within the model length and the KV pool."""
        check_token_ids(context_token_ids, self.vocab_size, "prompt")
        if not choices:
            raise InvalidRequestError("choices is empty: give at least one choice", "choices")
        for i, choice in enumerate(choices):
            if not choice:
                raise InvalidRequestError(
                    f"choices[{i}] is empty: give at least one token", "choices"
                )
            check_token_ids(choice, self.vocab_size, "choices")
        longest = max(len(c) for c in choices)
        total = len(context_token_ids) + longest
        if total > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                f"context ({len(context_token_ids)} tokens) plus the longest choice ({longest} tokens) "
                f"is {total} tokens. Please shorten the context or the choices.",
                param="choices",
                limit=self.max_model_len,
                needed=total,
            )
        self._check_fits_pool(total, "choices")

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
        """Score each choice as the continuation of the context: one prompt-only sequence per choice
        (context + choice) with prompt logprobs over the choice, nothing sampled. Choice 0 leads and
        prefills the context; the others start from its context blocks, shared by reference. The
        finished output has one CompletionOutput per choice (token ids and their logprobs; the top
        `num_top_logprobs` of each position too)."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate_score(context_token_ids, choices)
        group = RequestGroup.for_scoring(
            request_id, context_token_ids, choices, num_top_logprobs, prompt
        )
        self.adapters.select(group, lora)
        if arrival_time is not None:
            group.metrics.arrival_time = arrival_time
        self._add_group(group)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.adapters.release(group)
        self._aborted.append(finished_stats(group, time.monotonic()))

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- LoRA adapters ---------------------------------------------------------------------------
    def loras(self) -> tuple[LoRAInfo, ...]:
        return self.adapters.infos()

    def read_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter for this model (blocking, safe off the step thread)."""
        return self.adapters.read(name, path)

    def install_lora(self, adapter: LoRAAdapter) -> LoRAInfo:
        """Serve a read adapter; call between steps."""
        return self.adapters.install(adapter)

    def load_lora(self, name: str, path: str) -> LoRAInfo:
        return self.install_lora(self.read_lora(name, path))

    def unload_lora(self, name: str) -> None:
        """Stop serving `name` (LoRANotFoundError if it is not); its running requests finish on it."""
        self.adapters.unload(name)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.publish()
            return []
        try:
            result = self.runner.execute(sched, self.eos_token_ids)
        except Exception as e:  # a failure of the whole batch: fail these requests, keep the engine
            logger.exception(
                "model step failed; failing the %d scheduled sequences", len(sched.scheduled)
            )
            result = RunnerOutput(
                errors={s.seq.seq_id: f"model execution failed: {e}" for s in sched.scheduled}
            )
        update = self.scheduler.update_from_output(sched, result)
        outputs = []
        for g in update.groups:
            out = self.output_processor.make_output(g)
            if out is not None:
                outputs.append(out)
                if out.finished:  # a finished group always has its final output
                    if self.groups.pop(g.request_id, None) is not None:
                        self.adapters.release(g)

        stats = update.stats  # the scheduler's own report of the step; its duration is timed here
        if self._aborted:
            stats.finished[:0], self._aborted = self._aborted, []
        stats.duration = time.monotonic() - t0
        self.scheduler.observe_step(sched, stats.duration)  # speculation's cost model learns too
        if self.scheduler.step_budget is not None:  # the step-time budget learns from each step
            load = StepLoad.of((s.num_new_tokens, s.start_pos) for s in sched.scheduled)
            self.scheduler.step_budget.observe(load, stats.duration)
        # Blocks a sample held through this step (shared ones count for each).
        for s in sched.scheduled:
            s.seq.group.metrics.kv_block_seconds += s.num_held_blocks * stats.duration
        self._accumulate(stats)
        if self.kv_events is not None:
            self.kv_events.flush()
        self.publish()
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (KV events: AllBlocksCleared); False while requests hold
        blocks. Call it between steps."""
        done = self.kv.pool.reset_cache()
        if done and self.kv_events is not None:
            self.kv_events.flush()
        return done

    def close(self) -> None:
        """Stop what runs beside the steps (the KV events publisher); the engine steps no more."""
        if self.kv_events is not None:
            self.kv_events.close()

    def publish(self, detail: bool = False) -> EngineSnapshot:
        """Build the state now and publish it: the one writer of `snapshot` (one store, so readers
        on other threads see the old or the new whole). A detailed build is returned to its caller;
        the published one keeps its counts and time, without the rows and the detail."""
        built = self.build_snapshot(detail)
        self.snapshot = plain_snapshot(built)
        return built

    def build_snapshot(self, detail: bool = False) -> EngineSnapshot:
        """The state now, for readers on other threads; call it only where steps run (or between them).
        Every step publishes one, so its cost is per running sequence, not per request field: one
        progress row per request (`requests`) comes with `detail` only, as the KV block holders do."""
        running_groups = {
            seq.group.request_id for seq in self.scheduler.running
        } & self.groups.keys()
        running, waiting = len(running_groups), len(self.groups) - len(running_groups)
        running_loras: set[str] = set()
        waiting_loras: set[str] = set()
        if self.adapters.by_id:  # only requests on an adapter name one
            for group in self.groups.values():
                if group.lora_name is not None:
                    is_running = group.request_id in running_groups
                    (running_loras if is_running else waiting_loras).add(group.lora_name)
        rows = self._request_rows(running_groups) if detail else ()
        t, kv = self.totals, self.kv
        return EngineSnapshot(
            task=self.task,
            num_steps=t.num_steps,
            time=time.monotonic(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_requests_running=running,
            num_requests_waiting=waiting,
            num_waiting_tokens=self.scheduler.num_waiting_tokens,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            num_prompt_tokens=t.num_prompt_tokens,
            num_generation_tokens=t.num_generation_tokens,
            num_preemptions=t.num_preemptions,
            prefix_cache_queries=t.prefix_cache_queries,
            prefix_cache_hits=t.prefix_cache_hits,
            num_finished=t.num_finished,
            spec_num_drafts=t.spec_num_drafts,
            spec_num_draft_tokens=t.spec_num_draft_tokens,
            spec_num_accepted_tokens=t.spec_num_accepted_tokens,
            kv_offload=copy.copy(self.kv_store.stats) if self.kv_store is not None else None,
            running_loras=tuple(sorted(running_loras)),
            waiting_loras=tuple(sorted(waiting_loras - running_loras)),
            max_loras=self.config.lora.max_loras,
            requests=rows,
            detail=self._snapshot_detail() if detail else None,
            kv_events=self.kv_events.publisher.state() if self.kv_events is not None else None,
        )

    def _request_rows(self, running_groups: set[str]) -> tuple[RequestProgress, ...]:
        rows: list[RequestProgress] = []
        for group in self.groups.values():
            state: RequestState = "waiting"
            if group.request_id in running_groups:
                state = "running"
            elif any(seq.status is SequenceStatus.PREEMPTED for seq in group.seqs):
                state = "preempted"
            lead = group.seqs[0]
            rows.append(
                RequestProgress(
                    group.request_id,
                    state,
                    len(group.seqs),
                    lead.num_prompt_tokens,
                    lead.num_computed_tokens,
                    lead.num_cached_tokens,
                    lead.num_output_tokens,
                    group.metrics.arrival_time,
                    group.lora_name,
                )
            )
        return tuple(rows)

    def _snapshot_detail(self) -> SnapshotDetail:
        pool = self.kv.pool.view  # read-only: the snapshot never touches the pool's structures
        blocks = tuple(
            BlockHolders(block_id, pool.ref_count(block_id), tuple(seq_ids))
            for block_id, seq_ids in sorted(self.kv.block_holders().items())
        )
        cached_free = pool.cached_free_blocks()
        sc = self.config.scheduler
        return SnapshotDetail(
            blocks,
            len(cached_free),
            cached_free,
            tuple(self.recent_steps),
            self.kv.block_size,
            sc.max_num_batched_tokens,
            sc.max_num_seqs,
        )

    def _accumulate(self, stats: StepStats) -> None:
        t = self.totals
        t.num_steps += 1
        t.num_prompt_tokens += stats.num_new_prompt_tokens
        t.num_generation_tokens += stats.num_generation_tokens
        t.num_preemptions += stats.num_preemptions
        t.prefix_cache_queries += stats.prefix_cache_queries
        t.prefix_cache_hits += stats.prefix_cache_hits
        t.num_finished += len(stats.finished)
        t.spec_num_drafts += stats.spec_num_drafts
        t.spec_num_draft_tokens += stats.spec_num_draft_tokens
        t.spec_num_accepted_tokens += stats.spec_num_accepted_tokens
        self.last_step = stats
        self.recent_steps.append(
            StepRecord(
                t.num_steps,
                time.monotonic(),
                stats.duration,
                stats.num_prefill_tokens,
                stats.num_decode_tokens,
                stats.num_preemptions,
                stats.num_running,
                stats.num_waiting,
                stats.spec_num_draft_tokens,
                stats.spec_num_accepted_tokens,
            )
        )


def sample_seed(seed: int, index: int) -> int:
    """Sample 0 uses the request's seed; the others get well-mixed seeds derived from it, so
    requests with neighbouring seeds do not share samples."""
    if index == 0:
        return seed
    mixed = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 64)
    return mixed ^ (mixed >> 31)

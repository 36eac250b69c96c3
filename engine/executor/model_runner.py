"""The only bridge from scheduled sequences (lists of ints) to tensors: builds the step's inputs and
attention metadata, runs the model forward over the paged KV cache, and samples."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine.core.config import ModelConfig
from engine.core.kv_cache_groups import KVCacheSpec, kv_cache_spec
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.executor.cuda_graphs import CudaGraphRunner
from engine.executor.input_batch import InputBatch
from engine.executor.kv_store import TieredKVStore
from engine.executor.kv_transfer import KVTransferRunner
from engine.executor.sampler import RowError, Sampler, SamplingRow, compute_prompt_logprobs
from engine.executor.spec_verify import (
    GeneratorRewind,
    grammar_cut_masks,
    num_accepted,
    verification_rows,
)
from engine.kernels.attention import (
    allocate_kv_cache,
    attention_backend,
    triton_importable,
)
from engine.models.lora_apply import lora_batch
from engine.models.lora_weights import LoRAAdapter
from engine.models.quantization import quantize_model
from engine.text.structured import GrammarCompiler, bitmask_words

logger = logging.getLogger(__name__)


def prepare_model(
    model: torch.nn.Module,
    config: ModelConfig,
    quantization: str | None = None,
    gguf_file: Path | None = None,
) -> None:
    """Apply the model options that change how the loaded model runs: threads, weight
    quantization (the format load_model chose: None, int8, int4 or gguf, whose blocks come from
    `gguf_file`), torch.compile of the dense layer parts."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cpus and config.num_threads > cpus:
            logger.warning(
                "%d threads on the %d CPU(s) this process may run on: threads wait for each other's "
                "turn on a core (decoding measured 1.5x slower with 2 threads on 1 CPU); "
                "use --threads %d",
                config.num_threads,
                cpus,
                cpus,
            )
    quantize_model(model, quantization, gguf_file)
    if config.compile:
        compile_dense = getattr(model, "compile_dense", None)
        if compile_dense is None:
            raise ValueError(f"--compile is not supported for {type(model).__name__}")
        compile_dense()  # compiled lazily by the first steps of each shape kind


def model_kv_spec(model: Any, max_model_len: int | None = None) -> KVCacheSpec:
    """The model's KV cache groups, from its per-layer sliding windows (`layer_windows`)."""
    windows: list[int | None] = getattr(model, "layer_windows", None) or [None] * model.num_layers
    return kv_cache_spec(list(windows), max_model_len)


class ModelRunner:
    def __init__(
        self,
        model: Any,  # a model of engine.models (num_layers, num_kv_heads, head_dim, ...)
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        cuda_graphs: bool = False,
        max_graph_batch: int = 64,
        grammars: GrammarCompiler | None = None,
        kv_spec: KVCacheSpec | None = None,
        # The KV cache's element type (engine.kernels.kv_dtype); None: dtype.
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.kv_spec = kv_spec or model_kv_spec(model)
        multi_group = len(self.kv_spec.groups) > 1
        self.grammars = grammars  # fills the allowed-token bitmask of constrained rows
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # The eager backend is chosen (and logged) once, at start-up.
        attention_backend(device.type, dtype, block_size)
        use_graphs = cuda_graphs and device.type == "cuda"
        if use_graphs and not triton_importable():
            logger.warning("CUDA graphs need the triton package (decode kernel); running eagerly")
            use_graphs = False
        if use_graphs and multi_group:
            logger.warning("CUDA graphs take one KV cache group; this model has several: eager")
            use_graphs = False
        if use_graphs and not getattr(model, "supports_cuda_graphs", True):
            logger.info("%s runs decode steps eagerly (no CUDA graphs)", type(model).__name__)
            use_graphs = False
        # With CUDA graphs, one extra block (never handed out by the cache manager) takes the
        # K/V that padding rows write. The groups share the group_size cache tensors: layer i
        # reads and writes tensor j of its group (engine.core.kv_cache_groups).
        tensors = allocate_kv_cache(
            self.kv_spec.group_size,
            num_blocks + int(use_graphs),
            block_size,
            model.num_kv_heads,
            model.head_dim,
            self.kv_dtype,
            device,
        )
        self.kv_tensors = tensors
        slots = self.kv_spec.layer_slots()
        self.kv_caches = [tensors[j] for _, j in slots]  # per model layer
        self.kv_transfer: KVTransferRunner | None = None  # KV offload tiers (attach_kv_store)
        self.sampler = Sampler()
        # LoRA adapters by id (the engine's LoRAAdapters.by_id): rows of requests on one get its deltas.
        self.loras: Mapping[int, LoRAAdapter] = {}
        layer_groups = [g for g, _ in slots] if multi_group else None
        self.input_batch = InputBatch(block_size, device, layer_groups=layer_groups)
        self.cuda_graphs: CudaGraphRunner | None = None
        if use_graphs:
            max_blocks = -(-model.max_position_embeddings // block_size)
            self.cuda_graphs = CudaGraphRunner(
                model, self.kv_caches, block_size, max_blocks, max_graph_batch, num_blocks
            )
            self.cuda_graphs.capture_all()  # at start-up, not while serving

    @staticmethod
    def kv_bytes_per_block(
        model: Any, block_size: int, dtype: torch.dtype, kv_spec: KVCacheSpec | None = None
    ) -> int:
        """Bytes one block id stands for: its slot in each of the group_size cache tensors."""
        layers = (kv_spec or model_kv_spec(model)).group_size
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * block_size * model.num_kv_heads * model.head_dim * element

    def attach_kv_store(self, store: TieredKVStore) -> None:
        """Copy evicted blocks to `store` and load tier hits from it, before each forward."""
        self.kv_transfer = KVTransferRunner(store, self.kv_tensors, self.kv_spec, self.device)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, eos_token_ids: frozenset[int]) -> RunnerOutput:
        if sched.kv_transfers is not None and self.kv_transfer is not None:
            self.kv_transfer.run(sched.kv_transfers)
        scheduled = sched.scheduled
        ids, pos, meta = self.input_batch.prepare(scheduled)
        lora = lora_batch(scheduled, self.loras)  # the step's adapter segments, or None
        if lora is not None:
            hidden = self.model(ids, pos, self.kv_caches, meta, lora=lora)
        elif self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(ids, pos, meta)  # [num_seqs, hidden]
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)  # [num_tokens, hidden]
        out = RunnerOutput()

        # Rows whose logits we need: prompt-logprob rows of a chunk, then the chunk's last token to
        # sample (a verified sequence: its last token and each draft, 1 + k rows).
        sample_idx: list[int] = []
        sample_seqs: list[ScheduledSeq] = []  # per sampled row
        offset = 0
        for s in scheduled:
            if s.prompt_logprobs_rows:
                first = offset + s.prompt_logprobs_offset
                self._prompt_logprobs(s, hidden[first : first + s.prompt_logprobs_rows], out)
            if s.needs_sample:
                last = offset + s.num_new_tokens - 1
                for j in range(len(s.draft_token_ids), -1, -1):
                    sample_idx.append(last - j)
                    sample_seqs.append(s)
            offset += s.num_new_tokens
        if not sample_seqs:
            return out

        if len(sample_idx) < hidden.shape[0]:  # a pure decode step samples every row as it is
            hidden = hidden[torch.tensor(sample_idx, device=self.device)]
        logits = self.model.compute_logits(hidden)  # [n, vocab]
        rows: list[SamplingRow] = []
        for i, s in enumerate(sample_seqs):
            if i and sample_seqs[i - 1] is s:
                continue  # a verified sequence's rows are built together
            base = self.input_batch.sampling_row(s.seq, eos_token_ids)
            rows += verification_rows(base, s.draft_token_ids) if s.draft_token_ids else [base]
        self._sample(logits, rows, sample_seqs, out)
        return out

    def _token_bitmask(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """[rows, words] int32 allowed-token bits (-1 = all allowed) when any row is constrained.

        A matcher in an error state gets no mask: the output processor fails its request alone.
        A verified sequence's rows get the masks after each of its drafts (grammar_cut_masks)."""
        constrained = []
        verified = []
        for row, s in enumerate(seqs):
            matcher = s.seq.matcher
            if matcher is None or matcher.is_error():
                continue
            if not s.draft_token_ids:
                constrained.append((matcher, row))
            elif row == 0 or seqs[row - 1] is not s:
                verified.append((s, row))
        if not constrained and not verified:
            return None
        assert self.grammars is not None, "a constrained sequence needs the grammar compiler"
        words = bitmask_words(self.model.vocab_size)
        bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32)
        if constrained:
            self.grammars.fill_bitmask(constrained, bitmask)
        for s, row in verified:
            grammar_cut_masks(self.grammars, s.seq.matcher, s.draft_token_ids, bitmask, row)
        return bitmask

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        seqs: list[ScheduledSeq],
        out: RunnerOutput,
    ) -> None:
        """Sample all rows; a row that fails (say non-finite logits, a broken grammar matcher) fails
        its sequence alone. Constrained rows get their grammar's allowed-token bitmask."""
        bitmask = self._token_bitmask(seqs)
        keep = [i for i in range(len(rows)) if seqs[i].seq.seq_id not in out.errors]
        if bitmask is not None:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        rewind = GeneratorRewind()
        for i in keep:
            if seqs[i].draft_token_ids and (i == 0 or seqs[i - 1] is not seqs[i]):
                rewind.save(i, rows[i])
        while keep:
            subset = len(keep) < len(rows)
            try:
                result = self.sampler(
                    logits[keep] if subset else logits,
                    [rows[i] for i in keep],
                    None if bitmask is None else (bitmask[keep] if subset else bitmask),
                )
            except RowError as e:  # the whole sequence fails, all its rows
                bad = seqs[keep[e.row_index]]
                out.errors[bad.seq.seq_id] = str(e)
                keep = [i for i in keep if seqs[i] is not bad]
                continue
            j = 0
            while j < len(keep):
                s = seqs[keep[j]]
                n = 1 + len(s.draft_token_ids)  # rows of this sequence
                tokens, lps = result.token_ids[j : j + n], result.logprobs[j : j + n]
                accepted = 0
                if s.draft_token_ids:
                    accepted = num_accepted(tokens, s.draft_token_ids)
                    out.num_accepted[s.seq.seq_id] = accepted
                    rewind.rewind(keep[j], accepted + 1, logits.shape[1], logits.device)
                    if lps[0] is not None:
                        out.draft_logprobs[s.seq.seq_id] = [lp for lp in lps[:accepted] if lp]
                out.sampled[s.seq.seq_id] = tokens[accepted]
                lp = lps[accepted]
                if lp is not None:
                    out.logprobs[s.seq.seq_id] = lp
                j += n
            return

    def _prompt_logprobs(self, s: ScheduledSeq, hidden: torch.Tensor, out: RunnerOutput) -> None:
        start = s.start_pos + s.prompt_logprobs_offset
        n = hidden.shape[0]
        targets = torch.tensor(
            s.seq.token_ids[start + 1 : start + 1 + n], dtype=torch.int64, device=self.device
        )
        logits = self.model.compute_logits(hidden)  # [n, vocab]
        num_top = s.seq.params.prompt_logprobs or 0
        out.prompt_logprobs[s.seq.seq_id] = (
            start + 1,
            compute_prompt_logprobs(logits, targets, num_top),
        )

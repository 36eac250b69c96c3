"""Draft-model proposer: a smaller model with the target's tokenizer (`draft_model`), or the target's
own first layers (`layer_skip`), proposing greedily over its own paged KV cache in the same engine.

Each target sequence has a shadow sequence here: the tokens whose KV the draft holds. Before a step,
every decoding sequence that wants drafts is brought up to date in one batched forward (the tokens
the draft has not seen: the prompt in chunks the first time, later the accepted tokens and the bonus
token; the KV of rejected drafts is rolled back by keeping only the prefix the shadow shares with
the sequence), which gives each its first draft; then one batched decode forward per further draft.
The draft's blocks are allocated from its own pool and freed with the target's sequence (finish,
abort or preemption). Verification decides what is emitted, so the draft's choice only changes the
speed, never the answer.

The layer-skip draft instead reads and writes the target's own KV of its layers (SharedKVDrafter):
for every token the target has computed, that KV is what the draft would compute (the same layers
over the same tokens), so the draft has no prefill, no pool and no rollback of its own. It computes
only the sequence's last token and its drafts 1..k-1, in slots of the target's blocks past the
computed tokens, which the target's own forward rewrites before anything reads them."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.core.errors import StartupError
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Sequence, SequenceStatus
from engine.core.scheduler import ScheduledSeq
from engine.core.spec_config import SpeculativeConfig
from engine.executor.input_batch import InputBatch
from engine.executor.model_runner import ModelRunner, model_kv_spec
from engine.kernels.attention import attention_backend
from engine.kernels.kv_dtype import resolve_kv_cache_dtype

logger = logging.getLogger(__name__)


def first_layers(model: Any, num_layers: int) -> Any:
    """A view of `model` that runs its first `num_layers` decoder layers, then its final norm and
    LM head (layer skip); it shares every weight with the model."""
    if not 1 <= num_layers < model.num_layers:
        raise ValueError(
            f"speculative config: num_draft_layers must be in [1, {model.num_layers - 1}] for this "
            f"{model.num_layers}-layer model, got {num_layers}"
        )
    view = copy.copy(model)  # shares parameters and buffers; the module tables are copied below
    view.__dict__["_modules"] = dict(model._modules)
    view._modules["layers"] = torch.nn.ModuleList(list(model.layers)[:num_layers])
    view.num_layers = num_layers
    view.layer_windows = list(model.layer_windows)[:num_layers]
    view._decode_args = None
    view._plan = None
    return view


def check_same_vocab(target: Any, draft: Any) -> None:
    """The draft's tokenizer must be the target's: the same tokens for the same ids."""
    ours, theirs = target.hf.get_vocab(), draft.hf.get_vocab()
    if ours != theirs:
        only = len(set(theirs.items()) - set(ours.items()))
        raise StartupError(
            f"speculative config: the draft model's tokenizer differs from the target's "
            f"({len(theirs)} vs {len(ours)} tokens, {only} ids map differently); a draft model "
            f"must share the target's tokenizer"
        )


def check_embedding_rows(target: Any, draft: Any) -> None:
    """Every token id the target emits (its vocab) must index the draft's embedding; rows past the
    target's vocab (a larger padded vocab) are fine: the draft's logits there are never proposed."""
    if draft.vocab_size < target.vocab_size:
        raise StartupError(
            f"speculative config: the draft model's embedding has {draft.vocab_size} rows, fewer "
            f"than the target's vocabulary of {target.vocab_size} tokens: the target's tokens "
            f"past {draft.vocab_size - 1} cannot be fed to the draft"
        )


class DraftProposer:
    """engine.core.speculator.Drafter over a model of engine.models."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_chunk: int,
        vocab_size: int,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.max_chunk = max_chunk  # catch-up (prefill) tokens the draft computes per step at most
        self.vocab_size = min(vocab_size, model.vocab_size)  # proposals stay in the target's vocab
        spec = model_kv_spec(model, max_model_len)
        self.kv = KVCacheManager(num_blocks, block_size, False, spec.windows)
        self.runner = ModelRunner(
            model, device, dtype, num_blocks, block_size, kv_spec=spec, kv_dtype=kv_dtype
        )
        self._shadows: dict[str, Sequence] = {}

    # -- Drafter -----------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            shadow.status = SequenceStatus.FINISHED_ABORTED  # its input-batch row is reclaimed

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        batch = []  # (shadow, tokens to compute, drafts wanted)
        budget = self.max_chunk
        for seq, k in wants:
            shadow = self._sync(seq)
            todo = seq.num_tokens - shadow.num_computed_tokens
            if todo > budget:  # a long catch-up (the prompt): a chunk now, drafts later
                if budget > 0 and self.kv.allocate_slots(shadow, budget):
                    batch.append((shadow, budget, 0))
                    budget = 0
                continue
            # KV for the unseen tokens and for drafts 1..k-1 (draft k's is never needed)
            if not self.kv.allocate_slots(shadow, todo + k - 1):
                continue  # the draft's pool is full: this sequence decodes plainly this step
            batch.append((shadow, todo, k))
            budget -= todo
        if not batch:
            return {}
        drafts: dict[str, list[int]] = {}
        firsts = self._forward([(shadow, n) for shadow, n, _ in batch])
        live = []
        for (shadow, n, k), token in zip(batch, firsts, strict=True):
            shadow.num_computed_tokens += n
            if k:
                drafts[shadow.seq_id] = [token]
                if k > 1:
                    live.append((shadow, k))
        while live:
            for shadow, _ in live:
                shadow.token_ids.append(drafts[shadow.seq_id][-1])
            tokens = self._forward([(shadow, 1) for shadow, _ in live])
            still = []
            for (shadow, k), token in zip(live, tokens, strict=True):
                shadow.num_computed_tokens += 1
                out = drafts[shadow.seq_id]
                out.append(token)
                if len(out) < k:
                    still.append((shadow, k))
            live = still
        return drafts

    # -- internals ---------------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its KV kept for the prefix it shares with the sequence's tokens
        (rejected drafts' KV is rolled back, their slots rewritten)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.group, seq.index, [], seq.num_prompt_tokens)
            shadow.status = SequenceStatus.RUNNING
            self._shadows[seq.seq_id] = shadow
        held, tokens = shadow.token_ids, seq.token_ids
        common = min(shadow.num_computed_tokens, len(tokens))
        # Only drafts were appended after the last verified token: check from there back.
        while common and held[common - 1] != tokens[common - 1]:
            common -= 1
        shadow.num_computed_tokens = common
        self.kv.trim(shadow, common)
        shadow.token_ids = list(tokens)
        return shadow

    def _forward(self, chunks: list[tuple[Sequence, int]]) -> list[int]:
        return greedy_forward(
            self.model, self.runner.input_batch, self.runner.kv_caches, self.kv, chunks,
            self.vocab_size,
        )  # fmt: skip


def greedy_forward(
    model: Any,
    input_batch: InputBatch,
    kv_caches: list[torch.Tensor],
    kv: KVCacheManager,
    chunks: list[tuple[Sequence, int]],
    vocab_size: int,
) -> list[int]:
    """Compute the next `n` tokens of each (shadow, n); the greedy token after each chunk."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i][1] != 1)  # decodes first
    scheduled = []
    for i in order:
        shadow, n = chunks[i]
        tables = kv.get_block_tables(shadow)
        scheduled.append(ScheduledSeq(shadow, n, shadow.num_computed_tokens, tables, True, 0))
    ids, pos, meta = input_batch.prepare(scheduled)
    hidden = model(ids, pos, kv_caches, meta)  # [num_tokens, hidden]
    ends, at = [], -1
    for s in scheduled:
        at += s.num_new_tokens
        ends.append(at)
    index = torch.tensor(ends, dtype=torch.int64, device=hidden.device)
    logits = model.compute_logits(hidden[index])  # [seqs, vocab]
    best = logits[:, :vocab_size].argmax(dim=-1).tolist()
    out = [0] * len(chunks)
    for row, i in enumerate(order):
        out[i] = int(best[row])
    return out


class SharedKVDrafter:
    """engine.core.speculator.Drafter for layer skip: the target's first layers over the target's
    own KV cache of those layers (its block tables, its pool)."""

    def __init__(
        self,
        model: Any,
        target_kv: KVCacheManager,
        target_caches: Callable[[], list[torch.Tensor]],
        layer_groups: list[int] | None,
        block_size: int,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.kv = target_kv
        self._target_caches = target_caches  # the runner's per-layer caches (built after us)
        self.input_batch = InputBatch(block_size, device, layer_groups=layer_groups)
        self.vocab_size = vocab_size
        self._shadows: dict[str, Sequence] = {}

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        if shadow is not None:
            shadow.status = SequenceStatus.FINISHED_ABORTED  # its input-batch row is reclaimed

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        kv = self.kv
        live = []
        for seq, k in wants:
            # Slots for the last token and drafts 1..k-1 in the target's blocks: taken only from
            # blocks it holds or a pool with room to spare (drafts never cause a preemption).
            extra = kv.blocks_needed(seq.num_tokens + k - 1) - len(kv.get_block_table(seq))
            if extra > 0 and kv.num_free_blocks < kv.num_groups * (extra + len(wants)):
                continue
            if not kv.allocate_slots(seq, k):
                continue
            shadow = self._shadows.get(seq.seq_id)
            if shadow is None:
                shadow = Sequence(seq.seq_id, seq.group, seq.index, [], seq.num_prompt_tokens)
                shadow.status = SequenceStatus.RUNNING
                self._shadows[seq.seq_id] = shadow
            shadow.token_ids = list(seq.token_ids)
            shadow.num_computed_tokens = seq.num_computed_tokens  # the target's KV up to here
            live.append((shadow, k))
        drafts: dict[str, list[int]] = {}
        caches = self._target_caches()[: self.model.num_layers]
        while live:
            tokens = greedy_forward(
                self.model, self.input_batch, caches, kv, [(s, 1) for s, _ in live],
                self.vocab_size,
            )  # fmt: skip
            still = []
            for (shadow, k), token in zip(live, tokens, strict=True):
                shadow.num_computed_tokens += 1
                out = drafts.setdefault(shadow.seq_id, [])
                out.append(token)
                if len(out) < k:
                    shadow.token_ids.append(token)
                    still.append((shadow, k))
            live = still
        return drafts


def build_drafter(
    config: SpeculativeConfig,
    target: Any,
    device: torch.device,
    target_dtype: torch.dtype,
    tokenizer: Any,
    model_config: Any,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_chunk: int,
    target_kv: KVCacheManager | None = None,
    target_caches: Callable[[], list[torch.Tensor]] | None = None,
    kv_cache_dtype: str = "auto",
    target_kv_dtype: torch.dtype | None = None,
) -> DraftProposer | SharedKVDrafter:
    """The draft for `config` (draft_model: loaded from its folder, checked to share the target's
    tokenizer and weight format; layer_skip: the target's first layers, over the target's KV when
    `target_kv` and `target_caches` are given, else over its own). A layer_skip draft's own KV
    cache takes the target's dtype (`target_kv_dtype`), a draft model's is resolved from
    `kv_cache_dtype` and its own weights as the target's is."""
    from engine.executor.model_runner import prepare_model
    from engine.models.loader import load_model, resolve_model
    from engine.text.tokenizer import Tokenizer

    if config.method == "layer_skip":
        assert config.num_draft_layers is not None
        model = first_layers(target, config.num_draft_layers)
        dtype, kv_dtype = target_dtype, target_kv_dtype
        if target_kv is not None and target_caches is not None:
            slots = model_kv_spec(target, max_model_len).layer_slots()[: model.num_layers]
            groups = [g for g, _ in slots] if target_kv.num_groups > 1 else None
            logger.info(
                "speculative decoding: layer_skip draft, %d of %d layers, over the target's KV",
                model.num_layers,
                target.num_layers,
            )
            return SharedKVDrafter(
                model, target_kv, target_caches, groups, block_size, device, target.vocab_size
            )
    else:
        assert config.model is not None
        try:
            path = resolve_model(config.model, model_config.cache_dir)
        except ValueError as e:
            raise StartupError(f"speculative draft {e}") from e  # "... model '/x' not found"
        try:
            draft_tokenizer = Tokenizer.from_pretrained(path)
        except Exception as e:
            raise StartupError(
                f"speculative config: cannot load the draft model's tokenizer: {e}"
            ) from e
        check_same_vocab(tokenizer, draft_tokenizer)
        try:
            loaded = load_model(
                path, model_config.dtype, model_config.device, model_config.quantization
            )
        except ValueError as e:
            raise StartupError(f"speculative draft model {config.model!r}: {e}") from e
        check_embedding_rows(target, loaded.model)
        quant = loaded.weight_format.quantization if loaded.weight_format else None
        prepare_model(loaded.model, model_config, quant, loaded.gguf_file)
        loaded.model.limit_context(max_model_len)
        model, dtype = loaded.model, loaded.dtype
        try:
            backend = attention_backend(device.type, dtype, block_size)
            kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, device, dtype, quant, backend)
        except ValueError as e:
            raise StartupError(f"speculative draft model's KV cache: {e}") from e
        if loaded.max_model_len < max_model_len:
            raise StartupError(
                f"speculative config: the draft model serves {loaded.max_model_len} tokens, "
                f"fewer than the target's max_model_len {max_model_len}"
            )
    logger.info(
        "speculative decoding: %s draft, %d layers, %d KV blocks of its own",
        config.method,
        model.num_layers,
        num_blocks,
    )
    return DraftProposer(
        model, device, dtype, num_blocks, block_size, max_model_len, max_chunk, target.vocab_size,
        kv_dtype,
    )  # fmt: skip

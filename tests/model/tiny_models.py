"""Tiny random-weight checkpoints of any decoder family, and the checks every family passes against
transformers: greedy tokens equal to `generate` in float32 under chunked prefill, preemption and
prefix-cache hits; prompt logprobs within 1e-4; both attention backends; int8 blocks batch-invariant.

Weights are drawn larger than transformers' init (which leaves a tiny model's logits nearly flat),
so greedy choices are decisive and a wrong layer changes tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.kernels.attention import AttentionMetadata, allocate_kv_cache
from engine.models.loader import load_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
BLOCK = 16
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4


def save_tiny_checkpoint(
    config: Any,
    out: Path,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    embed_std: float = 0.5,
) -> Path:
    """Save a random-weight model of `config` (float32) with decisive weights, a generation config
    and, from `tokenizer_dir`, a tokenizer; returns `out`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    randomize_decisively(model, seed, embed_std)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
    ).save_pretrained(out)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


@torch.no_grad()
def randomize_decisively(model: torch.nn.Module, seed: int, embed_std: float = 0.5) -> None:
    """Matrices ~ N(0, 1.5 / sqrt(fan_in)), embeddings ~ N(0, embed_std), norm weights around their
    init (1, or 0 for Gemma's (1 + w) norms) with spread 0.2, biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if "embed" in name:
            param.copy_(noise * embed_std)
        elif param.dim() >= 2:
            param.copy_(noise * (1.5 / param.shape[-1] ** 0.5))
        elif "norm" in name:
            param.add_(noise * 0.2)
        else:
            param.copy_(noise * 0.1)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def hf_reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(
    hf_model: Any, prompts: list[list[int]], max_new: int = MAX_TOKENS
) -> list[list[int]]:
    """transformers' `generate`, greedy, one prompt at a time, never stopping early."""
    results = []
    with torch.inference_mode():
        for p in prompts:
            out = hf_model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=None,
                pad_token_id=0,
            )
            results.append(out[0, len(p) :].tolist())
    return results


def hf_logprobs(hf_model: Any, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, GREEDY)]


@dataclass
class FamilyCase:
    """One tiny checkpoint with its prompts and transformers' answers, shared by the checks."""

    folder: Path
    prompts: list[list[int]]
    hf_model: Any
    expected: list[list[int]] = field(default_factory=list)
    max_model_len: int | None = None  # served context (None: the model's own maximum)

    @classmethod
    def build(
        cls, folder: Path, lengths: list[int], seed: int = 0, max_model_len: int | None = None
    ) -> FamilyCase:
        hf_model = hf_reference(folder)
        config = getattr(hf_model.config, "text_config", None) or hf_model.config
        prompts = random_prompts(config.vocab_size, lengths, seed)
        return cls(folder, prompts, hf_model, hf_greedy(hf_model, prompts), max_model_len)

    def llm(self, **options: Any) -> LLM:
        base: dict[str, Any] = {"dtype": "float32", "quantization": "none", "block_size": BLOCK}
        if self.max_model_len is not None:
            base["max_model_len"] = self.max_model_len
        return LLM(str(self.folder), **(base | options))


# ---------------------------------------------------------------- the checks


def check_chunked_prefill(case: FamilyCase) -> None:
    """A small token budget: long prompts are chunked and share steps with others' decodes."""
    llm = case.llm(max_num_batched_tokens=24, max_num_seqs=8, enable_prefix_caching=False)
    got = greedy(llm, case.prompts)
    for i, (g, e) in enumerate(zip(got, case.expected, strict=True)):
        assert g == e, f"prompt {i} ({len(case.prompts[i])} tokens) diverged: {g} != {e}"


def check_preemption(case: FamilyCase, num_blocks: int) -> None:
    llm = case.llm(max_num_batched_tokens=64, num_blocks=num_blocks, enable_prefix_caching=False)
    got = greedy(llm, case.prompts)
    assert llm.engine.totals.num_preemptions > 0, "the pool was meant to force preemptions"
    for i, (g, e) in enumerate(zip(got, case.expected, strict=True)):
        assert g == e, f"prompt {i} diverged after preemption"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked


def check_prefix_cache_hits(case: FamilyCase, shared: int = 3 * BLOCK, tail: int = 20) -> None:
    """Prompts sharing a long prefix: the later ones reuse the first one's blocks."""
    head = case.prompts[-1][:shared]
    prompts = [head + p[:tail] for p in case.prompts[:3]]
    expected = hf_greedy(case.hf_model, prompts)
    llm = case.llm(max_num_batched_tokens=40)
    first = greedy(llm, prompts[:1])
    rest = greedy(llm, prompts[1:])
    assert llm.engine.totals.prefix_cache_hits >= 2 * shared
    assert [*first, *rest] == expected


def check_prompt_logprobs(case: FamilyCase, prompt: list[int]) -> None:
    llm = case.llm(max_num_batched_tokens=24)  # the prompt's logprobs come chunk by chunk
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    ref = hf_logprobs(case.hf_model, prompt)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    worst = max(
        abs(plp[pos].logprob - ref[pos - 1, prompt[pos]].item()) for pos in range(1, len(prompt))
    )
    assert worst < LOGPROB_TOLERANCE, worst


def check_backends_match_transformers(case: FamilyCase, prompt: list[int]) -> None:
    """Whole-prompt logits through a paged cache (scattered blocks) on the C++ kernels and on the
    pure-torch SDPA path, both against transformers."""
    model = load_model(case.folder, "float32", "cpu").model
    if case.max_model_len is not None:
        model.limit_context(case.max_model_len)
    ref = hf_logprobs(case.hf_model, prompt)
    num_blocks = -(-len(prompt) // BLOCK)
    table = list(range(num_blocks, 0, -1))  # reversed: block order must not matter
    for backend in ("cpu", "sdpa"):
        kv = allocate_kv_cache(
            model.num_layers,
            num_blocks + 1,
            BLOCK,
            model.num_kv_heads,
            model.head_dim,
            torch.float32,
            "cpu",
        )
        meta = AttentionMetadata.from_lists([len(prompt)], [len(prompt)], [table], BLOCK)
        meta.backend = backend
        logits = model.compute_logits(
            model(torch.tensor(prompt), torch.arange(len(prompt)), kv, meta)
        )
        diff = (logits.log_softmax(-1) - ref).abs().max().item()
        assert diff < LOGPROB_TOLERANCE, (backend, diff)


def check_int8_batch_invariant(case: FamilyCase) -> None:
    """int8 blocks: greedy tokens the same alone and batched with chunked prefills, and close to
    float32 (most of the first tokens agree)."""
    llm = case.llm(quantization="int8", max_num_batched_tokens=24, enable_prefix_caching=False)
    from engine.models.block_quant import BlockQ8Weight

    assert isinstance(llm.engine.model.layers[0].self_attn.qkv_weight, BlockQ8Weight)
    batched = greedy(llm, case.prompts)
    alone = [greedy(llm, [p])[0] for p in case.prompts[:3]]
    assert batched[:3] == alone
    agree = sum(b[0] == e[0] for b, e in zip(batched, case.expected, strict=True))
    assert agree >= len(case.prompts) // 2, (batched, case.expected)

"""decode_layers' thread-team path (csrc/decode_layer.cpp: the layers' small ops and matmuls in
parallel regions, the threads sharing each phase between spinning barriers) gives bitwise the
per-op path's hidden states and KV-cache writes: every block format and fused weights whose parts
mix them, biases (Qwen2) and q/k norms (Qwen3), 1 to 70 rows (the zmm tiles of 8 and more than one
row panel of 64), 1 to 3 threads, float32 and float16 KV caches, and every kernel path this CPU
runs; steps it cannot run (float matmuls, more threads than CPUs) take the per-op path, and say why
when it is required."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.models.cpu_features import BLOCK_KERNEL_PATHS, block_kernel_probe
from tests.model.gguf_files import TinyLlama, write_tiny_llama

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

LAYER_TYPES = [
    {  # Q4_0 throughout (its sums take q - 8)
        "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_0",
        "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_0",
    },
    {  # a fused qkv of three formats, gate and up of two
        "attn_q": "Q4_K", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q5_K",
        "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q4_1",
    },
    {
        "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "F16",
        "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q6_K",
    },
]  # fmt: skip
SPEC = TinyLlama(256, 512, 4, 2, LAYER_TYPES, ("Q8_0", 0.5), ("Q8_0", 0.5))


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf"
    write_tiny_llama(path, SPEC)
    cache = str(tmp_path_factory.mktemp("cache"))
    return LLM(str(path), quantization="gguf", cache_dir=cache, max_num_seqs=4)


def _tiny_dir(smollm2_dir: Path, folder: Path, config_class: type, **extra: Any) -> Path:
    """A 2-layer random-weight checkpoint of config_class with SmolLM2's tokenizer and vocab."""
    from tests.model.tiny_models import save_tiny_checkpoint

    smol = json.loads((smollm2_dir / "config.json").read_text())
    config = config_class(
        vocab_size=smol["vocab_size"], hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=smol.get("bos_token_id"), eos_token_id=smol.get("eos_token_id"), **extra,
    )  # fmt: skip
    return save_tiny_checkpoint(config, folder, smollm2_dir)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2: biases on q, k and v."""
    from transformers import Qwen2Config

    return _tiny_dir(smollm2_dir, tmp_path_factory.mktemp("qwen2"), Qwen2Config)


@pytest.fixture(scope="module")
def tiny_llama_biases_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with attention and MLP biases (mlp_bias: gate/up and down)."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama_biases")
    return _tiny_dir(smollm2_dir, folder, LlamaConfig, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3: per-head q/k norms."""
    from tests.model.test_qwen3 import qwen3_config
    from tests.model.tiny_models import save_tiny_checkpoint

    config = qwen3_config(smollm2_dir, num_hidden_layers=2)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("qwen3"), smollm2_dir)


def _step(
    llm: LLM, rows: int, kv_dtype: torch.dtype, seed: int, max_len: int = 40
) -> dict[str, Any]:
    """Random decode_layers arguments for the model's plan: hidden states, caches, step tensors;
    contexts of 1 to max_len tokens, the first row's max_len."""
    model = llm.engine.model
    plan = model._decode_plan()
    assert plan is not None
    attn = model.layers[0].self_attn
    d, kv_heads = attn.head_dim, attn.num_kv_heads
    hidden = model.layers[0].input_layernorm.weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    width = -(-max_len // block_size)
    blocks = (width + 1) * rows + 4
    caches = [
        (torch.randn(2, blocks, block_size, kv_heads, d, generator=gen) * 2).to(kv_dtype)
        for _ in model.layers
    ]
    lens = torch.randint(1, max_len, (rows,), generator=gen, dtype=torch.int32)
    lens[0] = max_len
    tables = (
        torch.randperm(blocks, generator=gen)[: width * rows].reshape(rows, width).to(torch.int32)
    )
    slots = torch.stack(
        [tables[r, (lens[r] - 1) // block_size] * block_size + (lens[r] - 1) % block_size
         for r in range(rows)]
    ).long()  # fmt: skip
    # distinct slots: rows that share one would write it in an order the paths need not share
    keep = [r for r in range(rows) if slots[r] not in slots[:r]]
    rows = len(keep)
    lens, tables, slots = lens[keep], tables[keep], slots[keep]
    angles = torch.rand(rows, d // 2, generator=gen) * 6
    return {
        "h": torch.randn(rows, hidden, generator=gen) * 3,
        "plan": plan.handle,
        "caches": caches,
        "shared": [angles.cos(), angles.sin(), slots, tables, lens],
        "where": [0] * len(caches),
    }


def _run(args: dict[str, Any], mode: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    caches = [c.clone() for c in args["caches"]]
    previous = torch.ops.kvserve.decode_team_select(mode)
    try:
        out = cpu_kernels.decode_layers(
            args["h"], args["plan"], caches, args["shared"], args["where"]
        )
    finally:
        torch.ops.kvserve.decode_team_select(previous)
    assert (torch.ops.kvserve.decode_team_last() == "") == (mode != 0)  # the team ran, or not
    return out, caches


def _paths() -> list[str]:
    return [p for p in BLOCK_KERNEL_PATHS if block_kernel_probe(p) == ""]


def _assert_team_equals_per_op(llm: LLM, rows: int, threads: int, kv_dtype: torch.dtype) -> None:
    saved_threads, saved_path = torch.get_num_threads(), torch.ops.kvserve.block_kernels_path()
    torch.set_num_threads(threads)
    try:
        for seed, path in enumerate(_paths()):
            torch.ops.kvserve.block_kernels_select(path)
            args = _step(llm, rows, kv_dtype, seed)
            per_op, per_op_caches = _run(args, 0)
            team, team_caches = _run(args, 2)  # 2: the team path must run
            assert torch.equal(team, per_op), (path, rows, threads)
            for a, b in zip(team_caches, per_op_caches, strict=True):
                assert torch.equal(a, b), (path, rows, threads)
            assert not torch.equal(team_caches[0], args["caches"][0])  # the step wrote its K/V
    finally:
        torch.set_num_threads(saved_threads)
        torch.ops.kvserve.block_kernels_select(saved_path)


@pytest.mark.parametrize("rows", [1, 2, 3, 9, 70])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_block_format_and_mixed_parts(mixed_gguf: LLM, rows: int, threads: int) -> None:
    _assert_team_equals_per_op(mixed_gguf, rows, threads, torch.float16)


@pytest.mark.parametrize("rows", [1, 2])
def test_few_rows_share_the_row_wise_phases_when_they_are_wide(mixed_gguf: LLM, rows: int) -> None:
    """With fewer rows than threads each thread computes RMSNorm, quantizing and SwiGLU whole for
    itself while they are small; past decode_team_whole_max values (0 here: always) the threads
    share them and meet at a barrier after each, as with more rows. The same bits either way."""
    saved = torch.ops.kvserve.decode_team_whole_max(0)
    try:
        _assert_team_equals_per_op(mixed_gguf, rows, 3, torch.float16)
    finally:
        assert torch.ops.kvserve.decode_team_whole_max(saved) == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama_biases"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_biases_and_qk_norms(request, family: str, kv_dtype: torch.dtype) -> None:
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    llm = LLM(str(folder), dtype="float32", quantization="int4", max_num_seqs=4)
    gen = torch.Generator().manual_seed(5)
    for layer in llm.engine.model.layers:
        attn = layer.self_attn
        if family == "qwen3":
            assert attn.q_norm is not None
            continue
        assert attn.qkv_bias is not None  # (transformers initialises biases to zero)
        attn.qkv_bias.data.normal_(0, 1, generator=gen)
        if family == "llama_biases":  # and o, gate/up, down
            for bias in (attn.o_bias, layer.mlp.gate_up_bias, layer.mlp.down_bias):
                assert bias is not None
                bias.data.normal_(0, 1, generator=gen)
    for rows in (1, 5):
        _assert_team_equals_per_op(llm, rows, 2, kv_dtype)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_long_contexts_run_the_split_attention_between_the_barriers(
    mixed_gguf: LLM, threads: int, kv_dtype: torch.dtype
) -> None:
    """From 512 keys the attention takes its split path, three phases the team runs between its
    barriers: the per-op path's bits, and the per-item attention's (decode_split_select(0))."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, max_len in ((1, 1300), (3, 700), (2, 513)):
            args = _step(mixed_gguf, rows, kv_dtype, rows, max_len=max_len)
            per_op, per_op_caches = _run(args, 0)
            team, team_caches = _run(args, 2)
            mode = torch.ops.kvserve.decode_split_select(0)
            try:
                items, items_caches = _run(args, 2)
            finally:
                torch.ops.kvserve.decode_split_select(mode)
            assert torch.equal(team, per_op) and torch.equal(team, items), (rows, max_len)
            for a, b, c in zip(team_caches, per_op_caches, items_caches, strict=True):
                assert torch.equal(a, b) and torch.equal(a, c)
    finally:
        torch.set_num_threads(saved)


def test_the_barrier_prefetch_is_only_a_hint(mixed_gguf: LLM) -> None:
    """While a thread waits at a barrier it asks for its share of the next matmul's weights: no
    budget, the default and one beyond every share give the same bits."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    budget = torch.ops.kvserve.decode_team_prefetch(0)
    try:
        args = _step(mixed_gguf, 3, torch.float16, 11)
        per_op, _ = _run(args, 0)
        for bytes_ in (0, budget, 1 << 30):
            torch.ops.kvserve.decode_team_prefetch(bytes_)
            team, _ = _run(args, 2)
            assert torch.equal(team, per_op), bytes_
        with pytest.raises(RuntimeError, match="bytes must be >= 0"):
            torch.ops.kvserve.decode_team_prefetch(-1)
    finally:
        torch.ops.kvserve.decode_team_prefetch(budget)
        torch.set_num_threads(saved)


def test_the_barriers_sleep_and_wake_beside_busy_neighbours(mixed_gguf: LLM) -> None:
    """Two spinning processes beside the team take its cores away, so its threads outwait the spin
    and sleep on the barrier's futex: every step still finishes, with the per-op bits. (A waiter
    that slept through its wake-up hung a server mid-step once: the futex handshake in
    decode_layer.cpp, whose sleeps also end after 1 ms to look again.)"""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    spin = "import time\nend = time.time() + 120\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        args = _step(mixed_gguf, 3, torch.float16, 12)
        per_op, _ = _run(args, 0)
        for _ in range(20):
            team, _ = _run(args, 2)
            assert torch.equal(team, per_op)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        torch.set_num_threads(saved)


def test_generation_is_the_same_and_float_models_take_the_per_op_path(
    mixed_gguf: LLM, tiny_llama_dir: Path
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]

    def generate(llm: LLM, mode: int) -> list[Any]:
        previous = torch.ops.kvserve.decode_team_select(mode)
        try:
            outs = llm.generate(prompts, params)
        finally:
            torch.ops.kvserve.decode_team_select(previous)
        return [(o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs]) for o in outs]

    assert generate(mixed_gguf, 2) == generate(mixed_gguf, 0)
    floats = LLM(str(tiny_llama_dir), dtype="float32", quantization="none", max_num_seqs=4)
    assert generate(floats, 1) == generate(floats, 0)  # not the team's: the per-op path runs
    with pytest.raises(RuntimeError, match="team path cannot run this step: layer 0: a float"):
        _run(_step(floats, 1, torch.float16, 0), 2)


def test_more_threads_than_cpus_take_the_per_op_path(mixed_gguf: LLM) -> None:
    """A barrier would wait for a descheduled thread at every phase: with more threads than the
    process's CPUs the step runs per op (the same bits), unless the team is required (tests)."""
    cpus = len(os.sched_getaffinity(0))
    saved = torch.get_num_threads()
    torch.set_num_threads(cpus + 1)
    try:
        args = _step(mixed_gguf, 1, torch.float16, 0)
        caches = [c.clone() for c in args["caches"]]
        out = cpu_kernels.decode_layers(
            args["h"], args["plan"], caches, args["shared"], args["where"]
        )
        assert torch.ops.kvserve.decode_team_last() == f"{cpus + 1} threads on {cpus} CPUs"
        assert torch.equal(out, _run(args, 2)[0])
    finally:
        torch.set_num_threads(saved)

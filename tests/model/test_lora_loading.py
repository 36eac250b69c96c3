"""Loading LoRA adapters: every kind of bad folder is its own LoRAError (at start-up and at run time,
changing nothing served); Phi-3's fused qkv_proj / gate_up_proj adapters; adapters on a decoder
embedding model; the async engine's load, unload and streaming with an adapter."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, AsyncLLMEngine, EngineConfig, LoRAError, LoRANotFoundError, SamplingParams
from engine.embeddings.embedding_engine import EmbeddingEngine
from tests.model import tiny_models as tm
from tests.model.lora_adapters import edit_config, make_adapter, peft_reference, save_tiny_base

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def base(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_base(smollm2_dir, tmp_path_factory.mktemp("lora_load_base"))


@pytest.fixture(scope="module")
def good(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(base, tmp_path_factory.mktemp("good") / "a", rank=8, seed=4)


@pytest.fixture(scope="module")
def llm(base: Path, good: Path) -> LLM:
    return LLM(str(base), dtype="float32", quantization="none", lora_modules=[f"good={good}"])


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "bad"))


def _rewrite(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(folder / WEIGHTS)
    for key, value in change.items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    save_file(tensors, folder / WEIGHTS)


def _key(folder: Path, part: str) -> str:
    return next(k for k in load_file(folder / WEIGHTS) if part in k)


BAD = {
    "no folder": (lambda f: shutil.rmtree(f), "no such folder"),
    "no config": (lambda f: (f / "adapter_config.json").unlink(), "not a PEFT adapter folder"),
    "config not json": (lambda f: (f / "adapter_config.json").write_text("{"), "not valid JSON"),
    "not lora": (lambda f: edit_config(f, peft_type="PREFIX_TUNING"), "not LORA"),
    "rank too high": (lambda f: edit_config(f, r=128), "above the maximum LoRA rank 64"),
    "unknown target": (lambda f: edit_config(f, target_modules=["fc1"]), "fc1 are not linears"),
    "lm_head": (lambda f: edit_config(f, target_modules=["lm_head"]), "output head"),
    "dora": (lambda f: edit_config(f, use_dora=True), "DoRA"),
    "corrupt": (
        lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:100]),
        "not a readable safetensors",
    ),
    "bin only": (
        lambda f: (f / WEIGHTS).rename(f / "adapter_model.bin"),
        "adapter_model.bin is a pickle",
    ),
    "int tensor": (
        lambda f: _rewrite(f, {_key(f, "q_proj.lora_A"): torch.zeros(8, 64, dtype=torch.int32)}),
        "must be floating point",
    ),
    "wrong shape": (
        lambda f: _rewrite(f, {_key(f, "q_proj.lora_A"): torch.zeros(8, 96)}),
        "another base model",
    ),
    "lora_B short": (  # q_proj's output is 64 rows: peft refuses 61 (no silent zero padding)
        lambda f: _rewrite(f, {_key(f, "q_proj.lora_B"): torch.zeros(61, 8)}),
        r"output 64\): an adapter for another base model",
    ),
    "lora_B long": (
        lambda f: _rewrite(f, {_key(f, "q_proj.lora_B"): torch.zeros(67, 8)}),
        r"output 64\): an adapter for another base model",
    ),
    "half a pair": (lambda f: _rewrite(f, {_key(f, "v_proj.lora_B"): None}), "not its pair"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_folder_is_a_lora_error_and_changes_nothing(llm, good, tmp_path, case):
    folder = _copy(good, tmp_path)
    breaks, message = BAD[case]
    breaks(folder)
    before = llm.engine.loras()
    with pytest.raises(LoRAError, match=message) as err:
        llm.engine.load_lora("other", str(folder))
    assert err.value.param == "lora_path"
    assert llm.engine.loras() == before


def test_name_already_loaded_and_start_up_errors(base, good, llm, tmp_path):
    with pytest.raises(LoRAError, match="already loaded") as err:
        llm.engine.load_lora("good", str(good))
    assert err.value.param == "lora_name"
    folder = _copy(good, tmp_path)
    edit_config(folder, r=16)
    with pytest.raises(LoRAError, match="above the maximum LoRA rank 8"):
        LLM(str(base), quantization="none", lora_modules=[f"x={folder}"], max_lora_rank=8)
    with pytest.raises(LoRANotFoundError) as missing:
        llm.generate([[5, 6, 7]], GREEDY, lora="nope")
    assert missing.value.served == ("good",)


def test_phi3_fused_qkv_and_gate_up_adapters(smollm2_dir, tmp_path):
    from tests.model.test_phi3 import phi3_config

    folder = tm.save_tiny_checkpoint(phi3_config(smollm2_dir, False, 1.0), tmp_path / "phi3")
    for name in tm.TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / name)
    adapter = make_adapter(
        folder, tmp_path / "ad", rank=8, targets=["qkv_proj", "o_proj", "gate_up_proj"], seed=7
    )
    prompts = tm.random_prompts(
        int(json.loads((folder / "config.json").read_text())["vocab_size"]), [5, 30]
    )
    want = tm.hf_greedy(peft_reference(folder, adapter), prompts, 8)
    phi = LLM(str(folder), dtype="float32", quantization="none", lora_modules=[f"a={adapter}"])
    assert phi.engine.loras()[0].target_modules == ("gate_up_proj", "o_proj", "qkv_proj")
    got = [list(o.outputs[0].token_ids) for o in phi.generate(prompts, GREEDY, lora="a")]
    assert got == want


def test_decoder_embeddings_with_an_adapter(base, good):
    config = EngineConfig.from_options(
        str(base), dtype="float32", task="embed", lora_modules=[f"good={good}"]
    )
    engine = EmbeddingEngine(config, base, "tiny")
    ids = [[5, 17, 300, 42, 9], [7, 7, 8, 1000]]
    engine.add_request("a", ids[0], lora="good")
    engine.add_request("b", ids[1])
    engine.add_request("c", ids[1], lora="good")
    got = {o.request_id: torch.tensor(o.embedding) for o in engine.step()}
    peft_model = peft_reference(base, good)
    inner = peft_model.base_model.model.model  # the LlamaModel, its linears carrying the adapter
    with torch.inference_mode():
        for rid, tokens in (("a", ids[0]), ("c", ids[1])):
            want = inner(torch.tensor([tokens])).last_hidden_state[0, -1]
            want = want / want.norm()
            assert torch.allclose(got[rid], want, atol=1e-4), rid
    assert not torch.allclose(got["b"], got["c"], atol=1e-2)
    assert not engine.adapters.pins


def test_async_engine_loads_streams_and_unloads(base, good, tmp_path):
    other = make_adapter(base, tmp_path / "other", rank=4, seed=9)
    prompt = [5, 17, 300, 42, 9, 11, 12]
    want = tm.hf_greedy(peft_reference(base, other), [prompt], 8)[0]

    async def run() -> None:
        config = EngineConfig.from_options(str(base), dtype="float32", quantization="none")
        engine = AsyncLLMEngine.from_config(config)
        await engine.start()
        try:
            with pytest.raises(LoRAError):
                await engine.load_lora("x", str(tmp_path / "missing"))
            info = await engine.load_lora("x", str(other))
            assert info.rank == 4 and engine.loras() == (info,)
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            tokens: list[int] = []
            async for out in engine.generate("r1", prompt, params, lora="x"):
                tokens = list(out.outputs[0].token_ids)  # cumulative
            assert tokens == want
            await engine.unload_lora("x")
            assert engine.loras() == ()
            with pytest.raises(LoRANotFoundError):
                engine.generate("r2", prompt, params, lora="x")
            with pytest.raises(LoRANotFoundError):
                await engine.unload_lora("x")
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_kv_events_name_the_adapter_of_its_blocks(base, good):
    from engine.core.kv_events import BlockStored

    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    llm = LLM(
        str(base), quantization="none", block_size=8, kv_events_config=config,
        lora_modules=[f"good={good}"],
    )  # fmt: skip
    try:
        assert llm.engine.kv_events is not None
        recorder = llm.engine.kv_events.recorder
        seen: list[object] = []
        add = recorder._add

        def recording(event: object) -> None:
            seen.append(event)
            add(event)  # type: ignore[arg-type]

        recorder._add = recording  # type: ignore[method-assign]
        prompt = list(range(5, 30))
        llm.generate([prompt], GREEDY, lora="good")
        llm.generate([prompt], GREEDY)
        stored = [e for e in seen if isinstance(e, BlockStored)]
        assert {e.lora_name for e in stored} == {"good", None}
        for event in stored:  # the adapter's chain carries its namespace in the extra keys
            assert (event.extra_keys is not None) == (event.lora_name == "good")
    finally:
        llm.engine.close()

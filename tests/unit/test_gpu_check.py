"""scripts/gpu-check.sh's pieces that need no GPU: shell syntax, the limits measurement on CPU, and
the final table's fractions and ratios from bench and baseline results."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
}


@pytest.mark.parametrize("script", ["gpu-check.sh", "gpu-wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)


def test_limits_on_cpu():
    limits = gpu_check.measure_limits(torch.device("cpu"), 1 << 20, 64, repeats=2)
    assert limits["device"] == "cpu" and limits["bandwidth_gbps"] > 0 and limits["bf16_tflops"] > 0


def _bench(output_tok_s, itl_ms, concurrency):
    stats = {"mean": itl_ms, "median": itl_ms, "p99": 2 * itl_ms}
    return {
        "config": {"concurrency": concurrency, "input_len": 128, "output_len": 64},
        "completed": 10,
        "total_prompt_tokens": 1280,
        "output_throughput": output_tok_s,
        "total_token_throughput": 3 * output_tok_s,
        "ttft_ms": stats,
        "itl_ms": stats,
    }


def test_table_fractions_and_ratios(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    results = tmp_path / "results"
    results.mkdir()
    limits = {"device": "X", "bandwidth_gbps": 1000.0, "bf16_tflops": 100.0, "matmul_square": 64}
    (results / "limits.json").write_text(json.dumps(limits))
    (results / "bench_c1.json").write_text(json.dumps(_bench(500.0, 2.0, 1)))
    (results / "bench_c8.json").write_text(json.dumps(_bench(8000.0, 4.0, 8)))
    hf = {
        "generate_batch1": {"ms_per_token": 10.0, "output_tok_s": 100.0},
        "continuous_batching": {"output_tok_s": 2000.0},
    }
    (results / "hf_baseline.json").write_text(json.dumps(hf))
    table = gpu_check.build_table(tmp_path, results, [1, 8], "bfloat16")
    cost = gpu_check.model_cost(CONFIG, 16, 128 + 32)
    floor_ms = (cost.weight_bytes + cost.kv_bytes_per_token * cost.context_len) / 1e12 * 1e3
    assert f"{100 * floor_ms / 2.0:.1f}% of bandwidth" in table
    assert f"{100 * 24000.0 * cost.flops_per_token / 100e12:.2f}% of bf16 compute" in table
    assert "generate ms/token over kvserve ITL = 5.00x" in table
    assert "kvserve 4.00x transformers CB output tok/s" in table


def test_table_with_missing_results(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    table = gpu_check.build_table(tmp_path, tmp_path, [1, 32, 256], "bfloat16")
    assert table.count("(no result)") == 3

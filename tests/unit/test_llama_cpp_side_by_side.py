"""The llama.cpp side-by-side's pure logic, without llama.cpp: a GGUF file's tensor-type histogram
and decode bytes (benchmarks/gguf_files.py), the weight-streaming limit and the per-file summary
(benchmarks/compare_report.py), llama-server's context size and options (llama_cpp_peer.py), and
the speculative peer's variants and summary (spec_peer.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import compare_report, gguf_files, llama_cpp_peer, spec_peer


def _write_gguf(path, tied: bool):
    """A 2-layer Llama-shaped GGUF: Q8_0 attention rows 64 wide, F32 norms, F16 embeddings."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    rng = np.random.default_rng(0)
    for layer in range(2):
        q = gguf.quants.quantize(
            rng.standard_normal((64, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0
        )
        w.add_tensor(f"blk.{layer}.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.add_tensor("token_embd.weight", np.ones((100, 64), dtype=np.float16))
    if not tied:
        w.add_tensor("output.weight", np.ones((100, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_histogram_counts_tensors_and_bytes_per_type(tmp_path):
    tensors, meta = gguf_files.read_tensors(_write_gguf(tmp_path / "m.gguf", tied=True))
    hist = gguf_files.type_histogram(tensors)
    q8_bytes = 64 * 64 // 32 * 34  # 34-byte blocks of 32 weights
    assert hist["Q8_0"] == (2, 2 * q8_bytes)
    assert hist["F16"] == (1, 100 * 64 * 2)
    assert hist["F32"] == (2, 2 * 64 * 4)
    assert list(hist) == ["F16", "Q8_0", "F32"]  # most bytes first
    text = gguf_files.format_histogram("m.gguf", hist)
    assert "Q8_0 x2" in text and "F16 x1" in text and text.startswith("m.gguf: ")


def test_decode_reads_the_embedding_table_only_when_it_is_the_lm_head(tmp_path):
    tied = gguf_files.read_tensors(_write_gguf(tmp_path / "t.gguf", tied=True))
    untied = gguf_files.read_tensors(_write_gguf(tmp_path / "u.gguf", tied=False))
    table = 100 * 64 * 2
    a, b = gguf_files.decode_bytes(*tied), gguf_files.decode_bytes(*untied)
    total_tied = sum(t.num_bytes for t in tied[0])
    assert a.weight_bytes == total_tied  # the table is the lm_head: read whole
    assert b.weight_bytes == total_tied + table - table + 64 * 2  # output whole, one embedding row
    # K+V per token: 2 layers x 2 kv heads x (16 + 16) dims x 2 bytes
    assert a.kv_bytes_per_token == 2 * 2 * 32 * 2
    assert a.per_token(10) == a.weight_bytes + 10 * a.kv_bytes_per_token


def test_streaming_limit_arithmetic():
    assert gguf_files.streaming_limit_ms(80e6, 40.0) == pytest.approx(2.0)
    limit = compare_report.StreamingLimit(bytes_per_token=50e6, read_gbps=25.0, context_len=160)
    assert limit.itl_ms == pytest.approx(2.0)
    with pytest.raises(ValueError):
        gguf_files.streaming_limit_ms(1.0, 0.0)


def _m(tok_s, itl, ttft):
    return {
        "output_throughput": tok_s,
        "itl_ms": {"median": itl},
        "ttft_ms": {"median": ttft},
    }


def test_file_summary_shows_ratios_long_prompts_and_itl_over_the_limit():
    kv = {"1": _m(100, 8.0, 150), "8": _m(300, 20, 300), "32": _m(600, 40, 900)}
    kv |= {"long1024": _m(1, 1, 2000), "long4096": _m(1, 1, 9000)}
    peer = {"1": _m(70, 10.0, 300), "8": _m(150, 30, 600), "32": _m(200, 90, 2000)}
    peer |= {"long4096": _m(1, 1, 6000)}
    rows = compare_report.headline_rows(kv, peer)
    labels = [r[0] for r in rows]
    assert labels[:4] == [
        "output tok/s c=32",
        "output tok/s c=8",
        "ITL median c=1 ms",
        "TTFT median c=1 ms",
    ]
    assert labels[4:] == ["TTFT 1024-token prompt ms", "TTFT 4096-token prompt ms"]
    assert rows[0][1:] == (600, 200) and math.isnan(rows[4][2])  # the peer has no 1024 level
    limit = compare_report.StreamingLimit(40e6, 20.0, 160)  # 2 ms
    text = compare_report.format_file_summary("Q4_0", kv, peer, "llama.cpp", limit)
    assert "3.00x" in text  # 600 / 200 tok/s at c=32
    assert "1.50x" in text  # 9000 / 6000 ms: slower on 4096-token prompts
    assert "kvserve 4.00x, llama.cpp 5.00x" in text  # 8 ms and 10 ms over a 2 ms limit
    table = compare_report.format_markdown([("Q4_0.gguf", kv, peer, limit)])
    assert "| Q4_0.gguf | output tok/s c=32 | 600.0 | 200.0 | 3.00x |" in table
    probed = compare_report.StreamingLimit(40e6, 20.0, 160, (18.0, 22.0))  # their median: 20
    text = compare_report.format_file_summary("Q4_0", kv, peer, "llama.cpp", probed)
    assert "probes before and after: 18.0, 22.0 GB/s" in text and "kvserve 4.00x" in text


def test_llama_cpp_context_and_options():
    assert llama_cpp_peer.llama_cpp_ctx_size(32, 256, 4168, unified_kv=False) == 32 * 4168
    assert llama_cpp_peer.llama_cpp_ctx_size(32, 256, 4168, unified_kv=True) == 32 * 256
    assert llama_cpp_peer.llama_cpp_ctx_size(4, 256, 4168, unified_kv=True) == 4168
    help_text = "-kvu, --kv-unified      use a unified KV buffer\n--spec-type TYPES  ..."
    assert llama_cpp_peer.has_option(help_text, "--kv-unified")
    assert llama_cpp_peer.has_option(help_text, "--spec-type")
    assert not llama_cpp_peer.has_option(help_text, "--kv")
    argv = llama_cpp_peer.llama_cpp_argv("ls", "m.gguf", 9, 8, 256, 2, ["-fa"], 4168, True)
    assert argv[argv.index("--ctx-size") + 1] == "4168" and "--kv-unified" in argv
    assert argv[-1] == "-fa"  # extra arguments last: they win


def test_spec_peer_variants_share_the_file_and_threads(tmp_path):
    args = spec_peer.build_parser().parse_args(
        ["--llama-server", "ls", "--gguf", "m.gguf", "--draft", "d.gguf", "--threads", "3"]
    )
    vs = spec_peer.variants(args)
    names = [v.name for v in vs]
    assert names[0] == "llama.cpp plain" and "llama.cpp draft" in names
    assert {"kvserve plain", "kvserve ngram", "kvserve suffix"} <= set(names)
    for v in vs:
        assert "m.gguf" in v.argv and v.argv[v.argv.index("--threads") + 1] == "3"
    suffix = next(v for v in vs if v.name == "kvserve suffix")
    config = json.loads(suffix.argv[suffix.argv.index("--speculative-config") + 1])
    assert config["method"] == "suffix"
    draft = next(v for v in vs if v.name == "llama.cpp draft")
    assert draft.argv[draft.argv.index("-md") + 1] == "d.gguf"
    assert spec_peer.rotation(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_spec_peer_summary_compares_with_the_same_servers_plain():
    def tally(tpot, texts, n=0, acc=0):
        t = spec_peer.Tally(tpot_ms=tpot, ttft_ms=[100.0], draft_n=n, draft_accepted=acc)
        t.texts = dict(enumerate(texts))
        return t

    tallies = {
        "llama.cpp plain": tally([10.0, 12.0], ["a", "b"]),
        "llama.cpp ngram-mod": tally([6.0, 5.0], ["a", "x"], n=10, acc=4),
        "kvserve plain": tally([8.0], ["a", "b"]),
        "kvserve suffix": tally([4.0], ["a", "b"]),
    }
    servers = {n: n.split()[0] for n in tallies}
    rows = {r["variant"]: r for r in spec_peer.summarize(tallies, servers)}
    assert rows["llama.cpp ngram-mod"]["vs_own_plain"] == pytest.approx(5.5 / 11.0)
    assert rows["llama.cpp ngram-mod"]["acceptance"] == pytest.approx(0.4)
    assert rows["llama.cpp ngram-mod"]["same_text"] == "1/2"
    assert rows["kvserve suffix"]["vs_own_plain"] == pytest.approx(0.5)
    assert rows["kvserve suffix"]["vs_llama_plain"] == pytest.approx(4.0 / 11.0)
    assert rows["kvserve suffix"]["same_text"] == "2/2"
    assert "kvserve suffix" in spec_peer.format_rows(list(rows.values()))

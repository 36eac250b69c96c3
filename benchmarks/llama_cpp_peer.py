"""How compare.py starts llama.cpp's `llama-server` (built by scripts/build-llama-cpp.sh; never in
the tests or CI): its command line, context size and the options this build knows."""

from __future__ import annotations

import subprocess


def llama_cpp_argv(
    binary: str,
    gguf: str,
    port: int,
    slots: int,
    max_len: int,
    threads: int,
    extra_args: list[str],
    longest: int = 0,
    unified_kv: bool = False,
) -> list[str]:
    """llama.cpp's server with one slot per concurrent request (continuous batching is its default)
    and `threads` threads for decode and for prompt batches."""
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--parallel", str(slots)]
    argv += ["--ctx-size", str(llama_cpp_ctx_size(slots, max_len, longest, unified_kv))]
    argv += ["--kv-unified"] if unified_kv else []
    return [*argv, "--threads", str(threads), "--threads-batch", str(threads), *extra_args]


def llama_cpp_ctx_size(slots: int, max_len: int, longest: int, unified_kv: bool) -> int:
    """Without a unified KV cache the context is split evenly across slots, so each must get
    max(`max_len`, `longest`) tokens; with one (`--kv-unified`) any slot may use the whole context,
    which then only has to hold every slot's `max_len` or one `longest` request."""
    if unified_kv:
        return max(slots * max_len, longest)
    return slots * max(max_len, longest)


def llama_cpp_help(binary: str) -> str:
    """This build's `--help` text ("" if it cannot be run)."""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout + out.stderr


def has_option(help_text: str, option: str) -> bool:
    """Whether `option` (e.g. "--kv-unified") is one of the flags `help_text` lists."""
    return any(option in line.replace(",", " ").split() for line in help_text.splitlines())


def llama_cpp_build_isa(binary: str) -> str:
    """The ISA options scripts/build-llama-cpp.sh switched on for this binary (its build-isa.txt
    beside the build folder), or a note that they are unknown."""
    from pathlib import Path

    for folder in Path(binary).resolve().parents[:3]:
        isa = folder / "build-isa.txt"
        if isa.is_file():
            return f"llama.cpp built with {isa.read_text().strip()}"
    return "llama.cpp build options unknown (not built by scripts/build-llama-cpp.sh)"

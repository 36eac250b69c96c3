"""Every `kvserve serve` option in one table: CLI flag, KVSERVE_* environment variable and YAML key,
with precedence CLI > environment > config file > default, turned into the frozen configs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import (
    DTYPES,
    KV_CACHE_DTYPES,
    POOLINGS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.core.lora import parse_lora_modules, read_adapter_spec
from engine.text import REASONING_PARSER_NAMES, TOOL_PARSERS
from server.distributed.config import ROUTERS, RayConfig
from server.state import ServerConfig

ENV_PREFIX = "KVSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TARGETS: dict[str, type] = {
    "server": ServerConfig,
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "engine": EngineConfig,
    "lora": LoRAConfig,
    "ray": RayConfig,
}
# vLLM's switch for the runtime LoRA routes, read when KVSERVE_ALLOW_RUNTIME_LORA_UPDATING is unset.
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# vLLM's switch for its development routes (POST /reset_prefix_cache), read when
# KVSERVE_SERVER_DEV_MODE is unset.
VLLM_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '1048576', '512MiB', '4GB', '2g' (binary units with 'i' or a bare letter)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"expected a size such as 512MiB or 4GB, got {text!r}")
    number, unit, binary = match.groups()
    power = " kmgt".index(unit.lower()) if unit else 0
    base = 1024 if (binary or (unit and not text.strip().lower().endswith("b"))) else 1000
    return int(float(number) * base**power)


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


parse_json_object.__name__ = "JSON object"  # argparse says "invalid JSON object value: ..."

# Variables the server itself gives the chat template; chat_template_kwargs cannot set them.
TEMPLATE_OWN_VARIABLES = ("messages", "tools", "add_generation_prompt", "chat_template", "tokenize")


class _ReasonedValueError(ValueError, argparse.ArgumentTypeError):
    """A bad option value whose reason argparse prints too (it hides a plain ValueError's)."""


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object that leaves the server's own variables alone."""
    value = parse_json_object(text)
    own = [key for key in value if key in TEMPLATE_OWN_VARIABLES]
    if own:
        raise _ReasonedValueError(
            f"cannot set {', '.join(map(repr, own))}: the server gives the chat template "
            "that variable itself"
        )
    return value


parse_template_kwargs.__name__ = "chat template kwargs"


def parse_optional_str(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class Option:
    name: str  # the flag without dashes: "max-model-len"
    target: str  # "<group>.<field>": server, model, cache, scheduler or engine
    parse: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    is_bool: bool = False
    metavar: str | None = None
    many: bool = False  # one or more values after the flag; `parse` takes the text or the list

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def default(self) -> Any:
        group, field = self.target.split(".")
        return {f.name: f for f in dataclasses.fields(_TARGETS[group])}[field].default


def _int(text: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none", "auto") else _float(text)


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else _int(text)


def _optional_size(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else parse_size(text)


class _OptionError(argparse.ArgumentTypeError, ValueError):
    """A value error argparse shows with its message (it hides a plain ValueError's)."""


def _kv_events_config(text: str) -> KVEventsConfig | None:
    try:
        return KVEventsConfig.parse(text)
    except (TypeError, ValueError) as e:
        raise _OptionError(str(e)) from None


def _speculative_config(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise _OptionError(str(e)) from None


def parse_lora_module_list(value: Any) -> tuple[tuple[str, str], ...]:
    """--lora-modules: `name=path` entries or vLLM's JSON objects ({"name", "path",
    "base_model_name"}); as one text (environment), a JSON list or entries separated by blanks."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise _OptionError(f"expected a JSON list of LoRA modules ({e})") from None
        else:
            value = [text] if text.startswith("{") else text.split()
    try:
        return parse_lora_modules(value)
    except ValueError as e:
        raise _OptionError(str(e)) from None


OPTIONS: tuple[Option, ...] = (
    Option("host", "server.host", str, "address to listen on (0.0.0.0 for all interfaces)"),
    Option("port", "server.port", _int, "TCP port"),
    Option(
        "served-model-name",
        "server.served_model_name",
        parse_optional_str,
        "model id clients use; default: the model's name",
    ),
    Option(
        "api-key",
        "server.api_key",
        parse_optional_str,
        "require 'Authorization: Bearer KEY' on every route but /health",
    ),
    Option(
        "allowed-origins",
        "server.allowed_origins",
        parse_list,
        "comma-separated CORS origins; CORS is off when empty",
    ),
    Option(
        "engine-page",
        "server.engine_page",
        parse_bool,
        "serve the live engine page at /engine (behind the API key)",
        is_bool=True,
    ),
    Option(
        "max-request-body-bytes",
        "server.max_request_body_bytes",
        parse_size,
        "largest accepted request body (e.g. 8MiB)",
    ),
    Option(
        "shutdown-timeout",
        "server.shutdown_timeout",
        _float,
        "seconds running requests may take to finish after SIGTERM/Ctrl-C",
    ),
    Option("log-level", "server.log_level", str.lower, "logging level", choices=LOG_LEVELS),
    Option(
        "tool-call-parser",
        "server.tool_call_parser",
        str,
        "tool-call format to parse (and force): auto = from the chat template (hermes when it "
        "has no tool support; the tools are then described in the prompt)",
        choices=("auto", *TOOL_PARSERS),
    ),
    Option(
        "reasoning-parser",
        "server.reasoning_parser",
        str,
        "reasoning format of chat outputs, returned apart from the answer: auto = from the chat "
        "template (qwen3 when it writes <think> tags or takes enable_thinking); none = off",
        choices=REASONING_PARSER_NAMES,
    ),
    Option(
        "chat-template-kwargs",
        "server.chat_template_kwargs",
        parse_template_kwargs,
        'default variables for the chat template, a JSON object (e.g. \'{"enable_thinking": '
        "false}'); a request's chat_template_kwargs override them",
        metavar="JSON",
    ),
    Option(
        "max-score-choices",
        "server.max_score_choices",
        _int,
        "most choices one /v1/score request may hold",
    ),
    Option(
        "responses-store-size",
        "server.responses_store_size",
        _int,
        "Responses API responses kept for previous_response_id and GET (least recently used "
        "evicted first; 0 keeps none)",
    ),
    Option(
        "dtype",
        "model.dtype",
        str,
        "activation (and float weight) dtype; auto = float32 on CPU (bfloat16 for a bf16 "
        "checkpoint on a CPU with native bf16 with --quantization none), bfloat16 on CUDA; the "
        "block formats (gguf, int8, int4) take auto or float32",
        choices=DTYPES,
    ),
    Option("device", "model.device", str, "auto, cpu, cuda or cuda:N"),
    Option(
        "max-model-len",
        "model.max_model_len",
        _optional_int,
        "longest prompt + completion in tokens; default: the model's",
    ),
    Option(
        "task",
        "model.task",
        str,
        "generate (completions, chat) or embed (/v1/embeddings); auto: as the model's files tell",
        choices=("auto", "generate", "embed"),
    ),
    Option("pooling", "model.pooling", str, "pooling for embedding models", choices=POOLINGS),
    Option(
        "chat-template",
        "model.chat_template",
        parse_optional_str,
        "chat template: a Jinja file or an inline template",
    ),
    Option(
        "cache-dir",
        "model.cache_dir",
        parse_optional_str,
        "where converted .gguf models are cached; default ~/.cache/kvserve",
    ),
    Option(
        "seed",
        "model.seed",
        _int,
        "seeds the engine's random generator once at start-up (requests without a `seed` draw "
        "from it, so they are not reproducible one by one; give a request `seed` for that)",
    ),
    Option(
        "quantization",
        "model.quantization",
        parse_optional_str,
        "weight format: auto = a .gguf model's own blocks (gguf), else int8, on x86 CPUs with "
        "AVX2 (float weights elsewhere); int8 = Q8_0 blocks; int4 = Q4_1 blocks (Q8_0 head); "
        "gguf = the blocks the .gguf file stores, exactly (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K; "
        "others "
        "as Q8_0); all "
        "with int8 activations per row and block of 32 (batch-invariant); none = float weights",
        choices=("auto", "none", "int8", "int4", "gguf"),
    ),
    Option(
        "compile",
        "model.compile",
        parse_bool,
        "torch.compile each layer's dense part (adds start-up time)",
        is_bool=True,
    ),
    Option(
        "threads",
        "model.num_threads",
        _optional_int,
        "torch intra-op threads for the model; default: torch's choice",
    ),
    Option(
        "cuda-graphs",
        "model.cuda_graphs",
        parse_bool,
        "replay decode steps from captured CUDA graphs (CUDA only)",
        is_bool=True,
    ),
    Option("block-size", "cache.block_size", _int, "tokens per KV-cache block (a power of two)"),
    Option(
        "num-kv-blocks",
        "cache.num_blocks",
        _optional_int,
        "KV-cache blocks; wins over --kv-cache-memory",
    ),
    Option(
        "kv-cache-memory",
        "cache.kv_cache_memory",
        _optional_size,
        "KV-cache size (e.g. 2GiB); default: picked for the device",
    ),
    Option(
        "kv-cache-dtype",
        "cache.kv_cache_dtype",
        str,
        "element type of the KV cache: auto = on CPU under block-quantized weights (gguf, int8, "
        "int4) bfloat16 where the C++ kernels' AVX-512 BF16 attention runs (bf16 dot products), "
        "else float16; otherwise the model's dtype. float16 or bfloat16 under float32 weights "
        "needs the C++ CPU kernels",
        choices=KV_CACHE_DTYPES,
    ),
    Option(
        "enable-prefix-caching",
        "cache.enable_prefix_caching",
        parse_bool,
        "reuse KV blocks of shared prompt prefixes",
        is_bool=True,
    ),
    Option(
        "kv-offload-memory",
        "cache.kv_offload_memory",
        _optional_size,
        "host-memory tier for KV blocks evicted from the prefix cache (e.g. 2GiB); default: none",
    ),
    Option(
        "kv-offload-dir",
        "cache.kv_offload_dir",
        parse_optional_str,
        "directory of a disk tier for evicted KV blocks (kept across restarts); default: none",
    ),
    Option(
        "kv-offload-disk",
        "cache.kv_offload_disk",
        _optional_size,
        "size of the disk tier (e.g. 20GiB); default: 10GiB",
    ),
    Option("max-num-seqs", "scheduler.max_num_seqs", _int, "sequences running in one engine step"),
    Option(
        "max-num-batched-tokens",
        "scheduler.max_num_batched_tokens",
        _int,
        "tokens per engine step (decodes + prefill chunks)",
    ),
    Option(
        "target-step-ms",
        "scheduler.target_step_ms",
        _optional_float,
        "CPU: the step time prefill chunks aim at while streams decode, so they keep getting "
        "tokens; auto (the default): 200 under block-quantized weights, else 0; "
        "0: --max-num-batched-tokens every step",
    ),
    Option(
        "max-queued-requests",
        "scheduler.max_queued_requests",
        _int,
        "waiting requests beyond which new ones get 429",
    ),
    Option(
        "max-queued-tokens",
        "scheduler.max_queued_tokens",
        _optional_int,
        "waiting prompt tokens beyond which new requests get 429; unset: 32 x max-num-batched-tokens",
    ),
    Option(
        "speculative-config",
        "engine.speculative_config",
        _speculative_config,
        "speculative decoding as vLLM's JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\'',
        metavar="JSON",
    ),
    Option(
        "kv-events-config",
        "engine.kv_events_config",
        _kv_events_config,
        "publish KV cache events (vLLM's JSON and wire format) for KV-aware routers, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\'',
        metavar="JSON",
    ),
    Option(
        "log-stats-interval",
        "engine.log_stats_interval",
        _float,
        "seconds between engine stats log lines (0 disables)",
    ),
    Option(
        "lora-modules",
        "lora.modules",
        parse_lora_module_list,
        "LoRA adapters served from start-up, each as name=path (a PEFT folder) or vLLM's JSON "
        '\'{"name": "sql", "path": "/adapters/sql"}\'; a request selects one by its `model` '
        "(name, or base:name)",
        metavar="NAME=PATH",
        many=True,
    ),
    Option(
        "max-loras",
        "lora.max_loras",
        _int,
        "distinct LoRA adapters one engine step runs (requests for others wait)",
    ),
    Option(
        "max-lora-rank",
        "lora.max_lora_rank",
        _int,
        "largest LoRA rank accepted, at start-up and by /v1/load_lora_adapter",
    ),
    Option(
        "enable-lora",
        "server.enable_lora",
        parse_bool,
        "accepted for vLLM's command lines: LoRA adapters are always available",
        is_bool=True,
    ),
    Option(
        "allow-runtime-lora-updating",
        "server.allow_runtime_lora_updating",
        parse_bool,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter; unset: on when --api-key "
        "is set (behind it), else off (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING is read too)",
        is_bool=True,
    ),
    Option(
        "server-dev-mode",
        "server.server_dev_mode",
        parse_bool,
        "serve vLLM's development route POST /reset_prefix_cache without --api-key (with a key it "
        "is always on, behind the key; vLLM's VLLM_SERVER_DEV_MODE is read too)",
        is_bool=True,
    ),
    Option(
        "replicas",
        "ray.replicas",
        _int,
        "kvserve replicas on Ray Serve, one engine each (needs the ray extra); 0 = this process",
    ),
    Option(
        "ray-address",
        "ray.ray_address",
        parse_optional_str,
        "join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of starting a local one",
    ),
    Option("replica-cpus", "ray.replica_cpus", float, "CPUs Ray reserves for each replica"),
    Option("replica-gpus", "ray.replica_gpus", float, "GPUs Ray reserves for each replica"),
    Option(
        "min-replicas",
        "ray.min_replicas",
        _optional_int,
        "autoscaling lower bound; default: 1 when --max-replicas is set",
    ),
    Option(
        "max-replicas",
        "ray.max_replicas",
        _optional_int,
        "autoscaling upper bound; autoscaling is off when unset",
    ),
    Option(
        "target-ongoing-requests",
        "ray.target_ongoing_requests",
        _float,
        "autoscaling target of in-flight requests per replica",
    ),
    Option(
        "max-ongoing-requests",
        "ray.max_ongoing_requests",
        _int,
        "in-flight requests Ray sends one replica at most (more wait in Ray's router)",
    ),
    Option(
        "request-router",
        "ray.request_router",
        str,
        "how Ray picks a replica: prefix (prompt-prefix affinity) or pow2 (Ray's default)",
        choices=ROUTERS,
    ),
)
OPTIONS_BY_DEST = {o.dest: o for o in OPTIONS}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags parse to SUPPRESS when absent, so the caller can tell a given flag from a default."""
    parser.add_argument(
        "model",
        nargs="?",
        default=argparse.SUPPRESS,
        help="a Hugging Face folder, a .gguf file or a hub id in the local HF cache "
        "(default: the bundled SmolLM2-135M-Instruct, or all-MiniLM-L6-v2 with --task embed; "
        f"env: {ENV_PREFIX}MODEL)",
    )
    parser.add_argument(
        "--model",
        dest="model_option",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="the model as a flag (vLLM's spelling); the same as the positional argument",
    )
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE.yaml",
        help=f"YAML file of options (keys as the flag names); CLI > env > file > default (env: {ENV_PREFIX}CONFIG)",
    )
    for opt in OPTIONS:
        shown = "unset" if opt.default in (None, ()) else opt.default
        text = f"{opt.help} (default: {shown}; env: {opt.env})"
        if opt.is_bool:
            parser.add_argument(
                f"--{opt.name}",
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
        elif opt.many:  # the list is parsed whole by resolve()
            parser.add_argument(
                f"--{opt.name}",
                nargs="+",
                default=argparse.SUPPRESS,
                metavar=opt.metavar or opt.dest.upper(),
                help=text,
            )
        else:
            parser.add_argument(
                f"--{opt.name}",
                type=_argparse_type(opt.parse),
                choices=opt.choices,
                default=argparse.SUPPRESS,
                metavar=opt.metavar or opt.dest.upper(),
                help=text,
            )


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for argparse: a bad value's message as the environment and config file give it,
    not argparse's "invalid <function name> value"."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _convert(opt: Option, value: Any, source: str) -> Any:
    try:
        if opt.many and value is not None:
            result = opt.parse(value)
        elif isinstance(value, str):
            result = opt.parse(value)
        elif value is None:
            result = None
        elif opt.is_bool:
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            result = value
        elif isinstance(value, dict):
            # A config file's mapping (chat-template-kwargs, speculative-config).
            result = opt.parse(json.dumps(value))
        elif isinstance(value, (list, tuple)):
            result = tuple(str(v) for v in value)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"unexpected value {value!r}")
        else:
            result = opt.parse(str(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    if opt.choices is not None and result is not None and result not in opt.choices:
        raise ValueError(f"{source}: must be one of {', '.join(opt.choices)}, got {result!r}")
    return result


def read_config_file(path: str) -> dict[str, Any]:
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"config file {file} does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {file} must be a mapping of option names to values")
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest == "model":
            values["model"] = None if value is None else str(value)
            continue
        opt = OPTIONS_BY_DEST.get(dest)
        if opt is None:
            known = ", ".join(sorted(["model", *OPTIONS_BY_DEST]))
            raise ValueError(f"config file {file}: unknown option {key!r}; known options: {known}")
        values[dest] = _convert(opt, value, f"config file {file}, option {key!r}")
    return values


def resolve(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flat option values: CLI > environment > config file > defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {opt.dest: opt.default for opt in OPTIONS}
    values["model"] = None
    config_path = cli.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        values.update(read_config_file(config_path))
    if environ.get(ENV_PREFIX + "MODEL"):
        values["model"] = environ[ENV_PREFIX + "MODEL"]
    for opt in OPTIONS:
        if opt.env in environ:
            values[opt.dest] = _convert(opt, environ[opt.env], f"environment variable {opt.env}")
    runtime_lora = OPTIONS_BY_DEST["allow_runtime_lora_updating"]
    if runtime_lora.env not in environ and environ.get(VLLM_RUNTIME_LORA_ENV):
        source = f"environment variable {VLLM_RUNTIME_LORA_ENV}"
        values[runtime_lora.dest] = _convert(runtime_lora, environ[VLLM_RUNTIME_LORA_ENV], source)
    dev_mode = OPTIONS_BY_DEST["server_dev_mode"]
    if dev_mode.env not in environ and environ.get(VLLM_DEV_MODE_ENV):
        source = f"environment variable {VLLM_DEV_MODE_ENV}"
        values[dev_mode.dest] = _convert(dev_mode, environ[VLLM_DEV_MODE_ENV], source)
    cli = dict(cli)
    if "model_option" in cli:
        flag = cli.pop("model_option")
        if cli.get("model") not in (None, flag):
            raise ValueError(f"two models given: {cli['model']!r} and --model {flag!r}")
        cli["model"] = flag
    for key, value in cli.items():
        given = OPTIONS_BY_DEST.get(key)
        if given is not None and given.many:
            value = _convert(given, value, f"--{given.name}")
        if key != "config":
            values[key] = value
    return values


def build_configs(values: Mapping[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """The frozen engine and server configs; a bad combination raises ValueError."""
    groups: dict[str, dict[str, Any]] = {name: {} for name in _TARGETS}
    for opt in OPTIONS:
        group, field = opt.target.split(".")
        groups[group][field] = values[opt.dest]
    engine_config = EngineConfig(
        model=ModelConfig(model=values.get("model"), **groups["model"]),
        cache=CacheConfig(**groups["cache"]),
        scheduler=SchedulerConfig(**groups["scheduler"]),
        lora=LoRAConfig(**groups["lora"]),
        **groups["engine"],
    )
    return engine_config, ServerConfig(**groups["server"])


def check_lora_modules(config: LoRAConfig, base: str | None = None) -> None:
    """Read each --lora-modules folder's adapter_config.json before the model loads, so a wrong path
    or rank is a start-up error at once (the engine checks the tensors against the model); an
    adapter named as the base model's id `base` could never be selected."""
    for name, path in config.modules:
        if name == base:
            raise ValueError(
                f"--lora-modules {name}: the adapter name is the base model's id; give the "
                "adapter its own name"
            )
        try:
            read_adapter_spec(path, config.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}: {e}") from None


def build_ray_config(values: Mapping[str, Any]) -> RayConfig:
    """The Ray Serve settings (replicas, resources, autoscaling, router); ValueError when bad."""
    fields = {
        opt.target.split(".")[1]: values[opt.dest]
        for opt in OPTIONS
        if opt.target.startswith("ray.")
    }
    return RayConfig(**fields)

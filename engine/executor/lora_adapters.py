"""The LoRA adapters an engine serves: read and checked off the step thread, installed between steps,
selected by name when a request is added, pinned by the requests that run on them, and freed after
an unload once the last of those has finished."""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

from engine.core.errors import LoRAError, LoRANotFoundError
from engine.core.lora import LoRAConfig, LoRAInfo, check_lora_name, read_adapter_spec
from engine.core.request import RequestGroup
from engine.models.lora_weights import LoRAAdapter, load_adapter

logger = logging.getLogger(__name__)


class LoRAAdapters:
    def __init__(self, model: Any, config: LoRAConfig, refuse: bool = False) -> None:
        self.model = model
        self.config = config
        self.refuse = refuse  # a model that takes no adapters (an encoder): every load fails
        self.served: dict[str, LoRAAdapter] = {}  # name -> the adapter new requests get
        # lora id -> weights the runner reads: the served ones and unloaded ones still pinned.
        self.by_id: dict[int, LoRAAdapter] = {}
        self.pins: dict[int, int] = {}  # lora id -> unfinished request groups on it
        # prefix-cache namespace -> the name last loaded with it (KV events name blocks by it)
        self.namespace_names: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # read() runs on worker threads

    def load_all(self) -> None:
        """The adapters named at start-up; a bad one raises LoRAError (engine construction fails)."""
        for name, path in self.config.modules:
            self.install(self.read(name, path))

    # -- loading -------------------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter's files for this model (blocking; serves nothing yet)."""
        check_lora_name(name)
        if self.refuse:
            raise LoRAError(
                f"{type(self.model).__name__} takes no LoRA adapters (decoder models do)",
                "lora_path",
            )
        if name in self.served:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        spec = read_adapter_spec(path, self.config.max_lora_rank)
        with self._lock:
            lora_id = next(self._ids)
        return load_adapter(self.model, spec, name, lora_id)

    def install(self, adapter: LoRAAdapter) -> LoRAInfo:
        """Serve a read adapter (between steps)."""
        name = adapter.info.name
        if name in self.served:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        self.served[name] = adapter
        self.by_id[adapter.lora_id] = adapter
        self.namespace_names[namespace_of(adapter)] = name
        logger.info(
            "LoRA adapter %s loaded: rank %d, %s, %.1f MiB (%s)",
            name, adapter.info.rank, ",".join(adapter.info.target_modules),
            adapter.num_bytes / (1 << 20), adapter.info.content_hash[:12],
        )  # fmt: skip
        return adapter.info

    def unload(self, name: str) -> None:
        """Stop serving `name`: new requests naming it fail now; running ones finish on it."""
        adapter = self.served.pop(name, None)
        if adapter is None:
            raise LoRANotFoundError(name, self.names())
        self._free_if_unused(adapter.lora_id)
        logger.info("LoRA adapter %s unloaded", name)

    # -- requests ------------------------------------------------------------------------------
    def select(self, group: RequestGroup, name: str | None) -> None:
        """Put `group` on the adapter `name` (None: the base model); LoRANotFoundError if absent.
        Its KV is namespaced by the adapter's content, so only the same weights share its blocks."""
        if name is None:
            return
        adapter = self.selected(name)
        group.lora_name = name
        group.lora_id = adapter.lora_id
        group.cache_namespace = namespace_of(adapter)

    def selected(self, name: str) -> LoRAAdapter:
        adapter = self.served.get(name)
        if adapter is None:
            raise LoRANotFoundError(name, self.names())
        return adapter

    def pin(self, group: RequestGroup) -> None:
        self.pin_id(group.lora_id)

    def pin_id(self, lora_id: int | None) -> None:
        if lora_id is not None:
            self.pins[lora_id] = self.pins.get(lora_id, 0) + 1

    def release(self, group: RequestGroup) -> None:
        """The group has ended: unpin its adapter (freed if it was unloaded meanwhile)."""
        self.release_id(group.lora_id)

    def release_id(self, lora_id: int | None) -> None:
        if lora_id is None or lora_id not in self.pins:
            return
        self.pins[lora_id] -= 1
        if self.pins[lora_id] <= 0:
            del self.pins[lora_id]
            self._free_if_unused(lora_id)

    def _free_if_unused(self, lora_id: int) -> None:
        if lora_id in self.pins:
            return
        adapter = self.by_id.get(lora_id)
        if adapter is not None and self.served.get(adapter.info.name) is not adapter:
            del self.by_id[lora_id]

    # -- views ---------------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return tuple(self.served)

    def infos(self) -> tuple[LoRAInfo, ...]:
        return tuple(a.info for a in self.served.values())


def namespace_of(adapter: LoRAAdapter) -> str:
    """The prefix-cache namespace of requests on `adapter`: its weights' content, not its name."""
    return "lora:" + adapter.info.content_hash

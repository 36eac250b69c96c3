"""The models one server answers to: its base model and the LoRA adapters its engine serves. The one
place a request's `model` becomes what it runs on (the base model; an adapter by its name or by
SGLang's "base:name"), and the cards `GET /v1/models` lists (an adapter's `parent` is the base
model, its `root` the adapter's folder, as vLLM lists them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine import EngineClient, LoRAError, LoRAInfo
from server.errors import model_not_found
from server.protocol import ModelCard


@dataclass(frozen=True)
class ServedModel:
    """What a request's `model` selects."""

    name: str  # what its response says it ran: the request's own spelling (the base id if omitted)
    lora: str | None = None  # the adapter it runs on (None: the base model)


def resolve_model(requested: str | None, base: str, engine: EngineClient | None) -> ServedModel:
    """The base model for None or its id; an adapter for its name or "<base>:<name>"; else a 404
    listing what is served. The adapters are only looked up for a name that is not the base."""
    if requested is None or requested == base:
        return ServedModel(base)
    adapters = [info.name for info in engine.loras()] if engine is not None else []
    if requested in adapters:
        return ServedModel(requested, requested)
    head, sep, tail = requested.rpartition(":")  # adapter names have no ':'; a base id may
    if sep and head == base and tail in adapters:
        return ServedModel(requested, tail)
    raise model_not_found(requested, [base, *adapters])


def check_adapter_names(engine: EngineClient, base: str) -> None:
    """An adapter named as the base model could never be selected: a LoRAError at start-up."""
    if any(info.name == base for info in engine.loras()):
        raise LoRAError(
            f"the adapter name {base!r} is the base model's id; give the adapter its own name",
            "lora_name",
        )


def base_card(engine: EngineClient, model_id: str, created: int) -> ModelCard:
    return ModelCard(
        id=model_id, created=created, root=engine.model_name, max_model_len=engine.max_model_len
    )


def adapter_card(info: LoRAInfo, base: str) -> ModelCard:
    return ModelCard(id=info.name, created=info.created, root=info.path, parent=base)


def model_cards(engine: EngineClient, base: str, created: int) -> list[ModelCard]:
    """The base model's card, then one per served adapter in the engine's order."""
    adapters: Sequence[LoRAInfo] = engine.loras()
    return [base_card(engine, base, created), *(adapter_card(i, base) for i in adapters)]


def model_card(engine: EngineClient, base: str, created: int, requested: str) -> ModelCard:
    """The card of the model `requested` selects (an adapter's for "<base>:<name>" too); 404 else."""
    served = resolve_model(requested, base, engine)
    if served.lora is None:
        return base_card(engine, base, created)
    info = next(i for i in engine.loras() if i.name == served.lora)
    return adapter_card(info, base)

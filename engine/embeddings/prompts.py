"""Instruction prompts of a sentence-transformers folder (`config_sentence_transformers.json`:
`prompts` and `default_prompt_name`), resolved per request as `SentenceTransformer.encode` does.
No torch: the server reads them through the engine client."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.errors import InvalidRequestError

CONFIG_FILE = "config_sentence_transformers.json"


@dataclass(frozen=True)
class EmbeddingPrompts:
    """Named prompt texts, prepended to a text input before it is tokenized (Qwen3-Embedding's
    "query" instruction, E5's "query: " / "passage: "); `default_name` is applied when a request
    names none, like `encode` with no `prompt_name`."""

    prompts: dict[str, str] = field(default_factory=dict)
    default_name: str | None = None

    def text_for(self, name: str | None) -> str:
        """The prompt text for a request's `prompt_name` (None: the folder's default, else none)."""
        if name is None:
            return self.prompts.get(self.default_name, "") if self.default_name else ""
        if name not in self.prompts:
            known = ", ".join(repr(k) for k in self.prompts) or "none"
            raise InvalidRequestError(
                f"prompt_name {name!r} is not one of this model's prompts ({known}; from its "
                f"{CONFIG_FILE})",
                "prompt_name",
            )
        return self.prompts[name]


def read_prompts(model_dir: Path) -> EmbeddingPrompts:
    """The folder's prompts (none when it has no config_sentence_transformers.json); ValueError
    for a file sentence-transformers would refuse too."""
    config_file = Path(model_dir) / CONFIG_FILE
    if not config_file.is_file():
        return EmbeddingPrompts()
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {config_file}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must be a JSON object")
    raw = config.get("prompts") or {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str | None) for k, v in raw.items()
    ):
        raise ValueError(f"{config_file}: prompts must map prompt names to texts")
    prompts = {name: text or "" for name, text in raw.items()}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(
            f"{config_file}: default_prompt_name {default!r} is not one of its prompts "
            f"({', '.join(repr(k) for k in prompts) or 'none'})"
        )
    return EmbeddingPrompts(prompts, default)

"""vLLM's JSON-valued options (`--kv-events-config`, `--speculative-config`, ...) read into a mapping
the same way everywhere (no torch): JSON text or a dict; None, '' and 'null' mean the option is off."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def config_mapping(
    value: str | Mapping[str, Any] | None, what: str, example: str
) -> Mapping[str, Any] | None:
    """The option's fields, or None when it is off. `what` names the option in errors ("kv events
    config"); `example` is a JSON object shown when the value is not one."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip() or value.strip().lower() in ("null", "none"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
        if value is None:
            return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object such as {example}")
    return value

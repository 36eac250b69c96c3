"""The prompt token ids of a request as a replica will compute them, for routing by KV state: the
ingress loads the served model's tokenizer and renders chat requests through the same chat
template code a replica uses (tools included). None when a request's prompt is not rendered here
(other surfaces, a body a replica will refuse): the router then falls back to its text guess."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from engine import Tokenizer, resolve_model
from server.errors import APIError
from server.field_map import CHAT_FIELDS
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.serving_chat import apply_template, chat_turn
from server.serving_completions import _prompts
from server.state import ServerConfig
from server.tool_calling import tool_plan

logger = logging.getLogger(__name__)


class RoutingTokenizer:
    def __init__(self, tokenizer: Tokenizer, server_config: ServerConfig) -> None:
        self.tokenizer = tokenizer
        self.config = server_config

    @classmethod
    def load(cls, values: Mapping[str, Any]) -> RoutingTokenizer | None:
        """The served model's tokenizer (None, with a warning, when it cannot be loaded here)."""
        from server.settings import build_configs

        try:
            engine_config, server_config = build_configs(values)
            mc = engine_config.model
            tokenizer = Tokenizer.from_pretrained(
                resolve_model(mc.model, mc.cache_dir), mc.chat_template
            )
        except Exception as e:  # noqa: BLE001 - routing falls back to the prompt text
            logger.warning("routing by KV state is off: cannot load the tokenizer: %s", e)
            return None
        return cls(tokenizer, server_config)

    def tokens(self, path: str, body: bytes) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                return self._chat(ChatCompletionRequest.model_validate_json(body))
            if path.endswith("/completions"):
                return _prompts(CompletionRequest.model_validate_json(body), self.tokenizer)[0][1]
        except (ValidationError, APIError):
            return None  # the replica answers it with its own 400
        except Exception as e:  # noqa: BLE001 - routing never fails a request
            logger.debug("no routing tokens for %s: %s", path, e)
            return None
        return None

    def _chat(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        turn = chat_turn(req)
        plan = tool_plan(
            turn,
            tok.chat_template,
            self.config.tool_call_parser,
            turn.constraint,
            CHAT_FIELDS,
            tok.added_tokens,
        )
        kwargs = {**(self.config.chat_template_kwargs or {}), **turn.template_kwargs}
        ids, _ = apply_template(
            tok,
            turn.messages,
            turn.add_generation_prompt,
            plan,
            kwargs,
            add_special_tokens=turn.add_special_tokens,
        )
        return ids

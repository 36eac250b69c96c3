"""A surface's names for the fields of the chat-shaped request it is planned as: `messages[3]` is
`input[2]` in Responses, `max_completion_tokens` is Messages' `max_tokens`. Errors name fields through
it when they are worded, so a message and its `param` always say the same name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FieldMap:
    """Chat request field paths (and the engine's input) -> this surface's."""

    prompt: str = "messages"  # what an engine prompt error names: the surface's whole input
    fields: Mapping[str, str] = field(default_factory=dict)  # chat top-level field -> surface path
    # Chat message index -> the surface path it came from (None: chat's own messages[i]).
    message_sources: tuple[str, ...] | None = None
    # A chat tool's `function.<field>` -> the surface's flat tool field (None: chat's own shape).
    tool_fields: Mapping[str, str] | None = None
    # A tool answer (chat's tool message) that answers no earlier call, in this surface's terms:
    # the message ({where}: the answer's path, {id}: its call id) and the answer's id field.
    tool_answer: str = (
        "{where} is a tool message answering tool_call_id {id!r}, but no earlier assistant "
        "message has a tool call with that id"
    )
    tool_answer_id: str = "tool_call_id"
    # What a prompt that fits the model, but not with the asked max tokens after it, blames
    # (None: the prompt, OpenAI's way; Messages blames its max_tokens, Anthropic's way).
    over_length: str | None = None

    def name(self, path: str) -> str:
        """The surface's name for a chat field path (a path outside the map is its own name)."""
        head, sep, rest = path.partition(".")
        if head == "prompt":
            return self.prompt
        if head.startswith("messages") and self.message_sources is not None:
            return self._message(head)
        if head.startswith("tools[") and self.tool_fields is not None:
            if rest.startswith("function"):
                fn_field = rest.removeprefix("function").removeprefix(".")
                name, dot, deeper = fn_field.partition(".")
                return head + (
                    "." + self.tool_fields.get(name, name) + dot + deeper if name else ""
                )
        if head in self.fields:
            return self.fields[head]
        return path

    def _message(self, head: str) -> str:
        assert self.message_sources is not None
        if head.startswith("messages["):
            index = head[len("messages[") : head.find("]")]
            if index.isdigit() and int(index) < len(self.message_sources):
                return self.message_sources[int(index)]
        return self.prompt


CHAT_FIELDS = FieldMap()
COMPLETION_FIELDS = FieldMap(prompt="prompt")
EMBEDDING_FIELDS = FieldMap(prompt="input")

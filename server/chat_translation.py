"""What the Responses and Messages surfaces share: their request planned as a chat-shaped request (its
errors named through the surface's FieldMap), and the skeleton of their event streams over the turn
events of the one sample they ask for."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engine import RequestOutput
from server.errors import validation_error
from server.field_map import FieldMap
from server.plan import GenerationPlan
from server.protocol import ChatCompletionRequest
from server.serving_chat import prepare_chat
from server.state import ServerState
from server.streaming import FrameStream
from server.turn import Turn, TurnDelta


def plan_as_chat(
    fields: dict[str, Any], names: FieldMap, state: ServerState, request_id: str
) -> GenerationPlan:
    """Validate a surface's translated fields as a chat request and plan it; every 400 names the
    surface's own field through `names`."""
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error([dict(err) for err in e.errors()], fields=names) from None
    return prepare_chat(chat, state, request_id=request_id, fields=names)


class TurnEvents(FrameStream):
    """Base of the Responses and Messages event streams: delta engine outputs -> turn deltas -> the
    subclass's frames, then the frames that close the finished turn."""

    def __init__(self, plan: GenerationPlan) -> None:
        self.plan = plan
        self.fields = plan.fields
        self.turns = plan.turn_stream()
        self.cached = 0  # prompt tokens served from the prefix cache

    def _delta_frames(self, delta: TurnDelta) -> list[str]:
        raise NotImplementedError

    def _output_frames(self, index: int, output: RequestOutput) -> list[str]:
        self.cached = output.num_cached_tokens
        frames: list[str] = []
        for out in output.outputs:
            for delta in self.turns.feed(out).deltas:
                frames += self._delta_frames(delta)
        return frames

    def _turn_frames(self, turn: Turn) -> list[str]:
        """The frames that end the stream of the finished `turn`."""
        raise NotImplementedError

    def _closing_frames(self) -> list[str]:
        turn = self.turns.turn
        assert turn is not None, "the engine ended a request without a finished output"
        return self._turn_frames(turn)

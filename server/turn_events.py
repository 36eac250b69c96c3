"""What the Responses and Messages surfaces share: the skeleton of their event streams over the turn
events of the one sample they ask for."""

from __future__ import annotations

from engine import RequestOutput
from server.plan import GenerationPlan
from server.streaming import FrameStream
from server.turn import Turn, TurnDelta


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

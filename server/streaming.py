"""The skeleton of every streamed response (opening frames, frames per engine output, an in-band error
once the 200 is sent, closing frames), and what chat and text completions share over it: the usage
block, and the chunk stream that ends with usage (and the opt-in cost sheet) and [DONE]."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from engine import CompletionOutput, RequestOutput
from server.cost_sheet import cost_sheet
from server.errors import APIError, to_api_error
from server.generation import ClientDisconnected
from server.sse import DONE_FRAME, sse_frame, to_json

if TYPE_CHECKING:
    from engine import Tokenizer


def usage_block(
    prompt_tokens: int, completion_tokens: int, cached: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; with a reasoning parser on, how many completion tokens reasoned."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class FrameStream:
    """Base of a streamed response: delta engine outputs (index of the engine request, output) -> SSE
    frames; a failure after the 200 status is one in-band error frame, and ends the stream."""

    error_param = "prompt"  # the request field a prompt error names

    def _opening_frames(self, first: RequestOutput | None) -> Iterable[str]:
        return ()

    def _output_frames(self, index: int, output: RequestOutput) -> list[str]:
        raise NotImplementedError

    def _error_frame(self, error: APIError) -> str:
        raise NotImplementedError

    def _closing_frames(self) -> Iterable[str]:
        raise NotImplementedError

    async def frames(
        self,
        first: tuple[int, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncIterator[str]:
        # The frames of one engine output go out in one write (one send, one syscall).
        try:
            opening = "".join(self._opening_frames(first[1] if first is not None else None))
            if opening:
                yield opening
            if first is not None:
                frames = self._output_frames(*first)
                if frames:
                    yield "".join(frames)
            async for index, output in outputs:
                frames = self._output_frames(index, output)
                if frames:
                    yield "".join(frames)
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield self._error_frame(to_api_error(e, self.error_param))
            return
        finally:
            await outputs.aclose()
        for frame in self._closing_frames():
            yield frame


class ChunkStream(FrameStream):
    """Chat and text completion chunks: subclasses set `object_name` and turn one engine output into
    frames."""

    object_name = ""

    def __init__(
        self,
        req: Any,
        tokenizer: Tokenizer,
        model: str,
        request_id: str,
        created: int,
        prompt_tokens: int,
        n: int,
        with_metrics: bool = False,
    ) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.model = model
        self.request_id = request_id
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.output_tokens: dict[int, int] = {}  # choice index -> tokens generated so far
        self.reasoning_tokens: dict[int, int] = {}  # choice index -> of those, reasoning
        self.thinking = False  # a reasoning parser is on (usage counts reasoning tokens)
        self.cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the cache
        self.with_metrics = with_metrics
        self.finals: dict[
            int, RequestOutput
        ] = {}  # prompt index -> its engine request's last output
        # Every chunk starts alike: serialise that head once, not per token.
        self._head = (
            f'data: {{"id":{to_json(request_id)},"object":{to_json(self.object_name)},'
            f'"created":{to_json(created)},"model":{to_json(model)},"choices":'
        )

    def _chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> str:
        frame = self._head + to_json(choices) + ',"system_fingerprint":null'
        if self.include_usage:
            frame += ',"usage":' + to_json(usage)
        if metrics is not None:
            frame += ',"metrics":' + to_json(metrics)
        return frame + "}\n\n"

    def _count(self, index: int, out: CompletionOutput) -> None:
        """Track choice `index`'s output tokens (the engine's count when it gives one)."""
        counted = self.output_tokens.get(index, 0) + len(out.token_ids)
        self.output_tokens[index] = out.num_output_tokens or counted
        self.reasoning_tokens[index] = out.num_reasoning_tokens

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        raise NotImplementedError

    def _output_frames(self, index: int, output: RequestOutput) -> list[str]:
        self.finals[index] = output
        return self._frames_for(index, output)

    def _error_frame(self, error: APIError) -> str:
        return sse_frame(error.body())

    def _closing_frames(self) -> list[str]:
        frames = []
        metrics = None
        if self.with_metrics:
            metrics = cost_sheet([self.finals[i] for i in sorted(self.finals)])
        if self.include_usage or metrics is not None:
            usage = usage_block(
                self.prompt_tokens,
                sum(self.output_tokens.values()),
                sum(self.cached.values()),
                sum(self.reasoning_tokens.values()) if self.thinking else None,
            )
            frames.append(self._chunk([], usage, metrics))
        return [*frames, DONE_FRAME]

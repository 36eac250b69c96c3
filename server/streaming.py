"""What chat and text completions share: the usage block, and the SSE chunk stream skeleton that turns
delta RequestOutputs into chunk frames, reports errors in-band and ends with usage (and the opt-in cost
sheet) and [DONE]."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from engine import CompletionOutput, RequestOutput
from server.cost_sheet import cost_sheet
from server.errors import to_api_error
from server.generation import ClientDisconnected
from server.sse import DONE_FRAME, sse_frame, to_json

if TYPE_CHECKING:
    from engine import Tokenizer


def usage_block(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ChunkStream:
    """Base of a streamed response: subclasses set `object_name` and turn one engine output into frames."""

    object_name = ""
    error_param = "prompt"  # the request field a prompt error names

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
        self.cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the cache
        self.with_metrics = with_metrics
        self.finals: dict[
            int, RequestOutput
        ] = {}  # prompt index -> its engine request's last output
        # Every chunk starts with the same fields: serialised once, not once per token.
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
        """One frame: the same bytes as sse_frame() of the whole payload (id, object, created, model,
        choices, system_fingerprint, then usage when asked for and metrics when given)."""
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

    def _opening_frames(self) -> Iterable[str]:
        return ()

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        raise NotImplementedError

    async def frames(
        self,
        first: tuple[int, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncIterator[str]:
        # The frames of one engine output go out in one write (one send, one syscall).
        try:
            opening = "".join(self._opening_frames())
            if opening:
                yield opening
            if first is not None:
                self.finals[first[0]] = first[1]
                frames = self._frames_for(*first)
                if frames:
                    yield "".join(frames)
            async for prompt_index, output in outputs:
                self.finals[prompt_index] = output
                frames = self._frames_for(prompt_index, output)
                if frames:
                    yield "".join(frames)
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield sse_frame(to_api_error(e, self.error_param).body())
            return
        finally:
            await outputs.aclose()
        metrics = None
        if self.with_metrics:
            metrics = cost_sheet([self.finals[i] for i in sorted(self.finals)])
        if self.include_usage or metrics is not None:
            usage = usage_block(
                self.prompt_tokens, sum(self.output_tokens.values()), sum(self.cached.values())
            )
            yield self._chunk([], usage, metrics)
        yield DONE_FRAME

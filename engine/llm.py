"""Offline API: `LLM(model).generate(prompts, params)` runs the engine loop to completion in-process;
`LLM.score(prompt, choices)` gives each choice's probability as the continuation of the prompt."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scoring import Normalize, ScoreResult, summarize_scores
from engine.llm_engine import LLMEngine
from engine.text.reasoning import get_reasoning_parser
from engine.text.score_inputs import Choice, build_score_inputs

Prompt = str | list[int]


class LLM:
    def __init__(
        self, model: str | None = None, dtype: str = "auto", **engine_options: object
    ) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. Prompts are strings or token-id lists; `lora`
        names the LoRA adapter of every prompt, or of each (None: the base model)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompt_list = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} LoRA names for {len(prompt_list)} prompts")
        ids = [f"offline-{i}" for i in range(len(prompt_list))]
        added: list[str] = []
        try:
            for request_id, prompt, p, name in zip(
                ids, prompt_list, param_list, loras, strict=True
            ):
                text = prompt if isinstance(prompt, str) else None
                token_ids = (
                    self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                )
                self.engine.add_request(
                    request_id, token_ids, dataclasses.replace(p, output_kind="final"), text,
                    lora=name,
                )  # fmt: skip
                added.append(request_id)
            results = self._run()
        finally:
            for request_id in added:
                self.engine.abort_request(request_id)
        return [results[i] for i in ids]

    def score(
        self,
        prompt: Prompt | None,
        choices: Sequence[Choice],
        *,
        messages: list[dict[str, str]] | None = None,
        normalize: Normalize = "sum",
        include_end_of_turn: bool = False,
        top_logprobs: int = 0,
        lora: str | None = None,
    ) -> ScoreResult:
        """How likely each choice is as the continuation of `prompt` (or, with `prompt=None` and
        `messages`, as the assistant's reply): the context is prefilled once and every choice is
        scored from its KV blocks. Text follows lm-evaluation-harness's loglikelihood tokenization."""
        inputs = build_score_inputs(
            self.tokenizer,
            list(choices),
            prompt=prompt,
            messages=messages,
            include_end_of_turn=include_end_of_turn,
        )
        request_id = "offline-score"
        text = prompt if isinstance(prompt, str) else None
        self.engine.add_score_request(
            request_id, inputs.context_token_ids, inputs.choice_token_ids, top_logprobs, text,
            lora=lora,
        )  # fmt: skip
        try:
            output = self._run()[request_id]
        finally:
            self.engine.abort_request(request_id)
        if output.error is not None:
            raise RuntimeError(f"scoring failed: {output.error}")
        return summarize_scores(output, inputs.choice_texts, normalize, top_logprobs)

    def _run(self) -> dict[str, RequestOutput]:
        """Step the engine until every request has finished; their final outputs by request id."""
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return results

    def chat(
        self,
        messages: list[dict[str, str]],
        params: SamplingParams | None = None,
        *,
        reasoning_parser: str = "auto",
        chat_template_kwargs: dict[str, object] | None = None,
    ) -> RequestOutput:
        """One chat turn. With a reasoning parser (`auto`: from the chat template), each output's
        `reasoning` holds the thinking and `text` the answer, as the server returns them."""
        text = self.tokenizer.render_chat_template(
            messages, add_generation_prompt=True, template_kwargs=chat_template_kwargs
        )
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        parser = get_reasoning_parser(reasoning_parser, self.tokenizer.chat_template)
        params = params or SamplingParams()
        if parser is not None:
            params = dataclasses.replace(params, reasoning=parser.format_for(text))
        return self.generate([token_ids], params)[0]

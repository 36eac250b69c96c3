"""A score request's token ids: the context (a prompt, or chat messages rendered with the generation
prompt) and each choice as its continuation, split as lm-evaluation-harness splits loglikelihood pairs.

Text pairs follow lm-eval's `_encode_pair`: the context's trailing whitespace moves to the front of the
continuation, then the continuation's tokens are those of `encode(context + continuation)` after
`len(encode(context))`, so the score equals lm-eval's for the same strings. Token ids are used as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer

Choice = str | list[int]
_PROBE = "kvserve-end-of-turn-probe"


@dataclass
class ScoreInputs:
    context_token_ids: list[int]
    choice_token_ids: list[list[int]]  # the scored tokens of each choice, end-of-turn included
    choice_texts: list[str]  # each choice as the caller gave it (token ids decoded)


def encode_pair(
    tokenizer: Tokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """lm-eval's loglikelihood split of (context, continuation) into token ids. An empty context
    becomes the model's BOS (or EOS) token, as lm-eval's prefix token."""
    stripped = context.rstrip()
    if stripped != context:
        continuation = context[len(stripped) :] + continuation
        context = stripped
    if not context:
        return [prefix_token_id(tokenizer)], tokenizer.encode(
            continuation, add_special_tokens=False
        )
    context_ids = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    return context_ids, whole[len(context_ids) :]


def prefix_token_id(tokenizer: Tokenizer) -> int:
    bos = tokenizer.hf.bos_token_id
    if bos is not None:
        return int(bos)
    eos = tokenizer.hf.eos_token_id
    if eos is None:
        raise InvalidRequestError("the prompt is empty and this model has no BOS token", "prompt")
    return int(eos)


def build_score_inputs(
    tokenizer: Tokenizer,
    choices: list[Choice],
    prompt: str | list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    include_end_of_turn: bool = False,
) -> ScoreInputs:
    """Token ids of the context and of each choice. Exactly one of `prompt` and `messages`; with
    messages the choices are candidate assistant replies and `include_end_of_turn` appends the token
    that ends the reply. Bad input raises InvalidRequestError naming the field."""
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
    if not choices:
        raise InvalidRequestError("choices is empty: give at least one choice", "choices")
    for i, choice in enumerate(choices):
        if len(choice) == 0:
            raise InvalidRequestError(f"choices[{i}] is empty", "choices")
    if len({isinstance(c, str) for c in choices}) > 1:
        raise InvalidRequestError("choices must be all strings or all token-id lists", "choices")
    if include_end_of_turn and messages is None:
        raise InvalidRequestError(
            "include_end_of_turn needs messages (a chat context)", "include_end_of_turn"
        )
    texts = [c if isinstance(c, str) else tokenizer.decode(c, False) for c in choices]
    if messages is not None:
        context, ids = _chat_inputs(tokenizer, messages, choices)
        if include_end_of_turn:
            end = end_of_turn_token_id(tokenizer, messages)
            ids = [c + [end] for c in ids]
        return ScoreInputs(context, ids, texts)
    assert prompt is not None
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("the prompt is empty: give at least one token", "prompt")
        # No context text to split: text choices are tokenized on their own.
        ids = [c if isinstance(c, list) else tokenizer.encode(c, False) for c in choices]
        return ScoreInputs(list(prompt), [list(c) for c in ids], texts)
    if not isinstance(choices[0], str):
        context = tokenizer.encode(prompt) if prompt else [prefix_token_id(tokenizer)]
        return ScoreInputs(context, [list(c) for c in choices if isinstance(c, list)], texts)
    pairs = [encode_pair(tokenizer, prompt, c) for c in choices if isinstance(c, str)]
    return ScoreInputs(pairs[0][0], [cont for _, cont in pairs], texts)


def _chat_inputs(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], choices: list[Choice]
) -> tuple[list[int], list[list[int]]]:
    """The templated context with the generation prompt, exactly as chat generation sees it, and each
    reply's tokens as they follow it (the template's own whitespace stays in the context)."""
    try:
        rendered = tokenizer.render_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from None
    context = tokenizer.encode(rendered, add_special_tokens=False)
    ids: list[list[int]] = []
    for choice in choices:
        if isinstance(choice, list):
            ids.append(list(choice))
            continue
        whole = tokenizer.encode(rendered + choice, add_special_tokens=False)
        if whole[: len(context)] == context and len(whole) > len(context):
            ids.append(whole[len(context) :])
        else:  # the reply merged with the template's last token: tokenize it on its own
            ids.append(tokenizer.encode(choice, add_special_tokens=False))
    return context, ids


def end_of_turn_token_id(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> int:
    """The token the chat template puts right after an assistant reply when it is an end-of-sequence
    token (what makes generation stop), else the tokenizer's EOS."""
    fallback = tokenizer.hf.eos_token_id
    try:
        text = tokenizer.render_chat_template(
            [*messages, {"role": "assistant", "content": _PROBE}], add_generation_prompt=False
        )
    except ValueError:
        text = ""
    at = text.rfind(_PROBE)
    if at >= 0:
        after = tokenizer.encode(text[at + len(_PROBE) :], add_special_tokens=False)
        if after and after[0] in tokenizer.eos_token_ids:
            return after[0]
    if fallback is None:
        raise InvalidRequestError(
            "this model has no end-of-turn (EOS) token to score", "include_end_of_turn"
        )
    return int(fallback)

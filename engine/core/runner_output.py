"""The model runner's answer for one step: sampled tokens, logprobs and per-sequence errors, keyed by
sequence id. A contract type of the torch-free core, so the output processor never imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import TokenLogprob


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # seq_id -> token id
    # seq_id -> the sampled token's logprobs
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # seq_id -> (first prompt position, one row per position)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Speculative decoding, seq_id -> how many of its draft tokens were accepted (their logprobs,
    # when asked for, in draft_logprobs); `sampled` then holds the token after them (the bonus).
    num_accepted: dict[str, int] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # seq_id -> message: that sequence fails alone
    errors: dict[str, str] = field(default_factory=dict)

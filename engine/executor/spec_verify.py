"""Verification of speculative draft tokens: one sampling row per verified position, and the
acceptance rule that keeps the output exactly what plain decoding gives.

Row j of a sequence with drafts d_1..d_k samples the token after d_1..d_j, with the sampler's usual
rule (argmax when greedy; Gumbel-max from the sequence's own generator otherwise), and d_{j+1} is
accepted while it equals that sample; the first sample that differs (or the one after all k) is the
bonus token. For greedy rows that is "the target's argmax equals the proposal". For sampled rows it is
rejection sampling against a point-mass draft: d is accepted with probability p_target(d), and on
rejection the token comes from p_target with d removed and renormalised (Gumbel-max conditioned on not
picking d), so the target distribution is kept exactly. A seeded sequence's generator is rewound so it
advances once per emitted token, as in plain decoding: the same seed gives the same text with and
without speculation.

With structured outputs the drafts are ones the grammar accepts (the speculator cut them there), and
row j is masked by the grammar's state after d_1..d_j: the matcher consumes the drafts one by one for
the masks and is rolled back, so it holds only emitted tokens, as in plain decoding."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.executor.sampler import SamplingRow


def verification_rows(base: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """Rows for positions 0..k; row j sees the drafts before it as output (penalties, min_tokens)."""
    p = base.params
    history_free = (
        p.min_tokens == 0
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )
    if history_free:
        return [base] * (len(drafts) + 1)
    return [base] + [
        dataclasses.replace(base, token_ids=base.token_ids + drafts[:j])
        for j in range(1, len(drafts) + 1)
    ]


def grammar_cut_masks(
    grammars: Any, matcher: Any, drafts: list[int], bitmask: torch.Tensor, first_row: int
) -> None:
    """Rows first_row..first_row + k of `bitmask`: the allowed tokens before each draft and after
    the last; the matcher ends where it started."""
    consumed = 0
    try:
        for j, token in enumerate(drafts):
            grammars.fill_bitmask([(matcher, first_row + j)], bitmask)
            if not matcher.consume_token(token):
                # Not expected (the drafts were validated): row j's mask does not allow the draft,
                # so verification stops there and the rows after it (left unmasked) are unused.
                break
            consumed += 1
        else:
            grammars.fill_bitmask([(matcher, first_row + len(drafts))], bitmask)
    finally:
        if consumed:
            matcher.rollback(consumed)


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """Leading drafts equal to what their rows sampled (sampled has len(drafts) + 1 entries)."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


class GeneratorRewind:
    """Seeded sampled sequences' generator states before a verification's draws, to redo only the
    draws of the emitted positions afterwards (rows past the first rejection drew for nothing)."""

    def __init__(self) -> None:
        self._states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def save(self, key: int, row: SamplingRow) -> None:
        if row.generator is not None and not row.params.greedy:
            self._states[key] = (row.generator, row.generator.get_state())

    def rewind(self, key: int, num_emitted: int, vocab_size: int, device: torch.device) -> None:
        saved = self._states.pop(key, None)
        if saved is None:
            return
        generator, state = saved
        generator.set_state(state)
        scratch = torch.empty(vocab_size, dtype=torch.float32, device=device)
        for _ in range(num_emitted):  # one [vocab] draw per sampled row, as the sampler makes them
            scratch.uniform_(generator=generator)

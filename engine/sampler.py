"""Batched token sampler: penalties, logit bias, temperature/top-k/top-p/min-p, seeds and logprobs.

One call samples one token for every row of a step; stages no row uses are skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Floor for exponential noise: exponential_() may return exactly 0 in rare cases, which would
# turn a zero-probability token into NaN/inf in the exponential race.
_MIN_EXP_NOISE = 1e-10


class RowError(ValueError):
    """Sampling row `row_index` has unusable logits (NaN, +inf, or all -inf).

    `row_indices` lists every bad row of the batch (first one is `row_index`). It is raised before
    any per-sequence generator advances, so the caller can fail those requests and call the
    sampler again with the remaining rows without changing their seeded outcomes.
    """

    def __init__(self, row_index: int, message: str, row_indices: list[int] | None = None) -> None:
        super().__init__(message)
        self.row_index = row_index
        self.row_indices = row_indices if row_indices is not None else [row_index]


@dataclass
class SamplingRow:
    """One sequence to sample this step (built by the runner)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step's token
    generator: torch.Generator | None  # per-sequence generator when params.seed is set
    eos_token_ids: frozenset[int]  # suppressed (with stop_token_ids) while output < min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]  # sampled token per row
    logprobs: list[TokenLogprob | None]  # per row; None when params.logprobs is None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator owned by one sequence; for n > 1 the runner passes seed + sample index."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per row; all tensor work is batched over rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # shared by unseeded rows; None -> torch's default generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # logits: [num_rows, vocab] raw model logits
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        if _is_plain_greedy(rows):
            return self._greedy_only(logits, rows)
        return self._sample(logits, rows)

    def _greedy_only(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        best_values, best_ids = logits.max(dim=-1)  # [num_rows] each
        # max() propagates NaN and yields +-inf for +inf / all -inf rows: one check covers all.
        values, token_ids = torch.stack([best_values, best_ids.float()]).tolist()
        _raise_on_bad_rows(values)
        return SamplerOutput(token_ids=[int(t) for t in token_ids], logprobs=[None] * len(rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        num_rows, vocab_size = logits.shape
        device = logits.device
        row_max = logits.amax(dim=-1)  # [num_rows]; NaN / +-inf marks a bad row
        seeded = [i for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
        if seeded:  # check before any per-sequence generator advances
            _raise_on_bad_rows(row_max.tolist())

        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            # Reported logprobs are of the raw model distribution (before penalties/temperature).
            raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1)  # [n_lp, vocab]

        logits = logits.clone()
        _apply_min_tokens(logits, rows)
        _apply_logit_bias(logits, rows)
        _apply_repetition_penalty(logits, rows)
        _apply_presence_frequency(logits, rows)

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        if random:
            token_ids[random] = self._sample_random(logits[random], [rows[i] for i in random])

        host = torch.cat([row_max, token_ids.float()]).tolist() if not seeded else None
        if host is not None:
            _raise_on_bad_rows(host[:num_rows])
            sampled = [int(t) for t in host[num_rows:]]
        else:
            sampled = token_ids.tolist()

        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if raw_logprobs is not None:
            num_top = [rows[i].params.logprobs or 0 for i in logprob_rows]
            entries = _gather_logprobs(raw_logprobs, token_ids[logprob_rows], max(num_top))
            for i, n, entry in zip(logprob_rows, num_top, entries, strict=True):
                entry.top = entry.top[:n]
                logprobs[i] = entry
        return SamplerOutput(token_ids=sampled, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # logits: [n, vocab] for non-greedy rows -> [n] sampled ids
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        logits.div_(temperature.unsqueeze(1))
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            _apply_top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)  # [n, vocab]
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            probs.masked_fill_(probs < threshold, 0.0)  # no renormalising needed for the race below
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (same as Gumbel-max).
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self.generator)
        else:
            for i, row in enumerate(rows):
                if row.generator is not None:  # own stream: same tokens alone or in any batch
                    noise[i].exponential_(generator=row.generator)
            if unseeded:
                shared = torch.empty(len(unseeded), probs.shape[1], device=device)
                noise[unseeded] = shared.exponential_(generator=self.generator)
        return probs.div_(noise.clamp_min_(_MIN_EXP_NOISE)).argmax(dim=-1)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprob]:
    """Logprob (and top-N) of each actual next prompt token under the raw model distribution."""
    # logits: [n, vocab] at prompt positions; next_token_ids: [n]
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _gather_logprobs(logprobs, next_token_ids.to(logits.device), num_top)


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprob]:
    # logprobs: [n, vocab] normalised; token_ids: [n]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n], 1-based
    chosen_list = chosen.squeeze(1).tolist()
    ranks_list = ranks.tolist()
    ids_list = token_ids.tolist()
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [n, num_top], best first
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in ids_list]
    return [
        TokenLogprob(token_id=t, logprob=lp, rank=rk, top=top)
        for t, lp, rk, top in zip(ids_list, chosen_list, ranks_list, tops, strict=True)
    ]


def _is_plain_greedy(rows: list[SamplingRow]) -> bool:
    for row in rows:
        p = row.params
        if not p.greedy or p.logprobs is not None or p.logit_bias or p.repetition_penalty != 1.0:
            return False
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            return False
        if len(row.output_token_ids) < p.min_tokens:
            return False
    return True


def _raise_on_bad_rows(row_values: list[float]) -> None:
    bad = [i for i, v in enumerate(row_values) if v != v or v in (float("inf"), float("-inf"))]
    if bad:
        raise RowError(
            bad[0],
            f"model produced non-finite logits (NaN, +inf or all -inf) for sampling row(s) {bad}",
            bad,
        )


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            banned = row.eos_token_ids.union(row.params.stop_token_ids)
            ids = [t for t in banned if t < vocab_size]
            row_idx += [i] * len(ids)
            token_idx += ids
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    row_idx: list[int] = []
    token_idx: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if token_id < logits.shape[1]:
                row_idx.append(i)
                token_idx.append(token_id)
                values.append(bias)
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def _token_mask_or_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device, counts: bool
) -> torch.Tensor:
    """[len(token_lists), vocab] token counts (float) or presence (bool), built in one scatter."""
    row_idx = [i for i, ids in enumerate(token_lists) for _ in ids]
    token_idx = [t for ids in token_lists for t in ids]
    result = torch.zeros(len(token_lists), vocab_size, device=device)
    if token_idx:
        rows_t = torch.tensor(row_idx, device=device)
        tokens_t = torch.tensor(token_idx, device=device)
        result.index_put_(
            (rows_t, tokens_t), torch.ones(len(token_idx), device=device), accumulate=True
        )
    return result if counts else result > 0


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    selected = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not selected:
        return
    device = logits.device
    seen = _token_mask_or_counts(
        [rows[i].prompt_token_ids + rows[i].output_token_ids for i in selected],
        logits.shape[1],
        device,
        counts=False,
    )  # [n_sel, vocab] bool
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in selected], device=device)
    penalty = penalty.unsqueeze(1)
    sub = logits[selected]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[selected] = torch.where(seen, penalised, sub)


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    selected = [
        i
        for i, r in enumerate(rows)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if not selected:
        return
    device = logits.device
    counts = _token_mask_or_counts(
        [rows[i].output_token_ids for i in selected], logits.shape[1], device, counts=True
    )  # [n_sel, vocab]
    presence = torch.tensor([rows[i].params.presence_penalty for i in selected], device=device)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in selected], device=device)
    penalty = frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
    logits[selected] -= penalty


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    # logits: [n, vocab], already temperature-scaled; masks in place with -inf.
    vocab_size = logits.shape[1]
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [n, vocab]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab_size else vocab_size for r in rows]
    if any(k < vocab_size for k in top_k):
        positions = torch.arange(vocab_size, device=device)
        k = torch.tensor(top_k, device=device).unsqueeze(1)
        sorted_logits.masked_fill_(positions.unsqueeze(0) >= k, float("-inf"))
    top_p = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        drop = mass_before >= p  # keep the smallest prefix whose mass reaches top_p
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, sorted_ids, sorted_logits)

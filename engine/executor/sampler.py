"""Batched token sampler: grammar masks, penalties, logit bias, temperature/top-k/top-p/min-p, seeds
and logprobs.

One call samples one token for every row of a step; stages no row uses are skipped. The allowed-token
bitmask of constrained rows (structured outputs) is applied first, in one batched operation, so every
later stage sees only tokens the grammar allows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.core.outputs import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.kernels import cpu_kernels

logger = logging.getLogger(__name__)

# top-p first looks for its cut-off among this many best tokens (one topk instead of a full
# sort, which is slow on CPU); rows whose candidates hold less than top_p mass fall back to a sort.
_TOP_P_CANDIDATES = 256
# Without the C++ kernels, greedy argmax on CPU reduces chunks of this many logits with the
# vectorised amax first (see first_argmax); max(dim) with indices is scalar code there, about 10x
# slower per element.
_ARGMAX_CHUNK = 128
_ARGMAX_MIN_ROWS = 4


class RowError(ValueError):
    """Sampling row `row_index` has unusable logits (NaN, +inf, or all -inf).

    `row_index` is the first bad row of the batch. It is raised before any per-sequence generator
    advances, so the caller can fail that request and call the sampler again with the remaining
    rows without changing their seeded outcomes.
    """

    def __init__(self, row_index: int, message: str) -> None:
        super().__init__(message)
        self.row_index = row_index


@dataclass
class SamplingRow:
    """One sequence to sample this step (built by the runner)."""

    params: SamplingParams
    token_ids: list[int]  # the sequence's live list: prompt, then output so far (never copied)
    num_prompt_tokens: int
    generator: torch.Generator | None  # per-sequence generator when params.seed is set
    eos_token_ids: frozenset[int]  # suppressed (with stop_token_ids) while output < min_tokens
    # Structured outputs: the row's bitmask row applies (the grammar, not min_tokens, decides the end).
    constrained: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:  # a copy; the repetition penalty reads token_ids whole
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:  # generated so far, before this step's token
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # sampled token per row
    logprobs: list[TokenLogprob | None]  # per row; None when params.logprobs is None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator owned by one sequence, seeded with its sample's seed (see llm_engine.sample_seed)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per row; all tensor work is batched over rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # shared by unseeded rows; None -> torch's default generator

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        # logits: [num_rows, vocab] raw model logits
        # token_bitmask: [num_rows, ceil(vocab / 32)] int32, bit j of word w allows token 32 w + j;
        # read only for rows with `constrained` set.
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw = logits
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask, [r.constrained for r in rows])
        if _is_plain_greedy(rows):
            return self._greedy_only(logits, rows)
        return self._sample(logits, rows, raw)

    def _greedy_only(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        best_values, best_ids = first_argmax(logits)  # [num_rows] each
        # max() propagates NaN and yields +-inf for +inf / all -inf rows: one check covers all.
        if logits.device.type == "cpu":  # two reads, fewer ops than stacking them
            values, token_ids = best_values.tolist(), best_ids.tolist()
        else:  # one device-to-host copy
            values, ids = torch.stack([best_values, best_ids.float()]).tolist()
            token_ids = [int(t) for t in ids]
        _raise_on_bad_rows(values)
        return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(rows))

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], raw: torch.Tensor
    ) -> SamplerOutput:
        num_rows, vocab_size = logits.shape
        device = logits.device
        row_max = logits.amax(dim=-1)  # [num_rows]; NaN / +-inf marks a bad row
        seeded = [i for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
        if seeded:  # check before any per-sequence generator advances
            _raise_on_bad_rows(row_max.tolist())

        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            # Reported logprobs are of the raw model distribution (before masks, penalties and
            # temperature), as vLLM reports them.
            raw_logprobs = torch.log_softmax(raw[logprob_rows], dim=-1)  # [n_lp, vocab]

        if _needs_adjustment(rows):
            logits = logits.clone()  # never modify the caller's tensor (it may retry on RowError)
            _apply_min_tokens(logits, rows)
            _apply_logit_bias(logits, rows)
            _apply_repetition_penalty(logits, rows)
            _apply_presence_frequency(logits, rows)

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            token_ids[greedy] = first_argmax(logits if len(greedy) == num_rows else logits[greedy])[
                1
            ]
        if random:
            subset = logits if len(random) == num_rows else logits[random]
            token_ids[random] = self._sample_random(subset, [rows[i] for i in random])

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
        # logits: [n, vocab] for non-greedy rows (read only) -> [n] sampled ids
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        logits = logits / temperature.unsqueeze(1)  # [n, vocab], a new tensor from here on
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            _apply_top_k_top_p(logits, rows)
        if any(r.params.min_p > 0.0 for r in rows):
            # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)
            threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
            logits.masked_fill_(logits < threshold, float("-inf"))
        # Gumbel-max: argmax(logit + G), G = -log(-log U), draws from softmax(logits) exactly.
        uniform = torch.empty_like(logits)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            uniform.uniform_(generator=self.generator)
        else:
            for i, row in enumerate(rows):
                if row.generator is not None:  # own stream: same tokens alone or in any batch
                    uniform[i].uniform_(generator=row.generator)
            if unseeded:
                shared = torch.empty(len(unseeded), logits.shape[1], device=device)
                uniform[unseeded] = shared.uniform_(generator=self.generator)
        gumbel_neg = uniform.log_().neg_().log_()  # = -G; U == 0 gives +inf (never picked)
        return logits.sub_(gumbel_neg).argmax(dim=-1)


_CHUNK_OFFSETS: dict[torch.device, torch.Tensor] = {}


def first_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max value, index of its first occurrence) of each row: exactly `logits.max(dim=-1)`,
    NaN rows included (NaN counts as the maximum), faster on CPU, where max(dim) is scalar code.

    On CPU with the C++ kernels: one op, a vectorized pass per row (csrc/first_argmax.cpp; one
    49152-logit row: ~10 us against 80-140 us for max(dim) right after a forward). Without them, the
    vectorised amax finds each chunk's maximum, the first chunk holding the row's maximum is the
    first whose maximum equals it, and one argmax over that chunk finishes (from 4 rows up)."""
    # logits: [n, vocab] -> values [n], indices [n] int64
    n, vocab = logits.shape
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and vocab > 0
        and cpu_kernels.available()
    ):
        return cpu_kernels.first_argmax(logits)  # csrc/first_argmax.cpp: one op, one pass a row
    chunk = _ARGMAX_CHUNK
    # Below a few rows the extra ops cost more than the scalar scan saves (measured break-even ~4).
    if logits.device.type != "cpu" or n < _ARGMAX_MIN_ROWS or vocab < 4 * chunk:
        return logits.max(dim=-1)
    num_full = vocab // chunk
    covered = num_full * chunk
    chunk_max = logits[:, :covered].unflatten(1, (num_full, chunk)).amax(dim=-1)  # [n, chunks]
    if covered < vocab:  # the ragged tail is one more chunk
        tail = logits[:, covered:].amax(dim=-1, keepdim=True)
        chunk_max = torch.cat([chunk_max, tail], dim=1)
    values, best_chunk = chunk_max.max(dim=-1)  # first chunk holding the maximum: [n] each
    start = best_chunk * chunk
    offsets = _CHUNK_OFFSETS.get(logits.device)
    if offsets is None:
        offsets = _CHUNK_OFFSETS[logits.device] = torch.arange(chunk, device=logits.device)
    # A tail chunk's missing columns repeat the last one, after the real occurrence: harmless.
    columns = (start.unsqueeze(1) + offsets).clamp_(max=vocab - 1)  # [n, chunk]
    return values, start + logits.gather(1, columns).argmax(dim=-1)


_BIT_INDEX: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, constrained: list[bool]
) -> torch.Tensor:
    """A copy of `logits` with the tokens each constrained row's bitmask forbids set to -inf."""
    # logits: [n, vocab]; bitmask: [n, words] int32 -> returns [n, vocab]
    rows = [i for i, c in enumerate(constrained) if c]
    if not rows:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    bits = _BIT_INDEX.get(device)
    if bits is None:
        bits = _BIT_INDEX[device] = torch.arange(32, dtype=torch.int32, device=device)
    masks = bitmask if len(rows) == len(constrained) else bitmask[rows]
    allowed = ((masks.to(device).unsqueeze(-1) >> bits) & 1).bool()  # [r, words, 32]
    allowed = allowed.flatten(1)[:, :vocab]  # [r, vocab]
    if len(rows) == len(constrained):
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    index = torch.tensor(rows, device=device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


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
        if row.num_output_tokens < p.min_tokens:
            return False
    return True


def _raise_on_bad_rows(row_values: list[float]) -> None:
    bad = [i for i, v in enumerate(row_values) if v != v or v in (float("inf"), float("-inf"))]
    if bad:
        raise RowError(
            bad[0],
            f"model produced non-finite logits (NaN, +inf or all -inf) for sampling row(s) {bad}",
        )


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens and not row.constrained:
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


def _needs_adjustment(rows: list[SamplingRow]) -> bool:
    return any(
        r.num_output_tokens < r.params.min_tokens
        or r.params.logit_bias
        or r.params.repetition_penalty != 1.0
        or r.params.presence_penalty != 0.0
        or r.params.frequency_penalty != 0.0
        for r in rows
    )


def _unique_tokens(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of the lists and how often each occurs: three [num_pairs]."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
    flat = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long, device=device)
    row_of = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    keys, counts = torch.unique(row_of * vocab_size + flat, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    selected = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not selected:
        return
    device = logits.device
    lists = [rows[i].token_ids for i in selected]
    sel_rows, tokens, _ = _unique_tokens(lists, logits.shape[1], device)
    if tokens.numel() == 0:
        return
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in selected], device=device)
    batch_rows = torch.tensor(selected, device=device)[sel_rows]
    seen = logits[batch_rows, tokens]  # [num_pairs]
    penalised = torch.where(seen > 0, seen / penalty[sel_rows], seen * penalty[sel_rows])
    logits[batch_rows, tokens] = penalised


def _apply_presence_frequency(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    selected = [
        i
        for i, r in enumerate(rows)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if not selected:
        return
    device = logits.device
    lists = [rows[i].output_token_ids for i in selected]
    sel_rows, tokens, counts = _unique_tokens(lists, logits.shape[1], device)
    if tokens.numel() == 0:
        return
    presence = torch.tensor([rows[i].params.presence_penalty for i in selected], device=device)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in selected], device=device)
    batch_rows = torch.tensor(selected, device=device)[sel_rows]
    penalty = frequency[sel_rows] * counts + presence[sel_rows]  # [num_pairs], count > 0 here
    logits[batch_rows, tokens] -= penalty


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask (with -inf) tokens outside each row's top-k, then outside its top-p nucleus."""
    # logits: [n, vocab], temperature-scaled, modified in place
    n, vocab_size = logits.shape
    device = logits.device
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab_size else 0 for r in rows]  # 0 = off
    top_p = [r.params.top_p for r in rows]
    uncapped_p = any(p < 1.0 and k == 0 for p, k in zip(top_p, top_k, strict=True))
    num_candidates = min(vocab_size, max(max(top_k), _TOP_P_CANDIDATES if uncapped_p else 1))
    candidates = logits.topk(num_candidates, dim=-1).values  # [n, C], best first
    k = torch.tensor([kk or num_candidates for kk in top_k], device=device)
    beyond_k = torch.arange(num_candidates, device=device).unsqueeze(0) >= k.unsqueeze(1)
    candidates.masked_fill_(beyond_k, float("-inf"))
    threshold = candidates.gather(1, (k - 1).unsqueeze(1))  # [n, 1]; k-th best logit
    has_k = torch.tensor([kk > 0 for kk in top_k], device=device).unsqueeze(1)
    threshold = torch.where(has_k, threshold, float("-inf"))

    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, device=device).unsqueeze(1)  # [n, 1]
        # Normaliser: the kept top-k set, or the whole vocabulary when top-k is off.
        log_norm = torch.where(
            has_k,
            torch.logsumexp(candidates, dim=-1, keepdim=True),
            torch.logsumexp(logits, dim=-1, keepdim=True),
        )
        probs = (candidates - log_norm).exp()  # [n, C]
        cut, covered = _nucleus_cut(candidates, probs, p)
        threshold = torch.maximum(threshold, torch.where(p < 1.0, cut, float("-inf")))
        short = [
            i for i, ok in enumerate(covered.tolist()) if not ok and top_p[i] < 1.0 and not top_k[i]
        ]
        if short:  # nucleus reaches past the candidates: sort those rows in full
            sorted_logits = logits[short].sort(dim=-1, descending=True).values
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            full_cut, _ = _nucleus_cut(sorted_logits, sorted_probs, p[short])
            threshold[short] = full_cut
    logits.masked_fill_(logits < threshold, float("-inf"))


def _nucleus_cut(
    sorted_logits: torch.Tensor, sorted_probs: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit of the last token of the smallest best-first prefix with mass >= top_p.

    Returns ([n, 1] cut-off logits, [n] whether the given prefix holds that much mass).
    """
    cumulative = sorted_probs.cumsum(dim=-1)  # [n, C]
    mass_before = cumulative - sorted_probs
    num_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)  # [n, 1]
    cut = sorted_logits.gather(1, num_keep - 1)
    return cut, cumulative[:, -1] >= top_p.squeeze(1)

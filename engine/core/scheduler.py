"""Token-budget scheduler (no torch): running sequences first, then waiting prompts in arrival order,
chunking prompts to fit the budget; preempts the newest running sequence (recompute) when KV runs out.

Head-of-line: when a waiting sequence cannot get KV blocks, the ones behind it (up to BYPASS_WINDOW
deep) are still admitted if they fit, but each blocked sequence lets at most HEAD_BYPASS_LIMIT later
ones go first; after that admission is strictly first-come-first-served until it gets its blocks, so
a long prompt is delayed by a bounded amount and never starved by a stream of short ones.

After the runner, update_from_output (vLLM's shape) applies its output: the KV written, the sampled
tokens and the stop rules (engine.core.sequence_update), the finished sequences' blocks, and the step's
stats, which the scheduler reports itself."""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, PrefixHit
from engine.core.kv_offload import KVTransfers
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.sequence_update import (
    Ending,
    Failure,
    SequenceUpdater,
    constraint_failure,
    finished_stats,
    store_prompt_logprobs,
)
from engine.core.speculator import Speculator
from engine.core.stats import StepKind, StepStats
from engine.core.step_budget import StepBudget

logger = logging.getLogger(__name__)

BYPASS_WINDOW = 8  # waiting sequences tried per step behind ones that cannot get KV blocks
HEAD_BYPASS_LIMIT = 4  # later sequences a KV-blocked waiting sequence lets go first, in total


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start_pos: int  # position of the first new token (= tokens already computed)
    block_tables: list[list[int]]  # per KV cache group: the sequence's live block table
    needs_sample: bool  # this chunk reaches the sequence's last token, so a token is sampled
    prompt_logprobs_rows: int  # new tokens whose next-prompt-token logprobs are wanted
    prompt_logprobs_offset: int = 0  # new tokens before the first of those rows
    num_held_blocks: int = 0  # KV blocks the sequence holds for this step (all groups)
    # Speculative decoding: proposed tokens after the sequence's last one, verified in this step
    # (counted in num_new_tokens; their KV is written, then kept only as far as they are accepted).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1

    @property
    def lora_id(self) -> int | None:
        return self.seq.group.lora_id


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes first, then prefill chunks
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: list[Sequence] = field(default_factory=list)
    num_draft_tokens: int = 0  # proposed tokens to verify (part of num_prefill_tokens)
    num_new_prompt_tokens: int = 0  # prompt tokens of requests scheduled for the first time
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)  # this step's lookups
    kv_transfers: KVTransfers | None = None  # KV offload: blocks to save / load before the forward

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def kind(self) -> StepKind:
        if self.num_prefill_tokens == 0:
            return "decode"
        return "prefill" if self.num_decode_tokens == 0 else "mixed"


@dataclass
class SchedulerUpdate:
    """What one runner output changed: the request groups it touched (in schedule order) and the
    step's stats (all but its duration, which the engine times)."""

    groups: list[RequestGroup]
    stats: StepStats


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        speculator: Speculator | None = None,
        updater: SequenceUpdater | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: no limit)
        self.kv = kv
        self.speculator = speculator  # None: no speculative decoding
        # The stop rules applied to sampled tokens (by default: no EOS, no model length).
        self.updater = updater or SequenceUpdater(frozenset(), sys.maxsize)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # seq id -> how many later sequences were admitted while this one could not get KV blocks
        self.bypassed: dict[str, int] = {}
        # The step-time token budget (CPU; set by the engine), None: max_num_batched_tokens per step.
        self.step_budget: StepBudget | None = None

    # -- admission ---------------------------------------------------------------------------
    def add_group(self, group: RequestGroup) -> None:
        """Only the leading sequence waits now; the others follow once it has prefilled."""
        self.waiting.append(group.seqs[0])

    def release_followers(self, group: RequestGroup) -> None:
        if group.followers_released:
            return
        group.followers_released = True
        leader = group.seqs[0]
        for seq in reversed(group.seqs[1:]):
            if not seq.status.finished:
                if group.max_output_tokens == 0:
                    # The leader ends with this prefill (scoring): take its prompt blocks now.
                    self.kv.share_prefix(seq, leader)
                self.waiting.appendleft(seq)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        if self.step_budget is not None:
            budget = self._step_time_budget()
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        lookups = PrefixCacheStats()

        speculator = self.speculator
        if speculator is not None and not speculator.enabled_for_batch(len(self.running)):
            speculator = None
        if speculator is not None:
            speculator.begin_step(self.running)  # a draft model proposes for all at once
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            if num_new == 1 and speculator is not None:
                drafts = self._drafts(speculator, seq, budget - 1)
                if drafts:  # verified as part of this step, like a prefill chunk of 1 + k
                    scheduled.append(self._scheduled(seq, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            while not self.kv.allocate_slots(seq, num_new):
                if self._drop_waiting_blocks(seq):
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing left behind it to schedule
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            i += 1

        # New work only when nothing had to be preempted: preemption means the pool is full.
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, lookups)

        # Stable: decodes first; each kind grouped by LoRA adapter (base rows first), so an adapter's
        # rows are contiguous within each kind (the runner's adapter segments).
        scheduled.sort(key=_step_order)
        num_decode = sum(1 for s in scheduled if s.is_decode)
        total = sum(s.num_new_tokens for s in scheduled)
        num_drafts = sum(len(s.draft_token_ids) for s in scheduled)
        transfers = self.kv.tiers.take() if self.kv.tiers is not None and scheduled else None
        num_new_prompt = 0
        now = time.monotonic()
        for s in scheduled:
            m = s.seq.group.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                num_new_prompt += s.seq.group.num_prompt_tokens
        return SchedulerOutput(
            scheduled,
            total,
            total - num_decode,
            num_decode,
            preempted,
            num_drafts,
            num_new_prompt,
            lookups,
            transfers,
        )

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine timed the step of `out`: the speculator's cost model learns from it."""
        if self.speculator is None:
            return
        rows = prefill = 0
        for s in out.scheduled:
            if s.is_decode or s.draft_token_ids:
                rows += 1
            else:
                prefill += 1
        self.speculator.observe_step(rows, out.num_draft_tokens, prefill > 0, seconds)

    def _step_time_budget(self) -> int:
        """This step's token budget under the step-time budget: the decodes plus the prefill its
        cost model fits in the target step time (engine.core.step_budget), the chunk starting
        where the first prompt still prefilling (else the next waiting one) stands."""
        assert self.step_budget is not None
        decodes, start = 0, None
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed_tokens
            decodes += left == 1
            if left > 1 and start is None:
                start = seq.num_computed_tokens
        if start is None:
            start = self.waiting[0].num_computed_tokens if self.waiting else 0
        return self.step_budget.token_budget(decodes, start)

    def _drafts(self, speculator: Speculator, seq: Sequence, budget: int) -> list[int]:
        """Proposed tokens for a decoding sequence whose KV blocks can take them now; never
        preempts for them (an empty list: decode plainly)."""
        drafts = speculator.propose(seq, budget, len(self.running))
        if drafts and not self.kv.allocate_slots(seq, 1 + len(drafts)):
            return []
        return drafts

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledSeq], lookups: PrefixCacheStats
    ) -> int:
        """Start (or resume) waiting sequences in arrival order while the budget, the sequence limit
        and the KV pool allow; returns the budget left."""
        i = 0  # self.waiting[:i] could not get KV blocks this step
        while i < len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            blocked = list(itertools.islice(self.waiting, i))
            if any(self.bypassed.get(b.seq_id, 0) >= HEAD_BYPASS_LIMIT for b in blocked):
                break  # FCFS from here: a blocked sequence has let enough others go first
            seq = self.waiting[i]
            if not lora_fits(self.max_loras, self.running, seq):
                i += 1  # waits for a running adapter to finish, like a sequence KV holds up
                if i >= BYPASS_WINDOW:
                    break
                continue
            hit: PrefixHit | None = None
            looked_up = seq.num_computed_tokens == 0  # not a follower already holding shared blocks
            if looked_up:
                hit = self.kv.find_cached_prefix(seq) or self.kv.sibling_prefix(seq)
            num_cached = hit.num_blocks * self.kv.block_size if hit is not None else 0
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, num_new, hit):
                if i == 0 and self._drop_waiting_blocks(seq):
                    continue  # retry: a waiting follower gave its shared blocks back
                i += 1
                if i >= BYPASS_WINDOW:
                    break
                continue
            for b in blocked:
                self.bypassed[b.seq_id] = self.bypassed.get(b.seq_id, 0) + 1
            del self.waiting[i]
            self.bypassed.pop(seq.seq_id, None)
            if seq.status is SequenceStatus.WAITING and looked_up:  # first admission, a real lookup
                self.kv.record_prefix_query(seq.num_tokens, num_cached, lookups)
                self.kv.record_tier_query(seq, num_cached)
                seq.num_cached_tokens = num_cached
            elif seq.num_lost_tokens:  # resumed: what the prefix cache does not give back is redone
                seq.group.metrics.num_recomputed_tokens += max(0, seq.num_lost_tokens - num_cached)
                seq.num_lost_tokens = 0
            seq.num_computed_tokens += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return budget

    def _scheduled(
        self, seq: Sequence, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new - len(drafts or ())  # the drafts come after the sequence's tokens
        needs_sample = end == seq.num_tokens and seq.group.max_output_tokens > 0
        rows = offset = 0
        logprobs_from = seq.prompt_logprobs_from
        if logprobs_from is not None:
            # Row j predicts token first+j+1; only prompt tokens are wanted.
            first = max(start, logprobs_from)
            rows = max(0, min(end, seq.num_prompt_tokens - 1) - first)
            offset = first - start if rows else 0
        tables = self.kv.get_block_tables(seq)
        held = self.kv.num_held_blocks(seq)
        return ScheduledSeq(
            seq, num_new, start, tables, needs_sample, rows, offset, held, drafts or []
        )

    def _drop_waiting_blocks(self, needy: Sequence) -> bool:
        """Free the shared blocks a waiting follower holds (the newest first) so `needy` can run; the
        follower recomputes them later. Without this, followers waiting behind a sequence that needs
        the whole pool would hold it up forever. False when no waiting sequence holds blocks."""
        for seq in reversed(self.waiting):
            if seq is not needy and self.kv.holds_blocks(seq):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)  # a draft model's KV goes with the target's
        seq.num_lost_tokens = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.group.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (%d tokens) to free KV blocks", seq.seq_id, seq.num_tokens)

    # -- after the runner ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> SchedulerUpdate:
        """Apply the runner's output for the step `out` scheduled: the KV written, each sequence's
        prompt logprob rows and sampled tokens under the stop rules, followers released once their
        leader's prompt is in, failed and finished sequences ended (their blocks freed); returns the
        groups touched and the step's stats."""
        self._advance_kv(out, result)
        stats = StepStats(
            out.kind,
            num_batched_tokens=out.num_batched_tokens,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_new_prompt_tokens=out.num_new_prompt_tokens,
        )
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for s in out.scheduled:
            seq, group = s.seq, s.seq.group
            if seq.status.finished:
                continue
            touched[group.request_id] = group
            if seq.seq_id in result.prompt_logprobs:
                store_prompt_logprobs(seq, *result.prompt_logprobs[seq.seq_id])
            if seq.seq_id in result.errors:
                if seq.matcher is not None and seq.matcher.is_error():  # it masked every token
                    self._end(seq, constraint_failure(group, seq.matcher.get_error()))
                else:
                    self._end(seq, Failure(result.errors[seq.seq_id]))
                continue
            if seq.index == 0 and seq.is_prefill_done:
                self.release_followers(group)
            if seq.seq_id not in result.sampled:
                if s.needs_sample is False and seq.is_prefill_done and group.max_output_tokens == 0:
                    # Scoring only (echo with no tokens to generate): done once the prompt is.
                    self.finish(seq, SequenceStatus.FINISHED_LENGTH)
                continue
            self._end(seq, self.updater.append_sampled(seq, s.draft_token_ids, result, now, stats))
        for group in touched.values():
            if group.finished:
                stats.finished.append(finished_stats(group, now))
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.kv_cache_usage = self.kv.usage
        stats.num_preemptions = len(out.preempted)
        stats.prefix_cache_queries = out.prefix_cache.queries
        stats.prefix_cache_hits = out.prefix_cache.hits
        return SchedulerUpdate(list(touched.values()), stats)

    def _end(self, seq: Sequence, ending: Ending) -> None:
        if isinstance(ending, Failure):  # the whole request fails
            group = seq.group
            group.error, group.fault = ending.message, ending.fault
            for s in group.seqs:
                self.finish(s, SequenceStatus.FINISHED_ERROR)
        elif ending is not None:
            self.finish(seq, ending)

    def _advance_kv(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """Account for the KV written this step, make the full blocks reusable, and give back what
        the sliding windows moved past. A verified sequence keeps the KV of its accepted drafts
        only: the rest is rolled back (its positions are computed again, their slots overwritten;
        blocks past them are freed)."""
        for s in out.scheduled:
            seq = s.seq
            if not s.draft_token_ids:
                seq.num_computed_tokens += s.num_new_tokens
                self.kv.cache_full_blocks(seq)
                self.kv.release_out_of_window(seq)
                continue
            accepted = result.num_accepted.get(seq.seq_id, 0)
            seq.num_computed_tokens += 1 + accepted
            # The accepted drafts and the bonus token are appended next: keep blocks for them only.
            self.kv.trim(seq, seq.num_computed_tokens + 1)
            self.kv.cache_full_blocks(seq)  # registers only blocks of tokens the sequence holds
            self.kv.release_out_of_window(seq)
            if self.speculator is not None and seq.seq_id not in result.errors:
                self.speculator.record(seq, len(s.draft_token_ids), accepted)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` and release its blocks (idempotent)."""
        if seq.status.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # a follower not released yet
            self.bypassed.pop(seq.seq_id, None)
        seq.status = status
        self.kv.free(seq)
        if self.speculator is not None:
            self.speculator.release(seq)


def _step_order(s: ScheduledSeq) -> tuple[bool, int]:
    lora_id = s.seq.group.lora_id
    return (not s.is_decode, -1 if lora_id is None else lora_id)


def lora_fits(max_loras: int | None, running: list[Sequence], seq: Sequence) -> bool:
    """Whether `seq` may run now: the base model always; an adapter when it already runs, or when
    fewer than `max_loras` distinct adapters run."""
    lora_id = seq.group.lora_id
    if max_loras is None or lora_id is None:
        return True
    running_ids = {s.group.lora_id for s in running if s.group.lora_id is not None}
    return lora_id in running_ids or len(running_ids) < max_loras

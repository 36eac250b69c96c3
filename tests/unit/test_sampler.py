"""Each sampling parameter changes the next-token distribution as a user would expect."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.executor.sampler import (
    RowError,
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
    first_argmax,
    make_generator,
)
from engine.kernels import cpu_kernels


def row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(temperature=0.0),
        token_ids=[*(prompt or []), *(output or [])],
        num_prompt_tokens=len(prompt or []),
        generator=generator,
        eos_token_ids=eos,
    )


def frequencies(logits: list[float], params: SamplingParams, draws: int = 8000) -> torch.Tensor:
    """Empirical distribution of `draws` samples of one row (batched, seeded shared generator)."""
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    batch = torch.tensor([logits]).repeat(draws, 1)
    out = sampler(batch, [row(params) for _ in range(draws)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits)).float() / draws


def greedy_pick(logits: list[float], **row_kwargs) -> int:
    params = row_kwargs.pop("params", SamplingParams(temperature=0.0))
    return Sampler()(torch.tensor([logits]), [row(params, **row_kwargs)]).token_ids[0]


def test_greedy_takes_argmax_lowest_id_on_ties_and_leaves_logits_untouched():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 5.0], [-2.0, -1.0, -3.0, -4.0]])
    before = logits.clone()
    out = Sampler()(logits, [row() for _ in range(3)])
    assert out.token_ids == [1, 0, 1]
    assert out.logprobs == [None, None, None]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 32])
@pytest.mark.parametrize("vocab", [49152, 50257, 600, 130])
def test_fast_greedy_argmax_equals_torch_max_with_ties_and_a_ragged_tail(rows: int, vocab: int):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab)
    logits[0, [7, vocab // 2, vocab - 1]] = 9.0  # ties across chunks: the first wins
    if rows > 1:
        logits[1, [vocab - 2, vocab - 1]] = 9.0  # the maximum only in the ragged tail
    if rows > 2:
        logits[2] = logits[2].round()  # ties everywhere, and one row with the maximum twice
        logits[-1, [vocab // 3, vocab // 3 + 1]] = 9.0
    expected_values, expected_ids = logits.max(dim=-1)
    values, ids = first_argmax(logits)
    assert torch.equal(ids, expected_ids) and torch.equal(values, expected_values)
    values, ids = first_argmax(logits[:, 1:])  # a non-contiguous view
    assert torch.equal(ids, logits[:, 1:].argmax(dim=-1))
    # the sampler's greedy rows, alone and beside a sampled row, pick the same tokens
    out = Sampler()(logits, [row() for _ in range(rows)])
    assert out.token_ids == expected_ids.tolist()
    mixed = [row(SamplingParams(temperature=1.0)), *[row() for _ in range(rows - 1)]]
    assert Sampler()(logits, mixed).token_ids[1:] == expected_ids.tolist()[1:]


def test_fast_greedy_argmax_reports_nan_and_all_minus_inf_rows_like_max():
    logits = torch.randn(4, 4096)
    logits[1, 4000] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("inf")
    values, ids = first_argmax(logits)
    assert values[1].isnan() and values[2] == float("-inf") and values[3] == float("inf")
    assert ids[3] == 5
    with pytest.raises(RowError) as info:
        Sampler()(logits, [row() for _ in range(4)])
    assert info.value.row_index == 1


def _argmax_cases() -> list[torch.Tensor]:
    """Rows of every width the kernel's vector loop, lane merge and tail meet, with ties, NaNs,
    infinities, signed zeros and strided rows."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in (1, 7, 8, 31, 63, 64, 65, 127, 200, 1000, 4099, 49152):
        rows = 3
        cases.append(torch.randn(rows, n, generator=gen))
        cases.append(torch.randint(-2, 2, (rows, n), generator=gen).float())  # ties everywhere
        nan = torch.randn(rows, n, generator=gen)
        nan[torch.rand(rows, n, generator=gen) < 0.02] = float("nan")
        nan[0, -1] = float("nan")  # at least one, in a tail or the last lane
        cases.append(nan)
        inf = torch.full((rows, n), float("-inf"))
        inf[1, n // 2] = float("inf")
        inf[2, torch.rand(n, generator=gen) < 0.3] = 5.0
        cases.append(inf)
        zeros = torch.where(torch.rand(rows, n, generator=gen) < 0.5, -0.0, 0.0)
        cases.append(zeros)  # -0.0 == 0.0: the first one, with its sign
        cases.append(torch.randn(rows, n + 5, generator=gen)[:, 2 : n + 2])  # strided rows
    return cases


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("portable", [False, True], ids=["vectorized", "portable"])
def test_first_argmax_kernel_is_bitwise_max_dim(portable):
    """csrc/first_argmax.cpp, each path: the value bits and first index torch's max(dim) gives."""
    for x in _argmax_cases():
        expected_values, expected_ids = x.max(dim=-1)
        values, ids = cpu_kernels.first_argmax(x, portable)
        assert torch.equal(ids, expected_ids), (x.shape, ids, expected_ids)
        assert torch.equal(values.view(torch.int32), expected_values.contiguous().view(torch.int32))


def test_top_k_one_and_tiny_top_p_equal_greedy():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    expected = logits.argmax(dim=-1).tolist()
    top_k = Sampler()(logits, [row(SamplingParams(temperature=1.0, top_k=1)) for _ in range(64)])
    top_p = Sampler()(logits, [row(SamplingParams(temperature=1.5, top_p=1e-6)) for _ in range(64)])
    assert top_k.token_ids == expected
    assert top_p.token_ids == expected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float):
    logits = [2.0, 1.0, 0.5, 0.0]
    freq = frequencies(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_top_k_keeps_only_k_best_renormalised():
    logits = [2.0, 1.0, 0.5, 0.0, 1.5]
    freq = frequencies(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(5)
    expected[[0, 4]] = torch.softmax(torch.tensor([2.0, 1.5]), dim=0)
    assert torch.allclose(freq, expected, atol=0.02), freq


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = frequencies(probs.log().tolist(), SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2] == 0 and freq[3] == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.02), freq


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([0.4, 0.3, 0.19, 0.11])  # threshold 0.5 * 0.4 = 0.2
    freq = frequencies(probs.log().tolist(), SamplingParams(temperature=1.0, min_p=0.5))
    assert freq[2] == 0 and freq[3] == 0
    assert torch.allclose(freq[:2], torch.tensor([4 / 7, 3 / 7]), atol=0.02), freq


def test_frequency_penalty_scales_with_count_of_generated_tokens():
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert greedy_pick([2.0, 1.5, 0.0], params=params, output=[0]) == 0  # 1.7 > 1.5
    assert greedy_pick([2.0, 1.5, 0.0], params=params, output=[0, 0]) == 1  # 1.4 < 1.5
    assert greedy_pick([2.0, 1.5, 0.0], params=params, prompt=[0, 0, 0]) == 0  # prompt not counted


def test_presence_penalty_is_flat_once_present():
    strong = SamplingParams(temperature=0.0, presence_penalty=0.6)
    weak = SamplingParams(temperature=0.0, presence_penalty=0.4)
    assert greedy_pick([2.0, 1.5], params=strong, output=[0]) == 1
    assert greedy_pick([2.0, 1.5], params=weak, output=[0, 0, 0]) == 0  # not multiplied by count
    encourage = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    assert greedy_pick([2.0, 1.5], params=encourage, output=[1]) == 1


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert greedy_pick([2.0, 1.5], params=params, prompt=[0]) == 1  # 2 / 1.5 < 1.5
    assert greedy_pick([2.0, 1.5], params=params, output=[0]) == 1
    assert greedy_pick([-1.0, -1.2], params=params, prompt=[0]) == 1  # -1 * 1.5 < -1.2
    assert greedy_pick([2.0, 1.5], params=params, prompt=[1]) == 0


def test_logit_bias_forces_and_bans_tokens():
    torch.manual_seed(1)
    logits = torch.randn(8, 30)
    force = SamplingParams(temperature=1.0, logit_bias={7: 100.0})
    assert Sampler()(logits, [row(force) for _ in range(8)]).token_ids == [7] * 8
    best = logits.argmax(dim=-1).tolist()
    banned = [row(SamplingParams(temperature=0.0, logit_bias={b: -100.0})) for b in best]
    picks = Sampler()(logits, banned).token_ids
    assert all(p != b for p, b in zip(picks, best, strict=True))


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # EOS = 0, stop token = 1
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    eos = frozenset({0})
    assert Sampler()(logits, [row(params, output=[3], eos=eos)]).token_ids == [2]
    assert Sampler()(logits, [row(params, output=[3, 3], eos=eos)]).token_ids == [0]


def test_logprobs_are_raw_log_softmax_with_ranks_and_sorted_top():
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5)),
        row(SamplingParams(temperature=0.7, logprobs=3, presence_penalty=1.0), output=[1, 2]),
        row(SamplingParams(temperature=0.0, logprobs=0, logit_bias={9: 100.0})),
        row(SamplingParams(temperature=1.0)),
    ]
    out = Sampler()(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    for i, n in [(0, 5), (1, 3), (2, 0)]:
        entry = out.logprobs[i]
        assert entry is not None and entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(expected[i, entry.token_id].item(), abs=1e-6)
        assert entry.rank == int((expected[i] > expected[i, entry.token_id]).sum()) + 1
        values, ids = expected[i].topk(n)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[0].rank == 1  # greedy picks the best token
    assert out.token_ids[2] == 9 and out.logprobs[2].rank > 1  # rank in the raw distribution
    assert out.logprobs[3] is None


def test_seeded_row_gives_same_tokens_alone_and_in_any_batch():
    torch.manual_seed(3)
    steps = [torch.randn(6, 100) for _ in range(12)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(batch_position: int, batch_size: int) -> list[int]:
        generator = make_generator(42, "cpu")
        other_seeded = make_generator(7, "cpu")
        tokens = []
        for logits in steps:
            rows = [
                row(SamplingParams(temperature=0.0)),
                row(SamplingParams(temperature=1.0)),
                row(SamplingParams(temperature=0.8, seed=7), generator=other_seeded),
                row(SamplingParams(temperature=1.2, top_k=5, presence_penalty=0.5), output=[1]),
                row(SamplingParams(temperature=0.5, min_p=0.1)),
            ][: batch_size - 1]
            rows.insert(batch_position, row(params, generator=generator))
            batch = logits[:batch_size].clone()
            batch[batch_position] = logits[5]  # the seeded request sees the same logits
            tokens.append(Sampler()(batch, rows).token_ids[batch_position])
        return tokens

    alone = run(0, 1)
    assert run(3, 6) == alone
    assert run(5, 6) == alone
    assert len(set(alone)) > 1  # genuinely sampled, not greedy


def test_different_seeds_give_different_samples():
    logits = torch.zeros(1, 1000)
    picks = set()
    for seed in range(5):
        params = SamplingParams(temperature=1.0, seed=seed)
        picks.add(
            Sampler()(logits, [row(params, generator=make_generator(seed, "cpu"))]).token_ids[0]
        )
    assert len(picks) > 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3, logprobs=2)],
)
def test_non_finite_row_raises_row_error_naming_that_row(bad: float, params: SamplingParams):
    logits = torch.randn(3, 10)
    logits[1, 4] = bad
    logits[2] = float("-inf")
    rows = [
        row(params, generator=make_generator(3, "cpu") if params.seed else None) for _ in range(3)
    ]
    with pytest.raises(RowError, match="row") as info:
        Sampler()(logits, rows)
    assert info.value.row_index == 1
    assert "[1, 2]" in str(info.value)  # the message names every bad row
    good = Sampler()(logits[:1], rows[:1])  # the healthy row samples fine on its own
    assert 0 <= good.token_ids[0] < 10


def test_prompt_logprobs_score_actual_next_tokens():
    torch.manual_seed(4)
    logits = torch.randn(5, 20)
    next_ids = torch.tensor([3, 0, 19, 7, 7])
    entries = compute_prompt_logprobs(logits, next_ids, num_top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in entries] == next_ids.tolist()
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(expected[i, next_ids[i]].item(), abs=1e-6)
        assert e.rank == int((expected[i] > expected[i, next_ids[i]]).sum()) + 1
        assert [t for t, _ in e.top] == expected[i].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits[:0], next_ids[:0], 2) == []


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Reference: the smallest best-first set of tokens whose probability reaches top_p."""
    probs, ids = torch.softmax(logits, dim=0).sort(descending=True)
    mass_before = probs.cumsum(0) - probs
    return set(ids[mass_before < top_p].tolist())


@pytest.mark.parametrize("scale", [0.002, 0.05])  # near-flat (nucleus of hundreds) and peaked
def test_top_p_on_large_vocab_matches_reference_nucleus(scale: float):
    logits = -torch.arange(2000, dtype=torch.float32) * scale
    params = SamplingParams(temperature=1.0, top_p=0.5)
    draws = 3000
    out = Sampler(generator=torch.Generator().manual_seed(5))(
        logits.repeat(draws, 1), [row(params) for _ in range(draws)]
    )
    allowed = nucleus(logits, 0.5)
    assert set(out.token_ids) <= allowed
    assert max(out.token_ids) >= 0.9 * max(allowed)  # reaches the edge of the nucleus


def test_top_k_then_top_p_renormalise_within_top_k():
    # top-3 renormalised: [0.5, 0.3, 0.2]; top_p 0.6 keeps the first two.
    logits = torch.tensor([0.5, 0.3, 0.2, 0.4, 0.35]).log()
    logits[3:] = -10.0
    logits[3] = torch.tensor(0.2).log() - 0.01  # just below the 3rd best: outside top-3
    freq = frequencies(logits.tolist(), SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.02), freq

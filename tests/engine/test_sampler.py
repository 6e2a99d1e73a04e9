"""The sampler on hand-built logits: masks, penalties, bias, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, apply_truncation, first_maxima
from engine.sampling_params import SamplingParams

EOS = 2
NEG_INF = float("-inf")


def make_request(
    prompt: list[int] | None = None, output: list[int] | None = None, **params: object
) -> Request:
    req = Request("r", prompt or [7], SamplingParams(**params))  # type: ignore[arg-type]
    for token in output or []:
        req.append_output_token(token)
    return req


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def probs_logits(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_all_greedy_rows_take_the_argmax() -> None:
    sampler = Sampler([EOS])
    logits = logits_of([0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0])
    rows = [make_request(temperature=0.0) for _ in range(3)]
    out = sampler.sample(logits, rows)
    assert out.token_ids == [1, 0, 3]
    assert out.logprobs == [None, None, None]


def test_top_k_keeps_exactly_the_k_best() -> None:
    logits = logits_of([1.0, 4.0, 3.0, 2.0, 0.0])
    masked = apply_truncation(logits, [SamplingParams(top_k=2)])
    assert masked[0].tolist() == [NEG_INF, 4.0, 3.0, NEG_INF, NEG_INF]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.5, [0]), (0.7, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: list[int]) -> None:
    logits = logits_of(probs_logits([0.5, 0.3, 0.15, 0.05]))
    masked = apply_truncation(logits, [SamplingParams(top_p=top_p)])
    assert [i for i, v in enumerate(masked[0].tolist()) if v != NEG_INF] == kept


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = logits_of(probs_logits([0.5, 0.3, 0.15, 0.05]))
    masked = apply_truncation(logits, [SamplingParams(min_p=0.2)])  # threshold 0.1
    assert [i for i, v in enumerate(masked[0].tolist()) if v != NEG_INF] == [0, 1, 2]


def test_masks_are_per_row() -> None:
    logits = logits_of([1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0])
    masked = apply_truncation(logits, [SamplingParams(top_k=1), SamplingParams()])
    assert masked[0].tolist() == [NEG_INF, 4.0, NEG_INF, NEG_INF]
    assert masked[1].tolist() == [1.0, 4.0, 3.0, 2.0]


def test_sampling_never_leaves_the_top_k() -> None:
    sampler = Sampler([EOS], seed=0)
    rows = [make_request(temperature=1.0, top_k=2) for _ in range(400)]
    logits = logits_of(*[[1.0, 1.5, 1.2, 0.0, 1.4]] * 400)
    tokens = sampler.sample(logits, rows).token_ids
    assert set(tokens) == {1, 4}


def test_sampling_follows_the_distribution() -> None:
    sampler = Sampler([EOS], seed=0)
    n = 4000
    rows = [make_request(temperature=1.0) for _ in range(n)]
    logits = logits_of(*[probs_logits([0.7, 0.2, 0.1])] * n)
    tokens = sampler.sample(logits, rows).token_ids
    freq = [tokens.count(t) / n for t in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    sampler = Sampler([EOS])
    row = make_request(prompt=[0], output=[1], temperature=0.0, repetition_penalty=2.0, logprobs=4)
    out = sampler.sample(logits_of([3.0, -1.0, 2.0, 0.5]), [row])
    expected = torch.tensor([1.5, -2.0, 2.0, 0.5]).log_softmax(-1)
    assert out.token_ids == [2]  # token 0 was the best before its penalty
    got = dict(out.logprobs[0].top_logprobs)  # type: ignore[union-attr]
    assert [got[i] for i in range(4)] == pytest.approx(expected.tolist())


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    sampler = Sampler([EOS])
    row = make_request(
        prompt=[3],
        output=[0, 0, 1],
        temperature=0.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=4,
    )
    out = sampler.sample(logits_of([2.0, 2.0, 1.0, 1.0]), [row])
    expected = torch.tensor([2.0 - 1.25, 2.0 - 0.75, 1.0, 1.0]).log_softmax(-1)
    got = dict(out.logprobs[0].top_logprobs)  # type: ignore[union-attr]
    assert [got[i] for i in range(4)] == pytest.approx(expected.tolist())
    assert out.token_ids == [1]


def test_logit_bias_can_force_or_forbid_a_token() -> None:
    sampler = Sampler([EOS], seed=0)
    forced = make_request(temperature=1.0, logit_bias={3: 100.0})
    forbidden = make_request(temperature=0.0, logit_bias={1: -100.0})
    out = sampler.sample(logits_of([0.0, 5.0, 0.0, 0.0], [0.0, 5.0, 1.0, 0.0]), [forced, forbidden])
    assert out.token_ids == [3, 2]


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached() -> None:
    sampler = Sampler([EOS])
    logits = [0.0, 1.0, 9.0, 0.0, 8.0]  # EOS best, stop token 4 second
    early = make_request(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=[4])
    done = make_request(output=[1, 1], temperature=0.0, min_tokens=2, stop_token_ids=[4])
    out = sampler.sample(logits_of(logits, logits), [early, done])
    assert out.token_ids == [1, EOS]


def banned_then_max(logits: torch.Tensor, banned: list[list[int]]) -> list[int]:
    """The general path's greedy pick: each row's banned tokens at -inf, then ``max(-1)``."""
    processed = logits.clone()
    for row, tokens in enumerate(banned):
        processed[row, tokens] = NEG_INF
    return processed.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("seed", range(8))
def test_greedy_min_tokens_shortcut_picks_what_the_ban_would(seed: int) -> None:
    """Greedy rows under ``min_tokens`` take the raw first maximum unless it is banned; that is
    the token the ban then ``max(-1)`` gives, on ties (a banned token tied first, or tied after
    the pick), beside a row past ``min_tokens`` and a row of -inf; a row with a bias as well
    sends the whole batch down the general path, which gives the same."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    logits = torch.randint(0, 4, (6, vocab), generator=gen).float()  # many ties
    logits[5, :] = NEG_INF
    bias = {3: 0.5} if seed % 2 else None
    rows, banned = [], []
    for i in range(6):
        stop = [int(t) for t in torch.randint(0, vocab, (2,), generator=gen)]
        row_bias = bias if i == 0 else None
        rows.append(make_request(output=[1] * i, temperature=0.0, min_tokens=4,
                                 stop_token_ids=stop, logit_bias=row_bias))  # fmt: skip
        banned.append(sorted({EOS, *stop}) if i < 4 else [])
    biased = logits.clone()
    if bias is not None:
        biased[0, 3] += 0.5
    expected = banned_then_max(biased, banned)
    assert Sampler([EOS]).sample(logits.clone(), rows).token_ids == expected


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_host_sample_equals_the_device_sample_then_read(rows: int) -> None:
    """``sample`` takes a few greedy CPU rows outside inference mode; the ids are those of
    ``sample_on_device`` read back, whether or not min_tokens bans the first maximum."""
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randint(0, 3, (rows, 10), generator=gen).float()
    logits[:, EOS] = 5.0  # EOS is every row's first maximum: banned while under min_tokens
    sampler = Sampler([EOS])
    for output in ([], [1, 1, 1]):  # under, then past, min_tokens
        reqs = [make_request(output=output, temperature=0.0, min_tokens=3) for _ in range(rows)]
        host = sampler.sample(logits.clone(), reqs)
        device = sampler.sample_on_device(logits.clone(), reqs).read()
        assert host.token_ids == device.token_ids and host.logprobs == device.logprobs
        assert all(t != EOS for t in host.token_ids) == (not output)


def test_greedy_reads_a_reused_logits_tensor_afresh_each_step() -> None:
    """The host step hands the same logits tensor every step, rewritten in place: each sample
    reads its current values (the kept NumPy view is of the same memory), and another tensor
    is read as itself."""
    sampler = Sampler([EOS])
    row = [make_request(temperature=0.0)]
    logits = logits_of([0.0, 3.0, 1.0, 2.0])
    assert sampler.sample(logits, row).token_ids == [1]
    logits.copy_(logits_of([0.0, 1.0, 1.0, 7.0]))
    assert sampler.sample(logits, row).token_ids == [3]
    assert sampler.sample(logits[:, :3], row).token_ids == [1]  # a view: another tensor
    assert sampler.sample(logits_of([4.0, 1.0, 1.0, 0.0]), row).token_ids == [0]


def test_greedy_min_tokens_with_the_banned_token_first_takes_the_next_maximum() -> None:
    sampler = Sampler([EOS])
    tied = logits_of([0.0, 1.0, 5.0, 5.0, 0.0])  # EOS (2) ties with 3 and comes first
    early = make_request(output=[1], temperature=0.0, min_tokens=3)
    assert sampler.sample(tied.clone(), [early]).token_ids == [3]
    after = logits_of([0.0, 5.0, 5.0, 0.0, 0.0])  # the first maximum (1) is not banned
    assert sampler.sample(after.clone(), [early]).token_ids == [1]
    logprobs = make_request(output=[1], temperature=0.0, min_tokens=3, logprobs=1)
    out = sampler.sample(tied.clone(), [logprobs])
    assert out.token_ids == [3] and out.logprobs[0] is not None
    assert out.logprobs[0].top_logprobs[0][0] == 3  # EOS's -inf is in the logprobs


def seeded_sequence(seed: int, companions: int, steps: int = 20) -> list[int]:
    vocab = 1000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    sampler = Sampler([EOS])
    row = make_request(temperature=1.0, top_p=0.95, seed=seed)
    for _ in range(steps):
        others = [make_request(temperature=1.0) for _ in range(companions)]
        logits = base.repeat(1 + companions, 1)
        out = sampler.sample(logits, [*others, row])
        row.append_output_token(out.token_ids[-1])
    return row.output_token_ids


def test_logprobs_report_the_chosen_token_and_top_alternatives() -> None:
    sampler = Sampler([EOS], seed=0)
    row = make_request(temperature=0.5, logprobs=2)
    raw = [1.0, 3.0, 2.0, 0.0]
    out = sampler.sample(logits_of(raw), [row])
    lp = out.logprobs[0]
    assert lp is not None
    expected = (torch.tensor(raw) / 0.5).log_softmax(-1)
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(expected[lp.token_id].item())
    assert [t for t, _ in lp.top_logprobs] == [1, 2]
    top_values = [v for _, v in lp.top_logprobs]
    assert top_values == pytest.approx([expected[1].item(), expected[2].item()])


def test_logprobs_zero_reports_only_the_chosen_token() -> None:
    sampler = Sampler([EOS])
    out = sampler.sample(logits_of([1.0, 3.0]), [make_request(temperature=0.0, logprobs=0)])
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 1 and lp.top_logprobs == []
    assert lp.logprob == pytest.approx(torch.tensor([1.0, 3.0]).log_softmax(-1)[1].item())


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    sampler = Sampler([EOS], seed=0)
    rows = [make_request(temperature=0.0), make_request(temperature=1.0, top_k=1)]
    out = sampler.sample(logits_of([0.0, 2.0, 1.0], [3.0, 0.0, 1.0]), rows)
    assert out.token_ids == [1, 0]


def test_seeded_row_is_reproducible_whatever_its_companions() -> None:
    alone = seeded_sequence(seed=1234, companions=0)
    assert seeded_sequence(seed=1234, companions=7) == alone
    assert seeded_sequence(seed=1234, companions=3) == alone
    assert seeded_sequence(seed=99, companions=0) != alone


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
def test_greedy_picks_the_first_maximum_as_torch_max_does(rows: int) -> None:
    """The greedy pick (NumPy's argmax for a few CPU rows, PyTorch's max beyond) is
    ``max(-1).indices`` on ties, NaN, rows of -inf and a transposed (strided) view."""
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randint(0, 5, (rows, 300), generator=gen).float()  # many ties
    logits[0, :] = NEG_INF
    if rows > 1:
        logits[1, 17] = float("nan")
        logits[1, 40] = float("nan")
    for view in (logits, logits.t().contiguous().t()):
        picked = first_maxima(view)
        assert picked.dtype == torch.int64
        assert torch.equal(picked, view.max(dim=-1).indices)
    assert first_maxima(logits)[0] == 0 and (rows == 1 or first_maxima(logits)[1] == 17)

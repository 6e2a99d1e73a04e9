"""The sampler as batched tensor ops: a row's result does not depend on its companions, the
number of device ops does not grow with the number of rows, and seeded draws come from a
counter-based generator (same bits on every device)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.request import Request
from engine.sampler import Sampler, row_key, seeded_exponentials
from engine.sampling_params import SamplingParams

# The two cores are shared: one intra-op thread (see conftest.one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2
VOCAB = 12


def make_request(prompt: list[int], output: list[int], **params: Any) -> Request:
    req = Request("r", prompt, SamplingParams(**params))
    for token in output:
        req.append_output_token(token)
    return req


def mixed_rows() -> list[Request]:
    """One row of each processing kind, several kinds at once in some."""
    return [
        make_request([1, 3], [4], temperature=0.0, repetition_penalty=1.7, logprobs=VOCAB),
        make_request(
            [5],
            [6, 6, 7],
            temperature=0.0,
            frequency_penalty=0.4,
            presence_penalty=0.3,
            logprobs=VOCAB,
        ),  # fmt: skip
        make_request(
            [0],
            [1],
            temperature=0.0,
            min_tokens=3,
            stop_token_ids=[9],
            logit_bias={8: 2.5, 3: -1.0},
            logprobs=VOCAB,
        ),  # fmt: skip
        make_request(
            [2, 2],
            [],
            temperature=0.7,
            repetition_penalty=0.8,
            frequency_penalty=1.0,
            logprobs=VOCAB,
            seed=17,
            top_k=5,
        ),  # fmt: skip
        make_request([4], [10, 11], temperature=0.0, logprobs=VOCAB),  # nothing to process
    ]


def _logits(n: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(3)) * 3


def test_each_rows_processed_distribution_is_the_same_alone_or_in_a_batch() -> None:
    rows = mixed_rows()
    logits = _logits(len(rows))
    together = Sampler([EOS], seed=0).sample(logits.clone(), rows)
    for i, row in enumerate(rows):
        alone = Sampler([EOS], seed=0).sample(logits[i : i + 1].clone(), [row])
        assert alone.token_ids[0] == together.token_ids[i], i
        a, b = alone.logprobs[0], together.logprobs[i]
        assert a is not None and b is not None
        assert a.logprob == b.logprob and a.top_logprobs == b.top_logprobs, i


def test_processing_matches_its_definition_row_by_row() -> None:
    rows = mixed_rows()
    logits = _logits(len(rows))
    out = Sampler([EOS], seed=0).sample(logits.clone(), rows)
    expected = logits.clone()
    # row 0: repetition 1.7 over prompt + output {1, 3, 4}
    for t in (1, 3, 4):
        v = expected[0, t]
        expected[0, t] = v / 1.7 if v > 0 else v * 1.7
    # row 1: output 6, 6, 7: frequency 0.4 per count, presence 0.3 once
    expected[1, 6] -= 0.4 * 2 + 0.3
    expected[1, 7] -= 0.4 + 0.3
    # row 2: bias, then EOS and the stop token banned (1 output token < min_tokens 3)
    expected[2, 8] += 2.5
    expected[2, 3] -= 1.0
    expected[2, [EOS, 9]] = float("-inf")
    for i in (0, 1, 2, 4):  # greedy rows: logprobs of the processed logits
        lp = out.logprobs[i]
        assert lp is not None
        want = expected[i].log_softmax(-1)
        got = dict(lp.top_logprobs)
        assert [got[t] for t in range(VOCAB)] == pytest.approx(want.tolist(), abs=1e-6), i
        assert out.token_ids[i] == int(want.argmax())


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops (kernels on a GPU) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += not func.is_view  # views launch nothing
        return func(*args, **(kwargs or {}))


def _ops_for(copies: int) -> int:
    rows = mixed_rows() * copies
    logits = _logits(len(rows))
    sampler = Sampler([EOS], seed=0)
    with _CountOps() as counter:
        sampler.sample(logits, rows)
    return counter.count


def test_device_ops_do_not_grow_with_the_number_of_rows() -> None:
    assert _ops_for(1) == _ops_for(20)  # 5 rows or 100: the same ops, on bigger tensors


def test_seeded_draws_depend_only_on_key_and_token() -> None:
    keys = torch.tensor([row_key(7, 0), row_key(7, 1), row_key(8, 0)])
    q = seeded_exponentials(keys, 1000)
    assert torch.equal(seeded_exponentials(keys[1:2], 1000)[0], q[1])  # alone = in a batch
    assert torch.equal(seeded_exponentials(keys, 10), q[:, :10])  # a prefix of the vocab
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    assert row_key(7, 0) == row_key(7, 0) and q.dtype == torch.float32
    assert bool((q > 0).all()) and bool(q.isfinite().all())


def test_seeded_draws_are_exponential() -> None:
    draws = seeded_exponentials(torch.tensor([row_key(s, 3) for s in range(8)]), 20000).double()
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e; 160,000 draws: standard errors ~0.003
    assert draws.mean().item() == pytest.approx(1.0, abs=0.015)
    assert draws.var().item() == pytest.approx(1.0, abs=0.04)
    assert (draws > 1).double().mean().item() == pytest.approx(1 / 2.718281828, abs=0.01)


def test_seeded_rows_follow_the_distribution() -> None:
    n = 4000
    probs = [0.6, 0.3, 0.1]
    rows = [make_request([0], [], temperature=1.0, seed=s) for s in range(n)]
    logits = torch.tensor([probs]).log().repeat(n, 1)
    tokens = Sampler([EOS], seed=0).sample(logits, rows).token_ids
    freq = [tokens.count(t) / n for t in range(3)]
    assert freq == pytest.approx(probs, abs=0.04)


def test_logprobs_of_rows_asking_different_counts_in_one_batch() -> None:
    rows = [
        make_request([0], [], temperature=0.0, logprobs=0),
        make_request([0], [], temperature=0.0, logprobs=3),
        make_request([0], [], temperature=0.0),
        make_request([0], [], temperature=0.0, logprobs=1),
    ]
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]] * 4)
    out = Sampler([EOS]).sample(logits, rows)
    lp = logits[0].log_softmax(-1)
    assert out.logprobs[2] is None
    got = [x for x in out.logprobs if x is not None]
    assert [x.token_id for x in got] == [2, 2, 2]
    assert [len(x.top_logprobs) for x in got] == [0, 3, 1]
    assert [t for t, _ in got[1].top_logprobs] == [2, 3, 1]
    assert got[1].logprob == pytest.approx(lp[2].item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_draws_are_the_same_bits_on_cuda_and_cpu() -> None:
    keys = torch.tensor([row_key(s, p) for s in (1, 99) for p in (0, 5)])
    assert torch.equal(
        seeded_exponentials(keys, 5000), seeded_exponentials(keys.cuda(), 5000).cpu()
    )

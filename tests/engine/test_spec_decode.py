"""Speculative decoding end to end on tiny random Llamas: the proposers, exactness (greedy and
seeded outputs identical to no speculation under batching, chunked prefill, preemption,
prefix caching, stops and logprobs), the target's distribution kept, the off switch, and
blocks freed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}  # fmt: skip


def draft_spec(tiny_llama_dir: Path, k: int = 3) -> dict[str, Any]:
    return {
        "model": str(tiny_llama_dir),
        "num_speculative_tokens": k,
        "disable_by_batch_size": None,
    }


def prompt(n: int, start: int = 100) -> list[int]:
    return [(start + 7 * i) % 4000 + 10 for i in range(n)]


def copy_heavy(i: int) -> list[int]:
    """A prompt that repeats itself, so prompt lookup has something to find."""
    return prompt(10 + i, start=i * 50) * 3


def assert_no_blocks_held(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(b.ref_cnt == 0 for b in engine.scheduler.kv.pool.blocks)
    proposer = engine.speculation.proposer if engine.speculation else None
    if proposer is not None and hasattr(proposer, "pool"):
        assert proposer.pool.num_used == 0


def summary(outs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    rows = []
    for o in outs:
        c = o.outputs[0]
        lps = (
            None
            if c.logprobs is None
            else [(lp.token_id, round(lp.logprob, 3)) for lp in c.logprobs]
        )
        rows.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
    return rows


# ----------------------------------------------------------------------------- config, proposer


def test_config_keeps_vllm_keys_and_names_bad_ones() -> None:
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 5, 3)
    assert cfg.prompt_lookup_min == 3  # vLLM: a missing bound is the other one
    lookup = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (5, 5)
    assert cfg.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert (
        SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 2}).method == "draft_model"
    )
    assert (
        SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    )
    for bad, word in [
        ("{", "JSON"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=word) as info:
            SpeculativeConfig.parse(bad)
        assert "--speculative-config" in str(info.value)


def test_engine_flag_parses_into_the_config() -> None:
    import argparse

    from engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    flag = '{"model": "smollm2-135m", "num_speculative_tokens": 2, "disable_by_batch_size": 8}'
    config = EngineConfig.from_cli_args(parser.parse_args(["--speculative-config", flag]))
    assert config.speculative == SpeculativeConfig("draft_model", 2, "smollm2-135m", 5, 5, 8)
    assert EngineConfig.from_cli_args(parser.parse_args([])).speculative is None
    with pytest.raises(ValueError, match="--speculative-config"):
        EngineConfig(speculative_config='{"num_speculative_tokens": -1}')


def test_ngram_proposes_what_followed_the_longest_repeated_suffix() -> None:
    ngram = NgramProposer(1, 3)
    assert ngram.propose_one([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    # The 3-gram (7, 2, 3) beats the later 2-gram (2, 3).
    assert ngram.propose_one([7, 2, 3, 8, 8, 2, 3, 6, 7, 2, 3], 2) == [8, 8]
    assert ngram.propose_one([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram.propose_one([5, 5, 5, 5], 3) == [5, 5, 5]  # a loop continues itself
    assert ngram.propose_one([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]  # period 3
    assert NgramProposer(2, 3).propose_one([1, 2, 9, 2], 2) == []  # needs 2 tokens to match


# ----------------------------------------------------------------------------- exactness


def mixed_params(stop: str) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [
        greedy,
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=25,
            frequency_penalty=0.5,
            ignore_eos=True,
            logprobs=1,
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=33, min_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=99, max_tokens=40, ignore_eos=True),
    ]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_outputs_equal_no_speculation_with_batching_and_preemption(
    tiny: LoadedModel, tiny_llama_dir: Path, proposer: str
) -> None:
    prompts = [copy_heavy(i) for i in range(7)] + [prompt(70, start=3)]
    plain = LLM.from_engine(make_engine(tiny))
    free = plain.generate(
        [prompts[4]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # ends the request mid-output
    params = mixed_params(stop)
    expected = summary(plain.generate(prompts, params))
    spec = NGRAM if proposer == "ngram" else draft_spec(tiny_llama_dir)
    # 10 blocks of 16 tokens for 8 requests of up to 110 tokens: preemption is forced; a
    # 48-token step budget splits the 70-token prompt into chunks.
    for mode in ("recompute", "swap"):
        engine = make_engine(
            tiny, speculative_config=spec, num_gpu_blocks_override=10, preemption_mode=mode,
            max_num_batched_tokens=48,
        )  # fmt: skip
        got = summary(LLM.from_engine(engine).generate(prompts, params))
        assert got == expected
        assert engine.stats().num_preemptions > 0
        stats = engine.speculation.stats  # type: ignore[union-attr]
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some were rejected
        assert_no_blocks_held(engine)
    assert expected[4][2:4] == ("stop", stop)


def test_draft_equal_to_target_accepts_every_greedy_guess(
    tiny: LoadedModel, tiny_llama_dir: Path
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [prompt(20 + 9 * i, start=i * 31) for i in range(6)]
    expected = [
        o.outputs[0].token_ids for o in LLM.from_engine(make_engine(tiny)).generate(prompts, params)
    ]
    engine = make_engine(tiny, speculative_config=draft_spec(tiny_llama_dir, k=4))
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert got == expected
    stats = engine.speculation.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # acceptance 1.0
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts
    # Each step verified up to 4 guesses and kept them all: about 5 tokens per step.
    assert engine.stats().num_steps < 6 * 30 / 3
    assert_no_blocks_held(engine)


def test_only_accepted_tokens_blocks_enter_the_prefix_cache(tiny: LoadedModel) -> None:
    """A follow-up whose prompt is the first answer reuses its cached blocks; if a rejected
    guess's KV had been hashed, its continuation would differ from the plain engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    first_prompt = copy_heavy(3)
    engine = make_engine(tiny, speculative_config=NGRAM)
    llm = LLM.from_engine(engine)
    first = llm.generate([first_prompt], params)[0].outputs[0].token_ids
    follow_up = first_prompt + first + prompt(5, start=7)
    again = llm.generate([follow_up], params)[0]
    assert again.num_cached_tokens >= 16 * ((len(first_prompt) + 40) // 16)
    plain = LLM.from_engine(make_engine(tiny)).generate([follow_up], params)[0]
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids
    assert engine.speculation.stats.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_max_tokens_is_never_exceeded_and_guesses_stop_short_of_it(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, speculative_config=NGRAM)
    for max_tokens in (1, 2, 3, 5, 6):
        engine.add_request(f"m{max_tokens}", [5, 5, 5, 5, 5, 5], SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
    finals = run_all(engine)
    for max_tokens in (1, 2, 3, 5, 6):
        c = finals[f"m{max_tokens}"].outputs[0]
        assert (len(c.token_ids), c.finish_reason) == (max_tokens, "length")
    assert engine.stats().num_generation_tokens == 1 + 2 + 3 + 5 + 6
    assert_no_blocks_held(engine)


# ----------------------------------------------------------------------------- off switch, abort


def test_speculation_turns_off_above_disable_by_batch_size(tiny: LoadedModel) -> None:
    spec = dict(NGRAM, disable_by_batch_size=2)
    engine = make_engine(tiny, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", copy_heavy(i), params)
    for _ in range(6):  # four running: above the switch
        engine.step()
        assert len(engine.scheduler.running) == 4
        assert engine.speculation.stats.num_drafts == 0  # type: ignore[union-attr]
    engine.abort("r0")
    engine.abort("r1")
    run_all(engine)
    assert engine.speculation.stats.num_drafts > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_abort_mid_speculation_frees_every_block(
    tiny: LoadedModel, tiny_llama_dir: Path, proposer: str
) -> None:
    spec = NGRAM if proposer == "ngram" else draft_spec(tiny_llama_dir)
    engine = make_engine(tiny, speculative_config=spec, num_gpu_blocks_override=40)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", copy_heavy(i), params)
    drafted = 0
    while drafted == 0:
        engine.step()
        drafted = engine.speculation.stats.num_drafts  # type: ignore[union-attr]
    engine.speculation.propose(engine.scheduler.running)  # type: ignore[union-attr]
    assert any(r.spec_token_ids for r in engine.scheduler.running)  # guesses in flight
    for i in range(3):
        out = engine.abort(f"r{i}")
        assert out is not None and out.outputs[0].finish_reason == "abort"
    assert_no_blocks_held(engine)


# ----------------------------------------------------------------------------- distribution


def test_verify_keeps_the_target_distribution() -> None:
    """Rows with known target distributions p0 (first position) and p1 (after guess g0):
    the emitted (first, second) pairs follow p0, and p0(g0) * p1 after an accepted guess."""
    vocab, num = 6, 60_000
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.2, 0.05, 0.05, 0.3])
    guess = [3, 0]  # g0 is likely, g1 = 0 is accepted with p1(0)
    logits = torch.stack([p0.log(), p1.log(), torch.zeros(vocab)]).repeat(num, 1)
    params = SamplingParams(temperature=1.0, max_tokens=10)

    class Row:
        sampling_params = params
        prompt_token_ids = [1]
        output_token_ids: list[int] = []

    sampler = Sampler([], seed=1234)
    out = sampler.verify(logits, [Row()] * num, [guess] * num)
    counts = torch.zeros(vocab, vocab + 1)  # [first, second or "none"]
    for tokens in out.token_ids:
        counts[tokens[0], tokens[1] if len(tokens) > 1 else vocab] += 1
    expected = torch.zeros(vocab, vocab + 1)
    for t in range(vocab):
        if t != guess[0]:
            expected[t, vocab] = p0[t]
    expected[guess[0], :vocab] = p0[guess[0]] * p1
    expected *= num
    seen = expected > 0
    assert counts[~seen].sum() == 0
    chi2 = (((counts - expected) ** 2)[seen] / expected[seen]).sum().item()
    # 10 degrees of freedom: P(chi2 > 35.6) = 1e-4; the seed is fixed, so this never flakes.
    assert chi2 < 35.6
    # The third row (after g1) is never used unless g1 was accepted; then it is the bonus.
    assert all(len(t) <= 3 for t in out.token_ids)
    assert sum(out.num_accepted) == sum(len(t) - 1 for t in out.token_ids)


def test_engine_sampling_keeps_the_target_distribution(
    tiny: LoadedModel, tiny_llama_dir: Path
) -> None:
    """Top-k 3 at temperature 1: the exact distribution of the first two tokens, computed from
    the plain engine's logprobs, against 600 speculative samples (chi-square, fixed seed).
    The second token is the one verified against the draft's guess (accepted or resampled)."""
    base = copy_heavy(2)
    plain = make_engine(tiny)
    probe = SamplingParams(temperature=1.0, top_k=3, max_tokens=1, logprobs=3, ignore_eos=True)

    def top3(tokens: list[int]) -> dict[int, float]:
        out = LLM.from_engine(plain).generate([tokens], probe)[0].outputs[0].logprobs
        assert out is not None
        top = dict(out[0].top_logprobs)
        total = sum(torch.tensor(list(top.values())).exp().tolist())
        return {t: float(torch.tensor(lp).exp()) / total for t, lp in top.items()}

    exact: dict[tuple[int, int], float] = {}
    for t0, q0 in top3(base).items():
        for t1, q1 in top3([*base, t0]).items():
            exact[(t0, t1)] = q0 * q1
    engine = make_engine(tiny, speculative_config=draft_spec(tiny_llama_dir, k=1), seed=2024)
    num = 600
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    outs = LLM.from_engine(engine).generate([base] * num, params)
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        first, second = o.outputs[0].token_ids[:2]
        counts[(first, second)] = counts.get((first, second), 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - num * p) ** 2 / (num * p) for k, p in exact.items())
    assert chi2 < 33.7  # 8 degrees of freedom: P(chi2 > 33.7) = 5e-5
    assert engine.speculation.stats.num_draft_tokens > 0  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- metrics, log


def test_metrics_and_log_line_report_acceptance(tiny: LoadedModel) -> None:
    from engine.server.metrics import ServerMetrics
    from engine.stats import EngineStats, format_stats

    engine = make_engine(tiny, speculative_config=NGRAM)
    LLM.from_engine(engine).generate(
        [copy_heavy(1)], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )
    stats = engine.stats()
    spec = engine.speculation.stats  # type: ignore[union-attr]
    assert stats.spec_decode_num_drafts == spec.num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == sum(
        stats.spec_decode_num_accepted_tokens_per_pos
    )
    body = ServerMetrics("tiny", 1024, engine.stats).render().decode()
    series = {
        'vllm:spec_decode_num_drafts_total{model_name="tiny"}': spec.num_drafts,
        'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}': spec.num_draft_tokens,
        'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}': spec.num_accepted_tokens,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}': (
            spec.num_accepted_tokens_per_pos[0]
        ),
    }
    for name, value in series.items():
        assert f"{name} {float(value)}" in body
    plain = ServerMetrics("tiny", 1024, make_engine(tiny).stats).render().decode()
    assert "spec_decode" not in plain  # absent when the engine does not speculate

    lines = format_stats(EngineStats(), stats, 2.0)
    rate = 100 * spec.num_accepted_tokens / spec.num_draft_tokens
    assert lines[1].startswith(f"SpecDecoding metrics: Draft acceptance rate: {rate:.1f}%")
    assert len(format_stats(EngineStats(), make_engine(tiny).stats(), 2.0)) == 1


# ----------------------------------------------------------------------------- grammar, LoRA


def test_grammar_masks_every_verified_position(tiny: LoadedModel, tiny_llama_dir: Path) -> None:
    import json

    from engine.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "tag": {"enum": ["a", "b"]}},
        "required": ["name", "tag"],
        "additionalProperties": False,
    }
    spec_params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    tokenizer = tiny.tokenizer
    example = tokenizer.encode('{"name":"ab","tag":"a"} {"name":"cd","tag":"b"} ' * 2)
    prompts = [example, example + prompt(5), prompt(12) * 2]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec_params),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40, structured_outputs=spec_params),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    expected = summary(LLM.from_engine(make_engine(tiny)).generate(prompts, params))
    for spec in (NGRAM, draft_spec(tiny_llama_dir)):
        engine = make_engine(tiny, speculative_config=spec)
        got = summary(LLM.from_engine(engine).generate(prompts, params))
        assert got == expected
        for row in got[:2]:
            assert set(json.loads(row[1])) == {"name", "tag"}
        assert engine.speculation.stats.num_draft_tokens > 0  # type: ignore[union-attr]
        assert_no_blocks_held(engine)

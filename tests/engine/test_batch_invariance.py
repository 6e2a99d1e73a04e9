"""The default numerics are batch invariant (issue 42): a request's greedy tokens do not depend
on the prefix cache, on the other requests in its steps, on the chunk size, on speculation or on
the number of threads.

Three levels: random batch compositions on a tiny model in GGUF blocks (hypothesis); one row's
logits bit for bit alone and inside a 64-row step on the real default model; and (slow) the
issue's proof, 12 chat prompts on the real default model at the default flags in every
situation a request can meet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_engine import make_engine, run_all
from tiny_llama import build_tiny_llama

from engine.attention import AttentionMetadata
from engine.kernels import cpu
from engine.kv_cache_dtype import cache_shape
from engine.llm import LLM
from engine.model_loader import LoadedModel, load_model
from engine.models.block_linear import BlockLinear, GGUFBlocks
from engine.models.llama import LlamaForCausalLM
from engine.models.panel_step import FusedPanelStep, use_native_norms
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")

# head_dim 32: the vector attention passes serve it, as they serve the real models.
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
         "num_key_value_heads": 1}  # fmt: skip


def _random_blocks(kind: str, rows: int, cols: int, gen: torch.Generator) -> GGUFBlocks:
    nb = cols // 32
    scales = (torch.rand(rows, nb, generator=gen) * 0.01 + 0.004).half().float()
    if kind == "q8_0":
        qs = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
        return GGUFBlocks(kind, qs, scales)
    qs = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    mins = (torch.randn(rows, nb, generator=gen) * 0.03).half().float()
    return GGUFBlocks(kind, qs, scales, mins)


def _in_blocks(model: LlamaForCausalLM, seed: int) -> None:
    """Every projection in Q4_1 blocks and the tied head in Q8_0, packed in panels, each dense
    weight the one its blocks encode, the native norms and the fused panel step: what the GGUF
    loader builds under float32 (so small steps run natively, bigger ones in Python)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, BlockLinear):
            blocks = _random_blocks("q4_1", *module.weight.shape, gen)
            module.weight.data = blocks.dequantize()
            blocks.pack_panels()
            module.blocks = blocks
    head = _random_blocks("q8_0", *model.model.embed_tokens.weight.shape, gen)
    head.scales = (head.scales * 20).half().float()  # clear greedy winners; float16, as a file's
    model.model.embed_tokens.weight.data = head.dequantize()
    head.pack_panels()
    model.lm_head_blocks = head
    use_native_norms(model)  # as the loader does: steps of <= 8 tokens in one native call
    model.fused_step = FusedPanelStep.build(model)
    assert model.fused_step is not None


@pytest.fixture(scope="module")
def tiny_blocks(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = build_tiny_llama(tmp_path_factory.mktemp("invariant") / "tiny", seed=4, **SIZES)
    loaded = load_model(ModelSource("tiny", Path(folder), "hf"), torch.float32, "cpu")
    _in_blocks(loaded.model, seed=9)
    return loaded


def _greedy(max_tokens: int) -> SamplingParams:
    """Greedy, with each chosen token's logprob: a float read from the row's logits, so a
    difference in their last bit shows even where the choice does not flip."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def _tokens(output: RequestOutput) -> list[tuple[int, float]]:
    completion = output.outputs[0]
    assert completion.logprobs is not None
    return [(t.token_id, t.logprob) for t in completion.logprobs]


def _solo(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[tuple[int, float]]:
    engine = make_engine(loaded, enable_prefix_caching=False)
    engine.add_request("solo", prompt, _greedy(max_tokens))
    return _tokens(run_all(engine)["solo"])


# Small vocabulary slices repeat n-grams, so n-gram speculation finds guesses.
prompts = st.lists(st.integers(1000, 1040), min_size=1, max_size=30)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.lists(st.tuples(prompts, st.integers(1, 6), st.booleans()), min_size=1, max_size=6),
    budget=st.sampled_from([8, 24, 64, 512]),
    caching=st.booleans(),
    threads=st.sampled_from([1, 2]),
    ngram=st.booleans(),
)
def test_random_batch_compositions_give_each_request_its_solo_tokens(
    tiny_blocks: LoadedModel,
    batch: list[tuple[list[int], int, bool]],
    budget: int,
    caching: bool,
    threads: int,
    ngram: bool,
) -> None:
    """Requests (some sharing the first request's prompt as a prefix, so the cache hits),
    any token budget (chunk size), prefix caching on or off, 1 or 2 threads, n-gram
    speculation or none: each request's tokens and their logprobs, to the bit, equal those it
    gets alone on a fresh engine
    (more threads than this machine's cores only make OpenMP barriers slow; the kernel tests
    take 3)."""
    first = batch[0][0]
    requests = [(first + p if share else p, n) for p, n, share in batch]
    expected = [_solo(tiny_blocks, p, n) for p, n in requests]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = make_engine(
            tiny_blocks, max_num_batched_tokens=budget, enable_prefix_caching=caching,
            max_num_seqs=4, speculative_config=spec if ngram else None,
        )  # fmt: skip
        engine.add_request("warm", first, _greedy(3))  # its blocks stay cached for the others
        run_all(engine)
        for i, (prompt, n) in enumerate(requests):
            engine.add_request(str(i), prompt, _greedy(n))
        done = run_all(engine)
    finally:
        torch.set_num_threads(before)
    assert [_tokens(done[str(i)]) for i in range(len(requests))] == expected


# ------------------------------------------------------------------ the real default model


@pytest.fixture(scope="module")
def smollm2_blocks(smollm2_gguf: Path) -> LoadedModel:
    """The default model as --dtype auto loads it: float32 on its GGUF blocks (panels)."""
    return load_model(ModelSource("smollm2", smollm2_gguf, "gguf"), torch.float32, "cpu", "gguf")


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _last_logits(
    model: LlamaForCausalLM, steps: list[list[tuple[list[int], int, list[int]]]]
) -> list[torch.Tensor]:
    """Run ``steps`` (each a list of (tokens, first position, block table)) on fresh caches;
    the logits of every request's last row, per step."""
    cfg = model.config
    shape = cache_shape(torch.float32, 24, 16, cfg.num_key_value_heads, cfg.head_dim)
    caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    out = []
    for step in steps:
        ids = [t for tokens, _, _ in step for t in tokens]
        positions = [s + i for tokens, s, _ in step for i in range(len(tokens))]
        q_lens = [len(tokens) for tokens, _, _ in step]
        meta = AttentionMetadata.build(
            q_lens, [s + len(t) for t, s, _ in step], [table for _, _, table in step], 16
        )
        rows = torch.tensor(q_lens).cumsum(0) - 1
        _, logits = model.forward_and_logits(
            torch.tensor(ids), torch.tensor(positions), caches, meta, rows
        )
        out.append(logits)
    return out


@pytest.mark.slow
def test_one_row_has_the_same_logits_alone_as_in_a_64_row_step_on_the_default_model(
    smollm2_blocks: LoadedModel, restore_threads: None
) -> None:
    """Request A's last-row logits, bit for bit: alone; inside a 64-row step beside two other
    prompts; prefilled in two chunks; after another step cached its first 32 tokens; as a
    decode row beside another request's decode; and at 1 and 3 threads."""
    model = smollm2_blocks.model
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (37, 45, 14))
    ta, tb = [0, 1, 2], [3, 4, 5]  # block tables
    alone = _last_logits(model, [[(a, 0, ta)]])[0][0]
    seen = {
        "in a 64-row step": _last_logits(model, [[(b, 0, tb), (a, 0, [6, 7, 8]), (c, 0, [9])]]),
        "in two chunks": _last_logits(model, [[(a[:20], 0, ta)], [(a[20:], 20, ta)]]),
        "after a cached prefix": _last_logits(
            model, [[(b, 0, tb), (a[:32], 0, ta)], [(a[32:], 32, ta)]]
        ),
        "as a decode row": _last_logits(
            model, [[(a[:36], 0, ta), (b[:44], 0, tb)], [(b[44:], 44, tb), (a[36:], 36, ta)]]
        ),
    }
    rows = {"in a 64-row step": (0, 1), "in two chunks": (1, 0), "after a cached prefix": (1, 0),
            "as a decode row": (1, 1)}  # fmt: skip
    found = {name: steps[rows[name][0]][rows[name][1]] for name, steps in seen.items()}
    for threads in (1, 3):
        torch.set_num_threads(threads)
        found[f"at {threads} threads"] = _last_logits(model, [[(a, 0, ta)]])[0][0]
    assert {name: torch.equal(v, alone) for name, v in found.items()} == dict.fromkeys(found, True)


# ------------------------------------------------------------------ the proof (slow)

README_PROMPT = "What is the capital of France?"


@pytest.mark.slow
def test_twelve_chat_prompts_get_the_same_tokens_in_every_situation(smollm2_gguf: Path) -> None:
    """The 12 everyday prompts of load/numerics_check.py (README's first) at the default flags:
    cold alone, cached alone, inside a batch of 16 with other prompts, with n-gram speculation,
    and at two chunk sizes: every token sequence identical. README's example gives its
    documented answer."""
    from load.numerics_check import PROMPTS, PROOF_PROMPTS

    assert PROOF_PROMPTS[0] == README_PROMPT and len(PROOF_PROMPTS) == 12
    others = [p for p in PROMPTS if p not in PROOF_PROMPTS]
    chats = [[{"role": "user", "content": p}] for p in PROOF_PROMPTS]
    fillers = [[{"role": "user", "content": f"{p} Answer briefly, please."}] for p in others]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def tokens(llm: LLM, conversations: list, n: int = 12) -> list[list[int]]:
        return [list(r.outputs[0].token_ids) for r in llm.chat(conversations, params)[:n]]

    default = LLM(str(smollm2_gguf))
    try:
        assert default.engine.numerics.batch_invariant
        cold = [tokens(default, [chat])[0] for chat in chats]
        cached = [tokens(default, [chat])[0] for chat in chats]  # prefixes cached now
        batched = tokens(default, chats + fillers[:4])  # a batch of 16
        answer = default.tokenizer.decode(cold[0], skip_special_tokens=True)
    finally:
        default.engine.close()
    variants = {
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
        "chunks of 16": {"max_num_batched_tokens": 16},
        "chunks of 64": {"max_num_batched_tokens": 64, "enable_prefix_caching": False},
    }
    seen = {"cached": cached, "batch of 16": batched}
    for name, flags in variants.items():
        llm = LLM(str(smollm2_gguf), **flags)
        try:
            seen[name] = tokens(llm, chats + fillers[:4])
        finally:
            llm.engine.close()
    assert {name: got == cold for name, got in seen.items()} == dict.fromkeys(seen, True)
    assert answer.strip() == "The capital of France is Paris."

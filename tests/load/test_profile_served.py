"""load/profile_served.py: py-spy stacks land in the share a reader expects."""

from __future__ import annotations

from load.profile_served import classify, shares

ENGINE = "thread (1): portico-engine;AsyncLLMEngine._run (engine/async_engine.py:187)"
STEP = ENGINE + ";LLMEngine.step (engine/llm_engine.py:217)"
FORWARD = STEP + ";ModelRunner.execute (engine/model_runner.py:133)"
LAYER = FORWARD + ";LlamaDecoderLayer.forward (engine/models/llama.py:120)"


def test_stacks_are_split_into_the_issue_shares() -> None:
    block = LAYER + ";block_matmul (engine/models/block_linear.py:130)"
    assert classify(block + ";quantized_linear (engine/kernels/__init__.py:170)").startswith(
        "forward: linears, GGUF"
    )
    assert classify(block + ";prepacked_linear (engine/kernels/__init__.py:190)").startswith(
        "forward: linears, dense"
    )
    assert classify(LAYER + ";attend_paged (engine/attention.py:99)") == "forward: attention"
    logits = FORWARD + ";LlamaForCausalLM.compute_logits (engine/models/llama.py:160)"
    assert classify(logits) == "forward: lm_head"
    assert classify(LAYER) == "forward: Python and small ops"
    assert classify(STEP + ";Sampler.sample (engine/sampler.py:97)") == "sampling"
    assert classify(STEP + ";append (engine/detokenizer.py:50)") == "detokenization"
    assert classify(STEP + ";schedule (engine/scheduler.py:90)") == "scheduling"
    assert classify(FORWARD) == "batch building (runner, metadata)"
    loop = "thread (2): MainThread;run (uvicorn/server.py:60);Runner.run (asyncio/runners.py:118)"
    assert classify(loop) == "HTTP: event loop"
    assert classify(loop + ";stream (engine/server/serving_completions.py:170)").startswith(
        "HTTP: handlers"
    )


def test_shares_sum_the_sample_counts_of_raw_lines() -> None:
    lines = [LAYER + ";attend_paged (engine/attention.py:99) 3", STEP + " 1", "garbage"]
    counts, total = shares(lines)
    assert counts == {"forward: attention": 3, "output building (engine)": 1} and total == 4

"""Image requests against the same texts without images, served, side by side in one run:
``python -m load.vision_bench``.

A LLaVA-1.5 of a small shape with random weights (``--load-format dummy``): the default
model's decoder (SmolLM2-135M: 30 layers, hidden 576) behind a CLIP ViT-B/16 tower at 224
pixels (12 layers, hidden 768: 196 image tokens a picture) and LLaVA's two-linear projector.
:func:`write_llava_folder` writes its config.json, SmolLM2's tokenizer with an ``<image>``
token and LLaVA-1.5's chat template, and CLIP's image processor settings; no weights.

One ``portico engine`` serves it; the serve benchmark (``load/serve_bench.py``) sends the
``random-image`` workload (``load.datasets.random_images``) twice at each concurrency: with
``--images-per-request`` pictures and with none (the same texts and output lengths), forced
output lengths (``ignore_eos``), greedy. What the table shows is what a picture costs a
request: its prompt tokens, its time to first token (the tower, the projector and the
picture's 196 prefill tokens) and its effect on decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from load import datasets, serve_bench
from load.llamacpp_bench import server_process
from load.standard import free_port

SERVED = "llava-smol"
# CLIP ViT-B/16 (openai/clip-vit-base-patch16) at 224 pixels: (224 / 16)^2 = 196 patches.
CLIP_B16: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "projection_dim": 512,
    "hidden_act": "quick_gelu", "model_type": "clip_vision_model",
}  # fmt: skip
# LLaVA-1.5's template (llava-hf/llava-1.5-7b-hf): a turn's images, then its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}"
    "{{ item['text'] + ' ' }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def write_llava_folder(folder: Path, decoder_dir: Path) -> Path:
    """A LLaVA folder ``--load-format dummy`` serves: ``decoder_dir``'s config.json (a Llama)
    as the text model and its tokenizer plus ``<image>``, CLIP ViT-B/16 as the tower."""
    from transformers import AutoTokenizer, CLIPImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(decoder_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    text = json.loads((decoder_dir / "config.json").read_text())
    text["vocab_size"] = len(tokenizer)
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": CLIP_B16,
        "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "image_seq_length": (CLIP_B16["image_size"] // CLIP_B16["patch_size"]) ** 2,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    size = CLIP_B16["image_size"]
    CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(str(folder))
    return folder


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both workloads at every concurrency against one engine; the report."""
    from portico.registry import DEFAULT_MODEL, resolve, tokenizer_folder

    decoder_dir = tokenizer_folder(resolve(DEFAULT_MODEL))
    if decoder_dir is None or not (decoder_dir / "config.json").is_file():
        raise SystemExit(f"no tokenizer folder for {DEFAULT_MODEL}: run `portico models pull`")
    folder = write_llava_folder(Path(args.folder), decoder_dir)
    port = free_port()
    cmd = [sys.executable, "-m", "portico.cli", "engine", "--model", str(folder),
           "--load-format", "dummy", "--served-model-name", SERVED, "--host", "127.0.0.1",
           "--port", str(port), "--limit-mm-per-prompt", f"image={max(1, args.images)}",
           *args.engine_args.split()]  # fmt: skip
    rows: list[dict[str, Any]] = []
    ready = f"http://127.0.0.1:{port}/ready"
    with server_process(cmd, None, ready, args.timeout_s, "portico engine"):
        base_url = f"http://127.0.0.1:{port}/v1"
        warm = datasets.random_images(
            2, args.images, tuple(args.image_size), output_len=(2, 2), seed=args.seed
        )
        _bench(base_url, warm, 2)
        for round_, concurrency in enumerate(args.concurrency):
            # a seed per round: new texts and pictures, none of them in the prefix cache yet
            # (the text-only run's prompts are no prefix of the image run's: those start with
            # the picture)
            seed = args.seed + 1 + round_
            for images in (0, args.images):
                reqs = datasets.random_images(
                    args.num_requests, images, tuple(args.image_size), tuple(args.prompt_len),
                    (args.output_len, args.output_len), seed,
                )  # fmt: skip
                summary = _bench(base_url, reqs, concurrency)
                rows.append(_row(summary, images, concurrency))
    return {"command": " ".join(sys.argv), "engine": cmd[3:], "rows": rows}


def _bench(base_url: str, reqs: list[datasets.BenchRequest], concurrency: int) -> dict[str, Any]:
    summary, _ = asyncio.run(
        serve_bench.run_benchmark(
            base_url, SERVED, reqs, max_concurrency=concurrency,
            extra_body={"ignore_eos": True}, progress=False,
        )
    )  # fmt: skip
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def _row(summary: dict[str, Any], images: int, concurrency: int) -> dict[str, Any]:
    return {
        "images": images,
        "concurrency": concurrency,
        "prompt_tokens_mean": summary["total_prompt_tokens"] / summary["completed"],
        "ttft_p50_ms": summary["ttft_ms"]["median"],
        "ttft_p90_ms": summary["ttft_ms"]["p90"],
        "tpot_p50_ms": summary["tpot_ms"]["median"],
        "output_tok_s": summary["output_throughput"],
        "requests_s": summary["request_throughput"],
    }


def table(report: dict[str, Any]) -> str:
    """The report's rows as a Markdown table."""
    lines = [
        "| images | concurrency | prompt tokens (mean) | TTFT p50 | TTFT p90 | TPOT p50 "
        "| output tok/s | requests/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['images']} | {r['concurrency']} | {r['prompt_tokens_mean']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms | {r['tpot_p50_ms']:.1f} ms "
            f"| {r['output_tok_s']:.1f} | {r['requests_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.vision_bench", description=__doc__)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4], help="comma-separated, e.g. 1,4")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--images", type=int, default=1, help="pictures per image request")
    p.add_argument("--image-size", type=int, nargs=2, default=(224, 224), metavar=("MIN", "MAX"))
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 32), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="", help="more `portico engine` flags, one string")
    p.add_argument("--folder", default="/tmp/portico-llava-smol", help="where the folder goes")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default="load/results/vision.json")
    args = p.parse_args(argv)
    if args.images < 1:
        p.error("--images must be >= 1 (the baseline without pictures always runs)")
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

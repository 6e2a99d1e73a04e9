"""Image requests against the same texts without images, served, side by side in one run:
``python -m load.vision_bench``.

A LLaVA-1.5 of a small shape with random weights (``--load-format dummy``): the default
model's decoder (SmolLM2-135M: 30 layers, hidden 576) behind a CLIP ViT-B/16 tower at 224
pixels (12 layers, hidden 768: 196 image tokens a picture) and LLaVA's two-linear projector.
:func:`write_llava_folder` writes its config.json, SmolLM2's tokenizer with an ``<image>``
token and LLaVA-1.5's chat template, and CLIP's image processor settings; no weights.

``--model-kind qwen2-vl``: a Qwen2-VL of the same small decoder (SmolLM2's 30 layers, read as
a Qwen2 with M-RoPE, ``mrope_section`` 8/12/12 over its 64-wide heads) behind Qwen2-VL's own
vision tower shape (the 2B's and 7B's: 32 blocks, width 1280, 16 heads, patch 14, 2x2
merger), with Qwen2-VL's image processor (dynamic resolution: a picture of ``H x W`` pixels
fills ``H / 28 x W / 28`` tokens) and chat template. :func:`write_qwen2_vl_folder` writes it.
Its pictures come at each of ``--image-sizes`` (square sides), so the table shows how the
cost follows the size. ``--model-kind qwen2.5-vl``: the same with Qwen2.5-VL's tower shape
(the 3B's and 7B's: 32 blocks, width 1280, SwiGLU of 3420, 16 heads, windows of 112 pixels,
full attention in blocks 7, 15, 23 and 31).

One ``portico engine`` serves it; the serve benchmark (``load/serve_bench.py``) sends the
``random-image`` workload (``load.datasets.random_images``) at each concurrency: with
``--images-per-request`` pictures (once per picture size) and with none (the same texts and
output lengths), forced output lengths (``ignore_eos``), greedy. What the table shows is what a
picture costs a request: its prompt tokens, its time to first token (the tower, the projector
and the picture's prefill tokens) and its effect on decode.
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

MODEL_KINDS = ("llava", "qwen2-vl", "qwen2.5-vl")
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


# Qwen2-VL's vision tower (Qwen/Qwen2-VL-2B-Instruct and -7B-Instruct share it); its
# hidden_size (the merger's output) is the decoder's, set when the folder is written.
QWEN2_VL_TOWER: dict[str, Any] = {
    "depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "in_channels": 3,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "hidden_act": "quick_gelu", "model_type": "qwen2_vl",
}  # fmt: skip
# Qwen2.5-VL's (Qwen/Qwen2.5-VL-3B-Instruct and -7B-Instruct share it); hidden_size is the
# tower's width here, out_hidden_size (the decoder's) is set when the folder is written.
QWEN2_5_VL_TOWER: dict[str, Any] = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
    "model_type": "qwen2_5_vl",
}  # fmt: skip
# Qwen2-VL-Instruct's template without its default system turn (the tests' tiny Qwen2-VL
# uses it too): <|vision_start|><|image_pad|><|vision_end|> where the message puts an image.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def write_qwen2_vl_folder(folder: Path, decoder_dir: Path, version: str = "2") -> Path:
    """A Qwen2-VL folder ``--load-format dummy`` serves: ``decoder_dir``'s config.json (a
    Llama, read as a Qwen2 with M-RoPE) as the text model and its tokenizer plus Qwen2-VL's
    vision tokens, Qwen2-VL's vision tower and image processor (transformers' default pixel
    bounds, 56 x 56 to 28 x 28 x 1280). ``version="2.5"``: Qwen2.5-VL's tower instead."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(decoder_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_TOKENS)})
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    text = json.loads((decoder_dir / "config.json").read_text())
    half = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
    section = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]  # 16/24/24 at 128
    text.update(
        model_type="qwen2", vocab_size=len(tokenizer),
        rope_parameters={
            "rope_type": "default", "mrope_section": section,
            "rope_theta": text.get("rope_theta", 1000000.0),
        },
    )  # fmt: skip
    vision = {**QWEN2_VL_TOWER, "hidden_size": text["hidden_size"]}
    if version == "2.5":
        vision = {**QWEN2_5_VL_TOWER, "out_hidden_size": text["hidden_size"]}
    kind = {"2": "Qwen2VL", "2.5": "Qwen2_5_VL"}[version]
    config = {
        "architectures": [f"{kind}ForConditionalGeneration"],
        "model_type": {"2": "qwen2_vl", "2.5": "qwen2_5_vl"}[version],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2).save_pretrained(
        str(folder)
    )
    return folder


def _picture_sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (MIN, MAX) side ranges the image rows run at: each of ``--image-sizes`` (a fixed
    square), or the one ``--image-size`` range."""
    if args.image_sizes:
        return [(side, side) for side in args.image_sizes]
    return [tuple(args.image_size)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both workloads at every concurrency against one engine; the report."""
    from portico.registry import DEFAULT_MODEL, resolve, tokenizer_folder

    decoder_dir = tokenizer_folder(resolve(DEFAULT_MODEL))
    if decoder_dir is None or not (decoder_dir / "config.json").is_file():
        raise SystemExit(f"no tokenizer folder for {DEFAULT_MODEL}: run `portico models pull`")
    kind = args.model_kind
    folder = Path(args.folder or f"/tmp/portico-{kind}-smol")
    if kind == "llava":
        write_llava_folder(folder, decoder_dir)
    else:
        write_qwen2_vl_folder(folder, decoder_dir, {"qwen2-vl": "2", "qwen2.5-vl": "2.5"}[kind])
    served = f"{args.model_kind}-smol"
    port = free_port()
    cmd = [sys.executable, "-m", "portico.cli", "engine", "--model", str(folder),
           "--load-format", "dummy", "--served-model-name", served, "--host", "127.0.0.1",
           "--port", str(port), "--limit-mm-per-prompt", f"image={max(1, args.images)}",
           *args.engine_args.split()]  # fmt: skip
    rows: list[dict[str, Any]] = []
    ready = f"http://127.0.0.1:{port}/ready"
    with server_process(cmd, None, ready, args.timeout_s, "portico engine"):
        base_url = f"http://127.0.0.1:{port}/v1"
        sizes = _picture_sizes(args)
        warm = datasets.random_images(2, args.images, sizes[0], output_len=(2, 2), seed=args.seed)
        _bench(base_url, served, warm, 2)
        for round_, concurrency in enumerate(args.concurrency):
            # a seed per round: new texts and pictures, none of them in the prefix cache yet
            # (the text-only run's prompts are no prefix of the image run's: those start with
            # the picture)
            seed = args.seed + 1 + round_
            for images, size in [(0, None), *((args.images, size) for size in sizes)]:
                reqs = datasets.random_images(
                    args.num_requests, images, size or sizes[0], tuple(args.prompt_len),
                    (args.output_len, args.output_len), seed,
                )  # fmt: skip
                summary = _bench(base_url, served, reqs, concurrency)
                rows.append(_row(summary, images, concurrency, size))
    return {"command": " ".join(sys.argv), "engine": cmd[3:], "rows": rows}


def _bench(
    base_url: str, served: str, reqs: list[datasets.BenchRequest], concurrency: int
) -> dict[str, Any]:
    summary, _ = asyncio.run(
        serve_bench.run_benchmark(
            base_url, served, reqs, max_concurrency=concurrency,
            extra_body={"ignore_eos": True}, progress=False,
        )
    )  # fmt: skip
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def _row(
    summary: dict[str, Any], images: int, concurrency: int, size: tuple[int, int] | None
) -> dict[str, Any]:
    side = "-" if size is None else str(size[0]) if size[0] == size[1] else "{}-{}".format(*size)
    return {
        "images": images,
        "picture_px": side,
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
        "| images | picture side (px) | concurrency | prompt tokens (mean) | TTFT p50 | TTFT p90 "
        "| TPOT p50 | output tok/s | requests/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['images']} | {r.get('picture_px', '-')} | {r['concurrency']} "
            f"| {r['prompt_tokens_mean']:.1f} "
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
    p.add_argument("--model-kind", choices=MODEL_KINDS, default="llava")
    p.add_argument("--image-size", type=int, nargs=2, default=(224, 224), metavar=("MIN", "MAX"))
    p.add_argument("--image-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="square picture sides, one image row each, e.g. 112,224 (instead of "
                   "--image-size)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 32), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="", help="more `portico engine` flags, one string")
    p.add_argument("--folder", default=None, help="where the folder goes "
                   "(default /tmp/portico-<model-kind>-smol)")  # fmt: skip
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

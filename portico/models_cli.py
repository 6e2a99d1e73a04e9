"""``portico models pull NAME`` and ``portico models list``."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    pull = sub.add_parser(
        "pull",
        help="fetch a model by alias (e.g. smollm2-135m) and write its tokenizer beside it "
        "as Hugging Face files",
    )
    pull.add_argument("name", help="model alias")
    sub.add_parser("list", help="show the models available on this machine")


def run(args: argparse.Namespace) -> int:
    from portico import registry

    if args.models_command == "pull":
        try:
            path = registry.pull(args.name)
        except registry.ModelNotFound as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{args.name}: {path}")
        folder = registry.models_dir() / args.name
        if registry.tokenizer_folder(registry.resolve(args.name)) is not None:
            print(f"tokenizer (Hugging Face files, for AutoTokenizer.from_pretrained): {folder}")
        return 0
    models = registry.list_local()
    if not models:
        print(f"no local models; run `portico models pull {registry.DEFAULT_MODEL}`")
        return 0
    width = max(len(m.name) for m in models)
    for m in models:
        print(f"{m.name:<{width}}  {m.format:<4}  {m.path}")
    return 0

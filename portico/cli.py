"""The ``portico`` command.

Each subcommand lives in the module that owns it and exposes two functions:
``add_arguments(parser)`` (cheap: argparse only, no heavy imports) and ``run(args) -> int``.
``portico --help`` lists exactly the subcommands whose module is present; only the module of
the subcommand that runs is imported (``portico engine`` needs only the engine's packages).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from types import MappingProxyType, ModuleType

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.cli", "run the gateway (and the engines it supervises)"),
    "engine": ("engine.server.cli", "serve one model behind an OpenAI-compatible API"),
    "models": ("portico.models_cli", "fetch and list local models"),
    "plan": (
        "engine.server.plan_cli",
        "size weights and KV cache; print the engine flags that fit",
    ),
    "keys": (
        "gateway.identity.keys_cli",
        "manage tenants, API keys, budgets and prices through the admin API",
    ),
    "bench": ("load.cli", "benchmarks: serving throughput/latency and gateway overhead"),
}


def _present(module_name: str) -> bool:
    """Whether ``module_name`` can be found, without running it (its parent packages run)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except ImportError:  # a parent package missing, or failing to import
        return False


def _load(module_name: str) -> ModuleType | None:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise


def _chosen(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level
    has only ``--help`` and ``--version``, which take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``portico`` parser for ``argv`` (None: ``sys.argv[1:]``). Only the subcommand
    ``argv`` names has its module imported and its flags added: ``portico engine`` never
    imports the gateway (its Redis store), so it starts where only the engine's
    dependencies are installed; ``portico --help`` (or an unknown word) lists the subcommands
    whose module is present without importing them."""
    from portico import __version__

    chosen = _chosen(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="portico",
        description="Portico: an edge gateway for OpenAI-compatible LLM traffic "
        "with its own paged-attention inference engine.",
    )
    parser.add_argument("--version", action="version", version=f"portico {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = [chosen] if chosen in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in names:
        module_name, help_text = SUBCOMMANDS[name]
        if name != chosen:  # listed in the help only: found, never imported
            if _present(module_name):
                sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = _load(module_name)
            if module is None:
                continue
            p = sub.add_parser(name, help=help_text, description=help_text)
            module.add_arguments(p)
        except ModuleNotFoundError as exc:  # a package the subcommand needs is not installed
            parser.error(f"'{name}' cannot run here: {exc}")
        p.set_defaults(_run=module.run)
    return parser


# OpenMP's waiting for everything `portico` starts (engines inherit it from `portico serve`):
# passive, so a thread that finished its share sleeps instead of spinning. Measured one variable
# at a time against a bounded spin (GOMP_SPINCOUNT=30000, the tuned benchmarks' setting;
# docs/engine-benchmark.md, "OpenMP waiting"): served one and 16 streams decoded alike at load
# 3 and 10-14% slower than with the spin when quieter (the fused step sleeps on its own
# barrier either way), while 64-row steps ran 4-10x slower with the spin whenever other work
# held a core. Engines with cores to themselves may set GOMP_SPINCOUNT=30000.
OPENMP_DEFAULTS: Mapping[str, str] = MappingProxyType({"OMP_WAIT_POLICY": "PASSIVE"})
OPENMP_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What ``portico`` adds to ``environ``: :data:`OPENMP_DEFAULTS`, or nothing when the user
    chose OpenMP's waiting (either of :data:`OPENMP_USER_SETTINGS` set, to any value)."""
    if any(name in environ for name in OPENMP_USER_SETTINGS):
        return {}
    return dict(OPENMP_DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    # Before anything imports torch (OpenMP reads its settings once, when it loads).
    os.environ.update(openmp_defaults(os.environ))
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The separation rules the packages' docstrings state, checked against every import the code
makes (``ast``: imports inside functions count too, a string in ``importlib`` does not).

Each part of the gateway may import only the parts below it: identity and the request body at
the bottom, then admission and the engine fleet, then the relay, then the remote tiers and
batches; the modules at ``gateway/``'s top (the request path, start-up, the app, the CLI)
import anything, and nothing imports them back. Across the engine hop only
``portico/contract.py`` is shared: the gateway imports no engine module and the engine no
gateway module; ``portico/`` imports neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The gateway's wings and what each may import (besides itself, portico/ and the stdlib and
# third-party packages). The leaf modules of gateway/ (store, metrics, tls) are open to all.
LEAVES = ("gateway.store", "gateway.metrics", "gateway.tls")
ALLOWED: dict[str, tuple[str, ...]] = {
    "gateway.body": (),
    "gateway.identity": (),
    "gateway.console": ("gateway.identity",),
    "gateway.admission": ("gateway.identity", "gateway.body"),
    "gateway.fleet": ("gateway.identity", "gateway.body"),
    "gateway.relay": ("gateway.identity", "gateway.body", "gateway.admission", "gateway.fleet"),
    "gateway.remotes": ("gateway.identity", "gateway.body", "gateway.fleet", "gateway.relay"),
    "gateway.batch": ("gateway.identity", "gateway.body", "gateway.admission", "gateway.relay"),
}
# (module, imported) pairs that break a rule today, each with its reason; shrink, never grow.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # portico keys finds the admin key file the gateway writes by its name
    ("gateway.identity.keys_cli", "gateway.cli"): "the admin key file's name",
    # a GGUF model's context length, read with the engine's own GGUF reader (lazily)
    ("gateway.relay.long_prompts", "engine.gguf_file"): "GGUF header",
}


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``from x import y`` counts as ``x`` and
    ``x.y``, since ``y`` may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def all_imports(root: Path, package: str) -> dict[str, set[str]]:
    """Module name -> what it imports, for every module of ``package`` under ``root``."""
    return {
        module_name(root, path): imports_of(path) for path in sorted((root / package).rglob("*.py"))
    }


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def gateway_breaks(module: str, name: str) -> bool:
    """Whether the gateway module ``module`` may not import ``name``."""
    if within(name, ("engine",)):
        return True
    if not within(name, ("gateway",)):
        return False
    if within(module, LEAVES):
        allowed: tuple[str, ...] = LEAVES
    else:
        wing = next((w for w in ALLOWED if within(module, (w,))), None)
        if wing is None:  # gateway/'s top: the request path, start-up, app, CLI
            return False
        allowed = (wing, *ALLOWED[wing], *LEAVES)
    # ``from gateway.x import y``: y may be a name inside the module gateway.x
    return not within(name, allowed) and not within(name.rsplit(".", 1)[0], allowed)


def broken_rules(root: Path = ROOT) -> set[tuple[str, str]]:
    """(module, imported) pairs under ``root`` that break a rule, exceptions included."""
    broken = {
        (module, name)
        for module, imported in all_imports(root, "gateway").items()
        for name in imported
        if gateway_breaks(module, name)
    }
    forbidden = {"engine": ("gateway", "load"), "portico": ("gateway", "engine", "load")}
    for package, names in forbidden.items():
        for module, imported in all_imports(root, package).items():
            broken.update((module, name) for name in imported if within(name, names))
    return broken


def test_the_rules_see_the_wings_and_their_imports() -> None:
    imports = all_imports(ROOT, "gateway")
    assert {"gateway.relay.proxy", "gateway.fleet.pool", "gateway.batch.batches"} <= set(imports)
    assert "gateway.fleet.pool" in imports["gateway.relay.proxy"]
    assert "portico.contract" in imports["gateway.fleet.prefix_index"]


def test_no_part_imports_where_its_rules_forbid() -> None:
    broken = broken_rules()

    def excused(module: str, name: str, exception: tuple[str, str]) -> bool:
        return module == exception[0] and within(name, (exception[1],))

    unlisted = sorted(b for b in broken if not any(excused(*b, e) for e in EXCEPTIONS))
    stale = sorted(e for e in EXCEPTIONS if not any(excused(*b, e) for b in broken))
    assert unlisted == []
    assert stale == [], "fixed: take these off EXCEPTIONS"


def test_a_wing_reaching_up_or_across_the_hop_is_caught(tmp_path: Path) -> None:
    for package in ("gateway/fleet", "gateway/relay", "engine", "portico"):
        (tmp_path / package).mkdir(parents=True)
    (tmp_path / "gateway/fleet/pool.py").write_text(
        "from gateway.relay.proxy import LocalUpstream\nfrom gateway.body.fields import f\n"
    )
    (tmp_path / "gateway/relay/proxy.py").write_text(
        "def f():\n    from gateway.request_path import Gateway\n    import gateway.fleet.pool\n"
    )
    (tmp_path / "engine/kv.py").write_text("from gateway.fleet import prefix_index\n")
    (tmp_path / "portico/cli.py").write_text("import engine.config\nimport portico.errors\n")
    assert broken_rules(tmp_path) == {
        ("gateway.fleet.pool", "gateway.relay.proxy"),
        ("gateway.fleet.pool", "gateway.relay.proxy.LocalUpstream"),
        ("gateway.relay.proxy", "gateway.request_path"),
        ("gateway.relay.proxy", "gateway.request_path.Gateway"),
        ("engine.kv", "gateway.fleet"),
        ("engine.kv", "gateway.fleet.prefix_index"),
        ("portico.cli", "engine.config"),
    }

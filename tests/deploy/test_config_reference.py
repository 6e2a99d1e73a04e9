"""docs/configuration.md documents exactly the configuration that exists: every field of
GatewayConfig (walked recursively through nested models, lists and optionals) and every
placeholder of the nginx template, and nothing that does not exist.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from edge_nginx import REPO_ROOT, TEMPLATE, placeholders
from pydantic import BaseModel

from gateway.config import GatewayConfig

DOC = REPO_ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|", re.M)


def _nested_models(annotation: object) -> list[tuple[str, type[BaseModel]]]:
    """(path suffix, model) for each pydantic model inside an annotation."""
    origin = typing.get_origin(annotation)
    if origin is None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [("", annotation)]
        return []
    args = typing.get_args(annotation)
    if origin in (list, tuple, set, frozenset):
        return [("[]" + s, m) for a in args for s, m in _nested_models(a)]
    if origin is dict:
        return [(".<name>" + s, m) for s, m in _nested_models(args[1])]
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [pair for a in args for pair in _nested_models(a)]
    return []


def config_fields(model: type[BaseModel] = GatewayConfig, prefix: str = "") -> set[str]:
    """Every field path of ``model``: ``listen.port``, ``engines[].name``, ``auth.jwt.issuer``."""
    paths = set()
    for name, field in model.model_fields.items():
        path = prefix + name
        paths.add(path)
        for suffix, sub in _nested_models(field.annotation):
            paths |= config_fields(sub, path + suffix + ".")
    return paths


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_walk_finds_nested_list_and_optional_fields() -> None:
    fields = config_fields()
    assert {
        "listen.port",
        "engines[].args",
        "tls.cert_file",
        "auth.jwt.issuer",
        "admission.abuse.failed_auth",
        "remotes[].api_base",
    } <= fields


def test_every_config_field_is_documented() -> None:
    documented = set(ROW.findall(_section("Gateway config file")))
    missing = config_fields() - documented
    assert not missing, f"docs/configuration.md lacks: {sorted(missing)}"


def test_every_documented_field_exists() -> None:
    documented = set(ROW.findall(_section("Gateway config file")))
    unknown = documented - config_fields()
    assert not unknown, f"docs/configuration.md documents unknown fields: {sorted(unknown)}"


def test_nginx_placeholders_are_documented_exactly() -> None:
    documented = set(ROW.findall(_section("nginx edge template")))
    assert documented == placeholders(TEMPLATE.read_text())


def test_documented_example_is_a_valid_config(tmp_path: Path) -> None:
    import yaml

    from gateway.config import parse_config

    example = _section("Gateway config file").split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_config(yaml.safe_load(example))
    assert config.engines[0].replicas == 2

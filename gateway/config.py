"""``GatewayConfig``: everything ``portico serve`` needs, from one YAML file.

Every field is validated at start-up (pydantic, ``extra="forbid"``); an error names the field
(``engines.0.replicas: Input should be greater than or equal to 1``). With no file the gateway
serves the default model (``smollm2-135m`` as ``smollm2``) with one replica and the embedded
Redis. The settings of other modules (store, auth, admission) are composed here, not copied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.admission.admission import AdmissionSettings
from gateway.batch.batches import BatchSettings
from gateway.body.image_parts import MediaSettings
from gateway.console.sessions import ConsoleSettings
from gateway.fleet.discovery import DiscoverySpec
from gateway.identity.audit import AuditSettings
from gateway.identity.auth import AuthSettings
from gateway.identity.prices import ModelPrice
from gateway.remotes.remote import RemoteSpec
from gateway.store import StoreSettings

PACKAGED_POLICIES = Path(__file__).resolve().parent.parent / "policies"
DEFAULT_MODEL_NAME = "smollm2"
DEFAULT_MODEL_SPEC = "smollm2-135m"


class ConfigError(ValueError):
    """The configuration is invalid; the message names every bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListenConfig(_Strict):
    """Where the gateway accepts connections."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port (tests)


class TLSConfig(_Strict):
    """TLS termination in uvicorn (TLS 1.2 and newer). With ``client_ca_file`` the gateway asks
    for client certificates (optional at the TLS level); ``admin_requires_client_cert`` makes the
    admin routes refuse callers without a certificate signed by that CA."""

    cert_file: Path
    key_file: Path
    key_password_env: str | None = None
    client_ca_file: Path | None = None
    admin_requires_client_cert: bool = False

    @model_validator(mode="after")
    def _files(self) -> TLSConfig:
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
        if self.admin_requires_client_cert and self.client_ca_file is None:
            raise ValueError("admin_requires_client_cert needs client_ca_file")
        return self


class EngineSpec(_Strict):
    """One local model: its replicas are engine processes the supervisor runs.

    ``command`` replaces the default ``portico engine`` command line; ``{uds}``, ``{model}`` and
    ``{name}`` in it are filled in per replica (another OpenAI-compatible server can be used).
    With ``discovery`` the replicas run elsewhere (engine pods behind a headless Service) and are
    found by DNS instead; ``model`` then names only the tokenizer prompt tokens are counted with.
    """

    name: str = Field(default=DEFAULT_MODEL_NAME, min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    model: str = DEFAULT_MODEL_SPEC  # alias, HF folder or .gguf path (portico.registry)
    replicas: int = Field(default=1, ge=1, le=64)
    args: list[str] = []  # extra engine flags: ["--max-num-seqs", "64", ...]
    command: list[str] | None = None
    env: dict[str, str] = {}
    startup_timeout_s: float = Field(default=600.0, gt=0)
    count_tokens_with: Literal["tokenizer", "estimate"] = "tokenizer"
    # prompts over the context (gateway/relay/long_prompts.py): refuse (the engine's 400),
    # truncate_left (keep system prompt + latest turns) or truncate_middle
    long_prompts: Literal["refuse", "truncate_left", "truncate_middle"] = "refuse"
    discovery: DiscoverySpec | None = None

    @model_validator(mode="after")
    def _started_or_found(self) -> EngineSpec:
        if self.discovery is not None and self.command is not None:
            raise ValueError("discovery: replicas found by DNS run no command here")
        return self


class EngineDefaults(_Strict):
    """What every supervised ``portico engine`` is started with (not a custom ``command``).

    ``scheduling``: the engines' waiting-queue policy, ``--scheduling-policy``: ``fair``
    (tenants share by their plans' weights), ``fcfs`` (arrival order) or ``priority`` (the
    request's ``priority`` field, then arrival). A ``--scheduling-policy`` in an engine's own
    ``args`` wins.
    """

    scheduling: Literal["fair", "fcfs", "priority"] = "fair"


class SupervisorConfig(_Strict):
    """Restart backoff of crashed engines."""

    backoff_base_s: float = Field(default=0.5, gt=0, le=60)
    backoff_max_s: float = Field(default=30.0, gt=0, le=3600)
    stable_after_s: float = Field(default=30.0, gt=0)
    # the engines' own drain, after the gateway's
    stop_timeout_s: float = Field(default=30.0, gt=0, le=3600)


class GatewayConfig(_Strict):
    """The whole configuration of one gateway process."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    tls: TLSConfig | None = None
    redis: StoreSettings = Field(default_factory=StoreSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    engines: list[EngineSpec] = Field(default_factory=lambda: [EngineSpec()])
    engine: EngineDefaults = Field(default_factory=EngineDefaults)
    remotes: list[RemoteSpec] = []
    # model name -> USD per 1M tokens {input, cached_input, output}, local and remote alike;
    # the admin API's prices (PUT /admin/v1/prices/{model}) override these; unpriced: free
    pricing: dict[str, ModelPrice] = {}
    policies_dir: Path = PACKAGED_POLICIES  # routing.yaml, retry.yaml (plans: redis.plans_file)
    runtime_dir: Path | None = None  # engine sockets; None: a private temporary folder
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    drain_timeout_s: float = Field(default=30.0, ge=0, le=3600)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # header limits without nginx in front (431 beyond them); nginx's defaults
    max_header_line_bytes: int = Field(default=8 * 1024, ge=1024, le=1024 * 1024)
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=4 * 1024 * 1024)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = False
    # how long a stored Responses API response (store: true) is kept; OpenAI keeps 30 days
    responses_retention_s: int = Field(default=30 * 24 * 3600, ge=60)
    # the Files and Batch APIs: file and batch limits, the runner (batch/batches.py)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    # http(s) image URLs the gateway fetches for local engines (none unless domains are named)
    media: MediaSettings = Field(default_factory=MediaSettings)

    @model_validator(mode="after")
    def _unique_models(self) -> GatewayConfig:
        names = [e.name for e in self.engines] + [r.name for r in self.remotes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engines/remotes: model names must be unique, repeated: {dupes}")
        if not names:
            raise ValueError("engines/remotes: at least one model must be served")
        if not self.policies_dir.is_dir():
            raise ValueError(f"policies_dir: no such folder: {self.policies_dir}")
        return self


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"{where}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_config(data: object) -> GatewayConfig:
    """Validate a parsed YAML document; ``ConfigError`` names each bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("invalid configuration: the file must hold a mapping")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def load_config(path: Path | None) -> GatewayConfig:
    """Read and validate ``path`` (None: the defaults)."""
    if path is None:
        return GatewayConfig()
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"the configuration {path} is not valid YAML: {exc}") from None
    return parse_config(data)

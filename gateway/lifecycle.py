"""The gateway's start-up and shutdown: :func:`start_gateway` opens Redis once and hands it to
identity, admission and usage, builds the upstreams (local engine pools, remote providers), the
router and the supervisor, starts the engines, and returns the :class:`Gateway` whose ``stop``
releases all of it in reverse order. The engine-process wiring (sockets, commands, the
supervisor's callbacks) lives here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from gateway.admission.abuse import AbuseGuard
from gateway.admission.admission import Admission
from gateway.admission.limiter import RedisLimiter
from gateway.admission.prompt_tokens import (
    PromptCounter,
    SizedImageTokens,
    load_image_tokens,
    load_tokenizer,
)
from gateway.admission.redis_pipe import RedisPipe
from gateway.admission.usage_recorder import UsageRecorder
from gateway.batch.batch_runner import BatchRunner, owner_principal
from gateway.batch.batches import BatchStore
from gateway.batch.files import DiskStorage, FileStorage, FileStore
from gateway.batch.s3_storage import S3Storage
from gateway.config import PACKAGED_POLICIES, EngineSpec, GatewayConfig
from gateway.fleet.adapters import AdapterCatalog
from gateway.fleet.discovery import DNSDiscovery
from gateway.fleet.pool import Pool, Replica, ReplicaPolicy
from gateway.fleet.prefix_index import PrefixIndex, PrefixIndexFeeder
from gateway.fleet.supervisor import EngineProcess, Supervisor, engine_argv
from gateway.identity.audit import AuditLog
from gateway.identity.auth import open_identity
from gateway.identity.layout import migrate_layout
from gateway.identity.prices import PriceBook
from gateway.identity.usage import UsageLedger
from gateway.metrics import GatewayMetrics
from gateway.relay.long_prompts import PromptFit, context_length
from gateway.relay.output_tokens import OutputCounter
from gateway.relay.proxy import LocalUpstream, Upstream
from gateway.relay.request_context import InFlight
from gateway.relay.responses_store import ResponseStore
from gateway.relay.retry import RetryPolicy, load_retry_policy
from gateway.relay.routing import Router, RoutingPolicy, load_routing_policy
from gateway.relay.transport import LeanTransport
from gateway.remotes.openai_remote import OpenAIRemoteUpstream
from gateway.remotes.remote import RemoteUpstream
from gateway.request_path import Gateway
from gateway.store import SharedRedis, open_shared_redis
from gateway.tracing import GatewayTracing
from portico.media_fetch import MediaFetcher

log = logging.getLogger("portico.gateway")

GC_YOUNG_THRESHOLD = 10_000


async def start_gateway(
    config: GatewayConfig,
    metrics: GatewayMetrics,
    in_flight: InFlight,
    env: Mapping[str, str],
) -> Gateway:
    """Open Redis once and hand it to identity, admission and usage; build the upstreams,
    the router and the supervisor; start the engines. On failure, what was opened closes."""
    fits = _prompt_fits(config)  # a bad long-prompt policy fails before anything starts
    async with contextlib.AsyncExitStack() as stack:
        runtime_dir = stack.enter_context(_runtime_dir(config.runtime_dir))
        tracing = GatewayTracing.from_env(env)
        if tracing is not None:  # closed last: the spans of the drain are exported too
            stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
        redis = await open_shared_redis(config.redis, env)
        stack.push_async_callback(redis.aclose)
        await migrate_layout(redis.client)  # keys named before hash tags, renamed once
        identity = open_identity(redis.client, config.redis, config.auth, env)
        stack.push_async_callback(identity.aclose)
        if config.admission.redis_down_policy != "closed":  # closed: an outage refuses all
            identity.authenticator.keep_outage_copy(config.auth.outage_copy_seconds)
        pipe = _open_pipe(stack, redis)
        admission, prices = await _open_admission(stack, redis, config, metrics, pipe)
        usage = _start_usage(stack, identity.store.ledger, pipe)
        guard = AbuseGuard(redis.url, config.admission.abuse, registry=metrics.registry)
        retry = load_retry_policy(config.policies_dir / "retry.yaml")
        routing = load_routing_policy(config.policies_dir / "routing.yaml")
        local = _open_local_engines(stack, config, runtime_dir, retry, routing, metrics, tracing)
        upstreams: dict[str, Upstream] = dict(local.upstreams)
        remote_tokenizers = await _load_remote_tokenizers(config)
        # a missing credential stops the start-up here
        remote_pools = _open_remotes(
            stack, config, retry, metrics, env, remote_tokenizers, upstreams
        )
        strict = config.policies_dir.resolve() != PACKAGED_POLICIES  # packaged: lenient
        router = Router(routing, set(upstreams), strict=strict)
        storage = _file_storage(config, env)  # a missing S3 credential stops the start here
        stack.push_async_callback(storage.aclose)
        # The adapter catalog is read before the engines start: each engine that becomes
        # ready gets its pool's adapters (the supervisor's on_state).
        adapters = AdapterCatalog(
            redis.client,
            {p.name: p for p in local.pools},
            {*upstreams, *routing.aliases, "auto"},
        )
        await adapters.load()
        engine_tasks: list[asyncio.Task[None]] = []
        supervisor, tokenizers = await _start_engines(
            stack, config, metrics, local, remote_pools, adapters, engine_tasks
        )
        gateway = Gateway(
            config=config,
            metrics=metrics,
            in_flight=in_flight,
            redis=redis,
            identity=identity,
            admission=admission,
            guard=guard,
            router=router,
            counter=PromptCounter({**tokenizers, **remote_tokenizers}, _image_tokens(config)),
            upstreams=upstreams,
            pools=local.pools,
            supervisor=supervisor,
            adapters=adapters,
            audit=AuditLog(redis.client, config.audit),
            _engine_tasks=engine_tasks,
            usage=usage,
            prices=prices,
            responses=ResponseStore(redis.client, config.responses_retention_s),
            files=FileStore(redis.client, storage, config.batches.max_file_bytes),
            batches=BatchStore(redis.client),
            fits=fits,
            runtime_dir=runtime_dir,
            tracing=tracing,
            media=MediaFetcher(config.media.policy()),
            _resources=stack.pop_all(),
        )
    _start_batch_runner(gateway)
    _freeze_startup_objects()
    return gateway


def _open_pipe(stack: contextlib.AsyncExitStack, redis: SharedRedis) -> RedisPipe | None:
    """The pipelined connection admission's scripts and the usage recorder's batches share
    (redis_pipe.py), closing with ``stack``; None over TLS, on a cluster or through Sentinel."""
    pipe = RedisPipe.from_client(redis.client)
    if pipe is not None:
        stack.push_async_callback(pipe.aclose)
    return pipe


def _start_usage(
    stack: contextlib.AsyncExitStack, ledger: UsageLedger, pipe: RedisPipe | None
) -> UsageRecorder:
    """The usage recorder, started; it closes with ``stack`` after the engines drained (its
    callback is pushed before theirs, and after the pipe's), so every request is counted."""
    usage = UsageRecorder(ledger, pipe=pipe)
    usage.start()
    stack.push_async_callback(usage.aclose)
    return usage


async def _open_admission(
    stack: contextlib.AsyncExitStack,
    redis: SharedRedis,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    pipe: RedisPipe | None,
) -> tuple[Admission, PriceBook]:
    """Admission over the shared Redis, with its price book; both close with ``stack``."""
    # Admission's two scripts per request go over ``pipe`` (redis_pipe.py); redis-py's
    # per-command cost was the largest single share of the gateway's CPU. Without a pipe
    # (TLS, a cluster, Sentinel): redis-py's client
    limiter = RedisLimiter(
        redis.client, budget_ttl_s=config.admission.budget_key_ttl_seconds, pipe=pipe
    )
    # prices are read from memory per request; the admin API's are refreshed from Redis
    prices = PriceBook(redis.client, config.pricing)
    await prices.refresh()
    prices.start()
    stack.push_async_callback(prices.aclose)
    admission = Admission(
        redis.client,
        config.admission,
        registry=metrics.registry,
        limiter=limiter,
        prices=prices,
    )
    admission.start_watch()  # Redis probed on a timer; aclose stops the probe
    stack.push_async_callback(admission.aclose)
    return admission, prices


def _open_local_engines(
    stack: contextlib.AsyncExitStack,
    config: GatewayConfig,
    runtime_dir: Path,
    retry: RetryPolicy,
    routing: RoutingPolicy,
    metrics: GatewayMetrics,
    tracing: GatewayTracing | None,
) -> _LocalEngines:
    """The local engines' pools and upstreams (not started); their clients close with
    ``stack``."""
    local = _LocalEngines(config, runtime_dir, retry, routing.affinity_slack, metrics)
    local.use_replica_policy(routing.replica_policy)
    for pool in local.pools:
        for replica in pool.replicas:
            stack.push_async_callback(replica.client.aclose)
    for upstream in local.upstreams.values():
        upstream.tracer = tracing
    return local


async def _start_engines(
    stack: contextlib.AsyncExitStack,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    local: _LocalEngines,
    remote_pools: list[Pool],
    adapters: AdapterCatalog,
    engine_tasks: list[asyncio.Task[None]],
) -> tuple[Supervisor, dict[str, Any]]:
    """Start the engines under a supervisor, the discoveries and the probers, and load the
    tokenizers meanwhile; returns the supervisor and the tokenizers by model. What starts
    here stops with ``stack`` (the engines drained before the probers stop)."""
    stack.push_async_callback(_cancel, engine_tasks)
    supervisor = _supervisor(local.processes, config, metrics, adapters, engine_tasks)
    for discovery in local.discoveries:  # closes the clients of what it found
        stack.push_async_callback(discovery.aclose)
    await asyncio.gather(*(d.refresh() for d in local.discoveries))
    stack.push_async_callback(_cancel, _start_probers(local, remote_pools))
    stack.push_async_callback(supervisor.stop, config.supervisor.stop_timeout_s)
    timeout = max((e.startup_timeout_s for e in config.engines), default=0.0)
    tokenizers, all_ready = await asyncio.gather(
        _load_tokenizers(config), supervisor.start(ready_timeout=timeout)
    )
    if not all_ready:
        log.error("not every engine became ready in %.0f s; serving what is up", timeout)
    for name, local_upstream in local.upstreams.items():  # prefix_aware pools hash tokens
        local_upstream.route_tokenizer = tokenizers.get(name)
        # loaded from the engine's own model folder (`portico engine`, no custom command):
        # admission's prompt ids are the engine's, so they travel with the request
        local_upstream.carry_tokenizer = tokenizers.get(name)
    return supervisor, tokenizers


def _open_remotes(
    stack: contextlib.AsyncExitStack,
    config: GatewayConfig,
    retry: RetryPolicy,
    metrics: GatewayMetrics,
    env: Mapping[str, str],
    tokenizers: Mapping[str, Any],
    upstreams: dict[str, Upstream],
) -> list[Pool]:
    """Add each remote tier to ``upstreams``; the pools of the OpenAI-compatible ones."""
    remote_pools: list[Pool] = []
    for spec in config.remotes:
        if spec.kind == "litellm":  # translation (Anthropic, Bedrock, ...)
            upstreams[spec.name] = RemoteUpstream(spec, retry, metrics, env)
            continue
        counter = OutputCounter(tokenizers.get(spec.name))
        remote = OpenAIRemoteUpstream(spec, retry, metrics, env, counter=counter)
        stack.push_async_callback(remote.client.aclose)
        remote_pools.append(remote.pool)
        upstreams[spec.name] = remote
    return remote_pools


def _start_probers(local: _LocalEngines, remote_pools: list[Pool]) -> list[asyncio.Task[None]]:
    """The pools' health probers, the discoveries and the prefix index feeders, started."""
    probers = [asyncio.create_task(pool.run_prober()) for pool in [*local.pools, *remote_pools]]
    probers += [asyncio.create_task(d.run()) for d in local.discoveries]
    probers += [asyncio.create_task(f.run()) for f in local.prefix_feeders]
    return probers


def _file_storage(config: GatewayConfig, env: Mapping[str, str]) -> FileStorage:
    """Where the Files API keeps bytes: the S3-compatible bucket of ``batches.store``, or
    ``batches.files_dir`` (default ``<redis.data_dir>/files``) on disk."""
    store = config.batches.store
    if store is not None:
        return S3Storage(store, store.credentials(env))
    return DiskStorage(config.batches.files_dir or config.redis.data_dir / "files")


def _start_batch_runner(gateway: Gateway) -> None:
    """The batch runner, on the gateway's request path; stopped first when the gateway stops
    (its lines in flight finish while the engines still run)."""
    tenants = gateway.identity.store
    runner = BatchRunner(
        gateway.batches,
        gateway.files,
        gateway.config.batches,
        gateway.serve,
        functools.partial(owner_principal, tenants),
        lambda: gateway.draining,
        stop_timeout_s=gateway.config.drain_timeout_s,
    )
    gateway.batch_runner = runner
    if gateway.config.batches.run:
        runner.start()
        gateway._resources.push_async_callback(runner.stop)


class _LocalEngines:
    """The local engine pools of the config: one pool per engine spec, one replica (process,
    Unix socket, HTTP client) per replica, and the upstream that forwards to each pool. A spec
    with ``discovery`` starts no process: its pool's replicas are the addresses DNS answers
    (``discoveries``), reached over TCP."""

    def __init__(
        self,
        config: GatewayConfig,
        runtime_dir: Path,
        retry: RetryPolicy,
        slack: int,
        metrics: GatewayMetrics,
    ) -> None:
        self.processes: list[EngineProcess] = []
        self.pools: list[Pool] = []
        self.upstreams: dict[str, LocalUpstream] = {}
        self.discoveries: list[DNSDiscovery] = []
        self._metrics = metrics
        self._scheduling = config.engine.scheduling
        timeout = httpx.Timeout(retry.read_timeout_s, connect=retry.connect_timeout_s)
        for spec in config.engines:
            replicas = [
                self._replica(spec, f"{spec.name}-{i}", runtime_dir, timeout)
                for i in range(spec.replicas if spec.discovery is None else 0)
            ]
            pool = Pool(
                spec.name,
                replicas,
                slack=slack,
                eject_after_failures=retry.eject_after_failures,
                eject_cooldown_s=retry.eject_cooldown_s,
                on_eject=self._count_ejection,
            )
            self.pools.append(pool)
            self.upstreams[spec.name] = LocalUpstream(pool, retry, metrics)
            if spec.discovery is not None:
                found = functools.partial(_tcp_replica, timeout=timeout)
                self.discoveries.append(DNSDiscovery(pool, spec.discovery, found))

    def use_replica_policy(self, policy: ReplicaPolicy) -> None:
        """Set every local pool's replica policy; prefix_aware gives each pool a prefix index
        and a feeder polling its replicas' block events (gateway/fleet/prefix_index.py)."""
        self.prefix_feeders: list[PrefixIndexFeeder] = []
        for pool in self.pools:
            pool.replica_policy = policy
            if policy == "prefix_aware":
                pool.index = PrefixIndex()
                self.prefix_feeders.append(PrefixIndexFeeder(pool.index, pool.available_clients))

    def _replica(
        self, spec: EngineSpec, name: str, runtime_dir: Path, timeout: httpx.Timeout
    ) -> Replica:
        uds = runtime_dir / f"{name}.sock"
        transport = LeanTransport(uds=str(uds))
        client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=timeout)
        replica = Replica(name, client, transport, timeout.as_dict())
        self.processes.append(
            EngineProcess(
                name,
                _engine_command(spec, name, uds, self._scheduling),
                replica,
                socket_path=uds,
                env=dict(spec.env),
                startup_timeout_s=spec.startup_timeout_s,
            )
        )
        return replica

    def _count_ejection(self, replica: Replica) -> None:
        pool = replica.name.rsplit("-", 1)[0]
        self._metrics.ejections.labels(pool, replica.name).inc()


def _prompt_fits(config: GatewayConfig) -> dict[str, PromptFit]:
    """Each local model's context length and long-prompt policy (where the length is known;
    a truncating policy without one is a configuration error)."""
    fits = {}
    for spec in config.engines:
        length = context_length(spec.model, spec.args)
        if length is None:
            if spec.long_prompts != "refuse":
                raise ValueError(
                    f"engines[{spec.name}].long_prompts={spec.long_prompts} needs the context "
                    "length: add --max-model-len to its args"
                )
            continue
        fits[spec.name] = PromptFit(length, spec.long_prompts)
    return fits


def _tcp_replica(name: str, host: str, port: int, *, timeout: httpx.Timeout) -> Replica:
    """A replica of an engine found by DNS, with its own client to ``host:port``."""
    transport = LeanTransport(host=host, port=port)
    client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=timeout)
    return Replica(name, client, transport, timeout.as_dict())


def _engine_command(spec: EngineSpec, name: str, uds: Path, scheduling: str) -> list[str]:
    """A replica's command line; ours gets ``engine.scheduling`` as ``--scheduling-policy``
    before the spec's own args (argparse keeps the last, so an engine's own flag wins)."""
    if spec.command is None:
        extra = ["--scheduling-policy", scheduling, *spec.args]
        return engine_argv(spec.model, spec.name, uds, extra)
    values = {"uds": str(uds), "model": spec.model, "name": spec.name, "replica": name}
    return [part.format(**values) for part in spec.command] + list(spec.args)


def _supervisor(
    processes: list[EngineProcess],
    config: GatewayConfig,
    metrics: GatewayMetrics,
    adapters: AdapterCatalog,
    tasks: list[asyncio.Task[None]],
) -> Supervisor:
    def on_state(process: EngineProcess) -> None:
        ready = process.state == "ready"
        metrics.engine_up.labels(process.name).set(1 if ready else 0)
        # a (re)started engine holds no adapter: it gets its pool's adapters again
        pool = process.name.rsplit("-", 1)[0]
        task = adapters.replica_changed(pool, process.replica, ready)
        if task is not None:
            tasks[:] = [t for t in tasks if not t.done()]
            tasks.append(task)

    return Supervisor(
        processes,
        backoff_base_s=config.supervisor.backoff_base_s,
        backoff_max_s=config.supervisor.backoff_max_s,
        stable_after_s=config.supervisor.stable_after_s,
        on_state=on_state,
        on_restart=lambda p: metrics.engine_restarts.labels(p.name).inc(),
    )


async def _load_remote_tokenizers(config: GatewayConfig) -> dict[str, Any]:
    """Tokenizers of remotes that name one (``remotes[].tokenizer``), by remote name."""
    wanted = [r for r in config.remotes if r.tokenizer is not None]
    loaded = await asyncio.gather(
        *(asyncio.to_thread(load_tokenizer, str(r.tokenizer)) for r in wanted)
    )
    return {r.name: tok for r, tok in zip(wanted, loaded, strict=True) if tok is not None}


def _image_tokens(config: GatewayConfig) -> dict[str, int | SizedImageTokens]:
    """Prompt tokens per image of each local vision model, by engine name."""
    found = {e.name: load_image_tokens(e.model) for e in config.engines if e.command is None}
    return {name: count for name, count in found.items() if count is not None}


async def _load_tokenizers(config: GatewayConfig) -> dict[str, Any]:
    wanted = [e for e in config.engines if e.count_tokens_with == "tokenizer" and e.command is None]
    loaded = await asyncio.gather(*(asyncio.to_thread(load_tokenizer, e.model) for e in wanted))
    return {e.name: tok for e, tok in zip(wanted, loaded, strict=True) if tok is not None}


@contextlib.contextmanager
def _runtime_dir(configured: Path | None) -> Iterator[Path]:
    """Where the engines' sockets go: the configured directory, else a private temporary one
    (removed at the end)."""
    if configured is not None:
        configured.mkdir(parents=True, exist_ok=True)
        yield configured
        return
    own = tempfile.TemporaryDirectory(prefix="portico-")
    try:
        yield Path(own.name)
    finally:
        with contextlib.suppress(OSError):
            own.cleanup()


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _freeze_startup_objects() -> None:
    # Everything loaded so far lives as long as the process: keep the cyclic collector from
    # rescanning it (tokenizers, litellm, pydantic models) on every full collection.
    gc.collect()
    gc.freeze()
    # A request leaves almost no cyclic garbage, but with requests in flight every young
    # collection finds live objects and promotes them, and every tenth one scans the older
    # generations (6 ms each at saturation, freeing nothing). Collecting the young
    # generation every 10k net allocations instead of 700 cut the collector's share of the
    # gateway's CPU from about 8 % to under 2 % at saturation; one such pass takes ~1 ms.
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, gen1, gen2)

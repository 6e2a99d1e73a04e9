"""A tensor-parallel worker: one process per rank above 0, started by the engine.

``python -m engine.distributed.worker --rank R --world-size N --port P --config JSON``: joins
rank 0's rendezvous, loads the model and keeps its shard, sizes its KV cache (its KV heads
only), then runs every plan rank 0 broadcasts until ``STOP``. It never schedules or samples.

Life: SIGTERM and SIGINT are ignored (the engine drains first and then stops its workers with
a ``STOP`` plan; a signal sent to the whole process group must not kill a rank mid-drain); a
worker whose parent dies exits within :data:`PARENT_POLL_S` seconds, so none is left behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.distributed import step_plan
from engine.distributed.group import TensorParallelGroup, rendezvous_store
from engine.distributed.sharding import check_divisible, shard_model
from engine.model_loader import (
    LoadedModel,
    choose_device,
    load_model,
    resolve_quantization,
)
from engine.model_runner import ModelRunner, num_kv_blocks
from engine.numerics import resolve_numerics
from portico.registry import resolve

log = logging.getLogger("portico.engine.tp")

PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 3


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU for every rank, or GPU ``rank`` (one GPU per rank) on CUDA."""
    device = choose_device(config.device)
    if device.type != "cuda":
        return device
    if torch.cuda.device_count() < config.tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size {config.tensor_parallel_size} needs as many GPUs; "
            f"{torch.cuda.device_count()} visible"
        )
    return torch.device("cuda", rank)


def cpu_threads_per_rank(world_size: int) -> int:
    """Intra-op threads for each rank on CPU: the cores shared out, unless OMP_NUM_THREADS
    was set (then PyTorch already follows it)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def load_shard(config: EngineConfig, group: TensorParallelGroup) -> LoadedModel:
    """Load the whole model on the CPU, keep ``group.rank``'s shard, move it to its device.

    Each rank reads the whole checkpoint once (peak memory: the whole model per rank while
    loading); what stays resident is the shard plus the replicated embedding and head.
    """
    source = resolve(config.model)
    device = group.device
    quantization = resolve_quantization(config.quantization, source, device)
    path = resolve_numerics(config.dtype, config.gguf_activations, device, quantization == "gguf")
    loaded = load_model(
        source, path.torch_dtype, "cpu", quantization, path.gguf_activations, config.load_format
    )
    check_divisible(loaded.config, group.world_size)
    local = shard_model(loaded.model, group)
    loaded.model.to(device)
    loaded.model.prepack_weights()
    return dataclasses.replace(loaded, config=local, numerics=path)


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        print("tensor-parallel worker: the engine process is gone; exiting", file=sys.stderr)
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def serve(config: EngineConfig, group: TensorParallelGroup) -> None:
    """Load this rank's shard and run rank 0's plans until ``STOP``."""
    loaded = load_shard(config, group)
    num_blocks = group.min_int(num_kv_blocks(loaded, config))
    runner = ModelRunner(loaded, config, num_blocks)
    log.info("rank %d: shard loaded, %d KV blocks", group.rank, num_blocks)
    with torch.inference_mode():
        while True:
            plan = step_plan.receive(group)
            if isinstance(plan, step_plan.StopPlan):
                return
            if isinstance(plan, step_plan.SwapPlan):
                runner.swap(plan.swap_out, plan.swap_in)
                continue
            runner.model(plan.input_ids, plan.positions, runner.kv_caches, plan.meta)


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.distributed.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="rank 0's rendezvous port")
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    parser.add_argument("--parent-pid", type=int, required=True, help="the engine's pid")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(args.parent_pid)  # the engine may already be gone: then at once
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s tp-rank-{args.rank}: %(message)s",
    )
    fields: dict[str, Any] = json.loads(args.config)
    config = EngineConfig(**fields)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_rank(args.world_size))
    store = rendezvous_store(args.rank, args.world_size, args.port)
    device = rank_device(config, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store.set(f"hello/{args.rank}", str(os.getpid()))
    group = TensorParallelGroup(store, args.rank, args.world_size, device)
    try:
        serve(config, group)
    except RuntimeError as exc:  # gloo: rank 0 closed its end (it exited without STOP)
        log.error("rank %d: lost the engine: %s", args.rank, str(exc).splitlines()[0][:200])
        return EXIT_PARENT_GONE
    log.info("rank %d: stopped", args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())

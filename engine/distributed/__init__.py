"""Tensor parallelism: one model split over several ranks (processes), vLLM's design.

- :mod:`engine.distributed.group`: the ranks and their channels (gloo; NCCL for the
  all-reduces on CUDA), built from a TCP rendezvous without torch's global default group.
- :mod:`engine.distributed.sharding`: each rank's shard of the weights (heads, MLP slices).
- :mod:`engine.distributed.step_plan`: what rank 0 broadcasts each step.
- :mod:`engine.distributed.leader`: rank 0 (the engine process) starts, watches and stops
  the workers; :mod:`engine.distributed.worker`: the worker processes' loop.
"""

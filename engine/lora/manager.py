"""Adapters by name, a CPU cache of loaded adapters (LRU), and the device slots of a step.

Three levels, as in vLLM: the *registry* (every adapter clients may name: ``--lora-modules``
and runtime loads), the *CPU cache* (up to ``max_cpu_loras`` adapters read from disk, least
recently used evicted first; an evicted adapter is read from its folder again when a request
needs it), and ``max_loras`` *device slots* (the adapters one step can mix). Each of the
model's projections gets a :class:`LoRALinear` holding its slice of the slot buffers and the
manager's :class:`LoRABatch`, which :meth:`LoRAManager.prepare` fills before every forward pass
with each row's slot: the runner sets it, the layers read it, one step at a time.

Threads: the registry is read and written on the server's event loop (``register`` reads the
folder there, to refuse a bad adapter before it is listed); the cache, the slots and the batch
belong to the engine thread (``prepare``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.lora.adapter import (
    NUM_PARTS,
    LoRAError,
    LoRARequest,
    LoRAWeights,
    load_adapter,
    module_shapes,
)
from engine.lora.ops import Segments, lora_delta, segments_of
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from torch import nn

    from engine.request import Request


@dataclass
class LoRABatch:
    """This step's slot per row (``None``: every row runs the base model, nothing to add) and
    its runs of equal slots (the CPU reference's segments)."""

    slots: torch.Tensor | None = None
    segments: Segments = field(default_factory=list)


class LoRALinear:
    """The LoRA half of one projection: its ``[slots, parts * rank, in]`` A buffer, its
    ``[slots, out, parts * rank]`` B buffer, and the shared batch it reads its rows' slots
    from. ``BlockLinear.forward`` calls :meth:`add_delta` on its output."""

    __slots__ = ("a", "b", "batch", "parts")

    def __init__(
        self, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch, parts: list[tuple[int, int]]
    ) -> None:
        self.a, self.b, self.batch, self.parts = a, b, batch, parts

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        slots = self.batch.slots
        if slots is not None:
            lora_delta(x, self.a, self.b, slots, out, self.batch.segments, self.parts)


class LoRAManager:
    """Owns the adapters of one engine (see the module docstring for the three levels)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
        base_model_name: str,
    ) -> None:
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.base_model_name = base_model_name
        self.registry: dict[str, LoRARequest] = {}
        self._registry_lock = threading.Lock()  # runtime loads check folders in worker threads
        self._next_id = 1
        self._cpu: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU: oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU order
        self.num_disk_loads = 0
        self.batch = LoRABatch()
        self._a: list[dict[str, torch.Tensor]] = []
        self._b: list[dict[str, torch.Tensor]] = []
        shapes = module_shapes(cfg)
        for layer in model.model.layers:  # type: ignore[union-attr]
            a_layer, b_layer = {}, {}
            for module_name, (in_features, outs) in shapes.items():
                parts = NUM_PARTS[module_name]
                width = parts * max_lora_rank
                bounds = [sum(outs[:i]) for i in range(len(outs) + 1)]
                part_ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
                a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, sum(outs), width, dtype=dtype, device=device)
                owner = layer.self_attn if module_name in ("qkv_proj", "o_proj") else layer.mlp
                getattr(owner, module_name).lora = LoRALinear(a, b, self.batch, part_ranges)
                a_layer[module_name], b_layer[module_name] = a, b
            self._a.append(a_layer)
            self._b.append(b_layer)

    @property
    def slot_bytes(self) -> int:
        """Device memory one slot takes (all layers, A and B)."""
        tensors = [t for layer in (*self._a, *self._b) for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors) // self.max_loras

    # -- the registry (server thread) --------------------------------------------------------

    def register(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter at ``path`` against the model and list it as ``name``.

        LoRAError (nothing registered) for a taken name, a wrong base model, a rank above
        ``--max-lora-rank``, a target module the model lacks, or an unreadable folder.
        """
        if not name or name == self.base_model_name:
            raise LoRAError(f"'{name}' cannot name an adapter: it is empty or the base model")
        if base_model_name is not None and base_model_name != self.base_model_name:
            raise LoRAError(
                f"adapter '{name}' is for base model '{base_model_name}'; this engine serves "
                f"'{self.base_model_name}'"
            )
        with self._registry_lock:
            if name in self.registry:
                raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
            request = LoRARequest(name, self._next_id, str(path), base_model_name)
            load_adapter(request, self.cfg, self.max_lora_rank)  # raises: nothing changes
            self._next_id += 1
            self.registry[name] = request
        return request

    def unregister(self, name: str) -> LoRARequest:
        """Stop listing ``name`` (KeyError if unknown). Requests already running keep it: the
        engine thread still finds its weights (from the cache or the folder)."""
        with self._registry_lock:
            return self.registry.pop(name)

    def get(self, name: str) -> LoRARequest | None:
        return self.registry.get(name)

    def registered_ids(self) -> dict[str, int]:
        """Each listed adapter's name and number (any thread): a router hashes an adapter's
        prompt blocks with that number, as this engine does."""
        with self._registry_lock:
            return {name: lora.lora_int_id for name, lora in self.registry.items()}

    def resident_names(self) -> tuple[str, ...]:
        """Listed adapters in a slot now (engine thread): a request for one of these runs
        without copying weights in first."""
        in_slots = self._slot_of
        if not in_slots:
            return ()
        with self._registry_lock:
            return tuple(n for n, lora in self.registry.items() if lora.lora_int_id in in_slots)

    # -- the step (engine thread) ------------------------------------------------------------

    def prepare(self, rows: list[tuple[LoRARequest | None, int]]) -> None:
        """Put this step's adapters in slots and set every row's slot: ``rows`` lists each
        scheduled request's adapter (None: the base model) and its number of tokens, in the
        runner's row order. The scheduler admits at most ``max_loras`` adapters at once."""
        if all(lora is None for lora, _ in rows):
            self.batch.slots = None
            self.batch.segments = []
            return
        wanted = {lora.lora_int_id: lora for lora, _ in rows if lora is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step; max_loras {self.max_loras}")
        for wanted_lora in wanted.values():
            self._ensure_slot(wanted_lora, wanted)
        slot_ids: list[int] = []
        for lora, num_tokens in rows:
            slot = -1 if lora is None else self._slot_of[lora.lora_int_id]
            slot_ids.extend([slot] * num_tokens)
        slots = torch.tensor(slot_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self.batch.slots = slots
        self.batch.segments = segments_of(slot_ids) if self.device.type != "cuda" else []

    @staticmethod
    def order(scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The step's requests with each adapter's rows contiguous (fewer, larger LoRA
        matmuls), one-token rows still first as the attention kernels expect; stable."""

        def key(item: tuple[Request, int]) -> tuple[bool, int]:
            lora = item[0].lora_request
            return item[1] != 1, -1 if lora is None else lora.lora_int_id

        return sorted(scheduled, key=key)

    def _ensure_slot(self, lora: LoRARequest, in_step: dict[int, LoRARequest]) -> None:
        if lora.lora_int_id in self._slot_of:
            self._slot_of.move_to_end(lora.lora_int_id)
            return
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # evict the least recently used adapter this step does not need
            victim = next(i for i in self._slot_of if i not in in_step)
            slot = self._slot_of.pop(victim)
        weights = self._weights(lora)
        for layer, (a_layer, b_layer) in enumerate(zip(self._a, self._b, strict=True)):
            for module_name, a in a_layer.items():
                b = b_layer[module_name]
                src_a = weights.a[layer].get(module_name)
                if src_a is None:
                    a[slot].zero_()
                    b[slot].zero_()
                else:
                    a[slot].copy_(src_a)
                    b[slot].copy_(weights.b[layer][module_name])
        self._slot_of[lora.lora_int_id] = slot

    def _weights(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter from the CPU cache, else from its folder (evicting the LRU beyond
        ``max_cpu_loras``)."""
        weights = self._cpu.get(lora.lora_int_id)
        if weights is not None:
            self._cpu.move_to_end(lora.lora_int_id)
            return weights
        weights = load_adapter(lora, self.cfg, self.max_lora_rank)
        self.num_disk_loads += 1
        self._cpu[lora.lora_int_id] = weights
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
        return weights

    @property
    def cpu_cached_ids(self) -> list[int]:
        """lora_int_ids in the CPU cache, least recently used first (tests, metrics)."""
        return list(self._cpu)

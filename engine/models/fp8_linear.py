"""FP8 weights (``--quantization fp8``, vLLM's flag): e4m3 projections, torch's scaled matmul.

At load, each projection of the Llama layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) is rounded to ``float8_e4m3fn`` with one float32 scale per output channel
(``scale = max |w_row| / 448``); the embedding, the norms and the LM head stay in the model's
dtype, as in vLLM. Each step quantizes the linear's input per token the same way (dynamic
activation scales: ``max |x_row| / 448``), and :func:`torch._scaled_mm` multiplies the two fp8
operands with float32 sums, applying both scales to the result. The dense weight is dropped:
a projection keeps 1 byte per weight plus 4 per output channel (``engine.memory_plan`` counts
the same bytes).

Error bound (``tests/engine/test_fp8_linear.py`` checks it layer by layer): e4m3 keeps three
mantissa bits, so a normal value is rounded within ``2**-4`` of itself, and one below the
smallest normal (``2**-6`` in scaled units) within ``2**-10`` scaled units.

Where it runs: CUDA cards of compute capability 8.9 and later (Ada, Hopper), where every
projection's dimensions must be multiples of 16 (``_scaled_mm``'s rule); and CPUs whose torch
build has ``_scaled_mm`` for fp8 (torch 2.13's CPU build does: a reference kernel, slower than
the float matmul; there it proves the numerics, it is not a speed path). Elsewhere
:func:`fp8_unsupported_reason` says why, and the loader refuses the flag with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
# Floor of a scale (an all-zero row or token would otherwise divide by zero); vLLM's floor.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# The projections quantized; embeddings, norms and the LM head keep the model's dtype.
FP8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_CUDA_MIN_CAPABILITY = (8, 9)


@dataclass
class Fp8Weight:
    """A projection ``[out, in]`` in e4m3 with its per-output-channel scales.

    ``qweight``: ``[out, in]`` row-major e4m3 (its ``.t()`` is the column-major second
    operand ``_scaled_mm`` wants); ``scale``: float32 ``[1, out]``; ``w ~= qweight * scale.T``.
    """

    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` these values encode (tests and checks)."""
        return self.qweight.float() * self.scale.t()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, n]`` in e4m3 with one float32 scale per row ``[rows, 1]``:
    ``x ~= q * scale``, ``scale = max(max |x_row| / 448, MIN_SCALE)``."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).div_(FP8_MAX).clamp_(min=MIN_SCALE)
    q = (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # not in place: x32 may be x
    return q, scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` ``[out, in]`` per output channel (:func:`quantize_rows`), on its device."""
    q, scale = quantize_rows(weight.detach())
    return Fp8Weight(q.contiguous(), scale.reshape(1, -1).contiguous())


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` in ``x``'s dtype: ``x`` ``[..., in]`` quantized per token, the
    product through :func:`torch._scaled_mm` with float32 sums and both scales applied."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    out_features = weight.qweight.shape[0]
    if rows.shape[0] == 0:
        return x.new_empty((*shape[:-1], out_features))
    q, scale = quantize_rows(rows)
    # CUDA's row-wise scaled matmul writes bfloat16 only; the CPU kernel writes any float dtype
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    out = torch._scaled_mm(
        q, weight.qweight.t(), scale_a=scale, scale_b=weight.scale, out_dtype=out_dtype
    )
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out.add_(bias)
    return out.reshape(*shape[:-1], out_features)


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """None where :func:`fp8_linear` runs on ``device``; else why not (for the refusal)."""
    device = torch.device(device)
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"this torch build ({torch.__version__}) has no float8_e4m3fn or _scaled_mm"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        capability = torch.cuda.get_device_capability(device)
        if capability < _CUDA_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (
                f"it needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper); "
                f"{name} is {capability[0]}.{capability[1]}"
            )
        return None
    if device.type != "cpu":
        return f"it runs on CUDA or the CPU, not {device.type}"
    return _cpu_reason()


def _cpu_reason() -> str | None:
    try:  # a tiny product: the CPU build either has the fp8 kernel or raises
        a = torch.ones(1, 16).to(FP8_DTYPE)
        b = torch.ones(16, 16).to(FP8_DTYPE)
        one = torch.ones(1, 1)
        out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=torch.ones(1, 16),
                               out_dtype=torch.float32)  # fmt: skip
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"this torch build's CPU _scaled_mm does not take fp8 ({exc})"
    if not torch.equal(out, torch.full((1, 16), 16.0)):
        return "this torch build's CPU _scaled_mm gave a wrong product"
    return None


def check_fp8_shape(name: str, out_features: int, in_features: int, device: torch.device) -> None:
    """On CUDA, ``_scaled_mm`` takes dimensions that are multiples of 16 only: refuse others
    with a ValueError naming the flag and the layer."""
    if device.type == "cuda" and (out_features % 16 or in_features % 16):
        raise ValueError(
            f"--quantization fp8: {name} is [{out_features}, {in_features}]; CUDA's scaled "
            "matmul needs both dimensions to be multiples of 16"
        )


def quantize_projections(model: torch.nn.Module) -> int:
    """Quantize every projection of ``model``'s layers (:data:`FP8_PROJECTIONS`) in place:
    attach its :class:`Fp8Weight` as ``module.fp8`` and drop the dense weight (an empty
    tensor of the same dtype and device is left in its place). Returns the bytes they keep."""
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in FP8_PROJECTIONS or not hasattr(module, "fp8"):
            continue
        weight = module.weight
        check_fp8_shape(name, weight.shape[0], weight.shape[1], weight.device)
        module.fp8 = quantize_weight(weight)
        module.packed = None
        module.weight = torch.nn.Parameter(
            weight.new_empty(0), requires_grad=False
        )  # the e4m3 copy is the weight now
        total += module.fp8.nbytes
    return total

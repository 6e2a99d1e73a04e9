"""The engine's native CPU kernels (``csrc/*.c``, one file per op family): built once, loaded
through ctypes.

The C files are compiled together into one library with the system C compiler (``cc -O3
-march=native -fopenmp``) the first time a process asks for it, into ``~/.cache/portico/kernels``
(``PORTICO_KERNEL_CACHE``), under a name keyed by the sources, the compiler and the CPU, so a
changed file or another machine gets its own build. Concurrent builders write to a temporary
file and rename it into place. Without a compiler, or with ``PORTICO_CPU_KERNELS=0``,
:func:`load` returns ``None`` (logged once) and the engine runs its PyTorch references instead:
same results, slower.

Instruction sets are detected, never assumed: ``-march=native`` compiles in the AVX-512,
AVX512-BF16 and VNNI paths only where the building CPU has them, AVX2 ones on a CPU with AVX2 and
FMA but no AVX-512, portable loops otherwise (tests/engine/test_kernel_builds.py builds and
checks the other two on any machine); the
library reports what it was built with (``portico_compiled_features``), and :func:`load` refuses
a library whose features the running CPU does not report in ``/proc/cpuinfo``
(:func:`cpu_features`), so a kernel cache shared between machines cannot crash one of them.

The library links the OpenMP runtime by soname, so it shares the one torch already loaded and
uses ``torch.get_num_threads()`` threads. ctypes releases the GIL for the duration of each call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
# Bits of portico_compiled_features() (csrc/features.c) and the /proc/cpuinfo flag of each.
_FEATURE_BITS = {
    "avx512f": 1,
    "avx512bw": 2,
    "avx512_bf16": 4,
    "avx512_vnni": 8,
    "amx_tile": 16,
    "amx_bf16": 32,
    "avx2": 64,
    "fma": 128,
    "f16c": 256,
}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def kv_kind(cache_dtype: torch.dtype, step_dtype: torch.dtype) -> int | None:
    """The native kernels' ``kv_kind`` (csrc/common.h) for a KV cache of ``cache_dtype`` in a
    step of ``step_dtype``: 0 the step's own dtype, 1 int8 rows with their scales, 2 float16
    under float32; None for a pairing they do not read."""
    if cache_dtype == torch.int8:
        return 1
    if cache_dtype == step_dtype:
        return 0
    if cache_dtype == torch.float16 and step_dtype == torch.float32:
        return 2
    return None


_Q8_KINDS = {"q4_1": 0, "q8_0": 1}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int


def cache_dir() -> Path:
    """Where built kernel libraries are kept."""
    default = Path.home() / ".cache" / "portico" / "kernels"
    return Path(os.environ.get("PORTICO_KERNEL_CACHE", default))


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    for line in text.splitlines():
        if line.startswith("flags"):
            return line
    return platform.processor()


def sources() -> list[Path]:
    """The C files built into the library, in a fixed order."""
    return sorted(SOURCE_DIR.glob("*.c"))


def cpu_flags() -> frozenset[str]:
    """Every flag this CPU reports in ``/proc/cpuinfo`` (empty where there is no such file)."""
    text = _cpu_identity()
    return frozenset(text.split()[2:]) if text.startswith("flags") else frozenset()


def cpu_features() -> frozenset[str]:
    """The vector instruction sets (of :data:`_FEATURE_BITS`) this CPU reports."""
    flags = cpu_flags()
    return frozenset(name for name in _FEATURE_BITS if name in flags)


@functools.cache
def bf16_matmul_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16). Without it,
    PyTorch's bf16 matmuls convert every operand and run several times slower than float32 (5x
    measured on an AVX2-only EPYC: docs/engine-benchmark.md)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_features())


def _compiled_features(lib: ctypes.CDLL) -> frozenset[str]:
    lib.portico_compiled_features.restype = _I
    bits = int(lib.portico_compiled_features())
    return frozenset(name for name, bit in _FEATURE_BITS.items() if bits & bit)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


# -ffp-contract=off: plain C arithmetic rounds like PyTorch's separate multiply and add.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off"]


def compile_library(
    compiler: str,
    out: Path,
    source_dir: Path = SOURCE_DIR,
    extra_flags: Sequence[str] = (),
) -> None:
    """Compile the C files of ``source_dir`` into the shared library ``out``, with ``extra_flags``
    after the usual ones (``-DNAME=VALUE``, or ``-mno-avx512f`` to build another instruction
    set's paths); OSError with the compiler's message when it fails."""
    result = subprocess.run(
        [compiler, *_FLAGS, *extra_flags, "-I", str(source_dir), "-o", str(out),
         *map(str, sorted(source_dir.glob("*.c"))), "-lm"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise OSError(f"{compiler} failed: {result.stderr.strip()[:2000]}")


def open_library(path: Path) -> ctypes.CDLL:
    """A built library (of :func:`compile_library`) with its functions' signatures declared.
    Unlike :func:`load`, nothing checks that this CPU runs what it was built with."""
    return _declare(ctypes.CDLL(str(path)))


def build(compiler: str) -> Path:
    """Compile the kernels (or find an earlier build); returns the shared library's path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                *(p.read_bytes() for p in sorted(SOURCE_DIR.iterdir()) if p.suffix in (".c", ".h")),
                version.encode(),
                " ".join(_FLAGS).encode(),
                _cpu_identity().encode(),
            ]
        )  # fmt: skip
    ).hexdigest()[:16]
    target = cache_dir() / f"portico_cpu_kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        compile_library(compiler, Path(staging))
        os.replace(staging, target)  # atomic: a reader sees a whole library or none
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.paged_attention.restype = _I
    lib.paged_attention.argtypes = [
        _P,
        _I64,
        _I64,
        _P,
        _I64,
        _I,
        _I,
        _I,
        _P,
        _I,
        _P,
        _P,
        _I,
        _I,
        ctypes.c_float,
        _I,
        _I,
        _P,
        _I,
    ]
    lib.q4_1_linear.restype = _I
    lib.q4_1_linear.argtypes = [_P, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I]
    lib.q8_0_linear.restype = _I
    lib.q8_0_linear.argtypes = [_P, _I, _I, _P, _P, _P, _I, _I, _P, _I]
    lib.block_linear_q8.restype = _I
    lib.block_linear_q8.argtypes = [_I, _P, _I, _I, _P, _P, _I, _I, _P, _I]
    lib.q8_packed_bytes.restype = ctypes.c_size_t
    lib.q8_packed_bytes.argtypes = [_I, _I, _I]
    lib.q8_pack.restype = _I
    lib.q8_pack.argtypes = [_I, _I, _I, _P, _P, _P, _P]
    lib.panel_linear.restype = _I
    lib.panel_linear.argtypes = [_I, _P, _I, _I, _P, _P, _I, _I, _P, _I]
    lib.panel_bytes.restype = ctypes.c_int64
    lib.panel_bytes.argtypes = [_I, _I, _I]
    lib.q8_supported.restype = _I
    lib.q8_supported.argtypes = [_I]
    lib.decode_step_supported.restype = _I
    lib.decode_step_supported.argtypes = [_P]
    lib.decode_step.restype = _I
    lib.decode_step.argtypes = [
        _P, _P, _P, ctypes.c_float, ctypes.c_float, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I64,
        _I, _P, _I, _P, _P, _I, _P, _P, _I, _P, _I,
    ]  # fmt: skip
    lib.panel_step_supported.restype = _I
    lib.panel_step_supported.argtypes = [_P]
    lib.panel_step.restype = _I
    lib.panel_step.argtypes = lib.decode_step.argtypes
    lib.add_rms_norm.restype = None
    lib.add_rms_norm.argtypes = [_P, _P, _P, ctypes.c_float, _P, _I, _I, _I, _I]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [_P, _I, _I, _I, _P, _I]
    lib.rope_write_kv.restype = None
    lib.rope_write_kv.argtypes = [
        _P,
        _I,
        _I64,
        _I,
        _I,
        _I,
        _P,
        _P,
        _P,
        _P,
        _I64,
        _I,
        _P,
        _I,
        _I,
        _I,
    ]
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; ``None`` when disabled or it cannot be built."""
    if os.environ.get("PORTICO_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the engine uses its PyTorch CPU kernels (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler)))
    except OSError as exc:
        log.warning("CPU kernels unavailable, using the PyTorch ones (slower): %s", exc)
        return None
    missing = _compiled_features(lib) - cpu_features()
    if missing:
        log.warning("CPU kernels need %s, which this CPU lacks: using PyTorch", sorted(missing))
        return None
    return _declare(lib)


def compiled_features() -> frozenset[str]:
    """The instruction sets the loaded library uses (empty when it is not loaded)."""
    lib = load()
    return _compiled_features(lib) if lib is not None else frozenset()


def int8_available() -> bool:
    """Whether the int8-activation block linears (and so the fused decode step) run here: the
    library was built with AVX512-VNNI or with AVX2, FMA and F16C (csrc/quantized_int8.c)."""
    lib = load()
    return lib is not None and bool(lib.q8_supported(64))


def available() -> bool:
    """Whether the native CPU kernels can be used in this process."""
    return load() is not None


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Native twin of :func:`~engine.kernels.reference.paged_attention_ref` (same meaning).

    An int8 ``kv_cache`` (rows of ``d`` values and their float32 scale,
    :mod:`engine.kv_cache_dtype`), and a float16 one under float32 queries, are read by the same
    kernel. Returns ``None`` when the kernels are unavailable or these inputs are outside what
    they handle (dtype, layout, head counts); the caller then runs the reference.
    """
    lib = load()
    kind = kv_kind(kv_cache.dtype, query.dtype)
    if (
        lib is None
        or query.dtype not in _DTYPE_CODES
        or kind is None
        or query.stride(-1) != 1
        or not kv_cache.is_contiguous()
    ):
        return None
    tokens, heads, head_dim = query.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    if heads % kv_heads:
        return None
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=query.dtype)
    status = lib.paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1), kv_cache.data_ptr(), num_blocks,
        block_size, kv_heads, head_dim, tables.data_ptr(), tables.shape[1], starts.data_ptr(),
        lens.data_ptr(), lens.shape[0], heads, float(scale), _DTYPE_CODES[query.dtype],
        kind, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if status == 0 else None


def quantized_linear(
    x: torch.Tensor,
    kind: str,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed_q8: torch.Tensor | None = None,
    panels: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` for W in GGUF blocks (``kind`` "q4_1" or "q8_0"), or ``None`` when
    the kernels are unavailable for these inputs. ``x`` is [M, K] float32 or bfloat16.

    With ``panels`` (the same blocks repacked, :meth:`GGUFBlocks.pack_panels`): the batch
    invariant kernel, :func:`panel_linear`.

    With ``packed_q8`` (:func:`pack_blocks_q8` of the same blocks) and bfloat16 ``x``: each block
    of 32 values of ``x`` is rounded to int8 (scale = max |x| / 127) and the products run on
    integer dot products (VNNI's, or AVX2's; csrc/quantized_int8.c). Not exact; float32 ``x``
    never does."""
    if panels is not None:
        return panel_linear(x, kind, panels, scales.shape[0], bias)
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODES or x.dim() != 2:
        return None
    x = x.contiguous()
    rows, k = x.shape
    n = scales.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype)
    bias_ptr = bias.data_ptr() if bias is not None else None
    threads = torch.get_num_threads()
    code = _DTYPE_CODES[x.dtype]
    if packed_q8 is not None and x.dtype == torch.bfloat16:
        status = lib.block_linear_q8(
            _Q8_KINDS[kind], x.data_ptr(), rows, k, packed_q8.data_ptr(), bias_ptr, n, code,
            out.data_ptr(), threads,
        )  # fmt: skip
        if status == 0:
            return out
    if kind == "q4_1":
        if mins is None:
            raise ValueError("q4_1 weights need their block minimums")
        status = lib.q4_1_linear(
            x.data_ptr(), rows, k, qs.data_ptr(), scales.data_ptr(), mins.data_ptr(), bias_ptr,
            n, code, out.data_ptr(), threads,
        )  # fmt: skip
    else:
        status = lib.q8_0_linear(
            x.data_ptr(), rows, k, qs.data_ptr(), scales.data_ptr(), bias_ptr, n, code,
            out.data_ptr(), threads,
        )  # fmt: skip
    return out if status == 0 else None


def panel_linear(
    x: torch.Tensor, kind: str, panels: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` for W [n, K] in GGUF blocks repacked as panel records of 16 output
    rows (:meth:`GGUFBlocks.pack_panels`), or ``None`` when the kernels are unavailable for these
    inputs. ``x`` is [M, K] float32 or bfloat16; the output has its dtype. Batch invariant: each
    row is written in integers on its own, the products are exact integer dot products and each
    output element is one fixed chain of float32 operations, whatever ``M``, the thread count or
    the other rows (csrc/panel_linear.c)."""
    lib = load()
    if lib is None or x.dtype not in _DTYPE_CODES or x.dim() != 2 or x.shape[0] == 0:
        return None
    x = x.contiguous()
    rows, k = x.shape
    if k % 32 or panels.numel() != lib.panel_bytes(_Q8_KINDS[kind], n, k):  # not these panels
        return None
    out = torch.empty((rows, n), dtype=x.dtype)
    status = lib.panel_linear(
        _Q8_KINDS[kind], x.data_ptr(), rows, k, panels.data_ptr(),
        bias.data_ptr() if bias is not None else None, n, _DTYPE_CODES[x.dtype],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if status == 0 else None


def pack_blocks_q8(
    kind: str, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
) -> torch.Tensor | None:
    """GGUF blocks (as :func:`quantized_linear` takes them) repacked into the int8-activation
    kernel's records: every 4 output rows' quants and scales for 64 inputs side by side, so a
    thread reads one forward stream (csrc/quantized_int8.c). ``None`` where that kernel does not
    serve (no library, neither AVX512-VNNI nor AVX2, ``K`` not a multiple of 64)."""
    lib = load()
    n, k = scales.shape[0], scales.shape[1] * 32
    if lib is None or kind not in _Q8_KINDS or not lib.q8_supported(k):
        return None
    if kind == "q4_1" and mins is None:
        raise ValueError("q4_1 weights need their block minimums")
    code = _Q8_KINDS[kind]
    out = torch.empty(int(lib.q8_packed_bytes(code, n, k)), dtype=torch.uint8)
    qs, scales = qs.contiguous(), scales.float().contiguous()
    mins_t = mins.float().contiguous() if mins is not None else None
    status = lib.q8_pack(
        code, n, k, qs.data_ptr(), scales.data_ptr(),
        mins_t.data_ptr() if mins_t is not None else None, out.data_ptr(),
    )  # fmt: skip
    return out if status == 0 else None


def add_rms_norm_cpu(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """``x += delta`` in place (when given), then Hugging Face's RMSNorm of ``x`` times
    ``weight``; ``None`` (nothing changed) when the kernels cannot take these inputs."""
    lib = load()
    if (
        lib is None
        or x.dtype not in _DTYPE_CODES
        or weight.dtype != x.dtype
        or not x.is_contiguous()
        or (delta is not None and (delta.dtype != x.dtype or not delta.is_contiguous()))
        or x.shape[-1] > 8192
    ):
        return None
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    lib.add_rms_norm(
        x.data_ptr(), delta.data_ptr() if delta is not None else None,
        weight.contiguous().data_ptr(), float(eps), out.data_ptr(), x.numel() // hidden, hidden,
        _DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul_cpu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up`` ([T, 2 * intermediate], gate first), each element
    computed alone by the same code wherever it sits (csrc/norm_rope.c), or ``None`` when the
    kernels cannot take these inputs."""
    lib = load()
    if (
        lib is None
        or gate_up.dtype not in _DTYPE_CODES
        or gate_up.dim() != 2
        or gate_up.shape[1] != 2 * intermediate
    ):
        return None
    gate_up = gate_up.contiguous()
    out = torch.empty((gate_up.shape[0], intermediate), dtype=gate_up.dtype)
    lib.silu_mul(
        gate_up.data_ptr(), gate_up.shape[0], intermediate, _DTYPE_CODES[gate_up.dtype],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_write_kv_cpu(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Rotate the query and key heads of ``qkv`` ([T, (heads + 2 kv_heads) * d]) in place with
    RoPE (float32 tables ``[max_pos, d / 2]``) and store the keys and values in ``kv_cache`` at
    ``slot_mapping`` (quantized, with their scales, into an int8 cache; rounded to nearest even
    into a float16 one). Returns False, having changed nothing, when the kernels cannot."""
    lib = load()
    kind = kv_kind(kv_cache.dtype, qkv.dtype)
    if (
        lib is None
        or qkv.dtype not in _DTYPE_CODES
        or kind is None
        or qkv.dim() != 2
        or qkv.stride(-1) != 1
        or not kv_cache.is_contiguous()
        or cos_table.dtype != torch.float32
        or head_dim > 512
    ):
        return False
    _, num_blocks, block_size, _, _ = kv_cache.shape
    cos_t, sin_t = cos_table.contiguous(), sin_table.contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    lib.rope_write_kv(
        qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
        cos_t.data_ptr(), sin_t.data_ptr(), pos.data_ptr(), kv_cache.data_ptr(), num_blocks,
        block_size, slots.data_ptr(), _DTYPE_CODES[qkv.dtype], kind,
        torch.get_num_threads(),
    )  # fmt: skip
    return True

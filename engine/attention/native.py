"""The compiled CPU backend (`native`): paged_attention.cpp, reading pages where they lie.

The kernel is built for this machine with the system's C++ compiler (-O3 -march=native -fopenmp;
kvstore.native: cached per source, flags, compiler and CPU; KVSTORE_KERNEL_MARCH=x86-64-v3, say,
builds it for another CPU), by `scripts/bootstrap` or on first use, and loaded with ctypes: no PyTorch headers, so a build takes about a second. It runs its
OpenMP loop in the process's one OpenMP runtime (PyTorch's, loaded first), on
torch.get_num_threads() threads.

One call a layer: every sequence of the step (decodes and prefill chunks alike) in one parallel
loop, K and V read in place from the hot pages (and from warm, for spilled pages), no gather, no
padding, no mask. Float32, head_dim a multiple of 16 up to 128, or 192 or 256; `auto` picks it on the CPU for those and
falls back to `sdpa` (with a log line) when the kernel cannot be built. It differs from the torch
reference only in the order of floating-point sums (tests hold it to the reference).
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.layer_ops import TORCH_OPS
from kvstore.errors import NotBuilt
from kvstore.native import build as native_build, compiler, cpu_flags, report

SOURCE = Path(__file__).with_name("paged_attention.cpp")
SOURCES = (SOURCE, SOURCE.with_name("layer_ops.cpp"), SOURCE.with_name("linear.cpp"))   # one library
HEADERS = (SOURCE.with_name("simd.h"),)
MARCH_ENV = "KVSTORE_KERNEL_MARCH"   # -march to build for (default native): x86-64-v3 is AVX2 without AVX-512
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-std=c++17")
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 256)
VERSION = 2   # kv_attention_version() of the source

_lib = None


# what a -march may turn on, by the compiler's macro and the flag /proc/cpuinfo shows for it
_X86_SETS = {"__AVX512F__": "avx512f", "__AVX2__": "avx2", "__FMA__": "fma", "__AVX__": "avx"}
_X86_64 = ("x86_64", "AMD64")


def _beyond_this_cpu(march: str) -> str | None:
    """The instruction set that -march=`march` builds for and this x86-64 CPU lacks (the library would
    die of an illegal instruction), or None."""
    cxx = compiler()
    flags = cpu_flags()
    if cxx is None or not flags or platform.machine() not in _X86_64:
        return None
    done = subprocess.run([cxx, f"-march={march}", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                          text=True)
    return next((flag for macro, flag in _X86_SETS.items()
                 if f"#define {macro} 1" in done.stdout and flag not in flags), None)


def build() -> Path:
    """The kernel's shared library, compiled now unless it already is. NotBuilt when it cannot be."""
    march = os.environ.get(MARCH_ENV) or "native"
    if march != "native" and (missing := _beyond_this_cpu(march)):
        raise NotBuilt(f"{MARCH_ENV}={march} builds the native kernels for {missing}, which this CPU does not "
                       f"have; unset it or name an older CPU (x86-64-v3: AVX2)")
    return native_build("paged_attention", "the native attention kernel", SOURCES, HEADERS, (*FLAGS, f"-march={march}"),
                        remedy="use engine.attention_backend: sdpa" + (f", or unset {MARCH_ENV}" if march != "native" else ""))


def load():
    """The loaded kernel (built first when needed); NotBuilt when it cannot be had."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build()))
        if lib.kv_attention_version() != VERSION:
            raise NotBuilt(f"the native attention kernel is version {lib.kv_attention_version()}, "
                           f"this engine expects {VERSION}")
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.kv_paged_attention.argtypes = [p, i64, p, p, p, i64, p, p, i64, i32, p, p, p, p, p,
                                           i32, i32, i32, i32, f32, i32]
        lib.kv_paged_attention.restype = i32
        lib.kv_add_rms_norm.argtypes = [p, p, i64, p, p, i64, i64, f32, i32]
        lib.kv_silu_mul.argtypes = [p, p, i64, i64, i32]
        lib.kv_rope_write.argtypes = [p, i64, p, p, p, p, p, p, i64, i32, i32, i32, i32]
        lib.kv_packed_linear_floats.argtypes = [i64, i64]
        lib.kv_packed_linear_floats.restype = i64
        lib.kv_pack_linear.argtypes = [p, i64, i64, p, i32]
        lib.kv_linear.argtypes = [p, i64, i64, p, p, i64, i64, p, i64, i32]
        for fn in (lib.kv_add_rms_norm, lib.kv_silu_mul, lib.kv_rope_write, lib.kv_pack_linear, lib.kv_linear):
            fn.restype = None
        _lib = lib
    return _lib


def preferred() -> str | None:
    """Why `auto` should not pick the native kernels on this CPU (None: it should). They are built for
    the registers the machine has (simd.h: 16-lane vectors with AVX-512, 8-lane with AVX2); on x86-64
    with AVX-512, or AVX2 and FMA, they are faster than sdpa and oneDNN's linears at a cached-prefix hit
    and in decode (scripts/bench_attention.py, BENCHMARKS.md). Elsewhere they run, exactly, but were
    not measured against sdpa, so `auto` leaves them out there."""
    if platform.machine() not in _X86_64:
        return f"the native kernels were measured on x86-64 with AVX-512 or AVX2, not on {platform.machine()}"
    flags = cpu_flags()
    if "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        return "the native kernels want AVX-512, or AVX2 with FMA, and this CPU has neither (sdpa is faster here)"
    return None


def unsuitable(dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why `auto` should not use the native kernels here: they cannot run (available) or are not the
    faster choice on this CPU (preferred); None when it should."""
    return available(dtype, head_dim) or preferred()


def available(dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why the native backend cannot run here (None: it can)."""
    if dtype != torch.float32:
        return f"the native attention kernel is float32 only (the KV here is {str(dtype).removeprefix('torch.')})"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"the native attention kernel is built for head_dim {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"
    try:
        load()
    except (NotBuilt, OSError) as exc:
        return str(exc)
    return None


class NativeLayerOps:
    """engine.layer_ops.TorchLayerOps in one call each (layer_ops.cpp), for float32 on the CPU: RoPE and
    the K/V write give PyTorch's bits; RMSNorm and silu differ only in the order of a row's sum and
    exp's last bit. A tensor that is not laid out as these calls read it goes to PyTorch's ops."""

    def __init__(self, lib):
        self.lib = lib

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm) -> torch.Tensor:
        if (x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32 or norm.weight.dtype != torch.float32
                or (delta is not None and (delta.shape != x.shape or delta.stride() != x.stride()
                                           or delta.dtype != torch.float32))):
            return TORCH_OPS.add_rms_norm(x, delta, norm)
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=torch.float32)
        self.lib.kv_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), x.stride(0),
                                 norm.weight.data_ptr(), out.data_ptr(), rows, dim, norm.eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.dtype != torch.float32:
            return TORCH_OPS.silu_mul(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=torch.float32)
        self.lib.kv_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rope_write(self, qkv, cos, sin, kv_cache, write_rows, nh: int, nkv: int, d: int) -> torch.Tensor:
        t = qkv.shape[0]
        if (qkv.stride(1) != 1 or qkv.dtype != torch.float32 or kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous()
                or not (cos.is_contiguous() and sin.is_contiguous()) or write_rows.dtype != torch.int64):
            return TORCH_OPS.rope_write(qkv, cos, sin, kv_cache, write_rows, nh, nkv, d)
        q = torch.empty((t, nh, d), dtype=torch.float32)
        rows = write_rows.contiguous()
        self.lib.kv_rope_write(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                               kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), rows.data_ptr(), t, nh, nkv, d,
                               torch.get_num_threads())
        return q


class NativeBackend(AttentionBackend):
    supports_spill = True
    reads_warm_in_place = True   # warm pages are host memory like hot ones here: one pointer a page

    def __init__(self):
        self.lib = load()
        self.fn = self.lib.kv_paged_attention
        self.layer_ops = NativeLayerOps(self.lib)

    def plan(self, batch: AttentionBatch, dtype: torch.dtype) -> None:
        why = available(dtype, batch.head_dim)
        if why:
            raise NotBuilt(why + "; use engine.attention_backend: sdpa")
        ps = batch.page_size
        pages, indptr, nwarm = [], [0], []
        for i, n in enumerate(batch.kv_lens):
            warm = batch.warm_tables[i] if batch.num_warm(i) else []
            need = -(-n // ps)
            pages += warm + batch.page_tables[i][:need - len(warm)]
            indptr.append(len(pages))
            nwarm.append(len(warm))
        # int32 arrays the kernel reads, kept alive until the next plan
        self._arrays = [np.asarray(x, dtype=np.int32) for x in
                        (batch.qo_indptr, batch.kv_lens, indptr, pages or [0], nwarm)]
        self.batch = batch
        self.scale = batch.head_dim ** -0.5

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, warm_cache: torch.Tensor | None = None) -> torch.Tensor:
        b = self.batch
        if q.stride(-1) != 1 or q.stride(-2) != b.head_dim or not kv_cache[0].is_contiguous():
            raise ValueError("the native attention kernel needs q rows of contiguous heads and a contiguous hot layer")
        out = torch.empty(q.shape, dtype=q.dtype)
        wk = wv = 0
        wstride = 0
        if warm_cache is not None and b.spilled:
            wk = warm_cache.data_ptr()
            wv = warm_cache[:, 1].data_ptr()
            wstride = warm_cache.stride(0)
        qo, lens, indptr, pages, nwarm = (a.ctypes.data for a in self._arrays)
        k, v = kv_cache[0], kv_cache[1]
        rc = self.fn(q.data_ptr(), q.stride(0), out.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                     wk, wv, wstride, b.num_seqs, qo, lens, indptr, pages, nwarm,
                     b.num_qo_heads, b.num_kv_heads, b.head_dim, b.page_size, self.scale, torch.get_num_threads())
        if rc:
            raise NotBuilt(f"the native attention kernel refused head_dim {b.head_dim}")
        return out


def main() -> int:
    """`python -m engine.attention.native`: build the kernel (if needed) and say where it is."""
    return report("native attention kernel", build)


if __name__ == "__main__":
    raise SystemExit(main())

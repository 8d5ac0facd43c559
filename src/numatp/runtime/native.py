"""numatp's C++ library, compiled on first use with the compiler torch.compile's C++ backend uses.

Six sources beside this file make one shared library: ``collective.cpp`` (the sockets' barrier and
all-reduce, plain C functions that :mod:`numatp.runtime.collective` calls through ``ctypes``),
``ops.cpp`` (dispatcher ops that compiled segments call from their C++ wrapper without the GIL:
``numatp::linear``, the GEMM providers, ``numatp::socket_all_reduce``, the collective itself, and
``numatp::decode_attention``; and ``numatp::linear_into``, ``numatp::mkl_pack`` and ``numatp::amx_pack``,
which the executor and the GEMM providers call), ``gemv.cpp`` (numatp's own kernel for a decode step's few
rows, one of those providers), ``amx.cpp`` (its bf16 kernel on AMX tiles, another), ``quant.cpp`` (its
kernels over quantized weights: a GEMV and the dequantizing of tiles, for more providers) and
``attention.cpp`` (a decode step's single-query attention); ``vec.h`` is the vectors the kernels share. It is built
with torch's headers, ABI and libraries (as torch's own C++ extensions are) into
``~/.cache/numatp/ext/``, keyed by the sources, the compiler, the flags, this CPU and the torch build, so
a new CPU or torch builds again (about 15 s: the sources compile at once, ops.cpp's torch headers take
most of it); a build writes a temporary file renamed into place, so processes building at once never
load half a library. ``ctypes`` and ``torch.ops.load_library`` open the same file, hence the same code
and the same per-thread state.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from numatp._cache import cache_dir
from numatp.topology.resources import cpu_signature

__all__ = ["compiler", "build", "library_path", "load_ops"]

_HERE = Path(__file__).parent
SOURCES = ("collective.cpp", "ops.cpp", "gemv.cpp", "quant.cpp", "attention.cpp", "amx.cpp")
HEADERS = ("vec.h",)
_lock = threading.Lock()
_path: Path | None = None
_ops_loaded = False


def compiler() -> str:
    """The C++ compiler: Inductor's choice, else the first of g++, c++, clang++ on PATH."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        found = shutil.which(get_cpp_compiler())
    except Exception:  # noqa: BLE001  (an Inductor without this helper: look on PATH)
        found = None
    for name in (found, "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise RuntimeError("numatp's C++ runtime is compiled on first use and needs a C++ compiler, the "
                       "same one torch.compile's C++ backend needs: none found (g++, c++, clang++) on PATH; "
                       "install one (Debian/Ubuntu: apt-get install g++) or point $CXX at it")


def build(sources: tuple[str, ...] = SOURCES) -> Path:
    """The shared library compiled from ``sources`` (files beside this module)."""
    srcs = [_HERE / s for s in sources]
    cxx = compiler()
    flags, libs = _flags()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(b"".join(s.read_bytes() for s in [*srcs, *(_HERE / h for h in HEADERS)])
                         + repr((cxx, version, flags, libs, cpu_signature())).encode())
    folder = cache_dir() / "ext"
    target = folder / f"numatp-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        # each source to an object at once (the sources' compile times add up otherwise: ops.cpp alone
        # takes most of it, for torch's headers), then one link into a file renamed into place
        objects = [Path(work) / f"{src.stem}.o" for src in srcs]
        compiling = [(src, subprocess.Popen([cxx, *flags, "-c", str(src), "-o", str(obj)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                     for src, obj in zip(srcs, objects)]
        failed = [(src, err) for src, proc in compiling
                  for _, err in [proc.communicate()] if proc.returncode != 0]   # all finish first
        if failed:
            src, err = failed[0]
            raise RuntimeError(f"numatp: compiling {src.name} with {cxx} failed:\n{err[-4000:]}")
        tmp = Path(work) / target.name
        proc = subprocess.run([cxx, "-shared", *map(str, objects), "-o", str(tmp), *libs],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"numatp: linking {', '.join(sources)} with {cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)   # atomic: another process building the same key at once finds a whole file
    return target


def _flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Compiler flags and libraries: optimised for this CPU, OpenMP (torch's runtime, already loaded),
    torch's include folders, C++ standard and ABI, linked to libc10 and libtorch_cpu."""
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    flags = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-isystem{p}" for p in include_paths()))
    return flags, (f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu")


def library_path() -> Path:
    """The library, built once per process (and once per sources, compiler and CPU on disk)."""
    global _path
    with _lock:
        if _path is None:
            _path = build()
        return _path


def load_ops() -> None:
    """Register ``numatp::linear``, ``numatp::linear_into``, ``numatp::mkl_pack``, ``numatp::amx_pack``,
    ``numatp::amx_usable``, ``numatp::socket_all_reduce``, ``numatp::decode_attention`` and
    ``numatp::qembedding`` with torch, and their shape functions."""
    global _ops_loaded
    path = library_path()
    with _lock:
        if _ops_loaded:
            return
        torch.ops.load_library(str(path))

        @torch.library.register_fake("numatp::linear")
        def _(x, w, bias, provider, n, k):
            return x.new_empty((x.shape[0], n))

        @torch.library.register_fake("numatp::linear_into")
        def _(x, w, bias, provider, n, k, out):
            return None

        @torch.library.register_fake("numatp::mkl_pack")
        def _(w, m, node=-1):
            raise RuntimeError("numatp::mkl_pack packs a real weight; it has no shape function")

        @torch.library.register_fake("numatp::amx_pack")
        def _(w, node=-1):
            raise RuntimeError("numatp::amx_pack packs a real weight; it has no shape function")

        @torch.library.register_fake("numatp::socket_all_reduce")
        def _(x, after):
            return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(1)

        @torch.library.register_fake("numatp::decode_attention")
        def _(q, k, v, mask, scale):
            return q.new_empty(q.shape)

        @torch.library.register_fake("numatp::qembedding")
        def _(buf, ids, k, dtype):
            return ids.new_empty((*ids.shape, k), dtype=dtype)

        _ops_loaded = True

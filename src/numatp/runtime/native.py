"""numatp's C++ parts, compiled on first use with the compiler torch.compile's C++ backend uses.

Two sources ship beside this file: ``collective.cpp`` (the sockets' barrier and all-reduce, a plain
shared library loaded with ``ctypes``) and ``gemm_ops.cpp`` (``numatp::linear``, the GEMM providers as a
dispatcher op that compiled segments call without the GIL, linked against torch and loaded with
``torch.ops.load_library``). Each is built once into ``~/.cache/numatp/ext/``, keyed by its source, the
compiler, the flags, this CPU and the torch build, so a new CPU or torch builds again; a build writes a
temporary file renamed into place, so processes building at once never load half a library.
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

__all__ = ["compiler", "build", "load_gemm_ops"]

_HERE = Path(__file__).parent
_lock = threading.Lock()
_gemm_ops_loaded = False


def compiler() -> str:
    """The C++ compiler: Inductor's choice, else the first of g++, c++, clang++ on PATH."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        found = shutil.which(get_cpp_compiler())
    except Exception:  # noqa: BLE001  (an Inductor without this helper: look on PATH)
        found = None
    for name in (found, "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("numatp's C++ runtime is compiled on first use and needs a C++ compiler, the "
                       "same one torch.compile's C++ backend needs: none found (g++, c++, clang++) on PATH; "
                       "install one (Debian/Ubuntu: apt-get install g++) or point $CXX at it")


def build(source: str, flags: tuple[str, ...], libs: tuple[str, ...] = ()) -> Path:
    """The shared library compiled from ``source`` (a file beside this module) with ``flags``, linked
    with ``libs`` (which follow the source on the command line)."""
    from numatp.runtime.gemm import cpu_signature

    src = _HERE / source
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(src.read_bytes() + repr((cxx, version, flags, libs, cpu_signature())).encode())
    folder = cache_dir() / "ext"
    target = folder / f"{src.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    proc = subprocess.run([cxx, *flags, str(src), "-o", tmp, *libs], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"numatp: compiling {src.name} with {cxx} failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, target)   # atomic: another process building the same key at once finds a whole file
    return target


def _with_torch() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Compiler flags and libraries for a source that includes torch's headers (as torch's own C++
    extensions are built: its include folders, its C++ standard and ABI, linked to libc10/libtorch_cpu)."""
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    flags = ("-O2", "-shared", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-isystem{p}" for p in include_paths()))
    return flags, (f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu")


def load_gemm_ops() -> None:
    """Register ``numatp::linear`` (built on first use, a few seconds) and its shape function."""
    global _gemm_ops_loaded
    with _lock:
        if _gemm_ops_loaded:
            return
        torch.ops.load_library(str(build("gemm_ops.cpp", *_with_torch())))

        @torch.library.register_fake("numatp::linear")
        def _(x, w, bias, provider, n, k):
            return x.new_empty((x.shape[0], n))

        _gemm_ops_loaded = True

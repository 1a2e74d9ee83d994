"""Send mlx's one-row float32 matrix products to the BLAS's matrix-vector routine (Linux CPUs).

mlx calls ``cblas_sgemm`` for every float32 product, also for the single row a one-stream decode step
multiplies by each weight matrix. OpenBLAS's ``sgemm`` is 2.5x slower at that shape than its ``sgemv``
(bench/RESULTS.md). :func:`install` compiles ``gemv.c`` once with the system's C compiler into the cache
folder, hands it the BLAS's own ``cblas_sgemm`` and ``cblas_sgemv``, and makes it global before the BLAS,
so that libmlx's ``cblas_sgemm`` binds to it. Without a C compiler nothing changes but the speed.
Called by :mod:`mlxpipe.blas` only, before mlx is imported; imports nothing from mlx.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .models import cache_dir

__all__ = ["ENV", "install"]

ENV = "MLXPIPE_GEMV"
_OFF = {"off", "0", "no", "false", "none"}
_SOURCE = Path(__file__).with_name("gemv.c")


def install(blas: Any) -> str:
    """Put the forwarding ``cblas_sgemm`` in front of ``blas`` (a ctypes library loaded RTLD_LOCAL).

    Returns what was done, for ``--model-info``. The caller must load ``blas`` globally afterwards. Never
    raises: any failure leaves mlx calling the BLAS's own ``sgemm``.
    """
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in _OFF:
        return f"off ({ENV}={setting})"
    try:
        sgemm = ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p)
        sgemv = ctypes.cast(blas.cblas_sgemv, ctypes.c_void_p)
    except AttributeError:
        return "not used: the BLAS has no cblas_sgemm/cblas_sgemv"
    try:
        path = _built()
        shim = _open(path, ctypes.RTLD_LOCAL)
        if not shim.mlxpipe_gemv_init(sgemm, sgemv):
            return "not used: the BLAS's functions could not be found"
        _open(path, ctypes.RTLD_GLOBAL)  # promoted now, so it comes before the BLAS in the global scope
    except (OSError, subprocess.SubprocessError, AttributeError, RuntimeError) as exc:
        # RuntimeError: the cache folder is under the home folder, and there is none.
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"not built: {first}"
    return "one-row products go to sgemv"


def _open(path: str, mode: int) -> Any:
    return ctypes.CDLL(path, mode=mode)


def _built() -> str:
    """The compiled library's path, compiling it first if this source has not been compiled here yet."""
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv-{key}.so"
    if target.is_file():
        return str(target)
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside the target and renamed into place: concurrent first runs never see half a file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".gemv-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(_SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise OSError(f"{Path(compiler).name} failed: {done.stderr.strip() or done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(target)

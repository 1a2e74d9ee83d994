"""Give mlx an optimized BLAS on Linux CPUs, loaded before mlx is imported.

The Linux ``mlx-cpu`` wheel bundles the reference (netlib) BLAS, 11-14x slower than OpenBLAS here at float32
products of several rows (bench/RESULTS.md, r-blas). Loading a BLAS that exports the same symbol names into
the global namespace *before* ``import mlx.core`` makes mlx's matmuls resolve to it. :func:`setup` does that,
once, and records why it did or did not, for ``--model-info``. It imports nothing from mlx.

Decision, in order:

- ``MLXPIPE_BLAS=off`` (or 0/no/false/none): load nothing. ``MLXPIPE_BLAS=/path/lib.so``: load that library.
- Not Linux (macOS uses Accelerate; Windows is out of scope): load nothing.
- mlx already imported: too late, load nothing.
- mlx's own BLAS is not the reference one: load nothing. Detected without importing mlx: the Linux wheels are
  repaired by auditwheel, which vendors the netlib ``libblas`` as ``mlx*.libs/libblas-<hash>.so*`` next to
  the ``mlx`` package; a build of mlx against an optimized BLAS has no such file.
- mlx's CUDA backend is installed (``mlx-cuda-13``/``-12``, the ``cuda13``/``cuda12`` extras): load nothing;
  its wheel bundles the reference BLAS as well, but the matrix products run on the GPU.
- Otherwise the first of these that loads and runs on this CPU: ``cmeel-openblas``'s ``libopenblas.so.0``
  (the ``cpu`` extra installs it; it needs the system's gfortran runtime, ``libgfortran.so.5``, and its x86-64
  build is for AVX-512 CPUs only), then ``scipy-openblas32``'s (also in the extra: built for every CPU, no
  gfortran; its functions are named ``scipy_cblas_sgemm`` and so on, so mlx reaches it only through the
  forwarding ``cblas_sgemm`` below, which needs a C compiler), then a system ``libopenblas``. A library built
  for one CPU family (OpenBLAS's ``TARGET``) is skipped where this CPU lacks its instructions: it would die
  with SIGILL in its first product.

In front of a BLAS it loads, :mod:`mlxpipe.cpu.gemv` puts a ``cblas_sgemm`` that sends one-row products to
``sgemv`` (``MLXPIPE_GEMV=off`` leaves it out).

When a fast path is missing for a reason the user can fix (no BLAS would load, the kernels could not be
built), :func:`slow_paths` says so in one line each, with the loader's or compiler's own message and the fix;
the command line prints them once when a run starts. :func:`use_threads` sets OpenBLAS's threads per run:
one for a single stream, the library's own count for a batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import first_line
from ..switches import setting, turned_off_by
from . import gemv

__all__ = ["ENV", "BlasChoice", "choose", "setup", "slow_paths", "threads", "use_threads"]

ENV = "MLXPIPE_BLAS"

# Libraries whose functions carry a prefix (scipy_cblas_sgemm): mlx binds cblas_sgemm by name, so only the
# forwarding cblas_sgemm of mlxpipe.cpu.gemv can send it there.
_PREFIXES = {"scipy-openblas32": "scipy_"}
_THROUGH_FORWARDING = "reached only through mlxpipe's cblas_sgemm"
_WHICH_WAS = ", which was "  # then what gemv.install returned
# What an OpenBLAS built for one TARGET (not DYNAMIC_ARCH) needs of an x86-64 CPU, as /proc/cpuinfo names it.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")
_TARGET_NEEDS = {
    "SKYLAKEX": _AVX512,
    "COOPERLAKE": (*_AVX512, "avx512_bf16"),
    "SAPPHIRERAPIDS": (*_AVX512, "avx512_bf16"),
    "HASWELL": ("avx2", "fma"),
    "ZEN": ("avx2", "fma"),
    "SANDYBRIDGE": ("avx",),
}

# Where Debian/Ubuntu, Fedora and Arch put OpenBLAS (the pthread build first: it is the fast default).
_SYSTEM_PATTERNS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasChoice:
    """What :func:`setup` decided: the library loaded (None if none) and why."""

    library: str | None
    source: str  # cmeel-openblas, system, MLXPIPE_BLAS, or "mlx" when mlx's own BLAS is used
    reason: str
    config: str | None = None  # OpenBLAS's own description (version, kernel)
    failed: tuple[str, ...] = field(default=())  # candidates that would not load, with the loader's message
    reference: bool = False  # mlx computes with the reference BLAS it bundles (slow float32 matmuls)
    gemv: str | None = None  # what mlxpipe.cpu.gemv did in front of the loaded library
    missing: bool = False  # an optimized BLAS was wanted and none would load: the user can fix that

    def info(self) -> dict[str, Any]:
        """The ``blas`` entry of ``--model-info``."""
        out: dict[str, Any] = {"library": self.library, "source": self.source, "reason": self.reason}
        out["reference_blas"] = self.reference
        if self.config:
            out["config"] = self.config
        if self.failed:
            out["failed"] = list(self.failed)
        if self.gemv:
            out["gemv"] = self.gemv
        return out


_choice: BlasChoice | None = None


def setup() -> BlasChoice:
    """Decide and load the BLAS once per process (later calls return the first decision). Never raises."""
    global _choice
    if _choice is None:
        _choice = choose()
    return _choice


def choose() -> BlasChoice:
    """Decide and, if it is worth it, load a BLAS now; :func:`setup` is the cached entry point."""
    value = setting(ENV)
    if _platform() != "linux":
        return BlasChoice(None, "mlx", f"not Linux ({_platform()}): mlx's own BLAS")
    reference = _reference_blas()
    if off := turned_off_by(ENV):
        return BlasChoice(None, "mlx", f"turned off by {off}", reference=reference is not None)
    if _mlx_imported():
        reason = "mlx was imported before mlxpipe could load a BLAS"
        return BlasChoice(None, "mlx", reason, reference=reference is not None)
    if value and value.lower() != "auto":
        return _load_first([(ENV, value)], reference)
    if reference is None:
        return BlasChoice(None, "mlx", "mlx does not bundle the reference BLAS: its own BLAS is used")
    cuda = _cuda_backend()
    if cuda is not None:  # its wheel bundles the reference BLAS too, but the matrix products run on the GPU
        return BlasChoice(None, "mlx", f"{cuda}: matrix products run on the GPU", reference=True)
    return _load_first(_candidates(), reference)


def _load_first(candidates: list[tuple[str, str]], reference: str | None) -> BlasChoice:
    failed: list[tuple[str, str, str]] = []  # (source, path, the loader's message)
    for source, path in candidates:
        try:
            handle, config = opened(source, path)
        except OSError as exc:
            failed.append((source, path, first_line(exc)))
            continue
        prefix = _PREFIXES.get(source, "")
        forwarding = gemv.install(handle)  # global before the BLAS, so libmlx binds to its cblas_sgemm
        if prefix and forwarding != gemv.FORWARDING:
            why = f"{_THROUGH_FORWARDING} (its functions are named {prefix}cblas_*){_WHICH_WAS}{forwarding}"
            failed.append((source, path, why))
            continue
        _load(path, ctypes.RTLD_GLOBAL)
        _set_threads(handle)
        return BlasChoice(path, source, "loaded before mlx", config, _said(failed), gemv=forwarding)
    return BlasChoice(
        None, "mlx", _none_loaded(failed), None, _said(failed), reference=reference is not None, missing=True
    )


def opened(source: str, path: str) -> tuple[Any, str | None]:
    """The library at ``path`` loaded RTLD_LOCAL, its functions found by their plain names, and OpenBLAS's
    description of it. Raises OSError when it will not load, or was built for CPUs this one is not."""
    handle = _load(path, ctypes.RTLD_LOCAL)
    prefix = _PREFIXES.get(source, "")
    if prefix:
        handle = _Prefixed(handle, prefix)
    config = _openblas_config(handle)
    lacking = _cpu_lacks(config)
    if lacking:
        raise OSError(lacking)
    return handle, config


def _said(failed: list[tuple[str, str, str]]) -> tuple[str, ...]:
    return tuple(f"{path}: {message}" for _, path, message in failed)


def _none_loaded(failed: list[tuple[str, str, str]]) -> str:
    """Why no optimized BLAS is in use, from what the loader said, with the fix where it is known."""
    if not failed:
        return "no optimized BLAS is installed (pip install 'mlxpipe[cpu]', which brings cmeel-openblas)"
    # A library that loads and runs here but needs the forwarding is the one worth fixing, else the first.
    forwarded = [f for f in failed if f[2].startswith(_THROUGH_FORWARDING)]
    if forwarded:
        source, _, message = forwarded[0]
        return f"{source} is {message}; {_forwarding_fix(message.partition(_WHICH_WAS)[2])}"
    source, _, message = failed[0]  # the best candidate: the one worth fixing
    what = f"{source} would not load ({message})"
    if "libgfortran" in message:  # cmeel-openblas links to the system's gfortran runtime
        return f"{what}: install the gfortran runtime (Debian/Ubuntu: apt-get install libgfortran5)"
    if message.startswith("built for "):
        return f"{what}: pip install scipy-openblas32 (built for every CPU; needs a C compiler)"
    return what


def slow_paths(choice: BlasChoice | None = None) -> list[str]:
    """What makes float32 products on this CPU slower than they could be, for reasons the user can fix: one
    line each, with the cause and the fix (empty when nothing does). ``choice``: :func:`setup`'s, by default.

    Not listed: paths turned off on purpose (``MLXPIPE_BLAS=off``, ``MLXPIPE_GEMV=off``), and a BLAS that
    is not needed (not Linux, mlx's own BLAS is optimized, the GPU computes).
    """
    choice = choice or setup()
    if choice.missing:
        slower = "11-14x slower for batches and prompts"
        return [f"float32 matrix products run on mlx's reference BLAS, {slower}: {choice.reason}"]
    if choice.gemv and choice.gemv.startswith("not built: "):
        cause, fix = choice.gemv.removeprefix("not built: "), _forwarding_fix(choice.gemv)
        return [
            f"one-row products are not sent to sgemv, a single stream decodes about 3x slower: {cause}; {fix}"
        ]
    return []


def _forwarding_fix(forwarding: str) -> str:
    """What to do about the forwarding ``cblas_sgemm`` not being in front, from what gemv.install said."""
    if forwarding.startswith(f"not built: {gemv.NO_COMPILER}"):
        return "install a C compiler (Debian/Ubuntu: apt-get install gcc)"
    if forwarding.startswith("not built: "):
        return gemv.build_fix() or "it is tried again once the compiler or mlxpipe changes"
    if forwarding.startswith(f"off ({gemv.ENV}="):
        return f"unset {gemv.ENV}"
    return "see --model-info"


# The probes below are separate functions so that tests can replace each one.


def _platform() -> str:
    return sys.platform


def _mlx_imported() -> bool:
    return "mlx.core" in sys.modules


def _load(path: str, mode: int) -> Any:
    # Loaded RTLD_LOCAL first, then again RTLD_GLOBAL (which promotes it): mlx's libmlx.so then binds its
    # cblas_* symbols to this library, or to a global library loaded before it.
    return ctypes.CDLL(path, mode=mode)


cpu_flags = gemv.cpu_flags  # (this module's name for it: the tests replace it here)


def _cpu_lacks(config: str | None) -> str | None:
    """Why an OpenBLAS described by ``config`` cannot run here (None when it can, or when nobody can tell).

    A ``DYNAMIC_ARCH`` build picks its kernels at run time; one built for a single ``TARGET`` uses its
    instructions everywhere and dies with SIGILL on a CPU without them.
    """
    words = (config or "").split()
    if "DYNAMIC_ARCH" in words:
        return None
    target = next((word for word in words if word.upper() in _TARGET_NEEDS), None)
    flags = cpu_flags()
    if target is None or flags is None:
        return None
    missing = [flag for flag in _TARGET_NEEDS[target.upper()] if flag not in flags]
    if not missing:
        return None
    return f"built for {target} CPUs only; this CPU lacks {', '.join(missing)}"


class _Prefixed:
    """A library whose functions all carry ``prefix``, looked up by their plain names."""

    def __init__(self, library: Any, prefix: str) -> None:
        self._library, self._prefix = library, prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._library, self._prefix + name)


def _reference_blas() -> str | None:
    """The reference BLAS vendored into the mlx wheel, if any (found from file names; mlx is not imported)."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return _vendored_reference_blas(list(spec.submodule_search_locations))


def _vendored_reference_blas(package_dirs: list[str]) -> str | None:
    # auditwheel puts a wheel's bundled libraries in <dist>.libs beside the package, names hashed.
    for location in package_dirs:
        libs = sorted(glob.glob(os.path.join(os.path.dirname(location), "mlx*.libs", "libblas*.so*")))
        if libs:
            return libs[0]
    return None


def _cuda_backend() -> str | None:
    """The installed mlx CUDA backend's distribution name (mlx-cuda-13, mlx-cuda-12), if any."""
    for name in ("mlx-cuda-13", "mlx-cuda-12"):
        if _installed(name):
            return name
    return None


def _installed(distribution: str) -> list[str]:
    """The folders on ``sys.path`` holding ``distribution``'s metadata (what importlib.metadata finds, without
    its import: ~20-40 ms of every start)."""
    name = distribution.replace("-", "_")
    entries = [entry or "." for entry in sys.path]
    return [e for e in entries if glob.glob(os.path.join(glob.escape(e), f"{name}-*.dist-info"))]


def _candidates() -> list[tuple[str, str]]:
    """Optimized BLAS libraries present on this machine, best first: (source, path)."""
    found: list[tuple[str, str]] = []
    for entry in _installed("cmeel-openblas"):  # cmeel's wheels install their libraries under cmeel.prefix
        path = Path(entry, "cmeel.prefix", "lib", "libopenblas.so.0")
        if path.is_file():
            found.append(("cmeel-openblas", str(path)))
            break
    for entry in _installed("scipy-openblas32"):
        path = Path(entry, "scipy_openblas32", "lib", "libscipy_openblas.so")
        if path.is_file():
            found.append(("scipy-openblas32", str(path)))
            break
    for pattern in _SYSTEM_PATTERNS:
        found += [("system", p) for p in sorted(glob.glob(pattern))]
    if not any(source == "system" for source, _ in found):
        name = ctypes.util.find_library("openblas")  # asks ldconfig; only when the usual paths had nothing
        if name:
            found.append(("system", name))
    return found


# Threads: one for a single stream (a second one only spins, and collapses decoding beside a busy process),
# and for batches whose products the quantized kernels compute (their helper thread sleeps and steps aside
# beside a busy process; OpenBLAS keeps long prompts); else OpenBLAS's default for batches; one per rank
# under a launcher; the user's OPENBLAS_NUM_THREADS wins.
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
_LAUNCHER_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_library: Any = None  # the OpenBLAS loaded by setup(), if any
_library_threads: int | None = None  # its thread count after loading: the default for batched work


def default_threads(batch: int | None = None) -> int | None:
    """The OpenBLAS thread count mlxpipe sets for ``batch`` records decoding together (``None``: not known
    yet), or ``None`` to keep the count the library started with."""
    if any(os.environ.get(name) for name in _THREAD_VARS):
        return None
    if any(name in os.environ for name in _LAUNCHER_VARS):
        return 1
    return 1 if batch == 1 or gemv.attached() else None


def use_threads(batch: int) -> None:
    """Set the loaded OpenBLAS's threads for ``batch`` records decoding together (:func:`default_threads`),
    and the quantized kernels' (:func:`.gemv.use_threads`): a helper, unless one thread is all the user or
    the launcher allows."""
    if _library is None:
        return
    threads = default_threads(batch) or _library_threads
    if threads:
        with contextlib.suppress(AttributeError):
            _library.openblas_set_num_threads(ctypes.c_int(threads))
    user = default_threads(None) is None and _library_threads == 1  # OPENBLAS_NUM_THREADS=1 and the like
    launched = any(name in os.environ for name in _LAUNCHER_VARS)
    # One stream's decode steps are one-row products (the helper never joins those): it reads prompts only.
    gemv.use_threads(1 if user or launched else 2)


def threads() -> int | None:
    """The loaded OpenBLAS's thread count now, for ``--model-info``; ``None`` without one."""
    try:
        return int(_library.openblas_get_num_threads()) if _library is not None else None
    except AttributeError:
        return None


def _set_threads(handle: Any) -> None:
    global _library, _library_threads
    threads = default_threads()
    if threads is not None:
        with contextlib.suppress(AttributeError):  # not OpenBLAS: leave the library's own default
            handle.openblas_set_num_threads(ctypes.c_int(threads))
    _library = handle
    try:
        _library_threads = int(handle.openblas_get_num_threads())
    except AttributeError:
        _library_threads = None


def _openblas_config(handle: Any) -> str | None:
    try:
        get_config = handle.openblas_get_config
    except AttributeError:
        return None
    get_config.restype = ctypes.c_char_p
    return (get_config() or b"").decode(errors="replace").strip()

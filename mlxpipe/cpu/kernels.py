"""Products by quantized matrices as an mlx operation on a CPU, from the quantized bytes alone.

``kernels.cpp`` defines an mlx operation (a ``Primitive`` with ``eval_cpu``) that hands a product to
gemv.c's kernels for a matrix registered there (:class:`Matrix`): the model keeps its quantized weights as
the only copy, and mlx's graph sees the product like any other operation (lazy, ``async_eval``). It is
compiled once into the cache with the system's C++ compiler against the installed mlx wheel (its headers and
``libmlx``) and nanobind (the ``cpu`` extra's), which must share that mlx's nanobind ABI: a mismatch is
caught before use. Without a compiler, a matching nanobind or gemv.c's kernels :func:`available` is False,
and the engine dequantizes as before (and says so once).
``MLXPIPE_KERNELS=off`` turns it off.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import json
import mmap
import subprocess
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx

from .. import cachefiles
from ..errors import first_line
from ..paths import cache_dir
from ..switches import turned_off, turned_off_by
from . import gemv

__all__ = [
    "ENV",
    "Matrix",
    "PackedFile",
    "Part",
    "available",
    "build_fix",
    "layout",
    "load",
    "product",
    "release_with",
]

ENV = "MLXPIPE_KERNELS"
SWIGLU = 1  # gemv.c's PRODUCT_SWIGLU: the product's two halves become silu(gate) * up
_SOURCE = Path(__file__).with_name("kernels.cpp")
_NAME = "_mlxpipe_kernels"
_module: Any = None
_state: str | None = None  # what load() found, once it has run
_fix = ""  # what to do about a module load() could not build or import


def load() -> str:
    """Build (once) and import the operation; what happened, for ``--model-info``. Never raises."""
    global _module, _state, _fix
    if _state is not None:
        return _state
    if turned_off(ENV):
        _state = f"off ({turned_off_by(ENV)})"
    elif not gemv.quantized_available():
        _state = "not used: gemv.c's quantized kernels do not run here"
    else:
        try:
            module = _imported(_built())
            _check(module)
            _module, _state = module, "quantized products by mlxpipe's kernels"
        except cachefiles.BuildError as exc:  # cause and fix apart, as gemv.install keeps them
            _state, _fix = f"not built: {exc.cause}", exc.fix
        except ImportError as exc:  # no nanobind, or one of another ABI than mlx's
            _state, _fix = f"not built: {first_line(exc)}", "pip install 'mlxpipe[cpu]' (its nanobind)"
        except (OSError, subprocess.SubprocessError, RuntimeError, TypeError, ValueError) as exc:
            _state = f"not built: {first_line(exc)}"
    return _state


def build_fix() -> str:
    """The fix for the failure :func:`load` reported ("not built: ..."), where it knows one."""
    return _fix


def layout() -> str:
    """What names the layout of the packed copies (gemv.c's source): part of a :class:`PackedFile`'s name."""
    return hashlib.sha256(gemv.source().read_bytes()).hexdigest()[:12]


def available() -> bool:
    """Whether products by :class:`Matrix` run here (:func:`load` built and imported the operation)."""
    load()
    return _module is not None


class Matrix:
    """A quantized matrix registered with gemv.c's kernels: ``q``, ``scales``, ``biases`` in mlx's affine
    layout (``w = scales * q + biases`` per group of ``group_size``), n x k. Its arrays are held here (the
    kernels read them in place) and passed to every product so that mlx keeps them while it is pending."""

    def __init__(
        self, handle: int, key: int, arrays: tuple[Any, ...], n: int, k: int, mapped: object = None
    ) -> None:
        self.handle, self.key, self.arrays, self.n, self.k = handle, key, arrays, n, k
        self.mapped = mapped  # the PackedFile whose mapping holds its copy, kept while it is

    @classmethod
    def register(cls, q: Any, scales: Any, biases: Any, bits: int, group_size: int) -> Matrix | None:
        """The registered matrix; None where the kernels do not take this form (bits, group size)."""
        if not available():
            return None
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)  # (float32: the C side's)
        mx.eval(q, scales, biases)
        found = gemv.register(q, scales, biases, bits, group_size)
        if found is None:
            return None
        handle, key = found
        n, k = int(q.shape[0]), int(q.shape[1]) * 32 // bits
        return cls(handle, key, (q, scales, biases), n, k)

    def pack_only(self) -> bool:
        """Make the kernels' packed copy of this matrix its only one, where the integer products run: the
        source arrays are let go (the caller frees its own). Whether it did."""
        if not gemv.pack(self.handle, self.key, only=True):
            return False
        self.arrays = ()
        return True


class PackedFile:
    """The kernels' packed copies of a model's matrices kept in one file between runs (``path``), mapped
    instead of read and repacked: a run opens a model in about the time it takes to map it.

    Layout: each copy 64-byte aligned, then a JSON index (name → offset, size, the copy's form, the matrix's
    form), its length and a magic, written last (a file cut short or of another layout has neither and is made
    again).
    """

    MAGIC = b"MLXPPK01"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index: dict[str, list[Any]] = {}
        self._map: Any = None
        self._base = 0
        self.made: dict[str, tuple[int, int, int, list[int]]] = {}  # copies packed in this run: to keep
        try:
            why = cachefiles.check_file(path)  # size, mtime and ends as its manifest says: else made again
            if why is not None:
                raise ValueError(why)
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
            tail = self._map[-16:]
            length = int.from_bytes(tail[:8], "little")
            if tail[8:] != self.MAGIC or length > len(self._map) - 16:
                raise ValueError("not a complete file of packed copies")
            index = json.loads(self._map[len(self._map) - 16 - length : len(self._map) - 16])
            self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            self.index = index
        except (OSError, ValueError):
            self.index = {}

    def adopt(self, name: str, form: list[int]) -> Matrix | None:
        """The matrix ``name`` (``form``: n, k, bits, group size) from its kept copy; None when not kept."""
        entry = self.index.get(name)
        if entry is None or entry[3] != form:
            return None
        offset, size, packing = entry[:3]
        found = gemv.adopt((form[0], form[1]), form[2], form[3], self._base + offset, size, packing)
        return None if found is None else Matrix(found[0], found[1], (), form[0], form[1], self)

    def remember(self, name: str, matrix: Matrix, form: list[int]) -> None:
        """Keep ``matrix``'s packed copy (made now where it is not yet) for :meth:`write`."""
        found = gemv.packed(matrix.handle)
        if found is not None:
            self.made[name] = (*found, form)

    def write(self) -> None:
        """Write every copy this run packed (with those it adopted) to the file, atomically; a cache that
        cannot be written is only slower next time."""
        if not self.made:
            return
        index: dict[str, list[Any]] = {}
        try:
            with cachefiles.scratch(self.path.parent) as room:  # removed on the way out, or by the next run
                tmp = room / self.path.name
                with open(tmp, "wb") as f:
                    kept = [(n, self._base + e[0], e[1], e[2], e[3]) for n, e in self.index.items()]
                    made = [(n, *e) for n, e in self.made.items()]
                    for name, address, size, packing, form in [*kept, *made]:
                        f.write(b"\0" * (-f.tell() % 64))
                        index[name] = [f.tell(), size, packing, form]
                        f.write(ctypes.string_at(address, size))
                    data = json.dumps(index).encode()
                    f.write(data + len(data).to_bytes(8, "little") + self.MAGIC)
                cachefiles.publish_file(tmp, self.path, {"magic": self.MAGIC.decode()}, whole=False)
            self._drop_other_layouts()
        except OSError:
            pass

    def _drop_other_layouts(self) -> None:
        """Remove this model's files of other layouts (an older mlxpipe's): never mapped again, they only
        take disk (an 8B model's are ~5 GB)."""
        prefix = self.path.name.split(".packed-")[0] + ".packed-"
        for other in self.path.parent.glob(glob.escape(prefix) + "*"):
            if other.name not in (self.path.name, self.path.name + ".sum"):
                other.unlink(missing_ok=True)


class Part:
    """Rows ``start`` to ``stop`` of a registered matrix (a fused projection's part): its products are those
    rows of the whole's, the same numbers (each row's sums depend on that row alone)."""

    def __init__(self, whole: Matrix, start: int, stop: int) -> None:
        self.whole, self.start, self.stop = whole, start, stop


def product(x: mx.array, matrix: Matrix | Part, swiglu: bool = False) -> mx.array:
    """``x @ W.T`` (float32) for ``matrix`` W; with ``swiglu`` (W: a gate's rows, then up's), ``silu(gate) *
    up`` of that product, in float32 by :func:`mlxpipe.cpu.layers.swiglu`'s operations."""
    if isinstance(matrix, Part):
        return product(x, matrix.whole)[..., matrix.start : matrix.stop]
    width = matrix.n // 2 if swiglu else matrix.n
    out: mx.array = _module.product(
        x, gemv.product_address(), matrix.handle, width, SWIGLU * swiglu, matrix.arrays
    )
    return out


def release_with(owner: object, matrices: Iterable[Matrix], settle: Callable[[], None]) -> None:
    """Unregister ``matrices`` once ``owner`` is gone (after ``settle``: products may still be pending)."""
    keys = [m.key for m in matrices]
    mapped = {id(m.mapped): m.mapped for m in matrices if m.mapped is not None}
    if keys:  # (the mapped files of kept copies held until then: a pending product may read them)
        weakref.finalize(owner, _release, keys, settle, list(mapped.values()))


def _release(keys: list[int], settle: Callable[[], None], mapped: list[object]) -> None:
    gemv.unregister(keys, settle)
    mapped.clear()


def _check(module: Any) -> None:
    """Raise ImportError when the module does not take mlx's arrays (a nanobind of another ABI than mlx's)."""
    try:
        module.product(mx.zeros((1, 1)), 0, 0, 0, 0, [])
    except TypeError:
        import nanobind

        raise ImportError(
            f"nanobind {nanobind.__version__} does not match mlx {getattr(mx, '__version__', '')}'s: "
            "install the nanobind that mlx was built with"
        ) from None


def _imported(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built() -> str:
    """The compiled module's path, compiling it first where this source, mlx and nanobind have not been
    compiled here yet (:func:`mlxpipe.cachefiles.build`: checked before it is imported, a damaged one built
    again). Raises OSError when it cannot be built (remembered per compiler, like gemv.c's)."""
    import nanobind  # a build requirement only: imported here, not at start-up

    mlx_dir = Path(mx.__file__).resolve().parent
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    inputs = (
        _SOURCE.read_bytes()
        + f"{getattr(mx, '__version__', '')}:{nanobind.__version__}:{suffix}:{mlx_dir}".encode()
    )
    key = hashlib.sha256(inputs).hexdigest()[:16]
    target = cache_dir() / f"kernels-{key}{suffix}"
    made_from = {
        "source": hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        "mlx": getattr(mx, "__version__", ""),
        "nanobind": nanobind.__version__,
        "mlx_dir": str(mlx_dir),
    }
    if cachefiles.check_file(target, made_from) is None and not cachefiles.noexec(target.parent):
        return str(target)
    compiler = cachefiles.find_compiler("CXX", ("c++", "g++"))
    if compiler is None:
        raise cachefiles.BuildError(
            "no C++ compiler (c++) found", "install a C++ compiler (Debian/Ubuntu: apt-get install g++)"
        )
    cxx = compiler
    nb = Path(nanobind.source_dir()).parent
    lib = mlx_dir / "lib"

    def command(out: Path) -> list[str]:
        return [
            cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
            "-DNB_DOMAIN=mlx",  # mlx's own nanobind domain: the module then takes mlx's arrays
            f"-I{nanobind.include_dir()}", f"-I{nb / 'ext' / 'robin_map' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_dir / 'include'}",
            str(_SOURCE), str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
            f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}", "-o", str(out),
        ]  # fmt: skip

    # nanobind's sources too: a C++ build takes several times gemv.c's
    return str(cachefiles.build(target, command, compiler, made_from, timeout=300))


if sys.platform != "linux":  # gemv.c's kernels are Linux's (the BLAS they stand before is the Linux wheel's)
    _state = "not used: not Linux"

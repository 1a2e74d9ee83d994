"""Send mlx's one-row float32 matrix products to the BLAS's matrix-vector routine (Linux CPUs).

mlx calls ``cblas_sgemm`` for every float32 product, also for the single row a one-stream decode step
multiplies by each weight matrix. OpenBLAS's ``sgemm`` is 2.5x slower at that shape than its ``sgemv``
(bench/RESULTS.md). :func:`install` compiles ``gemv.c`` once with the system's C compiler into the cache
folder, hands it the BLAS's own ``cblas_sgemm`` and ``cblas_sgemv``, and makes it global before the BLAS,
so that libmlx's ``cblas_sgemm`` binds to it. Without a C compiler nothing changes but the speed. A build
that fails is remembered (a marker file in the cache folder, keyed by the source and the compiler), so that
later runs do not pay for it again; a new compiler, a changed source, freed space or a day tries again. The
library is checked against its manifest before it is mapped (:mod:`mlxpipe.cachefiles`): a damaged one is
built again instead of crashing the process.
Installed by :mod:`mlxpipe.cpu.blas`, before mlx is imported; imports nothing from mlx.

A float32 weight matrix that was dequantized from mlx's 4- or 8-bit form can be :func:`attach`-ed to that
form (by the engine): one-row products by it then read the quantized bytes, on machines with AVX-512 or
AVX2, and so do products of several rows (``--batch`` decode steps, prompts), each row summed exactly as the
one-row kernels sum it alone (so a record's numbers do not depend on its neighbours, nor on how its prompt
is cut).
``MLXPIPE_QGEMM=off`` keeps those several-row products on the BLAS. Where the CPU has AMX (bfloat16 tiles),
products of ``AMX_ROWS`` rows or more use it instead: a row's sums then still depend on that row alone, but
are added in another order than the one-row kernels add them (the last bits can differ from ``--batch 1``'s);
``MLXPIPE_AMX=off`` keeps them on the AVX-512 kernels. Otherwise products of 16 rows or more are a GEMM on
W's dequantized rows (AVX-512 or AVX2, the same sums on either), in the same sense: each row's sums depend on
it alone, in another order than the one-row kernels'. A large one-row product (a single stream's output
layer) shares its rows with the helper thread too (:func:`share_one_rows`), each row summed as alone.

On a CPU with AVX2 all those products (one row or many) split each row of A per group into two 8-bit parts
and sum integers (:func:`use_int8`): by VNNI (AVX-512's, or AVX-VNNI beside AVX2), or by AVX2 alone (the
same integers by vpmaddubsw, or vpmaddwd for 8-bit weights); faster than the float32 kernels, each row's
numbers its own (the same at ``--batch 1`` and in any batch, and on any of these kernels), within ~1e-4 of
float32's. ``MLXPIPE_INT8=1`` takes one part, as llama.cpp's CPU products do (faster again, greedy answers
part from float32's); ``MLXPIPE_INT8=off`` keeps the float32 kernels (and AMX, which otherwise the integer
products replace). Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import cachefiles
from ..errors import first_line
from ..paths import cache_dir
from ..switches import setting, turned_off, turned_off_by

__all__ = [
    "AMX_ENV",
    "AMX_ROWS",
    "ARGMAX_ALPHA",
    "ARGMAX_MAX_COLUMNS",
    "ATTENTION_MAX_CAPACITY",
    "ENV",
    "INT8_ENV",
    "MAX_ROWS",
    "NO_COMPILER",
    "ONE_ROW_SHARED",
    "QGEMM_ENV",
    "SCORES_ALPHA",
    "SOFTMAX_ALPHA",
    "SWIGLU_ALPHA",
    "adopt",
    "argmax_available",
    "argmax_calls",
    "attach",
    "attached",
    "attention_alpha",
    "attention_available",
    "attention_calls",
    "build_fix",
    "detach",
    "install",
    "int8_activations",
    "int8_parts",
    "pack",
    "packed",
    "product_address",
    "quantized_available",
    "quantized_batch_calls",
    "quantized_calls",
    "register",
    "share_one_rows",
    "source",
    "swiglu_available",
    "swiglu_calls",
    "unregister",
    "use_amx",
    "use_int8",
    "use_threads",
]

ENV = "MLXPIPE_GEMV"
QGEMM_ENV = "MLXPIPE_QGEMM"
AMX_ENV = "MLXPIPE_AMX"
INT8_ENV = "MLXPIPE_INT8"
AMX_ROWS = 16  # fewer rows than this: the AVX-512 kernels are faster
# One-row products of this many weights or more share their rows with the helper, if they also take 90 us or
# more alone on this machine (gemv.c times them): below that the helper's wake-up costs more than it saves.
ONE_ROW_SHARED = 1 << 20
NO_COMPILER = "no C compiler (cc) found"
FORWARDING = "one-row products go to sgemv"  # what install() returns once its cblas_sgemm is in front
# Products whose alpha is one of these compute attention's parts instead (gemv.c, cpu.layers.attention):
# a @ b.T with each score summed in one order, and softmax(a) @ b.
SCORES_ALPHA = -(2.0**99)
SOFTMAX_ALPHA = -(2.0**100)
# Attention's two products for every (record, KV head) pair of a KV cache at once, the layout in the mantissa
# (gemv.c's attention_batch): one call instead of one per pair, the pairs shared with the helper.
_ATTENTION_ALPHA = 2.0**98
ATTENTION_MAX_CAPACITY = (1 << 17) - 1  # positions of a KV cache's buffer the alpha can name
# A product whose alpha is this is a fused gate-and-up projection: its first half becomes silu(gate) * up.
SWIGLU_ALPHA = -(2.0**101)
# A product of logits (m x vocabulary) by two columns whose alpha is this: each row's mx.argmax (gemv.c).
ARGMAX_ALPHA = -(2.0**102)
ARGMAX_MAX_COLUMNS = (1 << 24) - 1  # a vocabulary the float32 index holds exactly
MAX_ROWS = 1 << 30  # every product by an attached matrix: a row's sums never depend on the batch or prompt
_SOURCE = Path(__file__).with_name("gemv.c")
_shim: Any = None  # the library in front of the BLAS, once installed
_fix = ""  # what to do about the library install() could not build (a BuildError's fix), once it failed


def build_fix() -> str:
    """The fix for the build failure :func:`install` reported ("not built: ..."), where it knows one."""
    return _fix


def install(blas: Any) -> str:
    """Put the forwarding ``cblas_sgemm`` in front of ``blas`` (a ctypes library loaded RTLD_LOCAL).

    Returns what was done, for ``--model-info``. The caller must load ``blas`` globally afterwards. Never
    raises: any failure leaves mlx calling the BLAS's own ``sgemm``.
    """
    if turned_off(ENV):
        return f"off ({turned_off_by(ENV)})"
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
        shim.mlxpipe_qgemm_max_rows(0 if turned_off(QGEMM_ENV) else MAX_ROWS)
        shim.mlxpipe_qgemm_amx(0 if turned_off(AMX_ENV) else AMX_ROWS)
        shim.mlxpipe_qgemm_int8(int8_parts())
        shim.mlxpipe_qgemv_shared_min(ctypes.c_long(ONE_ROW_SHARED))
        global _shim
        _shim = _open(path, ctypes.RTLD_GLOBAL)  # promoted now: it comes before the BLAS in the global scope
    except cachefiles.BuildError as exc:
        global _fix
        _fix = exc.fix
        return f"not built: {exc.cause}"
    except (OSError, subprocess.SubprocessError, AttributeError, RuntimeError) as exc:
        # RuntimeError: the cache folder is under the home folder, and there is none.
        return f"not built: {first_line(exc)}"
    return FORWARDING


def source() -> Path:
    """gemv.c, the library's source."""
    return _SOURCE


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags as the kernel lists them (None where it does not: not x86, no /proc)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def _defines() -> list[str]:
    """The compiler's -D options for this CPU: on an x86-64 CPU that says it lacks AVX-512 VNNI, the tiles
    only it runs are left out (the costliest part of the build: bench/RESULTS.md#r-build)."""
    flags = cpu_flags()
    if flags is None or "avx2" not in flags or {"avx512_vnni", "avx512bw"} <= flags:
        return []
    return ["-DMLXPIPE_WITHOUT_VNNI512"]


def _open(path: str, mode: int) -> Any:
    return ctypes.CDLL(path, mode=mode)


def _built() -> str:
    """The compiled library's path, compiling it first if this source has not been compiled here yet.

    The library is checked against its manifest before use (a cut-short or changed file is built again);
    raises OSError (:class:`~mlxpipe.cachefiles.BuildError`, cause and fix) when it cannot be built or used.
    """
    source = _SOURCE.read_bytes()
    defines = _defines()
    defined = " ".join(defines)
    key = hashlib.sha256(source + platform.machine().encode() + defined.encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv-{key}.so"
    inputs = {"source": hashlib.sha256(source).hexdigest(), "machine": platform.machine()}
    if defined:
        inputs["defines"] = defined
    if cachefiles.check_file(target, inputs) is None and not cachefiles.noexec(target.parent):
        return str(target)  # the common case: no compiler looked for
    compiler = cachefiles.find_compiler()
    if compiler is None:
        raise OSError(NO_COMPILER)

    def command(out: Path) -> list[str]:
        return [compiler, "-O2", *defines, "-shared", "-fPIC", "-o", str(out), str(_SOURCE), "-lm"]

    return str(cachefiles.build(target, command, compiler, inputs))


# ---- quantized one-row products ----------------------------------------------------------------------

# Registered matrices, by the float32 matrix's address: that matrix (kept alive while registered, so that its
# address cannot pass to another array) and the quantized arrays the C side reads.
_attached: dict[tuple[int, int], tuple[Any, ...]] = {}
_held: dict[tuple[int, int], tuple[Any, ...]] = {}  # what keeps the memory the C side reads valid, per matrix


def attached() -> int:
    """How many matrices are attached to the quantized kernels now."""
    return len(_attached)


def quantized_available() -> bool:
    """Whether :func:`attach` can work here: the library is installed and the CPU has its kernels."""
    return _shim is not None and bool(_shim.mlxpipe_qgemv_available())


def _address(array: Any) -> int:
    return _view(array, None)[0]


def _key(weight: Any) -> tuple[int, int]:
    """An attached matrix's key: its address and rows (a fused matrix and a view of its first rows share one
    address)."""
    return _address(weight), int(weight.shape[0])


def _view(array: Any, fmt: str | None) -> tuple[int, Any]:
    """The address of ``array``'s own memory (C-ordered, of struct format ``fmt`` when given) and an object
    that keeps it valid; a C-ordered copy where the array is not so (numpy, imported only then)."""
    view = memoryview(array)
    if view.c_contiguous and not view.readonly and (fmt is None or view.format == fmt):
        holder = ctypes.c_char.from_buffer(view)  # no copy, and no numpy to import on the common path
        return ctypes.addressof(holder), holder
    import numpy as np

    copy = np.ascontiguousarray(view, dtype=np.float32 if fmt == "f" else None)
    return int(copy.ctypes.data), copy


def attach(weight: Any, q: Any, scales: Any, biases: Any, bits: int, group_size: int) -> bool:
    """Let one-row products by ``weight`` (float32, n x k, row-major) read ``q`` instead.

    ``q``, ``scales``, ``biases``, ``bits`` and ``group_size``: the quantized form ``weight`` was
    dequantized from (mlx's affine layout: ``weight = scales * q + biases`` per group of ``group_size``).
    Arrays with the buffer protocol (mlx's, numpy's), evaluated; ``weight`` must be the very array the
    model multiplies by (its address is the key), the others are read where they lie (held here until
    :func:`detach`; copied when not C-ordered, or not float32 for the scales and biases). False, and nothing
    registered, when the library, the CPU or the layout does not allow it.
    """
    if not quantized_available():
        return False
    n, k = weight.shape
    key = _key(weight)
    # Views this module holds (mlx arrays never change once computed), for the C side to read; copying the
    # quantized bytes cost a tenth of a start-up (bench/RESULTS.md). The float32 matrix is only an address.
    (qp, qh), (sp, sh), (bp, bh) = _view(q, None), _view(scales, "f"), _view(biases, "f")
    p = ctypes.c_void_p
    ok = _shim.mlxpipe_qgemv_register(p(key[0]), n, k, bits, group_size, p(qp), p(sp), p(bp))
    if ok:
        _attached[key] = (weight, q, scales, biases, bits, group_size)
        _held[key] = (qh, sh, bh)
    return bool(ok)


def register(q: Any, scales: Any, biases: Any, bits: int, group_size: int) -> tuple[int, int] | None:
    """Register a quantized matrix (``q``, float32 ``scales`` and ``biases`` as :func:`attach` takes them,
    held by the caller while registered) for :func:`product_address`'s products, with no float32 matrix:
    its handle and key (for :func:`unregister`); None where the library, the CPU or the layout does not allow
    it."""
    if not quantized_available():
        return None
    (qp, qh), (sp, sh), (bp, bh) = _view(q, None), _view(scales, "f"), _view(biases, "f")
    n, k = int(q.shape[0]), int(q.shape[1]) * 32 // bits
    key = _new_key()
    p = ctypes.c_void_p
    _shim.mlxpipe_qmatrix.restype = p
    handle = _shim.mlxpipe_qmatrix(p(key), n, k, bits, group_size, p(qp), p(sp), p(bp))
    if not handle:
        return None
    _held[(key, n)] = (qh, sh, bh)
    return int(handle), key


_keys = 0  # keys given to registered matrices (multiples of 64 below any real array's address)


def _new_key() -> int:
    """A registered matrix's own key: an address freed and taken again by another array must not name it."""
    global _keys
    _keys += 1
    return _keys << 6


def _let_go(key: int) -> None:
    """Drop what keeps the arrays of the matrix registered under ``key`` alive."""
    for held in [h for h in _held if h[0] == key]:
        _held.pop(held, None)


def pack(handle: int, key: int, only: bool) -> bool:
    """Make the packed copy of a :func:`register`-ed matrix (``handle``, ``key``) now, for the integer
    products; with ``only`` the library then forgets its source arrays and lets them go (its products read
    the copy alone). False, nothing changed, where the integer products do not run."""
    if _shim is None or not _shim.mlxpipe_qmatrix_pack(ctypes.c_void_p(handle), int(only)):
        return False
    if only:
        _let_go(key)
    return True


def packed(handle: int) -> tuple[int, int, int] | None:
    """A registered matrix's packed copy (made now where it is not yet): its address, size in bytes and form
    (flags: 1, its scales and biases 16-bit; 2, no biases, each being a fixed multiple of its scale); None
    where the integer products do not run."""
    if _shim is None:
        return None
    size, form = ctypes.c_long(), ctypes.c_int()
    _shim.mlxpipe_qmatrix_packed.restype = ctypes.c_void_p
    address = _shim.mlxpipe_qmatrix_packed(ctypes.c_void_p(handle), ctypes.byref(size), ctypes.byref(form))
    return (int(address), size.value, form.value) if address else None


def adopt(
    shape: tuple[int, int], bits: int, group_size: int, address: int, size: int, form: int
) -> tuple[int, int] | None:
    """Register a matrix (``shape`` n x k) by a packed copy :func:`packed` gave for it in an earlier process,
    ``size`` bytes at ``address`` of ``form`` (64-byte aligned; the caller keeps it mapped while registered):
    its handle and key; None where the integer products do not run or the size is not this matrix's."""
    if _shim is None:
        return None
    key = _new_key()
    p = ctypes.c_void_p
    _shim.mlxpipe_qmatrix_adopt.restype = p
    handle = _shim.mlxpipe_qmatrix_adopt(
        p(key), shape[0], shape[1], bits, group_size, p(address), ctypes.c_long(size), form
    )
    return (int(handle), key) if handle else None


def unregister(keys: list[int], settle: Callable[[], None] = lambda: None) -> None:
    """Forget the matrices :func:`register` gave these keys (after ``settle``: products may be pending)."""
    if _shim is None:
        return
    for key in keys:
        _shim.mlxpipe_qgemv_unregister(ctypes.c_void_p(key))
    settle()
    _shim.mlxpipe_qgemv_release()
    for key in keys:
        _let_go(key)


def product_address() -> int:
    """The address of gemv.c's ``mlxpipe_qproduct`` (the product :mod:`.kernels`' operation calls)."""
    return int(ctypes.cast(_shim.mlxpipe_qproduct, ctypes.c_void_p).value or 0)


def detach(weights: Any, settle: Callable[[], None] = lambda: None) -> None:
    """Forget ``weights`` (attached float32 matrices): their one-row products go back to the BLAS.

    ``settle`` is called between the two steps, to wait for products still running: the copies the C side
    reads are released only after it (mlx runs a step ahead; freeing them at the end of a run crashed).
    """
    for w in weights:
        if _shim is not None:
            _shim.mlxpipe_qgemv_unregister(ctypes.c_void_p(_address(w)))
    settle()
    if _shim is not None:
        _shim.mlxpipe_qgemv_release()  # their repacked copies (the integer products'), now unread
    for w in weights:
        _attached.pop(_key(w), None)
        _held.pop(_key(w), None)


def use_threads(threads: int) -> None:
    """Let products of several rows by attached matrices use ``threads`` threads (1 or 2: the caller and one
    helper, which sleeps between products and is left out for a while when it does not get a core)."""
    if _shim is not None:
        _shim.mlxpipe_qgemm_threads(max(1, threads))


def share_one_rows(weights: int) -> None:
    """Let one-row products of at least ``weights`` weights by attached matrices share their rows with the
    helper (0: none; :data:`ONE_ROW_SHARED` by default), when they take 90 us or more alone on this machine (a
    running mean of its one-row speed). Each row is still summed by one thread, as alone: the
    numbers do not change. Only while :func:`use_threads` allows the helper; after it made a product wait, it
    is left out for 50 ms."""
    if _shim is not None:
        _shim.mlxpipe_qgemv_shared_min(ctypes.c_long(weights))


def use_amx(rows: int) -> bool:
    """Send products of at least ``rows`` rows by attached matrices to AMX (0: never); whether the CPU (and
    the kernel) let this process use it."""
    return _shim is not None and bool(_shim.mlxpipe_qgemm_amx(rows))


def int8_parts() -> int:
    """The 8-bit parts ``MLXPIPE_INT8`` asks activations to be split into: 2 (unset), 1, or 0 (off)."""
    if turned_off(INT8_ENV):
        return 0
    return 1 if setting(INT8_ENV) == "1" else 2


def use_int8(parts: int) -> int:
    """Products by attached matrices from activations split into ``parts`` 8-bit parts (1 or 2; 0: the float32
    kernels) where the CPU has AVX2 (with VNNI, or by AVX2 alone); the parts that run now (0 elsewhere)."""
    return 0 if _shim is None else int(_shim.mlxpipe_qgemm_int8(parts))


def int8_activations() -> int:
    """The 8-bit parts products by attached matrices split each activation into here (``MLXPIPE_INT8``; 0:
    none, the float32 kernels, as on a CPU without AVX2)."""
    return 0 if _shim is None else int(_shim.mlxpipe_qgemm_int8(-1))


def attention_alpha(softmax: bool, rep: int, capacity: int) -> float:
    """The alpha that asks for attention's scores (``softmax`` False: ``a @ b.T``) or its softmax times the
    values of every (record, KV head) pair in one product: ``rep`` rows of ``a`` a pair (1-31), pair p's
    keys or values ``p * capacity`` rows after the first pair's in ``b`` (at most ATTENTION_MAX_CAPACITY)."""
    payload = int(softmax) | rep << 1 | capacity << 6
    return -_ATTENTION_ALPHA * (1 + payload / 2.0**23)


def attention_available() -> bool:
    """Whether mlx's products go through the library on a CPU with its AVX-512 or AVX2 kernels, so that one
    whose alpha is :data:`SCORES_ALPHA` computes ``a @ b.T`` (each sum in one order: attention's scores) and
    one whose alpha is :data:`SOFTMAX_ALPHA` computes ``softmax(a) @ b`` (its weights times the values);
    float32. (Elsewhere its portable loops would be slower than mx.fast's fallback.)"""
    return _shim is not None and bool(_shim.mlxpipe_attention_available())


def swiglu_available() -> bool:
    """Whether mlx's products go through the library, so that one whose alpha is :data:`SWIGLU_ALPHA`
    computes ``c = a @ b`` (b's columns: a gate projection's, then an up projection's of the same width), then
    ``silu(gate) * up`` (m x width) packed row-major at ``c``'s start, in float32 by
    :func:`mlxpipe.cpu.layers.swiglu`'s operations."""
    return _shim is not None


def argmax_available() -> bool:
    """Whether mlx's products go through the library, so that a product of logits (m x vocabulary, float32)
    by two columns (never read) whose alpha is :data:`ARGMAX_ALPHA` gives each row's ``mx.argmax`` as a float
    in both columns (m x 2)."""
    return _shim is not None


def argmax_calls() -> int:
    """Products computed as each row's argmax (:data:`ARGMAX_ALPHA`) so far in this process."""
    if _shim is None:
        return 0
    _shim.mlxpipe_argmax_calls.restype = ctypes.c_long
    return int(_shim.mlxpipe_argmax_calls())


def swiglu_calls() -> int:
    """Products followed by a SwiGLU (:data:`SWIGLU_ALPHA`) so far in this process."""
    if _shim is None:
        return 0
    _shim.mlxpipe_swiglu_calls.restype = ctypes.c_long
    return int(_shim.mlxpipe_swiglu_calls())


def attention_calls() -> int:
    """Products computed as attention's scores or ``softmax(a) @ b`` so far in this process."""
    if _shim is None:
        return 0
    _shim.mlxpipe_attention_calls.restype = ctypes.c_long
    return int(_shim.mlxpipe_attention_calls())


def quantized_batch_calls() -> int:
    """Products of several rows computed from quantized weights so far in this process."""
    if _shim is None:
        return 0
    _shim.mlxpipe_qgemm_calls.restype = ctypes.c_long
    return int(_shim.mlxpipe_qgemm_calls())


def quantized_calls() -> int:
    """One-row products computed from quantized weights so far in this process."""
    if _shim is None:
        return 0
    _shim.mlxpipe_qgemv_calls.restype = ctypes.c_long
    return int(_shim.mlxpipe_qgemv_calls())

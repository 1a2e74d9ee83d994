"""The cblas_sgemm in front of the BLAS (mlxpipe/gemv.c): same products as the BLAS, one-row ones via sgemv.

The C function is checked directly against numpy for every layout, and then through mlx in a fresh process
(mlx binds its BLAS when first imported, so the loader must run before that).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, blas_runs_here, cli_env

from mlxpipe import cachefiles
from mlxpipe.cpu import blas, gemv

# The Linux CPU paths' own tests: MLXPIPE_CPU=off (make test-portable) leaves them nothing to test.
pytestmark = pytest.mark.cpu_paths


ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112


def _tests_library() -> Any:
    """The library the tests below share, loaded from a copy of the built one beside it: an instance apart
    from the one this process's engine loaded (every loader of one path shares one), so that what the tests
    register and set never reaches the engine's."""
    built = Path(gemv._built())
    copy = built.with_name(built.stem + "-tests.so")
    if not copy.exists():
        shutil.copyfile(built, copy)
    return ctypes.CDLL(str(copy), mode=ctypes.RTLD_LOCAL)


def _own_shim(openblas: Any, quantized: bool = False, avx2: bool = False, int8: bool = False) -> Any:
    """The tests' library (:func:`_tests_library`: apart from the engine's), in front of OpenBLAS;
    ``avx2``: its AVX2 kernels, also where the CPU has AVX-512; ``int8``: 8-bit activations where the CPU
    has AVX-512 VNNI, else the float32 kernels (which the tests below check against float64)."""
    shim = _tests_library()
    shim.mlxpipe_qgemv_avx2(int(avx2))
    shim.mlxpipe_qgemm_int8(int(int8))  # (the one copy: an earlier test may have set it)
    shim.mlxpipe_qgemm_max_rows(gemv.MAX_ROWS)  # (one dlopen'd copy a path: an earlier test may have set it)
    if quantized and not shim.mlxpipe_qgemv_available():
        pytest.skip("the quantized kernels need AVX-512 or AVX2")
    assert shim.mlxpipe_gemv_init(
        ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p)
    )
    return shim


def _private_copy(folder: Path) -> Any:
    """The library loaded from a copy in ``folder``: an instance of its own, its state (settings, counters,
    registered matrices) fresh, as every loader of one path shares one; copied, not compiled again."""
    copy = folder / "gemv-private.so"
    shutil.copyfile(gemv._built(), copy)
    return ctypes.CDLL(str(copy), mode=ctypes.RTLD_LOCAL)


@pytest.fixture(autouse=True)
def _integer_products_as_asked() -> Iterator[None]:
    """A test may set the tests' library's integer products: what MLXPIPE_INT8 asks for is put back after
    each, for the next."""
    yield
    _tests_library().mlxpipe_qgemm_int8(gemv.int8_parts())


@pytest.fixture(params=[False, True], ids=["best-kernels", "avx2-kernels"])
def avx2(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Each quantized test twice: with the best kernels this CPU has, and with the AVX2 ones (on a CPU
    without AVX-512 the same ones); the library is left on the best after."""
    yield bool(request.param)
    _tests_library().mlxpipe_qgemv_avx2(0)


@pytest.fixture
def openblas() -> Any:
    # The first that runs on this CPU, as mlxpipe picks it; loaded RTLD_LOCAL, never global inside the tests.
    for source, path in blas._candidates() if sys.platform == "linux" else []:
        with contextlib.suppress(OSError):
            return blas.opened(source, path)[0]
    pytest.skip("no OpenBLAS that runs on this machine")


def _stored(matrix: np.ndarray, order: int, trans: int) -> tuple[np.ndarray, int]:
    """The buffer and leading dimension BLAS expects for op(X) = matrix."""
    x = matrix.T if trans == TRANS else matrix
    if order == COL_MAJOR:
        return np.array(x, order="F"), x.shape[0]  # always a copy: BLAS writes into C
    return np.array(x, order="C"), x.shape[1]


def test_forwarding_sgemm_matches_numpy_for_every_layout(openblas: Any, tmp_path: Path) -> None:
    shim = _private_copy(tmp_path)
    assert shim.mlxpipe_gemv_init(
        ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p)
    )
    ptr = ctypes.c_void_p
    rng = np.random.default_rng(7)
    for (m, k, n), order, ta, tb in itertools.product(
        [(1, 33, 17), (9, 33, 1), (1, 5, 1), (6, 33, 17), (1, 300, 130), (310, 120, 1)],  # small, then sgemv
        [ROW_MAJOR, COL_MAJOR],
        [NO_TRANS, TRANS],
        [NO_TRANS, TRANS],
    ):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        c0 = rng.standard_normal((m, n)).astype(np.float32)
        sa, lda = _stored(a, order, ta)
        sb, ldb = _stored(b, order, tb)
        sc, ldc = _stored(c0, order, NO_TRANS)
        shim.cblas_sgemm(
            order, ta, tb, m, n, k, ctypes.c_float(1.5), ptr(sa.ctypes.data), lda,
            ptr(sb.ctypes.data), ldb, ctypes.c_float(0.5), ptr(sc.ctypes.data), ldc,
        )  # fmt: skip
        expected = 1.5 * (a.astype(np.float64) @ b) + 0.5 * c0
        np.testing.assert_allclose(sc, expected, rtol=1e-4, atol=1e-4, err_msg=f"{(m, k, n, order, ta, tb)}")


def test_attention_products_match_numpy(openblas: Any, tmp_path: Path) -> None:
    # The two products layers.attention asks for by their alpha: a @ b.T (the scores), softmax(a) @ b.
    shim = _private_copy(tmp_path)  # its count of attention calls starts at 0
    assert shim.mlxpipe_gemv_init(
        ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p)
    )
    ptr, f = ctypes.c_void_p, ctypes.c_float
    rng = np.random.default_rng(8)
    cases = [(3, 64, 96), (1, 64, 1), (7, 40, 33), (5, 128, 300)]  # rows, head size, keys
    # The best kernels this CPU has, the AVX2 ones (where it has them), then the portable loops other CPUs
    # would run.
    for (m, k, n), kind in itertools.product(cases, ["best", "avx2", "portable"]):
        shim.mlxpipe_qgemv_avx2(int(kind == "avx2"))
        shim.mlxpipe_attention_portable(int(kind == "portable"))
        q = rng.standard_normal((m, k)).astype(np.float32)
        cache = rng.standard_normal((2, n + 9, k)).astype(np.float32)  # keys, values: rows of a longer cache
        keys, values = cache[0, :n], cache[1, :n]
        scores = np.zeros((m, n), np.float32)
        shim.cblas_sgemm(
            ROW_MAJOR, NO_TRANS, TRANS, m, n, k, f(gemv.SCORES_ALPHA), ptr(q.ctypes.data), k,
            ptr(keys.ctypes.data), k, f(0.0), ptr(scores.ctypes.data), n,
        )  # fmt: skip
        np.testing.assert_allclose(scores, q.astype(np.float64) @ keys.T, rtol=1e-5, atol=1e-5)
        scores[:, : n // 3] = np.finfo(np.float32).min  # masked keys weigh nothing
        out = np.zeros((m, k), np.float32)
        shim.cblas_sgemm(
            ROW_MAJOR, NO_TRANS, NO_TRANS, m, k, n, f(gemv.SOFTMAX_ALPHA), ptr(scores.ctypes.data), n,
            ptr(values.ctypes.data), k, f(0.0), ptr(out.ctypes.data), k,
        )  # fmt: skip
        weights = np.exp(scores.astype(np.float64) - scores.max(axis=1, keepdims=True))
        expected = (weights / weights.sum(axis=1, keepdims=True)) @ values
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5, err_msg=f"{(m, k, n, kind)}")
    assert shim.mlxpipe_attention_calls() == 24


def test_swiglu_products_give_layers_swiglu_bit_for_bit(openblas: Any) -> None:
    # A product whose alpha is SWIGLU_ALPHA: here by the identity, so c is the chosen gate and up values,
    # then silu(gate) * up packed at c's start (a contiguous matrix for the next product), the very numbers
    # of layers.swiglu (mlx's compiled kernels).
    shim = _own_shim(openblas)
    for half in (37, 61):  # 37: 32 in vectors, 5 alone; 61: 48 in AVX-512's vectors, 8 in AVX2's, 5 alone
        _swiglu_product(shim, half)
    shim.mlxpipe_attention_portable(0)


def _swiglu_product(shim: Any, half: int) -> None:
    import mlx.core as mx

    from mlxpipe.cpu import layers

    ptr, f = ctypes.c_void_p, ctypes.c_float
    rng = np.random.default_rng(21)
    m, ldc = 5, 2 * half + 3  # rows of c further apart than n
    values = (6 * rng.standard_normal((m, 2 * half))).astype(np.float32)
    values[0, :10] = [0.0, -0.0, 1e-30, 7.9, -7.9, 15.81, -15.81, 50.0, -50.0, -3.0]  # the clamp at 7.9
    with mx.stream(mx.cpu):  # the CPU's kernels' numbers (a GPU's round otherwise)
        expected = np.array(layers.swiglu(mx.array(values[:, :half]), mx.array(values[:, half:])))
    identity = np.eye(2 * half, dtype=np.float32)
    calls = shim.mlxpipe_swiglu_calls
    calls.restype = ctypes.c_long
    for kind in ["best", "portable"]:
        shim.mlxpipe_attention_portable(int(kind == "portable"))
        c = np.zeros(m * ldc, np.float32)
        before = calls()
        shim.cblas_sgemm(
            ROW_MAJOR, NO_TRANS, TRANS, m, 2 * half, 2 * half, f(gemv.SWIGLU_ALPHA), ptr(values.ctypes.data),
            2 * half, ptr(identity.ctypes.data), 2 * half, f(0.0), ptr(c.ctypes.data), ldc,
        )  # fmt: skip
        assert calls() == before + 1
        assert np.array_equal(c[: m * half].reshape(m, half), expected), (kind, half)


def test_argmax_products_pick_what_mx_argmax_picks(openblas: Any) -> None:
    # A product of logits by two columns whose alpha is ARGMAX_ALPHA: each row's index as mx.argmax gives it
    # (its first NaN, else the first of its largest, -0 and 0 alike), in both columns, as a float.
    import mlx.core as mx

    shim = _own_shim(openblas)
    ptr, f = ctypes.c_void_p, ctypes.c_float
    rng = np.random.default_rng(5)
    nan, inf = float("nan"), float("inf")
    rows = [rng.standard_normal(k).astype(np.float32) for k in (1, 5, 16, 17, 49152)]
    rows += [np.array(v, np.float32) for v in ([1, nan, 2, nan], [nan, 1, nan], [inf, nan], [3, 3, 1])]
    rows += [np.full(40, -inf, np.float32), np.array([-0.0, 0.0, -0.0], np.float32)]
    ties = np.zeros(100, np.float32)
    ties[[37, 70]] = 5.0  # the first of two, in the second 16 of the vector loop
    late_nan = rng.standard_normal(40).astype(np.float32)
    late_nan[33] = nan  # in the tail past the vectors of 16
    rows += [ties, late_nan]
    for kind in ["best", "portable"]:
        shim.mlxpipe_attention_portable(int(kind == "portable"))
        for row in rows:
            k, m, ldc = len(row), 3, 5
            logits = np.tile(row, (m, 1))
            logits[1] = logits[1][::-1]  # another row of the same values: another index
            with mx.stream(mx.cpu):  # mlx's CPU argmax, which the kernel follows
                want = np.array(mx.argmax(mx.array(logits), axis=-1))
            c = np.full(m * ldc, -1.0, np.float32)
            shim.cblas_sgemm(
                ROW_MAJOR, NO_TRANS, NO_TRANS, m, 2, k, f(gemv.ARGMAX_ALPHA), ptr(logits.ctypes.data), k,
                ptr(np.zeros((k, 2), np.float32).ctypes.data), 2, f(0.0), ptr(c.ctypes.data), ldc,
            )  # fmt: skip
            picked = c.reshape(m, ldc)
            assert np.array_equal(picked[:, 0], want) and np.array_equal(picked[:, 1], want), (kind, row[:8])
            assert (picked[:, 2:] == -1.0).all()  # nothing else written
    shim.mlxpipe_attention_portable(0)


_THROUGH_MLX = """
import json, numpy as np
from mlxpipe.cpu import blas
choice = blas.setup()
import mlx.core as mx
mx.set_default_device(mx.cpu)  # these are the CPU's products (and tolerance), also where a GPU is the default
rng = np.random.default_rng(3)
worst = 0.0
for m, k, n in [(1, 576, 1536), (1, 576, 1), (7, 64, 1), (5, 64, 96), (1, 1, 8)]:
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    want = a.astype(np.float64) @ b
    A, B = mx.array(a), mx.array(b)
    for x, y in [(A, B), (A, mx.contiguous(B.T).T), (mx.contiguous(A.T).T, B)]:
        worst = max(worst, float(np.abs(np.array(x @ y) - want).max()))
    worst = max(worst, float(np.abs(np.array((B.T @ A.T).T) - want).max()))
x = rng.standard_normal((4, 1, 64)).astype(np.float32)
w = rng.standard_normal((96, 64)).astype(np.float32)
worst = max(worst, float(np.abs(np.array(mx.array(x) @ mx.array(w).T) - x.astype(np.float64) @ w.T).max()))
print(json.dumps({"gemv": choice.gemv, "worst": worst}))
"""


@pytest.mark.parametrize("setting", ["", "off"])
def test_mlx_products_are_right_with_and_without_forwarding(setting: str) -> None:
    env = cli_env(MLXPIPE_GEMV=setting)
    r = subprocess.run(
        [sys.executable, "-c", _THROUGH_MLX], capture_output=True, text=True, env=env, cwd=REPO, check=False
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["worst"] < 1e-3
    loads_blas = bool(blas._candidates()) and sys.platform == "linux" and blas._cuda_backend() is None
    runs_here = [source for source, path in blas._candidates() if blas_runs_here(source, path)]
    if setting == "off" and loads_blas:  # (on CUDA no BLAS is loaded, so there is nothing to put gemv before)
        # A library whose functions carry a prefix (scipy-openblas32) is reached only through the forwarding.
        prefixed = bool(runs_here) and runs_here[0] in blas._PREFIXES
        assert out["gemv"] == (None if prefixed else "off (MLXPIPE_GEMV=off)")
    elif loads_blas and runs_here:
        assert out["gemv"] == gemv.FORWARDING


def test_without_a_compiler_nothing_is_forwarded(
    openblas: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemv.ENV, raising=False)
    monkeypatch.setattr(cachefiles.shutil, "which", lambda name: None)
    assert gemv.install(openblas) == "not built: no C compiler (cc) found"
    assert not list(tmp_path.rglob("*.so"))


def _failing_compiler(folder: Path) -> tuple[Path, Path]:
    """A C compiler that fails as a broken toolchain does, counting its runs in a file: (compiler, count)."""
    runs = folder / "runs"
    cc = folder / "cc"
    cc.write_text(
        f"#!/bin/sh\necho run >> {runs}\n"
        "echo 'gemv.c:1:10: fatal error: stdint.h: No such file' >&2\nexit 1\n"
    )
    cc.chmod(0o755)
    return cc, runs


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script as the compiler")
def test_the_library_builds_without_its_x86_kernels(tmp_path: Path) -> None:
    # On another CPU (Linux on ARM) gemv.c is its portable part alone (forwarding, attention's loops): it must
    # compile there too, without a warning, or mlx would lose the BLAS forwarding with the kernels.
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    source = (Path(gemv.__file__).parent / "gemv.c").read_text()
    guard = "#if defined(__x86_64__) && defined(__GNUC__)"
    assert source.count(guard) == 1
    portable = tmp_path / "gemv_portable.c"
    portable.write_text(source.replace(guard, "#if 0"))
    command = [cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(tmp_path / "p.so"), str(portable)]
    done = subprocess.run([*command, "-lm"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_cpu_without_avx512_vnni_builds_without_its_tiles(
    openblas: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Those tiles are the costliest part of gemv.c to compile (bench/RESULTS.md#r-build), and such a CPU never
    # runs them. The define is in the library's key: a cache folder shared by two CPUs keeps one build each.
    without = ["-DMLXPIPE_WITHOUT_VNNI512"]
    for flags, defines in [
        (None, []),  # not Linux, or no /proc: everything is built, as before
        ({"fp", "asimd"}, []),  # not x86: the portable part alone anyway
        ({"avx2", "fma"}, without),
        ({"avx2", "avx512f", "avx512bw"}, without),
        ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, []),
    ]:
        monkeypatch.setattr(gemv, "cpu_flags", lambda flags=flags: flags)
        assert gemv._defines() == defines
    monkeypatch.undo()
    here = gemv.cpu_flags() or set()
    shim = _own_shim(openblas, quantized=True)
    if shim.mlxpipe_qgemm_int8(2) == 2 and gemv._defines():  # the library built here: never AVX-512's tiles
        assert shim.mlxpipe_qgemm_int8_kind() == (AVX_VNNI if "avx_vnni" in here else 3)
    shim.mlxpipe_qgemm_int8(0)


def test_a_failed_build_is_remembered_per_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cc, runs = _failing_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(OSError, match=r"^cc failed: gemv.c:1:10: fatal error: stdint.h") as first:
        gemv._built()
    assert runs.read_text().count("run") == 1
    with pytest.raises(OSError, match="remembered in") as again:  # the next run does not compile again
        gemv._built()
    assert isinstance(again.value, cachefiles.BuildError) and isinstance(first.value, cachefiles.BuildError)
    assert again.value.cause.startswith(first.value.cause) and runs.read_text().count("run") == 1
    assert not list((tmp_path / "cache").rglob("*.so")) and not list((tmp_path / "cache").rglob(".gemv-*"))
    cc.write_text(cc.read_text() + "# upgraded\n")  # another compiler (or version): tried again
    with pytest.raises(OSError, match=r"^cc failed"):
        gemv._built()
    assert runs.read_text().count("run") == 2


def test_a_library_without_sgemv_is_left_alone() -> None:
    class NotABlas:
        cblas_sgemm = None

    assert gemv.install(NotABlas()).startswith("not used")


# ---- quantized one-row products ------------------------------------------------------------------------


def _quantized(rng: Any, n: int, k: int, bits: int, group: int = 32) -> tuple[np.ndarray, ...]:
    """A random matrix in mlx's affine layout: (float32 weight, packed bytes, scales, biases)."""
    q = rng.integers(0, 2**bits, size=(n, k), dtype=np.uint8)
    packed = _packed(q, bits)
    scales = (rng.standard_normal((n, k // group)) * 0.02).astype(np.float32)
    biases = (rng.standard_normal((n, k // group)) * 0.02).astype(np.float32)
    weight = (
        (q.reshape(n, -1, group) * scales[..., None] + biases[..., None]).reshape(n, k).astype(np.float32)
    )
    return weight, packed, scales, biases


def _packed(q: np.ndarray, bits: int) -> np.ndarray:
    """Values q (n x k) packed as mlx packs them: a little-endian stream of `bits`-bit values, low first."""
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(q.shape[0], -1)
    return np.packbits(stream, axis=1, bitorder="little")


def _values(packed: np.ndarray, bits: int) -> np.ndarray:
    """:func:`_packed`'s values again (int64)."""
    stream = np.unpackbits(packed, axis=1, bitorder="little").reshape(packed.shape[0], -1, bits)
    return (stream.astype(np.int64) << np.arange(bits)).sum(-1)


def _register(shim: Any, arrays: tuple[np.ndarray, ...], bits: int, group: int = 32) -> None:
    """Register :func:`_quantized`'s ``arrays`` with ``shim``: the caller keeps all four alive while the shim
    may read them."""
    w, packed, scales, biases = arrays
    ptr = ctypes.c_void_p
    assert shim.mlxpipe_qgemv_register(
        ptr(w.ctypes.data), *w.shape, bits, group, ptr(packed.ctypes.data), ptr(scales.ctypes.data),
        ptr(biases.ctypes.data),
    )  # fmt: skip


def _registered(shim: Any, rng: Any, n: int, k: int, bits: int, group: int = 32) -> tuple[np.ndarray, ...]:
    """A random matrix (:func:`_quantized`) registered with ``shim`` (:func:`_register`)."""
    arrays = _quantized(rng, n, k, bits, group)
    _register(shim, arrays, bits, group)
    return arrays


def test_quantized_rows_match_numpy_and_fall_back_when_they_cannot(openblas: Any, avx2: bool) -> None:
    shim = _own_shim(openblas, quantized=True, avx2=avx2)
    shim.mlxpipe_qgemv_calls.restype = ctypes.c_long
    ptr = ctypes.c_void_p
    rng = np.random.default_rng(11)

    def one_row(w: np.ndarray, start: int, ta: int, lda: int, alpha: float, beta: float, c: Any) -> bool:
        """c = alpha op(a) w^T + beta c through the shim; whether the quantized kernels computed it."""
        n, k = w.shape
        before = shim.mlxpipe_qgemv_calls()
        shim.cblas_sgemm(
            ROW_MAJOR, ta, TRANS, 1, n, k, ctypes.c_float(alpha), ptr(start), lda, ptr(w.ctypes.data), k,
            ctypes.c_float(beta), ptr(c.ctypes.data), n,
        )  # fmt: skip
        return bool(shim.mlxpipe_qgemv_calls() == before + 1)

    # The kernels take two rows at a time: odd row counts leave one; GGUF's group of 32 and others.
    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (576, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    for n, k, bits, group in [*shapes, (96, 512, 4, 128)]:
        w, *_alive = _registered(shim, rng, n, k, bits, group)
        x = rng.standard_normal((3, k)).astype(np.float32)  # row 1 as a row; column 1 as a strided column
        want = (x[1].astype(np.float64) @ w.T.astype(np.float64)) * 0.5
        column = np.array(x.T, order="C")
        for ta, start, lda in [(NO_TRANS, x[1:2].ctypes.data, k), (TRANS, column.ctypes.data + 4, 3)]:
            c = np.zeros(n, np.float32)
            assert one_row(w, start, ta, lda, 0.5, 0.0, c)
            np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # An accumulating product: the BLAS computes it from the float32 copy.
        c = np.ones(n, np.float32)
        assert not one_row(w, x[1:2].ctypes.data, NO_TRANS, k, 1.0, 1.0, c)
        np.testing.assert_allclose(c, 2 * want + 1, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    shim.mlxpipe_qgemv_unregister(ptr(w.ctypes.data))  # the last one: back to the BLAS
    c = np.zeros(n, np.float32)
    assert not one_row(w, x[1:2].ctypes.data, NO_TRANS, k, 1.0, 0.0, c)
    np.testing.assert_allclose(c, 2 * want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not shim.mlxpipe_qgemv_register(ptr(1), 10, 48, 4, 32, ptr(1), ptr(1), ptr(1))  # 48 % 32 != 0
    assert not shim.mlxpipe_qgemv_register(ptr(1), 10, 64, 3, 32, ptr(1), ptr(1), ptr(1))  # 3 bits: no kernel


def test_one_row_products_shared_with_the_helper_are_the_ones_computed_alone(
    openblas: Any, avx2: bool
) -> None:
    shim = _own_shim(openblas, quantized=True, avx2=avx2)
    shim.mlxpipe_qgemv_shared_min.argtypes = [ctypes.c_long]
    ptr = ctypes.c_void_p
    rng = np.random.default_rng(12)
    stats = (ctypes.c_long * 4)()
    default_us = shim.mlxpipe_qgemv_shared_us(0)  # (what it was, put back at the end)

    def one_row(w: np.ndarray, x: np.ndarray) -> np.ndarray:
        n, k = w.shape
        c = np.zeros(n, np.float32)
        shim.cblas_sgemm(
            ROW_MAJOR, NO_TRANS, TRANS, 1, n, k, ctypes.c_float(1.0), ptr(x.ctypes.data), k,
            ptr(w.ctypes.data), k, ctypes.c_float(0.0), ptr(c.ctypes.data), n,
        )  # fmt: skip
        return c

    # Odd row counts (the kernels take rows in pairs), 4 and 8 bits, a stretch of rows a thread or many.
    for n, k, bits, group in [(1536, 576, 4, 32), (193, 576, 4, 32), (4097, 576, 8, 32), (97, 512, 8, 64)]:
        w, *_alive = _registered(shim, rng, n, k, bits, group)
        x = rng.standard_normal(k).astype(np.float32)
        shim.mlxpipe_qgemm_threads(1)
        alone = one_row(w, x)
        shim.mlxpipe_qgemm_threads(2)
        shim.mlxpipe_qgemv_shared_min(1)  # every one-row product shared, whatever its time alone
        shim.mlxpipe_qgemv_shared_us(0)
        shim.mlxpipe_qgemm_shared_stats(stats)
        shared_before = stats[0]
        for _ in range(20):  # the helper joins some of them, maybe late; each row is one thread's sum
            assert (one_row(w, x) == alone).all(), (n, k, bits)
        shim.mlxpipe_qgemm_shared_stats(stats)
        assert stats[0] > shared_before  # (a slow helper is left out for 50 ms, not for good)
        shim.mlxpipe_qgemv_shared_us(1_000_000)  # shared only past a second alone: none (once timed)
        one_row(w, x)
        shim.mlxpipe_qgemm_shared_stats(stats)
        shared_before = stats[0]
        for _ in range(5):
            assert (one_row(w, x) == alone).all()
        shim.mlxpipe_qgemm_shared_stats(stats)
        assert stats[0] == shared_before
        shim.mlxpipe_qgemv_shared_min(0)  # none shared: as alone
        assert (one_row(w, x) == alone).all()
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    shim.mlxpipe_qgemv_shared_min(gemv.ONE_ROW_SHARED)  # (the process's own library, if it is loaded)
    shim.mlxpipe_qgemv_shared_us(default_us)


@pytest.fixture(scope="module")
def float32_engine() -> Any:
    """The embedded model dequantized to float32 (``--dtype float32``), its matrices attached."""
    from mlxpipe.engine import Engine

    return Engine.load(dtype="float32")


@pytest.mark.model
def test_the_embedded_models_one_row_products_read_its_quantized_weights(float32_engine: Any) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    engine = float32_engine
    if not engine.quantized_rows:
        assert engine.dtype != "float32" or not gemv.quantized_available()
        pytest.skip("no quantized one-row products here (a GPU, or a CPU without AVX-512)")
    # 30 layers x 7 matrices, the tied embedding as the output layer, and each layer's fused q/k/v and gate/up
    assert engine.quantized_rows == 211 + (60 if "fused" in engine.cpu_fast_paths else 0)
    calls = 121 if "fused" in engine.cpu_fast_paths else 211  # a step's products: 4 a layer when fused
    tokens = mx.array(
        [engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")]
    )

    def last_logits() -> Any:  # the prompt, then its last token alone: a one-row product per matrix
        cache = make_prompt_cache(engine.model)
        mx.eval(engine.model(tokens[:, :-1], cache=cache))
        return engine.model(tokens[:, -1:], cache=cache)[0, -1]

    before = gemv.quantized_calls()
    parts = gemv.use_int8(0)  # the float32 kernels: float32's sums in another order
    try:
        quantized = last_logits()
        mx.eval(quantized)
    finally:
        gemv.use_int8(parts)
    # as the CPU computes them by default: from activations in 8-bit parts where it has AVX-512 VNNI
    integers = last_logits() if parts else quantized
    mx.eval(integers)
    assert gemv.quantized_calls() - before == (2 if parts else 1) * calls
    entries = list(gemv._attached.values())
    weights = [e[0] for e in entries]
    # The copies must outlive the wait for products still running (mlx computes a step ahead).
    held = []
    gemv.detach(weights, settle=lambda: held.append(all(gemv._key(w) in gemv._attached for w in weights)))
    assert held == [True] and not any(gemv._key(w) in gemv._attached for w in weights)
    try:
        plain = last_logits()
        mx.eval(plain)
    finally:
        for entry in entries:
            gemv.attach(*entry)
    assert gemv.quantized_calls() - before == (2 if parts else 1) * calls  # none while detached
    assert mx.allclose(quantized, plain, rtol=1e-4, atol=1e-4).item()
    assert mx.argmax(quantized).item() == mx.argmax(plain).item()
    # two 8-bit parts: each product within ~1e-4 of float32's (of its largest value), the logits within 0.1%
    assert parts in (0, 2) and (mx.abs(integers - plain).max() < 1e-3 * mx.abs(plain).max()).item()
    assert mx.argmax(integers).item() == mx.argmax(plain).item()


def _product(shim: Any, w: np.ndarray, x: np.ndarray, alpha: float = 1.0) -> tuple[np.ndarray, bool]:
    """alpha x w^T through the shim (c wider than n: nothing may be written past a row); whether the
    quantized kernels computed it."""
    (n, k), m = w.shape, x.shape[0]
    c = np.full((m, n + 3), 7.0, np.float32)
    shim.mlxpipe_qgemm_calls.restype = ctypes.c_long
    before = shim.mlxpipe_qgemm_calls()
    ptr = ctypes.c_void_p
    shim.cblas_sgemm(
        ROW_MAJOR, NO_TRANS, TRANS, m, n, k, ctypes.c_float(alpha), ptr(x.ctypes.data), x.strides[0] // 4,
        ptr(w.ctypes.data), k, ctypes.c_float(0.0), ptr(c.ctypes.data), n + 3,
    )  # fmt: skip
    assert (c[:, n:] == 7.0).all()
    return c[:, :n], bool(shim.mlxpipe_qgemm_calls() > before)


def test_quantized_products_of_several_rows_match_numpy(openblas: Any, avx2: bool) -> None:
    shim = _own_shim(openblas, quantized=True, avx2=avx2)
    ptr = ctypes.c_void_p
    rng = np.random.default_rng(13)

    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (576, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    for (n, k, bits, group), threads in itertools.product(shapes, [1, 2]):
        shim.mlxpipe_qgemm_threads(threads)
        w, *_alive = _registered(shim, rng, n, k, bits, group)
        for m in [2, 3, 8, 9, 17, 64]:  # blocks of 8 rows and what is left over
            x = rng.standard_normal((m, k + 5)).astype(np.float32)[:, :k]  # a row stride other than k
            want = 0.5 * (x.astype(np.float64) @ w.T.astype(np.float64))
            c, quantized = _product(shim, w, x, 0.5)
            assert quantized, (n, k, bits, m)
            np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # A row's sums are those the one-row kernel gives it alone, to the last bit (--batch 1's numbers).
        x = rng.standard_normal((9, k)).astype(np.float32)
        together, _ = _product(shim, w, x, 1.0)
        for i in (0, 8):
            alone = np.zeros(n, np.float32)
            shim.cblas_sgemm(
                ROW_MAJOR, NO_TRANS, TRANS, 1, n, k, ctypes.c_float(1.0), ptr(x[i:].ctypes.data), k,
                ptr(w.ctypes.data), k, ctypes.c_float(0.0), ptr(alone.ctypes.data), n,
            )  # fmt: skip
            assert (alone == together[i]).all()
    shim.mlxpipe_qgemm_max_rows(8)  # more rows than that: the BLAS, on the float32 copy
    c, quantized = _product(shim, w, x, 1.0)
    assert not quantized
    np.testing.assert_allclose(c, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4 * np.abs(c).max())
    shim.mlxpipe_qgemm_max_rows(0)  # MLXPIPE_QGEMM=off: one-row products only
    c, quantized = _product(shim, w, x[:2], 1.0)
    assert not quantized
    np.testing.assert_allclose(c, x[:2].astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4 * np.abs(c).max())


def test_amx_products_match_numpy_and_depend_on_their_row_alone(openblas: Any) -> None:
    shim = _tests_library()
    if not shim.mlxpipe_qgemv_available() or not shim.mlxpipe_qgemm_amx(2):
        pytest.skip("no AMX (bfloat16 tiles) for this process")
    shim.mlxpipe_qgemm_int8(0)  # AMX's tiles, not the integer products that take their place by default
    shim.mlxpipe_qgemm_max_rows(1 << 30)  # (the same library as the tests' above, if they loaded it)
    assert shim.mlxpipe_gemv_init(
        ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p)
    )
    rng = np.random.default_rng(17)

    # Whole and partial tiles of 16 rows of W; 4 and 8 bits; the helper thread or not; 300 rows: two passes.
    # Odd counts of groups (17, 3) by odd counts of 16-row passes: an odd count of tile products a block.
    shapes = [(1536, 576, 4), (193, 576, 4), (576, 1536, 4), (4096, 576, 8), (97, 512, 8)]
    shapes += [(48, 544, 4), (16, 96, 8)]
    for (n, k, bits), threads in itertools.product(shapes, [1, 2]):
        shim.mlxpipe_qgemm_threads(threads)
        w, *_alive = _registered(shim, rng, n, k, bits)
        x = rng.standard_normal((300, k + 5)).astype(np.float32)[:, :k]  # a row stride other than k
        for m in [2, 17, 64, 300]:
            want = 0.5 * (x[:m].astype(np.float64) @ w.T.astype(np.float64))
            together = _product(shim, w, x[:m], 0.5)[0]
            # float32's precision: x is split into three bfloat16 parts, q is exact in bfloat16
            np.testing.assert_allclose(together, want, rtol=1e-5, atol=2e-6 * np.abs(want).max())
            # A row's sums do not depend on the rows beside it (its tile's other columns, the pass it is in).
            alone = _product(shim, w, np.ascontiguousarray(x[[m - 1, 0]]), 0.5)[0]
            assert (alone[0] == together[m - 1]).all() and (alone[1] == together[0]).all()
    # Groups other than 32 stay on the float32 kernels (below 16 rows, not the GEMM's): a row's sums are the
    # one-row kernel's.
    x = rng.standard_normal((12, 512)).astype(np.float32)
    for group, amx in [(64, 2), (32, 0)]:  # groups of 64 stay on float32 kernels; then MLXPIPE_AMX=off
        shim.mlxpipe_qgemm_amx(amx)
        w, *_alive = _registered(shim, rng, 64, 512, 4, group)
        assert (_product(shim, w, x)[0][5] == _product(shim, w, x[5:6])[0][0]).all()


def test_avx2_gemm_products_match_numpy_and_depend_on_their_row_alone(openblas: Any) -> None:
    # Products of 16 rows or more with the AVX2 kernels: a GEMM on W's dequantized rows (on a CPU with
    # AVX-512 too, where the AVX2 kernels are asked for).
    shim = _own_shim(openblas, quantized=True, avx2=True)
    rng = np.random.default_rng(19)

    # Partial tiles of 6 rows of W and of 16 of A; 4 and 8 bits; groups of 32 and 64; the helper or not;
    # 300 rows: chunks of 64.
    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (577, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    for (n, k, bits, group), threads in itertools.product(shapes, [1, 2]):
        shim.mlxpipe_qgemm_threads(threads)
        w, *_alive = _registered(shim, rng, n, k, bits, group)
        x = rng.standard_normal((300, k + 5)).astype(np.float32)[:, :k]  # a row stride other than k
        first = None
        for m in [16, 17, 64, 300]:
            want = 0.5 * (x[:m].astype(np.float64) @ w.T.astype(np.float64))
            together = _product(shim, w, x[:m], 0.5)[0]
            np.testing.assert_allclose(together, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            first = together[:16] if first is None else first
            assert (together[:16] == first).all()  # the same rows, whatever the rows beside them
        order = rng.permutation(20)  # and wherever they stand
        moved = _product(shim, w, np.ascontiguousarray(x[order]), 0.5)[0]
        assert (moved[np.argsort(order)][:16] == first).all()


def test_avx512_gemm_products_are_the_avx2_gemms_to_the_last_bit(openblas: Any) -> None:
    # Products of 16 rows or more with the AVX-512 kernels: the AVX2 GEMM's sums on 16 lanes, k in chunks of
    # 256 columns, 12 rows of W a tile (so the same numbers on either kind of x86-64 CPU).
    shim = _own_shim(openblas, quantized=True)
    gemm512 = getattr(shim, "mlxpipe_qgemm_gemm512", None)
    if gemm512 is None or not gemm512(16):
        pytest.skip("no AVX-512 on this CPU")
    rng = np.random.default_rng(23)

    # Partial tiles of 12 rows of W and of 32 or 16 of A; k of one chunk, of a partial last chunk (288, 1536 =
    # 6 x 256), 4 and 8 bits, groups of 32 and 64, the helper or not; 300 rows: chunks of 64.
    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (577, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    shapes += [(40, 288, 4, 32), (13, 128, 8, 32)]
    try:
        for (n, k, bits, group), threads in itertools.product(shapes, [1, 2]):
            shim.mlxpipe_qgemm_threads(threads)
            w, *_alive = _registered(shim, rng, n, k, bits, group)
            x = rng.standard_normal((300, k + 5)).astype(np.float32)[:, :k]  # a row stride other than k
            for m in [16, 17, 33, 64, 300]:
                want = 0.5 * (x[:m].astype(np.float64) @ w.T.astype(np.float64))
                wide = _product(shim, w, x[:m], 0.5)[0]
                np.testing.assert_allclose(wide, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
                shim.mlxpipe_qgemv_avx2(1)
                narrow = _product(shim, w, x[:m], 0.5)[0]
                shim.mlxpipe_qgemv_avx2(0)
                assert (wide == narrow).all(), (n, k, bits, group, m)
    finally:
        shim.mlxpipe_qgemv_avx2(0)
        shim.mlxpipe_qgemm_threads(1)


def _int8_reference(
    x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, parts: int
) -> Any:
    """x W^T as the 8-bit kernels define it, in float64: each row quantized per group (scale sx = max|x| /
    127) to q1 + q2 / 256 (q1 rounded to nearest, q2 the rest rounded, with two parts), integer dot products,
    then the sum over groups of scale * sx * dot + bias * sum(x)."""
    n, groups = scales.shape
    q = _values(packed, bits)
    xg = x.reshape(x.shape[0], groups, -1)
    amax = np.abs(xg).max(-1)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    y = xg * inverse[..., None]  # float32 products, as the kernels round them
    xq = np.rint(y)
    rest = np.clip(np.rint((y - xq) * np.float32(256)), -128, 127) if parts == 2 else np.zeros_like(y)
    w = q.reshape(n, groups, -1)
    dots = np.einsum("mgj,ngj->mng", xq.astype(np.int64), w).astype(np.float64)
    dots += np.einsum("mgj,ngj->mng", rest.astype(np.int64), w) / 256
    sx = (amax / np.float32(127)).astype(np.float64)
    return (dots * scales[None] * sx[:, None] + biases[None] * xg.astype(np.float64).sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("parts", [1, 2])
def test_int8_products_sum_integers_and_a_rows_numbers_depend_on_it_alone(openblas: Any, parts: int) -> None:
    # Where the integer products run (VNNI, or AVX2 alone), products by attached matrices quantize A's rows to
    # one 8-bit part (as llama.cpp's CPU products do) or two, and sum integers: every row count, one row or a
    # batch's or a prompt's, on one thread or two, gives a row the very numbers it gets alone (--batch 1's),
    # to the bit.
    shim = _own_shim(openblas, quantized=True)
    if shim.mlxpipe_qgemm_int8(parts) != parts:
        pytest.skip("no integer products on this CPU")
    rng = np.random.default_rng(29)
    ptr = ctypes.c_void_p
    # Partial tiles of 32 rows of W and of 8 of A; 2 to 8 bits (2, 3, 5, 6: low bits and a plane of high
    # bits); groups of 32, 64, 128; 300 rows of A.
    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (577, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    shapes += [(40, 256, 4, 128), (13, 128, 8, 32)]  # smaller than sgemv is worth: still these kernels
    shapes += [(1536, 576, 6, 32), (193, 640, 6, 64), (97, 512, 6, 128), (577, 576, 5, 32), (40, 512, 5, 128)]
    shapes += [(193, 576, 3, 32), (97, 512, 3, 128), (40, 640, 2, 64)]
    try:
        for (n, k, bits, group), threads in itertools.product(shapes, [1, 2]):
            shim.mlxpipe_qgemm_threads(threads)
            w, packed, scales, biases = _registered(shim, rng, n, k, bits, group)
            x = rng.standard_normal((300, k + 5)).astype(np.float32)[:, :k]  # a row stride other than k
            x[7, :group] = 0.0  # a group of zeros: scale 0
            want = _int8_reference(x, packed, scales, biases, bits, parts)
            exact = x.astype(np.float64) @ w.T.astype(np.float64)
            # each row alone, as a one-stream decode step computes it (also as a strided column)
            alone = np.zeros((9, n), np.float32)
            column = np.array(x[:9].T, order="C")
            for i in range(9):
                shim.cblas_sgemm(
                    ROW_MAJOR, NO_TRANS, TRANS, 1, n, k, ctypes.c_float(1.0), ptr(x[i:].ctypes.data), k + 5,
                    ptr(w.ctypes.data), k, ctypes.c_float(0.0), ptr(alone[i].ctypes.data), n,
                )  # fmt: skip
                across = np.zeros(n, np.float32)
                shim.cblas_sgemm(
                    ROW_MAJOR, TRANS, TRANS, 1, n, k, ctypes.c_float(1.0), ptr(column.ctypes.data + 4 * i), 9,
                    ptr(w.ctypes.data), k, ctypes.c_float(0.0), ptr(across.ctypes.data), n,
                )  # fmt: skip
                assert (across == alone[i]).all()
            np.testing.assert_allclose(alone, want[:9], rtol=1e-5, atol=1e-5 * np.abs(want).max())
            # within what 8-bit activations cost: ~1% of the largest value with one part, 1e-4 with two
            assert np.abs(alone - exact[:9]).max() < (0.03 if parts == 1 else 2e-4) * np.abs(exact).max()
            for m in [2, 7, 9, 16, 17, 64, 300]:
                together, quantized = _product(shim, w, x[:m], 0.5)
                assert quantized
                scale = np.abs(want).max()
                np.testing.assert_allclose(together, 0.5 * want[:m], rtol=1e-5, atol=1e-5 * scale)
                assert (together[: min(m, 9)] == 0.5 * alone[: min(m, 9)]).all(), (n, k, bits, group, m)
            order = rng.permutation(20)  # wherever a row stands
            moved = _product(shim, w, np.ascontiguousarray(x[order]))[0]
            assert (moved[np.argsort(order)][:9] == alone).all()
        # MLXPIPE_INT8=off: the float32 kernels again, their own sums
        assert not shim.mlxpipe_qgemm_int8(0)
        floats = _product(shim, w, x[:17])[0]
        np.testing.assert_allclose(floats, exact[:17], rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    finally:
        shim.mlxpipe_qgemm_int8(0)
        shim.mlxpipe_qgemm_threads(1)


HALF, SYMMETRIC = 1, 2  # gemv.c's forms of a packed copy: 16-bit scales and biases; no biases
AVX_VNNI, AVX512_VNNI = 1, 2  # gemv.c's kinds of integer tiles (mlxpipe_qgemm_int8_kind; 3: AVX2 alone)


def _integer_shim(openblas: Any) -> tuple[Any, bool]:
    """The tests' library with the integer products (skipped where none run), and whether AVX2's tiles run
    here too (beside AVX-512's)."""
    shim = _own_shim(openblas, quantized=True)
    if shim.mlxpipe_qgemm_int8(2) != 2:
        pytest.skip("no integer products on this CPU")
    shim.mlxpipe_qgemm_int8_forms.restype = ctypes.c_long
    shim.mlxpipe_qgemv_avx2(1)
    narrow = shim.mlxpipe_qgemm_int8(2) == 2
    shim.mlxpipe_qgemv_avx2(0)
    return shim, narrow


def _products_by_form(
    shim: Any, arrays: tuple[np.ndarray, ...], bits: int, group: int, x: np.ndarray, form: int, narrow: bool
) -> np.ndarray:
    """Register ``arrays`` with packed copies of ``form`` allowed and not, on AVX-512's tiles (and AVX2's
    where ``narrow``): each copy has the form or not as allowed, and every product (one row: qgemv's path;
    2, 17 and 64 rows) is the same, to the bit. Returns the 64-row product."""
    allow = shim.mlxpipe_qgemm_int8_half if form == HALF else shim.mlxpipe_qgemm_int8_symmetric
    w = arrays[0]
    got = {}
    for allowed, avx2 in itertools.product([0, 1], [0, 1] if narrow else [0]):
        allow(allowed)
        shim.mlxpipe_qgemv_avx2(avx2)
        held = shim.mlxpipe_qgemm_int8_forms(form)
        _register(shim, arrays, bits, group)
        got[allowed, avx2] = [_product(shim, w, x[:m])[0] for m in (1, 2, 17, 64)]
        assert shim.mlxpipe_qgemm_int8_forms(form) - held == allowed  # this copy in that form or not
        shim.mlxpipe_qgemv_unregister(ctypes.c_void_p(w.ctypes.data))
        shim.mlxpipe_qgemv_release()
    allow(1)
    for key, products in got.items():
        assert all((a == b).all() for a, b in zip(products, got[0, 0], strict=True)), (w.shape, bits, key)
    shim.mlxpipe_qgemv_avx2(0)
    return got[1, 0][3]


def test_float16_scales_kept_in_16_bits_give_the_same_numbers(openblas: Any) -> None:
    # A GGUF file's scales and biases are float16 values: the integer products' repacked copy keeps them in 16
    # bits (a sixth fewer bytes a weight to read), and every product, one row or many, AVX-512's and AVX2's,
    # is the one the 32-bit copy gives, to the bit. A matrix with a scale float16 cannot hold keeps 32.
    shim, narrow = _integer_shim(openblas)
    rng = np.random.default_rng(37)
    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (577, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    shapes += [(193, 576, 6, 32), (97, 512, 5, 64)]
    try:
        for (n, k, bits, group), parts in itertools.product(shapes, [1, 2]):
            shim.mlxpipe_qgemm_int8(parts)
            arrays = w, _, scales, biases = _quantized(rng, n, k, bits, group)
            scales[...], biases[...] = scales.astype(np.float16), biases.astype(np.float16)
            x = rng.standard_normal((64, k)).astype(np.float32)
            _products_by_form(shim, arrays, bits, group, x, HALF, narrow)
        shim.mlxpipe_qgemm_int8_half(1)
        held = shim.mlxpipe_qgemm_int8_forms(HALF)
        w, *_alive = _registered(shim, rng, 64, 256, 4)  # float32 scales: not float16 values
        assert _product(shim, w, x[:4, :256])[1]
        assert shim.mlxpipe_qgemm_int8_forms(HALF) == held
    finally:
        shim.mlxpipe_qgemm_int8_half(1)
        shim.mlxpipe_qgemv_avx2(0)
        shim.mlxpipe_qgemm_int8(0)


def test_symmetric_matrices_leave_their_biases_out_and_give_the_same_numbers(openblas: Any) -> None:
    # GGUF's Q8_0, Q4_0 and Q5_0 convert to biases of -2^(bits-1) times the scale: the packed copy leaves them
    # out (a Q8_0 weight reads 8.5 bits, not 9) and the kernels compute each from its scale, the very number:
    # every product, one row or many, either part count, AVX-512's and AVX2's, 16- or 32-bit scales, is the
    # copy-with-biases' to the bit. A bias off by one step of float32 keeps the biases.
    shim, narrow = _integer_shim(openblas)
    rng = np.random.default_rng(41)
    shapes = [(4096, 576, 8, 32), (97, 512, 8, 64), (1536, 576, 4, 32), (193, 576, 5, 32), (577, 1536, 6, 64)]
    try:
        for (n, k, bits, group), parts, half in itertools.product(shapes, [1, 2], [0, 1]):
            shim.mlxpipe_qgemm_int8(parts)
            shim.mlxpipe_qgemm_int8_half(half)
            w, packed, scales, biases = _quantized(rng, n, k, bits, group)
            scales[...] = scales.astype(np.float16)
            biases[...] = scales * -(2.0 ** (bits - 1))
            w[...] = (
                _values(packed, bits).reshape(n, -1, group) * scales[..., None] + biases[..., None]
            ).reshape(n, k)
            x = rng.standard_normal((64, k)).astype(np.float32)
            product = _products_by_form(shim, (w, packed, scales, biases), bits, group, x, SYMMETRIC, narrow)
            if parts == 2:  # (one part is MLXPIPE_INT8=1's coarser choice, tested elsewhere)
                want = x.astype(np.float64) @ w.T.astype(np.float64)
                np.testing.assert_allclose(product, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
        shim.mlxpipe_qgemm_int8_symmetric(1)
        held = shim.mlxpipe_qgemm_int8_forms(SYMMETRIC)
        w, packed, scales, biases = _quantized(rng, 64, 256, 8)
        biases[...] = scales * -128.0
        biases[5, 3] = np.nextafter(biases[5, 3], np.float32(1))  # one bias off: not symmetric
        _register(shim, (w, packed, scales, biases), 8)
        assert _product(shim, w, x[:4, :256])[1]
        assert shim.mlxpipe_qgemm_int8_forms(SYMMETRIC) == held
        shim.mlxpipe_qgemv_unregister(ctypes.c_void_p(w.ctypes.data))
    finally:
        shim.mlxpipe_qgemm_int8_symmetric(1)
        shim.mlxpipe_qgemm_int8_half(1)
        shim.mlxpipe_qgemv_avx2(0)
        shim.mlxpipe_qgemm_int8(0)


def test_avx_vnni_products_are_the_avx512_ones_to_the_last_bit(openblas: Any) -> None:
    # A CPU with AVX-VNNI but not AVX-512 (AVX2 and 256-bit VNNI) takes the same integer products, 8 lanes a
    # register: the same numbers as AVX-512's (tried where the CPU has both).
    shim = _own_shim(openblas, quantized=True)
    if shim.mlxpipe_qgemm_int8(2) != 2 or shim.mlxpipe_qgemm_int8_kind() != AVX512_VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU")
    shim.mlxpipe_qgemv_avx2(1)
    both = shim.mlxpipe_qgemm_int8_kind() == AVX_VNNI
    shim.mlxpipe_qgemv_avx2(0)
    if not both:
        pytest.skip("no AVX-VNNI beside AVX-512 VNNI on this CPU")
    _avx_vnni_tiles_match(shim)


def test_avx_vnni_tiles_by_avx512s_vnni_are_the_avx512_ones(openblas: Any, tmp_path: Path) -> None:
    # Where the CPU has AVX-512 VNNI but not AVX-VNNI (Zen 4), the AVX2 tiles still run: built with AVX-512
    # VL's encoding of the same 256-bit vpdpbusd (a test build), they give AVX-512's numbers, every width.
    cc = shutil.which("cc")
    shim = _own_shim(openblas, quantized=True)
    if cc is None or shim.mlxpipe_qgemm_int8(2) != 2 or shim.mlxpipe_qgemm_int8_kind() != AVX512_VNNI:
        pytest.skip("no C compiler or no AVX-512 VNNI on this CPU")
    source = (Path(gemv.__file__).parent / "gemv.c").read_text()
    detect = "int avxvnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);"
    vex = '"%{vex%} vpdpbusd '
    assert source.count(detect) == 1 and source.count(vex) == 1
    source = source.replace(
        detect, 'int avxvnni = __builtin_cpu_supports("avx512vl"); (void)a, (void)b, (void)c, (void)d;'
    )
    source = source.replace(vex, '"vpdpbusd ')  # EVEX's encoding (AVX-512 VL): the same operation
    (tmp_path / "vnni.c").write_text(source)
    command = [
        cc,
        "-O2",
        "-shared",
        "-fPIC",
        "-o",
        str(tmp_path / "vnni.so"),
        str(tmp_path / "vnni.c"),
        "-lm",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    emulated = ctypes.CDLL(str(tmp_path / "vnni.so"), mode=ctypes.RTLD_LOCAL)
    assert emulated.mlxpipe_gemv_init(
        ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p)
    )
    emulated.mlxpipe_qgemv_avx2(1)
    if emulated.mlxpipe_qgemm_int8_kind() != AVX_VNNI:
        pytest.skip("no AVX-512 VL on this CPU")
    emulated.mlxpipe_qgemv_avx2(0)
    _avx_vnni_tiles_match(emulated)


def test_avx2_alone_tiles_are_the_avx512_ones_to_the_last_bit(openblas: Any) -> None:
    # A CPU with AVX2 but no VNNI (Zen 2 and 3, Intel before Alder Lake) sums the same integers by other
    # instructions (vpmaddubsw below 8 bits, vpmaddwd by 16-bit words at 8): the same numbers as AVX-512
    # VNNI's (tried where the CPU has it).
    shim = _own_shim(openblas, quantized=True)
    if shim.mlxpipe_qgemm_int8(2) != 2 or shim.mlxpipe_qgemm_int8_kind() != AVX512_VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU")
    shim.mlxpipe_qgemm_int8_emulated(2)
    try:
        _avx_vnni_tiles_match(shim)
    finally:
        shim.mlxpipe_qgemm_int8_emulated(1)


def _avx_vnni_tiles_match(shim: Any) -> None:
    """Products by ``shim``'s AVX2 integer tiles (mlxpipe_qgemv_avx2) are its AVX-512 ones, to the bit."""
    rng = np.random.default_rng(31)
    ptr = ctypes.c_void_p
    shim.mlxpipe_qgemm_max_rows(gemv.MAX_ROWS)
    shapes = [(1536, 576, 4, 32), (193, 576, 4, 32), (577, 1536, 4, 64), (4096, 576, 8, 32), (97, 512, 8, 64)]
    shapes += [(193, 576, 6, 32), (577, 640, 6, 64), (97, 512, 5, 32), (40, 256, 5, 128), (97, 512, 3, 64)]
    shapes += [(40, 256, 2, 32)]
    symmetric = [(4096, 576, 8, 32), (193, 576, 4, 32)]  # as GGUF's Q8_0, Q4_0: copied without biases
    try:
        for (n, k, bits, group), threads, parts in itertools.product([*shapes, *symmetric], [1, 2], [1, 2]):
            shim.mlxpipe_qgemm_threads(threads)
            shim.mlxpipe_qgemm_int8(parts)
            w, *_alive = arrays = _quantized(rng, n, k, bits, group)
            if (n, k, bits, group) in symmetric:
                arrays[3][...] = arrays[2] * -(2.0 ** (bits - 1))
            _register(shim, arrays, bits, group)
            x = rng.standard_normal((64, k + 5)).astype(np.float32)[:, :k]
            for m in [1, 2, 3, 17, 64]:
                wide = _product(shim, w, x[:m])[0] if m > 1 else None
                shim.mlxpipe_qgemv_avx2(1)
                narrow = _product(shim, w, x[:m])[0] if m > 1 else None
                shim.mlxpipe_qgemv_avx2(0)
                if m == 1:  # a one-row product: qgemv's path
                    wide, narrow = np.zeros((1, n), np.float32), np.zeros((1, n), np.float32)
                    for out, avx2 in [(wide, 0), (narrow, 1)]:
                        shim.mlxpipe_qgemv_avx2(avx2)
                        shim.cblas_sgemm(
                            ROW_MAJOR, NO_TRANS, TRANS, 1, n, k, ctypes.c_float(1.0), ptr(x.ctypes.data), k,
                            ptr(w.ctypes.data), k, ctypes.c_float(0.0), ptr(out.ctypes.data), n,
                        )  # fmt: skip
                    shim.mlxpipe_qgemv_avx2(0)
                assert (wide == narrow).all(), (n, k, bits, group, m, threads, parts)
    finally:
        shim.mlxpipe_qgemv_avx2(0)
        shim.mlxpipe_qgemm_int8(0)
        shim.mlxpipe_qgemm_threads(1)


@pytest.mark.model
def test_the_kernels_compute_the_embedded_model_from_its_quantized_weights_alone(
    engine: Any, float32_engine: Any
) -> None:
    # --dtype auto on a CPU: every matrix by mlxpipe's mlx operation, its packed copy the only one; the logits
    # as the float32 model's within the integer products' error, the same greedy pick.
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxpipe.cpu import kernels, quantized

    if engine.dtype != "quantized" or not kernels.available():
        pytest.skip("mlxpipe's kernels do not run here (a GPU, a CPU without AVX-512 or AVX2, no compiler)")
    layer = engine.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.__dict__[quantized.MATRIX], kernels.Matrix)
    if gemv.int8_activations():  # the packed copy is the only one: neither the layer nor the matrix holds any
        assert layer.mlp.down_proj.__dict__[quantized.MATRIX].arrays == ()
    tokens = mx.array(
        [engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")]
    )

    def last_logits(model: Any) -> Any:
        cache = make_prompt_cache(model)
        mx.eval(model(tokens[:, :-1], cache=cache))  # several rows, then one
        out = model(tokens[:, -1:], cache=cache)[0, -1]
        mx.eval(out)
        return out

    ours, plain = last_logits(engine.model), last_logits(float32_engine.model)
    assert (mx.abs(ours - plain).max() < 1e-3 * mx.abs(plain).max()).item()
    assert mx.argmax(ours).item() == mx.argmax(plain).item()

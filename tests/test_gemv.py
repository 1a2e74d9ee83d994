"""The cblas_sgemm in front of the BLAS (mlxpipe/gemv.c): same products as the BLAS, one-row ones via sgemv.

The C function is checked directly against numpy for every layout, and then through mlx in a fresh process
(mlx binds its BLAS when first imported, so the loader must run before that).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, cli_env

from mlxpipe import blas, gemv

ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112


@pytest.fixture
def openblas() -> Any:
    candidates = blas._candidates()
    if sys.platform != "linux" or not candidates:
        pytest.skip("no OpenBLAS on this machine")
    return ctypes.CDLL(candidates[0][1], mode=ctypes.RTLD_LOCAL)  # never global inside the test process


def _stored(matrix: np.ndarray, order: int, trans: int) -> tuple[np.ndarray, int]:
    """The buffer and leading dimension BLAS expects for op(X) = matrix."""
    x = matrix.T if trans == TRANS else matrix
    if order == COL_MAJOR:
        return np.array(x, order="F"), x.shape[0]  # always a copy: BLAS writes into C
    return np.array(x, order="C"), x.shape[1]


def test_forwarding_sgemm_matches_numpy_for_every_layout(
    openblas: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # compiles it afresh
    shim = ctypes.CDLL(gemv._built(), mode=ctypes.RTLD_LOCAL)
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


_THROUGH_MLX = """
import json, numpy as np
from mlxpipe import blas
choice = blas.setup()
import mlx.core as mx
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
    if setting == "off":
        assert out["gemv"] == "off (MLXPIPE_GEMV=off)"
    elif blas._candidates() and sys.platform == "linux":
        assert out["gemv"] == "one-row products go to sgemv"


def test_without_a_compiler_nothing_is_forwarded(
    openblas: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gemv.ENV, raising=False)
    monkeypatch.setattr(gemv.shutil, "which", lambda name: None)
    assert gemv.install(openblas) == "not built: no C compiler (cc) found"
    assert not list(tmp_path.rglob("*.so"))


def test_a_library_without_sgemv_is_left_alone() -> None:
    class NotABlas:
        cblas_sgemm = None

    assert gemv.install(NotABlas()).startswith("not used")

"""What a new user meets first: mlx without a backend, a slow CPU path said, package metadata, `make setup`.

The first two are tested through the real command in a subprocess: the missing backend by putting a copy of
mlx's own extension module first on the path without the libmlx it links to (what plain ``mlx`` without
``mlx-cpu``/``mlx-cuda`` is on Linux), so that the loader's own error is what mlxpipe turns into one line; the
slow path with a C compiler that fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, blas_runs_here, cli_env, run_cli

from mlxpipe.cpu import blas
from mlxpipe.paths import cache_dir


def _mlx_without_its_library(tmp_path: Path) -> Path:
    """A folder holding an ``mlx`` package whose ``core`` extension is mlx's own, without ``lib/libmlx``."""
    spec = importlib.util.find_spec("mlx.core")
    assert spec is not None and spec.origin, "mlx is not installed"
    core = Path(spec.origin)
    if not core.name.startswith("core.") or core.suffix not in (".so", ".pyd"):
        pytest.skip(f"mlx.core is not an extension module here: {core}")
    shadow = tmp_path / "shadow"
    (shadow / "mlx").mkdir(parents=True)
    # Copied, not linked: the loader finds libmlx relative to the file's own folder ($ORIGIN/lib).
    shutil.copy2(core, shadow / "mlx" / core.name)
    return shadow


def _env_without_backend(tmp_path: Path) -> dict[str, str]:
    # mlx has no __init__.py (a namespace package): the first folder on the path with mlx/core wins.
    # The rest of PYTHONPATH stays after it (where mlxpipe's other dependencies may live, as on the H200).
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    shadow = [str(REPO), str(_mlx_without_its_library(tmp_path))]
    return cli_env(PYTHONPATH=os.pathsep.join(shadow + rest))


def test_mlx_without_a_backend_is_one_line_and_exit_3(tmp_path: Path) -> None:
    probe = run_cli([], input="hi\n", env=_env_without_backend(tmp_path), timeout=120)
    err = probe.stderr.decode()
    assert probe.returncode == 3, err
    assert probe.stdout == b""
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    if sys.platform == "linux":
        assert err == "mlxpipe: error: mlx has no backend here; install 'mlxpipe[cpu]' (or [cuda13])\n"
    else:
        assert err.startswith("mlxpipe: error: mlx could not be imported: "), err


def test_help_and_version_need_no_backend(tmp_path: Path) -> None:
    env = _env_without_backend(tmp_path)
    for args in (["--help"], ["--version"]):
        r = run_cli(args, env=env, timeout=60)
        assert r.returncode == 0 and r.stderr == b"" and r.stdout


def _fast_blas_expected() -> bool:
    """Whether this machine loads an optimized BLAS in front of mlx (a Linux CPU with one installed)."""
    return sys.platform == "linux" and bool(blas._candidates()) and blas._cuda_backend() is None


@pytest.mark.model
@pytest.mark.cpu_paths
@pytest.mark.skipif(not _fast_blas_expected(), reason="the one-row kernels are built only on a Linux CPU")
def test_a_slow_path_is_said_once_when_a_run_starts_and_not_with_quiet(tmp_path: Path) -> None:
    # A compiler that fails (a broken toolchain): the kernels cannot be built, and the run says so once,
    # with the compiler's own message, before the first answer; the next run does not compile again.
    cache = tmp_path / "cache"
    (cache / "mlxpipe").mkdir(parents=True)
    models = cache_dir() / "models"  # the converted embedded model, shared: not converted again
    models.mkdir(parents=True, exist_ok=True)
    (cache / "mlxpipe" / "models").symlink_to(models)
    runs = tmp_path / "runs"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho run >> {runs}\necho 'gemv.c:1: error: no stdint.h' >&2\nexit 1\n")
    cc.chmod(0o755)
    env = cli_env(XDG_CACHE_HOME=str(cache), CC=str(cc))
    r = run_cli(["-n", "2"], input="hi\nho\n", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(b"\n") == 2
    cause = (
        "cc failed: gemv.c:1: error: no stdint.h; it is tried again with another compiler, once space "
        "is freed or after a day"
    )
    runs_here = [source for source, path in blas._candidates() if blas_runs_here(source, path)]
    if runs_here and runs_here[0] in blas._PREFIXES:  # scipy-openblas32 (a CPU without AVX-512)
        # Its functions are reached only through the kernels' library: without it, no optimized BLAS.
        warning = (
            "float32 matrix products run on mlx's reference BLAS, 11-14x slower for batches and prompts: "
            "scipy-openblas32 is reached only through mlxpipe's cblas_sgemm (its functions are named "
            "scipy_cblas_*), which was not built: " + cause
        )
    else:
        warning = "one-row products are not sent to sgemv, a single stream decodes about 3x slower: " + cause
    assert r.stderr.decode().splitlines() == [f"mlxpipe: warning: {warning}"]
    quiet = run_cli(["-q", "-n", "2"], input="hi\n", env=env)
    assert quiet.returncode == 0 and quiet.stdout and quiet.stderr == b""
    assert runs.read_text().count("run") == 1  # remembered: the second run did not compile


@pytest.mark.model
@pytest.mark.cpu_paths
@pytest.mark.skipif(not _fast_blas_expected(), reason="an optimized BLAS is loaded only on a Linux CPU")
def test_model_info_gives_the_loaders_own_reason(tmp_path: Path) -> None:
    missing = tmp_path / "libopenblas.so.0"
    r = run_cli(["--model-info"], env=cli_env(MLXPIPE_BLAS=str(missing)))
    assert r.returncode == 0 and r.stderr == b"", r.stderr  # --model-info carries it in its JSON
    reason = json.loads(r.stdout)["blas"]["reason"]
    assert reason.startswith(f"MLXPIPE_BLAS would not load ({missing}: cannot open shared object file")


def test_the_package_is_described_once_and_ships_its_license_and_types() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    meta = project["project"]
    # One version: the package's own, which --version prints and setuptools reads without importing it.
    assert "version" not in meta and "version" in meta["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mlxpipe.__version__"}
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "the mlxpipe authors" in license_text
    # PEP 561: the typed API (mlxpipe.run, the events) is typed for its users' checkers too.
    assert (REPO / "mlxpipe" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["mlxpipe"]
    assert "Typing :: Typed" in meta["classifiers"] and meta["urls"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_setup_installs_again_when_other_extras_are_asked_for(tmp_path: Path) -> None:
    shutil.copy2(REPO / "pyproject.toml", tmp_path)
    shutil.copy2(REPO / "Makefile", tmp_path)
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / ".extras").write_text("cpu,test\n")  # what an earlier `make setup` left
    (venv / ".installed-cpu+test").touch()

    def planned(*args: str) -> str:
        r = subprocess.run(["make", "-n", "setup", *args], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "pip install" not in planned()  # the same extras: installed already
    assert 'pip install -qq -e ".[cuda13,test]"' in planned("EXTRAS=cuda13,test")
    (venv / ".extras").write_text("cuda13,test\n")
    (venv / ".installed-cuda13+test").touch()
    assert "pip install" not in planned()  # a later plain `make test` keeps the GPU's extras

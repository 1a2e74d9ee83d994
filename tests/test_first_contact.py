"""What a new user meets first: an install without an mlx backend, the notice of a slow CPU path.

Each is tested through the real command in a subprocess: the missing backend by putting a copy of mlx's
own extension module first on the path without the libmlx it links to (what plain ``mlx`` without
``mlx-cpu``/``mlx-cuda`` is on Linux), so the loader's own error is what mlxpipe turns into one line.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, run_cli


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
    return cli_env(PYTHONPATH=os.pathsep.join([str(REPO), str(_mlx_without_its_library(tmp_path))]))


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

"""Model errors and --model-info through the real command: one clear line, exit 3, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env, run_cli
from test_models import _embedded_gguf, _write_gguf

pytestmark = pytest.mark.model


def _one_line_error(r, *needles: str) -> None:
    err = r.stderr.decode()
    assert r.returncode == 3, err
    assert r.stdout == b""
    assert err.count("\n") == 1 and err.startswith("mlxpipe: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_missing_model_path(tmp_path: Path) -> None:
    _one_line_error(run_cli(["-m", str(tmp_path / "nope.gguf")], input="hi\n"), "nope.gguf")


def test_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(_embedded_gguf().read_bytes()[:2_000_000])
    _one_line_error(run_cli(["-m", str(path)], input="hi\n"), "truncated")


def test_unsupported_architecture_via_env(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "g.gguf", "gpt2", {"wte": (np.ones((4, 8), np.float32), None)})
    r = run_cli([], input="hi\n", env=cli_env(MLXPIPE_MODEL=str(path)))
    _one_line_error(r, "gpt2")


def test_model_info_is_one_json_object() -> None:
    r = run_cli(["--model-info"])
    assert r.returncode == 0 and r.stderr == b""
    info = json.loads(r.stdout)
    assert info["source"] == "embedded" and info["architecture"] == "llama"
    assert info["context_length"] == 8192 and info["has_chat_template"] is True
    assert 120e6 < info["parameters"] < 150e6

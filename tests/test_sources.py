"""Where models come from besides files: Hugging Face ids from a local cache, Ollama names, bare names.

The caches are built in the test: a tiny random-weight GGUF (tests/gguf_factory.py) converted by mlxpipe's
own converter into the hub cache's layout, or placed as an Ollama blob with its manifest. No network.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import cli_env, run_cli, seed_cache
from gguf_factory import mlx_folder_from_gguf, tiny_bpe, write_gguf

from mlxpipe.models import ModelError, materialize, resolve
from mlxpipe.models import hub as hub_module

REPO_ID = "tiny-org/Tiny-Llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLXPIPE_MODEL", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", tiny_bpe())


def _hub_cache(root: Path, tiny_gguf: Path, repo_id: str = REPO_ID) -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = mlx_folder_from_gguf(tiny_gguf, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def _ollama_store(root: Path, gguf: Path, name: str = "tiny", tag: str = "latest") -> Path:
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


def _one_line_error(r: object, *needles: str) -> str:
    err: str = r.stderr.decode()  # type: ignore[attr-defined]
    assert r.returncode == 3, err  # type: ignore[attr-defined]
    assert err.count("\n") == 1 and err.startswith("mlxpipe: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


# --- Hugging Face ids


def test_hub_id_resolves_from_hf_home(tmp_path: Path, tiny_gguf: Path) -> None:
    snapshot = _hub_cache(tmp_path / "hf" / "hub", tiny_gguf)
    source = resolve(REPO_ID)
    assert (source.kind, source.path) == ("hub", snapshot)
    assert materialize(source) == str(snapshot)


def test_hub_cache_variable_wins_and_any_snapshot_serves(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _hub_cache(tmp_path / "elsewhere", tiny_gguf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert resolve(REPO_ID).path == snapshot
    # A cache whose refs/main is missing (a download by revision) still serves its snapshot.
    (snapshot.parents[1] / "refs" / "main").unlink()
    assert resolve(REPO_ID).path == snapshot


def test_uncached_hub_id_offline_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve("nobody/nothing")
    assert (source.kind, source.path) == ("hub", None)
    with pytest.raises(ModelError) as info:
        materialize(source)
    message = str(info.value)
    assert str(tmp_path / "hf" / "hub" / "models--nobody--nothing") in message
    assert "hf download nobody/nothing" in message and "HF_HUB_OFFLINE" in message


def test_uncached_hub_id_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    # Port 9 on loopback refuses at once: the same path a network that is down takes, without its waits.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelError, match=r"cannot be reached; fetch it with: hf download nobody/nothing"):
        materialize(resolve("nobody/nothing"))


def test_hub_cache_location_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hub_module.hub_cache() == tmp_path / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert hub_module.hub_cache() == tmp_path / "h" / "hub"


@pytest.mark.model
def test_hub_id_through_the_command(tmp_path: Path, tiny_gguf: Path) -> None:
    snapshot = _hub_cache(tmp_path / "hf" / "hub", tiny_gguf)
    seed_cache(tmp_path / "xdg", "gemv", "kernels")  # the compiled libraries: not built again for this
    env = cli_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    r = run_cli(["-m", REPO_ID, "--model-info"], env=env)
    assert r.returncode == 0, r.stderr.decode()
    info = json.loads(r.stdout)
    assert (info["source"], info["spec"], info["folder"]) == ("hub", REPO_ID, str(snapshot))
    assert info["architecture"] == "llama" and info["has_chat_template"] is True

    r = run_cli(["-m", REPO_ID, "--max-tokens", "3", "--raw"], input="hello\n", env=env)
    assert r.returncode == 0, r.stderr.decode()

    _one_line_error(run_cli(["-m", "nobody/nothing"], input="hi\n", env=env), "hf download nobody/nothing")


# --- Ollama names


def test_ollama_name_resolves_to_its_blob(tmp_path: Path, tiny_gguf: Path) -> None:
    blob = _ollama_store(tmp_path / "ollama", tiny_gguf)
    _ollama_store(tmp_path / "ollama", tiny_gguf, tag="q8")
    for spec in ("ollama:tiny", "ollama:tiny:latest", "ollama:library/tiny:q8"):
        source = resolve(spec)
        assert (source.kind, source.path) == ("ollama", blob)
    folder = Path(materialize(resolve("ollama:tiny")))
    assert folder.name.startswith("tiny-") and (folder / "config.json").is_file()
    assert Path(materialize(resolve("ollama:tiny"))) == folder  # converted once


def test_ollama_errors_name_what_is_missing(tmp_path: Path, tiny_gguf: Path) -> None:
    with pytest.raises(ModelError, match="no Ollama model store at"):
        resolve("ollama:tiny")
    blob = _ollama_store(tmp_path / "ollama", tiny_gguf)
    with pytest.raises(ModelError, match=r"'tiny:7b' is not pulled .*ollama pull tiny:7b"):
        resolve("ollama:tiny:7b")
    blob.unlink()
    with pytest.raises(ModelError, match="model blob is missing"):
        resolve("ollama:tiny")
    with pytest.raises(ModelError, match="not an Ollama model name"):
        resolve("ollama:../../etc")


def test_bare_name_lists_the_accepted_forms(tmp_path: Path, tiny_gguf: Path) -> None:
    with pytest.raises(ModelError, match=r"unknown model 'llama3\.2': -m takes .*ollama:NAME") as info:
        resolve("llama3.2")
    assert "\n" not in str(info.value)
    _ollama_store(tmp_path / "ollama", tiny_gguf)
    with pytest.raises(ModelError, match="Ollama has it: -m ollama:tiny"):
        resolve("tiny")
    # A bare id that the hub cache holds (old ids such as gpt2 have no owner) is used.
    _hub_cache(tmp_path / "hf" / "hub", tiny_gguf, repo_id="tinybare")
    assert resolve("tinybare").kind == "hub"


@pytest.mark.model
def test_ollama_through_the_command(tmp_path: Path, tiny_gguf: Path) -> None:
    _ollama_store(tmp_path / "ollama", tiny_gguf)
    seed_cache(tmp_path / "xdg", "gemv", "kernels")  # the compiled libraries: not built again for this
    env = cli_env(OLLAMA_MODELS=str(tmp_path / "ollama"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    r = run_cli(["--model-info"], env={**env, "MLXPIPE_MODEL": "ollama:tiny"})
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["source"] == "ollama"
    _one_line_error(run_cli(["-m", "ollama:missing"], input="hi\n", env=env), "ollama pull missing:latest")
    _one_line_error(run_cli(["-m", "llama3.2"], input="hi\n", env=env), "ollama:NAME[:TAG]")
    shutil.rmtree(tmp_path / "ollama")

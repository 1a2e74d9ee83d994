"""Shared fixtures: the real command, the real embedded model, and a fake engine for fast tests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mlxpipe.events import Chunk, Done
from mlxpipe.records import Record

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``MLXPIPE_CPU=off`` (``make test-portable``: mlx's portable operations, what a Mac runs) the
    tests of the Linux CPU paths themselves have nothing to test."""
    from mlxpipe.switches import CPU, turned_off

    if turned_off(CPU):
        skip = pytest.mark.skip(reason=f"tests the Linux CPU paths, which {CPU}=off turns off")
        for item in items:
            if item.get_closest_marker("cpu_paths"):
                item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """The suite run as from a terminal's foreground, also when a script started it with ``&`` (which
    ignores SIGINT, and the commands the tests start would inherit that, keeping it ignored: mlxpipe does).
    Model conversions and compiled libraries go to a cache of the session's own, never the user's: set
    before collection, which imports ``mlxpipe.cpu`` (that loads, or builds, gemv.c's library)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _user_cache[:] = [os.environ.get("XDG_CACHE_HOME")]
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mlxpipe-tests-cache-")
    _session_cache[:] = [os.environ["XDG_CACHE_HOME"]]


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _session_cache:
        return
    shutil.rmtree(_session_cache.pop(), ignore_errors=True)
    old = _user_cache.pop()
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


_session_cache: list[str] = []  # the session's XDG_CACHE_HOME, while it is set
_user_cache: list[str | None] = []  # XDG_CACHE_HOME before the session


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for running the command from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLXPIPE_MODEL", None)
    env.update(extra)
    return env


def seed_cache(home: Path, *libraries: str) -> None:
    """Give the fresh cache ``home`` (an XDG_CACHE_HOME) the compiled ``libraries`` ("gemv": gemv.c's,
    "kernels": kernels.cpp's) of the session's cache, each with its manifest, so that a run there does not
    compile them again: for tests of something else than building them (a conversion, a model source). Those
    this process does not use (turned off, nothing to forward to, not built here) are left out, as a run
    would leave them; a copy is checked as a run checks it."""

    from mlxpipe import cachefiles
    from mlxpipe.cpu import blas, gemv

    found: list[Path] = []
    with pytest.MonkeyPatch.context() as patch:  # built in the session's cache, once (a test may set its own)
        if _session_cache:
            patch.setenv("XDG_CACHE_HOME", _session_cache[0])
        if "gemv" in libraries and blas.setup().gemv == gemv.FORWARDING:
            found.append(Path(gemv._built()))  # (this process's own was loaded from the cache of its start)
        if "kernels" in libraries:
            from mlxpipe.cpu import kernels

            if kernels.available():
                found.append(Path(kernels._built()))
    folder = home / "mlxpipe"  # mlxpipe.paths.cache_dir() under XDG_CACHE_HOME=home
    folder.mkdir(parents=True, exist_ok=True)
    for library in found:
        for path in (library, library.with_name(library.name + cachefiles.SUM_SUFFIX)):  # its manifest last
            shutil.copy2(path, folder / path.name)
        assert cachefiles.check_file(folder / library.name) is None


MLXPIPE = [sys.executable, "-m", "mlxpipe"]


def ring_port() -> int:
    """A port for ``mlx.launch -n 2 --backend ring -p PORT``: its ranks bind PORT and PORT + 1, so both must
    be free (checking PORT alone let a rank meet a taken PORT + 1 under parallel tests on an H200)."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            if port >= 65535:
                continue
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def run_cli(
    args: list[str],
    input: bytes | str | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``mlxpipe ARGS`` as a real process; stdout and stderr are captured as bytes."""
    data = input.encode() if isinstance(input, str) else input
    return subprocess.run(
        MLXPIPE + args,
        input=data,
        capture_output=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=kwargs.pop("cwd", REPO),
        **kwargs,
    )


@pytest.fixture(scope="session")
def batch_is_exact() -> bool:
    """Whether ``--batch`` answers match one-at-a-time answers: on a CPU they do (where AMX or the AVX2
    GEMM sums products of 16+ rows in another order than one row's, the short greedy texts tested still
    match). On CUDA, ``--batch`` computes with 16-bit weights and the sequential path in quantized kernels;
    batched and single matmuls round differently there, so greedy texts can part after a few words (seen on
    an H200)."""
    r = run_cli(["--model-info", "--batch", "4"])
    assert r.returncode == 0, r.stderr
    return bool(json.loads(r.stdout)["device"].startswith("Device(cpu"))


def blas_runs_here(source: str, path: str) -> bool:
    """Whether the BLAS library at ``path`` loads and runs on this CPU, as mlxpipe.cpu.blas judges it."""
    from mlxpipe.cpu import blas

    try:
        blas.opened(source, path)
    except OSError:
        return False
    return True


def interrupt_a_story(p: subprocess.Popen[bytes], signum: int) -> list[dict[str, Any]]:
    """Feed ``p`` (``mlxpipe --jsonl``) a long story and a second record, send ``signum`` once the story's
    first chunk is out; the events it wrote, to its end."""
    assert p.stdin and p.stdout
    p.stdin.write(b'"Write a long story about a dragon."\n"Second."\n')
    p.stdin.close()
    first = p.stdout.readline()
    assert json.loads(first)["event"] == "chunk"  # generation has started
    p.send_signal(signum)
    return [json.loads(line) for line in (first + p.stdout.read()).splitlines()]


def start_cli(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``mlxpipe ARGS`` as a real process, stdin, stdout and stderr pipes (``kwargs``: Popen's)."""
    return subprocess.Popen(
        [*MLXPIPE, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        cwd=REPO,
        **kwargs,
    )


@pytest.fixture(scope="session")
def engine() -> Any:
    """The real embedded model, loaded once per test session."""
    from mlxpipe.engine import Engine

    return Engine.load()


class FakeEngine:
    """An engine that answers from a queue, for fast tests of io, pipeline and rendering.

    ``enqueue(["a b", ...])`` sets the next answers (each streamed word by word); ``history``
    lists the records it was asked.
    """

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.history: list[Record] = []

    def enqueue(self, answers: list[str]) -> None:
        self.answers.extend(answers)

    def generate(self, record: Record, should_stop: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        self.history.append(record)
        answer = self.answers.pop(0) if self.answers else f"echo: {record.prompt}"
        words = answer.split(" ")
        text = ""
        for n, word in enumerate(words, 1):
            piece = word if n == 1 else " " + word
            text += piece
            yield Chunk(record.index, record.id, piece, n, 100.0, record.sample, record.samples)
        done = Done(record.index, record.id, text, "stop", len(words), 100.0, 3, 300.0, 1000, record.input)
        yield replace(done, sample=record.sample, samples=record.samples)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()

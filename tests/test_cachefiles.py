"""What mlxpipe keeps in its cache is checked before use; interrupted work leaves nothing behind (issue 39).

Real files, real compilers, real processes and signals; a full or noexec filesystem is a small tmpfs mounted
here where the test runs as root and may mount, else the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MLXPIPE, REPO, cli_env, run_cli, seed_cache

from mlxpipe import cachefiles
from mlxpipe.cpu import gemv
from mlxpipe.paths import cache_dir

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Unix files, locks and signals")

SOURCE = "int answer(void) { return 42; }\n"


def _cc() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def _build(folder: Path, cc: str, source: Path) -> Path:
    def command(out: Path) -> list[str]:
        return [cc, "-shared", "-fPIC", "-o", str(out), str(source)]

    return cachefiles.build(folder / "lib-1.so", command, cc, {"source": source.read_text()})


def _script(folder: Path, name: str, body: str) -> Path:
    """A compiler that is a shell script (a broken or hanging toolchain), counting its runs in ``runs``."""
    path = folder / name
    path.write_text(f"#!/bin/sh\necho run >> {folder / 'runs'}\n{body}\n")
    path.chmod(0o755)
    return path


def _runs(folder: Path) -> int:
    runs = folder / "runs"
    return runs.read_text().count("run") if runs.exists() else 0


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, *options: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (root only), unmounted afterwards; skips where it cannot."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a tmpfs needs root on Linux")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


# ---- compiled libraries ----------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["cut short", "empty", "overwritten", "no manifest"])
def test_a_damaged_library_is_built_again(tmp_path: Path, damage: str) -> None:
    cc = _cc()
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    lib = _build(tmp_path / "cache", cc, source)
    whole = lib.read_bytes()
    assert cachefiles.check_file(lib) is None
    if damage == "cut short":
        os.truncate(lib, len(whole) // 2)
    elif damage == "empty":
        os.truncate(lib, 0)
    elif damage == "overwritten":
        lib.write_bytes(bytes(len(whole)))
    else:
        lib.with_name(lib.name + ".sum").unlink()
    assert cachefiles.check_file(lib) is not None
    assert _build(tmp_path / "cache", cc, source) == lib
    assert cachefiles.check_file(lib) is None and len(lib.read_bytes()) == len(whole)
    import ctypes

    assert ctypes.CDLL(str(lib)).answer() == 42


def test_a_cut_short_kernel_is_rebuilt_and_model_info_says_forwarding(tmp_path: Path) -> None:
    # A truncated gemv-*.so was mapped and every run died of SIGBUS (exit 135), --model-info included.
    _cc()
    shared = Path(gemv._built())  # the session cache's library, built once
    cache = tmp_path / "cache" / "mlxpipe"
    cache.mkdir(parents=True)
    (cache_dir() / "models").mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(cache_dir() / "models")  # the converted embedded model: not converted again
    seed_cache(tmp_path / "cache", "kernels")  # kernels.cpp's library: gemv.c's alone is built again
    target = cache / shared.name
    shutil.copyfile(shared, target)
    shutil.copyfile(shared.with_name(shared.name + ".sum"), target.with_name(target.name + ".sum"))
    os.truncate(target, target.stat().st_size // 3)
    r = run_cli(["--model-info"], env=cli_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr
    gemv_said = json.loads(r.stdout)["blas"].get("gemv")
    if gemv_said is not None and not gemv_said.startswith("off"):
        assert gemv_said == gemv.FORWARDING
        assert cachefiles.check_file(target) is None


def test_a_hanging_compiler_is_stopped_at_the_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compiler's child holds its stderr open: the whole session is killed, not the driver alone.
    pids = tmp_path / "pids"
    cc = _script(tmp_path, "cc", f"sleep 1000 & echo $! > {pids}\nwait")
    monkeypatch.setenv(cachefiles.TIMEOUT_ENV, "1")
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    with pytest.raises(cachefiles.BuildError, match=r"^cc took longer than 1 s and was stopped") as info:
        _build(tmp_path / "cache", str(cc), source)
    assert cachefiles.TIMEOUT_ENV in info.value.fix
    child = int(pids.read_text())
    with contextlib.suppress(FileNotFoundError):  # gone, or a zombie waiting for its reaper
        assert Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] in "ZX"
    assert not list((tmp_path / "cache").glob(".tmp-*")) and _runs(tmp_path) == 1
    with pytest.raises(cachefiles.BuildError, match="remembered in"):  # not tried again on the next run
        _build(tmp_path / "cache", str(cc), source)
    assert _runs(tmp_path) == 1


def test_a_failure_marker_is_tried_again_after_a_day_or_when_damaged(tmp_path: Path) -> None:
    cc = _script(tmp_path, "cc", "echo 'answer.c:1: error: broken' >&2; exit 1")
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    with pytest.raises(
        cachefiles.BuildError, match=r"^cc failed: answer.c:1: error: broken; it is tried again"
    ):
        _build(tmp_path / "cache", str(cc), source)
    with pytest.raises(cachefiles.BuildError, match="remembered in"):
        _build(tmp_path / "cache", str(cc), source)
    assert _runs(tmp_path) == 1
    (marker,) = (tmp_path / "cache").glob("*.failed")
    day_ago = time.time() - cachefiles.RETRY_SECONDS - 60
    os.utime(marker, (day_ago, day_ago))
    with pytest.raises(cachefiles.BuildError, match=r"^cc failed"):
        _build(tmp_path / "cache", str(cc), source)
    assert _runs(tmp_path) == 2
    (marker,) = (tmp_path / "cache").glob("*.failed")
    marker.write_text("{")  # a marker cut short is no reason to skip the build
    with pytest.raises(cachefiles.BuildError, match=r"^cc failed"):
        _build(tmp_path / "cache", str(cc), source)
    assert _runs(tmp_path) == 3


def test_a_failure_marker_is_tried_again_once_space_is_freed(tmp_path: Path) -> None:
    cc = _script(tmp_path, "cc", "echo 'ld: cannot find -lm' >&2; exit 1")
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    with _tmpfs(tmp_path / "fs", "160m") as fs:
        filler = fs / "filler"
        filler.write_bytes(bytes(100 << 20))  # 60 MB left: not a full disk, but less than will be free
        with pytest.raises(cachefiles.BuildError, match=r"^cc failed: ld: cannot find -lm"):
            _build(fs / "cache", str(cc), source)
        with pytest.raises(cachefiles.BuildError, match="remembered in"):
            _build(fs / "cache", str(cc), source)
        assert _runs(tmp_path) == 1
        filler.unlink()
        with pytest.raises(cachefiles.BuildError, match=r"^cc failed"):
            _build(fs / "cache", str(cc), source)
        assert _runs(tmp_path) == 2


def test_a_build_on_a_full_disk_says_so_and_succeeds_once_space_is_freed(tmp_path: Path) -> None:
    cc = _cc()
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    with _tmpfs(tmp_path / "fs", "4m") as fs:
        (fs / "cache").mkdir()
        filler = fs / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(bytes(64 << 10))
        with pytest.raises(cachefiles.BuildError, match=r"^no space left on the device of") as info:
            _build(fs / "cache", cc, source)
        assert "free some space" in info.value.fix
        assert not list((fs / "cache").iterdir())  # no temporary file, no marker, no half a library
        filler.unlink()
        lib = _build(fs / "cache", cc, source)
        assert cachefiles.check_file(lib) is None


def test_a_noexec_cache_is_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cc()
    with _tmpfs(tmp_path / "fs", "8m", "noexec") as fs:
        monkeypatch.setenv("XDG_CACHE_HOME", str(fs))
        with pytest.raises(cachefiles.BuildError, match="mounted noexec") as info:
            gemv._built()
        assert "XDG_CACHE_HOME" in info.value.fix
        assert not list(fs.rglob("*.so")) and not list(fs.rglob("*.failed"))


# ---- prefix caches and converted models --------------------------------------------------------------


@pytest.mark.model
def test_an_overwritten_prefix_cache_is_computed_again() -> None:
    # Its bytes overwritten, same size: answers were empty ("tokens": 1, "stop"), exit 0.
    args = [
        "--out",
        "jsonl",
        "-n",
        "4",
        "--temp",
        "0",
        "--system",
        "You answer with one word, issue 39 prefix.",
    ]
    first = run_cli(args, input="Name a colour.\n")
    assert first.returncode == 0, first.stderr
    files = sorted((cache_dir() / "derived").glob("*.prefix-*"), key=lambda p: p.stat().st_mtime)
    kept = files[-1]  # the one this run wrote
    size = kept.stat().st_size
    with open(kept, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x7f" * (size - size // 2))
    assert cachefiles.check_safetensors(kept) is not None
    again = run_cli(args, input="Name a colour.\n")
    assert again.returncode == 0, again.stderr
    (before,) = [json.loads(line) for line in first.stdout.splitlines() if b'"done"' in line]
    (after,) = [json.loads(line) for line in again.stdout.splitlines() if b'"done"' in line]
    assert after["text"] == before["text"] and after["tokens"] == before["tokens"] > 1
    assert cachefiles.check_safetensors(kept) is None  # written again, whole


def test_a_converted_model_changed_in_place_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxpipe.models import cache, materialize, resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    conversions: list[Path] = []

    def convert(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(b"weights " * 1000)
        conversions.append(out)

    monkeypatch.setattr(cache, "convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = Path(materialize(resolve(str(gguf))))
    assert cachefiles.check_manifest(folder) is None and len(conversions) == 1
    assert Path(materialize(resolve(str(gguf)))) == folder and len(conversions) == 1
    data = folder / "model.safetensors"
    with open(data, "r+b") as f:  # same size, other bytes
        f.seek(3000)
        f.write(b"XXXX")
    assert cachefiles.check_manifest(folder) is not None
    assert Path(materialize(resolve(str(gguf)))) == folder and len(conversions) == 2
    assert cachefiles.check_manifest(folder) is None
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


# ---- interrupted work ---------------------------------------------------------------------------------


def _scratch_owner(folder: Path, prelude: str = "") -> tuple[subprocess.Popen[bytes], Path]:
    """A process holding a scratch folder in ``folder`` (half a file written in it), and that folder."""
    code = (
        f"import signal, sys, time\nfrom pathlib import Path\n{prelude}from mlxpipe import cachefiles\n"
        "s = cachefiles.Scratch(Path(sys.argv[1]))\n(s.path / 'half').write_bytes(b'x' * 1000)\n"
        "print(s.path, flush=True)\ntime.sleep(1000)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, env=cli_env(), cwd=REPO
    )
    assert owner.stdout is not None
    return owner, Path(owner.stdout.readline().decode().strip())


def test_a_scratch_folder_of_a_live_process_is_kept_and_a_dead_ones_removed(tmp_path: Path) -> None:
    owner, path = _scratch_owner(tmp_path)
    old = time.time() - 2 * cachefiles.STALE_SECONDS
    os.utime(path, (old, old))
    cachefiles.clean_stale(tmp_path)
    assert (path / "half").exists()  # its owner lives: however old, never taken
    owner.kill()
    owner.wait()
    cachefiles.clean_stale(tmp_path)
    assert not path.exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_a_scratch_folder_lives_removes_it_and_ends_by_the_signal(
    tmp_path: Path, signum: int
) -> None:
    owner, path = _scratch_owner(
        tmp_path, "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    )  # as mlxpipe starts
    assert path.exists()
    owner.send_signal(signum)
    assert owner.wait() == -signum
    assert list(tmp_path.iterdir()) == []


def _tree(root: Path) -> list[str]:
    """Every path under ``root``, the hashed names of files kept per run (prefix caches) left as they are."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _holdings(cache: Path) -> tuple[frozenset[str], frozenset[str]]:
    """What ``cache`` holds: the paths published in it, and its scratch folders (temporary names apart)."""
    published: set[str] = set()
    scratches: set[str] = set()
    for folder, dirs, files in os.walk(cache):
        here = Path(folder).relative_to(cache)
        for name in [*dirs, *files]:
            if name.startswith(cachefiles.SCRATCH_PREFIX):
                scratches.add(str(here / name))
            elif not any(fnmatch.fnmatch(name, p) for p in cachefiles.LEGACY_TEMPS):
                published.add(str(here / name))
        dirs[:] = [d for d in dirs if not d.startswith(cachefiles.SCRATCH_PREFIX)]
    return frozenset(published), frozenset(scratches)


# A phase of a first run: where its scratch folder was made, what was published before, for how many seconds.
Phase = tuple[str, frozenset[str], float]


def _phases(run: subprocess.Popen[bytes], cache: Path) -> list[Phase]:
    """The phases of ``run`` (from an empty ``cache``), in order, timed from its scratch folders."""
    seen: dict[str, tuple[frozenset[str], float, float]] = {}
    deadline = time.monotonic() + 600
    while run.poll() is None and time.monotonic() < deadline:
        now = time.monotonic()
        published, scratches = _holdings(cache)
        for name in scratches:
            before, first, _ = seen.get(name, (published, now, now))
            seen[name] = (before, first, now)
        time.sleep(0.02)
    ordered = sorted(seen.items(), key=lambda item: item[1][1])
    return [(str(Path(name).parent), before, last - first) for name, (before, first, last) in ordered]


def _interrupt(
    run: subprocess.Popen[bytes], cache: Path, old: frozenset[str], phase: Phase, at: float
) -> bool:
    """Wait until ``run`` is ``at`` (a fraction) into ``phase``: what came before it published, a scratch
    folder (not one of ``old``) made where the phase makes its own; whether ``run`` still lives then."""
    folder, before, seconds = phase
    deadline = time.monotonic() + 600
    while run.poll() is None and time.monotonic() < deadline:
        published, scratches = _holdings(cache)
        if before <= published and any(str(Path(s).parent) == folder for s in scratches - old):
            time.sleep(at * seconds)
            return run.poll() is None
        time.sleep(0.02)
    return False


@pytest.mark.model
def test_interrupted_cold_runs_leave_nothing_once_a_run_succeeds(tmp_path: Path) -> None:
    # Interrupt a first run in each of its phases (building gemv.c, converting, building the kernels, writing
    # the packed copies), timed by a clean run's, by every signal, kill -9 included; one good run after: the
    # cache holds exactly what a clean run leaves.
    hi = tmp_path / "hi.txt"
    hi.write_text("hi\n")

    def start(cache: Path) -> subprocess.Popen[bytes]:
        with open(hi, "rb") as stdin:
            return subprocess.Popen(
                [*MLXPIPE, "-n", "2", "--temp", "0"],
                stdin=stdin,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=cli_env(XDG_CACHE_HOME=str(cache)),
                cwd=REPO,
            )

    clean = tmp_path / "clean"
    run = start(clean)
    phases = _phases(run, clean)
    run.communicate(timeout=600)
    assert run.returncode == 0
    assert phases, "a first run made no scratch folder"
    cache = tmp_path / "interrupted"
    # Every phase interrupted halfway, one of 3 s or more (a build) near its start and 40% in; the signals
    # taken in turn.
    points = [(i, at) for i, phase in enumerate(phases) for at in ([0.05, 0.4] if phase[2] >= 3 else [0.5])]
    signals = [signal.SIGKILL, signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP]
    plan = [(i, at, signals[n % len(signals)]) for n, (i, at) in enumerate(points)]
    for index, at, signum in plan:
        _, old = _holdings(cache)  # (a killed run's scratch folders, until the next run removes them)
        run = start(cache)
        sent = _interrupt(run, cache, old, phases[index], at)
        if sent:
            run.send_signal(signum)
        _, err = run.communicate(timeout=120)
        assert b"Traceback" not in err
        assert run.returncode in (0, -signum, 128 + signum), (index, at, signum, run.returncode, err)
        # A phase of a second or more is long enough to be caught in the act.
        assert sent or phases[index][2] < 1, (index, phases, run.returncode, err)
    run = start(cache)
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err
    assert _tree(cache) == _tree(clean)


def test_a_large_file_is_checked_by_size_mtime_and_ends(tmp_path: Path) -> None:
    # The float32 file (540 MB) is not hashed whole at every start: a rewrite in place changes its mtime.
    made = tmp_path / "made"
    made.write_bytes(bytes(range(256)) * 4096)
    target = tmp_path / "kept.safetensors"
    cachefiles.publish_file(made, target, {"version": "v2"}, whole=False)
    assert cachefiles.check_file(target, {"version": "v2"}) is None
    assert "other inputs" in (cachefiles.check_file(target, {"version": "v3"}) or "")
    st = target.stat()
    os.utime(
        target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9)
    )  # rewritten in place, same bytes at its ends
    assert "changed after it was written" in (cachefiles.check_file(target) or "")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open(target, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    assert cachefiles.check_file(target) is not None  # its mtime, or else its first 64 KiB, tell
    os.truncate(target, 1000)
    assert "1000 bytes" in (cachefiles.check_file(target) or "")
    cachefiles.discard_file(target)
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_published_before_manifests_is_adopted_when_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxpipe.models import cache, materialize, resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "convert_gguf", lambda gguf, out: pytest.fail("converted again"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = cache_dir() / "models" / f"m-{cache._cache_key(gguf)[:20]}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    assert Path(materialize(resolve(str(gguf)))) == folder
    assert cachefiles.check_manifest(folder) is None

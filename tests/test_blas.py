"""The BLAS loader's decision (present, absent, turned off, macOS, mlx already imported), without loading one.

Each probe of :mod:`mlxpipe.blas` is replaced, so these tests run in milliseconds and load no library (but
one, which builds a library whose dependency is gone, for the loader's own message).
The end-to-end check that a real BLAS is picked up is the --model-info test at the bottom (real model).
"""

from __future__ import annotations

import ast
import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_env, run_cli

from mlxpipe.cpu import blas, gemv

# The Linux CPU paths' own tests: MLXPIPE_CPU=off (make test-portable) leaves them nothing to test.
pytestmark = pytest.mark.cpu_paths


REFERENCE = "/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
CMEEL = ("cmeel-openblas", "/venv/site-packages/cmeel.prefix/lib/libopenblas.so.0")
SYSTEM = ("system", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
SCIPY = ("scipy-openblas32", "/venv/site-packages/scipy_openblas32/lib/libscipy_openblas.so")
AVX512_CPU = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX2_CPU = {"avx", "avx2", "fma"}  # an AMD EPYC (Zen 2/3), say


class FakeLibrary:
    """What ctypes.CDLL returns, as far as the loader looks at it: cmeel's build for SKYLAKEX, or scipy's
    for every CPU, whose functions carry its prefix."""

    def __init__(self, path: str) -> None:
        self.threads = 2
        prefix = "scipy_" if path == SCIPY[1] else ""
        config = (
            b"OpenBLAS 0.3.34 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64" if prefix else CMEEL_CONFIG
        )
        setattr(self, f"{prefix}openblas_get_config", lambda: config)
        setattr(self, f"{prefix}openblas_get_num_threads", lambda: self.threads)
        setattr(self, f"{prefix}openblas_set_num_threads", self._set_threads)

    def _set_threads(self, n: Any) -> None:
        self.threads = n.value


CMEEL_CONFIG = b"OpenBLAS 0.3.31 SKYLAKEX MAX_THREADS=4"


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A Linux machine with mlx-cpu's reference BLAS and cmeel-openblas; tests change what they need."""
    state: dict[str, Any] = {
        "platform": "linux",
        "imported": False,
        "reference": REFERENCE,
        "candidates": [CMEEL, SYSTEM],
        "cuda": None,  # the mlx CUDA backend's distribution, when installed
        "flags": AVX512_CPU,  # what /proc/cpuinfo lists
        "forwarding": gemv.FORWARDING,  # what gemv.install says it did
        "broken": set(),  # paths whose loading fails
        "loaded": [],  # paths made global, in order
        "steps": [],  # every load and gemv install, in order
    }

    def load(path: str, mode: int) -> FakeLibrary:
        if path in state["broken"]:
            raise OSError("libgfortran.so.5: cannot open shared object file: No such file or directory")
        state["steps"].append(("global" if mode == ctypes.RTLD_GLOBAL else "local", path))
        if mode == ctypes.RTLD_GLOBAL:
            state["loaded"].append(path)
        return FakeLibrary(path)

    def install(library: FakeLibrary) -> str:
        state["steps"].append(("gemv", None))
        return str(state["forwarding"])

    monkeypatch.delenv(blas.ENV, raising=False)
    for name in blas._THREAD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(blas, "_platform", lambda: state["platform"])
    monkeypatch.setattr(blas, "_mlx_imported", lambda: state["imported"])
    monkeypatch.setattr(blas, "_reference_blas", lambda: state["reference"])
    monkeypatch.setattr(blas, "_candidates", lambda: list(state["candidates"]))
    monkeypatch.setattr(blas, "_cuda_backend", lambda: state["cuda"])
    monkeypatch.setattr(blas, "cpu_flags", lambda: state["flags"])
    monkeypatch.setattr(blas, "_load", load)
    monkeypatch.setattr(blas.gemv, "install", install)
    monkeypatch.setattr(blas.gemv, "attached", lambda: False)  # an engine loaded earlier in this process
    monkeypatch.setattr(blas, "_library", None)  # the loaded library, as setup() keeps it
    monkeypatch.setattr(blas, "_library_threads", None)
    return state


def test_loads_cmeel_openblas_first_when_mlx_has_the_reference_blas(machine: dict[str, Any]) -> None:
    choice = blas.choose()
    assert machine["loaded"] == [CMEEL[1]]
    assert (choice.library, choice.source, choice.reference) == (CMEEL[1], "cmeel-openblas", False)
    assert choice.config == "OpenBLAS 0.3.31 SKYLAKEX MAX_THREADS=4"
    assert blas.threads() == 2  # the library's default
    assert choice.info()["library"] == CMEEL[1]
    # The gemv forwarding goes into the global scope between the local and the global load of the BLAS,
    # so that libmlx's cblas_sgemm binds to it and it can call the BLAS.
    assert machine["steps"] == [("local", CMEEL[1]), ("gemv", None), ("global", CMEEL[1])]
    assert choice.info()["gemv"] == "one-row products go to sgemv"


def test_nothing_is_loaded_for_mlx_on_cuda(machine: dict[str, Any]) -> None:
    # mlx-cuda-13's wheel vendors the reference BLAS too, but its matrix products run on the GPU.
    machine["reference"] = "/venv/site-packages/mlx_cuda_13.libs/libblas-bd8a282c.so.3.10.0"
    machine["cuda"] = "mlx-cuda-13"
    choice = blas.choose()
    assert machine["loaded"] == []
    assert choice.library is None and "mlx-cuda-13" in choice.reason and "GPU" in choice.reason


def test_users_thread_count_is_kept(machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    blas.choose()
    for batch in (1, 32):
        blas.use_threads(batch)
        assert blas.threads() == 2


def test_one_thread_per_rank_under_mlx_launch(
    machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLX_RANK", "0")
    blas.choose()
    assert blas.threads() == 1
    blas.use_threads(32)
    assert blas.threads() == 1


def test_one_thread_for_one_stream_the_default_for_a_batch(machine: dict[str, Any]) -> None:
    # One stream's products are matrix-vector ones: one thread is as fast, and cannot collapse when another
    # process wants the second core; batched matrix products get the library's default again.
    assert blas.threads() is None  # nothing loaded yet: nothing to set
    blas.use_threads(1)
    blas.choose()
    assert blas.threads() == 2
    blas.use_threads(1)
    assert blas.threads() == 1
    blas.use_threads(16)
    assert blas.threads() == 2


def test_one_thread_for_a_batch_whose_products_the_quantized_kernels_take(
    machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their helper takes the second core; OpenBLAS's spinning threads would collapse beside a busy process.
    helper: list[int] = []
    monkeypatch.setattr(gemv, "attached", lambda: 211)
    monkeypatch.setattr(gemv, "use_threads", helper.append)
    blas.choose()
    blas.use_threads(16)
    assert blas.threads() == 1 and helper == [2]
    blas.use_threads(1)  # the helper stays: a stream's several-row products are its prompts
    assert blas.threads() == 1 and helper == [2, 2]


def test_falls_back_to_the_system_library_and_says_why(machine: dict[str, Any]) -> None:
    machine["broken"] = {CMEEL[1]}
    choice = blas.choose()
    assert machine["loaded"] == [SYSTEM[1]]
    assert choice.source == "system"
    assert len(choice.failed) == 1 and "libgfortran.so.5" in choice.failed[0]
    assert choice.info()["failed"] == list(choice.failed)


def test_a_build_for_avx512_is_skipped_on_a_cpu_without_it_for_scipys_through_the_forwarding(
    machine: dict[str, Any],
) -> None:
    # cmeel-openblas's x86-64 wheel is built for SKYLAKEX only: on an AVX2 CPU its first product dies with
    # SIGILL. scipy-openblas32 picks its kernels at run time; mlx reaches its prefixed functions only
    # through the forwarding cblas_sgemm, which goes global before it.
    machine["flags"] = AVX2_CPU
    machine["candidates"] = [CMEEL, SCIPY, SYSTEM]
    choice = blas.choose()
    assert (choice.library, choice.source) == (SCIPY[1], "scipy-openblas32")
    assert choice.config is not None and "DYNAMIC_ARCH" in choice.config
    assert machine["steps"] == [
        ("local", CMEEL[1]),
        ("local", SCIPY[1]),
        ("gemv", None),
        ("global", SCIPY[1]),
    ]
    assert choice.failed == (
        f"{CMEEL[1]}: built for SKYLAKEX CPUs only; this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, "
        "avx512cd",
    )
    assert blas.threads() == 2 and blas.slow_paths(choice) == []
    blas.use_threads(1)  # the prefixed thread functions are found too
    assert blas.threads() == 1


def test_where_the_cpu_has_avx512_cmeels_build_stays_first(machine: dict[str, Any]) -> None:
    machine["candidates"] = [CMEEL, SCIPY, SYSTEM]
    assert blas.choose().source == "cmeel-openblas"
    machine["flags"] = None  # no /proc/cpuinfo flags (not x86): nobody can tell, the build is tried
    assert blas.choose().source == "cmeel-openblas"


def test_a_prefixed_library_without_the_forwarding_is_not_used(machine: dict[str, Any]) -> None:
    machine["flags"] = AVX2_CPU
    machine["candidates"] = [CMEEL, SCIPY]
    machine["forwarding"] = "not built: no C compiler (cc) found"
    choice = blas.choose()
    assert choice.library is None and machine["loaded"] == [] and choice.missing
    assert choice.failed[1] == (
        f"{SCIPY[1]}: reached only through mlxpipe's cblas_sgemm (its functions are named scipy_cblas_*), "
        "which was not built: no C compiler (cc) found"
    )
    # The fix named is the one for the library that runs here: the compiler, not cmeel's AVX-512.
    assert choice.reason == (
        "scipy-openblas32 is reached only through mlxpipe's cblas_sgemm (its functions are named "
        "scipy_cblas_*), which was not built: no C compiler (cc) found; install a C compiler (Debian/Ubuntu: "
        "apt-get install gcc)"
    )
    assert blas.slow_paths(choice) == [
        "float32 matrix products run on mlx's reference BLAS, 11-14x slower for batches and prompts: "
        + choice.reason
    ]
    machine["forwarding"] = "off (MLXPIPE_GEMV=off)"
    assert blas.choose().reason.endswith("which was off (MLXPIPE_GEMV=off); unset MLXPIPE_GEMV")


def test_only_a_build_for_avx512_on_a_cpu_without_it_names_the_library_for_every_cpu(
    machine: dict[str, Any],
) -> None:
    machine["flags"] = AVX2_CPU
    machine["candidates"] = [CMEEL]
    choice = blas.choose()
    assert choice.library is None and choice.missing
    assert choice.reason == (
        "cmeel-openblas would not load (built for SKYLAKEX CPUs only; this CPU lacks avx512f, avx512bw, "
        "avx512vl, avx512dq, avx512cd): pip install scipy-openblas32 (built for every CPU; needs a C "
        "compiler)"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS is loaded on Linux only")
def test_the_installed_libraries_are_judged_by_their_own_config_and_this_cpus_flags() -> None:
    # The real candidates of this venv, asked in a fresh process (a library loads nothing of mlx): each one
    # that would be chosen must run on this CPU, which the real model runs elsewhere in the suite prove.
    script = (
        "import ctypes, json\n"
        "from mlxpipe.cpu import blas\n"
        "out = []\n"
        "for source, path in blas._candidates():\n"
        "    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)\n"
        "    prefix = blas._PREFIXES.get(source, '')\n"
        "    config = blas._openblas_config(blas._Prefixed(lib, prefix) if prefix else lib)\n"
        "    try:\n"
        "        blas.opened(source, path)\n"
        "        lacks = None\n"
        "    except OSError as exc:\n"
        "        lacks = str(exc)\n"
        "    out.append([source, config, lacks])\n"
        "print(json.dumps([out, sorted(blas.cpu_flags() or [])]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True
    )
    judged, flags = json.loads(done.stdout)
    by_source = {source: (config, lacks) for source, config, lacks in judged}
    if "scipy-openblas32" in by_source:
        assert "DYNAMIC_ARCH" in by_source["scipy-openblas32"][0] and by_source["scipy-openblas32"][1] is None
    if "cmeel-openblas" in by_source and "SKYLAKEX" in by_source["cmeel-openblas"][0].split():
        assert (by_source["cmeel-openblas"][1] is None) == ("avx512f" in flags and "avx512bw" in flags)


def test_absent_loads_nothing_and_names_the_package(machine: dict[str, Any]) -> None:
    machine["candidates"] = []
    choice = blas.choose()
    assert machine["loaded"] == [] and choice.library is None
    assert choice.source == "mlx" and "pip install 'mlxpipe[cpu]'" in choice.reason
    assert choice.reference  # --model-info says mlx computes with its reference BLAS
    (line,) = blas.slow_paths(choice)
    assert "reference BLAS" in line and choice.reason in line


def test_every_candidate_broken_loads_nothing_and_says_the_loaders_error(machine: dict[str, Any]) -> None:
    # cmeel-openblas *is* installed here: the reason is what the loader said, and the fix for it.
    machine["broken"] = {CMEEL[1], SYSTEM[1]}
    choice = blas.choose()
    assert choice.library is None and len(choice.failed) == 2
    assert choice.reason == (
        "cmeel-openblas would not load (libgfortran.so.5: cannot open shared object file: No such file or "
        "directory): install the gfortran runtime (Debian/Ubuntu: apt-get install libgfortran5)"
    )
    assert "pip install" not in choice.reason
    assert blas.slow_paths(choice) == [
        "float32 matrix products run on mlx's reference BLAS, 11-14x slower for batches and prompts: "
        + choice.reason
    ]


def test_no_slow_path_is_said_when_the_fast_one_is_off_or_not_needed(
    machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    machine["broken"] = {CMEEL[1], SYSTEM[1]}
    monkeypatch.setenv(blas.ENV, "off")
    assert blas.slow_paths(blas.choose()) == []  # asked for
    monkeypatch.delenv(blas.ENV)
    machine["cuda"] = "mlx-cuda-13"
    assert blas.slow_paths(blas.choose()) == []  # the GPU computes
    machine["cuda"], machine["platform"] = None, "darwin"
    assert blas.slow_paths(blas.choose()) == []  # Accelerate


def test_a_kernel_that_could_not_be_built_is_a_slow_path(machine: dict[str, Any]) -> None:
    choice = blas.choose()
    assert blas.slow_paths(choice) == []
    no_cc = blas.BlasChoice(
        CMEEL[1], CMEEL[0], "loaded before mlx", gemv="not built: no C compiler (cc) found"
    )
    (line,) = blas.slow_paths(no_cc)
    assert "no C compiler (cc) found" in line and "apt-get install gcc" in line
    broken = blas.BlasChoice(
        CMEEL[1], CMEEL[0], "loaded before mlx", gemv="not built: cc failed: gemv.c:1: error"
    )
    (line,) = blas.slow_paths(broken)
    assert "cc failed: gemv.c:1: error" in line and "tried again" in line
    off = blas.BlasChoice(CMEEL[1], CMEEL[0], "loaded before mlx", gemv="off (MLXPIPE_GEMV=off)")
    assert blas.slow_paths(off) == []


@pytest.mark.skipif(shutil.which("cc") is None or sys.platform != "linux", reason="needs cc on Linux")
def test_the_reason_is_the_real_loaders_message(tmp_path: Path) -> None:
    # A real library whose dependency is gone, as cmeel-openblas is without libgfortran.so.5: the reason
    # quotes what the dynamic loader said about it.
    (tmp_path / "dep.c").write_text("int mlxpipe_dep(void) { return 1; }\n")
    (tmp_path / "blas.c").write_text(
        "int mlxpipe_dep(void);\nint cblas_sgemm(void) { return mlxpipe_dep(); }\n"
    )
    dep = tmp_path / "libmlxpipe-gone.so.1"
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libmlxpipe-gone.so.1",
            "-o",
            str(dep),
            str(tmp_path / "dep.c"),
        ],
        check=True,
    )
    lib = tmp_path / "libopenblas.so.0"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "blas.c"), str(dep)], check=True)
    dep.unlink()
    choice = blas._load_first([("cmeel-openblas", str(lib))], REFERENCE)
    assert choice.library is None and choice.missing and choice.reference
    assert choice.reason.startswith("cmeel-openblas would not load (libmlxpipe-gone.so.1: cannot open shared")
    assert choice.failed[0].startswith(f"{lib}: libmlxpipe-gone.so.1: cannot open shared")


@pytest.mark.parametrize("value", ["off", "OFF", "0", "no", "false", "none"])
def test_env_var_turns_it_off(machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(blas.ENV, value)
    choice = blas.choose()
    assert machine["loaded"] == [] and choice.library is None and choice.reference
    assert blas.ENV in choice.reason


def test_env_var_path_forces_that_library(machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blas.ENV, "/opt/blas/libmyblas.so")
    machine["reference"] = None  # forced even when mlx's BLAS is not the reference one
    choice = blas.choose()
    assert machine["loaded"] == ["/opt/blas/libmyblas.so"]
    assert (choice.library, choice.source) == ("/opt/blas/libmyblas.so", blas.ENV)


def test_never_on_macos(machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    machine["platform"] = "darwin"
    assert blas.choose().library is None
    monkeypatch.setenv(blas.ENV, "/opt/blas/libmyblas.so")  # not even when asked
    choice = blas.choose()
    assert machine["loaded"] == [] and choice.library is None and "darwin" in choice.reason


def test_not_when_mlx_brings_its_own_optimized_blas(machine: dict[str, Any]) -> None:
    machine["reference"] = None
    choice = blas.choose()
    assert machine["loaded"] == [] and choice.library is None and not choice.reference


def test_too_late_once_mlx_is_imported(machine: dict[str, Any]) -> None:
    machine["imported"] = True
    choice = blas.choose()
    assert machine["loaded"] == [] and "imported" in choice.reason


def test_setup_decides_once(machine: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "_choice", None)
    first = blas.setup()
    machine["candidates"] = []
    assert blas.setup() is first and machine["loaded"] == [CMEEL[1]]


def test_reference_probe_finds_the_wheels_vendored_blas(tmp_path: Path) -> None:
    # The probe reads file names next to the mlx package; it never imports mlx.
    package = tmp_path / "site-packages" / "mlx"
    package.mkdir(parents=True)
    assert blas._vendored_reference_blas([str(package)]) is None
    (package.parent / "mlx_cpu.libs").mkdir()
    (package.parent / "mlx_cpu.libs" / "libgfortran-f7379c93.so.5.0.0").write_bytes(b"")
    assert blas._vendored_reference_blas([str(package)]) is None
    lib = package.parent / "mlx_cpu.libs" / "libblas-bd8a282c.so.3.10.0"
    lib.write_bytes(b"")
    assert blas._vendored_reference_blas([str(package)]) == str(lib)


def test_every_module_importing_mlx_loads_the_blas_first() -> None:
    # mlx binds its BLAS symbols when first imported: any mlxpipe module that imports mlx at the top
    # must call blas.setup() before that import, or the optimized BLAS is silently not used.
    for path in sorted((REPO / "mlxpipe").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        setup_line = None
        for node in tree.body:
            if isinstance(node, ast.Expr) and "blas.setup()" in ast.unparse(node):
                setup_line = node.lineno
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "mlx" or n.startswith(("mlx.", "mlx_lm")) for n in names):
                assert setup_line is not None, f"{path.name}:{node.lineno} imports mlx before blas.setup()"


@pytest.mark.model
def test_model_info_reports_blas_and_dtype() -> None:
    r = run_cli(["--model-info"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    # float32 on a CPU; on CUDA the model's own 16-bit type (float16 for a GGUF such as the embedded one);
    # quantized on Metal or when memory is short
    assert info["dtype"] in ("float32", "float16", "bfloat16", "quantized") and info[
        "dtype_reason"
    ].startswith("auto on")
    if info["device"].startswith("Device(cpu"):
        assert info["dtype"] in ("float32", "quantized")
    assert set(info["blas"]) >= {"library", "source", "reason"}
    assert "imported before" not in info["blas"]["reason"]  # nothing on the CLI's path imports mlx first
    if info["blas"]["library"]:
        assert info["blas"]["threads"] >= 1
    r = run_cli(["--model-info", "--dtype", "quantized"], env=cli_env(MLXPIPE_BLAS="off"))
    assert r.returncode == 0, r.stderr
    off = json.loads(r.stdout)
    assert off["dtype"] == "quantized" and off["blas"]["library"] is None and off["blas"]["reference_blas"]
    assert "MLXPIPE_BLAS" in off["blas"]["reason"]


def test_installed_distributions_are_what_importlib_metadata_finds() -> None:
    # Looked up without importing importlib.metadata (a start-up cost); it stays the reference.
    import importlib.metadata

    for name in ("mlx", "mlx-lm", "cmeel-openblas", "mlx-cuda-13", "mlx-cuda-12", "no-such-distribution"):
        try:
            location = str(importlib.metadata.distribution(name).locate_file(""))
        except importlib.metadata.PackageNotFoundError:
            location = None
        found = [str(Path(p).resolve()) for p in blas._installed(name)]
        assert (location is not None) == bool(found), name
        if location is not None:
            assert str(Path(location).resolve()) in found


# An 8 MiB malloc in a fresh process: glibc maps it from the kernel (its threshold starts at 128 KiB) unless
# mlxpipe.cpu set the threshold to 32 MiB, when it comes from the heap, below the program break.
_HEAP_OR_MAPPED = """
import ctypes, sys
import mlxpipe.cpu
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_long]
block = libc.malloc(8 << 20)
print("heap" if block < libc.sbrk(0) else "mapped")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
@pytest.mark.parametrize(("switch", "where"), [("", "heap"), ("off", "mapped")])
def test_large_buffers_come_from_the_heap_unless_turned_off(switch: str, where: str) -> None:
    try:
        ctypes.CDLL(None).mallopt  # noqa: B018 (glibc has it, musl not)
    except AttributeError:
        pytest.skip("not glibc")
    env = {**cli_env(), "MLXPIPE_MALLOC": switch}
    code = [sys.executable, "-c", _HEAP_OR_MAPPED]
    out = subprocess.run(code, capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == where

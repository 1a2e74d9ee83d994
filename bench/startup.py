"""Start-up: how long ``echo hi | mlxpipe -n 1`` takes as a whole process, and where that time goes.

    flock -x /tmp/mlxpipe-cpu.lock timeout 600 python bench/startup.py [--rounds 5] [--against CHECKOUT]

Times this checkout's code; ``--against`` also times another checkout's (the main branch's, or an older
commit's tree), round by round in turn, and prints the ratio of each median (this / that) beside them.

Each round runs, in fresh processes (a warm cache: the model folder, the kept float32 matrices, the
compiled kernels and Python's bytecode exist, as in an installed package; a first unmeasured run makes
them):

- ``whole``: ``echo hi | python -m mlxpipe -n 1`` (stdout to /dev/null), wall time, and the CPU time it
  used (user + system, every thread: what a busy machine inflates least);
- ``empty``: the same with empty input (no model is loaded);
- ``python``: ``python -c pass``, the interpreter's own start, which mlxpipe cannot shorten;
- the breakdown, in one process, each step timed after the one before: importing the command line
  (``mlxpipe.cli.main``), mlx (``mlxpipe.cpu``: the BLAS, then mlx), the engine (``mlxpipe.engine`` and what
  it imports: mlx-lm, and transformers where the checkout imports it), ``Engine.load`` (tokenizer, weights,
  dtype, CPU paths), the first token of "hi"; then, for the split, the tokenizer alone and the weights file
  alone loaded again (from the page cache) the checkout's way.

Prints the median and minimum of each over the rounds, the load average, and whether one record imported
transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BREAKDOWN = r"""
import json, sys, time
t = [("start", time.perf_counter())]
def mark(name):
    t.append((name, time.perf_counter()))
import mlxpipe.cli.main
mark("import cli")
import mlxpipe.cpu
mark("import mlx (BLAS, mlx)")
from mlxpipe.engine import Engine
mark("import engine (and what it imports)")
engine = Engine.load(None)
mark("Engine.load (tokenizer, weights, dtype, CPU paths)")
from mlxpipe.reader import records_from_objects
from mlxpipe.records import Settings
(record,) = records_from_objects(["hi"], Settings(max_tokens=1))
for event in engine.generate(record):
    pass
mark("first token")
transformers = "transformers" in sys.modules
from pathlib import Path
import mlx.core as mx
folder = Path(engine.folder)
try:  # this checkout's own tokenizer (issue 21), else mlx-lm's (which imports transformers)
    from mlxpipe.engine.tokenizer import load as load_fast
    load_fast(str(folder))
except ImportError:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    load_tokenizer(folder)
mark("  again: the tokenizer alone")
mx.eval(mx.load(str(folder / "model.safetensors")))
mark("  again: the weights file alone (mx.load)")
out = [(name, b - a) for (name, b), (_, a) in zip(t[1:], t)]
print(json.dumps({"steps": out, "transformers": transformers}))
"""


def _env(repo: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLXPIPE_MODEL", None)
    # An installed package has its bytecode compiled (pip does it); a checkout gets it on the unmeasured
    # first run, even where the environment says not to write it (this machine's does).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _wall(repo: Path, argv: list[str], stdin: bytes, cpu: list[float] | None = None) -> float:
    """Wall seconds of one run; its CPU seconds (user + system, all threads) appended to ``cpu``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, input=stdin, stdout=subprocess.DEVNULL, env=_env(repo), cwd=repo, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def _round(repo: Path, runs: dict[str, list[float]], imported: set[bool]) -> None:
    py = sys.executable
    mlxpipe = [py, "-m", "mlxpipe", "-n", "1"]
    whole = runs.setdefault("whole: echo hi | mlxpipe -n 1", [])
    whole.append(_wall(repo, mlxpipe, b"hi\n", runs.setdefault("whole, CPU time (user + system)", [])))
    runs.setdefault("empty input", []).append(_wall(repo, mlxpipe, b""))
    runs.setdefault("python -c pass", []).append(_wall(repo, [py, "-c", "pass"], b""))
    out = subprocess.run([py, "-c", BREAKDOWN], capture_output=True, env=_env(repo), cwd=repo, check=True)
    breakdown = json.loads(out.stdout)
    for name, seconds in breakdown["steps"]:
        runs.setdefault(f"  {name}", []).append(seconds)
    imported.add(breakdown["transformers"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout to time beside this one")
    args = parser.parse_args()
    repos = [REPO] + ([args.against.resolve()] if args.against else [])
    for repo in repos:  # warm: the page cache, the converted model, the kept matrices, the compiled kernels
        _wall(repo, [sys.executable, "-m", "mlxpipe", "-n", "1"], b"hi\n")
    loads = [os.getloadavg()[0]]
    runs: list[dict[str, list[float]]] = [{} for _ in repos]
    imported: list[set[bool]] = [set() for _ in repos]
    for _ in range(args.rounds):
        for i, repo in enumerate(repos):
            _round(repo, runs[i], imported[i])
        loads.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds; load average (1 min) {min(loads):.2f} to {max(loads):.2f}")
    for repo, seen in zip(repos, imported, strict=True):
        print(f"{repo}: transformers imported by one record: {sorted(seen)}")
    head = " | ".join(f"{r.name}: median s | min s" for r in repos)
    print(f"| step | {head} |" + (" this / that (medians) |" if len(repos) > 1 else ""))
    print("|---" * (1 + 2 * len(repos) + (len(repos) > 1)) + "|")
    for name in runs[0]:
        cells = []
        for r in runs:
            values = r.get(name)
            cells.append(f"{statistics.median(values):.3f} | {min(values):.3f}" if values else "— | —")
        ratio = ""
        if len(repos) > 1 and runs[1].get(name):
            ratio = f" {statistics.median(runs[0][name]) / statistics.median(runs[1][name]):.2f} |"
        print(f"| {name} | {' | '.join(cells)} |{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

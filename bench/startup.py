"""Start-up: how long ``echo hi | mlxpipe -n 1`` takes as a whole process, and where that time goes.

    flock -x /tmp/mlxpipe-cpu.lock python bench/startup.py [--rounds 5] [--repo CHECKOUT]

``--repo`` times another checkout's code (the main branch's, for a before/after); by default this one's.

Each round runs, in fresh processes (a warm cache: the model folder and the compiled kernels exist):

- ``whole``: ``echo hi | python -m mlxpipe -n 1`` (stdout to /dev/null), wall time;
- ``empty``: the same with empty input (no model is loaded);
- ``python``: ``python -c pass``, the interpreter's own start, which mlxpipe cannot shorten;
- the breakdown, in one process, each step timed after the one before: importing the command line
  (``mlxpipe.cli.main``), mlx (``mlxpipe.cpu``: the BLAS, then mlx), transformers, mlx-lm and the engine
  (``mlxpipe.engine``), then ``Engine.load`` split into the tokenizer (mlx-lm's loader), the weights
  (mlx-lm's ``load_model``) and the rest (``Engine.load`` itself, which loads both again from the page
  cache, plus choosing and applying the dtype and the CPU paths), and the first token of "hi".

Prints the median of each over the rounds, the load average, and a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
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
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
mark("import transformers")
import mlx_lm
mark("import mlx_lm")
from mlxpipe.engine import Engine
mark("import engine")
from mlxpipe import models
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model
from pathlib import Path
folder = Path(models.materialize(models.resolve(None)))
load_tokenizer(folder)
mark("tokenizer")
load_model(folder)
mark("weights")
engine = Engine.load(None)
mark("Engine.load (again, + dtype, CPU paths)")
from mlxpipe.reader import records_from_objects
from mlxpipe.records import Settings
(record,) = records_from_objects(["hi"], Settings(max_tokens=1))
for event in engine.generate(record):
    pass
mark("first token")
print(json.dumps([(name, b - a) for (name, b), (_, a) in zip(t[1:], t)]))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLXPIPE_MODEL", None)
    return env


def _wall(argv: list[str], stdin: bytes) -> float:
    started = time.perf_counter()
    subprocess.run(argv, input=stdin, stdout=subprocess.DEVNULL, env=_env(), cwd=REPO, check=True)
    return time.perf_counter() - started


def main() -> int:
    global REPO
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code is timed")
    args = parser.parse_args()
    REPO = args.repo.resolve()
    py = sys.executable
    mlxpipe = [py, "-m", "mlxpipe", "-n", "1"]
    _wall(mlxpipe, b"hi\n")  # warm: the page cache, the converted model, the compiled kernels
    loads = [os.getloadavg()[0]]
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        runs.setdefault("whole: echo hi | mlxpipe -n 1", []).append(_wall(mlxpipe, b"hi\n"))
        runs.setdefault("empty input", []).append(_wall(mlxpipe, b""))
        runs.setdefault("python -c pass", []).append(_wall([py, "-c", "pass"], b""))
        out = subprocess.run([py, "-c", BREAKDOWN], capture_output=True, env=_env(), cwd=REPO, check=True)
        for name, seconds in json.loads(out.stdout):
            runs.setdefault(f"  {name}", []).append(seconds)
        loads.append(os.getloadavg()[0])
    print(f"{REPO}: {args.rounds} rounds; load average (1 min) {min(loads):.2f} to {max(loads):.2f}")
    print("| step | median s | min s |")
    print("|---|---|---|")
    for name, values in runs.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

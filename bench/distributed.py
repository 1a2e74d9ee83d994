"""Records over ranks, one core each as a stand-in for hosts: one process on one core vs ``mlx.launch -n N``.

    flock -x /tmp/mlxpipe-cpu.lock python bench/distributed.py [--ranks 2] [--records 16] [--max-tokens 32]
        [--mixed] [--batch 1] [--rounds 2] [--startup] [--spinning] [--variant NAME:KEY=VALUE,...]...

Every run is the real command on the same file (greedy, ``--no-stream`` JSONL, model load included), each
process pinned with ``taskset -c`` (rank r on core r; the single process on core 0), OpenBLAS at one thread.
Runs, taking turns each round: one process; N ranks as mlxpipe runs them; with ``--spinning``, N ranks with
``MLXPIPE_CALM_LAUNCHER=off`` (the launcher's relay left spinning: mlxpipe.launcher); and each ``--variant``:
N ranks with more environment (``CWD=DIR`` runs another checkout, e.g. an older protocol from
``git archive``). Prints wall time, the speed-up over one process (median of rounds), the generated tokens
per second of wall time, the mean decode and prompt rates of the records (their ``done`` events; with ranks,
over every rank's records, to compare with one process on one core), the launcher's own CPU seconds, and
whether the answers equal one process's. ``--mixed`` gives half the records ``max_tokens`` 8 and half 200.
``--startup`` also times one process and N ranks on an input of one record of one token (start-up and model
load: one process skips the model on an empty input), and prints the speed-up past it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).with_name("mlx.launch")
if not LAUNCH.exists():  # pip install --target puts it in its own bin/
    LAUNCH = Path(shutil.which("mlx.launch") or LAUNCH)
TOPICS = ["the sea", "mountains", "coffee", "bicycles", "libraries", "volcanoes", "owls", "rain"]


def write_input(path: Path, records: int, mixed: bool) -> None:
    lines = []
    for i in range(records):
        record: dict[str, object] = {
            "id": i,
            "prompt": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}.",
        }
        if mixed:
            record["max_tokens"] = 8 if i % 2 == 0 else 200
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, bytes, float, str]:
    """Wall seconds, stdout, the CPU seconds of the top process alone (the launcher, for mlx.launch), and
    what the ranks said about their ticks (``MLXPIPE_TICK_STATS``)."""
    started = time.perf_counter()
    env = dict(env)
    cwd = env.pop("CWD", str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd
        )
        cpu = 0.0
        out = b""
        assert p.stdout is not None
        while True:
            chunk = p.stdout.read1(1 << 16)
            if not chunk:
                break
            out += chunk
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                pass
        p.wait()
        err.seek(0)
        ticks = "; ".join(
            sorted(
                line.split("]: ", 1)[0].split()[-1] + ": " + line.split("]: ", 1)[1]
                for line in err.read().decode(errors="replace").splitlines()
                if " ticks (" in line
            )
        )
    return time.perf_counter() - started, out, cpu, ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--startup", action="store_true", help="also time both on a one-token input")
    parser.add_argument(
        "--spinning", action="store_true", help="also N ranks with the launcher left spinning"
    )
    parser.add_argument(
        "--variant", action="append", default=[], help="NAME:KEY=VALUE,...: N ranks, more env"
    )
    args = parser.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", MLXPIPE_TICK_STATS="1")
    mlxpipe = [sys.executable, "-m", "mlxpipe", "--jsonl", "--no-stream", "-n", str(args.max_tokens)]
    mlxpipe += ["--batch", str(args.batch)]
    variants: dict[str, dict[str, str]] = {"ranks": env}
    if args.spinning:
        variants["ranks, launcher spinning"] = dict(env, MLXPIPE_CALM_LAUNCHER="off")
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        variants[name] = dict(env, **dict(pair.split("=", 1) for pair in pairs.split(",") if pair))
    results: dict[str, list[tuple[float, bytes, float, str]]] = {"one": [], **{name: [] for name in variants}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "in.jsonl"
        write_input(data, args.records, args.mixed)
        one = ["taskset", "-c", "0", *mlxpipe, str(data)]
        pinned = f"exec taskset -c $MLX_RANK {' '.join(mlxpipe)} {data}"
        launch = [str(LAUNCH), "-n", str(args.ranks), "--backend", "ring", "--", "sh", "-c", pinned]
        empty = Path(tmp) / "one.jsonl"
        empty.write_text('{"id": 0, "prompt": "Hi.", "max_tokens": 1}\n')
        starts: dict[str, list[float]] = {"one": [], "ranks": []}
        for _ in range(args.rounds):
            results["one"].append(run(one, env))
            for name, variant in variants.items():
                results[name].append(run(launch, variant))
            if args.startup:  # the same commands on one record of one token: start-up and model load
                starts["one"].append(run([*one[:-1], str(empty)], env)[0])
                starts["ranks"].append(run([*launch[:-1], pinned.replace(str(data), str(empty))], env)[0])

    def events(out: bytes) -> list[dict[str, object]]:
        return [json.loads(line) for line in out.splitlines() if line.startswith(b"{")]

    reference = [(e["id"], e.get("text")) for e in events(results["one"][0][1])]
    one_wall = statistics.median(r[0] for r in results["one"])
    day, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    print(f"# {day}, {platform.machine()}, {os.cpu_count()} cores, load {load:.2f}; {args.records} records, ")
    mixed = " (mixed 8/200)" if args.mixed else ""
    print(f"# max tokens {args.max_tokens}{mixed}, --batch {args.batch}, greedy")
    print(
        "| run | wall s (median) | all walls | vs one | generated tok/s | decode tok/s | prompt tok/s "
        "| launcher CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        walls = ", ".join(f"{r[0]:.1f}" for r in runs)
        dones = [e for r in runs for e in events(r[1]) if e.get("event") == "done"]
        tokens = statistics.median(
            sum(int(e["tokens"]) for e in events(r[1]) if e.get("event") == "done") / r[0]  # type: ignore[call-overload]
            for r in runs
        )
        decode = statistics.mean(float(e["tps"]) for e in dones)  # type: ignore[arg-type]
        prompt = statistics.mean(float(e["prompt_tps"]) for e in dones)  # type: ignore[arg-type]
        cpu = "—" if name == "one" else f"{statistics.median(r[2] for r in runs):.1f}"
        same = all([(e["id"], e.get("text")) for e in events(r[1])] == reference for r in runs)
        print(
            f"| {name}{'' if same else ' (answers differ!)'} | {wall:.1f} | {walls} | "
            f"{one_wall / wall:.2f} | {tokens:.0f} | {decode:.0f} | {prompt:.0f} | {cpu} |"
        )
    if args.startup:
        one_start, ranks_start = (statistics.median(starts[k]) for k in ("one", "ranks"))
        ranks_wall = statistics.median(r[0] for r in results["ranks"])
        print(
            f"- start-up, one token (median): one {one_start:.1f} s, ranks {ranks_start:.1f} s; "
            f"past it, ranks vs one: {(one_wall - one_start) / (ranks_wall - ranks_start):.2f}"
        )
    for name, runs in results.items():
        if runs[-1][3]:
            print(f"- {name}, last round: {runs[-1][3]}")


if __name__ == "__main__":
    main()

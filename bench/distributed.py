"""Records over ranks, one core each as a stand-in for hosts: one process on one core vs ``mlx.launch -n N``.

    flock -x /tmp/mlxpipe-cpu.lock python bench/distributed.py [--ranks 2] [--records 16] [--max-tokens 32]
        [--mixed] [--batch 1] [--rounds 2]

Every run is the real command on the same file (greedy, ``--no-stream`` JSONL, model load included), each
process pinned with ``taskset -c`` (rank r on core r; the single process on core 0), OpenBLAS at one thread.
Runs, taking turns each round: one process; N ranks as mlxpipe runs them; N ranks with
``MLXPIPE_CALM_LAUNCHER=off`` (the launcher's relay left spinning: mlxpipe.launcher). Prints wall time, the
speed-up over one process (median of rounds), each rank's mean decode and prompt rates (from its records'
``done`` events), the launcher's own CPU seconds, and whether the answers equal one process's. ``--mixed``
gives half the records ``max_tokens`` 8 and half 200 (the lockstep's worst case), against equal lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).with_name("mlx.launch")
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


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, bytes, float]:
    """Wall seconds, stdout, and the CPU seconds of the top process alone (the launcher, for mlx.launch)."""
    started = time.perf_counter()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, cwd=REPO)
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
    return time.perf_counter() - started, out, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    mlxpipe = [sys.executable, "-m", "mlxpipe", "--jsonl", "--no-stream", "-n", str(args.max_tokens)]
    mlxpipe += ["--batch", str(args.batch)]
    results: dict[str, list[tuple[float, bytes, float]]] = {
        "one": [],
        "ranks": [],
        "ranks, launcher spinning": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "in.jsonl"
        write_input(data, args.records, args.mixed)
        one = ["taskset", "-c", "0", *mlxpipe, str(data)]
        pinned = f"exec taskset -c $MLX_RANK {' '.join(mlxpipe)} {data}"
        launch = [str(LAUNCH), "-n", str(args.ranks), "--backend", "ring", "--", "sh", "-c", pinned]
        for _ in range(args.rounds):
            results["one"].append(run(one, env))
            results["ranks"].append(run(launch, env))
            results["ranks, launcher spinning"].append(run(launch, dict(env, MLXPIPE_CALM_LAUNCHER="off")))

    def events(out: bytes) -> list[dict[str, object]]:
        return [json.loads(line) for line in out.splitlines() if line.startswith(b"{")]

    reference = [(e["id"], e.get("text")) for e in events(results["one"][0][1])]
    one_wall = statistics.median(r[0] for r in results["one"])
    day, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    print(f"# {day}, {platform.machine()}, {os.cpu_count()} cores, load {load:.2f}; {args.records} records, ")
    mixed = " (mixed 8/200)" if args.mixed else ""
    print(f"# max tokens {args.max_tokens}{mixed}, --batch {args.batch}, greedy")
    print(
        "| run | wall s (median) | vs one | decode tok/s per rank | prompt tok/s per rank | launcher CPU s |"
    )
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        dones = [e for e in events(runs[-1][1]) if e.get("event") == "done"]
        size = 1 if name == "one" else args.ranks
        decode, prompt = [], []
        for rank in range(size):
            mine = [e for n, e in enumerate(dones) if n % size == rank]
            decode.append(statistics.mean(float(e["tps"]) for e in mine) if mine else 0.0)  # type: ignore[arg-type]
            prompt.append(statistics.mean(float(e["prompt_tps"]) for e in mine) if mine else 0.0)  # type: ignore[arg-type]
        cpu = "—" if name == "one" else f"{statistics.median(r[2] for r in runs):.1f}"
        same = all([(e["id"], e.get("text")) for e in events(r[1])] == reference for r in runs)
        print(
            f"| {name}{'' if same else ' (answers differ!)'} | {wall:.1f} | {one_wall / wall:.2f} | "
            f"{', '.join(f'{d:.0f}' for d in decode)} | {', '.join(f'{p:.0f}' for p in prompt)} | {cpu} |"
        )


if __name__ == "__main__":
    main()

"""What ``import stability.auto`` adds to a short training script's start and exit, and what ``stability --help`` costs.

Runs, alternating in rounds (so a shared machine's noise hits both alike), a tiny training script (an MLP, SGD,
``--steps`` steps, ``import torch`` in both) as a fresh process without and with ``import stability.auto`` (embedded
redis-server and local worker, a private run directory per run), and reports per variant the median of:

* ``total``: the process's wall time from start to exit;
* ``exit``: from the script's last step to the process's exit (what the user waits for after training);
* ``cpu``: the training process's own CPU time (user + system, from ``wait4``): what the import, the capture and
  the session's work in the trainer cost it, undisturbed by other processes on a shared machine (the supervisor,
  redis-server and worker it starts are not included: they run in their own processes);
* for the stability variant ``report``: from the process's exit until ``findings.json`` is written by the local
  worker, which finishes draining in the background after the training process is gone.

Then ``stability --help`` and ``python -c pass`` (best of ``--rounds``). Ratios are against the plain script / bare
interpreter measured in the same run.

    OMP_NUM_THREADS=1 python bench/bench_startup.py [--rounds 5] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys, time
    if sys.argv[1] == "1":
        import stability.auto
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(int(sys.argv[2])):
        x = torch.randn(16, 32)
        loss = ((model(x) - 1.0) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("LAST", time.time(), flush=True)
""")


def run_script(script: Path, stability: bool, steps: int, run_dir: Path) -> tuple[float, float, float, float | None]:
    """(total, exit, cpu, report) seconds of one run; ``report`` None without stability or when no report came."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(OMP_NUM_THREADS="1", STABILITY_RUN_DIR=str(run_dir), STABILITY_QUIET="1")
    out = run_dir.parent / f"{run_dir.name}.out"
    start = time.time()
    with out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, str(script), "1" if stability else "0", str(steps)], env=env,
                                stdout=stdout, stderr=subprocess.DEVNULL)
        _pid, status, usage = os.wait4(proc.pid, 0)
    ended = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"the training script exited with {proc.returncode}")
    cpu = usage.ru_utime + usage.ru_stime
    last = float(next(line.split()[1] for line in out.read_text().splitlines() if line.startswith("LAST")))
    report = None
    if stability:
        findings = run_dir / "findings.json"
        deadline = time.monotonic() + 120
        while not findings.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        report = time.time() - ended if findings.exists() else None
    return ended - start, ended - last, cpu, report


def best_of(cmd: list[str], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stability-bench-startup-") as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        results: dict[bool, list[tuple[float, float, float, float | None]]] = {False: [], True: []}
        for r in range(args.rounds):
            for stability in (False, True):
                results[stability].append(run_script(script, stability, args.steps, Path(tmp) / f"run{r}-{stability}"))
        plain_total = statistics.median(row[0] for row in results[False])
        plain_cpu = statistics.median(row[2] for row in results[False])
        print(f"tiny MLP, {args.steps} steps, {args.rounds} rounds, median seconds, load average "
              f"{os.getloadavg()[0]:.1f}")
        for stability, label in ((False, "plain script"), (True, "with import stability.auto")):
            rows = results[stability]
            total = statistics.median(row[0] for row in rows)
            exit_s = statistics.median(row[1] for row in rows)
            cpu = statistics.median(row[2] for row in rows)
            reports = [row[3] for row in rows if row[3] is not None]
            extra = f"  report {statistics.median(reports):.2f} s after exit" if reports else ""
            print(f"{label:28s} total {total:6.2f} s ({total - plain_total:+.2f} s)  exit {exit_s:5.2f} s after the "
                  f"last step  process CPU {cpu:5.2f} s ({cpu - plain_cpu:+.2f} s){extra}")
        bare = best_of([sys.executable, "-c", "pass"], args.rounds)
        helped = best_of([sys.executable, "-m", "stability.cli", "--help"], args.rounds)
        print(f"python -c pass               {bare:6.3f} s (best of {args.rounds})")
        print(f"stability --help             {helped:6.3f} s (x{helped / bare:.2f}, {helped - bare:+.3f} s)")


if __name__ == "__main__":
    main()

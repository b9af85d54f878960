"""How long an embedded run takes to clean up after its training process ends, and what the supervisor costs.

For each ending (clean exit, exception, SIGTERM, SIGKILL) a small ``import stability.auto`` training script runs in
a subprocess until step 60; the script then ends that way. Printed: seconds from the end of the training process
until its supervisor, redis-server and worker are all gone (the worker has drained the run and written
findings.json first), whether findings.json / report.html / status.json exist, the status recorded, and the
resident memory of the supervisor process while the run was live.

    OMP_NUM_THREADS=1 python bench/bench_lifecycle.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, time
    import torch
    import stability.auto  # noqa: F401
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in range(100000):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step == 60:
            open(os.environ["MARKER"], "w").close()
            if os.environ["END"] == "clean":
                break
            if os.environ["END"] == "exception":
                raise RuntimeError("boom")
        time.sleep(0.02)
""")


def descendants(pid: int) -> dict[int, str]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            try:
                out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def one(end: str, root: Path) -> dict[str, object]:
    work = root / end
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STABILITY_")}
    env.update(STABILITY_RUN_DIR=str(work / "run"), MARKER=str(work / "marker"), END=end, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(work / "train.py")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    supervisor_kib = 0
    while not (work / "marker").exists():
        seen.update(descendants(proc.pid))
        time.sleep(0.1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        seen.update(descendants(proc.pid))
        cmds = " ".join(seen.values())
        if "redis-server" in cmds and "stability.worker" in cmds:
            break
        time.sleep(0.1)
    for pid, cmd in seen.items():
        if "stability.supervisor" in cmd and alive(pid):
            supervisor_kib = rss_kib(pid)
    if end in ("SIGTERM", "SIGKILL"):
        proc.send_signal(getattr(signal, end))
    rc = proc.wait(300)
    ended = time.monotonic()
    while any(alive(pid) for pid in seen) and time.monotonic() - ended < 600:
        time.sleep(0.1)
    cleanup = time.monotonic() - ended
    run = work / "run"
    status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
    return {"end": end, "rc": rc, "cleanup_s": round(cleanup, 1), "left": sum(alive(p) for p in seen),
            "findings": (run / "findings.json").exists(), "report": (run / "report.html").exists(),
            "status": f"{status.get('status')} at {status.get('step')} ({status.get('reason')})",
            "supervisor_rss_mib": round(supervisor_kib / 1024, 1)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for end in ("clean", "exception", "SIGTERM", "SIGKILL"):
            print(json.dumps(one(end, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()

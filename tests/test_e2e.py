"""The scale-out path end to end: a real training process points STABILITY_REDIS_URL at a redis-server, a separate
`stability worker` process diagnoses it, and the Redis server is killed and restarted in the middle of training.
Nothing is lost, nothing is processed twice, and the NaN injected while Redis was down is still found."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import torch

import stability
from stability import keys
from stability.embedded import RedisServer

pytestmark = pytest.mark.slow

STEPS, DOWN, UP, NAN_STEP = 120, 40, 80, 60


def _worker(url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(STABILITY_REDIS_URL=url, STABILITY_SWEEP_S="0.2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "stability.worker", "--loglevel", "INFO"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _train(handle: stability.Handle, server: RedisServer) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if step == DOWN:
            server.kill()
        if step == UP:
            server.start()
        x = torch.randn(16, 8)
        if step == NAN_STEP:
            x[0, 0] = float("nan")
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step == NAN_STEP:  # keep training healthy after the poisoned batch (as a guard would)
            with torch.no_grad():
                for p in model.parameters():
                    p.nan_to_num_(0.0)
            opt.state.clear()
    return losses


def _archived(run_dir: Path) -> list[tuple[int, int]]:
    tables = [pq.read_table(p, columns=["rank", "step"]) for p in (run_dir / "archive").glob("*.parquet")]
    table = pa.concat_tables(tables)
    return list(zip(table.column("rank").to_pylist(), table.column("step").to_pylist(), strict=True))


def test_training_with_external_redis_killed_midrun_loses_nothing(redis_server: RedisServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    worker = _worker(redis_server.url, tmp_path / "worker.log")
    try:
        with stability.watch(run_id="e2e", run_dir=run_dir, redis_url=redis_server.url) as handle:
            _train(handle, redis_server)
            assert handle.session is not None
            emitter = handle.session.emitter
        stats = emitter.stats
        assert stats.spooled > 0 and stats.replayed == stats.spooled and stats.dropped == 0 and stats.errors == 0
        client = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 120
        while not client.hexists(keys.meta("e2e"), "drained"):
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)

    rows = _archived(run_dir)
    assert Counter(rows).most_common(1)[0][1] == 1, "a record was archived twice"
    assert sorted(rows) == [(0, s) for s in range(STEPS)]
    findings: list[dict[str, Any]] = [json.loads(f[b"f"]) for _, f in client.xrange(keys.findings("e2e"))]
    nan = [f for f in findings if f["kind"] == "nan"]
    assert nan and nan[0]["step"] == NAN_STEP and nan[0]["causes"][0]["cause"] == "numerical_nan", findings
    assert client.xlen(keys.errors("e2e")) == 0

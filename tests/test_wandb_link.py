"""The W&B diagnosis run links to the training script's own ``wandb.run`` without writing to it.

End to end: a training process calls ``wandb.init(mode="offline", project=..., group=...)``, then
``stability.watch(...)`` against a private redis-server, trains a tiny model on the CPU with an injected NaN and
logs its own metrics. A real :class:`Drainer` with the real detectors and the W&B sink (the worker side, in this
process) drains the run. Both offline ``.wandb`` files are read back (tests/wandb_files.py): the diagnosis run has
the training run's project and group and names it in its config; the training run holds nothing the worker wrote.
The W&B server is the one part that cannot run here (offline mode).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from stability.worker.drain import Drainer
from stability.worker.sinks import redis_meta
from stability.worker.wandb_sink import WandbSink
from tests import wandb_files

RUN = "run-wandb-link"

TRAIN = textwrap.dedent(
    """
    import math, sys
    import torch
    import wandb
    import stability

    torch.set_num_threads(1)
    redis_url, run_dir = sys.argv[1], sys.argv[2]
    run = wandb.init(mode="offline", project="stab-link", group="exp-7", name="trainer")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = stability.watch(model, opt, run_id=sys.argv[3], run_dir=run_dir, redis_url=redis_url)
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        x = torch.randn(32, 8, generator=gen)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        if step == 30:
            loss = loss * math.nan  # the injected fault
        opt.zero_grad()
        loss.backward()
        opt.step()  # from step 30 on the weights are NaN
        run.log({"train/loss": loss.item()}, step=step)
    handle.close()
    print("TRAINING_RUN_ID", run.id, flush=True)
    run.finish()
    """
)


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    return tmp_path


def drain_until_done(client: Any, sink: WandbSink, timeout: float = 60.0) -> list[Any]:
    findings: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = Drainer(client, RUN, sinks=[sink]).run()
        findings += result.findings
        if result.status == "drained":
            return findings
        time.sleep(0.1)
    raise TimeoutError(f"{RUN} not drained within {timeout}s")


def test_the_diagnosis_run_links_to_the_training_run_and_never_writes_to_it(
    offline: Path, redis_server: Any, redis_client: Any
) -> None:
    run_dir, train_dir = offline / "run", offline / "trainer"
    train_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SERVICE", "STABILITY_REDIS_URL")}
    # The session records the mode from WANDB_MODE; a script that only passes mode="offline" to wandb.init would
    # need the session to read wandb.run.settings.mode (see the report), so the variable is set here too.
    env |= {"WANDB_MODE": "offline", "WANDB_DIR": str(train_dir), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN, redis_server.url, str(run_dir), RUN],
        env=env, cwd=offline, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    training_id = proc.stdout.split("TRAINING_RUN_ID")[1].split()[0]

    meta = redis_meta(redis_client)(RUN)
    assert (meta["wandb_project"], meta["wandb_group"], meta["wandb_run_id"]) == ("stab-link", "exp-7", training_id)

    sink = WandbSink(redis_meta(redis_client), window=5)
    findings = drain_until_done(redis_client, sink)
    assert any(f.kind == "nan" and f.step == 30 for f in findings)

    diagnosis = wandb_files.finished_run_file(run_dir)  # the worker's run, in the training run's run dir
    training = wandb_files.finished_run_file(train_dir)
    info, train_info = wandb_files.run_info(diagnosis), wandb_files.run_info(training)
    assert train_info["run_id"] == training_id and info["run_id"] != training_id
    assert (info["project"], info["group"], info["job_type"]) == ("stab-link", "exp-7", "diagnosis")
    assert (train_info["project"], train_info["group"]) == ("stab-link", "exp-7")
    config = wandb_files.config(diagnosis)
    assert config["training_wandb_run_id"] == training_id and config["training_run_id"] == RUN
    titles = [a["title"] for a in wandb_files.alerts(diagnosis)]
    assert "nan at step 30" in titles
    diag_rows = [r for r in wandb_files.history(diagnosis) if "diag/step" in r]
    assert {r["diag/step"] for r in diag_rows} >= set(range(25, 36))

    # the training run: only what the script logged
    assert wandb_files.alerts(training) == []
    train_rows = wandb_files.history(training)
    assert len(train_rows) == 40
    assert all(not k.startswith(("diag/", "findings", "incidents/")) for r in train_rows for k in r)
    assert not any(k.startswith(("training_", "_wandb/visualize")) for k in wandb_files.config(training))


def test_an_active_wandb_run_in_the_same_process_is_left_alone(offline: Path) -> None:
    """The sink creates its own run even when ``wandb.run`` is active in its process, and logs nothing into it."""
    import wandb

    from tests.test_wandb_sink import NAN, entries

    training = wandb.init(mode="offline", project="stab-link", group="g2", dir=str(offline / "trainer"))
    try:
        training.log({"train/loss": 1.0})
        run_dir = offline / "run"
        run_dir.mkdir()
        meta = {"wandb_project": "stab-link", "wandb_group": "g2", "wandb_run_id": training.id, "run_dir": str(run_dir)}
        sink = WandbSink(lambda run_id: meta, window=3)
        sink.emit("r-same", [NAN], entries("r-same", range(25, 40)))
        sink.close("r-same")
        assert wandb.run is training  # still the script's run
        training.log({"train/loss": 0.5})
    finally:
        training.finish()
    diagnosis = wandb_files.finished_run_file(offline / "run")
    assert wandb_files.run_info(diagnosis)["group"] == "g2"
    assert [a["title"] for a in wandb_files.alerts(diagnosis)] == ["nan at step 30"]
    train_file = wandb_files.finished_run_file(offline / "trainer")
    assert wandb_files.alerts(train_file) == []
    assert [r.get("train/loss") for r in wandb_files.history(train_file)] == [1.0, 0.5]
    assert all(len([k for k in r if not k.startswith("_")]) == 1 for r in wandb_files.history(train_file))

"""Slowdowns, stragglers, hangs, memory leaks and the on-demand profiler (issue 12).

Real parts: torch on the CPU with the real Capture hooks, a two-process gloo DDP run, a private redis-server and the
``stability profile`` command. Simulated records only where a run would take minutes (the silence check, the clean
4-rank run: ``bench/bench_slowdowns.py`` runs the full-size versions).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stability.cli import main as cli_main
from stability.config import WatchConfig
from stability.detectors.base import Severity
from stability.detectors.engine import DiagnoserConfig, RunDiagnoser
from stability.detectors.hang import HangConfig
from stability.detectors.steptime import PERF_KINDS
from stability.evaluation.ddp import run_ranks
from stability.hooks.capture import Capture
from stability.records import StepRecord
from stability.testing import ListSink, capture_loop, saving_checkpoint
from tests._slow_worker import SlowSpec, slow_worker


def _diagnose(records: list[StepRecord], config: DiagnoserConfig | None = None) -> list:
    diag = RunDiagnoser(config)
    found = []
    for record in sorted(records, key=lambda r: (r.step, r.rank)):
        found += diag.update(record)
    return found + diag.finish()


def _loop(tmp_path: Path, steps: int, before_step=lambda step: None) -> list[StepRecord]:
    """A tiny single-process training loop under Capture (watchdog off); ``before_step(step)`` is the data loader."""
    config = WatchConfig(run_id="slow", run_dir=tmp_path, layer_every=0, stats_every=0)
    return capture_loop(config, steps, lambda step, capture: before_step(step))


def test_capture_records_step_timing_and_memory(tmp_path: Path) -> None:
    records = _loop(tmp_path, 4, lambda step: time.sleep(0.05 if step == 2 else 0.0))
    assert [r.step for r in records] == [0, 1, 2, 3]
    second = records[2].signals
    assert second["data_time"] >= 0.05 and second["step_time"] >= second["data_time"] + 0.02
    assert 0.02 <= second["compute_time"] < second["step_time"]
    assert second["samples_per_s"] == pytest.approx(16 / second["step_time"])
    assert 1e6 < second["host_rss"] < second["host_mem_limit"]
    assert "data_time" not in records[0].signals  # no previous step end to wait from


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it on a lent GPU); "
                    "the CPU path is the test above")
def test_cuda_step_timing_and_memory_never_sync(tmp_path: Path) -> None:
    """On CUDA: allocator counters every step and the device step time from CUDA events a step or more later, with
    any host-device sync in the hooks an error (torch.cuda.set_sync_debug_mode)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
    sink = ListSink()
    os.environ["STABILITY_WATCHDOG"] = "0"
    capture = Capture(WatchConfig(run_id="cuda-timing", run_dir=tmp_path, stats_every=0), sink).attach(model, opt)
    data = torch.randn(64, 256, device="cuda")

    def step() -> None:
        model(data).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    capture.close()
    assert capture.errors == 0 and len(sink) == 9
    last = sink.records[-1].signals
    assert 0 < last["mem_allocated"] <= last["mem_peak"] <= last["mem_limit"] and last["mem_reserved"] > 0
    device_times = [r.signals["device_step_time"] for r in sink.records if "device_step_time" in r.signals]
    assert device_times and all(0 < t < 60 for t in device_times)


def test_injected_dataloader_sleep_is_a_dataloader_stall(tmp_path: Path) -> None:
    stalls = {45, 53, 68}  # irregular: not a recurring checkpoint / eval step
    records = _loop(tmp_path, 75, lambda step: time.sleep(0.6 if step in stalls else 0.0))
    found = [f for f in _diagnose(records) if f.kind in PERF_KINDS]
    stall = [f for f in found if f.kind == "dataloader_stall"]
    assert stall and stall[-1].step in stalls and stall[-1].causes[0].cause == "dataloader_stall", found
    assert "waiting for data" in stall[-1].message and stall[-1].causes[0].remedy
    assert not [f for f in found if f.kind in ("slowdown", "memory_leak", "straggler", "hang")], found


@pytest.mark.parametrize(("step_s", "warned"), [(0.001, False), (0.02, True)])
def test_a_stall_is_a_warning_only_when_it_costs_real_time(step_s: float, warned: bool) -> None:
    """The same 30x irregular data stalls: on 1 ms steps (a busy machine's scheduler pausing a tiny CPU script, seen
    on a clean pytorch/examples run) an INFO; on 20 ms steps (0.6 s each) a WARNING."""
    rng = np.random.default_rng(3)
    records = []
    for step in range(120):
        data = 30 * step_s if step in (70, 83, 101) else 0.05 * step_s * float(rng.lognormal(0, 0.1))
        records.append(StepRecord(run_id="r", step=step, signals={
            "step_time": data + step_s * float(rng.lognormal(0, 0.05)), "data_time": data}))
    stalls = [f for f in _diagnose(records) if f.kind == "dataloader_stall"]
    assert len(stalls) == 1 and stalls[0].step == 101, stalls
    assert (stalls[0].severity == Severity.WARNING) == warned, stalls


def test_recurring_outliers_are_learned_not_alarmed() -> None:
    rng = np.random.default_rng(1)
    records = []
    for step in range(400):
        slow = step % 50 == 0 and step > 0  # a checkpoint save every 50 steps (counts as data waiting)
        data = 2.0 if slow else 0.01 * float(rng.lognormal(0, 0.1))
        records.append(StepRecord(run_id="r", step=step, signals={
            "step_time": data + 0.2 * float(rng.lognormal(0, 0.1)), "data_time": data}))
    assert [f for f in _diagnose(records) if f.kind in PERF_KINDS] == []


def test_growing_host_memory_is_a_leak_with_a_projection(tmp_path: Path) -> None:
    kept: list[np.ndarray] = []
    records = _loop(tmp_path, 100, lambda step: kept.append(np.ones(3 * 2**20 // 8)))  # 3 MiB per step, touched
    found = [f for f in _diagnose(records) if f.kind in PERF_KINDS]
    leaks = [f for f in found if f.kind == "memory_leak"]  # (a loaded machine may add irregular slow steps)
    assert len(leaks) == 1, found
    leak = leaks[0]
    assert leak.signal == "host_rss" and leak.causes[0].cause == "memory_leak"
    assert 2.5 * 2**20 < leak.evidence["bytes_per_step"] < 3.5 * 2**20
    assert leak.evidence["projected_step"] > leak.step and "reaches the limit" in leak.message
    assert len(kept) == 100


def test_slow_rank_is_a_straggler_and_a_stopped_rank_a_hang_in_a_gloo_run(tmp_path: Path) -> None:
    spec = SlowSpec(name="slow-ddp", run_dir=str(tmp_path))
    records = run_ranks(slow_worker, spec, timeout=300.0)
    found = [f for f in _diagnose(records) if f.kind in PERF_KINDS]
    host = socket.gethostname()
    stragglers = [f for f in found if f.kind == "straggler"]
    assert [(f.rank, f.host) for f in stragglers] == [(1, host)], found
    assert stragglers[0].step < 50 and stragglers[0].causes[0].cause == "straggler"
    hangs = [f for f in found if f.kind == "hang" and f.rank == spec.hang_rank
             and f.evidence["last_step"] == spec.hang_step - 1]  # (a loaded machine may stall a step too)
    assert len(hangs) == 1 and hangs[0].host == host, found
    assert f"after step {spec.hang_step - 1}" in hangs[0].message and hangs[0].causes[0].cause == "hang"
    dump = tmp_path / f"hang-rank{spec.hang_rank}-step{spec.hang_step}.txt"
    text = dump.read_text()
    assert "_slow_worker.py" in text and "slow_worker" in text  # the stopped rank's Python stack


def test_a_rank_silent_while_another_continues_is_a_hang() -> None:
    records = []
    for step in range(40):
        for rank in (0, 1):
            if rank == 1 and step > 20:
                continue  # rank 1 stops after step 20; rank 0 goes on
            records.append(StepRecord(run_id="r", step=step, rank=rank, host=f"h{rank}", wall_time=100.0 + step,
                                      signals={"step_time": 1.0, "data_time": 0.1, "compute_time": 0.5}))
    found = [f for f in _diagnose(records, DiagnoserConfig(hang=HangConfig(min_s=1.0))) if f.kind == "hang"]
    assert [(f.rank, f.host, f.step) for f in found] == [(1, "h1", 21)]
    assert "rank 1 on h1 hung after step 20" in found[0].message and found[0].evidence["silent_s"] >= 2.0


def test_hogwild_processes_are_neither_stragglers_nor_hung_when_one_ends_first() -> None:
    """Forked Hogwild processes (coordinate ``fork``) wait for no one: a process 1.6x slower than the other, and
    one that ends 20 steps earlier, are the same records that make a straggler and a hang of DDP ranks."""
    def records(coords: dict[int, dict[str, int]]) -> list[StepRecord]:
        return [StepRecord(run_id="r", step=step, rank=rank, host="h", wall_time=100.0 + step,
                           coords=coords[rank], signals={"step_time": 1.0, "data_time": 0.1,
                                                         "compute_time": 0.8 if rank == 2 else 0.5})
                for step in range(60) for rank in (1, 2) if rank == 1 or step < 40]

    config = DiagnoserConfig(hang=HangConfig(min_s=1.0))
    ddp = {f.kind for f in _diagnose(records({1: {}, 2: {}}), config)}
    assert {"straggler", "hang"} <= ddp  # the same timings in a DDP run
    forked = _diagnose(records({1: {"fork": 1}, 2: {"fork": 2}}), config)
    assert [f for f in forked if f.kind in PERF_KINDS] == []


def test_clean_multirank_records_raise_no_performance_finding() -> None:
    rng = np.random.default_rng(7)
    records = [StepRecord(run_id="r", step=step, rank=rank, host=f"h{rank}", wall_time=float(step),
                          coords={"world_size": 4}, signals={
                              "step_time": 0.3, "data_time": 0.02 * float(rng.lognormal(0, 0.1)),
                              "compute_time": 0.2 * float(rng.lognormal(0, 0.1)),
                              "host_rss": 3e9 + 1e6 * float(rng.standard_normal())})
               for step in range(300) for rank in range(4)]
    assert [f for f in _diagnose(records) if f.kind in PERF_KINDS] == []


def test_profile_request_writes_a_chrome_trace_and_a_summary(tmp_path: Path, redis_server, capsys) -> None:
    run_id = "prof-run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = ListSink()
    capture = Capture(WatchConfig(run_id=run_id, run_dir=tmp_path, redis_url=redis_server.url, layer_every=0,
                                  stats_every=0), sink).attach(model, opt)
    assert cli_main(["profile", run_id, "--steps", "3", "--redis", redis_server.url]) == 0
    assert "profile" in capsys.readouterr().out
    deadline = time.monotonic() + 60.0
    try:
        while not list(tmp_path.glob("profile-rank0-step*.summary.json")):
            assert time.monotonic() < deadline, "no profile written within 60 s of the request"
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
    finally:
        capture.close()
    (trace,) = tmp_path.glob("profile-rank0-step*.json.gz")
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    ops = {e.get("name") for e in events if e.get("cat") == "cpu_op"}
    assert {"aten::addmm", "aten::relu"} <= ops, sorted(ops)[:20]
    (summary_file,) = tmp_path.glob("profile-rank0-step*.summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["last_step"] - summary["first_step"] == 2 and summary["top_ops"]
    assert summary["split_s"]["compute"] > 0 and set(summary["split_s"]) == {"compute", "comm", "memcpy", "data"}
    profiled = [r for r in sink.records if "profile_compute_s" in r.signals]
    assert [r.step for r in profiled] == [summary["last_step"]]


def test_a_performance_incident_asks_for_one_profile(redis_client) -> None:
    from stability import keys
    from stability.detectors.base import Finding, Severity
    from stability.worker.advice import AdviceSink

    def finding(kind: str, step: int, severity: Severity = Severity.WARNING) -> Finding:
        return Finding(kind=kind, step=step, onset=step, severity=severity, signal="compute_time", value=1.0,
                       message="m", detector="d", rank=3)

    sink = AdviceSink(redis_client)
    sink.emit("r1", [finding("step_time_spike", 5, Severity.INFO), finding("loss_spike", 6)], [])
    assert redis_client.get(keys.profile("r1")) is None  # neither is a performance warning
    sink.emit("r1", [finding("straggler", 40)], [])
    first = json.loads(redis_client.get(keys.profile("r1")))
    assert first["steps"] == 5 and first["reason"] == "straggler on rank 3 at step 40"
    sink.emit("r1", [finding("memory_leak", 90)], [])
    assert json.loads(redis_client.get(keys.profile("r1")))["id"] == first["id"]  # once per hour, not per finding
    assert 0 < redis_client.ttl(keys.profile("r1")) <= 3600


def test_profile_command_bad_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    os.environ.pop("STABILITY_REDIS_URL", None)
    assert cli_main(["profile", "r1", "--steps", "3"]) == 2
    assert "give --redis URL" in capsys.readouterr().err
    assert cli_main(["profile", "r1", "--steps", "0", "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "--steps must be 1-100" in capsys.readouterr().err
    assert cli_main(["profile", "bad id!", "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "run id 'bad id!' is invalid" in capsys.readouterr().err
    assert cli_main(["profile", "r1", "--run-dir", str(tmp_path)]) == 2
    assert "no embedded Redis URL" in capsys.readouterr().err


def test_watchdog_ignores_evaluation_and_checkpoint_saves_and_reports_a_stall(tmp_path: Path) -> None:
    import threading

    from stability.hooks.timing import StepTiming, TimingConfig, Watchdog

    timing = StepTiming(TimingConfig(hang_min_s=0.5, poll_s=3600.0))  # checks driven by the test
    hangs: list[tuple[int, float]] = []
    dog = Watchdog(timing, tmp_path, 0, lambda step, waited, path: hangs.append((step, waited)))
    cpu = torch.device("cpu")
    try:
        for step in range(5):
            timing.end_step(step, cpu, {})
        start = timing.last_end
        assert start is not None and dog.limit() == 0.5
        assert dog.check(start + 0.4) is None  # within the limit
        with torch.no_grad():
            timing.forward((torch.zeros(2),))  # an evaluation pass between steps: activity
        assert dog.check(timing.last_active + 0.4) is None

        with saving_checkpoint() as saver:
            timing.thread = saver  # the "training thread" is inside torch.save
            dump = dog.check(time.monotonic() + 60)
        assert dump is not None and "saving a checkpoint" in dump.read_text() and hangs == []

        timing.end_step(5, cpu, {})  # the next step completed; now a real stall
        timing.thread = threading.get_ident()
        dump = dog.check(timing.last_end + 5.0)
        assert dump == tmp_path / "hang-rank0-step6.txt" and hangs == [(6, pytest.approx(5.0))]
        assert "test_slowdowns.py" in dump.read_text()  # this thread's stack is in it
        assert dog.check(timing.last_end + 9.0) is None  # once per stall
    finally:
        dog.close()


def test_timing_signal_names_are_known_to_the_detectors() -> None:
    from stability.detectors.steptime import PERF_SIGNALS
    from stability.hooks.timing import TIMING_SIGNALS

    assert set(TIMING_SIGNALS) <= PERF_SIGNALS  # the odd-record forest must not take wall-clock jitter as a feature

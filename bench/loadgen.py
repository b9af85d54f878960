"""Load generator: N simulated ranks x M runs of realistic records against a private redis-server and real workers.

Run ``python bench/loadgen.py --help``. It starts a private redis-server (TCP on loopback, no persistence; the
system ``redis-server`` unless ``--redis-server``) and ``--workers`` real worker processes, exactly as
an operator starts them (``python -m stability.worker``: Celery, solo pool, the first one with the embedded beat,
the others ``--no-beat``), then writes records the way the training-side emitter does (one stream per rank, IDs
``<wall ms>-<step>``, run registered in ``stability:runs``) built by ``bench/_records.py``: ~200 signals per record
with 40 modules (global signals, per-module grad / param norms, update ratios, Adam lag, activation max) and
injected anomalies (NaN losses at known wall times, per-layer gradient jumps, loss spikes) so detectors do real
work.

Two modes:

* ``backlog`` (throughput): ``--steps`` records per rank are written first, the workers start on them all at once
  (the runs are registered in one command), and the drain is timed until every entry is acked. The baseline, in
  the same run and on the same Redis, is a bare ``XREADGROUP`` + ``XACK`` loop over a copy of the streams (no
  decoding, no detectors, one process): the Redis floor.
* ``live`` (capacity): every rank writes one record per ``1 / --step-rate`` seconds for ``--duration`` seconds;
  every step one rank per run gets a NaN loss (a rank at most once per 120 steps). Printed: records/s written
  and processed, the consumer lag (entries written but not acked) sampled once a second (max and at the end),
  end-to-end latency from the record's XADD to its ``nan`` finding in the findings stream (the finding's stream
  ID is Redis' clock, the same machine's: p50 / p99 / max), and Redis ``used_memory``.

Both modes also print records per worker CPU-second (the worker processes' user + system time from ``/proc``):
on a shared machine wall-clock rates measure the other jobs too, CPU-time rates much less so.

Everything is printed as one summary (``--json PATH`` also writes it). A worker's log is in the temporary
directory; ``--keep`` keeps that directory and prints where it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import RecordFactory

from stability import keys
from stability.embedded import RedisServer, free_port
from stability.records import encode
from stability.transport import push_urgent

REPO = Path(__file__).resolve().parents[1]
REARM = 120
"""Steps between two NaNs injected on one rank in live mode (the NaN detector re-arms after 20 finite records,
the engine re-alerts a kind on a rank after ``cooldown_steps`` (100))."""


@dataclass
class Result:
    """What one load-generator run measured (printed, and written by ``--json``)."""

    mode: str
    runs: int
    ranks: int
    workers: int
    signals: int
    archive: bool
    records: int = 0
    seconds: float = 0.0
    written_per_s: float = 0.0
    processed_per_s: float = 0.0
    baseline_per_s: float = 0.0
    lag_max: int = 0
    lag_end: int = 0
    lag_samples: list[tuple[float, int]] = field(default_factory=list)
    unread_max: int = 0
    """Live mode: the most entries not yet read by any drain (the lag without the processed, uncommitted ones)."""
    latencies: list[float] = field(default_factory=list)
    injected: int = 0
    findings: dict[str, int] = field(default_factory=dict)
    used_memory: int = 0
    used_memory_peak: int = 0
    redis_version: str = ""
    bytes_per_record: int = 0
    worker_cpu_s: float = 0.0
    writing_s: float = 0.0
    """Live mode: wall seconds while steps were written (the first step's start to the last step's end)."""
    writing_cpu: dict[str, float] = field(default_factory=dict)
    """Live mode: CPU seconds while steps were written: ``workers``, ``loadgen`` (this process: the writer and the lag
    sampler, which reads every stream's group once a second) and ``redis``."""
    """CPU seconds (user + system) the worker processes spent (their main processes: the drains; not the beat)."""
    baseline_cpu_s: float = 0.0
    """CPU seconds of the bare XREADGROUP + XACK loop (this process, while it ran)."""
    load: float = 0.0
    """The machine's 1-minute load average at the end (a busy machine stretches every wall-clock rate)."""
    shard_size: int = 0
    """Ranks per shard of each run (0: unsharded)."""
    no_detectors: bool = False
    """``--no-detectors``: the workers ran the benchmark-only no-op diagnoser."""
    aof_peak: int = 0
    """``--aof``: the largest size of the server's append-only files seen (sampled every 0.5 s)."""
    aof_end: int = 0
    """``--aof``: their size at the end."""
    bursts: list[float] = field(default_factory=list)
    """Live mode: seconds each step's pipelined XADDs took (the records are encoded before their step's time)."""

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        out = {k: v for k, v in self.__dict__.items() if k not in ("lag_samples", "latencies", "bursts")}
        out["burst_max_s"] = max(self.bursts, default=None)
        out["burst_p50_s"] = _quantile(sorted(self.bursts), 0.5)
        out["latency_p50_s"] = _quantile(lat, 0.5)
        out["latency_p99_s"] = _quantile(lat, 0.99)
        out["latency_max_s"] = lat[-1] if lat else None
        out["latency_samples"] = len(lat)
        out["vs_baseline"] = self.processed_per_s / self.baseline_per_s if self.baseline_per_s else None
        out["per_worker_cpu_s"] = self.records / self.worker_cpu_s if self.worker_cpu_s else None
        out["baseline_per_cpu_s"] = self.records / self.baseline_cpu_s if self.baseline_cpu_s else None
        return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


# ----------------------------------------------------------------------------------------------------- workers
def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc/<pid>/stat``; 0 where unreadable)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return total


@contextmanager
def workers(url: str, count: int, tmp: Path, args: argparse.Namespace) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` real worker processes (the first with the beat), ready when this yields; killed on exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(STABILITY_REDIS_URL=url, STABILITY_SWEEP_S=str(args.sweep_s), STABILITY_BATCH=str(args.batch),
               STABILITY_DRAIN_S=str(args.drain_s), STABILITY_SNAPSHOT_S=str(args.snapshot_s),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    if args.snapshot_idle_s is not None:
        env["STABILITY_SNAPSHOT_IDLE_S"] = str(args.snapshot_idle_s)
    if args.no_detectors:
        env["STABILITY_BENCH_NO_DETECTORS"] = "1"  # benchmark-only mode of the worker (worker/tasks.py)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp / f"worker{i}.log" for i in range(count)]
    try:
        for i, log in enumerate(logs):
            cmd = [sys.executable, "-m", "stability.worker", "--loglevel", "INFO", "-n", f"w{i}@loadgen"]
            if i:
                cmd.append("--no-beat")
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + 120
        while not all(b"ready." in log.read_bytes() for log in logs):
            for proc, log in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    raise SystemExit(f"worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit("workers not ready after 120 s")
            time.sleep(0.1)
        yield procs
    finally:
        for proc in procs:  # worker, beat and pool share one process group
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ----------------------------------------------------------------------------------------------------- writing
def run_ids(args: argparse.Namespace) -> list[str]:
    return [f"load-{i}" for i in range(args.runs)]


def register(client: redis.Redis[bytes], runs: list[str], ranks: int, tmp: Path, archive: bool,
             shard_size: int = 0) -> None:
    """Metadata and rank sets as the emitter writes them (the run is added to ``stability:runs`` separately);
    ``shard_size`` > 0 makes each run a sharded run (``worker.shards``)."""
    pipe = client.pipeline(transaction=False)
    for run in runs:
        meta: dict[str, str] = {"started": repr(time.time()), "host": "loadgen"}
        if shard_size:
            meta["shard_size"] = str(shard_size)
        if archive:
            (tmp / run).mkdir(exist_ok=True)
            meta["run_dir"] = str(tmp / run)
        pipe.hset(keys.meta(run), mapping=meta)  # type: ignore[arg-type]
        for start in range(0, ranks, 4096):
            pipe.sadd(keys.ranks(run), *range(start, min(ranks, start + 4096)))
    pipe.execute()


def anomaly_at(step: int, rank: int, ranks: int, run_index: int, every: int) -> str | None:
    """The anomaly injected at (step, rank), if any: rotating ranks, so no rank's cooldown hides the next one."""
    if every <= 0 or step < 1 or step % every:
        return None
    turn = step // every
    kinds = ("nan", "layer_grad", "spike") if every > 1 else ("nan",)
    kind = kinds[turn % len(kinds)]
    if rank == (turn * 7919 + run_index * 31) % ranks:
        return kind
    return None


def fill_backlog(client: redis.Redis[bytes], runs: list[str], args: argparse.Namespace, prefix: str = "") -> int:
    """Write ``args.steps`` records per rank of every run; return the bytes of one record."""
    size = 0
    base_ms = int(time.time() * 1000) - args.steps * 1000
    for index, run in enumerate(runs):
        factories = [RecordFactory(run_id=run, rank=r, modules=args.modules, stats_every=args.stats_every)
                     for r in range(args.ranks)]
        pipe = client.pipeline(transaction=False)
        for step in range(args.steps):
            for rank, factory in enumerate(factories):
                kind = anomaly_at(step, rank, args.ranks, index, args.anomaly_every)
                data = encode(factory.record(step, (base_ms + step * 1000) / 1000, kind))
                size = len(data)
                pipe.xadd(prefix + keys.records(run, rank), {"r": data}, id=f"{base_ms + step * 1000}-{step}")
            if len(pipe) >= 500:
                pipe.execute()
        pipe.execute()
    return size


# ----------------------------------------------------------------------------------------------------- measuring
def unacked(client: redis.Redis[bytes], runs: list[str], ranks: int, *, unread: list[int] | None = None) -> int:
    """Entries written but not acked, over every rank stream: lag (never delivered) + pending (delivered, unacked);
    a stream without the group yet counts whole. ``unread`` gets the lag alone (entries not yet read by a drain:
    pending entries were processed and wait for a commit)."""
    streams = [keys.records(run, r) for run in runs for r in range(ranks)]
    total = never = 0
    for start in range(0, len(streams), 2048):
        chunk = streams[start:start + 2048]
        pipe = client.pipeline(transaction=False)
        for stream in chunk:
            pipe.xinfo_groups(stream)
            pipe.xlen(stream)
        replies = pipe.execute(raise_on_error=False)
        for groups, length in zip(replies[::2], replies[1::2], strict=True):
            group = next((g for g in groups if _text(g["name"]) == keys.GROUP), None) \
                if isinstance(groups, list) else None
            if group is None:
                total += int(length) if isinstance(length, int) else 0
                never += int(length) if isinstance(length, int) else 0
            else:
                lag = int(group.get("lag") or 0)
                total += int(group["pending"]) + lag
                never += lag
    if unread is not None:
        unread.append(never)
    return total


def _redis_cpu(client: redis.Redis[bytes]) -> float:
    info: dict[str, Any] = client.info("cpu")  # type: ignore[assignment]
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def bare_loop(client: redis.Redis[bytes], runs: list[str], ranks: int, batch: int, prefix: str) -> float:
    """Records/s of a plain XREADGROUP + XACK loop over the ``prefix`` copy of the streams (the Redis floor)."""
    streams = [prefix + keys.records(run, r) for run in runs for r in range(ranks)]
    for stream in streams:
        client.xgroup_create(stream, "bare", id="0")
    done = 0
    start = time.perf_counter()
    chunk = 256
    while True:
        got = 0
        for i in range(0, len(streams), chunk):
            reply = client.xreadgroup("bare", "c", dict.fromkeys(streams[i:i + chunk], ">"), count=batch)
            if not reply:
                continue
            pipe = client.pipeline(transaction=False)
            for name, entries in reply:  # type: ignore[union-attr]
                pipe.xack(name, "bare", *[eid for eid, _ in entries])
                got += len(entries)
            pipe.execute()
        if not got:
            break
        done += got
    seconds = time.perf_counter() - start
    for stream in streams:
        client.delete(stream)
    return done / seconds


def findings_by_kind(client: redis.Redis[bytes],
                     runs: list[str]) -> tuple[dict[str, int], list[tuple[str, str, dict[str, Any]]]]:
    """Counts of the findings per kind, and every finding as (run, stream id, finding); revisions of an alerted
    diagnosis (``evidence["revised"]``) are counted apart (``revisions``), not as findings."""
    kinds: dict[str, int] = {}
    out = []
    for run in runs:
        for eid, fields in client.xrange(keys.findings(run)):
            finding = json.loads(fields[b"f"])
            if (finding.get("evidence") or {}).get("revised"):
                kinds["revisions"] = kinds.get("revisions", 0) + 1
                continue
            kinds[finding["kind"]] = kinds.get(finding["kind"], 0) + 1
            out.append((run, _text(eid), finding))
    return kinds, out


def memory(client: redis.Redis[bytes], result: Result) -> None:
    info = client.info("memory")
    result.used_memory = int(info["used_memory"])
    result.used_memory_peak = int(info["used_memory_peak"])


# ----------------------------------------------------------------------------------------------------- modes
def backlog(client: redis.Redis[bytes], url: str, tmp: Path, args: argparse.Namespace) -> Result:
    runs = run_ids(args)
    result = Result(mode="backlog", runs=args.runs, ranks=args.ranks, workers=args.workers, signals=0,
                    archive=args.archive)
    result.signals = RecordFactory(run_id="x", rank=0, modules=args.modules).signal_count
    total = args.runs * args.ranks * args.steps
    if not args.no_baseline:
        fill_backlog(client, runs, args, prefix="bare:")
        cpu = time.process_time()
        result.baseline_per_s = bare_loop(client, runs, args.ranks, args.batch, "bare:")
        result.baseline_cpu_s = time.process_time() - cpu
    register(client, runs, args.ranks, tmp, args.archive, args.shard_size)
    start = time.perf_counter()
    result.bytes_per_record = fill_backlog(client, runs, args)
    result.written_per_s = total / (time.perf_counter() - start)
    with workers(url, args.workers, tmp, args) as procs:
        pids = [p.pid for p in procs]
        cpu = cpu_seconds(pids)
        start = time.monotonic()
        client.sadd(keys.RUNS, *runs)
        deadline = start + args.timeout
        while True:
            left = unacked(client, runs, args.ranks)
            now = time.monotonic()
            result.lag_samples.append((now - start, left))
            if left == 0 or now > deadline:
                break
            time.sleep(0.25)
        result.seconds = time.monotonic() - start
        result.worker_cpu_s = cpu_seconds(pids) - cpu
        memory(client, result)
    result.records = total - left
    result.lag_end = left
    result.lag_max = max(n for _, n in result.lag_samples)
    result.processed_per_s = result.records / result.seconds
    result.findings, _ = findings_by_kind(client, runs)
    return result


_Prepared = tuple[bytes, bytes, str, tuple[str, int, int] | None]
"""One encoded record ready to write: stream key, record bytes, entry id, its NaN probe (run, rank, step) or None."""


class _StepWriter:
    """Writes one step of every rank of every run, as the emitters of a live job would (pipelined XADDs), with a
    NaN loss on one rank per run (a rank at most once per :data:`REARM` steps); remembers when each NaN record
    reached Redis (the pipeline chunk that carried it returned)."""

    def __init__(self, client: redis.Redis[bytes], runs: list[str], args: argparse.Namespace) -> None:
        self.client = client
        self.runs = runs
        self.ranks = args.ranks
        self.factories = {run: [RecordFactory(run_id=run, rank=r, modules=args.modules, stats_every=args.stats_every)
                                for r in range(args.ranks)] for run in runs}
        self.injected: dict[tuple[str, int, int], float] = {}
        self.size = 0
        """Bytes of the last record written."""
        self._last_nan: dict[tuple[str, int], int] = {}
        self._prepared: dict[int, list[_Prepared]] = {}
        self.bursts: list[float] = []
        """Seconds each step's pipelined XADDs took (encoding excluded)."""

    def _nan_rank(self, step: int, index: int, run: str) -> int:
        rank = (step * 7919 + index * 31) % self.ranks if step >= 1 else -1
        if rank < 0 or step - self._last_nan.get((run, rank), -REARM) < REARM:
            return -1  # that rank's last NaN is too recent: the detector would (rightly) not re-alert
        self._last_nan[(run, rank)] = step
        return rank

    def prepare(self, step: int, wall: float) -> None:
        """Encode ``step`` of every rank ahead of its write, as ``wall`` (each rank's emitter encodes its own records in
        parallel in a real job: the single writer here must not stretch the burst by encoding 16k records in it)."""
        batch: list[_Prepared] = []
        for index, run in enumerate(self.runs):
            nan_rank = self._nan_rank(step, index, run)
            for rank, factory in enumerate(self.factories[run]):
                kind = "nan" if rank == nan_rank else None
                data = encode(factory.record(step, wall, kind))
                self.size = len(data)
                batch.append((keys.records(run, rank).encode(), data, f"{int(wall * 1000)}-{step}",
                              (run, rank, step) if kind else None))
        self._prepared[step] = batch

    def write(self, step: int) -> int:
        """Write ``step`` of every rank (encoded now unless :meth:`prepare` did it); return the records written."""
        if step not in self._prepared:
            self.prepare(step, time.time())
        start = time.monotonic()
        pipe = self.client.pipeline(transaction=False)
        probes: list[tuple[str, int, int]] = []
        for stream, data, eid, probe in self._prepared.pop(step):
            pipe.xadd(stream, {"r": data}, id=eid)
            if probe:
                probes.append(probe)
                push_urgent(pipe, probe[0], probe[1])  # as the rank's emitter does with a non-finite record
            if len(pipe) >= 2000:
                self._execute(pipe, probes)
        self._execute(pipe, probes)
        self.bursts.append(time.monotonic() - start)
        return len(self.runs) * self.ranks

    def _execute(self, pipe: Any, probes: list[tuple[str, int, int]]) -> None:
        pipe.execute()
        now = time.time()
        for probe in probes:
            self.injected[probe] = now
        probes.clear()


def live(client: redis.Redis[bytes], url: str, tmp: Path, args: argparse.Namespace) -> Result:
    runs = run_ids(args)
    result = Result(mode="live", runs=args.runs, ranks=args.ranks, workers=args.workers, signals=0,
                    archive=args.archive)
    result.signals = RecordFactory(run_id="x", rank=0, modules=args.modules).signal_count
    writer = _StepWriter(client, runs, args)
    register(client, runs, args.ranks, tmp, args.archive, args.shard_size)
    client.sadd(keys.RUNS, *runs)
    stop = threading.Event()
    sampler_client = redis.Redis.from_url(url)

    def sample(t0: float) -> None:
        while not stop.wait(args.sample_s):
            unread: list[int] = []
            n = unacked(sampler_client, runs, args.ranks, unread=unread)
            result.lag_samples.append((time.monotonic() - t0, n))
            result.unread_max = max(result.unread_max, unread[0])
            memory(sampler_client, result)

    with workers(url, args.workers, tmp, args) as procs:
        pids = [p.pid for p in procs]
        cpu = cpu_seconds(pids)
        own, server = time.process_time(), _redis_cpu(client)
        t0 = time.monotonic()
        sampler = threading.Thread(target=sample, args=(t0,), daemon=True)
        sampler.start()
        written, late = 0, 0.0
        wall0 = time.time()
        steps = max(1, int(args.duration * args.step_rate))
        for step in range(steps):
            wait = t0 + step / args.step_rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            late = max(late, -wait)
            written += writer.write(step)
            if step + 1 < steps:
                writer.prepare(step + 1, wall0 + (step + 1) / args.step_rate)
        result.writing_s = time.monotonic() - t0
        result.writing_cpu = {"workers": cpu_seconds(pids) - cpu, "loadgen": time.process_time() - own,
                              "redis": _redis_cpu(client) - server}
        result.written_per_s = written / max(1e-9, result.writing_s)
        drain_deadline = time.monotonic() + args.timeout
        while unacked(client, runs, args.ranks) and time.monotonic() < drain_deadline:
            time.sleep(0.25)
        result.seconds = time.monotonic() - t0
        result.worker_cpu_s = cpu_seconds(pids) - cpu
        # a held NaN finding of a sharded run waits for the cross-rank stage, which may still be behind when every
        # record is acked: give the findings up to a minute more (their latency is measured from their own ids)
        findings_deadline = min(drain_deadline, time.monotonic() + 60)
        while (findings_by_kind(client, runs)[0].get("nan", 0) < len(writer.injected)
               and time.monotonic() < findings_deadline):
            time.sleep(0.5)
        stop.set()
        sampler.join()
        memory(client, result)
    result.lag_end = unacked(client, runs, args.ranks)
    result.records = written - result.lag_end
    result.processed_per_s = result.records / result.seconds
    result.lag_max = max((n for _, n in result.lag_samples), default=0)
    result.findings, found = findings_by_kind(client, runs)
    result.injected = len(writer.injected)
    result.bytes_per_record = writer.size
    result.bursts = writer.bursts
    for run, eid, finding in found:
        written_at = writer.injected.get((run, finding["rank"], finding["step"]))
        if finding["kind"] == "nan" and written_at is not None:
            result.latencies.append(int(eid.split("-")[0]) / 1000 - written_at)
    if late > 1.0:
        print(f"note: the writer fell {late:.1f} s behind its schedule (the machine could not write that fast)")
    return result


# ----------------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/loadgen.py", description=__doc__.split("\n\n")[0],
                                epilog="Example: python bench/loadgen.py --mode live --runs 8 --ranks 2048 "
                                       "--step-rate 0.1 --duration 60 --workers 2")
    p.add_argument("--mode", choices=("backlog", "live"), default="backlog")
    p.add_argument("--runs", type=int, default=4, help="training runs (default 4)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--modules", type=int, default=40, help="modules per record: 6 + 5 x modules signals (default 40)")
    p.add_argument("--stats-every", type=int, default=1,
                   help="per-module param/update/Adam/activation stats every N steps (default 1: every record)")
    p.add_argument("--steps", type=int, default=500, help="backlog: records per rank (default 500)")
    p.add_argument("--step-rate", type=float, default=1.0, help="live: steps per second per rank (default 1)")
    p.add_argument("--duration", type=float, default=30.0, help="live: seconds of writing (default 30)")
    p.add_argument("--anomaly-every", type=int, default=250,
                   help="backlog: an anomaly (nan / layer_grad / spike in turn) every N steps per run (default 250; "
                        "each finding costs its ranking, up to ~0.5 s with the data-oddity model)")
    p.add_argument("--shard-size", type=int, default=0,
                   help="ranks per shard: each run is a sharded run drained by all workers (default 0: unsharded)")
    p.add_argument("--archive", action="store_true", help="archive to Parquet (run_dir in the run's metadata)")
    p.add_argument("--aof", action="store_true",
                   help="the server with the embedded configuration's append-only file (its peak size is reported)")
    p.add_argument("--sweep-s", type=float, default=0.5, help="STABILITY_SWEEP_S of the workers (default 0.5)")
    p.add_argument("--batch", type=int, default=500, help="STABILITY_BATCH of the workers (default 500)")
    p.add_argument("--snapshot-s", type=float, default=5.0,
                   help="STABILITY_SNAPSHOT_S of the workers: seconds between detector snapshots (default 5)")
    p.add_argument("--snapshot-idle-s", type=float, default=None,
                   help="STABILITY_SNAPSHOT_IDLE_S of the workers: a caught-up drain commits after this (default: "
                        "unset, i.e. --snapshot-s)")
    p.add_argument("--drain-s", type=float, default=20.0, help="STABILITY_DRAIN_S of the workers (default 20)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up waiting for the drain after this (s)")
    p.add_argument("--no-baseline", action="store_true", help="backlog: skip the bare XREADGROUP loop")
    p.add_argument("--no-detectors", action="store_true",
                   help="BENCHMARK ONLY: the workers feed records to a no-op diagnoser (STABILITY_BENCH_NO_DETECTORS=1)"
                        ": the worker's ceiling without detectors (unsharded runs only; nothing is found)")
    p.add_argument("--redis-server", default=_system_redis(),
                   help="redis-server binary (default: /usr/bin/redis-server (7.x: XINFO reports the lag), else the "
                        "one on PATH, else the embedded one)")
    p.add_argument("--sample-s", type=float, default=1.0,
                   help="live: seconds between lag samples (each reads every stream's group: ~0.15 core at 16k ranks "
                        "per sample a second; default 1)")
    p.add_argument("--json", type=Path, help="also write the summary as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (worker logs, archive)")
    args = p.parse_args(argv)
    if min(args.runs, args.ranks, args.workers, args.steps, args.modules) < 1 or args.step_rate <= 0:
        p.error("--runs, --ranks, --workers, --steps, --modules must be >= 1 and --step-rate > 0")
    if args.no_detectors and args.shard_size:
        p.error("--no-detectors applies to unsharded runs only (the drain task), not with --shard-size")
    return args


def _system_redis() -> str | None:
    system = "/usr/bin/redis-server"
    return system if os.access(system, os.X_OK) else shutil.which("redis-server")


def print_summary(out: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:,.0f} ms"

    archive = "on" if out["archive"] else "off"
    if out.get("no_detectors"):
        archive += ", DETECTORS OFF (--no-detectors)"
    shards = f", shard size {out['shard_size']}" if out.get("shard_size") else ""
    print(f"{out['mode']}: {out['runs']} runs x {out['ranks']} ranks{shards}, {out['signals']} signals "
          f"({out['bytes_per_record']} B/record), {out['workers']} worker(s), archive {archive}, "
          f"redis {out['redis_version']}")
    print(f"  records processed : {out['records']:,} in {out['seconds']:.1f} s")
    print(f"  records/s written : {out['written_per_s']:,.0f}")
    ratio = f"  ({out['vs_baseline']:.3f}x the bare XREADGROUP+XACK loop, {out['baseline_per_s']:,.0f}/s)" \
        if out["vs_baseline"] else ""
    print(f"  records/s drained : {out['processed_per_s']:,.0f}{ratio}")
    if out["per_worker_cpu_s"]:
        base = f" (bare loop {out['baseline_per_cpu_s']:,.0f} per CPU-second)" if out["baseline_per_cpu_s"] else ""
        print(f"  per CPU-second    : {out['per_worker_cpu_s']:,.0f} records per worker CPU-second "
              f"({out['worker_cpu_s']:.1f} CPU-s){base}; load average {out['load']:.1f}")
    if out["writing_cpu"]:
        shares = ", ".join(f"{k} {v:.1f} ({v / out['writing_s']:.2f} cores)" for k, v in out["writing_cpu"].items())
        print(f"  CPU while writing : {out['writing_s']:.1f} s: {shares}")
    print(f"  consumer lag      : max {out['lag_max']:,} entries, {out['lag_end']:,} at the end"
          + (f" (not yet read: max {out['unread_max']:,})" if out["mode"] == "live" else ""))
    if out.get("burst_p50_s") is not None:
        print(f"  step burst        : p50 {ms(out['burst_p50_s'])}, max {ms(out['burst_max_s'])} "
              f"(one step's pipelined XADDs, records encoded before)")
    print(f"  latency (nan)     : p50 {ms(out['latency_p50_s'])}, p99 {ms(out['latency_p99_s'])}, "
          f"max {ms(out['latency_max_s'])} ({out['latency_samples']} of {out['injected']} injected)")
    print(f"  redis used_memory : {out['used_memory'] / 2**20:,.1f} MiB (peak {out['used_memory_peak'] / 2**20:,.1f})")
    if out["aof_peak"]:
        print(f"  append-only file  : peak {out['aof_peak'] / 2**20:,.1f} MiB, "
              f"{out['aof_end'] / 2**20:,.1f} MiB at the end")
    print(f"  findings          : {out['findings']}")


class AofSizes:
    """Samples the size of the append-only files under a redis directory every 0.5 s on a thread (the peak)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.directory.rglob("*.aof*") if p.is_file())

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, self.size())

    def __enter__(self) -> AofSizes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tmp = Path(tempfile.mkdtemp(prefix="stability-loadgen-"))
    try:
        with RedisServer(tmp / "redis", port=free_port(), binary=args.redis_server, appendonly=args.aof) as server, \
                AofSizes(tmp / "redis") as aof:
            client = redis.Redis.from_url(server.url)
            client.config_set("maxmemory-policy", "noeviction")
            result = (backlog if args.mode == "backlog" else live)(client, server.url, tmp, args)
            result.aof_peak, result.aof_end = aof.peak, aof.size()
            result.shard_size = args.shard_size
            result.no_detectors = args.no_detectors
            result.redis_version = str(client.info("server")["redis_version"])
            result.load = os.getloadavg()[0]
            client.close()
        out = result.summary()
        print_summary(out)
        if args.json:
            args.json.write_text(json.dumps(out | {"lag_samples": result.lag_samples, "latencies_s": result.latencies,
                                                   "bursts_s": result.bursts}, indent=1))
        return 0 if result.lag_end == 0 else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""Redis growth over a long run: ``used_memory`` and append-only-file bytes against the step count.

Run: ``python bench/bench_redis_growth.py [--steps 100000] [--ranks 1] [--modules 40]``.

A private redis-server is started with the embedded server's configuration (:class:`stability.embedded.
RedisServer`: append-only file on, ``appendfsync everysec``, automatic AOF rewrite). Per rank, a real
:class:`~stability.transport.Emitter` writes realistic records (``loss``, ``grad_norm``, ``lr``, ``loss_scale`` and,
per module, ``grad_norm/<m>``, ``param_norm/<m>``, ``update_ratio/<m>``, ``adam_v_ratio/<m>`` plus a few
``act_rms/<m>``: 4 x modules + 10 signals, random-walk values) in chunks; after each chunk a real
:class:`~stability.worker.drain.Drainer` with the default :class:`~stability.worker.drain.SnapshotPolicy`, the
detectors (``--detectors real``: ``RunDiagnoser``; default: a stand-in with a state of the real suite's size, since
the per-module detectors are too slow for 100k steps today) and an :class:`~stability.worker.sinks.ArchiveSink` into
a temporary run directory drains the run until caught up, as a worker's sweep would. At the checkpoints (1k, 10k,
100k steps, up to ``--steps``) the run pauses for one snapshot interval and is drained once more (what happens when
a live run idles: the time-based commit acks and trims), then the figures are printed:

* ``used_memory`` (``INFO memory``) and the AOF bytes on disk, each with its ratio to the 1,000-step figure;
* the peaks of both over all chunks so far (the sawtooth between commits / AOF rewrites), also as ratios;
* entries left in the rank streams, AOF rewrites so far, drain throughput.

Measured in the same run, so the ratios are what matters (targets: <= 2x at 100k steps).
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import redis

from stability import keys
from stability.detectors.base import Finding
from stability.detectors.engine import RunDiagnoser
from stability.embedded import RedisServer, free_port
from stability.records import StepRecord
from stability.transport import Emitter
from stability.worker.drain import Diagnoser, Drainer, SnapshotPolicy
from stability.worker.sinks import ArchiveSink, RedisFindingsSink, Sink, redis_meta

RUN = "growth"


class SizedState:
    """A stand-in for ``RunDiagnoser``: no findings, but a state of the real suite's size (``--detectors stub``).

    The per-module detectors take ~15 ms per 170-signal record on this machine (another issue), which would make a
    100k-step run take half an hour; what Redis sees of the detectors is only the snapshot's size, kept here.
    """

    def __init__(self, size: int) -> None:
        self.blob = random.Random(size).randbytes(size)
        self.steps = 0

    def update(self, record: Any) -> list[Finding]:
        self.steps += 1
        return []

    def finish(self) -> list[Finding]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "blob": self.blob}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.blob = int(state["steps"]), bytes(state["blob"])


def real_state_size(signals: Signals, steps: int = 300) -> int:
    """Bytes of the real suite's msgpack state after ``steps`` records of these signals."""
    diag = RunDiagnoser()
    for s in range(steps):
        diag.update(StepRecord(run_id=RUN, step=s, wall_time=1.7e9 + s, signals=signals.at(s)))
    return len(msgpack.packb(diag.state_dict(), use_bin_type=True))


class Signals:
    """Random-walk signals of one rank, named like the hooks name them."""

    def __init__(self, modules: int, rank: int) -> None:
        self.rng = random.Random(rank)
        self.modules = [f"model.layers.{i}.{part}" for i in range(modules // 2) for part in ("attn", "mlp")]
        self.modules += [f"model.extra.{i}" for i in range(modules - len(self.modules))]
        acts = self.modules[:: max(1, len(self.modules) // 6)][:6]
        self.names = ["loss", "grad_norm", "lr", "loss_scale"]
        for quantity in ("grad_norm", "param_norm", "update_ratio", "adam_v_ratio"):
            self.names += [f"{quantity}/{m}" for m in self.modules]
        self.names += [f"act_rms/{m}" for m in acts]
        self.level = {n: 1.0 + self.rng.random() for n in self.names}

    def at(self, step: int) -> dict[str, float]:
        out = {}
        for name, value in self.level.items():
            value *= math.exp(self.rng.gauss(0.0, 0.01))
            self.level[name] = value
            out[name] = value
        out["loss"] = 3.0 * math.exp(-step / 50_000) + 0.05 * self.rng.random()
        out["lr"] = 3e-4
        out["loss_scale"] = 65536.0
        return out


def aof_bytes(directory: Path) -> int:
    """Bytes of the append-only file(s): ``appendonly.aof`` (Redis 6) or ``appendonlydir/*`` (Redis 7)."""
    files = [directory / "appendonly.aof", *(directory / "appendonlydir").glob("*")]
    return sum(f.stat().st_size for f in files if f.is_file())


def drain(client: redis.Redis[bytes], sinks: list[Sink], policy: SnapshotPolicy,
          diagnoser: Callable[[], Diagnoser]) -> tuple[int, int]:
    processed = trimmed = 0
    while True:
        result = Drainer(client, RUN, sinks=sinks, snapshot=policy, max_seconds=60.0, diagnoser=diagnoser).run()
        processed += result.processed
        trimmed += result.trimmed
        if result.status != "timeout":
            return processed, trimmed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps per rank")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--modules", type=int, default=40, help="modules per model (signals = 4 x modules + 10)")
    parser.add_argument("--detectors", choices=("stub", "real"), default="stub",
                        help="real RunDiagnoser, or a stand-in with a state of the real suite's size (default)")
    parser.add_argument("--chunk", type=int, default=1000, help="steps per rank emitted between drains")
    parser.add_argument("--every-s", type=float, default=SnapshotPolicy().every_s, help="snapshot interval")
    parser.add_argument("--every-records", type=int, default=SnapshotPolicy().every_records,
                        help="snapshot after this many entries")
    args = parser.parse_args()
    policy = SnapshotPolicy(every_s=args.every_s, every_records=args.every_records)
    checkpoints = [c for c in (1_000, 10_000, 100_000, 1_000_000) if c <= args.steps]
    if args.steps not in checkpoints:
        checkpoints.append(args.steps)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=free_port()) as server:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        client: redis.Redis[bytes] = redis.Redis.from_url(server.url)
        emitters = [Emitter(redis_url=server.url, run_id=RUN, spool_dir=run_dir / "spool", rank=r,
                            meta={"run_dir": str(run_dir)}) for r in range(args.ranks)]
        signals = [Signals(args.modules, r) for r in range(args.ranks)]
        sinks: list[Sink] = [RedisFindingsSink(client), ArchiveSink(redis_meta(client))]
        diagnoser: Callable[[], Diagnoser] = RunDiagnoser
        if args.detectors == "stub":
            size = real_state_size(Signals(args.modules, 0)) * args.ranks
            diagnoser = functools.partial(SizedState, size)
            print(f"detectors: stand-in with the real suite's state size ({size:,} bytes)")
        print(f"{args.ranks} rank(s), {len(signals[0].names)} signals per record, snapshot every "
              f"{policy.every_s:g} s / {policy.every_records} entries, chunks of {args.chunk} steps")
        print(f"{'steps':>8} {'used_memory':>12} {'x1k':>5} {'peak':>12} {'x1k':>5} {'AOF bytes':>12} {'x1k':>5} "
              f"{'AOF peak':>12} {'x1k':>5} {'stream len':>10} {'rewrites':>8} {'rec/s':>7}")
        base: tuple[int, int] | None = None
        peak_mem = peak_aof = 0
        step, t_drain, n_drained, rewrites, last_aof = 0, 0.0, 0, 0, 0
        t0 = 1.7e9
        for checkpoint in checkpoints:
            while step < checkpoint:
                end = min(step + args.chunk, checkpoint)
                for rank, emitter in enumerate(emitters):
                    for s in range(step, end):
                        rec = StepRecord(run_id=RUN, step=s, rank=rank, wall_time=t0 + s, host=f"node{rank}",
                                         signals=signals[rank].at(s))
                        while not emitter.put(rec):  # queue full: let the emitter thread catch up
                            emitter.flush()
                    emitter.flush()
                step = end
                start = time.perf_counter()
                n_drained += drain(client, sinks, policy, diagnoser)[0]
                t_drain += time.perf_counter() - start
                peak_mem = max(peak_mem, int(client.info("memory")["used_memory"]))
                aof = aof_bytes(server.directory)
                rewrites += aof < last_aof
                last_aof = aof
                peak_aof = max(peak_aof, aof)
            time.sleep(policy.every_s + 0.2)  # the run idles for one snapshot interval: a time-based commit follows
            drain(client, sinks, policy, diagnoser)
            client.execute_command("CONFIG", "SET", "appendfsync", "always")  # flush the AOF buffer to disk
            client.execute_command("CONFIG", "SET", "appendfsync", "everysec")
            mem, aof = int(client.info("memory")["used_memory"]), aof_bytes(server.directory)
            peak_mem, peak_aof = max(peak_mem, mem), max(peak_aof, aof)
            if base is None:
                base = (mem, aof)
            length = sum(int(client.xlen(keys.records(RUN, r))) for r in range(args.ranks))
            print(f"{checkpoint:>8} {mem:>12,} {mem / base[0]:>5.2f} {peak_mem:>12,} {peak_mem / base[0]:>5.2f} "
                  f"{aof:>12,} {aof / base[1]:>5.2f} {peak_aof:>12,} {peak_aof / base[1]:>5.2f} {length:>10} "
                  f"{rewrites:>8} {n_drained / max(t_drain, 1e-9):>7.0f}", flush=True)
        for emitter in emitters:
            emitter.close()
        state = client.strlen(keys.state(RUN))
        files = list((run_dir / "archive").iterdir())
        print(f"detector snapshot: {state:,} bytes; archive: {sum(f.stat().st_size for f in files):,} bytes in "
              f"{len(files)} files")


if __name__ == "__main__":
    main()

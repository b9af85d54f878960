"""Nothing lost, nothing silent (issue 14 items 1, 3, 5, 6, 7), against real processes.

* a full disk under the spool: a real 256 KiB tmpfs (``mount -t tmpfs``; where mounting is refused, an
  ``RLIMIT_FSIZE`` limit on this process stands in for it, with ``SIGXFSZ`` ignored so a write fails with ``EFBIG``);
* replay after training ended while Redis was down, by ``stability replay`` and by a relaunch of the same run;
* secrets, permissions and error messages, read from real processes' stderr and a real run directory.

Real redis-servers (tests/conftest.py), real training processes (torch on the CPU), the real CLI and worker.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from stability import keys, runstate
from stability.embedded import RedisServer, free_port
from stability.records import StepRecord
from stability.transport import Emitter, parse_id, scan_spool, spool_path
from stability.transport._spool import encode_frames, lost_path

RUN = "safety-run"
SECRET = "s3cretPW"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STABILITY_", "WANDB_"))}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", **extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stability.cli", *args], capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)


def _record(step: int, width: int = 1) -> StepRecord:
    signals = {"loss": 3.0 - step / 1000, "grad_norm": 1.0}
    signals.update({f"grad_norm/layer{i}.weight": 0.5 + i / 1000 for i in range(width)})
    return StepRecord(run_id=RUN, step=step, rank=0, wall_time=1e9 + step, signals=signals)


def _stream_steps(client: redis.Redis[bytes], run_id: str = RUN) -> list[int]:
    return [parse_id(entry_id)[1] for entry_id, _ in client.xrange(keys.records(run_id, 0))]


# ------------------------------------------------------------------------------------------- item 1: full disk


class SmallDisk:
    """A directory on a small filesystem: a 256 KiB tmpfs, or (mount refused) a file size limit on this process.

    ``fill()`` takes most of the room, ``free()`` gives it back.
    """

    SIZE = 256 * 1024

    def __init__(self, path: Path) -> None:
        self.path = path
        self.how = ""
        self._old_limit: tuple[int, int] | None = None
        self._old_handler: object = None

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.SIZE}", "tmpfs", str(self.path)],
                               capture_output=True, text=True)
        self.how = "tmpfs" if mount.returncode == 0 else "rlimit"
        return self

    def fill(self) -> None:
        if self.how == "tmpfs":
            with (self.path / "filler").open("wb") as out:
                out.write(b"\0" * (self.SIZE - 48 * 1024))
        else:
            self._old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            self._old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (48 * 1024, self._old_limit[1]))

    def free(self) -> None:
        if self.how == "tmpfs":
            (self.path / "filler").unlink()
        elif self._old_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self._old_limit)
            signal.signal(signal.SIGXFSZ, self._old_handler)  # type: ignore[arg-type]
            self._old_limit = None

    def __exit__(self, *exc: object) -> None:
        if self.how == "tmpfs":
            subprocess.run(["umount", "-l", str(self.path)], check=False)
        else:
            self.free()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "disk") as disk:
        yield disk


def test_full_disk_spool_counts_every_lost_record_and_replays_the_rest_in_order(
    small_disk: SmallDisk, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis is down and the spool's disk fills up, then has room again: every record is spooled or counted lost,
    nothing spooled after the failure is hidden behind a torn frame, and the replay says what was lost."""
    run_dir = small_disk.path / "run"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    emitter = Emitter(redis_url=dead, run_id=RUN, spool_dir=run_dir / "spool", batch_max=10, timeout_s=0.2)
    for step in range(20):  # room: spooled
        emitter.put(_record(step, width=60))
    assert emitter.flush(60)
    small_disk.fill()
    for step in range(20, 200):  # disk full: most of these cannot be spooled
        emitter.put(_record(step, width=60))
    assert emitter.flush(60)
    small_disk.free()
    for step in range(200, 230):  # room again: spooled after the failures
        emitter.put(_record(step, width=60))
    emitter.close(timeout=60)
    stats = emitter.stats
    assert stats.queued == 230 and stats.sent == 0
    assert stats.unspooled > 0, f"the disk never filled ({small_disk.how})"
    assert stats.spooled + stats.unspooled == 230  # each record spooled or counted lost
    assert int(lost_path(run_dir / "spool", 0).read_text()) == stats.unspooled

    entries, reader = scan_spool(spool_path(run_dir / "spool", 0))
    assert (reader.corrupt, reader.torn) == (0, False)  # failed writes were cut back: no torn frame inside
    spooled_steps = [parse_id(entry_id)[1] for entry_id, _ in entries]
    assert len(spooled_steps) == stats.spooled and spooled_steps == sorted(spooled_steps)
    assert spooled_steps[:20] == list(range(20)) and spooled_steps[-30:] == list(range(200, 230))

    proc = cli("replay", str(run_dir), "--redis", redis_server.url)
    assert proc.returncode == 0, proc.stderr
    assert f"{stats.spooled} records replayed" in proc.stdout
    assert f"{stats.unspooled} records lost (could not be spooled)" in proc.stdout, proc.stdout
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    assert _stream_steps(client) == spooled_steps
    status = runstate.read_status(client, RUN)
    assert status.lost == stats.unspooled and f"{stats.unspooled} records lost" in status.describe()
    local = runstate.read_status_file(run_dir)  # status.json
    assert local is not None and local.lost == stats.unspooled
    assert not lost_path(run_dir / "spool", 0).exists() and not spool_path(run_dir / "spool", 0).exists()
    client.close()


def test_a_damaged_region_inside_a_spool_is_skipped_counted_and_the_rest_replayed(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """An older writer's torn frame with whole frames behind it: the reader does not stop there."""
    from stability.records import encode

    frames = [encode_frames([(f"{1000 + s}-{s}", encode(_record(s)))]) for s in range(30)]
    torn = frames[10][: len(frames[10]) // 2]  # a write cut short by ENOSPC, later frames appended after it
    spool = spool_path(tmp_path / "run" / "spool", 0)
    spool.parent.mkdir(parents=True)
    spool.write_bytes(b"".join(frames[:10]) + torn + b"".join(frames[11:]))
    proc = cli("replay", str(tmp_path / "run"), "--redis", redis_server.url)
    assert proc.returncode == 0, proc.stderr
    assert "29 records replayed, 0 already in Redis, 1 damaged spool regions skipped" in proc.stdout
    assert "damaged bytes skipped" in proc.stderr  # the log line names the offset
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    assert _stream_steps(client) == [s for s in range(30) if s != 10]
    assert runstate.read_status(client, RUN).lost == 1
    client.close()


def test_a_torn_tail_left_by_a_crash_is_counted_when_it_is_cut(tmp_path: Path) -> None:
    """A process killed mid-write left half a frame; the next emitter cuts it before appending and counts it."""
    from stability.records import encode

    spool = spool_path(tmp_path / "spool", 0)
    spool.parent.mkdir(parents=True)
    data = encode_frames([(f"{1000 + s}-{s}", encode(_record(s))) for s in range(5)])
    spool.write_bytes(data[:-7])
    emitter = Emitter(redis_url=f"redis://127.0.0.1:{free_port()}/0", run_id=RUN, spool_dir=tmp_path / "spool",
                      timeout_s=0.2)
    emitter.put(_record(10))
    emitter.close(timeout=30)
    assert (emitter.stats.spooled, emitter.stats.errors) == (1, 1)
    assert int(lost_path(tmp_path / "spool", 0).read_text()) == 1
    assert [parse_id(i)[1] for i, _ in scan_spool(spool)[0]] == [0, 1, 2, 3, 10]


# -------------------------------------------------------------------------------- item 3: replay afterwards

_TRAIN = textwrap.dedent("""
    import sys, torch, stability
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = stability.watch(model, opt)
    for step in range(int(sys.argv[1])):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    handle.close()
""")


def _train(tmp_path: Path, run_dir: Path, url: str, steps: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = _env(STABILITY_REDIS_URL=url, STABILITY_RUN_ID=RUN, STABILITY_RUN_DIR=str(run_dir), STABILITY_QUIET="1")
    return subprocess.run([sys.executable, str(script), str(steps)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)


def test_training_that_ends_while_redis_is_down_is_replayed_later_once_and_in_order(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Training with Redis down ends; a relaunch of the same run (Redis back) sends the old spool first, once, in
    order, then its own records; ``stability replay`` afterwards finds nothing left and adds nothing."""
    run_dir = tmp_path / "run"
    url = f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0"  # item 5: the password must show up nowhere
    redis_server.kill()
    first = _train(tmp_path, run_dir, url, 30)
    assert first.returncode == 0, first.stderr
    assert "redis://:***@127.0.0.1" in first.stderr  # the emitter's "unavailable, spooling" line
    spool = spool_path(run_dir / "spool", 0)
    old = [entry_id for entry_id, _ in scan_spool(spool)[0]]
    assert [parse_id(i)[1] for i in old] == list(range(30))

    redis_server.start()
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    client.config_set("requirepass", SECRET)
    client = redis.Redis.from_url(url)
    second = _train(tmp_path, run_dir, url, 20)  # the next session of the same run id
    assert second.returncode == 0, second.stderr
    ids = [entry_id.decode() for entry_id, _ in client.xrange(keys.records(RUN, 0))]
    assert ids[:30] == old  # the old spool first, with its own IDs, once
    assert [parse_id(i)[1] for i in ids[30:]] == list(range(20))  # then the relaunch's own records
    assert len(ids) == 50 and not spool.exists()

    again = cli("replay", str(run_dir), "--redis", url)
    assert again.returncode == 0 and "nothing to replay" in again.stdout
    assert client.xlen(keys.records(RUN, 0)) == 50
    client.close()
    outputs = {"first": first.stdout + first.stderr, "second": second.stdout + second.stderr,
               "replay": again.stdout + again.stderr}
    outputs.update({str(p): p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file()})
    assert not [where for where, text in outputs.items() if SECRET in text]


def test_a_second_replay_after_the_worker_trimmed_the_stream_counts_already_not_refused(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A replay interrupted after part of the spool reached Redis, repeated after the worker read and trimmed it."""
    from stability.records import encode

    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    stream = keys.records(RUN, 0)
    entries = [(f"{1000 + s}-{s}", encode(_record(s))) for s in range(10)]
    for entry_id, payload in entries[:6]:  # the first replay got this far
        client.xadd(stream, {"r": payload}, id=entry_id)
    client.xgroup_create(stream, keys.GROUP, id="0")
    client.xreadgroup(keys.GROUP, "w", {stream: ">"})  # a worker read them ...
    client.xtrim(stream, minid="1006-6")  # ... and trimmed them away
    spool = spool_path(tmp_path / "run" / "spool", 0)
    spool.parent.mkdir(parents=True)
    spool.write_bytes(encode_frames(entries))
    proc = cli("replay", str(tmp_path / "run"), "--redis", redis_server.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 records replayed, 6 already in Redis" in proc.stdout
    assert _stream_steps(client) == [6, 7, 8, 9] and not spool.exists()
    client.close()


# ------------------------------------------------------------------------------------------ item 5: secrets

BAD_URLS = [
    f"redis//:{SECRET}@host:6379/0",  # the malformed URL
    f"redis://:{SECRET}@host:port/0",  # a port that is not a number
    f"redis:/u:{SECRET}@host:6379/0?password={SECRET}",
]


def test_a_malformed_url_never_shows_its_password(tmp_path: Path) -> None:
    """Training console, worker stderr and CLI errors (real processes), for malformed URLs: one clear line each."""
    training = _train(tmp_path, tmp_path / "run", BAD_URLS[0], 3)
    assert training.returncode != 0 and "redis//:***@host:6379/0" in training.stderr
    outputs = {"training": training.stdout + training.stderr}
    for url in BAD_URLS[:2]:
        worker = subprocess.run([sys.executable, "-m", "stability.worker"], capture_output=True, text=True,
                                env=_env(STABILITY_REDIS_URL=url), timeout=60)
        assert worker.returncode == 2 and "Traceback" not in worker.stderr, worker.stderr[-3000:]
        assert worker.stderr.strip().splitlines()[-1].startswith("stability worker: STABILITY_REDIS_URL")
        outputs[f"worker {url}"] = worker.stdout + worker.stderr
    broker = subprocess.run([sys.executable, "-m", "stability.worker"], capture_output=True, text=True, timeout=60,
                            env=_env(STABILITY_REDIS_URL="redis://127.0.0.1:1/0", STABILITY_BROKER_URL=BAD_URLS[0]))
    assert broker.returncode == 2 and "STABILITY_BROKER_URL 'redis//:***@host:6379/0' is not a URL" in broker.stderr
    outputs["worker broker"] = broker.stdout + broker.stderr
    postmortem = cli("postmortem", BAD_URLS[0], timeout=60)  # taken for a path: the message still hides it
    assert postmortem.returncode == 2 and "***" in postmortem.stderr
    outputs["postmortem"] = postmortem.stdout + postmortem.stderr
    runs = cli("runs", BAD_URLS[2], timeout=60)
    assert runs.returncode == 2 and "Traceback" not in runs.stderr, runs.stderr[-3000:]
    outputs["runs"] = runs.stdout + runs.stderr
    assert not [where for where, text in outputs.items() if SECRET in text], outputs
    if (tmp_path / "run").exists():
        assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and SECRET in p.read_text(errors="replace")]


def test_safe_url_redacts_well_formed_and_malformed_urls() -> None:
    from stability.redis_url import safe_url, scrub

    assert safe_url(f"redis//:{SECRET}@host:6379/0") == "redis//:***@host:6379/0"
    assert safe_url(f"rediss://admin:{SECRET}@h:1/2") == "rediss://admin:***@h:1/2"
    assert safe_url(f"redis://{SECRET}@h/0") == "redis://***@h/0"  # a bare password
    assert safe_url(f"unix:///r.sock?db=1&password={SECRET}") == "unix:///r.sock?db=1&password=***"
    assert safe_url("redis://h:6379/0") == "redis://h:6379/0"
    url = f"redis://:{SECRET}@h:x/0"
    assert SECRET not in scrub(f"bad {url}: {SECRET}", url)


# -------------------------------------------------------------------------------------- item 6: permissions


def test_a_run_directory_is_private_and_a_damaged_archive_file_does_not_abort_the_postmortem(tmp_path: Path) -> None:
    """A short real training with the embedded Redis and local worker: directories 0700, files 0600 (item 6). Then
    one archive Parquet file is cut short: the post-mortem analyses the rest and names the damaged file (item 7)."""
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = _env(STABILITY_RUN_ID=RUN, STABILITY_RUN_DIR=str(run_dir), STABILITY_QUIET="1")
    proc = subprocess.run([sys.executable, str(script), "30"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = {p.relative_to(run_dir).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [run_dir, *run_dir.rglob("*")] if not p.is_socket()}
    for name in ("worker.log", "run.json", "status.json", "findings.json", "report.html", "redis/url",
                 "redis/redis.log"):
        assert name in found, sorted(found)
    assert any(n.startswith("redis/appendonly") for n in found) and any(n.startswith("archive/") for n in found)
    wrong = {name: oct(mode) for name, mode in found.items()
             if mode != (0o700 if (run_dir / name).is_dir() else 0o600)}
    assert not wrong, wrong

    parquet = sorted((run_dir / "archive").glob("*.parquet"))
    damaged = parquet[0].with_name("records-0-999999.parquet")
    damaged.write_bytes(parquet[0].read_bytes()[:-100])  # cut short (a full disk, a crash while copying)
    result = cli("postmortem", str(run_dir))  # rewrites findings.json and report.html in the run directory
    assert result.returncode == 0, result.stderr[-3000:]
    findings = run_dir / "findings.json"
    assert damaged.name in result.stderr and damaged.name in findings.read_text()
    assert json.loads(findings.read_text())["steps"] == 30
    assert {stat.S_IMODE(p.stat().st_mode) for p in (findings, run_dir / "report.html")} == {0o600}


def test_spool_files_are_private(tmp_path: Path) -> None:
    emitter = Emitter(redis_url=f"redis://127.0.0.1:{free_port()}/0", run_id=RUN, spool_dir=tmp_path / "spool",
                      timeout_s=0.2)
    emitter.put(_record(0))
    emitter.close(timeout=30)
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700
    assert stat.S_IMODE(emitter.spool_path.stat().st_mode) == 0o600


# ------------------------------------------------------------------------------------------- item 7: errors


def test_worker_setting_errors_are_one_line_without_traceback() -> None:
    for env in ({"STABILITY_SWEEP_S": "abc"}, {"STABILITY_REDIS_URL": "redis://127.0.0.1:notaport/0"},
                {"STABILITY_REDIS_URL": "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus"}):
        proc = subprocess.run([sys.executable, "-m", "stability.worker"], capture_output=True, text=True,
                              env=_env(**env), timeout=60)
        assert proc.returncode == 2, (env, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("stability worker:")


def test_wrong_password_is_reported_once_as_authentication_failed(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_server.url)
    client.config_set("requirepass", SECRET)
    wrong = f"redis://:wrong-{SECRET[:3]}@127.0.0.1:{redis_server.port}/0"
    with caplog.at_level("WARNING", logger="stability"):
        emitter = Emitter(redis_url=wrong, run_id=RUN, spool_dir=tmp_path / "spool", timeout_s=0.5, batch_max=5)
        for step in range(40):
            emitter.put(_record(step))
            time.sleep(0.05)  # two seconds of training: several batches, past the 1 s retry interval
        assert emitter.flush(30)
        emitter.close(timeout=30)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("authentication failed" in m for m in messages) == 1, messages
    assert not any("unavailable" in m for m in messages), messages
    assert emitter.stats.spooled == 40  # kept for a replay with the right password
    worker = subprocess.run([sys.executable, "-m", "stability.worker"], capture_output=True, text=True,
                            env=_env(STABILITY_REDIS_URL=wrong), timeout=60)
    assert worker.returncode == 2 and "authentication failed" in worker.stderr and "Traceback" not in worker.stderr
    client.close()


def test_postmortem_piped_into_head_has_no_broken_pipe(tmp_path: Path) -> None:
    csv = tmp_path / "log.csv"
    csv.write_text("step,loss\n" + "".join(f"{s},{3.0 - s / 500 if s != 150 else 'nan'}\n" for s in range(300)))
    # head -n 0 exits at once: every write of the report meets a closed pipe
    proc = subprocess.run(f"{sys.executable} -m stability.cli postmortem {csv} | head -n 0", shell=True,
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.stdout == ""
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

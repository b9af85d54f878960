"""The emitter against a real private redis-server: order, IDs, outages (kill, SIGSTOP, OOM), spool and replay."""

from __future__ import annotations

import logging
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from stability import keys
from stability.embedded import RedisServer, free_port
from stability.errors import ConfigError, RecordError, SourceError
from stability.records import StepRecord, decode
from stability.transport import Emitter, EmitterStats, parse_id, read_spool, spool_path
from stability.transport._emitter import RETRY_CLOSING_FOR_S

RUN = "run-t"
T0 = 1_700_000_000.0


def _rec(step: int, wall_time: float | None = None, rank: int = 0) -> StepRecord:
    return StepRecord(
        run_id=RUN,
        step=step,
        rank=rank,
        wall_time=T0 + step * 0.01 if wall_time is None else wall_time,
        signals={"loss": 1.0 / (step + 1), "grad_norm/h.0": float(step)},
    )


def _stream(client: redis.Redis, rank: int = 0) -> list[tuple[str, StepRecord]]:
    return [(eid.decode(), decode(fields[b"r"])) for eid, fields in client.xrange(keys.records(RUN, rank))]


def _steps(client: redis.Redis) -> list[int]:
    return [rec.step for _, rec in _stream(client)]


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def make_emitter(spool_dir: Path) -> Iterator[Callable[..., Emitter]]:
    made: list[Emitter] = []

    def make(url: str, **kwargs: object) -> Emitter:
        kwargs.setdefault("timeout_s", 0.3)
        emitter = Emitter(redis_url=url, run_id=RUN, spool_dir=spool_dir, **kwargs)  # type: ignore[arg-type]
        made.append(emitter)
        return emitter

    yield make
    for emitter in made:
        emitter.close()


@pytest.fixture
def dead_url() -> str:
    """A URL where nothing listens (connection refused at once)."""
    return f"redis://127.0.0.1:{free_port()}/0"


def _make_spool(make_emitter: Callable[..., Emitter], dead_url: str, steps: range) -> Path:
    """Write a spool the honest way: an emitter whose Redis is unreachable."""
    emitter = make_emitter(dead_url)
    assert all(emitter.put(_rec(step)) for step in steps)
    emitter.close()
    assert emitter.stats.spooled == len(steps)
    return emitter.spool_path


# ------------------------------------------------------------------------------------------------- happy path


def test_records_arrive_in_order_with_their_ids_and_the_run_is_registered(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    emitter = make_emitter(redis_server.url, rank=0, batch_max=100, meta={"host": "node-1", "project": "p"})
    special = {"loss": math.nan, "grad_norm": math.inf, "loss_scale": -math.inf}
    for step in range(250):
        record = _rec(step) if step != 42 else StepRecord(run_id=RUN, step=42, wall_time=T0 + 0.42, signals=special)
        assert emitter.put(record)
    assert emitter.flush(10)
    assert emitter.stats == EmitterStats(queued=250, sent=250, spooled=0, replayed=0, dropped=0, errors=0, duplicates=0)
    emitter.close()

    entries = _stream(redis_client)
    assert [rec.step for _, rec in entries] == list(range(250))
    assert [eid for eid, _ in entries] == [f"{int((T0 + s * 0.01) * 1000)}-{s}" for s in range(250)]
    assert entries[3][1].signals == {"loss": 0.25, "grad_norm/h.0": 3.0}
    nonfinite = entries[42][1].signals
    assert math.isnan(nonfinite["loss"]) and nonfinite["grad_norm"] == math.inf and nonfinite["loss_scale"] == -math.inf
    assert redis_client.sismember(keys.RUNS, RUN) and redis_client.smembers(keys.ranks(RUN)) == {b"0"}
    meta = redis_client.hgetall(keys.meta(RUN))
    assert meta[b"host"] == b"node-1" and meta[b"project"] == b"p"
    assert float(meta[b"started"]) <= float(meta[b"ended:0"]) <= time.time() + 1
    assert not emitter.spool_path.exists()
    # the non-finite record also asked the sweeping worker to read this rank first, once
    assert redis_client.lrange(keys.URGENT, 0, -1) == [keys.urgent_member(RUN, 0).encode()]


def test_ids_stay_strictly_increasing_when_the_clock_stalls_or_steps_repeat(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    emitter = make_emitter(redis_server.url)
    walls_and_steps = [(1.000, 0), (1.000, 1), (0.999, 2), (1.000, 1), (5.000, 0), (0.0, 9)]
    for wall, step in walls_and_steps:
        assert emitter.put(StepRecord(run_id=RUN, step=step, wall_time=wall, signals={}))
    emitter.close()
    ids = [eid for eid, _ in _stream(redis_client)]
    assert ids[:5] == ["1000-0", "1000-1", "1000-2", "1001-1", "5000-0"]
    ms, step = parse_id(ids[5])  # wall time 0 (unset): the emitter's clock is used
    assert step == 9 and abs(ms - time.time() * 1000) < 60_000
    assert emitter.stats.sent == 6 and emitter.stats.duplicates == 0


def test_unix_socket_urls_in_both_spellings(tmp_path: Path, spool_dir: Path) -> None:
    with RedisServer(tmp_path / "unix-redis") as server:  # port None: unix socket only
        for rank, url in enumerate((server.url, server.celery_url)):
            with Emitter(redis_url=url, run_id=RUN, spool_dir=spool_dir, rank=rank) as emitter:
                assert emitter.put(_rec(0, rank=rank))
            assert emitter.stats.sent == 1, url


def test_parse_id() -> None:
    assert parse_id("1700000000123-42") == (1700000000123, 42)
    assert parse_id(b"5-0") == (5, 0)
    for bad in ("5", "a-1", "1-", "-1", "1-2-3", "\uff11-2"):
        with pytest.raises(RecordError, match="stream entry id"):
            parse_id(bad)


def test_put_from_many_threads_keeps_every_record(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    emitter = make_emitter(redis_server.url, batch_max=17)

    def produce(offset: int) -> None:
        for i in range(150):
            assert emitter.put(_rec(offset + i, wall_time=T0))

    threads = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    emitter.close()
    steps = _steps(redis_client)
    assert sorted(steps) == sorted(k * 1000 + i for k in range(4) for i in range(150))
    assert emitter.stats.sent == 600 and emitter.stats.duplicates == 0


# ------------------------------------------------------------------------------------------------- outages


def test_redis_killed_and_restarted_loses_nothing_and_duplicates_nothing(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    # under "everysec" a busy disk lets Redis postpone the AOF write() while it already replied (its own loss window
    # on SIGKILL, seen on a loaded CI machine); "always" writes before replying, so only the emitter is on trial here
    redis_client.config_set("appendfsync", "always")
    emitter = make_emitter(redis_server.url)
    assert all(emitter.put(_rec(step)) for step in range(100))
    assert emitter.flush(10) and emitter.stats.sent == 100

    redis_server.kill()
    accepted = [emitter.put(_rec(step)) for step in range(100, 300)]
    assert all(accepted)  # put neither blocks nor fails while Redis is down
    assert emitter.flush(10)
    assert emitter.stats.spooled == 200 and emitter.stats.sent == 100
    assert [parse_id(eid)[1] for eid, _ in read_spool(emitter.spool_path)] == list(range(100, 300))

    redis_server.start()
    assert _wait_for(lambda: emitter.stats.replayed == 200), emitter.stats  # the emitter reconnects by itself
    assert all(emitter.put(_rec(step)) for step in range(300, 350))
    emitter.close()

    entries = _stream(redis_client)
    assert [rec.step for _, rec in entries] == list(range(350))
    assert len({eid for eid, _ in entries}) == 350
    stats = emitter.stats
    assert (stats.sent, stats.spooled, stats.replayed, stats.errors, stats.dropped) == (150, 200, 200, 0, 0)
    assert not emitter.spool_path.exists()


def _stalled_while_sending(redis_server: RedisServer, make_emitter: Callable[..., Emitter]) -> Emitter:
    """An emitter that sent steps 0-49, then put steps 50-149 while Redis was stopped (SIGSTOP; resumed on return)."""
    emitter = make_emitter(redis_server.url, timeout_s=0.3, batch_max=10)
    assert all(emitter.put(_rec(step)) for step in range(50))
    assert emitter.flush(10) and emitter.stats.sent == 50
    pid = redis_server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        assert all(emitter.put(_rec(step)) for step in range(50, 150))
        assert emitter.flush(20)
    finally:
        os.kill(pid, signal.SIGCONT)
    return emitter


def test_hung_redis_spools_then_replays(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    emitter = _stalled_while_sending(redis_server, make_emitter)
    assert emitter.stats.spooled == 100 and emitter.stats.sent == 50
    # The batch that timed out was applied once the server resumed ("maybe written"): it replays as duplicates,
    # never as second entries. Only that one batch (<= batch_max records) can be a duplicate.
    assert _wait_for(lambda: emitter.stats.replayed + emitter.stats.duplicates == 100), emitter.stats
    emitter.close()
    entries = _stream(redis_client)
    assert [rec.step for _, rec in entries] == list(range(150))
    assert len({eid for eid, _ in entries}) == 150
    stats = emitter.stats
    assert stats.duplicates <= 10 and stats.replayed >= 90 and stats.errors == 0


def test_a_redis_that_stalled_before_close_gets_the_spool_and_the_end_at_close(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    """Redis stalls (SIGSTOP) near the end, records spool, it answers again just as the run closes: the close tries
    it again instead of waiting out the retry backoff, so the spool is replayed and the rank's end recorded (a demo
    on a busy machine once ended "offline" this way: no drain, no archive)."""
    emitter = _stalled_while_sending(redis_server, make_emitter)
    assert emitter.stats.spooled >= 90
    emitter.close(timeout=20)  # the next retry was due >= 1 s after the stall began
    assert emitter.reachable, emitter.stats
    assert not emitter.spool_path.exists()
    assert [rec.step for _, rec in _stream(redis_client)] == list(range(150))
    assert redis_client.hexists(keys.meta(RUN), "ended:0")


def test_close_does_not_retry_a_redis_that_refuses(make_emitter: Callable[..., Emitter], dead_url: str) -> None:
    emitter = make_emitter(dead_url)
    assert all(emitter.put(_rec(step)) for step in range(20))
    started = time.monotonic()
    emitter.close(timeout=30)
    # retrying would take RETRY_CLOSING_FOR_S (10 s); spooling at once takes milliseconds
    assert time.monotonic() - started < RETRY_CLOSING_FOR_S / 2, "nothing listens: the close spools at once"
    assert not emitter.reachable and emitter.stats.spooled == 20


def test_out_of_memory_is_retried_not_lost(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    emitter = make_emitter(redis_server.url)
    assert emitter.put(_rec(0)) and emitter.flush(10) and emitter.stats.sent == 1
    redis_client.config_set("maxmemory", "1")  # noeviction: every write is refused with OOM
    try:
        assert all(emitter.put(_rec(step)) for step in range(1, 21))
        assert emitter.flush(10)
        assert emitter.stats.spooled == 20 and emitter.stats.errors == 0
    finally:
        redis_client.config_set("maxmemory", "0")
    emitter.close()  # retries at once and replays
    assert _steps(redis_client) == list(range(21))
    assert emitter.stats.replayed == 20


def test_a_stream_ahead_of_the_clock_is_reported(
    redis_client: redis.Redis,
    redis_server: RedisServer,
    make_emitter: Callable[..., Emitter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    redis_client.xadd(keys.records(RUN, 0), {"r": b"x"}, id=f"{int(T0 * 1000) + 10_000}-0")  # an earlier process
    emitter = make_emitter(redis_server.url)
    with caplog.at_level(logging.WARNING, logger="stability.transport"):
        assert all(emitter.put(_rec(step)) for step in range(3))
        emitter.close()
    assert (emitter.stats.duplicates, emitter.stats.sent) == (3, 0)
    assert "already has entries after" in caplog.text


def test_records_redis_refuses_for_good_are_counted_as_errors(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    redis_client.set(keys.records(RUN, 0), "not a stream")  # WRONGTYPE for every XADD
    emitter = make_emitter(redis_server.url)
    assert all(emitter.put(_rec(step)) for step in range(5))
    emitter.close()
    assert (emitter.stats.errors, emitter.stats.sent, emitter.stats.spooled) == (5, 0, 0)


# ------------------------------------------------------------------------------------------------- spool


def test_spool_from_an_earlier_process_is_replayed_and_a_second_replay_adds_nothing(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter], dead_url: str
) -> None:
    path = _make_spool(make_emitter, dead_url, range(30))
    saved = path.read_bytes()

    first = make_emitter(redis_server.url)
    first.close()
    assert (first.stats.replayed, first.stats.duplicates) == (30, 0)
    assert not path.exists()

    path.write_bytes(saved)  # the same spool again, e.g. a crash between replay and removal
    second = make_emitter(redis_server.url)
    second.close()
    assert (second.stats.replayed, second.stats.duplicates) == (0, 30)
    assert _steps(redis_client) == list(range(30))
    assert not path.exists()


def test_close_with_redis_down_keeps_the_spool(make_emitter: Callable[..., Emitter], dead_url: str) -> None:
    path = _make_spool(make_emitter, dead_url, range(5))
    assert path == spool_path(path.parent, 0) and path.exists()
    assert [decode(payload).step for _, payload in read_spool(path)] == list(range(5))


def test_torn_tail_is_skipped_then_cut_before_appending(
    redis_client: redis.Redis,
    redis_server: RedisServer,
    make_emitter: Callable[..., Emitter],
    dead_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = _make_spool(make_emitter, dead_url, range(10))
    path.write_bytes(path.read_bytes()[:-5])  # crash in the middle of the last frame
    with caplog.at_level(logging.WARNING, logger="stability.transport"):
        assert [parse_id(eid)[1] for eid, _ in read_spool(path)] == list(range(9))
    assert "torn last frame" in caplog.text

    _make_spool(make_emitter, dead_url, range(20, 25))  # appends after cutting the torn frame
    assert [parse_id(eid)[1] for eid, _ in read_spool(path)] == [*range(9), *range(20, 25)]

    emitter = make_emitter(redis_server.url)
    emitter.close()
    assert _steps(redis_client) == [*range(9), *range(20, 25)]
    assert emitter.stats.errors == 0


def _frame_offsets(data: bytes) -> list[int]:
    offsets, offset = [], 0
    while offset < len(data):
        offsets.append(offset)
        offset += 8 + struct.unpack_from("<I", data, offset)[0]
    return offsets


def test_corrupt_frame_in_the_middle_is_skipped_logged_and_counted(
    redis_client: redis.Redis,
    redis_server: RedisServer,
    make_emitter: Callable[..., Emitter],
    dead_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = _make_spool(make_emitter, dead_url, range(10))
    data = bytearray(path.read_bytes())
    data[_frame_offsets(bytes(data))[3] + 20] ^= 0xFF  # flip a byte inside the body of frame 3
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="stability.transport"):
        assert [parse_id(eid)[1] for eid, _ in read_spool(path)] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert "corrupt frame" in caplog.text

    emitter = make_emitter(redis_server.url)
    emitter.close()
    assert _steps(redis_client) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert (emitter.stats.replayed, emitter.stats.errors) == (9, 1)


def test_read_spool_of_a_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"spool-rank7\.bin"):
        read_spool(spool_path(tmp_path, 7))


# ------------------------------------------------------------------------------------------------- put contract


def test_queue_full_drops_are_counted(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    emitter = make_emitter(redis_server.url, queue_size=5, timeout_s=2.0)
    assert emitter.put(_rec(0)) and emitter.flush(10)
    pid = redis_server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # the emitter thread now waits up to 2 s on its round trip
    try:
        results = [emitter.put(_rec(step)) for step in range(1, 201)]
    finally:
        os.kill(pid, signal.SIGCONT)
    emitter.close()
    stats = emitter.stats
    assert stats.dropped == results.count(False) and stats.dropped >= 90
    assert stats.queued == 1 + results.count(True)
    accepted = [0] + [step for step, ok in zip(range(1, 201), results, strict=True) if ok]
    assert _steps(redis_client) == accepted


def test_put_never_raises(redis_server: RedisServer, make_emitter: Callable[..., Emitter]) -> None:
    emitter = make_emitter(redis_server.url)
    assert not emitter.put(StepRecord(run_id=RUN, step=1, signals={"loss": "high"}))  # type: ignore[dict-item]
    emitter.close()
    emitter.close()  # idempotent
    assert not emitter.put(_rec(2))
    assert emitter.stats.dropped == 2 and emitter.stats.queued == 0
    assert emitter.flush(0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"run_id": "bad id"}, "run id"),
        ({"rank": -1}, "rank"),
        ({"queue_size": 0}, "queue_size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"batch_max": 0}, "batch_max"),
        ({"redis_url": "http://user:secret@host/"}, "redis_url 'http://user:\\*\\*\\*@host/'"),
    ],
)
def test_bad_arguments_raise_config_error(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"redis_url": "redis://127.0.0.1:1/0", "run_id": RUN, "spool_dir": tmp_path, **kwargs}
    with pytest.raises(ConfigError, match=message):
        Emitter(**args)  # type: ignore[arg-type]


def test_transport_imports_no_service_side_library() -> None:
    code = (
        "import sys, stability.transport; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'celery', 'sklearn', 'statsmodels', "
        "'pyarrow', 'rich'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_restarted_rank_unends_a_finished_run(
    redis_client: redis.Redis, redis_server: RedisServer, make_emitter: Callable[..., Emitter]
) -> None:
    """A run resumed under the same id must not look finished to the worker (ended:<rank> / drained cleared)."""
    first = make_emitter(redis_server.url)
    first.put(_rec(0))
    first.close()
    meta = keys.meta(RUN)
    assert redis_client.hexists(meta, "ended:0")
    redis_client.hset(meta, "drained", "1")  # what the worker writes when it has finished the run
    redis_client.srem(keys.RUNS, RUN)
    second = make_emitter(redis_server.url)
    second.put(_rec(1, wall_time=time.time() + 1))
    assert second.flush(10)
    assert not redis_client.hexists(meta, "ended:0") and not redis_client.hexists(meta, "drained")
    assert redis_client.sismember(keys.RUNS, RUN)
    second.close()

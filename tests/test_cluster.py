"""Redis Cluster: three private ``redis-server --cluster-enabled yes`` nodes on free ports, made into one cluster
(slots split in three, ``CLUSTER MEET``), then the real data path over a ``redis+cluster://`` URL: real emitters
write several runs (a NaN in one, a loss spike in another), a Drainer with the real detectors (and, in the slow
test, a real ``stability worker`` process whose Celery broker is a separate plain Redis) drains them.

What it proves: every key of a run lives in one hash slot on one node (MULTI/EXEC and Lua scripts never cross
slots), different runs live on different nodes, findings land, runs end drained and leave ``keys.RUNS``; a
cluster URL is refused as a Celery broker with a clear message.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from stability import keys
from stability.embedded import RedisServer, free_port
from stability.errors import ConfigError
from stability.records import StepRecord
from stability.redis_url import connect, is_cluster_url
from stability.transport import Emitter
from stability.worker.advice import AdviceSink
from stability.worker.drain import Drainer
from stability.worker.sinks import RedisFindingsSink

SLOTS = 16384
STEPS = 80
NAN_STEP = 30
SPIKE_STEP = 60
REPO = Path(__file__).resolve().parents[1]


# -- a private 3-node cluster -----------------------------------------------------------------------------------


def _binary() -> str | None:
    for path in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(path, os.X_OK):
            return path
    return None


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000, Redis < 7 has no ``cluster-port``) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port > 65535 - 10000:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _wait(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


class Cluster:
    """Three master nodes, slots 0-5460 / 5461-10921 / 10922-16383, no replicas; data in ``directory``."""

    def __init__(self, directory: Path, binary: str, nodes: int = 3, extra: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.binary = binary
        self.extra = extra
        self.ports = [_cluster_port() for _ in range(nodes)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """Two startup nodes: the client finds the third itself."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def start(self, timeout: float = 90.0) -> Cluster:
        self.directory.mkdir(parents=True, exist_ok=True)
        for port in self.ports:
            self._spawn(port)
        for port, proc in self.procs.items():
            _wait(f"node {port} to answer", lambda p=port, pr=proc: self._ping(p, pr), timeout)
        for index, port in enumerate(self.ports):
            lo, hi = index * SLOTS // len(self.ports), (index + 1) * SLOTS // len(self.ports)
            with self.node(port) as node:
                node.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
                node.execute_command("CLUSTER SET-CONFIG-EPOCH", index + 1)  # distinct epochs, as redis-cli does
        with self.node(self.ports[0]) as first:
            for port in self.ports[1:]:
                first.execute_command("CLUSTER MEET", "127.0.0.1", port)
        _wait("cluster_state:ok on every node", self._ready, timeout)
        return self

    def _spawn(self, port: int) -> None:
        """One node; its data (AOF when ``extra`` asks for it) and cluster config stay in ``directory/<port>``."""
        data = self.directory / str(port)
        data.mkdir(exist_ok=True)
        with open(data / "stderr.txt", "ab") as err:  # config errors come before the log file is opened
            self.procs[port] = subprocess.Popen(
                [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(data / "nodes.conf"), "--dir", str(data), "--save", "",
                 "--appendonly", "no", "--maxmemory-policy", "noeviction", "--logfile", str(self._log(port)),
                 *self.extra],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
            )  # fmt: skip

    def _log(self, port: int) -> Path:
        return self.directory / f"node-{port}.log"

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash)."""
        proc = self.procs.pop(port)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, port: int, timeout: float = 90.0) -> None:
        """Start a killed node again: it rejoins with its node id and slots (from its nodes.conf)."""
        self._spawn(port)
        _wait(f"node {port} to answer", lambda: self._ping(port, self.procs[port]), timeout)
        _wait("cluster_state:ok on every node", self._ready, timeout)

    def _ping(self, port: int, proc: subprocess.Popen[bytes]) -> bool:
        if proc.poll() is not None:
            log = "".join(path.read_text(errors="replace") for path in
                          (self.directory / str(port) / "stderr.txt", self._log(port)) if path.exists())  # fmt: skip
            if re.search(r"Bad directive|FATAL CONFIG", log):  # a redis-server that does not know cluster-enabled
                pytest.skip(f"{self.binary} cannot run a cluster node: {log.strip().splitlines()[-1]}")
            pytest.fail(f"cluster node {port} exited with {proc.returncode}:\n{log[-2000:]}")
        try:
            with self.node(port) as node:
                return bool(node.ping())
        except redis.ConnectionError:
            return False

    def _ready(self) -> bool:
        for port in self.ports:
            with self.node(port) as node:
                info = node.execute_command("CLUSTER INFO")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(self.ports):
                    return False
                if len(node.execute_command("CLUSTER SLOTS")) != len(self.ports):
                    return False
        return True

    def keys_by_node(self) -> dict[int, set[str]]:
        out = {}
        for port in self.ports:
            with self.node(port) as node:
                out[port] = {k.decode() for k in node.keys("stability:*")}
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs.clear()


@pytest.fixture
def cluster_binary() -> str:
    binary = _binary()
    if binary is None:
        pytest.skip("no system redis-server (7.x) to run cluster nodes")
    return binary


@pytest.fixture
def cluster(tmp_path: Path, cluster_binary: str) -> Iterator[Cluster]:
    nodes = Cluster(tmp_path / "cluster", cluster_binary)
    try:
        yield nodes.start()
    finally:
        nodes.stop()


def runs_on_each_node(client: Any, count: int) -> list[str]:
    """``count`` run ids whose hash slots lie on ``count`` different nodes (run keys are spread by their tag)."""
    chosen: dict[str, str] = {}
    for i in range(10_000):
        run_id = f"cl-run-{i}"
        node = client.get_node_from_key(keys.meta(run_id)).name
        chosen.setdefault(node, run_id)
        if len(chosen) == count:
            return sorted(chosen.values())
    raise AssertionError("could not find runs on distinct nodes")


def emit_run(url: str, run_id: str, spool: Path, *, nan_at: int | None = None, spike_at: int | None = None) -> None:
    """Two ranks of one run through real emitters, closed (rank ended) at the end."""
    rng = random.Random(run_id)
    emitters = [Emitter(redis_url=url, run_id=run_id, spool_dir=spool, rank=rank, timeout_s=5.0) for rank in (0, 1)]
    for step in range(STEPS):
        for rank, emitter in enumerate(emitters):
            loss = 3.0 * math.exp(-step / 200) + rng.gauss(0, 0.02)
            if step == spike_at:
                loss *= 8
            if (rank, step) == (1, nan_at):
                loss = math.nan
            signals = {"loss": loss, "grad_norm": 1.0 + rng.gauss(0, 0.01)}
            assert emitter.put(StepRecord(run_id=run_id, step=step, rank=rank, wall_time=1e9 + step, host=f"h{rank}",
                                          signals=signals))  # fmt: skip
    for emitter in emitters:
        emitter.close()
        stats = emitter.stats
        assert (stats.sent, stats.spooled, stats.errors, stats.duplicates) == (STEPS, 0, 0, 0), stats


def findings_of(client: Any, run_id: str) -> list[tuple[str, int, int]]:
    return [(f["kind"], f["rank"], f["step"]) for f in
            (json.loads(fields[b"f"]) for _, fields in client.xrange(keys.findings(run_id)))]  # fmt: skip


# -- tests ------------------------------------------------------------------------------------------------------


def test_url_forms() -> None:
    from stability.config import WatchConfig
    from stability.redis_url import _cluster_parts, safe_url

    assert is_cluster_url("redis+cluster://a:1") and is_cluster_url("rediss+cluster://a:1")
    assert not is_cluster_url("redis://a:1/0")
    assert _cluster_parts("rediss+cluster://u:pw@a:7000,b:7001/0?ssl_cert_reqs=none", "x") == (
        "rediss://u:pw@a:7000/0?ssl_cert_reqs=none", [("b", 7001)]
    )
    assert _cluster_parts("redis+cluster://a", "x") == ("redis://a:6379/0", [])
    assert safe_url("redis+cluster://u:secret@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert WatchConfig(redis_url="redis+cluster://a:1,b:2").redis_url == "redis+cluster://a:1,b:2"
    with pytest.raises(ConfigError, match="database 0 only"):
        WatchConfig(redis_url="redis+cluster://a:1/2")
    with pytest.raises(ConfigError, match="no valid port"):
        connect("redis+cluster://a:port")


def test_a_cluster_cannot_be_the_celery_broker(tmp_path: Path) -> None:
    from stability.worker.app import WorkerSettings

    with pytest.raises(ConfigError, match="STABILITY_BROKER_URL"):
        WorkerSettings(redis_url="redis+cluster://127.0.0.1:7000")
    with pytest.raises(ConfigError, match=r"STABILITY_BROKER_URL='redis\+cluster://.*' is a Redis Cluster"):
        WorkerSettings(redis_url="redis+cluster://127.0.0.1:7000", broker_url="redis+cluster://127.0.0.1:7000")
    ok = WorkerSettings.from_env({"STABILITY_REDIS_URL": "redis+cluster://h:7000", "STABILITY_BROKER_URL": "unix:///s"})
    assert (ok.broker, ok.client_url) == ("redis+socket:///s", "redis+cluster://h:7000")
    assert WorkerSettings(redis_url="redis://h:1/2").broker == "redis://h:1/2"  # unchanged: the Redis is the broker

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(STABILITY_REDIS_URL="redis+cluster://127.0.0.1:7000", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "stability.worker"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "is a Redis Cluster, which cannot be the Celery broker; set STABILITY_BROKER_URL" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_emitters_and_drainer_over_a_three_node_cluster(cluster: Cluster, tmp_path: Path) -> None:
    client = connect(cluster.url, socket_timeout=5)
    nan_run, spike_run, clean_run = runs = runs_on_each_node(client, 3)
    emit_run(cluster.url, nan_run, tmp_path / "spool", nan_at=NAN_STEP)
    emit_run(cluster.url, spike_run, tmp_path / "spool", spike_at=SPIKE_STEP)
    emit_run(cluster.url, clean_run, tmp_path / "spool")
    assert {m.decode() for m in client.smembers(keys.RUNS)} == set(runs)
    # the NaN's emitter also pushed its rank to the global urgent list (another slot than the run's keys)
    assert client.lrange(keys.URGENT, 0, -1) == [keys.urgent_member(nan_run, 1).encode()]

    sinks = [RedisFindingsSink(client), AdviceSink(client)]  # both run Lua scripts on the run's slot
    for run_id in runs:
        statuses = []
        while not statuses or statuses[-1] != "drained":  # batch 25: several committed transactions per run
            statuses.append(Drainer(client, run_id, sinks=sinks, batch=25, max_seconds=60).run().status)
            assert len(statuses) < 20, statuses
        assert client.hexists(keys.meta(run_id), "drained")
        for rank in (0, 1):
            assert int(client.xpending(keys.records(run_id, rank), keys.GROUP)["pending"]) == 0
            assert client.xlen(keys.records(run_id, rank)) == STEPS
    assert client.smembers(keys.RUNS) == set()

    assert ("nan", 1, NAN_STEP) in findings_of(client, nan_run)
    assert {("loss_spike", rank, SPIKE_STEP) for rank in (0, 1)} <= set(findings_of(client, spike_run))
    assert not [f for f in findings_of(client, clean_run) if f[0] in ("nan", "loss_spike")]
    advice = json.loads(client.get(keys.advice(spike_run)))
    assert (advice["kind"], advice["step"]) == ("loss_spike", SPIKE_STEP)
    from stability.hooks.guard import Guard, GuardConfig  # the training side's reader of the advice

    guard = Guard(GuardConfig(run_id=spike_run, redis_url=cluster.url))
    polled = guard.poll_now()
    guard.close()
    assert polled is not None and (polled.kind, polled.step) == ("loss_spike", SPIKE_STEP)

    # every key of a run is on one node, in one slot; the three runs are on three different nodes
    by_node = cluster.keys_by_node()
    homes = {}
    for run_id in runs:
        tag = f"stability:{{{run_id}}}:"
        nodes = {port for port, names in by_node.items() if any(n.startswith(tag) for n in names)}
        assert len(nodes) == 1, (run_id, nodes)
        homes[run_id] = nodes.pop()
        run_keys = {n for n in by_node[homes[run_id]] if n.startswith(tag)}
        assert {keys.records(run_id, 0), keys.records(run_id, 1), keys.meta(run_id), keys.state(run_id),
                keys.ranks(run_id)} <= run_keys  # fmt: skip
        assert len({client.keyslot(name) for name in run_keys}) == 1
    assert len(set(homes.values())) == 3

    # a crash between "drained" and the removal from RUNS (two steps on a cluster) is healed by the next drain
    client.sadd(keys.RUNS, spike_run)
    assert Drainer(client, spike_run, sinks=sinks).run().status == "drained"
    assert not client.sismember(keys.RUNS, spike_run)
    client.close()


def test_emitter_spools_until_the_cluster_is_up(cluster_binary: str, tmp_path: Path) -> None:
    """A cluster client contacts a node when made; the emitter makes it on its thread, so a cluster that is down at
    start means spooling, then a replay once it is up, as with one server."""
    nodes = Cluster(tmp_path / "late", cluster_binary)
    try:
        emitter = Emitter(redis_url=nodes.url, run_id="late-run", spool_dir=tmp_path / "spool", timeout_s=5.0)
        for step in range(5):
            assert emitter.put(StepRecord(run_id="late-run", step=step, rank=0, wall_time=1e9 + step,
                                          signals={"loss": 1.0}))  # fmt: skip
        assert emitter.flush(30)
        assert (emitter.stats.spooled, emitter.stats.sent) == (5, 0)
        nodes.start()
        _wait("the spool to be replayed", lambda: emitter.stats.replayed == 5, 60)
        emitter.close()
        client = connect(nodes.url)
        assert [eid.decode().split("-")[1] for eid, _ in client.xrange(keys.records("late-run", 0))] == list("01234")
        assert client.sismember(keys.RUNS, "late-run") and client.hexists(keys.meta("late-run"), "ended:0")
        client.close()
    finally:
        nodes.stop()


def train_watched(url: str, run_id: str, run_dir: Path) -> None:
    """A real CPU training loop under ``stability.watch`` (session, console reader, emitter) with a NaN batch."""
    import torch

    import stability

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with stability.watch(run_id=run_id, run_dir=run_dir, redis_url=url, quiet=True) as handle:
        for step in range(STEPS):
            x = torch.randn(16, 8)
            if step == NAN_STEP:
                x[0, 0] = float("nan")
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == NAN_STEP:  # keep training healthy after the poisoned batch
                with torch.no_grad():
                    for p in model.parameters():
                        p.nan_to_num_(0.0)
                opt.state.clear()
        assert handle.session is not None
        emitter = handle.session.emitter
    stats = emitter.stats
    assert stats.sent == STEPS and stats.spooled == stats.dropped == stats.errors == 0, stats


def test_a_node_crash_spools_its_runs_only_and_loses_nothing(cluster_binary: str, tmp_path: Path) -> None:
    """SIGKILL the node of one run mid-run: that run's emitter spools while the run on a healthy node stays live
    (``cluster-require-full-coverage no``); the node restarts from its append-only file, the spool is replayed,
    and both runs drain completely with the NaN injected during the outage found."""
    # appendfsync always: with everysec redis may delay the AOF write while an fsync runs, so a SIGKILL loses up
    # to ~2 s of acknowledged writes (redis's documented trade-off); this test restarts the node from its AOF
    extra = ("--appendonly", "yes", "--appendfsync", "always", "--cluster-require-full-coverage", "no")
    nodes = Cluster(tmp_path / "crash", cluster_binary, extra=extra)
    try:
        client = connect(nodes.start().url, socket_timeout=5)
        by_port = {}
        for i in range(10_000):
            by_port.setdefault(client.get_node_from_key(keys.meta(f"crash-{i}")).port, f"crash-{i}")
        victim_port = nodes.ports[2]  # not a startup node of the URL
        victim, healthy = by_port[victim_port], by_port[nodes.ports[0]]
        emitters = {run_id: Emitter(redis_url=nodes.url, run_id=run_id, spool_dir=tmp_path / run_id, timeout_s=5.0)
                    for run_id in (victim, healthy)}  # fmt: skip

        def put(steps: range) -> None:
            for run_id, emitter in emitters.items():
                for step in steps:
                    loss = math.nan if step == 25 else 2.0 - 0.01 * step + 0.001 * (step % 3)
                    assert emitter.put(StepRecord(run_id=run_id, step=step, rank=0, wall_time=1e9 + step,
                                                  signals={"loss": loss, "grad_norm": 1.0}))  # fmt: skip
                assert emitter.flush(60)

        put(range(0, 20))
        nodes.kill(victim_port)
        put(range(20, 40))
        assert emitters[victim].stats.spooled > 0
        assert emitters[healthy].stats.spooled == 0 and emitters[healthy].stats.sent == 40
        # an emitter that starts during the outage, for a run on a healthy node, sends live from the start
        newcomer = Emitter(redis_url=nodes.url, run_id=by_port[nodes.ports[1]], spool_dir=tmp_path / "new",
                           timeout_s=5.0)  # fmt: skip
        assert newcomer.put(StepRecord(run_id=newcomer.run_id, step=0, wall_time=1e9, signals={"loss": 1.0}))
        newcomer.close()
        assert (newcomer.stats.sent, newcomer.stats.spooled) == (1, 0), newcomer.stats
        nodes.restart(victim_port)
        _wait("the victim's spool to be replayed",
              lambda: emitters[victim].stats.replayed == emitters[victim].stats.spooled, 90)  # fmt: skip
        put(range(40, 60))
        for emitter in emitters.values():
            emitter.close()
            assert emitter.stats.errors == emitter.stats.dropped == 0, emitter.stats

        for run_id in (victim, healthy):
            statuses: list[str] = []
            while not statuses or statuses[-1] != "drained":
                statuses.append(Drainer(client, run_id, sinks=[RedisFindingsSink(client)], max_seconds=60).run().status)
                assert len(statuses) < 10, statuses
            steps = [int(eid.decode().split("-")[1]) for eid, _ in client.xrange(keys.records(run_id, 0))]
            assert steps == list(range(60)), run_id
            assert ("nan", 0, 25) in findings_of(client, run_id)
        client.close()
    finally:
        nodes.stop()


@pytest.mark.slow
def test_worker_process_over_a_cluster_with_a_separate_broker(
    cluster: Cluster, redis_server: RedisServer, tmp_path: Path
) -> None:
    """``stability worker`` with STABILITY_REDIS_URL=redis+cluster://... and STABILITY_BROKER_URL=a plain Redis;
    one run from a real ``stability.watch`` training loop (archived in its run directory), one from emitters."""
    client = connect(cluster.url, socket_timeout=5)
    runs = runs_on_each_node(client, 2)
    watched, emitted = runs
    train_watched(cluster.url, watched, tmp_path / "run")
    emit_run(cluster.url, emitted, tmp_path / "spool", nan_at=NAN_STEP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "STABILITY_"))}
    env.update(STABILITY_REDIS_URL=cluster.url, STABILITY_BROKER_URL=redis_server.url, STABILITY_SWEEP_S="0.2",
               STABILITY_BATCH="50", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # fmt: skip
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "stability.worker", "-n", "cluster@%h"], cwd=tmp_path,
                                  env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        def drained() -> bool:
            if worker.poll() is not None:
                pytest.fail(f"worker exited with {worker.returncode}:\n{log.read_text()[-4000:]}")
            return all(client.hexists(keys.meta(r), "drained") for r in runs)

        _wait(f"runs drained by the worker; log:\n{log}", drained, 240, poll=0.2)
        assert ("nan", 1, NAN_STEP) in findings_of(client, emitted)
        assert ("nan", 0, NAN_STEP) in findings_of(client, watched)
        assert sorted((tmp_path / "run" / "archive").glob("*.parquet")), "the watched run was not archived"
        assert (tmp_path / "run" / "findings.json").exists()
        _wait("the runs to leave keys.RUNS", lambda: not client.smembers(keys.RUNS), 30)
        broker = redis.Redis.from_url(redis_server.url)
        assert not any(k.startswith(b"stability:") for k in broker.keys("*")), "run data went to the broker"
        broker.close()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
        client.close()

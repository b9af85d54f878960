"""The parts of :mod:`stability.sources.ranks` on their own: prefixes and file names (layout), the hang rules
(hangs: a rank's last line against the others' steps or NCCL watchdog timeouts) and host matching (hosts)."""

from __future__ import annotations

from pathlib import Path

from stability.records import StepRecord
from stability.sources._model import LogEvent
from stability.sources.ranks.hangs import LastLine, logging_interval, span, stopped_ranks
from stability.sources.ranks.hosts import attribute_hosts, describe_hosts, host_from_name
from stability.sources.ranks.layout import discover_files, outer_mode, split_prefixes


def last_line(steps: list[int], where: str) -> LastLine:
    line = LastLine()
    for step in steps:
        line.note(None, step, f"  iteration {step} | lm loss: 2.0  ", where)
    return line


def test_prefixes_nest_and_outer_mode_needs_most_lines() -> None:
    assert split_prefixes("0: [default3]:[rank7]: hello", "label") == ("0", 3, 7, "hello")
    assert split_prefixes("tqdm 50%[rank2]:[W init] x") == (None, None, 2, "[W init] x")
    assert outer_mode(["node-a: x", "node-b: y", "node-a: z"]) == "host"
    assert outer_mode(["INFO: x", "WARNING: y"]) == ""
    assert outer_mode(["3: a", "plain"]) == ""


def test_file_names_give_ranks_and_hosts() -> None:
    named = discover_files([Path("log.node-b.1"), Path("log.node-a.0")])
    assert [(f.path.name, f.rank, f.host) for f in named] == [("log.node-a.0", 0, "node-a"), ("log.node-b.1", 1,
                                                                                                 "node-b")]
    torchrun = discover_files([Path(f"d/r_{n}/attempt_1/{local}/stdout.log") for n in "xy" for local in (0, 1)])
    assert {(f.node, f.local, f.attempt) for f in torchrun} == {(n, lo, 1) for n in ("r_x", "r_y") for lo in (0, 1)}


def test_last_line_keeps_steps_gap_and_text() -> None:
    line = last_line([10, 10, 20, 50], "r.log:4")
    assert (line.last_step, line.steps, line.gap, line.last_line, line.last_source) == \
        (50, 3, 30, "iteration 50 | lm loss: 2.0", "r.log:4")
    assert logging_interval([10, 20, 20, 30, 60]) == 10
    assert logging_interval([5]) == 1
    assert span([5, 0, 1, 2, 3, 9, 10]) == "0-3, 5, 9-10"


def test_rank_behind_the_others_is_stopped() -> None:
    records = [StepRecord(run_id="r", step=s, signals={"loss": 2.0}) for s in range(10, 101, 10)]
    lines = [(r, last_line(list(range(10, 101, 10)), f"r{r}.log:9")) for r in (0, 1, 3)]
    lines.append((2, last_line([10, 20, 30], "r2.log:3")))
    found = stopped_ranks(lines, {2: "node-b"}, records, [], {})
    assert [(e.kind, e.rank, e.host, e.step, e.value, e.source) for e in found] == \
        [("rank_stopped", 2, "node-b", 30, 0.0, "r2.log:3")]
    assert "rank 2 on node-b: its log stops at step 30" in found[0].message
    assert "rank(s) 0-1, 3 went on to step 100" in found[0].message
    assert stopped_ranks(lines[:3], {}, records, [], {}) == []  # all level: nothing stopped


def test_rank_waited_for_by_nccl_watchdogs() -> None:
    timeouts = [LogEvent(kind="nccl_timeout", message="Watchdog caught collective operation timeout: "
                         "WorkNCCL(SeqNum=41, OpType=ALLREDUCE, ...)", source=f"r{r}.log:7", step=40, rank=r)
                for r in (0, 1, 3)]
    lines = [(r, last_line([10, 20, 40], f"r{r}.log:6")) for r in (0, 1, 3)] + [(2, last_line([10, 20], "r2.log:2"))]
    found = stopped_ranks(lines, {}, [], timeouts, {"world_size": "4"})
    assert [(e.rank, e.step, e.value) for e in found] == [(2, 20, 1.0)]
    assert "in ALLREDUCE SeqNum=41 (NCCL watchdog)" in found[0].message
    missing = stopped_ranks(lines[:3], {}, [], timeouts, {"world_size": "4"})
    assert [(e.rank, e.source) for e in missing] == [(2, "r0.log:7")]
    assert "rank(s) 2 are not in these logs" in missing[0].message
    assert stopped_ranks(lines, {}, [], timeouts[:1], {"world_size": "4"}) == []  # most ranks silent: no suspect


def test_system_events_land_on_the_ranks_of_their_host() -> None:
    hosts = {0: "node-a.cluster", 1: "node-a.cluster", 2: "node-b", 3: "node-b"}
    assert describe_hosts(hosts) == "node-a.cluster: ranks 0-1; node-b: ranks 2-3"
    xid = LogEvent(kind="xid", message="NVRM: Xid 79", source="k:1", host="NODE-A")
    plain = LogEvent(kind="xid", message="NVRM: Xid 48", source="k:2")
    matched = attribute_hosts([xid, plain], hosts, default_host="node-b")
    assert [(e.host, e.rank, e.ranks) for e in matched] == [("NODE-A", 0, (0, 1)), ("node-b", 2, (2, 3))]
    assert host_from_name(Path("dmesg-node-b.cluster.txt"), ["node-a.cluster", "node-b.cluster"]) == "node-b.cluster"
    assert host_from_name(Path("node-c.dmesg")) == "node-c"
    assert host_from_name(Path("kern.log")) == ""

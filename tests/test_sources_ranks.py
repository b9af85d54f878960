"""Post-mortem of multi-rank logs (issue #11): per-rank files and prefixed combined files read as one multi-rank run,
a rank whose log stops while the others wait (``hang``), kernel logs matched to the ranks of their host.

Fixtures are written from the launchers' own line formats: torchrun's ``--tee`` prefix ``[${role_name}${local_rank}]:``
(torch/distributed/elastic/multiprocessing/tail_log.py) and its ``--log-dir`` layout
``<log_dir>/<rdzv_run_id>_<random>/attempt_<k>/<local_rank>/stdout.log`` (elastic/multiprocessing/api.py
``DefaultLogsSpecs.reify``), PyTorch's ``[rankN]:`` prefix of worker exceptions and C++ log lines and its NCCL
watchdog message (ProcessGroupNCCL.cpp), ``srun --label`` (``N: ``), pdsh (``host: ``), SLURM ``--output
log.%N.%t``, the kernel's ``NVRM: Xid`` line; one test runs a real 2-process torchrun (gloo, CPU).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from stability.cli import main
from stability.postmortem import PostmortemResult, load_source, run
from stability.sources import load_system_log, sniff
from stability.sources.ranks import attribute_hosts, discover, split_prefixes
from stability.testing import torchrun


def analyse(source: Path | list[Path], tmp_path: Path, **kwargs: object) -> PostmortemResult:
    return run(source, json_out=tmp_path / "f.json", html_out=tmp_path / "r.html", **kwargs)  # type: ignore[arg-type]


def serious(result: PostmortemResult) -> list[dict[str, object]]:
    return [e for e in result.events if e["severity"] != "info"]


def causes(event: dict[str, object]) -> list[str]:
    found = event["causes"]
    assert isinstance(found, list)
    return [str(c["cause"]) for c in found]


def stamp(step: int) -> str:
    return f"[2024-05-13 11:{step // 60 % 60:02d}:{step % 60:02d}]"


def nanogpt(step: int, rank: int) -> str:
    return f"iter {step}: loss {3.0 - 0.001 * step + 0.01 * rank:.4f}, time 812.30ms"


def megatron(step: int) -> str:
    return (f" {stamp(step)} iteration {step:>8d}/     500 | consumed samples: {step * 128:>12d} | elapsed time per "
            f"iteration (ms): 812.3 | learning rate: 3.000000E-04 | global batch size:   128 | lm loss: "
            f"{3.0 - 0.001 * step:.6E} | loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def watchdog(rank: int, seq: int = 1623) -> str:
    """PyTorch's (>= 2.4) NCCL watchdog line, as printed under its ``[rankN]:`` prefix."""
    return (f"[rank{rank}]:[E513 11:15:00.{rank:09d} ProcessGroupNCCL.cpp:616] "
            f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, "
            f"NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600043 milliseconds before timing out.")


def test_prefixes_nest_and_say_local_or_global_ranks() -> None:
    assert split_prefixes("[default3]:[rank7]: Traceback (most recent call last):") == (
        None, 3, 7, "Traceback (most recent call last):")
    assert split_prefixes("[rank2]:[E513 11:15:00.000000001 x.cpp:1] y") == (None, None, 2,
                                                                             "[E513 11:15:00.000000001 x.cpp:1] y")
    bar = " 24/1752 [01:08<1:22:56,  2.88s/it][rank5]:[E602 11:17:52.185053341 ProcessGroupNCCL.cpp:632] [Rank 5] x"
    assert split_prefixes(bar)[2] == 5
    assert split_prefixes(" 3: [default1]: iter 5: loss 2.0", "label") == ("3", 1, None, "iter 5: loss 2.0")
    assert split_prefixes("node-b: [2024-05-13 11:00:00] x", "host") == ("node-b", None, None,
                                                                          "[2024-05-13 11:00:00] x")
    assert split_prefixes("[2024-05-13 11:00:00] iteration 5/ 10 |") == (None, None, None,
                                                                          "[2024-05-13 11:00:00] iteration 5/ 10 |")


# -- one combined file ---------------------------------------------------------------------------------------------

def _combined_hang(path: Path, prefix: Callable[[int], str], world: int = 4, stuck: int = 2, last: int = 150) -> Path:
    """Every rank prints its loss every 10 iterations; rank ``stuck`` never comes back from the all-reduce of
    iteration ``last`` + 1, the others wait in it until their NCCL watchdogs fire 10 minutes later."""
    lines = []
    for step in range(10, last + 1, 10):
        lines += [f"{prefix(r)}{nanogpt(step, r)}" for r in range(world)]
    lines += [f"{prefix(r)}some warning from rank {r}" for r in range(world) if r != stuck]
    lines += [watchdog(r) for r in range(world) if r != stuck]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_combined_rank_prefixed_log_where_rank_2_stops_is_a_hang_naming_rank_2(tmp_path: Path) -> None:
    path = _combined_hang(tmp_path / "train.log", lambda r: f"[rank{r}]: ")
    assert sniff(path) == "text"
    log = load_source(path)
    assert sorted({r.rank for r in log.records}) == [0, 1, 2, 3]
    assert {r.rank: r.signals["loss"] for r in log.records if r.step == 10} == {0: 2.99, 1: 3.0, 2: 3.01, 3: 3.02}
    assert [e.rank for e in log.events if e.kind == "nccl_timeout"] == [0, 1, 3]
    result = analyse(path, tmp_path)
    hangs = [e for e in serious(result) if e["kind"] == "hang"]
    assert [(e["rank"], e["onset"], e["severity"]) for e in hangs] == [(2, 150, "error")]
    assert causes(hangs[0])[0] == "hang"
    message = str(hangs[0]["message"])
    assert "rank 2: its log stops at step 150" in message and "rank(s) 0-1, 3 timed out" in message
    assert "ALLREDUCE SeqNum=1623" in message
    data = json.loads((tmp_path / "f.json").read_text())
    assert [e["rank"] for e in data["log_events"] if e["kind"] == "rank_stopped"] == [2]


def test_watchdogs_of_one_node_waiting_for_ranks_not_in_the_log_say_so(tmp_path: Path) -> None:
    """The console of node 0 (ranks 0-3 of 8): all four time out; the rank they wait for is on the other node."""
    lines = ["[default0]:using world size: 8, data-parallel size: 8, tensor-model-parallel size: 1, "
             "pipeline-model-parallel size: 1"]
    lines += [f"[default3]:{megatron(step)}" for step in range(10, 110, 10)]
    lines += [watchdog(r) for r in range(4)]
    path = tmp_path / "node0.log"
    path.write_text("\n".join(lines) + "\n")
    stopped = [e for e in load_source(path).events if e.kind == "rank_stopped"]
    assert len(stopped) == 1 and "rank(s) 4-7 are not in these logs" in stopped[0].message
    hangs = [e for e in serious(analyse(path, tmp_path)) if e["kind"] == "hang"]
    assert [(e["severity"], e["onset"]) for e in hangs] == [("error", 100)]


def test_torchrun_tee_prefixes_are_local_ranks_and_a_rank_whose_lines_stop_is_a_hang(tmp_path: Path) -> None:
    """torchrun --tee 3 console: ``[default3]:``; here the others log on (no collective waits for rank 1)."""
    lines = []
    for step in range(10, 310, 10):
        lines += [f"[default{r}]:{nanogpt(step, r)}" for r in range(3) if not (r == 1 and step > 120)]
    path = tmp_path / "console.log"
    path.write_text("\n".join(lines) + "\n")
    result = analyse(path, tmp_path)
    assert result.ranks == (0, 1, 2)
    hangs = [e for e in serious(result) if e["kind"] == "hang"]
    assert [(e["rank"], e["onset"], e["severity"], causes(e)[0]) for e in hangs] == [(1, 120, "warning", "hang")]
    assert "went on to step 300" in str(hangs[0]["message"])


def test_a_rank_that_prints_only_at_start_up_is_quiet_not_hung(tmp_path: Path) -> None:
    """Megatron prints the losses from one rank; the others print a few start-up lines and then nothing."""
    lines = [f"[default{r}]: > rank {r} building model ..." for r in range(4)]
    lines += [f"[default3]:{megatron(step)}" for step in range(10, 310, 10)]
    path = tmp_path / "megatron.log"
    path.write_text("\n".join(lines) + "\n")
    log = load_source(path)
    assert {r.rank for r in log.records} == {3}  # print_rank_last: the last rank prints the losses
    assert not [e for e in log.events if e.kind == "rank_stopped"]
    assert not [e for e in serious(analyse(path, tmp_path)) if e["kind"] == "hang"]
    # a rank that prints now and then (every 100 iterations) and not in the last 100 is not hung either
    lines += [f"[default1]: [W reducer.cpp:1389] Warning: at iteration {step}" for step in range(100, 300, 100)]
    lines += [f"[default3]:{megatron(step)}" for step in range(310, 400, 10)]
    path.write_text("\n".join(lines) + "\n")
    assert not [e for e in load_source(path).events if e.kind == "rank_stopped"]


def test_srun_label_lines_are_global_ranks_and_the_cross_rank_check_names_the_faulty_one(tmp_path: Path) -> None:
    """``srun --label`` of 4 tasks printing llm.c-style lines; from step 150 task 3's post-all-reduce grad norm
    differs from the other replicas' (they agree bit for bit before): a faulty rank."""
    lines = []
    for step in range(1, 200):
        for task in range(4):
            norm = 1.0 + 0.001 * (step % 7) + (0.5 if task == 3 and step >= 150 else 0.0)
            loss = 3.0 - 0.001 * step + 0.003 * ((step * (task + 3)) % 5)
            lines.append(f"{task}: step:{step}/200 train_loss:{loss:.5f} norm:{norm:.5f}")
    path = tmp_path / "slurm-1234.out"
    path.write_text("\n".join(lines) + "\n")
    log = load_source(path)
    assert sorted({r.rank for r in log.records}) == [0, 1, 2, 3] and len(log.records) == 4 * 199
    found = [e for e in serious(analyse(path, tmp_path)) if e["kind"] == "rank_disagreement"]
    assert [(e["rank"], e["onset"]) for e in found] == [(3, 150)]
    assert causes(found[0])[0] == "hardware_fault"


def test_pdsh_host_prefixes_and_torchrun_local_ranks_give_global_ranks_by_node_order(tmp_path: Path) -> None:
    lines = []
    for step in range(10, 110, 10):
        for host in ("node-a", "node-b"):
            lines += [f"{host}: [default{r}]:{nanogpt(step, r)}" for r in range(2)]
    path = tmp_path / "pdsh.log"
    path.write_text("\n".join(lines) + "\n")
    log = load_source(path)
    assert log.hosts == {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    assert {(r.rank, r.host) for r in log.records} == {(0, "node-a"), (1, "node-a"), (2, "node-b"), (3, "node-b")}
    assert any("assumed from their order by name" in n for n in log.notes)


# -- per-rank files -------------------------------------------------------------------------------------------------

def test_torchrun_log_dir_layout_with_two_nodes_and_a_restart(tmp_path: Path) -> None:
    """``--log-dir D --redirects 3``: one ``<run id>_<random>`` directory per node, ``attempt_<k>`` per restart;
    node 1's global ranks are read from a ``[rankN]:`` line, node 0's follow from local rank + 0."""
    root = tmp_path / "torchrun-logs"
    for node, name in enumerate(("job7_x2k1", "job7_a9zz")):  # random suffixes: name order is not node order
        for attempt, steps in ((0, range(10, 110, 10)), (1, range(60, 160, 10))):
            for local in range(2):
                folder = root / name / f"attempt_{attempt}" / str(local)
                folder.mkdir(parents=True)
                rank = node * 2 + local
                (folder / "stdout.log").write_text("".join(f"{nanogpt(s, rank)}\n" for s in steps))
                err = f"[rank{rank}]: a warning\n" if node == 1 and attempt == 0 else ""
                (folder / "stderr.log").write_text(err)
    files = discover(root)
    assert {(f.node, f.local, f.attempt) for f in files} >= {("job7_a9zz", 1, 1), ("job7_x2k1", 0, 0)}
    assert sniff(root) == "ranked"
    log = load_source(root)
    assert sorted({(r.rank, r.signals["loss"]) for r in log.records if r.step == 10}) == [
        (0, 2.99), (1, 3.0), (2, 3.01), (3, 3.02)]
    assert [(s.first_step, s.last_step, s.stop - s.start) for s in log.segments] == [(10, 100, 40), (60, 150, 40)]
    assert log.segments[1].context.get("attempt") == "1"
    assert any("nodes job7_x2k1 assumed" in n for n in log.notes)  # no line of node 0 names a global rank
    result = analyse(root, tmp_path)
    assert result.ranks == (0, 1, 2, 3) and result.steps == 15


def test_real_torchrun_log_dir_and_tee_console(tmp_path: Path) -> None:
    """A real 2-process gloo run with ``--log-dir --tee 3``: the directory and the captured console read the same."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "for it in range(1, 31):\n"
        "    t = torch.ones(1); dist.all_reduce(t)\n"
        "    print(f'iter {it}: loss {3.0 - 0.01 * it + 0.1 * rank:.4f}, time 10.00ms', flush=True)\n"
        "print(f'rank {rank} done', file=sys.stderr, flush=True)\n"
        "dist.destroy_process_group()\n")
    done = torchrun(script, launcher=("--log-dir", str(tmp_path / "logs"), "--tee", "3"))
    assert done.returncode == 0, done.stderr[-2000:]
    console = tmp_path / "console.log"
    console.write_text(done.stdout + done.stderr)
    for source in (tmp_path / "logs", console):
        log = load_source(source)
        assert sorted({r.rank for r in log.records}) == [0, 1], source
        assert {r.rank: r.signals["loss"] for r in log.records if r.step == 30} == {0: 2.7, 1: 2.8}
        assert len(log.records) == 60


def test_slurm_per_task_files_and_a_dmesg_of_node_b_match_ranks_4_to_7(tmp_path: Path) -> None:
    """``--output log.%N.%t``: 8 tasks on node-a / node-b; rank 5 stops at iteration 120 while the others' NCCL
    watchdogs fire; node-b's dmesg (no host in its lines: from the file name) has an Xid 79 at that time."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank in range(8):
        host = "node-a" if rank < 4 else "node-b"
        last = 120 if rank == 5 else 130
        lines = [f"{stamp(s)} rank {rank} step {s} done" for s in range(10, last + 1, 10)]
        if rank == 0:
            lines = [megatron(s) for s in range(10, last + 1, 10)]
        if rank != 5:
            lines.append(watchdog(rank).replace("E513 11:15", "E513 11:12"))
        (logs / f"log.{host}.{rank}").write_text("\n".join(lines) + "\n")
    dmesg = tmp_path / "node-b.dmesg"
    dmesg.write_text("[1234567.100000] NVRM: Xid (PCI:0000:3b:00): 79, pid=28911, name=python, GPU has fallen off "
                     "the bus.\n[1234567.100100] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n")
    log = load_source(logs)
    assert log.hosts == {r: "node-a" if r < 4 else "node-b" for r in range(8)}
    assert not [e for e in log.events if e.kind == "xid"]
    stopped = [e for e in log.events if e.kind == "rank_stopped"]
    assert [(e.rank, e.host, e.step) for e in stopped] == [(5, "node-b", 120)]
    events = attribute_hosts(load_system_log(dmesg, hosts={"node-a", "node-b"}), log.hosts)
    assert [(e.kind, e.host, e.rank, e.ranks) for e in events] == [("xid", "node-b", 4, (4, 5, 6, 7))]
    result = analyse(logs, tmp_path, system_logs=[dmesg])
    found = {e["kind"]: e for e in serious(result)}
    assert found["hang"]["rank"] == 5 and found["hang"]["host"] == "node-b" and found["hang"]["onset"] == 120
    assert causes(found["hang"])[:2] == ["hardware_fault", "hang"] or causes(found["hang"])[:2] == [
        "hang", "hardware_fault"]
    hardware = found["hardware_error"]
    assert hardware["host"] == "node-b" and hardware["rank"] == 4 and "(ranks 4-7)" in str(hardware["message"])
    (logs / dmesg.name).write_bytes(dmesg.read_bytes())  # a kernel log among the rank logs is read as one
    beside = load_source(logs)
    assert [(e.kind, e.ranks) for e in beside.events if e.kind == "xid"] == [("xid", (4, 5, 6, 7))]
    assert "node-b.dmesg: read as a system log (kernel / nvidia-smi)" in beside.notes


def test_cli_several_per_rank_files_and_one_system_log_per_node(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.log"
        path.write_text("".join(f"{nanogpt(s, rank)}\n" for s in range(10, 210, 10)))
        files.append(path)
    kern = tmp_path / "kern.log"
    kern.write_text("May 13 11:02:30 node-x kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=python, An "
                    "uncorrectable double bit error (DBE) has been detected on GPU\n")
    code = main(["postmortem", *map(str, files), "--system-log", str(kern), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "hardware_fault" in out
    data = json.loads((tmp_path / "out" / "rank0.findings.json").read_text())
    assert sorted(data["ranks"]) == [0, 1]


def test_hosts_from_nccl_info_lines_and_the_torchrun_failure_summary(tmp_path: Path) -> None:
    """srun starts one torchrun per node (``0: [default1]: ...``); node 1 names its host in NCCL INFO lines, and
    torchrun's failure summary of node 0 names its host and a global rank (``rank : 1 (local_rank: 1)``)."""
    lines = [f"{node}: [default{local}]:{nanogpt(step, node * 2 + local)}"
             for step in range(10, 60, 10) for node in range(2) for local in range(2)]
    lines += ["1: [default0]:gpu-b17:31337:31399 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.17<0>",
              "0: Root Cause (first observed failure):", "0: [0]:", "0:   time      : 2024-05-13_11:20:00",
              "0:   host      : gpu-a03", "0:   rank      : 1 (local_rank: 1)", "0:   exitcode  : -6 (pid: 4242)"]
    path = tmp_path / "srun.out"
    path.write_text("\n".join(lines) + "\n")
    log = load_source(path)
    assert log.hosts == {0: "gpu-a03", 1: "gpu-a03", 2: "gpu-b17", 3: "gpu-b17"}
    assert {r.rank: r.signals["loss"] for r in log.records if r.step == 10} == {0: 2.99, 1: 3.0, 2: 3.01, 3: 3.02}
    assert not log.notes  # srun task ids are the node indices: nothing assumed from names


def test_glog_dates_of_pytorch_cpp_lines_take_the_year_of_the_log() -> None:
    from stability.sources.system import parse_time

    new, _ = parse_time("[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught", 2024)
    old, _ = parse_time("E1204 14:40:32.295000 12040 torch/distributed/elastic/multiprocessing/api.py:1002] x", 2024)
    assert new == pytest.approx(1710986828.408271257) and old == pytest.approx(1733323232.295)


def test_deepspeed_launcher_over_pdsh_maps_ranks_to_hosts_for_the_kernel_log(tmp_path: Path) -> None:
    """DeepSpeed's multi-node launcher runs over pdsh (``host: `` prefixes) and logs its global rank mapping; rank
    0 on node-a prints the steps. An Xid in node-b's journal (the host in the syslog line) names ranks 2-3."""
    mapping = ("[2024-05-13 10:59:58,000] [INFO] [launch.py:163:main] global_rank_mapping=defaultdict(<class "
               "'list'>, {'node-a': [0, 1], 'node-b': [2, 3]})")
    lines = [f"{host}: {mapping}" for host in ("node-a", "node-b")]
    lines += [f"node-a: {megatron(step)}" for step in range(10, 210, 10)]
    path = tmp_path / "ds.log"
    path.write_text("\n".join(lines) + "\n")
    journal = tmp_path / "journal.txt"
    journal.write_text("May 13 11:01:05 node-b kernel: NVRM: Xid (PCI:0000:bd:00): 79, pid=5151, name=python, GPU "
                       "has fallen off the bus.\n")
    result = analyse(path, tmp_path, system_logs=[journal])
    assert result.meta["hosts"] == "node-a: ranks 0-1; node-b: ranks 2-3"
    hardware = [e for e in serious(result) if e["kind"] == "hardware_error"]
    assert [(e["rank"], e["host"], e["onset"]) for e in hardware] == [(2, "node-b", 60)]
    assert "(ranks 2-3)" in str(hardware[0]["message"])

"""The ``stability`` command: ``demo``, ``worker``, ``postmortem``, ``runs``, ``replay``, ``eval``, ``profile``.

Everything heavy (torch, the detectors, Celery) is imported only by the subcommand that needs it, so
``stability --help`` and ``stability --version`` answer at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["main"]

FAULTS = ("none", "bad-batch", "lr-spike", "nan", "divergence")
"""The demo's faults (the same tuple as :data:`stability.demo.FAULTS`, kept here so that help needs no torch)."""
DEFAULT_FAULT = "lr-spike"
SEVERITIES = ("info", "warning", "error")


def _version() -> str:
    from stability import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stability", description="Training-stability diagnosis: live alerts during training, post-mortems after.",
    )
    parser.add_argument("--version", action="version", version=f"stability {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a tiny GPT with an injected fault and diagnose it live",
                          description="Train a tiny GPT on the CPU with an injected fault and diagnose it live.")
    demo.add_argument("--fault", choices=FAULTS, default=DEFAULT_FAULT,
                      help=f"fault to inject (default {DEFAULT_FAULT})")
    demo.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    demo.add_argument("--run-dir", type=Path, default=None, help="run directory (default ./stability-runs/demo-...)")

    sub.add_parser(
        "worker", add_help=False,
        help="run a Celery worker that diagnoses runs (Redis from STABILITY_REDIS_URL, default "
             "redis://127.0.0.1:6379/0); 'stability worker --help' for its options",
    )  # fmt: skip
    sub.add_parser("eval", add_help=False,
                   help="score the detectors on the labelled corpus (docs/evaluation.md); 'stability eval --help'")

    pm = sub.add_parser(
        "postmortem", help="analyse a finished or failed run (run directory, CSV file or Redis URL)",
        description="Analyse a run directory, a CSV log or a run in Redis with the same detectors as the worker, "
                    "and write findings.json and report.html next to the source (a CSV gets <stem>.findings.json "
                    "and <stem>.report.html beside it; a Redis run <run id>.findings.json and <run id>.report.html "
                    "in the current directory) or into -o DIR.",
    )  # fmt: skip
    pm.add_argument("source", nargs="+", help="run directory, CSV file (column 'step' plus signal columns), a "
                    "training log (Megatron-LM/DeepSpeed/HF Trainer/fairseq stdout, JSON lines, trainer_state.json; "
                    "lines may carry torchrun [default3]:/[rank3]:, srun --label '3: ' or pdsh 'host: ' prefixes), "
                    "a directory of per-rank logs (torchrun --log-dir, slurm-JOB-TASK.out, log.NODE.TASK), several "
                    "per-rank/per-node log files of one run, a TensorBoard or W&B offline run directory, or "
                    "redis://HOST:PORT/DB, rediss://..., unix:///path/redis.sock with --run ID")
    pm.add_argument("-o", "--out-dir", type=Path, default=None, help="write findings and report into this directory")
    pm.add_argument("--json", dest="json_out", type=Path, default=None,
                    help="findings JSON path (overrides the default)")
    pm.add_argument("--html", dest="html_out", type=Path, default=None,
                    help="HTML report path (overrides the default)")
    pm.add_argument("--fail-on", choices=SEVERITIES, default=None,
                    help="exit with code 1 when an incident of this severity or worse is found (for CI)")
    pm.add_argument("--run", "--run-id", dest="run_id", default=None,
                    help="run to load from a Redis source (default: the only run there); run id for a CSV source "
                         "(default: the file name)")
    pm.add_argument("--loss-averaged", choices=("auto", "yes", "no"), default="auto",
                    help="each CSV loss is the mean over the log interval (Megatron, HF Trainer); auto: yes for "
                    "files with Megatron's consumed_samples and skipped_iters columns")
    pm.add_argument("--system-log", dest="system_logs", type=Path, action="append", default=[], metavar="PATH",
                    help="a kernel log of the run's nodes (dmesg, journalctl -k): Xid, ECC, hung tasks, OOM kills "
                    "and NCCL timeouts go on the same timeline; or an nvidia-smi -q dump: uncorrectable ECC errors, "
                    "pending page retirements / row remappings, hardware slowdowns (repeatable: one per node; the "
                    "host is the syslog line's or the file name's, e.g. node-b.dmesg, and events are matched to the "
                    "ranks that ran there)")
    pm.add_argument("--baseline", type=Path, default=None, metavar="OTHER_SOURCE",
                    help="another run (any source but Redis) to compare with, aligned on step: the first step and the "
                    "signals where the two runs part")
    pm.add_argument("--exact", action="store_true",
                    help="replay every column of a CSV through the detectors, one record per row (the reference "
                    "path; by default a CSV is read as columns and quiet per-layer columns are screened out: the same "
                    "findings, much faster on big files)")

    runs = sub.add_parser("runs", help="list the runs in a Redis (status, ranks, last step, incidents, run dir)",
                          description="List the runs in a Redis: status (running / finished / died at step N), "
                                      "ranks, last step, age of the last record, open incidents and worst severity, "
                                      "run directory. Needs no worker.")
    runs.add_argument("url", help="redis://HOST:PORT/DB, rediss://... or unix:///path/redis.sock")
    runs.add_argument("--json", dest="as_json", action="store_true", help="print JSON lines instead of a table")

    rp = sub.add_parser("replay", help="send a run's spool to Redis after training ended (in order)",
                        description="Send the records a training run spooled while Redis was down "
                                    "(<run dir>/spool) to Redis in order, mark the run's ranks ended so a worker "
                                    "finishes it, and delete each spool file once all of it is in Redis. Without "
                                    "--redis and STABILITY_REDIS_URL the run's embedded Redis and a local worker "
                                    "are started again until the run is drained (findings and report written).")
    rp.add_argument("run_dir", type=Path, help="the run directory")
    rp.add_argument("--redis", default=None, help="target Redis URL (default: STABILITY_REDIS_URL, else embedded)")
    rp.add_argument("--wait", type=float, default=300.0,
                    help="embedded: seconds to wait for the worker to drain the run (default 300)")
    _profile_parser(sub)
    return parser


def _profile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prof = sub.add_parser("profile", help="profile the next N steps of a running job (torch.profiler trace into "
                          "its run directory)")
    prof.add_argument("run_id", help="the run to profile")
    prof.add_argument("--steps", type=int, default=5, help="steps to profile on every rank (default 5, at most 100)")
    prof.add_argument("--redis", default=None, help="the run's Redis URL (default: STABILITY_REDIS_URL, else the "
                      "embedded Redis of --run-dir)")
    prof.add_argument("--run-dir", type=Path, default=None, help="the run directory (embedded Redis)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stability`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["worker"]:
        from stability.worker.__main__ import main as worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["eval"]:
        from stability.evaluation import main as eval_main

        return int(eval_main(argv[1:]))
    args = _parser().parse_args(argv)
    from stability.errors import StabilityError

    try:
        if args.command == "demo":
            from stability.demo import run_demo

            run_demo(fault=args.fault, steps=args.steps, run_dir=args.run_dir)
            return 0
        if args.command == "postmortem":
            return _postmortem(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "profile":
            from stability.hooks.profiler import request_from_cli

            print(request_from_cli(args.run_id, args.steps, args.redis, args.run_dir))
            return 0
        if args.command == "replay":
            from stability.replay import replay

            results = replay(args.run_dir, args.redis, wait_s=args.wait)
            return 1 if any(r.refused for r in results) else 0
    except StabilityError as exc:
        print(f"stability: error: {_redacted(str(exc), argv)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``stability postmortem ... | head``): not an error to report
        _quiet_stdout()
        return 1
    return 1


def _redacted(message: str, argv: list[str]) -> str:
    """``message`` without the password of any URL-like argument (a malformed URL may be taken for a path)."""
    from stability.redis_url import scrub

    for arg in argv:
        if "@" in arg:
            message = scrub(message, arg)
    return message


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush to a closed pipe raises nothing."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _postmortem(args: argparse.Namespace) -> int:
    from stability import postmortem, report
    from stability.redis_source import is_redis_url

    sources: list[str] = args.source
    if len(sources) > 1 and any(is_redis_url(s) for s in sources):
        from stability.errors import SourceError

        raise SourceError("a Redis URL is a source of its own: give it alone")
    if is_redis_url(sources[0]):
        if args.baseline is not None:
            from stability.errors import SourceError

            raise SourceError("--baseline: not supported with a Redis source (give a run directory or a log)")
        result, json_out, html_out = postmortem.run_redis(sources[0], args.run_id, out_dir=args.out_dir,
                                                          json_out=args.json_out, html_out=args.html_out)
    else:
        averaged = {"auto": None, "yes": True, "no": False}[args.loss_averaged]
        source = Path(sources[0])
        json_default, html_default = postmortem.default_outputs(source, args.out_dir)
        json_out, html_out = args.json_out or json_default, args.html_out or html_default
        given = [Path(s) for s in sources] if len(sources) > 1 else source
        result = postmortem.run(given, json_out=json_out, html_out=html_out, run_id=args.run_id,
                                loss_averaged=averaged, system_logs=args.system_logs, baseline=args.baseline,
                                exact=args.exact)
    print(report.render_text(result))
    print(f"findings: {json_out}")
    print(f"report:   {html_out}")
    worst = result.worst()
    if args.fail_on is not None and worst is not None and SEVERITIES.index(worst) >= SEVERITIES.index(args.fail_on):
        print(f"stability: {worst} incident found (--fail-on {args.fail_on})", file=sys.stderr)
        return 1
    return 0


def _runs(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from stability import redis_source

    if not redis_source.is_redis_url(args.url):
        from stability.errors import SourceError

        raise SourceError(f"{redis_source.redact(args.url)}: not a redis://, rediss:// or unix:// URL")
    rows = redis_source.list_runs(args.url)
    if args.as_json:
        for row in rows:
            print(json.dumps(asdict(row)))
    elif rows:
        print(redis_source.format_table(rows))
    else:
        print(f"no runs in Redis at {redis_source.redact(args.url)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

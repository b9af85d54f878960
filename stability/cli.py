"""The ``stability`` command: ``demo``, ``worker``, ``postmortem``, ``eval``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from stability.errors import StabilityError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stability", description="Training-stability diagnosis.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny GPT with an injected fault and diagnose it live")
    from stability.demo import DEFAULT_FAULT, FAULTS

    demo.add_argument(
        "--fault", choices=FAULTS, default=DEFAULT_FAULT, help=f"fault to inject (default {DEFAULT_FAULT})"
    )
    demo.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    demo.add_argument("--run-dir", type=Path, default=None, help="run directory (default ./stability-runs/demo-...)")

    worker = sub.add_parser(
        "worker", help="run a Celery worker that diagnoses runs (uses STABILITY_REDIS_URL)", add_help=False
    )
    worker.add_argument("celery_args", nargs=argparse.REMAINDER, help="extra arguments passed to celery worker")

    sub.add_parser("eval", help="score the detectors on the labelled corpus (see docs/evaluation.md)", add_help=False)

    pm = sub.add_parser("postmortem", help="analyse a finished or failed run (run directory or CSV file)")
    pm.add_argument("source", type=Path, help="run directory or CSV file (column 'step' plus signal columns)")
    pm.add_argument("--json", dest="json_out", type=Path, default=None, help="write findings JSON here")
    pm.add_argument("--html", dest="html_out", type=Path, default=None, help="write a self-contained HTML report")
    pm.add_argument("--run-id", default=None, help="run id for a CSV source (default: the file name)")
    pm.add_argument("--loss-averaged", choices=("auto", "yes", "no"), default="auto",
                    help="each CSV loss is the mean over the log interval (Megatron, HF Trainer); auto: yes for "
                    "files with Megatron's consumed_samples and skipped_iters columns")
    return parser


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
    try:
        if args.command == "demo":
            from stability.demo import run_demo

            run_demo(fault=args.fault, steps=args.steps, run_dir=args.run_dir)
            return 0
        if args.command == "postmortem":
            return _postmortem(args)
    except StabilityError as exc:
        print(f"stability: error: {exc}", file=sys.stderr)
        return 2
    return 1


def _postmortem(args: argparse.Namespace) -> int:
    from stability import postmortem, report

    averaged = {"auto": None, "yes": True, "no": False}[args.loss_averaged]
    result = postmortem.run(args.source, json_out=args.json_out, html_out=args.html_out, run_id=args.run_id,
                            loss_averaged=averaged)
    print(report.render_text(result))
    if args.json_out:
        print(f"findings: {args.json_out}")
    if args.html_out:
        print(f"report:   {args.html_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``stability worker`` / ``python -m stability.worker``: run a Celery worker that takes part in the sweep.

Defaults: ``--pool solo`` (one process; the W&B sink keeps one diagnosis run per training run in it), INFO logging,
no gossip/mingle/heartbeat traffic. No Celery beat: every worker takes part in the sweep lease
(:class:`stability.worker.tasks.Sweeper`), so any worker takes over when the sweeping one dies; ``--no-beat`` keeps
a worker out of it (``STABILITY_SWEEPER=0``). Unknown arguments go to ``celery worker`` unchanged.

Settings are checked before Celery starts (issue 14 item 7): a bad variable or URL, a wrong password or a bad TLS
option ends the worker with one line naming the problem (password redacted) and exit code 2, instead of a traceback
or a "cannot connect" retried forever. Redis merely down is not an error: Celery waits for it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

from stability.errors import ConfigError

__all__ = ["main", "worker_argv"]

GC_THRESHOLDS = (50_000, 50, 100)
"""The worker's cyclic-GC thresholds (CPython's default is (700, 10, 10)). A worker holds long-lived detector state
of thousands of ranks: with the defaults, creating 8,000 ranks' suites ran 9 full collections over the growing heap
(~300 us of each new rank's first record, 473 vs 182 us; steady records unchanged at ~70 us, 11 signals). Detector
updates make little cyclic garbage, so collecting less often costs little memory."""

_DESCRIPTION = (
    "Run a Celery worker that diagnoses training runs. Redis (records and broker) comes from STABILITY_REDIS_URL "
    "(default redis://127.0.0.1:6379/0; redis+cluster://HOST:PORT for a Redis Cluster, which then needs a separate "
    "broker in STABILITY_BROKER_URL). Defaults: --pool solo, INFO logging; every worker may run the sweep (one at a "
    "time, by a Redis lease; --no-beat keeps this one out). Unknown options go to 'celery worker'."
)


def worker_argv(argv: list[str] | None = None) -> list[str]:
    """The ``celery`` argument list that :func:`main` runs for ``argv``."""
    parser = argparse.ArgumentParser(prog="stability worker", description=_DESCRIPTION)
    parser.add_argument("--pool", choices=("solo", "prefork"), default="solo", help="worker pool (default solo)")
    parser.add_argument("--concurrency", type=int, default=None, help="prefork processes (default: CPU count)")
    parser.add_argument("--loglevel", default="INFO", help="log level (default INFO)")
    parser.add_argument("--no-beat", action="store_true", help="never run the sweep in this worker")
    args, extra = parser.parse_known_args(argv)
    out = ["worker", "--pool", args.pool, "--loglevel", args.loglevel]
    out += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    if args.no_beat:
        os.environ["STABILITY_SWEEPER"] = "0"
    if args.concurrency is not None:
        out += ["--concurrency", str(args.concurrency)]
    return out + extra


def main(argv: list[str] | None = None) -> int:
    """Run the worker until it is stopped; return its exit status."""
    try:
        cmd = worker_argv(sys.argv[1:] if argv is None else argv)
        if not os.environ.get("STABILITY_REDIS_URL"):
            from stability.worker.app import DEFAULT_REDIS_URL

            print(f"stability worker: STABILITY_REDIS_URL is not set; using {DEFAULT_REDIS_URL} "
                  "(set STABILITY_REDIS_URL=redis://HOST:PORT/DB to use another server)", file=sys.stderr, flush=True)
        from stability.worker.app import app, settings

        _preflight(settings.client_url, "STABILITY_REDIS_URL")
        if settings.broker_url is not None and "://" not in settings.broker_url:
            # kombu would take it for an AMQP host name, and print it (password included) in every retry
            from stability.redis_url import safe_url

            raise ConfigError(f"STABILITY_BROKER_URL {safe_url(settings.broker_url)!r} is not a URL "
                              "(scheme://[user:password@]host:port/...)")
        if settings.broker_url is not None and settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
            _preflight(settings.broker_url, "STABILITY_BROKER_URL")
        gc.freeze()  # what the imports made (celery, numpy, ...) lives as long as the process: out of every collection
        gc.set_threshold(*GC_THRESHOLDS)
        app.worker_main(cmd)
    except ConfigError as exc:  # e.g. a Redis Cluster URL with no separate broker (STABILITY_BROKER_URL)
        print(f"stability worker: {exc}", file=sys.stderr, flush=True)
        return 2
    except ValueError as exc:  # a URL part only Celery/kombu parse (the broker's port, ...)
        print(f"stability worker: invalid setting: {_scrubbed(str(exc))}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def _preflight(url: str, name: str) -> None:
    """One round trip to ``url`` (named ``name``): raise :class:`ConfigError` for what retrying cannot fix."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from stability.redis_url import classify_error, connect, safe_url, scrub

    client: Any = None
    try:
        client = connect(url, socket_timeout=3.0, socket_connect_timeout=3.0, retry=Retry(NoBackoff(), 0))
        client.ping()
    except ConfigError as exc:
        raise ConfigError(f"{name} {str(exc).removeprefix('redis_url ')}") from None
    except Exception as exc:
        kind = classify_error(exc)
        if kind == "down":  # Celery retries the broker until Redis answers
            return
        what = {"auth": "authentication failed", "tls": "TLS setup failed"}.get(kind, "invalid client setting")
        raise ConfigError(f"{name}: Redis at {safe_url(url)}: {what} ({scrub(str(exc), url)})") from None
    finally:
        if client is not None:
            client.close()


def _scrubbed(message: str) -> str:
    from stability.redis_url import scrub

    for name in ("STABILITY_REDIS_URL", "STABILITY_BROKER_URL"):
        url = os.environ.get(name)
        if url:
            message = scrub(message, url)
    return message


if __name__ == "__main__":
    sys.exit(main())

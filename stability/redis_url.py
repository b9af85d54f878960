"""Redis URLs and clients: the one place that turns ``STABILITY_REDIS_URL`` into a redis-py client.

Accepted URLs:

* ``redis://[[user]:password@]host[:port][/db]`` and ``rediss://...`` (TLS): one Redis server;
* ``unix:///path/to/redis.sock[?db=N]`` (or kombu's spelling ``redis+socket:///path``): one server on a socket;
* ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]`` and ``rediss+cluster://...`` (TLS): a
  **Redis Cluster**. The listed nodes are only startup nodes (one reachable node is enough; list a few so a client
  that starts while one is down still finds the cluster); the client discovers the others and follows ``MOVED``
  redirections. Database 0 only (a cluster has no other).

The cluster is named in the URL rather than detected (``CLUSTER INFO``) because the client kind must be known
before the first round trip: the training side's emitter starts while Redis may be down (it spools), and a plain
client pointed at a cluster node would fail only later, with ``MOVED`` on the keys of every other node.

Every key of one run carries the ``{run}`` hash tag (:mod:`stability.keys`), so all of a run's keys live in one
hash slot: a run's MULTI/EXEC and Lua scripts touch that slot only, and different runs spread over the nodes.
Global keys (``keys.RUNS``) are never written in a run's transaction.

Imports redis lazily: importing this module (``stability.config`` does) costs nothing.
"""

from __future__ import annotations

import re
from typing import Any, TypeAlias

from stability.errors import ConfigError

RedisClient: TypeAlias = Any
"""A ``redis.Redis`` (bytes responses) or a ``redis.cluster.RedisCluster``: they share every command stability
sends. ``Any`` because this project's mypy treats redis-py as untyped (its inline annotations type each command as
``Awaitable[T] | T``)."""

__all__ = [
    "CLUSTER_SCHEMES",
    "SCHEMES",
    "RedisClient",
    "check_url",
    "connect",
    "classify_error",
    "down_errors",
    "is_cluster_url",
    "redis_py_url",
    "safe_url",
    "scrub",
]

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""URL prefixes that name a Redis Cluster."""
SCHEMES = ("redis://", "rediss://", "unix://", "redis+socket://", *CLUSTER_SCHEMES)
"""Every accepted URL prefix."""


def is_cluster_url(url: str) -> bool:
    """True if ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return url.startswith(CLUSTER_SCHEMES)


def check_url(url: str, what: str = "redis_url") -> None:
    """Raise :class:`~stability.errors.ConfigError` (naming ``what``) unless ``url`` is an accepted Redis URL."""
    if not url.startswith(SCHEMES):
        raise ConfigError(
            f"{what} {safe_url(url)!r} must start with redis://, rediss://, unix:// or redis+socket://, or with "
            "redis+cluster:// / rediss+cluster:// for a Redis Cluster"
        )
    if is_cluster_url(url):
        _cluster_parts(url, what)


def redis_py_url(url: str) -> str:
    """The redis-py spelling of a single-server URL: kombu's ``redis+socket://path`` becomes ``unix://path``."""
    prefix = "redis+socket://"
    return "unix://" + url[len(prefix) :] if url.startswith(prefix) else url


def connect(url: str, **kwargs: Any) -> RedisClient:
    """A redis-py client for ``url``: ``redis.Redis`` for one server, ``redis.cluster.RedisCluster`` for a cluster.

    ``kwargs`` go to the client (``socket_timeout``, ``retry``, ...); for a cluster they apply to the connection
    of every node. A cluster client contacts a startup node here, so this raises (``RedisClusterException``,
    see :func:`down_errors`) when none answers; a single-server client connects only on its first command.

    Raises:
        ConfigError: the URL is not an accepted Redis URL.
    """
    check_url(url)
    if not is_cluster_url(url):
        import redis

        try:
            return redis.Redis.from_url(redis_py_url(url), **kwargs)
        except ValueError as exc:
            raise ConfigError(f"redis_url {safe_url(url)!r} is invalid: {exc}") from None
    from redis.cluster import ClusterNode, RedisCluster

    first, others = _cluster_parts(url, "redis_url")
    nodes = [ClusterNode(host.strip("[]"), port) for host, port in others]
    return RedisCluster.from_url(first, startup_nodes=nodes, **kwargs)


def down_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "Redis (or the cluster) cannot be reached now", beyond ``ConnectionError``/``TimeoutError``.

    ``RedisClusterException`` (no startup node answers, slots not covered) is not a ``redis.RedisError``.
    """
    from redis.exceptions import ClusterDownError, RedisClusterException

    return (RedisClusterException, ClusterDownError)


def classify_error(exc: BaseException) -> str:
    """Why a Redis call failed: ``"auth"`` (wrong or missing password, no permission), ``"tls"`` (the TLS handshake
    or a TLS option), ``"config"`` (another client-side setting Redis never saw), or ``"down"`` (cannot reach it now).

    The first three will not get better by retrying: report them once, not as "Redis unavailable" all run.
    """
    import ssl

    from redis import exceptions as errors

    if isinstance(exc, errors.AuthenticationError | errors.AuthenticationWrongNumberOfArgsError):
        return "auth"
    text = str(exc)
    if isinstance(exc, errors.ResponseError):
        return "auth" if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")) else "down"
    causes = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(c, ssl.SSLError | ssl.CertificateError) for c in causes) or "SSL" in text or "certif" in text:
        return "tls"
    if isinstance(exc, errors.ConnectionError | errors.TimeoutError | OSError | errors.RedisClusterException):
        return "down"
    if isinstance(exc, errors.RedisError):
        return "config"
    return "down"


def safe_url(url: str) -> str:
    """``url`` without its password, for logs and messages; also for malformed URLs (issue 14 item 5).

    Everything between the scheme and the last ``@`` is user information: its part after the first ``:`` becomes
    ``***`` (all of it when it has no ``:``, since ``redis://s3cret@host`` may be a bare password), and
    ``password=`` query values become ``***``. The scheme need not be well formed (``redis//:s3cret@host``).
    """
    text = _QUERY_PASSWORD.sub(r"\1***", url)
    head, qmark, query = text.partition("?")
    at = head.rfind("@")
    if at < 0:
        return text
    start = _SCHEME_PREFIX.match(head)
    begin = start.end() if start else 0
    userinfo = head[begin:at]
    user, colon, _password = userinfo.partition(":")
    masked = f"{user}:***" if colon and "/" not in user else "***"
    return f"{head[:begin]}{masked}{head[at:]}{qmark}{query}"


def scrub(message: str, url: str) -> str:
    """``message`` with ``url`` and its password replaced by their redacted forms (error texts may quote either)."""
    message = message.replace(url, safe_url(url))
    head = url.partition("?")[0]
    at = head.rfind("@")
    if at >= 0:
        start = _SCHEME_PREFIX.match(head)
        userinfo = head[start.end() if start else 0 : at]
        secret = userinfo.partition(":")[2] or userinfo
        if len(secret) >= 3:
            message = message.replace(secret, "***")
    for match in _QUERY_PASSWORD.finditer(url):
        if len(match.group(2)) >= 3:
            message = message.replace(match.group(2), "***")
    return message


_SCHEME_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:?/*")
"""A scheme, well formed or not: ``redis://``, ``redis//``, ``redis:/``, ``unix:///``."""
_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)([^&#]*)")


def _cluster_parts(url: str, what: str) -> tuple[str, list[tuple[str, int]]]:
    """Split a cluster URL into a redis-py URL of its first node and the (host, port) of the other nodes."""
    scheme, rest = url.split("://", 1)
    plain = "rediss" if scheme == "rediss+cluster" else "redis"
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), ":", "6379")
        try:
            number = int(port)
        except ValueError:
            raise ConfigError(f"{what} {safe_url(url)!r}: node {item!r} has no valid port") from None
        if not host or not 0 < number < 65536:
            raise ConfigError(f"{what} {safe_url(url)!r}: node {item!r} is not host:port")
        nodes.append((host, number))
    if path not in ("", "0"):
        raise ConfigError(f"{what} {safe_url(url)!r}: a Redis Cluster has database 0 only, not {path!r}")
    first_host, first_port = nodes[0]
    auth = f"{userinfo}@" if userinfo else ""
    first = f"{plain}://{auth}{first_host}:{first_port}/0" + (f"?{query}" if query else "")
    return first, nodes[1:]

"""A Redis command packed once and sent many times (a shard drain's ``XREADGROUP`` over its 1,024 streams).

redis-py packs every argument of every call in Python: a shard of 1,024 ranks sends 2,048 stream names and ids per
read, ~15 % of a worker in the 16,384-rank load test (py-spy). :class:`PackedCommand` packs the arguments once and
sends the same bytes on each call, through the client's own connection pool, health check and reply parsing. A
client without a connection pool of that kind (a ``RedisCluster``) runs the command the ordinary way.
"""

from __future__ import annotations

from typing import Any

import redis

__all__ = ["PackedCommand"]


class PackedCommand:
    """``client.execute_command(*args)``, with ``args`` packed on the first call only."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self._packed: list[bytes] | None = None

    def __call__(self, client: Any) -> Any:
        if not isinstance(client, redis.Redis) or client.connection is not None:
            return client.execute_command(*self.args)
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            if self._packed is None:
                self._packed = conn.pack_command(*self.args)
            conn.send_packed_command(self._packed)
            return client.parse_response(conn, self.args[0])
        except (redis.ConnectionError, TimeoutError, redis.TimeoutError):
            conn.disconnect()
            return client.execute_command(*self.args)  # once more the ordinary way, with the client's retries
        finally:
            pool.release(conn)

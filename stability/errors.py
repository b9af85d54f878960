"""The one exception tree of stability.

::

    StabilityError
    ├── ConfigError      (also ValueError)  a bad setting or environment variable
    ├── RecordError      (also ValueError)  a malformed or oversized record / stream entry
    ├── SourceError      (also ValueError)  a post-mortem input that cannot be read (CSV, run dir)
    ├── TransportError                       Redis could not be reached or answered wrongly
    └── EmbeddedServerError                  the embedded redis-server could not be started

Every error message names the thing that was wrong (the field, the file, the URL).
"""

from __future__ import annotations


class StabilityError(Exception):
    """Base class of every error raised by stability."""


class ConfigError(StabilityError, ValueError):
    """A configuration value or environment variable is invalid."""


class RecordError(StabilityError, ValueError):
    """A record could not be encoded or decoded; the message names the offending field."""


class SourceError(StabilityError, ValueError):
    """A post-mortem source (CSV file, run directory) cannot be read."""


class TransportError(StabilityError):
    """Redis could not be reached, or answered something unexpected."""


class EmbeddedServerError(StabilityError):
    """The embedded redis-server could not be started or stopped."""

"""Failure kinds shared by the cores and the HTTP shell.

The cores raise these without knowing about HTTP; the shell maps each kind to one status code,
so a route never decides a status by itself and every failure leaves as `{"error": "..."}`.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request that cannot be served. `status` is the HTTP status the shell answers with."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """A well-formed value the service refuses (block_size 0, both tenant spellings differ...)."""

    status = 400


class MalformedRequest(ServiceError):
    """The request cannot be read at all: invalid JSON, broken body stream, bad query string."""

    status = 400


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class AlreadyRegistered(Conflict):
    """A registration for a worker (or rank) that is registered already, here or in another
    partition. Replicas that share one `--workers` list expect it of each other."""


class PayloadTooLarge(ServiceError):
    status = 413


class UnsupportedMediaType(ServiceError):
    status = 415


class InvalidShape(ServiceError):
    """Valid JSON of the wrong shape: missing field, wrong type, null, out-of-range integer."""

    status = 422



class Unavailable(ServiceError):
    """Something the request needs outside the process is unreachable (a replica's NATS server
    did not acknowledge a publish in time): nothing was done; the client may retry."""

    status = 503

"""One exception hierarchy for everything the agent (or this client) refuses.

Every error is an AgentError carrying the grpc.StatusCode of the refusal in
`code`; constructing AgentError(code, message) gives the subclass of that
code, so `except rdma_agent.NotFoundError` and `except AgentError` (then
`error.code`) both work. Mistakes in arguments, found before anything is
sent, are InvalidArgumentError, which is also a ValueError, or
ArgumentTypeError, also a TypeError; their messages name the call or op and
list the valid values.
"""

from __future__ import annotations

from typing import Iterable

import grpc

__all__ = [
    "AgentError", "ArgumentTypeError", "CancelledError", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError",
    "OutOfRangeError", "PermissionDeniedError", "ResourceExhaustedError", "UnavailableError",
    "status_code",
]

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a status number (UNKNOWN if it is not one)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class AgentError(Exception):
    """An RPC, attach-socket request or argument refused, with its gRPC code."""

    code: grpc.StatusCode
    message: str
    _by_code: dict[grpc.StatusCode, type[AgentError]] = {}
    _code: grpc.StatusCode | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls._code is not None and cls._code not in AgentError._by_code:
            AgentError._by_code[cls._code] = cls

    def __new__(cls, code: grpc.StatusCode, message: str) -> AgentError:
        if cls is AgentError:
            cls = AgentError._by_code.get(code, AgentError)
        return super().__new__(cls)

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (AgentError, (self.code, self.message))


class CancelledError(AgentError):
    _code = grpc.StatusCode.CANCELLED


class InvalidArgumentError(AgentError, ValueError):
    """INVALID_ARGUMENT: also a ValueError."""
    _code = grpc.StatusCode.INVALID_ARGUMENT


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type: INVALID_ARGUMENT, also a TypeError."""


class DeadlineExceededError(AgentError):
    _code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(AgentError):
    _code = grpc.StatusCode.NOT_FOUND


class PermissionDeniedError(AgentError):
    _code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(AgentError):
    _code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(AgentError):
    _code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRangeError(AgentError):
    _code = grpc.StatusCode.OUT_OF_RANGE


class InternalError(AgentError):
    _code = grpc.StatusCode.INTERNAL


class UnavailableError(AgentError):
    _code = grpc.StatusCode.UNAVAILABLE


def invalid(message: str) -> InvalidArgumentError:
    """An InvalidArgumentError (a ValueError) with `message`."""
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)


def wrong_type(what: str, value: object, expected: str) -> ArgumentTypeError:
    """An ArgumentTypeError (a TypeError): `what` is not `expected`."""
    return ArgumentTypeError(grpc.StatusCode.INVALID_ARGUMENT,
                             "%s must be %s, not %s" % (what, expected, type(value).__name__))


def one_of(what: str, value: object, valid: Iterable[str]) -> InvalidArgumentError:
    """An InvalidArgumentError naming `value` and the valid ones."""
    return invalid("%s %r is not one of %s" % (what, value, ", ".join(repr(v) for v in valid)))

"""Errors of the buffer package. Every error carries a short machine-readable `reason` (used as the
label of the bad-message / request-error counters and sent back to clients in error replies)."""
from __future__ import annotations


class BufferError(Exception):
    """Base class. `reason` is a short snake_case label, the message says what and where."""

    reason = "buffer_error"

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    def __reduce__(self):  # picklable whatever the subclass's __init__ takes (Ray ships errors)
        return (_restore, (type(self), str(self), dict(self.__dict__)))


def _restore(cls, message: str, state: dict) -> "BufferError":
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class SampleError(BufferError):
    """A sample or group violates the record contract; names the field and the sample."""

    reason = "bad_sample"

    def __init__(self, field: str, sample_id: str | None, message: str):
        self.field = field
        self.sample_id = sample_id
        where = f"sample {sample_id!r}" if sample_id is not None else "group"
        super().__init__(f"{where}, field {field!r}: {message}")


# Reasons a pushed group is refused for its own content (codec and size checks): pushed again it is
# refused again, so a worker quarantines its prompt instead of generating it forever.
GROUP_REFUSALS = frozenset({"bad_sample", "bad_group", "bad_frame_count", "bad_packed_group", "bad_protocol_version",
                            "oversized", "header_too_large", "msgpack_limit", "bad_msgpack"})


class ProtocolError(BufferError):
    """A message that is not a valid request or reply (framing, msgpack, protocol version, size)."""

    reason = "bad_message"


class RequestError(BufferError):
    """A well-formed request the buffer refuses (unknown permit, buffer full, conflicting push...)."""

    reason = "bad_request"


class LogFailed(RequestError):
    """The durable log could not write or sync a record: the request is not answered as a success
    and the buffer stops, to be restarted from its log (every later call raises this)."""

    reason = "log_failed"


class RemoteError(BufferError):
    """An error reply from the buffer service, re-raised on the client side with its reason."""

    reason = "remote_error"


class BufferUnavailable(BufferError):
    """The buffer service did not answer within the client's timeout and retries."""

    reason = "unavailable"

"""The staleness-bounded replay buffer: sample record and wire codec, η admission gate, store with
leases and a durable log, a ZMQ service and its client. Imports neither torch nor ray."""
from buffer.admission import AdmissionGate, Permit
from buffer.config import BufferConfig
from buffer.errors import BufferError, BufferUnavailable, ProtocolError, RemoteError, RequestError, SampleError
from buffer.sample import Group, PulledBatch, Sample

__all__ = [
    "AdmissionGate", "BufferConfig", "BufferError", "BufferUnavailable", "Group", "Permit", "ProtocolError",
    "PulledBatch", "RemoteError", "RequestError", "Sample", "SampleError",
]

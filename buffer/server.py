"""The buffer as a ZMQ service: one ROUTER socket, one thread, `BufferCore` behind it.

Requests are `[header, *payload]` (`buffer.codec`), header = {"v", "id", "op", "args"}; the reply
echoes "id" with {"ok": true, "result": ...} or {"ok": false, "error": {"reason", "message"}}.
Operations: acquire_permits, release_permit, filter_group, push_groups, pull_batch (which can first ack the
previous batch and set the version: a learner's step end and its next batch in one request),
ack (which can also set the version), nack, set_version, set_eta, recover, stats, health, snapshot (a
checkpoint's copy of the state: one payload frame, the records `restore` takes, msgpack-packed;
`serve --restore FILE` starts a fresh service from such a file).
acquire_permits and pull_batch long-poll: a request that cannot be served yet is parked until it
can or until its timeout, while the loop keeps serving others. A worker
takes the permits of one engine batch in one request and pushes their groups in one request
(one packed group per payload frame), which can also take its next permits (`next_permit_ids`,
no waiting): round trips, not bytes, are what a request costs.

Every bad message (garbage, truncated, oversized, wrongly typed, invalid sample) gets an error
reply and is counted by reason in `stats()["bad_messages"]` (refused but well-formed requests in
`stats()["request_errors"]`); nothing a client sends can stop the loop. The stats keys are listed
in `buffer.core`.

Binds to 127.0.0.1 by default, without keys: any local user may call every operation. Use CURVE
(`buffer.auth`, `curve.enabled`, with role folders) or `ipc_path` (a Unix socket in a 0700 folder)
where other local users are not trusted; a run's supervised service uses the ipc socket when CURVE
is off (`services.buffer_handle`), and hands the service a socket it holds (`--listen-fd`), so a
restart never frees the port or the path. What one client may take is bounded by `buffer.limits`.
    python -m buffer serve --config buffer.yaml        (or `etarl buffer serve ...`)
    python -m buffer keygen DIR
"""
from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
from collections import Counter
from dataclasses import dataclass

import msgpack
import zmq

from buffer import auth
from buffer.codec import check_frame_count, decode_message_header, encode_message, frames_nbytes
from buffer.config import BufferConfig
from buffer.core import BufferCore, PullResult
from buffer.errors import BufferError, LogFailed, ProtocolError, RequestError
from buffer.limits import ClientLimits

log = logging.getLogger(__name__)
LOG_FAILED_EXIT = 3  # the service's exit code when its durable log failed (each request got an error reply)
_MAX_LOOP_WAIT_S = 0.05  # the loop re-checks deadlines at least this often
_BATCH = 256  # messages handled before parked requests get another look
_MAX_PARKED = 4096  # long polls waiting at once; more are refused (a flood must not eat memory)
_MAX_IDS = 1024  # permits asked for, or groups pushed, in one request
_REQUIRED = object()


@dataclass
class _Parked:
    identity: bytes
    request_id: str
    args: dict
    start: float
    deadline: float


def _id_list(value) -> bool:
    return (isinstance(value, list) and 0 < len(value) <= _MAX_IDS
            and all(isinstance(i, str) and 0 < len(i) <= 256 for i in value))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_REASON = (lambda v: isinstance(v, str) and 0 < len(v) <= 4096, "a reason string (1 to 4096 chars)")
_ARG_TYPES = {
    "worker_id": (lambda v: isinstance(v, str), "a string"),
    "quarantine": _REASON,
    "reason": _REASON,
    "permit_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a string id"),
    "permit_ids": (_id_list, f"a list of 1 to {_MAX_IDS} string ids"),
    "next_permit_ids": (_id_list, f"a list of 1 to {_MAX_IDS} string ids"),
    "lease_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a string id"),
    "ack_lease_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a string id"),
    "timeout": (lambda v: _number(v) and 0 <= v <= 86400, "seconds in [0, 86400]"),
    "batch_size": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "version": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "eta": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "failed": (lambda v: isinstance(v, bool), "a bool"),
}
_OP_ARGS = {
    "acquire_permits": {"worker_id": _REQUIRED, "timeout": 0.0, "permit_ids": _REQUIRED},
    "release_permit": {"permit_id": _REQUIRED, "quarantine": None},
    "filter_group": {"permit_id": _REQUIRED, "reason": _REQUIRED},
    "push_groups": {"permit_ids": _REQUIRED, "worker_id": None, "next_permit_ids": None},
    "pull_batch": {"batch_size": _REQUIRED, "timeout": 0.0, "lease_id": None, "ack_lease_id": None, "version": None},
    "ack": {"lease_id": _REQUIRED, "version": None},
    "nack": {"lease_id": _REQUIRED, "failed": False},
    "set_version": {"version": _REQUIRED},
    "set_eta": {"eta": None},
    "recover": {"version": _REQUIRED},
    "stats": {},
    "health": {},
    "snapshot": {},
}


def parse_args(op: str, args) -> dict:
    """Check a request's arguments against the op's signature; ProtocolError('bad_args') names the problem."""
    if not isinstance(args, dict):
        raise ProtocolError(f"{op}: args must be a map, got {type(args).__name__}", "bad_args")
    spec = _OP_ARGS[op]
    unknown = sorted(set(args) - set(spec), key=str)
    if unknown:
        raise ProtocolError(f"{op}: unknown arguments {unknown}", "bad_args")
    out = {}
    for name, default in spec.items():
        value = args.get(name, default)
        if value is _REQUIRED or value is None and default is _REQUIRED:  # a null is no value
            raise ProtocolError(f"{op}: missing argument {name!r}{' (null)' if value is None else ''}", "bad_args")
        check, what = _ARG_TYPES[name]
        if value is not None and not check(value):
            raise ProtocolError(f"{op}: argument {name!r} must be {what}, got {value!r:.60}", "bad_args")
        out[name] = value
    return out


class BufferServer:
    def __init__(self, config: BufferConfig, core: BufferCore | None = None, listen_fd: int | None = None):
        """`listen_fd`: a bound, listening socket (tcp or Unix) to serve on instead of binding one:
        the supervisor's, held across restarts (ZMQ_USE_FD)."""
        if config.ipc_path is not None and listen_fd is None:
            auth.check_private_dir(config.ipc_path.parent)
        self.config = config
        self.core = core or BufferCore(config)
        self._limits = ClientLimits(config.per_client, config.max_version_jump, self.core.clock)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.router_mandatory = 1  # a reply to a gone client fails instead of vanishing
        # A hard cap far above the checked limit, so oversized messages normally get an error reply.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 * config.limits.max_message_bytes)
        # With role folders, each request is checked against its client key's role (auth.ROLE_OPS).
        self._authenticator, self._roles = (auth.configure_server(self.socket, config.curve) if config.curve.enabled
                                            else (None, None))
        if listen_fd is not None:
            self.socket.setsockopt(zmq.USE_FD, listen_fd)
            self.socket.bind(config.endpoint)
        elif config.port == 0 and config.ipc_path is None:
            self.socket.bind_to_random_port(f"tcp://{config.host}")
        else:
            self.socket.bind(config.endpoint)
        self.endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._acquires: list[_Parked] = []
        self._pulls: list[_Parked] = []
        # A plain flag, not an Event: a signal handler sets it (`main`), and Event.set takes a lock
        # that a second signal arriving inside the first handler's set() would wait on for ever.
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._handlers = {
            "acquire_permits": self._acquire, "release_permit": self._release, "filter_group": self._filter,
            "push_groups": self._push,
            "pull_batch": self._pull, "ack": self._ack, "nack": self._nack, "set_version": self._set_version,
            "recover": self._recover, "stats": self._stats, "health": self._health, "set_eta": self._set_eta,
            "snapshot": self._snapshot,
        }

    # ---- loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while not self._stopping:
                if poller.poll(self._poll_timeout_ms()):
                    for _ in range(_BATCH):
                        try:
                            frames, role, principal = self._receive()
                        except zmq.Again:
                            break
                        self._handle(frames, role, principal)
                try:
                    self.core.tick()
                    self._serve_parked()
                except LogFailed:
                    pass  # the core has stopped (`core.failed`): so does the loop, below
                if self.core.failed is not None:  # fail stop: the supervisor restarts it from the log
                    log.critical("buffer: the durable log failed, the service stops (exit code %d): %s",
                                 LOG_FAILED_EXIT, self.core.failed)
                    break
        finally:
            self._close()

    def start(self) -> "BufferServer":
        """Serve in a background thread (tests, benchmarks, in-process use)."""
        self._thread = threading.Thread(target=self.serve_forever, name="buffer-server", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """End the loop at its next turn (at most `_MAX_LOOP_WAIT_S`); safe in a signal handler."""
        self._stopping = True

    def stop(self, timeout: float = 5.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _close(self) -> None:
        self.socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.context.term()
        self.core.close()

    def _poll_timeout_ms(self) -> int:
        deadlines = [p.deadline for p in self._acquires + self._pulls]
        now = self.core.clock()
        wait = min([_MAX_LOOP_WAIT_S, *(d - now for d in deadlines)])
        return max(0, int(wait * 1000))

    # ---- one message ------------------------------------------------------------------------

    def _receive(self) -> tuple[list, str | None, str]:
        """The next message (identity as bytes, the other frames as views into the received
        messages: a pushed group is stored and logged without a copy), its client's role
        (None: no roles configured, every op allowed) and its principal (the client's public key,
        or "" without role folders: keyless clients share one version budget). A role is read
        from the message's ZAP User-Id (the client's public key)."""
        frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        views = [frames[0].bytes, *(f.buffer for f in frames[1:])]
        if self._roles is None:
            return views, None, ""
        user = frames[-1].get("User-Id") or ""
        return views, self._roles.get(user.encode(), ""), user

    def _handle(self, frames: list[bytes], role: str | None = None, principal: str = "") -> None:
        identity, request_id = frames[0], None
        try:
            if len(frames) < 2:
                raise ProtocolError("empty message (no header frame)", "bad_envelope")
            size = frames_nbytes(frames) - len(identity)
            if size > self.config.limits.max_message_bytes:
                raise ProtocolError(f"message of {size} bytes exceeds max_message_bytes="
                                    f"{self.config.limits.max_message_bytes}", "oversized")
            check_frame_count(len(frames) - 1, self.config.limits)  # the identity frame is ZMQ's, not the client's
            header = decode_message_header(frames[1], ("id", "op", "args"), self.config.limits)
            request_id = header["id"] if isinstance(header["id"], str) else None
            op = header["op"]
            if not isinstance(op, str) or op not in self._handlers:
                raise ProtocolError(f"unknown op {op!r:.60}", "unknown_op")
            if role is not None and not auth.role_allows(role, op):
                raise RequestError(f"{op}: forbidden for a client of role {role or 'none'!r} "
                                   f"(see buffer.auth.ROLE_OPS)", "forbidden")
            args = parse_args(op, header["args"])
            if op != "push_groups" and len(frames) > 2:
                raise ProtocolError(f"{op} takes no payload frames, got {len(frames) - 2}", "bad_frame_count")
            rise, acks = self._version_move(op, args)
            self._limits.check_version_rise(principal, rise, acks)
            reply = self._handlers[op](identity, request_id, args, frames[2:])
            if rise > 0 or acks:
                self._limits.spend_version_rise(principal, rise, acks)
            if reply is not None:
                self._deliver(identity, request_id, op, *reply)
        except BufferError as exc:
            self.core.count_bad_message(exc)
            self._error(identity, request_id, exc.reason, str(exc))
        except Exception as exc:  # a bug must cost one request, not the service
            log.exception("buffer: internal error handling a request")
            self.core.count_bad_message(ProtocolError(str(exc), "internal"))
            self._error(identity, request_id, "internal", f"{type(exc).__name__}: {exc}")

    def _send(self, identity: bytes, message: list) -> bool:
        try:
            self.socket.send_multipart([identity, *message], flags=zmq.NOBLOCK, copy=False)  # big frames by reference
            return True
        except zmq.ZMQError:  # the client is gone (EHOSTUNREACH) or not reading (EAGAIN)
            return False

    def _deliver(self, identity: bytes, request_id, op: str, result, payload=()) -> None:
        """Send a result; a permit or lease that cannot reach its client is handed back at once
        (the client's retry, if any, gets it again by its id)."""
        message = encode_message({"id": request_id, "ok": True, "result": result}, payload)
        if self._send(identity, message) or result is None:
            return
        if op in ("acquire_permits", "push_groups"):
            for permit in result if op == "acquire_permits" else result["permits"]:
                self.core.release_permit(permit["permit_id"])
        elif op == "pull_batch":
            self.core.nack(result["lease_id"])

    def _error(self, identity: bytes, request_id, reason: str, message: str) -> None:
        header = {"id": request_id, "ok": False, "error": {"reason": reason, "message": message[:2000]}}
        self._send(identity, encode_message(header))

    # ---- operations -------------------------------------------------------------------------

    def _version_move(self, op: str, args: dict) -> tuple[int, int]:
        """(how far a request raises the learner version, the batches it acks): what the
        per-client version budget checks. A fresh buffer may be recovered to any version."""
        gate = self.core.gate
        lease = args.get("ack_lease_id") if op == "pull_batch" else args.get("lease_id") if op == "ack" else None
        acks = int(lease is not None and lease in self.core.store.leases)  # a retried ack earns nothing
        version = args.get("version") if op in ("set_version", "ack", "pull_batch", "recover") else None
        if version is None or (op == "recover" and not (gate.version or gate.accepted or gate.permits)):
            return 0, acks
        return version - gate.version, acks

    def _park(self, queue: list, identity, request_id, args) -> None:
        if len(self._acquires) + len(self._pulls) >= _MAX_PARKED:
            raise RequestError(f"{_MAX_PARKED} requests are already waiting; retry later", "too_many_waiting")
        self._limits.check_park(identity)
        self._limits.parked[identity] += 1
        now = self.core.clock()
        queue.append(_Parked(identity, request_id, args, now, now + args["timeout"]))

    def _grant(self, identity: bytes, worker_id, permit_ids: list[str]) -> list:
        """Permits for a connection, within its per-client cap."""
        held = self.core.gate.permits
        permits = self.core.try_acquire_many(worker_id, self._limits.permit_ids(identity, permit_ids, held))
        self._limits.granted(identity, permits, held)
        return permits

    def _acquire(self, identity, request_id, args, _payload):
        permits = self._grant(identity, args["worker_id"], args["permit_ids"])
        if not permits and args["timeout"] > 0:
            self._park(self._acquires, identity, request_id, args)
            self.core.start_gate_wait()
            return None
        self.core.finish_gate_wait(bool(permits))
        return [p.to_dict() for p in permits],

    def _release(self, identity, request_id, args, _payload):
        return self.core.release_permit(args["permit_id"], args["quarantine"]),

    def _filter(self, identity, request_id, args, _payload):
        return self.core.filter_group(args["permit_id"], args["reason"]),

    def _push(self, identity, request_id, args, payload):
        if len(payload) != len(args["permit_ids"]):
            raise ProtocolError(f"push_groups takes one packed group frame per permit id ({len(args['permit_ids'])}), "
                                f"got {len(payload)} frames", "bad_frame_count")
        if args["next_permit_ids"] is None:
            return {"results": self.core.push_groups(payload, args["permit_ids"]), "permits": []},
        if args["worker_id"] is None:
            raise ProtocolError("push_groups: next_permit_ids needs worker_id", "bad_args")
        held, refused = self.core.gate.permits, None
        try:
            next_ids = self._limits.permit_ids(identity, args["next_permit_ids"], held, ending=args["permit_ids"])
        except RequestError as exc:  # the push goes ahead; only its next permits are refused
            next_ids, refused = [], exc
        results, permits = self.core.push_and_acquire(payload, args["permit_ids"], args["worker_id"], next_ids)
        self._limits.granted(identity, permits, held)
        if refused is not None:
            self.core.count_bad_message(refused)
        return {"results": results, "permits": [p.to_dict() for p in permits]},

    def _pull(self, identity, request_id, args, _payload):
        # the ack (if any) happens now, once; a parked request only pulls
        result = self.core.pull_batch(args["batch_size"], 0.0, args["lease_id"], args["ack_lease_id"], args["version"])
        if result is None and args["timeout"] > 0:
            self._park(self._pulls, identity, request_id, args)
            return None
        return self._pull_reply(result)

    @staticmethod
    def _pull_reply(result: PullResult | None):
        if result is None:
            return None, ()
        meta = {"lease_id": result.lease_id, "dropped_stale": result.dropped_stale, "version": result.version,
                "prompts_quarantined": result.prompts_quarantined, "groups_filtered": result.groups_filtered}
        return meta, result.groups  # one packed group per frame

    def _ack(self, identity, request_id, args, _payload):
        return self.core.ack(args["lease_id"], args["version"]),

    def _nack(self, identity, request_id, args, _payload):
        return self.core.nack(args["lease_id"], args["failed"]),

    def _set_version(self, identity, request_id, args, _payload):
        self.core.set_version(args["version"])
        return None,

    def _set_eta(self, identity, request_id, args, _payload):
        self.core.set_eta(args["eta"])
        return None,

    def _recover(self, identity, request_id, args, _payload):
        self.core.recover(args["version"])
        return None,

    def _stats(self, identity, request_id, args, _payload):
        return self.core.stats(),

    def _health(self, identity, request_id, args, _payload):
        return self.core.health(),

    def _snapshot(self, identity, request_id, args, _payload):
        return {}, [self.core.checkpoint_state()]

    # ---- parked long polls ------------------------------------------------------------------

    def _serve_parked(self) -> None:
        now = self.core.clock()
        still, gate_open = [], True
        for p in self._acquires:
            # capacity is shared: after one refusal the others only need their deadlines checked
            try:
                permits = self._grant(p.identity, p.args["worker_id"], p.args["permit_ids"]) if gate_open else []
            except RequestError as exc:  # its connection took permits meanwhile (another socket's request)
                self._error(p.identity, p.request_id, exc.reason, str(exc))
                self.core.finish_gate_wait(False, p.start)
                self.core.count_bad_message(exc)
                continue
            gate_open = bool(permits)
            if not permits and now < p.deadline:
                still.append(p)
                continue
            self.core.finish_gate_wait(bool(permits), p.start)
            self._deliver(p.identity, p.request_id, "acquire_permits", [q.to_dict() for q in permits])
        self._acquires = still
        still = []
        for p in self._pulls:
            try:
                result = self.core.pull_batch(p.args["batch_size"], 0.0, p.args["lease_id"])
            except BufferError as exc:
                self._error(p.identity, p.request_id, exc.reason, str(exc))
                continue
            if result is None and now < p.deadline:
                still.append(p)
                continue
            self._deliver(p.identity, p.request_id, "pull_batch", *self._pull_reply(result))
        self._pulls = still
        self._limits.parked = Counter(p.identity for p in self._acquires + self._pulls)


# ---- command line ---------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """`python -m buffer serve --config X.yaml` | `python -m buffer keygen DIR`; `etarl buffer` delegates here."""
    parser = argparse.ArgumentParser(prog="etarl buffer", description="the staleness-bounded replay buffer service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the buffer service")
    serve.add_argument("--config", help="buffer config YAML (or a run config with a `buffer:` section)")
    serve.add_argument("--port", type=int, help="override the port (0 = any free port)")
    serve.add_argument("--listen-fd", type=int, help="serve on this inherited, listening socket (the run's "
                       "supervisor holds it across restarts) instead of binding host:port or ipc_path")
    serve.add_argument("--restore", metavar="FILE", help="start from this state (a `snapshot` reply as written to a "
                       "run's checkpoint, buffer.msgpack): the service must be fresh (a durable log is rewritten to "
                       "hold it)")
    serve.add_argument("--log-level", default="INFO")
    keygen = sub.add_parser("keygen", help="write the CURVE server key pair (unless DIR has one) and a client "
                            "key pair per role, authorized under DIR/authorized_clients/<role>/")
    keygen.add_argument("dir")
    keygen.add_argument("--role", choices=sorted(auth.ROLE_OPS), help="one client key of this role (default: one per role)")
    keygen.add_argument("--name", help="the client key's file name (with --role; default: the role)")
    args = parser.parse_args(argv)
    if args.command == "keygen":
        if args.name and not args.role:
            parser.error("--name needs --role")
        roles = (args.role,) if args.role else tuple(auth.ROLE_OPS)
        for name, path in auth.keygen(args.dir, roles, args.name).items():
            print(f"{name}: {path}")
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = BufferConfig.from_yaml(args.config) if args.config else BufferConfig()
        if args.port is not None:
            config = config.model_copy(update={"port": args.port})
        server = BufferServer(config, listen_fd=args.listen_fd)
        if args.restore:
            with open(args.restore, "rb") as state:
                server.core.restore(msgpack.unpackb(state.read(), raw=False))
    except (OSError, ValueError, zmq.ZMQError, LogFailed, RequestError) as exc:  # ValueError: a corrupt log too
        print(f"etarl buffer serve: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    if not config.curve.enabled and config.ipc_path is None:
        log.warning("buffer: serving on %s without keys: any local user may call every operation (set curve.enabled "
                    "with authorized_clients_dir, or ipc_path in a 0700 folder)", server.endpoint)
    print(f"buffer serving on {server.endpoint} (curve={'on' if config.curve.enabled else 'off'}, "
          f"durable={'on' if config.log.path else 'off'})", flush=True)
    server.serve_forever()
    return LOG_FAILED_EXIT if server.core.failed is not None else 0

"""What one client of the buffer service may take (`buffer.config.PerClientLimits`).

The shared limits (the gate's `max_concurrent`, the server's 4,096 parked requests, the store's
capacity) bound the buffer; these bound one client, so a greedy or hostile one cannot take it from
the others:
- permits held and long polls parked, per connection (its ZMQ routing identity);
- the learner version's rise, per principal (a CURVE key with role folders; without, every keyless
  client together, since a client that reconnects must not get a fresh budget): a token bucket of
  `max_version_jump` tokens, refilled at `version_rate_per_s` and by one token per batch the
  principal acks. The learner moves one version per consumed batch, so its pace never runs dry;
  a client that only calls set_version gets `max_version_jump` at once and the rate after that.
Every refusal is a `RequestError` (too_many_permits, too_many_waiting, version_jump), which the
server answers and counts in `stats()["request_errors"]`. Plain state: the server's one thread owns it.
"""
from __future__ import annotations

from collections import Counter

from buffer.config import PerClientLimits
from buffer.errors import RequestError


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float):
        self.tokens, self.at = tokens, at


class ClientLimits:
    def __init__(self, limits: PerClientLimits, max_version_jump: int, clock):
        self.limits = limits
        self.burst = float(max_version_jump)
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}  # principal -> its version tokens
        self._permits: dict[bytes, set[str]] = {}  # connection -> ids of the permits granted to it
        self._tracked = 0
        self.parked: Counter = Counter()  # connection -> long polls parked

    # ---- permits ----------------------------------------------------------------------------

    def permit_ids(self, identity: bytes, permit_ids: list[str], held: dict, ending=()) -> list[str]:
        """The ids of a request that this connection may be granted: those already granted (a
        retried request) and new ones while it holds fewer than max_permits. `held` is the gate's
        permits by id; `ending`: permits the same request pushes first (they no longer count).
        Raises too_many_permits when none may be."""
        mine = self._permits.get(identity)
        if mine is not None:
            mine.intersection_update(held)  # consumed, released, reclaimed: no longer held
        room = self.limits.max_permits - (len(mine - set(ending)) if mine else 0)
        allowed = []
        for permit_id in permit_ids:
            if permit_id in held:
                allowed.append(permit_id)
            elif room > 0:
                allowed.append(permit_id)
                room -= 1
        if not allowed:
            raise RequestError(f"this client holds {len(mine or ())} permits (per_client.max_permits="
                               f"{self.limits.max_permits}); push or release some first", "too_many_permits")
        return allowed

    def granted(self, identity: bytes, permits, held: dict) -> None:
        if not permits:
            return
        self._permits.setdefault(identity, set()).update(p.permit_id for p in permits)
        self._tracked += len(permits)
        if self._tracked > 4 * len(held) + 1024:  # connections that went away: forget their ended permits
            for key in list(self._permits):
                self._permits[key].intersection_update(held)
                if not self._permits[key]:
                    del self._permits[key]
            self._tracked = sum(len(s) for s in self._permits.values())

    # ---- parked long polls ------------------------------------------------------------------

    def check_park(self, identity: bytes) -> None:
        if self.parked[identity] >= self.limits.max_waiting:
            raise RequestError(f"this client has {self.parked[identity]} requests waiting (per_client.max_waiting="
                               f"{self.limits.max_waiting}); retry when one is answered", "too_many_waiting")

    # ---- the version ------------------------------------------------------------------------

    def _bucket(self, principal: str) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(principal)
        if bucket is None:
            bucket = self._buckets[principal] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.limits.version_rate_per_s)
        bucket.at = now
        return bucket

    def check_version_rise(self, principal: str, rise: int, acks: int = 0) -> None:
        """Refuse a version rise beyond the principal's tokens (with the batch acked in the same
        request counted first)."""
        if rise <= 0:
            return
        available = min(self.burst, self._bucket(principal).tokens + acks)
        if rise > available:
            raise RequestError(
                f"version +{rise} refused: this client may raise the version by {int(available)} now (at most "
                f"max_version_jump={int(self.burst)} at once, then {self.limits.version_rate_per_s:g} per second "
                f"and one per batch it acks: per_client.version_rate_per_s)", "version_jump")

    def spend_version_rise(self, principal: str, rise: int, acks: int = 0) -> None:
        """A request that moved the version by `rise` (and acked `acks` batches) succeeded."""
        bucket = self._bucket(principal)
        bucket.tokens = min(self.burst, bucket.tokens + acks) - max(0, rise)

"""The cluster's reload protocol, without Ray: who decides which version the cluster serves, and how every part
comes to serve it (`cfir_jax.cluster.deployments` runs these classes on Ray; the tests drive them with fake replicas
and a fake clock).

A version is named by its id, `version_id(N, fingerprint)`: index.json's number and the digest of every store's
manifest. A restored or rebuilt workdir whose number went down is a new id, never mistaken for the one it replaced.
The workdir holds its newest version only: a part can load the committed version, and no other.

- **One decider.** The command's process (`Coordinator`) alone chooses the cluster's `Target`: a generation (one
  more per accepted reload, so the order never depends on version numbers) and a version id. A reload reads the
  committed id and, unless it is served already, checks it once (complete, every byte verified, the model of the
  cluster's family), asks every shard to load it (`Shards.prepare`: a replica loads it in the background, never in a
  request), and only then publishes the new target. A reload that fails leaves the target as it was, is one line,
  and never raises. One runs at a time: another asked meanwhile is refused (an operator's) or waits (SIGHUP, a part's
  ask) and changes nothing of the running one.
- **A mailbox.** The `Relay` (a Ray actor) holds the published target, the fronts' reports and the parts' asks.
  It keeps nothing that the command does not publish again at its next tick: a relay that restarted empty is whole
  again within a tick, and an ask it lost is asked again.
- **Fronts follow** (`cfir_jax.cluster.follow.Follower`). Each front reports what it serves every second and
  reloads its own side to a newer target; one that fails tries again later (2, 4, ... up to 30 s), keeps serving
  what it has meanwhile, and after STUCK_S of failures reports itself unhealthy (Ray then replaces it). A front
  started (or restarted) serves the target, never the workdir unchecked.
- **Shards load what the workdir holds** (`cfir_jax.cluster.follow.ShardVersions`). A shard replica loads a version
  when asked for it (Ray Serve's model multiplexing routes requests by version and keeps the last two) and only
  when the workdir holds it; asked for one that is gone (`VersionGone`: it restarted after a commit), it refuses,
  and the front that asked asks for a reload: the command checks the committed version and, once it passes, the
  cluster serves it. That is how the service recovers by itself, with no SIGHUP, when a replica restarts after
  `index.py --add` or `--remove` committed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from cfir_jax.core.errors import CfirError, first_line

FRONT_PERIOD_S = 1.0  # a front reports and reads the target this often
FRONT_EXPIRY_S = 10.0  # a front silent this long is gone: a reload no longer waits for it
FOLLOW_RETRY_MAX_S = 30.0  # a failed follow is tried again after 2, 4, 8 ... periods, at most this long
STUCK_S = 120.0  # a front that failed to follow the target this long is unhealthy (Ray replaces it)
ASK_AGAIN_S = 5.0  # a part asks for a reload past a version it found gone at most this often
KEPT_OUTCOMES = 256  # settled outcomes the relay keeps for their askers


def version_id(version: int, fingerprint: str) -> str:
    """The id of a version of a workdir: '7:3f2a...' (index.json's number, then the stores' digest)."""
    return f"{int(version)}:{fingerprint}"


def version_number(vid: str) -> int:
    """The index.json number of a version id ('7:3f2a...' -> 7; 0 for none)."""
    return int(vid.split(":", 1)[0]) if vid else 0


class VersionGone(CfirError):
    """A version asked for that the workdir no longer holds (it holds its newest only)."""

    def __init__(self, asked: str, current: str, where: str = ""):
        self.asked, self.current, self.where = asked, current, where
        super().__init__(f"{where}version {version_number(asked)} ({asked}) is no longer in the workdir, which holds "
                         f"version {version_number(current)} ({current})")

    def __reduce__(self):  # sent between processes (a shard replica's refusal reaches its front)
        return VersionGone, (self.asked, self.current, self.where)


@dataclasses.dataclass(frozen=True)
class Target:
    """What the cluster serves: the version id, and the generation that orders targets (one more per reload)."""

    generation: int
    vid: str

    @property
    def version(self) -> int:
        return version_number(self.vid)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A reload's result: ok, its one line, the target after it."""

    ok: bool
    line: str
    target: Target | None = None


@dataclasses.dataclass(frozen=True)
class Ask:
    """A reload asked of the command: by an operator (`admin`, answered with its Outcome) or by a part that found the
    served version `seen` gone (`gone`)."""

    ticket: str
    kind: str  # "admin" or "gone"
    seen: str  # the version id the asker serves
    why: str = ""


class Workdir(Protocol):
    """The command's view of the workdir."""

    def current(self) -> str:
        """The committed version's id."""

    def check(self, vid: str) -> None:
        """CfirError unless the committed version is complete, intact and of the cluster's model family."""


class Shards(Protocol):
    """The command's view of the index shards."""

    def prepare(self, vid: str, timeout_s: float) -> None:
        """Returns once every shard holds `vid` (loaded beside what it serves); CfirError when one cannot."""


class Relay:
    """The mailbox between the command and the fronts (a Ray actor): the published target, the fronts' reports and
    the reloads asked. It holds nothing the command does not publish again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.current: Target | None = None
        self.reports: dict[str, tuple[Target | None, str, float]] = {}  # front -> (serving, last error, at)
        self.asks: list[Ask] = []
        self.taken: set[str] = set()  # tickets the command is working on
        self.outcomes: dict[str, Outcome] = {}

    def publish(self, target: Target) -> None:
        if self.current is None or target.generation >= self.current.generation:
            self.current = target

    def target(self) -> Target | None:
        return self.current

    def report(self, front: str, serving: Target | None, error: str = "") -> Target | None:
        """A front's report: what it serves, why its last follow failed ('' when it did not). Returns the target."""
        self.reports[front] = (serving, error, self.clock())
        return self.current

    def fronts(self) -> dict[str, tuple[Target | None, str]]:
        """The live fronts (reported within FRONT_EXPIRY_S): {front: (serving, last error)}."""
        now = self.clock()
        return {f: (t, e) for f, (t, e, at) in self.reports.items() if now - at <= FRONT_EXPIRY_S}

    def ask(self, kind: str, seen: str, why: str = "") -> str:
        ticket = uuid.uuid4().hex
        self.asks.append(Ask(ticket, kind, seen, why))
        return ticket

    def take(self) -> list[Ask]:
        asks, self.asks = self.asks, []
        self.taken |= {a.ticket for a in asks}
        return asks

    def settle(self, ticket: str, outcome: Outcome) -> None:
        self.taken.discard(ticket)
        self.outcomes[ticket] = outcome
        while len(self.outcomes) > KEPT_OUTCOMES:
            self.outcomes.pop(next(iter(self.outcomes)))

    def outcome(self, ticket: str) -> Outcome | None:
        """The asked reload's outcome, None while it waits or runs; a ticket this relay never saw (it restarted
        meanwhile) is a failed outcome that says so."""
        if ticket in self.outcomes:
            return self.outcomes.pop(ticket)
        if ticket in self.taken or any(a.ticket == ticket for a in self.asks):
            return None
        return Outcome(False, "the reload was lost (the cluster's relay restarted): ask again")


class Coordinator:
    """The command's decision of what the cluster serves (module docstring). target: what it serves at start."""

    def __init__(self, workdir: Workdir, shards: Shards, relay, target: Target,
                 prepare_timeout_s: float = 900.0, clock: Callable[[], float] = time.monotonic):
        self.workdir, self.shards, self.relay, self.target = workdir, shards, relay, target
        self.prepare_timeout_s = prepare_timeout_s
        # version id -> (why it was refused, whether for good: its check failed, not a shard's load), and when
        self.refused: dict[str, tuple[str, bool, float]] = {}
        self.clock = clock
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._lock.locked()

    def reload(self, why: str, explicit: bool = True) -> Outcome:
        """Checks the committed version and makes it the target once every shard holds it. explicit: asked by an
        operator (SIGHUP, POST /v1/admin/reload), who may ask again for a version refused before; a part's ask
        (explicit False) never checks again a version already refused, so nothing loops. Never raises."""
        if not self._lock.acquire(blocking=False):
            return Outcome(False, f"reload: refused ({why}): a reload is already running", self.target)
        try:
            return self._reload(why, explicit)
        except Exception as e:  # noqa: BLE001 - whatever failed, the target stays and the command serves on
            return Outcome(False, f"reload: failed ({why}), still serving version {self.target.version}: "
                                  f"{first_line(e)}", self.target)
        finally:
            self._lock.release()

    def _reload(self, why: str, explicit: bool) -> Outcome:
        old = self.target
        disk = self.workdir.current()
        if disk == old.vid:
            return Outcome(True, f"reload: version {old.version} is served already ({why})", old)
        if not explicit and self.refuses(disk):
            return Outcome(False, f"reload: refused ({why}), still serving version {old.version}: version "
                                  f"{version_number(disk)} was refused: {self.refused[disk][0]}", old)
        try:
            self.workdir.check(disk)
        except Exception as e:  # noqa: BLE001 - this version fails its checks: a part's ask never checks it again
            return self._refuse(disk, why, e, for_good=True)
        try:
            self.shards.prepare(disk, self.prepare_timeout_s)
            if self.workdir.current() != disk:
                raise CfirError("the workdir changed while the reload checked it; reload again when index.py is done")
        except Exception as e:  # noqa: BLE001 - a shard could not load it (now): a part's ask may try again later
            return self._refuse(disk, why, e, for_good=False)
        self.refused.pop(disk, None)
        self.target = Target(old.generation + 1, disk)
        try:
            self.relay.publish(self.target)
        except Exception:  # noqa: BLE001 - the command's next tick publishes it again
            pass
        return Outcome(True, f"reload: version {old.version} -> {self.target.version} ({why}): checked and held by "
                             "every shard; the fronts follow", self.target)

    def refuses(self, disk: str) -> bool:
        """Whether a part's ask would be refused without a check: `disk` failed its checks before, or a shard could
        not load it less than ASK_AGAIN_S ago."""
        if disk not in self.refused:
            return False
        _, for_good, at = self.refused[disk]
        return for_good or self.clock() - at < ASK_AGAIN_S

    def due(self) -> bool:
        """Whether a part's ask for a reload has anything to do now: the workdir holds another version than the
        target, one not refused (cheap: index.json and the manifests)."""
        try:
            disk = self.workdir.current()
        except Exception:  # noqa: BLE001 - a workdir mid-commit: asked again by the part later
            return False
        return disk != self.target.vid and not self.refuses(disk)

    def _refuse(self, disk: str, why: str, e: BaseException, for_good: bool) -> Outcome:
        self.refused[disk] = (first_line(e), for_good, self.clock())
        return Outcome(False, f"reload: refused ({why}), still serving version {self.target.version}: "
                              f"{first_line(e)}", self.target)

    def lagging(self) -> dict[str, str]:
        """The live fronts that do not serve the target yet: {front: what it serves, and why it failed}."""
        out = {}
        for front, (serving, error) in self.relay.fronts().items():
            if serving is None or serving.generation < self.target.generation:
                at = f"version {serving.version}" if serving else "nothing yet"
                out[front] = at + (f" ({error})" if error else "")
        return out


class Reloader:
    """The command's loop side of the protocol: every tick it publishes the target again (a relay that restarted is
    whole within a tick), takes the asks, and starts a reload when one is due, in a thread of its own (`spawn`), so
    the loop (signals, the head's health) never waits for one. say: where its one-line outcomes go;
    after(outcome): what runs once a reload changed the target (in the reload's thread: the command waits for the
    fronts there)."""

    def __init__(self, coordinator: Coordinator, relay, spawn: Callable[[Callable[[], None]], object],
                 say: Callable[[str], None], after: Callable[[Outcome], None] = lambda outcome: None):
        self.coordinator, self.relay, self.spawn, self.say, self.after = coordinator, relay, spawn, say, after
        self.sighups, self.gone, self.admin = 0, "", []
        self.busy = False  # a reload was started and has not ended
        self.quiet = False  # a failed relay call is said once until one succeeds

    def tick(self, sighups: int = 0) -> None:
        self.sighups += sighups
        asks = self._relay(lambda: (self.relay.publish(self.coordinator.target), self.relay.take())[1]) or []
        for ask in asks:
            if ask.kind == "admin" and self.busy:  # refused at once; the running one goes on
                self._settle(ask.ticket, Outcome(False, "reload: refused (POST /v1/admin/reload): a reload is "
                                                        "already running", self.coordinator.target))
            elif ask.kind == "admin":
                self.admin.append(ask.ticket)
            elif ask.seen == self.coordinator.target.vid:  # a part found the served version gone
                self.gone = ask.why
        if self.busy or not (self.sighups or self.admin or self.gone):
            return
        if self.gone and not (self.sighups or self.admin) and not self.coordinator.due():
            self.gone = ""  # nothing to do, or refused already: asked again if it still holds
            return
        if self.gone:
            self.say(f"reload: asked by a part of the cluster: {self.gone}")
        explicit = bool(self.sighups or self.admin)
        why = "SIGHUP" if self.sighups else "POST /v1/admin/reload" if self.admin else "a version is gone"
        tickets, self.sighups, self.admin, self.gone = self.admin, 0, [], ""
        self.busy = True
        self.spawn(lambda: self._run(why, explicit, tickets))

    def _run(self, why: str, explicit: bool, tickets: list[str]) -> None:
        try:
            before = self.coordinator.target
            outcome = self.coordinator.reload(why, explicit)
            self.say(outcome.line)
            for ticket in tickets:
                self._settle(ticket, outcome)
        finally:
            self.busy = False
        if outcome.target is not None and outcome.target != before:
            self.after(outcome)

    def _settle(self, ticket: str, outcome: Outcome) -> None:
        self._relay(lambda: self.relay.settle(ticket, outcome))

    def _relay(self, call):
        try:
            out = call()
            self.quiet = False
            return out
        except Exception as e:  # noqa: BLE001 - the relay restarts (an actor); the next tick tries again
            if not self.quiet:
                self.say(f"the cluster's relay does not answer ({first_line(e)}); trying again")
            self.quiet = True
            return None

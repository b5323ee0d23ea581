"""The cluster's reload protocol: which versions every front serves, which every shard replica holds, and when a
replica loads or drops one (`cfir_jax.serve.deployments` runs these parts on Ray; the tests run them in one process).

Every front reports the versions it serves to the board (`ReloadBoard`) every second: the one it answers at, and
the one it swapped out while a batch may still run on it. Every shard replica reports the versions it holds every
half second. From these reports:

- A front's reload (SIGHUP, POST /v1/admin/reload, or following another front) first loads and checks its own side
  (the workdir complete, the model of the same family, the index not changed while loading, warm-up). Only then
  does it ask for the version (`prepare_everywhere`): every replica of every shard loads it in the background, told
  by the board (never inside a request), and the front swaps once every live replica holds it, or refuses the
  reload when one cannot (the workdir moved on meanwhile).
- A shard replica holds one version per `ShardIndex` (every method opened under one `versions.reading`) and drops
  one only when no live front serves it and no reload prepares it (`ShardReplica`).
- The fronts follow the newest version any front serves or a reload prepares (the board's answer to a report): a
  front behind it reloads, its own side loading while the shards load theirs, and a follow that fails is tried
  again later (`FrontReporter`).

The board holds nothing the reports do not restore: an actor restarts with an empty state, and within a report
period it knows every front's and replica's versions again; until SETTLE_S after its start it tells no replica to
drop anything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from cfir_jax.core.errors import CfirError

log = logging.getLogger("cfir_jax.serve")
FRONT_EXPIRY_S = 10.0  # a front silent this long is gone: the versions it served are no longer kept for it
REPLICA_EXPIRY_S = 5.0  # a shard replica silent this long is gone: a reload no longer waits for it
SETTLE_S = 10.0  # after the board starts, no replica drops a version (the reports restore the board's state first)
FRONT_REPORT_S = 1.0
REPLICA_REPORT_S = 0.5
FOLLOW_RETRY_MAX_S = 60.0  # a failed follow is tried again after 2, 4, 8 ... report periods, at most this long


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]


class ReloadBoard:
    """What every front serves and every shard replica holds, from their reports (the command's actor on Ray)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.target = 0  # the newest version a front serves: the one every front follows
        self.fronts: dict[str, tuple[frozenset[int], float]] = {}  # front -> (versions in use, last report)
        self.replicas: dict[str, tuple[int, frozenset[int], dict[int, str], float]] = {}  # shard, held, failed, at
        self.preparing: dict[int, float] = {}  # version -> last asked (a front re-asks while it waits)
        self.requested: dict[int, float] = {}  # version -> when a front began a reload to it (its checks pending)

    def front(self, front: str, serving: int, in_use: Sequence[int] = ()) -> int:
        """A front's report: the version it answers at, and the others a batch of it may still use. Returns the
        version every front should load: the newest one a front serves or, sooner, the newest a reload began (every
        front then loads and checks its own side at once, and each asks the shards only once its checks passed)."""
        now = self.clock()
        self.fronts[front] = (frozenset([int(serving), *map(int, in_use)]), now)
        self.target = max(self.target, int(serving))
        asked = [v for v, at in [*self.preparing.items(), *self.requested.items()] if now - at <= FRONT_EXPIRY_S]
        return max([self.target, *asked])

    def request(self, version: int) -> None:
        """A front began a reload to `version` (the workdir's committed one): the other fronts begin theirs."""
        self.requested[int(version)] = self.clock()

    def prepare(self, version: int, shards: int) -> tuple[str, str]:
        """A front's checks passed for `version`: every shard replica loads it. Asked again at every poll of the
        front that waits (a board that restarted learns it again); returns `holding(version, shards)`."""
        self.preparing[int(version)] = self.clock()
        return self.holding(version, shards)

    def abandon(self, version: int) -> None:
        """The reload to `version` was refused: replicas may drop it (unless a front serves it), fronts not load it."""
        self.preparing.pop(int(version), None)
        self.requested.pop(int(version), None)

    def replica(self, replica: str, shard: int, held: Sequence[int], failed: dict[int, str]) -> tuple[list[int], bool]:
        """A shard replica's report: what it holds and the versions it could not load (why). Returns the versions
        it should hold, and whether it may drop the others."""
        self.replicas[replica] = (int(shard), frozenset(map(int, held)), {int(v): w for v, w in failed.items()},
                                  self.clock())
        now = self.clock()
        live = [v for v, at in self.fronts.values() if now - at <= FRONT_EXPIRY_S]
        asked = {v for v, at in self.preparing.items() if now - at <= FRONT_EXPIRY_S}
        wanted = set().union(*live, asked)
        return sorted(wanted), bool(live) and now - self.started >= SETTLE_S

    def holding(self, version: int, shards: int) -> tuple[str, str]:
        """Whether every live replica of every shard holds `version`: ("held", ""), ("waiting", what for) or
        ("refused", why)."""
        now, version = self.clock(), int(version)
        waiting = ""
        for s in range(shards):
            live = [(h, f) for sh, h, f, at in self.replicas.values() if sh == s and now - at <= REPLICA_EXPIRY_S]
            for _, failed in live:
                if version in failed:
                    return "refused", failed[version]
            if not live:
                waiting = waiting or f"shard {s} has no live replica"
            elif not all(version in h for h, _ in live):
                waiting = waiting or f"shard {s} is loading version {version}"
        return ("waiting", waiting) if waiting else ("held", "")


def prepare_everywhere(board, version: int, shards: int, timeout_s: float, poll_s: float = 0.2) -> None:
    """Asks every replica of every shard for `version` and returns once every live one holds it; CfirError (and the
    version abandoned) when a replica cannot load it or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            state, why = board.prepare(version, shards)  # asked at every poll: a restarted board learns it again
            if state == "held":
                return
            if state == "refused":
                raise CfirError(why)
            if time.monotonic() > deadline:
                raise CfirError(f"the shards did not load version {version} in {timeout_s:g} s: {why}")
            time.sleep(poll_s)
    except BaseException:
        board.abandon(version)
        raise


class ShardReplica:
    """One replica of shard `shard`: a ShardIndex per version it holds. Its reporter tells the board what it holds
    and learns what to hold; its loader loads and drops in the background, so a request only reads.

    open_index() -> a ShardIndex of the workdir's current version (every method under one reading); current() -> the
    workdir's committed version (index.json, cheap)."""

    def __init__(self, board, shard: int, open_index: Callable[[], object], current: Callable[[], int]):
        self.board, self.shard, self.open_index, self.current = board, shard, open_index, current
        self.id = uuid.uuid4().hex
        self.held: dict[int, object] = {}
        self.failed: dict[int, str] = {}
        self._want: tuple[list[int], bool] = ([], False)
        self._work = threading.Event()
        self._stop = threading.Event()
        index = open_index()
        self.held[index.version] = index
        self._threads = [threading.Thread(target=f, name=n, daemon=True)
                         for f, n in ((self._report, "cfir-shard-report"), (self._load, "cfir-shard-load"))]
        for t in self._threads:
            t.start()

    def at(self, version: int):
        """The ShardIndex of `version`; CfirError at once when this replica does not hold it (another may)."""
        index = self.held.get(version)
        if index is None:
            raise CfirError(f"shard {self.shard}: this replica holds versions {sorted(self.held)}, not {version}")
        return index

    def report(self) -> None:
        """One report to the board (the reporter's loop; tests call it to step)."""
        self._want = self.board.replica(self.id, self.shard, sorted(self.held), dict(self.failed))
        self._work.set()

    def step(self) -> None:
        """Loads the versions the board asks for that the workdir has, notes those it no longer has, drops the
        unwanted ones when the board allows (the loader's loop; tests call it to step)."""
        wanted, may_drop = self._want
        for version in wanted:
            if version in self.held or version in self.failed:
                continue
            now = self.current()
            if now != version:
                self.failed[version] = f"shard {self.shard}: the workdir is at version {now}, not {version}"
                continue
            try:
                index = self.open_index()
            except Exception as e:  # noqa: BLE001 - named to the front that asked for it, which refuses its reload
                self.failed[version] = f"shard {self.shard}: {_first_line(e)}"
                continue
            if index.version != version:
                self.failed[version] = f"shard {self.shard}: the workdir moved to version {index.version}, " \
                                       f"not {version}"
                continue
            self.held = {**self.held, version: index}  # one reference swap: requests read `held` unlocked
            log.info("shard %d: holding version %d", self.shard, version)
        self.failed = {v: w for v, w in self.failed.items() if v in wanted}  # asked again later: tried again
        if may_drop and set(self.held) - set(wanted):
            self.held = {v: i for v, i in self.held.items() if v in wanted}

    def _report(self) -> None:
        while not self._stop.wait(REPLICA_REPORT_S):
            try:
                self.report()
            except Exception as e:  # noqa: BLE001 - the next report tries again
                log.warning("shard %d: reporting to the board: %s", self.shard, _first_line(e))

    def _load(self) -> None:
        while not self._stop.is_set():
            if self._work.wait(1.0):
                self._work.clear()
                self.step()

    def close(self) -> None:
        self._stop.set()


class FrontReporter:
    """A front's reports: every period, what it serves (and the version it swapped out, for grace_s after the swap,
    while a batch may still use it); when the board's target is newer, `follow` (a reload) in a thread of its own,
    started again after a failure (2, 4, 8 ... report periods later) until it succeeds."""

    def __init__(self, board, serving: Callable[[], int], follow: Callable[[], None], grace_s: float,
                 period_s: float = FRONT_REPORT_S, start: bool = True):
        self.board, self.serving, self.follow, self.grace_s, self.period_s = board, serving, follow, grace_s, period_s
        self.id = uuid.uuid4().hex
        self.retired: dict[int, float] = {}  # version swapped out -> until when it is still reported
        self.following: threading.Thread | None = None
        self.last_error, self.failures, self.retry_at = "", 0, 0.0
        self._last: int | None = None
        self._stop = threading.Event()
        if start:
            threading.Thread(target=self._loop, name="cfir-front-report", daemon=True).start()

    def report(self) -> int:
        """One report (the loop's; also right after this front swapped): returns the board's target."""
        now, serving = time.monotonic(), self.serving()
        if self._last is not None and self._last != serving:  # swapped: a batch may still run on the old one
            self.retired[self._last] = now + self.grace_s
        self._last = serving
        self.retired = {v: until for v, until in self.retired.items() if until > now and v != serving}
        target = self.board.front(self.id, serving, sorted(self.retired))
        idle = self.following is None or not self.following.is_alive()
        if target > serving and idle and now >= self.retry_at:
            self.following = threading.Thread(target=self._follow, name="cfir-follow", daemon=True)
            self.following.start()
        return target

    def _follow(self) -> None:
        try:
            self.follow()
            self.last_error, self.failures = "", 0
        except Exception as e:  # noqa: BLE001 - started again later; the front keeps serving what it has
            self.last_error, self.failures = _first_line(e), self.failures + 1
            wait = min(FOLLOW_RETRY_MAX_S, self.period_s * 2**self.failures)
            self.retry_at = time.monotonic() + wait
            log.warning("following a reload (tried again in %g s): %s", wait, self.last_error)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.report()
            except Exception as e:  # noqa: BLE001 - the next report tries again
                log.warning("reporting to the reload board: %s", _first_line(e))

    def close(self) -> None:
        self._stop.set()

"""The parts' side of the reload protocol (`cfir_jax.cluster.reload`): a front's `Follower` (its reports, its
follows of a newer target, its asks when the version it serves is gone from the workdir) and a shard replica's load
rule (`ShardVersions`: only the version the workdir holds). Ray-free: the deployments run them on Ray, the tests with
fake replicas and a fake clock."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from cfir_jax.cluster.reload import (
    ASK_AGAIN_S,
    FOLLOW_RETRY_MAX_S,
    FRONT_PERIOD_S,
    STUCK_S,
    Target,
    VersionGone,
    version_number,
)
from cfir_jax.core.errors import first_line

log = logging.getLogger("cfir_jax.serve")


class FollowingFront(Protocol):
    """A front as its Follower sees it: what it serves, and how it follows a newer target (a Service implements it:
    `cfir_jax.cluster.front.FrontService`)."""

    def serving(self) -> Target | None:
        """The target the front serves (None before its first load)."""

    def follow(self, target: Target) -> None:
        """Serves `target` (its own side loaded, checked, warmed, swapped in); VersionGone when the workdir has moved
        past it, CfirError when it cannot."""


class Follower:
    """A front's side: its reports, its follows of a newer target, and its asks when the version it serves or
    follows is gone from the workdir. spawn(fn): runs a follow beside the reports (a thread; the tests call it)."""

    def __init__(self, relay, front: FollowingFront, clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[Callable[[], None]], object] | None = None, period_s: float = FRONT_PERIOD_S):
        self.relay, self.front, self.clock, self.period_s = relay, front, clock, period_s
        self.spawn = spawn or (lambda fn: threading.Thread(target=fn, name="cfir-follow", daemon=True).start())
        self.id = uuid.uuid4().hex
        self.last_error, self.failures, self.retry_at = "", 0, 0.0
        self.failing_since: float | None = None
        self.asked: dict[str, float] = {}  # version id -> when this front last asked past it
        self._busy = threading.Lock()

    def poll(self) -> Target | None:
        """One report (every period_s): returns the target, and follows it when it is newer than what is served."""
        serving = self.front.serving()
        target = self.relay.report(self.id, serving, self.last_error)
        behind = target is not None and (serving is None or target.generation > serving.generation)
        if behind and self.clock() >= self.retry_at and self._busy.acquire(blocking=False):
            self.spawn(lambda: self._follow(target))
        return target

    def _follow(self, target: Target) -> None:
        try:
            self.front.follow(target)
            self.last_error, self.failures, self.failing_since = "", 0, None
        except Exception as e:  # noqa: BLE001 - tried again later; the front keeps serving what it has
            self.last_error, self.failures = first_line(e), self.failures + 1
            self.failing_since = self.failing_since if self.failing_since is not None else self.clock()
            self.retry_at = self.clock() + min(FOLLOW_RETRY_MAX_S, self.period_s * 2**self.failures)
            log.warning("following version %d failed (tried again later): %s", target.version, self.last_error)
            if isinstance(e, VersionGone):
                self.gone(target.vid, self.last_error)
        finally:
            self._busy.release()

    def gone(self, vid: str, why: str) -> None:
        """Asks the command for a reload past `vid` (a shard or this front found it gone), at most every
        ASK_AGAIN_S per version."""
        now = self.clock()
        if now - self.asked.get(vid, -ASK_AGAIN_S) >= ASK_AGAIN_S:
            self.asked[vid] = now
            try:
                self.relay.ask("gone", vid, why)
            except Exception as e:  # noqa: BLE001 - a search is never failed by it; asked again later
                self.asked.pop(vid, None)
                log.warning("asking for a reload past version %d: %s", version_number(vid), first_line(e))

    def stuck(self) -> str | None:
        """Why this front is unhealthy: it failed to follow the target for STUCK_S (None while it is not)."""
        if self.failing_since is not None and self.clock() - self.failing_since >= STUCK_S:
            return f"failed to follow the cluster's version for {self.clock() - self.failing_since:.0f} s: " \
                   f"{self.last_error}"
        return None


class ShardVersions:
    """A shard replica's rule for loading a version: only the one the workdir holds now. current() -> the
    committed version's id; open_shard(vid) -> the shard's search at the committed version (VersionGone when it
    moved past vid while opening).

    Besides the versions its calls ask for, a replica loads the cluster's target on its own (`wanted`, every
    period): every replica of a shard then holds the served version, and a dead one costs no request."""

    def __init__(self, current: Callable[[], str], open_shard: Callable[[str], object], where: str = ""):
        self.current, self.open_shard, self.where = current, open_shard, where
        self.gone = ""  # the last version found gone: not loaded again on the replica's own initiative

    def load(self, vid: str):
        now = self.current()
        if now != vid:
            self.gone = vid
            raise VersionGone(vid, now, self.where)
        return self.open_shard(vid)

    def wanted(self, target: Target | None) -> str | None:
        """The target's version, which this replica loads (or keeps, its most recently used) on its own; None when
        there is none yet or it was found gone."""
        return target.vid if target is not None and target.vid != self.gone else None

"""A front of the cluster: the single process's Service (micro-batcher, queue bound, deadlines, 503s) over the
single process's resident `Index` (the library's one query core), whose served methods score their unions on the
shards (`cfir_jax.cluster.scoring.ShardedSR`, the `Index`'s scoring) or, with one shard, here (one hop fewer), at the
version the cluster's target names (`cfir_jax.cluster.reload`).

- It starts at the target: the workdir's committed version when it is the target; a front started after a commit
  that no reload checked asks the command for a reload and waits for the target that follows (never serving a version
  unchecked, nor making the others follow one).
- It follows a newer target in the background (`Follower`): its own side loaded beside the served one and swapped in
  whole, as one process reloads (the command verified the version once; the family is checked again here).
- POST /v1/admin/reload asks the command for a reload, waits for its outcome, and answers it: 200 once this front
  serves the new version, 409 with the reason when it was refused.
- Ray's health check (`check_health`) fails when the worker thread that runs the batches is gone, or when the front
  failed to follow the target for `cfir_jax.cluster.reload.STUCK_S`: Ray replaces it, and the new one starts at the
  target.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

import ml_collections

from cfir_jax.cluster.follow import Follower
from cfir_jax.cluster.reload import Target, VersionGone, version_id
from cfir_jax.cluster.scoring import ShardedSR
from cfir_jax.cluster.shard import ShardClient, committed_id
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.serve.errors import Refused, Unavailable
from cfir_jax.serve.resident import IndexHolder, LoadedIndex, load_index
from cfir_jax.serve.service import Service

log = logging.getLogger("cfir_jax.serve")
ASK_POLL_S = 0.2  # how often an admin reload reads its outcome


class FrontHolder(IndexHolder):
    """The front's resident index at a target of the cluster. client: the shards (None: one shard, scored here)."""

    def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str],
                 max_batch: int, config: ml_collections.ConfigDict, client: ShardClient | None, target: Target):
        self.client, self.aiming, self.target = client, target, target
        super().__init__(workdir, config_spec, overrides, methods, max_batch, config)

    def load(self, workdir: str, config: ml_collections.ConfigDict) -> LoadedIndex:
        """The version `aiming` names, its methods warmed (through the shards, which hold it already); VersionGone
        when the workdir holds another."""
        vid = self.aiming.vid
        if committed_id(workdir) != vid:
            raise VersionGone(vid, committed_id(workdir), "front: ")
        scoring = ShardedSR.factory(self.client, vid) if self.client is not None else None
        fresh = load_index(workdir, config, self.methods, self.max_batch, scoring=scoring)
        if version_id(fresh.version, fresh.fingerprint) != vid:
            raise VersionGone(vid, version_id(fresh.version, fresh.fingerprint), "front: ")
        return fresh

    def verify(self, config: ml_collections.ConfigDict) -> None:
        """Nothing: the command verified the version once, before it became the target."""

    def follow(self, target: Target) -> LoadedIndex | None:
        """Serves `target`: the same version under a newer generation at once; another loaded, checked and swapped
        in (the fresh index returned). VersionGone when the workdir no longer holds it."""
        if target.vid == self.target.vid:
            self.target = target
            return None
        committed = committed_id(self.workdir)
        if committed != target.vid:
            raise VersionGone(target.vid, committed, "front: ")
        self.aiming = target
        fresh = self.reload()
        self.target = target
        return fresh


class FrontService(Service):
    """The single process's Service over a FrontHolder, following the cluster's target, with the shards in /readyz."""

    def __init__(self, holder: FrontHolder, settings, relay, follower: Follower):
        super().__init__(holder, settings)
        self.relay, self.follower = relay, follower
        self._stop = threading.Event()
        threading.Thread(target=self._poll, name="cfir-front-report", daemon=True).start()

    # the Follower's view of this front (`cfir_jax.cluster.follow.FollowingFront`)
    def serving(self) -> Target | None:
        return self.holder.target

    def follow(self, target: Target) -> None:
        fresh = self.holder.follow(target)
        if fresh is not None:
            self.swapped(fresh)

    def _poll(self) -> None:
        while not self._stop.wait(self.follower.period_s):
            try:
                self.follower.poll()
            except Exception as e:  # noqa: BLE001 - the relay restarts (an actor); the next report tries again
                log.warning("reporting to the cluster's relay: %s", first_line(e))

    def readiness(self) -> tuple[bool, dict]:
        ready, body = super().readiness()
        client = self.holder.client
        down = dict(client.down) if client is not None and hasattr(client, "down") else {}
        if client is not None:
            body["shards"] = {str(s): down.get(s, "ok") for s in range(client.shards)}
        body["generation"] = self.holder.target.generation
        if self.follower.last_error:
            body["following"] = self.follower.last_error
        if down and ready:
            s = min(down)
            body.update(ready=False, reason=f"shard {s} unavailable: {down[s]}")
        return ready and not down, body

    def health(self) -> None:
        """Ray's check_health: raises when this front cannot serve (module docstring)."""
        if not self.batcher.alive and not self.stopping:
            raise RuntimeError("the worker thread that runs the batches is gone")
        stuck = self.follower.stuck()
        if stuck:
            raise RuntimeError(stuck)

    async def reload(self) -> dict:
        """POST /v1/admin/reload: the command's reload of the whole cluster, answered once this front serves it
        (Refused 409 when the command refused it, Unavailable while it runs or this front is not there yet)."""
        serving = self.holder.target
        deadline = time.monotonic() + float(self.settings.ready_timeout_s)  # a reload loads, as a start does
        ticket = await asyncio.to_thread(self.relay.ask, "admin", serving.vid)
        outcome = None
        while outcome is None and time.monotonic() < deadline:
            await asyncio.sleep(ASK_POLL_S)
            outcome = await asyncio.to_thread(self.relay.outcome, ticket)
        if outcome is None:
            raise Unavailable("the reload is still running: see GET /readyz")
        if not outcome.ok:
            self.metrics.reloads.labels("refused").inc()
            raise Refused(outcome.line, 409)
        target = outcome.target
        while target is not None and self.holder.target.generation < target.generation:  # its follower loads it
            if time.monotonic() > deadline:
                why = self.follower.last_error or "still loading"
                raise Unavailable(f"the cluster reloaded to version {target.version}; this front does not serve it "
                                  f"yet: {why}")
            await asyncio.sleep(ASK_POLL_S)
        return {"reloaded": True, **self.holder.current.describe(), "line": outcome.line}

    async def shutdown(self) -> None:
        if self.stopping and self._stop.is_set():  # the ingress's lifespan and the replica's stop both end it
            return
        self._stop.set()
        await super().shutdown()
        close = getattr(self.holder.client, "close", None)
        if close is not None:
            close()


def start_front(workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str],
                config: ml_collections.ConfigDict, relay, client: Callable[[Follower], ShardClient | None],
                clock: Callable[[], float] = time.monotonic) -> FrontService:
    """A front serving the cluster's target, waiting at most serve.ready_timeout_s for one it can load: a target
    gone from the workdir (a commit no reload checked) is asked past, and the next target loaded. client(follower):
    the shards' client, which tells the follower of versions it finds gone."""
    deadline = clock() + float(config.serve.ready_timeout_s)
    follower = Follower(relay, None, clock)
    shards = client(follower)
    patience = getattr(shards, "budget_s", None)
    if patience is not None:  # the first warm-up waits for shards that are starting beside this front
        shards.budget_s = float(config.serve.ready_timeout_s)
    while True:
        target = relay.target()
        if target is not None:
            try:
                holder = FrontHolder(workdir, config_spec, overrides, methods, int(config.serve.max_batch), config,
                                     shards, target)
                break
            except VersionGone as e:
                follower.gone(target.vid, first_line(e))
                log.warning("front: %s; asked for a reload", first_line(e))
        if clock() > deadline:
            raise CfirError(f"no version of {workdir} to serve in {config.serve.ready_timeout_s:g} s "
                            "(serve.ready_timeout_s): see the command's reload lines")
        time.sleep(1.0)
    if patience is not None:
        shards.budget_s = patience
    service = FrontService(holder, config.serve, relay, follower)
    follower.front = service
    return service


def describe(service: FrontService) -> tuple[list[str], int]:
    """What the gateway checks requests against: the served methods and the most hits."""
    current = service.holder.current
    return list(current.methods), current.max_top_k

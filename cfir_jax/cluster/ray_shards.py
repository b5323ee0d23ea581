"""The front's client of the shards on Ray Serve (a `cfir_jax.cluster.shard.ShardClient`): one call per shard in
parallel, every call routed by the version it asks for (Ray Serve's model multiplexing: `multiplexed_model_id` is the
version id, so a replica that holds that version takes it), waited on (never polled), and retried until half the
request's deadline has passed, then `Unavailable` (503 `shard s unavailable`).

- A call that fails (its replica died, or it lacks the version and the workdir moved past it) is sent again after
  10 ms, then 20, 40 ... at most 250 ms: Ray picks a replica again.
- A call unanswered after serve.shard_timeout_s is sent again beside the first (a replica that died may hold it
  unanswered, or be loading the version: Ray sends the second to one that holds it); the first answer wins and the
  others are cancelled.
- A replica that found the version gone from the workdir (`VersionGone`: it restarted after a commit) is reported to
  `gone(vid, why)`: the front asks the command for a reload to the committed version (`cfir_jax.cluster.reload`).
- A prober notes which shards answer, for /readyz.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

from cfir_jax.cluster.reload import VersionGone
from cfir_jax.cluster.shard import checked
from cfir_jax.core.errors import first_line
from cfir_jax.serve.errors import Unavailable

RETRY_S, RETRY_MAX_S = 0.01, 0.25  # a failed call is sent again this much later, doubling up to the most


async def _awaited(handle, op: str, args: tuple):
    """op(*args) on a replica of `handle`, awaited; cancelled (the request too) when the caller no longer waits."""
    response = getattr(handle, op).remote(*args)
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


class RayShards:
    """The shards' deployment handles, one per shard, called from any thread; the calls run on `loop` (the
    replica's event loop). gone(vid, why): told when a replica found a version gone. budget_s: how long a call is
    retried (half of serve.deadline_ms; longer while the front first warms up beside starting shards)."""

    def __init__(self, handles: Sequence, settings, loop: asyncio.AbstractEventLoop,
                 gone: Callable[[str, str], None] = lambda vid, why: None):
        self.handles, self.loop, self.gone = list(handles), loop, gone
        self.shards = len(self.handles)
        self.timeout_s = float(settings.shard_timeout_s)
        self.budget_s = float(settings.deadline_ms) / 2e3
        self.down: dict[int, str] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._probe, name="cfir-shard-probe", daemon=True).start()

    def score(self, vid, fused, queries, parts):
        return self._call(vid, "score", lambda s: (fused, queries, parts[s]), list(parts))

    def search(self, vid, queries, k, weights):
        out = self._call(vid, "search", lambda s: (queries, k, weights), list(range(len(self.handles))))
        return [out[s] for s in range(len(self.handles))]

    def _send(self, s: int, vid: str, op: str, args: tuple) -> futures.Future:
        handle = self.handles[s].options(multiplexed_model_id=vid)
        return asyncio.run_coroutine_threadsafe(_awaited(handle, op, args), self.loop)

    def _call(self, vid: str, op: str, args_of, shards: list[int]) -> dict:
        """op(*args_of(s)) at version vid on each of `shards` at once, each retried and hedged (module docstring);
        {shard: its answer's value}. A shard with no answer after budget_s: Unavailable."""
        start, budget = time.monotonic(), self.budget_s
        tries: dict[int, dict[futures.Future, float]] = {s: {} for s in shards}
        send_at, backoff = dict.fromkeys(shards, start), dict.fromkeys(shards, RETRY_S)
        out: dict[int, object] = {}
        try:
            while len(out) < len(shards):
                now = time.monotonic()
                for s in (s for s in shards if s not in out):
                    if now - start > budget:
                        raise Unavailable(f"shard {s} unavailable: {self.down.get(s) or f'no answer in {budget:g} s'}")
                    if now >= send_at[s]:
                        tries[s][self._send(s, vid, op, args_of(s))] = now
                        send_at[s] = now + self.timeout_s
                pending = {f: s for s, fs in tries.items() if s not in out for f in fs}
                wake = min([start + budget, *(send_at[s] for s in shards if s not in out)])
                timeout = max(0.0, wake - time.monotonic()) + 1e-4
                if not pending:  # every call failed: the next goes out at send_at
                    time.sleep(timeout)
                    continue
                done, _ = futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)
                for f in done:
                    s = pending[f]
                    del tries[s][f]
                    if not self._settle(s, vid, f, out) and not tries[s]:
                        send_at[s] = min(send_at[s], time.monotonic() + backoff[s])
                        backoff[s] = min(RETRY_MAX_S, 2 * backoff[s])
        finally:
            for fs in tries.values():
                for f in fs:
                    f.cancel()  # a hedged duplicate or a loser: its request cancelled
        return out

    def _settle(self, s: int, vid: str, f: futures.Future, out: dict) -> bool:
        """The answer of a call into `out` (True), or why it failed noted for /readyz (False)."""
        try:
            out.setdefault(s, checked(s, vid, f.result()))
            self.down.pop(s, None)
            return True
        except VersionGone as e:  # a replica without the version, which the workdir no longer holds
            self.down[s] = first_line(e)
            self.gone(vid, first_line(e))
        except Exception as e:  # noqa: BLE001 - a dead replica, a load that failed: sent again while time is left
            self.down[s] = f"{type(e).__name__}: {first_line(e)}"[:200]
        return False

    def _probe(self) -> None:
        while not self._stop.wait(1.0):
            for s, h in enumerate(self.handles):
                try:
                    h.ping.remote().result(timeout_s=self.timeout_s)
                    if self.down.get(s, "").startswith(("ping", "RayActorError", "ActorUnavailableError")):
                        self.down.pop(s, None)
                except Exception as e:  # noqa: BLE001 - named in /readyz
                    self.down[s] = f"ping: {type(e).__name__}"

    def close(self) -> None:
        self._stop.set()

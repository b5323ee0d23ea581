"""The Ray Serve deployments of the cluster service (`cfir_jax.serve.cluster` starts them; settings: `serve.*`).

Three deployments behind one HTTP API (the single process's `app`: the same JSON, errors and headers):

- `Gateway` (serve.gateway_replicas; with 2 fronts or more): the ingress. It checks each request and hands it to a
  front, again to another replica when the one it reached died (`cfir_jax.serve.gateway`); it holds no model.
- `Front` (serve.front_replicas, serve.front_num_gpus each): the single process's Service and micro-batcher (its
  queue bound, deadlines and 503s) over `ClusterRetriever`s: spaCy entities, the summary and the query encoding
  here, batched; the union fanned out to every shard and the answers merged (`cfir_jax.serve.merge`). A picture
  (POST /v1/search/image) is embedded here and searched on every shard.
- `IndexShard<s>` for s < serve.shards (serve.shard_replicas each): rows [lo, hi) of the image cache and the lists'
  parts in them (`cfir_jax.serve.shard`), memory-mapped from the one workdir.

Versions (`cfir_jax.serve.reload`): every shard call carries the version its front loaded, and a shard replica
answers at exactly that version or refuses at once (another replica holds it). A reload (POST /v1/admin/reload, or
SIGHUP to the command) loads and checks the front's own side first (complete, same model family, unchanged while
loading, warmed); only then does every replica of every shard load version N+1 beside N, told by the board (an actor
of the command's own process, `ReloadBoard`: it lives as long as the command, whichever front dies, and its state
comes back from the parts' reports when it restarts); the front flips once every live replica holds N+1, and refuses
(N keeps answering) when one cannot. The other fronts follow the newest version any front serves within a second, a
failed follow tried again; a replica drops N once no front uses it. A shard call that fails (a dead replica, a
timeout) is tried again, on another replica when there is one, until half the request's deadline has passed: then
the request is answered 503 `shard s unavailable` and /readyz names the shard. With one front, the front is the
HTTP ingress itself (one hop fewer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures

import ml_collections
import ray
from ray import serve
from starlette.exceptions import HTTPException

from cfir_jax.core.errors import CfirError
from cfir_jax.serve.app import Service, create_app
from cfir_jax.serve.batcher import Unavailable
from cfir_jax.serve.gateway import GatewayService
from cfir_jax.serve.merge import ClusterRetriever
from cfir_jax.serve.reload import FrontReporter, ReloadBoard, ShardReplica, prepare_everywhere
from cfir_jax.serve.resident import IndexHolder, load_config, load_index
from cfir_jax.serve.shard import ShardIndex, shard_bounds
from cfir_jax.stores import versions
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout

log = logging.getLogger("cfir_jax.serve")
BOARD_TIMEOUT_S = 5.0  # a call to the board (an actor of the command's process)
RETRY_S = 0.01  # a shard call that failed is sent again this much later (Ray picks a replica again)
PREPARE_TIMEOUT_S = 900.0  # how long a reload waits for every shard replica to load its version


class _RemoteBoard:
    """The board actor's methods as plain calls (the protocol's parts, `cfir_jax.serve.reload`, call a board)."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name: str):
        method = getattr(self.actor, name)
        return lambda *args: ray.get(method.remote(*args), timeout=BOARD_TIMEOUT_S)


class IndexShard:
    """Shard `shard` of `shards` (Ray Serve replicas of one deployment): a ShardReplica, told by the board which
    versions to hold; a request at a version it does not hold is refused at once (another replica may hold it)."""

    def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str], shard: int,
                 shards: int, board):
        self.shard = shard
        max_batch = int(load_config(workdir, config_spec, overrides).serve.max_batch)

        def open_index() -> ShardIndex:  # the workdir's current version, every method under one reading, warmed
            index = ShardIndex(load_config(workdir, config_spec, overrides), workdir, shard, shards, methods)
            index.warm_up(max_batch)
            return index

        self.replica = ShardReplica(_RemoteBoard(board), shard, open_index,
                                    lambda: versions.current_version(Layout.of(workdir)))

    def score(self, version: int, method: str, docs, top_k: int):
        return self.replica.at(version).score(method, docs, top_k)

    def search(self, version: int, embeddings, k: int):
        return self.replica.at(version).search(embeddings, k)

    def pictures(self, version: int, query, k: int):
        return self.replica.at(version).pictures(query, k)

    def ping(self) -> int:
        return self.shard

    def __del__(self):
        self.replica.close()


async def _awaited(handle, op: str, args: tuple):
    """op(*args) on a replica of `handle`, awaited; cancelled (the request too) when the caller no longer waits."""
    response = getattr(handle, op).remote(*args)
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


class RayShards:
    """The front's client of the shards: one call per shard in parallel, waited on (never polled), each retried (Ray
    picks a live replica) until half the request deadline has passed, then `Unavailable`. A prober notes which
    shards answer for /readyz. loop: the replica's event loop, where the calls are made and awaited."""

    def __init__(self, handles: Sequence, settings, loop: asyncio.AbstractEventLoop):
        self.handles, self.loop = list(handles), loop
        self.timeout_s = float(settings.shard_timeout_s)
        self.budget_s = float(settings.deadline_ms) / 2e3
        self.down: dict[int, str] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._probe, name="cfir-shard-probe", daemon=True).start()

    def _send(self, s: int, op: str, args: tuple) -> futures.Future:
        return asyncio.run_coroutine_threadsafe(_awaited(self.handles[s], op, args), self.loop)

    def _call(self, op: str, args_of) -> list:
        """op(*args_of(s)) on every shard at once. A shard's call that fails is sent again RETRY_S later, and one
        that has not answered in serve.shard_timeout_s is sent again beside it (a replica that died may hold it
        unanswered); the first answer wins and the others are cancelled. A shard with no answer after half the
        deadline: Unavailable."""
        start = time.monotonic()
        tries: dict[int, dict[futures.Future, float]] = {s: {} for s in range(len(self.handles))}
        send_at = dict.fromkeys(tries, start)  # when a shard's next call is sent
        out: dict[int, object] = {}
        try:
            while len(out) < len(self.handles):
                now = time.monotonic()
                for s in (s for s in tries if s not in out):
                    if now - start > self.budget_s:
                        reason = self.down.get(s) or f"no answer in {self.budget_s:g} s"
                        raise Unavailable(f"shard {s} unavailable: {reason}")
                    if now >= send_at[s]:
                        tries[s][self._send(s, op, args_of(s))] = now
                        send_at[s] = now + self.timeout_s
                pending = {f: s for s, fs in tries.items() if s not in out for f in fs}
                wake = min([start + self.budget_s, *(send_at[s] for s in tries if s not in out)])
                timeout = max(0.0, wake - time.monotonic()) + 1e-4
                if not pending:  # every call failed: the next goes out at send_at
                    time.sleep(timeout)
                    continue
                done, _ = futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)
                for f in done:
                    s = pending[f]
                    del tries[s][f]
                    if not self._settle(s, f, out) and not tries[s]:
                        send_at[s] = min(send_at[s], time.monotonic() + RETRY_S)
        finally:
            for fs in tries.values():
                for f in fs:
                    f.cancel()  # a hedged duplicate or a loser: its request cancelled
        return [out[s] for s in range(len(self.handles))]

    def _settle(self, s: int, f: futures.Future, out: dict) -> bool:
        """The answer of a call into `out` (True), or why it failed noted for /readyz (False)."""
        try:
            out.setdefault(s, f.result())
            self.down.pop(s, None)
            return True
        except CfirError:  # a replica without the version (one started after a commit): another may hold it
            self.down[s] = "a replica without the version asked for"
        except Exception as e:  # noqa: BLE001 - a dead replica: sent again while time is left
            self.down[s] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return False

    def score(self, version: int, method: str, docs, top_k: int) -> list:
        return self._call("score", lambda s: (version, method, docs, top_k))

    def search(self, version: int, embeddings, k: int) -> list:
        return self._call("search", lambda s: (version, embeddings, k))

    def pictures(self, version: int, query, k: int) -> list:
        return self._call("pictures", lambda s: (version, query, k))

    def _probe(self) -> None:
        while not self._stop.wait(1.0):
            for s, h in enumerate(self.handles):
                try:
                    h.ping.remote().result(timeout_s=self.timeout_s)
                    self.down.pop(s, None)
                except Exception as e:  # noqa: BLE001 - named in /readyz
                    self.down[s] = f"{type(e).__name__}"

    def close(self) -> None:
        self._stop.set()


class ClusterHolder(IndexHolder):
    """The front's index: ClusterRetrievers over the shards. A load checks and warms this side only; the shards
    load its version once it passed every check (`activate`)."""

    def __init__(self, workdir, config_spec, overrides, methods, max_batch, config, client, board):
        self.client, self.board = client, board
        super().__init__(workdir, config_spec, overrides, methods, max_batch, config)

    def load(self, workdir, config):
        return load_index(workdir, config, self.methods, self.max_batch,
                          make=lambda config, workdir, method: ClusterRetriever(config, workdir, method, self.client),
                          warm=lambda retriever, max_batch: retriever.warm_front(max_batch))

    def activate(self, fresh) -> None:
        prepare_everywhere(self.board, fresh.version, len(self.client.handles), PREPARE_TIMEOUT_S)

    def reload(self):
        """The single process's reload, the other fronts told at once that it began (they load beside it)."""
        version = versions.current_version(Layout.of(self.workdir))
        if version != self.current.version:
            self.board.request(version)
        try:
            return super().reload()
        except CfirError:
            self.board.abandon(version)
            raise


class ClusterService(Service):
    """The single process's Service over a ClusterHolder, with the shards in /readyz and every version it serves
    reported to the board (which the shards keep, and which the other fronts follow)."""

    def __init__(self, holder: ClusterHolder, settings, board):
        super().__init__(holder, settings)
        self.reporter = FrontReporter(board, lambda: self.holder.current.version, self._follow,
                                      grace_s=float(settings.deadline_ms) / 1e3 + 5.0)
        self._closed = False

    def readiness(self) -> tuple[bool, dict]:
        ready, body = super().readiness()
        down = dict(self.holder.client.down)
        body["shards"] = {str(s): down.get(s, "ok") for s in range(len(self.holder.client.handles))}
        if self.reporter.last_error:
            body["following"] = self.reporter.last_error
        if down and ready:
            s = min(down)
            body.update(ready=False, reason=f"shard {s} unavailable: {down[s]}")
        return ready and not down, body

    async def reload(self):
        answer = await super().reload()
        if answer.status_code == 200:
            await asyncio.to_thread(self.reporter.report)  # the other fronts follow at their next report
        return answer

    def _follow(self) -> None:
        """Reloads because another front did, or prepares a version (the reporter's thread; tried again later on
        failure). A reload of this front already running is the follow."""
        if self.holder.reloading:
            return
        self.swapped(self.holder.reload())
        self.reporter.report()

    async def shutdown(self) -> None:
        if self._closed:  # the ingress's lifespan and the replica's stop both end it
            return
        self._closed = True
        await super().shutdown()
        self.reporter.close()
        self.holder.client.close()


class Front:
    """A front replica: the single process's Service (micro-batcher, queue bound, deadlines) over ClusterRetrievers;
    the gateway hands it checked requests."""

    async def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str], board,
                       *shards):
        logging.getLogger("cfir_jax.serve").setLevel(logging.INFO)
        config = load_config(workdir, config_spec, overrides)
        client = RayShards(shards, config.serve, asyncio.get_running_loop())
        board = _RemoteBoard(board)
        # Off the replica's event loop: loading waits on the shards, whose calls run on that loop
        holder = await asyncio.to_thread(ClusterHolder, workdir, config_spec, overrides, methods,
                                         int(config.serve.max_batch), config, client, board)
        self.service = ClusterService(holder, config.serve, board)

    def describe(self) -> tuple[list[str], int]:
        current = self.service.holder.current
        return list(current.retrievers), current.max_top_k

    async def answer(self, docs, method: str, top_k: int, html: bool) -> tuple[int, str | list[str], dict]:
        """(200, the answer, its headers) or (status, the one-line error, headers), as the app would answer."""
        return await _status(self.service.answer(docs, method, top_k, html))

    async def picture(self, picture: bytes | None, image_id: str | None, top_k: int | None, qid: str):
        """A picture request the gateway checked, as `answer` answers: embedded here, searched on every shard."""
        return await _status(self.service.search_picture(picture, image_id, top_k, qid))

    def readiness(self) -> tuple[bool, dict]:
        return self.service.readiness()

    async def reload(self) -> tuple[int, dict]:
        answer = await self.service.reload()
        return answer.status_code, json.loads(answer.body)

    async def __del__(self):
        await self.service.shutdown()  # Ray's graceful stop: the batcher answers what it accepted


async def _status(call) -> tuple[int, object, dict]:
    """(200, answer, headers) of a service call, or (status, its one-line refusal, headers)."""
    try:
        answer, headers = await call
        return 200, answer, headers
    except HTTPException as e:
        return e.status_code, str(e.detail), dict(e.headers or {})


@serve.ingress()
class FrontIngress(Front):
    """One front serving HTTP itself (serve.front_replicas=1): the single process's app over its Service, one hop
    fewer than through a gateway (which would have no other front to retry on)."""

    def __serve_build_asgi_app__(self):
        return create_app(self.service)

    async def reload(self) -> int:
        """The reload of SIGHUP: the HTTP status of POST /v1/admin/reload."""
        return (await self.service.reload()).status_code


@serve.ingress()
class Gateway:
    """The HTTP ingress: the single process's app over a GatewayService (requests retried on a live front)."""

    async def __init__(self, config_json: str, front):
        self.service = GatewayService(front, ml_collections.ConfigDict(json.loads(config_json)))
        await self.service.start()

    def __serve_build_asgi_app__(self):
        return create_app(self.service)

    async def reload(self) -> int:
        """The reload of SIGHUP: the HTTP status of POST /v1/admin/reload."""
        return (await self.service.reload()).status_code


def build_app(workdir: str, config, config_spec: str, overrides: Sequence[str], methods: Sequence[str]):
    """The bound application: serve.shards IndexShard deployments behind serve.front_replicas Fronts, behind the
    gateways (or, with one front, the front as the ingress). Called by the command's process after ray.init: the
    reload board is its actor, so no front's death takes the board with it (an actor dies with the process that
    made it), and two applications on one Ray never share one."""
    s = config.serve
    num_rows = ImageCache.open(Layout.of(workdir).image_cache).num_images
    shard_bounds(num_rows, int(s.shards))  # a bad shard count is refused here, in one line
    board = ray.remote(num_cpus=0, max_restarts=-1)(ReloadBoard).remote()
    shard_cls = serve.deployment(IndexShard)
    shards = [shard_cls.options(name=f"IndexShard{n}", num_replicas=int(s.shard_replicas),
                                ray_actor_options={"num_cpus": float(s.shard_num_cpus)},
                                health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=30)
              .bind(workdir, config_spec, list(overrides), list(methods), n, int(s.shards), board)
              for n in range(int(s.shards))]
    one = int(s.front_replicas) == 1
    front = serve.deployment(FrontIngress if one else Front).options(
        name="Front", num_replicas=int(s.front_replicas), max_ongoing_requests=int(s.queue_size) + 16,
        ray_actor_options={"num_cpus": float(s.front_num_cpus), "num_gpus": float(s.front_num_gpus)},
        health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=60)
    fronts = front.bind(workdir, config_spec, list(overrides), list(methods), board, *shards)
    if one:
        return fronts
    gateway = serve.deployment(Gateway).options(
        name="Gateway", num_replicas=int(s.gateway_replicas), max_ongoing_requests=4 * int(s.queue_size) + 16,
        ray_actor_options={"num_cpus": float(s.gateway_num_cpus)}, graceful_shutdown_timeout_s=60)
    return gateway.bind(s.to_json(), fronts)

"""The Ray Serve deployments of the cluster service (`cfir_jax.serve.cluster` starts them; settings: `serve.*`).

Three deployments behind one HTTP API (the single process's `app`: the same JSON, errors and headers):

- `Gateway` (serve.gateway_replicas): the ingress. It checks each request and hands it to a front, again to another
  replica when the one it reached died (`cfir_jax.serve.gateway`); it holds no model.
- `Front` (serve.front_replicas, serve.front_num_gpus each): the single process's Service and micro-batcher (its
  queue bound, deadlines and 503s) over `ClusterRetriever`s: spaCy entities, the summary and the query encoding
  here, batched; the union fanned out to every shard and the answers merged (`cfir_jax.serve.merge`).
- `IndexShard<s>` for s < serve.shards (serve.shard_replicas each): rows [lo, hi) of the image cache and the lists'
  parts in them (`cfir_jax.serve.shard`), memory-mapped from the one workdir.

Versions: every shard call carries the version its front loaded, and a shard replica answers at exactly that version
(loading it beside the one it serves when it is the workdir's current one; it keeps the two newest). A reload (POST
/v1/admin/reload, or SIGHUP to the command) verifies the workdir, asks every shard to load version N+1 beside N (any
refusal refuses the reload everywhere, and N keeps answering), then the front flips; the other fronts follow within
a second (`_Board`, an actor of the command's own process: it lives as long as the command, whichever front dies). A
shard call that fails (a dead replica, a timeout) is tried again, on another replica when there is one, until half
the request's deadline has passed: then the request is answered 503 `shard s unavailable` and /readyz names the
shard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence

import ml_collections
import ray
from ray import serve
from starlette.exceptions import HTTPException

from cfir_jax.core.errors import CfirError
from cfir_jax.serve.app import Service, create_app
from cfir_jax.serve.batcher import Unavailable
from cfir_jax.serve.gateway import GatewayService
from cfir_jax.serve.merge import ClusterRetriever
from cfir_jax.serve.resident import IndexHolder, load_config, load_index
from cfir_jax.serve.shard import ShardIndex, shard_bounds
from cfir_jax.stores import versions
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout

log = logging.getLogger("cfir_jax.serve")
KEEP_VERSIONS = 2  # a shard replica keeps the version it serves and the one beside it


@ray.remote(num_cpus=0, max_restarts=-1)
class _Board:
    """How many reloads succeeded: a front that sees more than it ran reloads too (its shards hold that version)."""

    def __init__(self):
        self.generation = 0

    def bump(self) -> int:
        self.generation += 1
        return self.generation

    def get(self) -> int:
        return self.generation


class IndexShard:
    """Shard `shard` of `shards`: a ShardIndex per version it holds (Ray Serve replicas of one deployment)."""

    def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str], shard: int,
                 shards: int):
        self.workdir, self.config_spec, self.overrides = workdir, config_spec, list(overrides)
        self.methods, self.shard, self.shards = list(methods), shard, shards
        self.held: dict[int, ShardIndex] = {}
        self._lock = threading.Lock()
        self.prepare(versions.current_version(Layout.of(workdir)))

    def prepare(self, version: int) -> dict:
        """Holds `version` (loading it beside the others when it is the workdir's current one); CfirError if not."""
        with self._lock:
            if version not in self.held:
                config = load_config(self.workdir, self.config_spec, self.overrides)
                index = ShardIndex(config, self.workdir, self.shard, self.shards, self.methods)
                if index.version != version:
                    raise CfirError(f"shard {self.shard}: the workdir is at version {index.version}, not {version}")
                self.held[version] = index
                for old in sorted(self.held)[:-KEEP_VERSIONS]:
                    del self.held[old]
            return self.held[version].describe()

    def score(self, version: int, method: str, docs, top_k: int):
        return self._at(version).score(method, docs, top_k)

    def search(self, version: int, embeddings, k: int):
        return self._at(version).search(embeddings, k)

    def ping(self) -> int:
        return self.shard

    def _at(self, version: int) -> ShardIndex:
        index = self.held.get(version)
        if index is None:
            self.prepare(version)
            index = self.held[version]
        return index


class RayShards:
    """The front's client of the shards: one call per shard in parallel, each retried (Ray picks a live replica) until
    half the request deadline has passed, then `Unavailable`. A prober notes which shards answer for /readyz."""

    def __init__(self, handles: Sequence, settings):
        self.handles = list(handles)
        self.timeout_s = float(settings.shard_timeout_s)
        self.budget_s = float(settings.deadline_ms) / 2e3
        self.down: dict[int, str] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._probe, name="cfir-shard-probe", daemon=True).start()

    def _call(self, op: str, args_of) -> list:
        """op(*args_of(s)) on every shard at once. A shard's call that fails is sent again at once, and one that has
        not answered in serve.shard_timeout_s is sent again beside it (a replica that died may hold it unanswered);
        the first answer wins. A shard with no answer after half the deadline: Unavailable."""
        start = time.monotonic()
        sent = {s: [(start, getattr(h, op).remote(*args_of(s)))] for s, h in enumerate(self.handles)}
        out: dict[int, object] = {}
        while len(out) < len(self.handles):
            for s, tries in sent.items():
                if s in out:
                    continue
                for t in list(tries):
                    try:
                        out[s] = t[1].result(timeout_s=0.005)
                        self.down.pop(s, None)
                        break
                    except TimeoutError:
                        continue
                    except CfirError:
                        if op == "prepare":  # a refusal of the version: the reload is refused
                            raise
                        # else a replica that cannot hold the version (one started after a commit): another may
                        self.down[s] = "a replica without the version asked for"
                        tries.remove(t)
                    except Exception as e:  # noqa: BLE001 - a dead replica: sent again below while time is left
                        self.down[s] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                        tries.remove(t)
                now = time.monotonic()
                if s in out:
                    continue
                if now - start > self.budget_s:
                    reason = self.down.get(s) or f"no answer in {self.budget_s:g} s"
                    raise Unavailable(f"shard {s} unavailable: {reason}")
                if not tries or now - max(t[0] for t in tries) > self.timeout_s:
                    tries.append((now, getattr(self.handles[s], op).remote(*args_of(s))))
            time.sleep(0.002)
        return [out[s] for s in range(len(self.handles))]

    def prepare(self, version: int) -> None:
        try:
            self._call("prepare", lambda s: (version,))
        except Unavailable as e:
            raise CfirError(str(e)) from None

    def score(self, version: int, method: str, docs, top_k: int) -> list:
        return self._call("score", lambda s: (version, method, docs, top_k))

    def search(self, version: int, embeddings, k: int) -> list:
        return self._call("search", lambda s: (version, embeddings, k))

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
    """The front's index: ClusterRetrievers over the shards, all at the version their shards were asked to load."""

    def __init__(self, workdir, config_spec, overrides, methods, max_batch, config, client):
        self.client = client
        super().__init__(workdir, config_spec, overrides, methods, max_batch, config)

    def load(self, workdir, config):
        def make(config, workdir, method):
            retriever = ClusterRetriever(config, workdir, method, self.client)
            self.client.prepare(retriever.version)  # every shard holds it, or the load is refused
            return retriever

        return load_index(workdir, config, self.methods, self.max_batch, make=make)


class ClusterService(Service):
    """The single process's Service over a ClusterHolder, with the shards in /readyz and reloads followed."""

    def __init__(self, holder: ClusterHolder, settings, board):
        super().__init__(holder, settings)
        self.board, self.generation = board, 0
        threading.Thread(target=self._follow, name="cfir-follow", daemon=True).start()

    def readiness(self) -> tuple[bool, dict]:
        ready, body = super().readiness()
        down = dict(self.holder.client.down)
        body["shards"] = {str(s): down.get(s, "ok") for s in range(len(self.holder.client.handles))}
        if down and ready:
            s = min(down)
            body.update(ready=False, reason=f"shard {s} unavailable: {down[s]}")
        return ready and not down, body

    async def reload(self):
        answer = await super().reload()
        if answer.status_code == 200:
            self.generation = await self.board.bump.remote()
        return answer

    def _follow(self) -> None:
        """Reloads when another front did (polls the board every second)."""
        while not self.stopping:
            time.sleep(1.0)
            try:
                generation = ray.get(self.board.get.remote(), timeout=5)
                if generation > self.generation:
                    self.generation = generation
                    fresh = self.holder.reload()
                    self.metrics.set_index(fresh)
            except Exception as e:  # noqa: BLE001 - the next poll tries again; the front keeps serving what it has
                log.warning("following a reload: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)

    async def shutdown(self) -> None:
        await super().shutdown()
        self.holder.client.close()


class Front:
    """A front replica: the single process's Service (micro-batcher, queue bound, deadlines) over ClusterRetrievers;
    the gateway hands it checked requests."""

    async def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str], board,
                       *shards):
        logging.getLogger("cfir_jax.serve").setLevel(logging.INFO)
        config = load_config(workdir, config_spec, overrides)
        client = RayShards(shards, config.serve)
        # Off the replica's event loop: loading waits on the shards' answers
        holder = await asyncio.to_thread(ClusterHolder, workdir, config_spec, overrides, methods,
                                         int(config.serve.max_batch), config, client)
        self.service = ClusterService(holder, config.serve, board)

    def describe(self) -> tuple[list[str], int]:
        current = self.service.holder.current
        return list(current.retrievers), current.max_top_k

    async def answer(self, docs, method: str, top_k: int, html: bool) -> tuple[int, str | list[str], dict]:
        """(200, the answer, its headers) or (status, the one-line error, headers), as the app would answer."""
        try:
            answer, headers = await self.service.answer(docs, method, top_k, html)
            return 200, answer, headers
        except HTTPException as e:
            return e.status_code, str(e.detail), dict(e.headers or {})

    def readiness(self) -> tuple[bool, dict]:
        return self.service.readiness()

    async def reload(self) -> tuple[int, dict]:
        answer = await self.service.reload()
        return answer.status_code, json.loads(answer.body)

    async def __del__(self):
        await self.service.shutdown()  # Ray's graceful stop: the batcher answers what it accepted


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
    """The bound application: serve.shards IndexShard deployments behind serve.front_replicas Fronts. Called by the
    command's process after ray.init: the fronts' reload board is its actor, so no front's death takes the board with it
    (an actor dies with the process that made it), and two applications on one Ray never share one."""
    s = config.serve
    num_rows = ImageCache.open(Layout.of(workdir).image_cache).num_images
    shard_bounds(num_rows, int(s.shards))  # a bad shard count is refused here, in one line
    shard_cls = serve.deployment(IndexShard)
    shards = [shard_cls.options(name=f"IndexShard{n}", num_replicas=int(s.shard_replicas),
                                ray_actor_options={"num_cpus": float(s.shard_num_cpus)},
                                health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=30)
              .bind(workdir, config_spec, list(overrides), list(methods), n, int(s.shards))
              for n in range(int(s.shards))]
    front = serve.deployment(Front).options(
        name="Front", num_replicas=int(s.front_replicas), max_ongoing_requests=int(s.queue_size) + 16,
        ray_actor_options={"num_cpus": float(s.front_num_cpus), "num_gpus": float(s.front_num_gpus)},
        health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=60)
    gateway = serve.deployment(Gateway).options(
        name="Gateway", num_replicas=int(s.gateway_replicas), max_ongoing_requests=4 * int(s.queue_size) + 16,
        ray_actor_options={"num_cpus": float(s.gateway_num_cpus)}, graceful_shutdown_timeout_s=60)
    board = _Board.remote()
    return gateway.bind(s.to_json(), front.bind(workdir, config_spec, list(overrides), list(methods), board, *shards))

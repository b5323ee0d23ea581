"""The Ray Serve deployments of the cluster service (`cfir_jax.cluster.command` starts them; settings: `serve.*`).

Behind one HTTP API (the single process's `app`: the same JSON, errors and headers):

- `Gateway` (serve.gateway_replicas; with 2 fronts or more): the ingress. It checks each request and hands it to a
  front, again to another replica when the one it reached died (`cfir_jax.cluster.gateway`); it holds no model.
- `Front` (serve.front_replicas, serve.front_num_gpus each): the single process's Service over the single process's
  Retrievers (`cfir_jax.cluster.front`), whose candidates the shards score. With one front, the front is the HTTP
  ingress itself.
- `ShardReplica<s>` for s < serve.shards (serve.shard_replicas each), only with 2 shards or more: rows [lo, hi) of the
  image cache (`cfir_jax.cluster.shard`). With one shard, each front scores its candidates itself (one hop fewer).

What of Ray Serve they use (docs/serving.md says why, and why not the rest):

- model multiplexing, with a version id as the model id: a shard replica loads a version on its first request for
  it (`ShardReplica.at_version`), when the workdir holds it, and keeps the last SHARD_VERSIONS; Ray routes every call
  to a replica that holds the version it asks for. Every replica also loads the cluster's target on its own, so that
  each holds the served version;
- health checks: a front whose batches cannot run, or which failed to follow the cluster's version for long, fails
  `check_health`, and Ray replaces it;
- one actor of the command's own, the `Relay` of the reload protocol (`cfir_jax.cluster.reload`), which every part
  finds by its handle.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import ml_collections
import ray
from ray import serve

from cfir_jax.cluster.follow import ShardVersions
from cfir_jax.cluster.front import describe, start_front
from cfir_jax.cluster.gateway import GatewayService
from cfir_jax.cluster.ray_shards import RayShards
from cfir_jax.cluster.reload import Relay, VersionGone
from cfir_jax.cluster.shard import ShardSearch, committed_id, shard_bounds
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.retrieve.stores import cache_path
from cfir_jax.serve.app import create_app
from cfir_jax.serve.errors import http_answer
from cfir_jax.serve.resident import load_config
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout

log = logging.getLogger("cfir_jax.serve")
SHARD_VERSIONS = 2  # versions a shard replica keeps: the served one and the one a reload brings
FOLLOW_PERIOD_S = 1.0  # how often a shard replica loads the cluster's target on its own
RELAY_TIMEOUT_S = 10.0  # a call to the relay (an actor of the command's)


class RemoteRelay:
    """The relay actor's methods as plain calls with a timeout, as the protocol's classes call a Relay."""

    def __init__(self, actor, timeout_s: float = RELAY_TIMEOUT_S):
        self.actor, self.timeout_s = actor, timeout_s

    def __getattr__(self, name: str):
        if name.startswith("_") or not hasattr(Relay, name):
            raise AttributeError(name)
        method = getattr(self.actor, name)
        return lambda *args: ray.get(method.remote(*args), timeout=self.timeout_s)


class ShardReplica:
    """One replica of shard `shard` of `shards` (a Ray Serve deployment's replica): a ShardSearch per version it
    holds, loaded when asked for (Ray Serve's model multiplexing, the version id the model id) and only when the
    workdir holds it (`ShardVersions`)."""

    async def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], shard: int, shards: int,
                       relay):
        logging.getLogger("cfir_jax.serve").setLevel(logging.INFO)
        self.workdir, self.config_spec, self.overrides = workdir, config_spec, list(overrides)
        self.shard, self.shards = shard, shards
        self.versions = ShardVersions(lambda: committed_id(workdir), self._open, f"shard {shard}: ")
        self.relay = relay
        await self._follow()  # ready (loaded and warmed) before Ray sends it a request
        self._follower = asyncio.get_running_loop().create_task(self._follow_forever())

    async def _follow(self) -> None:
        """Loads the cluster's target when the workdir holds it (kept most recently used when it does already)."""
        try:
            vid = self.versions.wanted(await asyncio.wait_for(self.relay.target.remote(), RELAY_TIMEOUT_S))
            if vid is not None:
                await self.at_version(vid)
        except VersionGone:  # a replica started after a commit: a front asks for a reload past it
            pass
        except Exception as e:  # noqa: BLE001 - the relay restarting, a load that failed: the next period tries again
            log.warning("shard %d: loading the cluster's version: %s", self.shard, first_line(e))

    async def _follow_forever(self) -> None:
        while True:
            await asyncio.sleep(FOLLOW_PERIOD_S)
            await self._follow()

    def _open(self, vid: str) -> ShardSearch:
        config = load_config(self.workdir, self.config_spec, self.overrides)
        opened = ShardSearch(config, self.workdir, self.shard, self.shards, vid)
        opened.warm_up(int(config.serve.max_batch))
        log.info("shard %d: holding version %s (rows %d-%d)", self.shard, vid, opened.lo, opened.hi - 1)
        return opened

    @serve.multiplexed(max_num_models_per_replica=SHARD_VERSIONS)
    async def at_version(self, vid: str) -> ShardSearch:
        """This shard's search at version `vid` (loaded on a miss, when the workdir holds it)."""
        return await asyncio.to_thread(self.versions.load, vid)

    async def prepare(self) -> str:
        """Loads the version the call is routed by (a reload's, before any front serves it)."""
        return (await self.at_version(serve.get_multiplexed_model_id())).vid

    async def score(self, fused: bool, queries, parts):
        shard = await self.at_version(serve.get_multiplexed_model_id())
        return await asyncio.to_thread(shard.score, fused, queries, parts)

    async def search(self, queries, k: int, weights):
        shard = await self.at_version(serve.get_multiplexed_model_id())
        return await asyncio.to_thread(shard.search, queries, k, weights)

    def ping(self) -> int:
        return self.shard


class Front:
    """A front replica (`cfir_jax.cluster.front`); the gateway hands it checked requests."""

    async def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str], relay,
                       *shards):
        logging.getLogger("cfir_jax.serve").setLevel(logging.INFO)
        config = load_config(workdir, config_spec, overrides)
        loop = asyncio.get_running_loop()

        def client(follower):
            return RayShards(shards, config.serve, loop, follower.gone) if shards else None

        # Off the replica's event loop: loading waits on the shards, whose calls run on that loop
        self.service = await asyncio.to_thread(start_front, workdir, config_spec, overrides, methods, config,
                                               RemoteRelay(relay), client)

    def describe(self) -> tuple[list[str], int]:
        return describe(self.service)

    async def answer(self, docs, method: str, top_k: int, html: bool) -> tuple[int, str | list[str], dict]:
        """(200, the answer, its headers) or (status, the one-line error, headers), as the app would answer."""
        return await _status(self.service.answer(docs, method, top_k, html))

    async def search_image(self, image: bytes | None, image_id: str | None, top_k: int | None, qid: str,
                           where: tuple = (), fold: bool = True, facets: tuple = (), html: bool = False):
        """An image request the gateway checked, as `answer` answers (the gallery when `html`)."""
        return await _status(self.service.search_image(image, image_id, top_k, qid, where, fold, facets, html))

    def readiness(self) -> tuple[bool, dict]:
        return self.service.readiness()

    async def reload(self) -> tuple[int, object, dict]:
        """(200, what serves now, {}) or (status, the refusal's one line, headers), as `answer` answers."""
        return await _status(self._reloaded())

    async def _reloaded(self) -> tuple[dict, dict]:
        return await self.service.reload(), {}

    def check_health(self) -> None:
        self.service.health()

    async def __del__(self):
        await self.service.shutdown()  # Ray's graceful stop: the batcher answers what it accepted


async def _status(call) -> tuple[int, object, dict]:
    """(200, answer, headers) of a service call, or its refusal as `cfir_jax.serve.errors.http_answer` makes it
    (status, one line, headers), which crosses Ray and the gateway raises again; any other error is raised."""
    try:
        answer, headers = await call
        return 200, answer, headers
    except Exception as e:
        refusal = http_answer(e)
        if refusal is None:
            raise
        return refusal


@serve.ingress()
class FrontIngress(Front):
    """One front serving HTTP itself (serve.front_replicas=1): the single process's app over its Service, one hop
    fewer than through a gateway (which would have no other front to retry on)."""

    def __serve_build_asgi_app__(self):
        return create_app(self.service)


@serve.ingress()
class Gateway:
    """The HTTP ingress: the single process's app over a GatewayService (requests retried on a live front)."""

    async def __init__(self, config_json: str, front):
        self.service = GatewayService(front, ml_collections.ConfigDict(json.loads(config_json)))
        await self.service.start()

    def __serve_build_asgi_app__(self):
        return create_app(self.service)


class ShardPreparer:
    """The command's `cfir_jax.cluster.reload.Shards`: each shard loads a version, in parallel, before a reload
    publishes it (a call routed by that version, so a replica that loads it is one Ray then sends it to)."""

    def __init__(self, app: str, shards: int):
        self.app, self.shards, self.handles = app, shards, []

    def prepare(self, vid: str, timeout_s: float) -> None:
        if not self.handles:
            self.handles = [serve.get_deployment_handle(f"ShardReplica{s}", self.app) for s in range(self.shards)]
        calls = [h.options(multiplexed_model_id=vid).prepare.remote() for h in self.handles]
        for s, call in enumerate(calls):
            try:
                call.result(timeout_s=timeout_s)
            except Exception as e:  # noqa: BLE001 - named in the reload's one line
                raise CfirError(f"shard {s} could not load version {vid}: {first_line(e)}") from None


def build_app(workdir: str, config, config_spec: str, overrides: Sequence[str], methods: Sequence[str], relay):
    """The bound application: serve.shards ShardReplica deployments (with 2 or more) behind serve.front_replicas
    Fronts, behind the gateways (or, with one front, the front as the ingress). relay: the command's Relay actor."""
    s = config.serve
    num_rows = ImageCache.open(cache_path(config, Layout.of(workdir))).num_images
    shard_bounds(num_rows, int(s.shards))  # a bad shard count is refused here, in one line
    shard_cls = serve.deployment(ShardReplica)
    shards = [shard_cls.options(name=f"ShardReplica{n}", num_replicas=int(s.shard_replicas),
                                ray_actor_options={"num_cpus": float(s.shard_num_cpus)},
                                health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=30)
              .bind(workdir, config_spec, list(overrides), n, int(s.shards), relay)
              for n in range(int(s.shards))] if int(s.shards) > 1 else []
    one = int(s.front_replicas) == 1
    front = serve.deployment(FrontIngress if one else Front).options(
        name="Front", num_replicas=int(s.front_replicas), max_ongoing_requests=int(s.queue_size) + 16,
        ray_actor_options={"num_cpus": float(s.front_num_cpus), "num_gpus": float(s.front_num_gpus)},
        health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=60)
    fronts = front.bind(workdir, config_spec, list(overrides), list(methods), relay, *shards)
    if one:
        return fronts
    gateway = serve.deployment(Gateway).options(
        name="Gateway", num_replicas=int(s.gateway_replicas), max_ongoing_requests=4 * int(s.queue_size) + 16,
        ray_actor_options={"num_cpus": float(s.gateway_num_cpus)}, graceful_shutdown_timeout_s=60)
    return gateway.bind(s.to_json(), fronts)


def make_relay():
    """The command's Relay actor: no CPU reserved, restarted whenever its process dies (the command publishes the
    target into it again at its next tick)."""
    return ray.remote(num_cpus=0, max_restarts=-1)(Relay).remote()

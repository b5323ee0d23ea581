"""The cluster's HTTP ingress: the single process's app (`cfir_jax.serve.app.create_app`) over a service that checks
each request and hands it to a front replica, again to another one when the replica it reached died.

It holds no model and no index: what it checks (text, method, top_k) needs only the served methods and
retrieval.top_k, which it asks a front once; an image (POST /v1/search/image) is read and checked here and searched
by a front. A search is idempotent, so a request whose front replica died mid-way
(SIGKILL, an OOM, a lost node) is sent again, until serve.deadline_ms; only then is it answered 503 `front
unavailable`. /readyz is the fronts' readiness (shards included), polled every second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ray.exceptions import ActorUnavailableError, RayActorError

from cfir_jax.core.errors import first_line
from cfir_jax.serve.errors import Refused, Unavailable
from cfir_jax.serve.metrics import Metrics
from cfir_jax.serve.service import check_options, check_text, max_body

log = logging.getLogger("cfir_jax.serve")
POLL_S = 1.0  # how often /readyz's answer is refreshed from a front
_GONE = (RayActorError, ActorUnavailableError)  # the replica a call reached died or cannot be reached


class GatewayService:
    """What the app's handlers call (the Service's surface), over a DeploymentHandle to the fronts."""

    def __init__(self, front, settings):
        self.front, self.settings = front, settings
        self.metrics = Metrics()
        self.admin_token = os.environ.get("CFIR_ADMIN_TOKEN") or settings.admin_token
        self.stopping = False
        self.max_body = max_body(settings)
        self.methods: list[str] = []
        self.max_top_k = 0
        self._ready: tuple[bool, dict] = (False, {"ready": False, "reason": "starting: no front has answered yet"})
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        """Learns what the fronts serve, then keeps their readiness fresh."""
        self.methods, self.max_top_k = await self._call("describe")
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _call(self, op: str, *args):
        """A front's answer to op(*args), sent again (to a live replica) while the deadline allows."""
        deadline = time.monotonic() + self.settings.deadline_ms / 1e3
        while True:
            try:
                return await getattr(self.front, op).remote(*args)
            except _GONE as e:
                if time.monotonic() > deadline:
                    raise Unavailable(f"front unavailable: {first_line(e, 200)}") from None
                log.warning("a front replica is gone (%s); sending %s again", type(e).__name__, op)
                await asyncio.sleep(0.05)

    async def _poll(self) -> None:
        while not self.stopping:
            try:
                self._ready = await asyncio.wait_for(self._call("readiness"), timeout=max(POLL_S, 5.0))
            except Exception as e:  # noqa: BLE001 - said in /readyz; the next poll tries again
                self._ready = (False, {"ready": False, "reason": f"no front answers: {type(e).__name__}"})
            await asyncio.sleep(POLL_S)

    def check_text(self, text: str, what: str) -> str:
        return check_text(self.settings, text, what)  # the one rule of a query (cfir_jax.core.query_rule)

    def check_options(self, top_k: int, method: str | None) -> str:
        return check_options(self.methods, self.max_top_k, top_k, method)

    async def answer(self, docs, method: str, top_k: int, html: bool = False, gone_when=None):
        """A front's answer (sent again to another front when one dies; gone_when is not watched here: the front
        drops a request at its deadline)."""
        return await self._answered("answer", docs, method, top_k, html)

    async def search_image(self, image: bytes | None, image_id: str | None, top_k: int | None, qid: str,
                           where: tuple = (), fold: bool = True, facets: tuple = (), html: bool = False):
        """A checked image request, searched by a front (which embeds it and asks every shard; its corpus draws
        the gallery when `html`)."""
        return await self._answered("search_image", image, image_id, top_k, qid, where, fold, facets, html)

    async def _answered(self, op: str, *args):
        """A front's (200, answer, headers) as (answer, headers); its refusal (status, one line, headers: the table of
        `cfir_jax.serve.errors`) raised again, which the app answers as the front did."""
        status, body, headers = await self._call(op, *args)
        if status != 200:
            raise Refused(body, status, headers)
        return body, headers

    def readiness(self) -> tuple[bool, dict]:
        ready, body = self._ready
        if self.stopping:
            return False, {**body, "ready": False, "reason": "stopping: answering the requests already accepted"}
        return ready, body

    def refresh_metrics(self) -> None:
        """This ingress's request counts and latencies (the stages' times are the fronts')."""

    async def reload(self) -> dict:
        """The fronts' reload (the command's, of the whole cluster): what serves now, or its refusal raised."""
        return (await self._answered("reload"))[0]

    async def shutdown(self) -> None:
        self.stopping = True
        if self._poller is not None:
            self._poller.cancel()

"""The service's HTTP app (`cfir_jax.serve.app`: the real Service, batcher, image queue and middleware) over a
stand-in index, served by uvicorn on 127.0.0.1 in a thread of the test's process: the doors without a model, for the
quick tier's tests and fuzzing. A text's "result" is one hit; an image is really decoded (the cache's preprocessing,
its pixels counted first) and embedded by a stand-in tower, and searched over four stand-in rows."""

import contextlib
import logging
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import uvicorn

from cfir_jax.api.index import Index
from cfir_jax.core.config_serve import serve_config
from cfir_jax.retrieve import image_query
from cfir_jax.retrieve.pipeline import RankedImage, Retrieval
from cfir_jax.serve.app import create_app
from cfir_jax.serve.middleware import http_protocol
from cfir_jax.serve.service import Service

IDS = ["img-a", "img-b", "img-c", "img-d"]
SIDE = 8  # the stand-in tower's image size


class StandInTower:
    """The tower's interface (batch_size, image_size, __call__): every image embeds as one fixed unit row, after
    `delay_s` (a slow tower)."""

    batch_size, image_size = 1, SIDE

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.calls = delay_s, 0

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        self.calls += 1
        time.sleep(self.delay_s)
        return np.full((len(pixels), 4), 0.5, np.float32)


class StandInImages(image_query.ImageSearch):
    """An image search over IDS without stores: the real decode (pixels counted from the header), the lock, the
    deadline's checks; the stand-in tower; every row scores 0.5."""

    def __init__(self, retriever):
        self.retriever_tower = retriever.tower
        self.stores = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(image_size=SIDE)),
                                      model_dir="W/model", live=SimpleNamespace(num_live=len(IDS),
                                      is_removed=lambda rows: np.zeros(len(rows), bool)))
        self.cache = SimpleNamespace(manifest={"source": "model"}, fingerprint="vision-standin", ids=IDS,
                                     path="W/image_cache", row=lambda i: IDS.index(i) if i in IDS else None,
                                     gather=lambda rows: np.full((len(rows), 4), 0.5, np.float32))
        self.norm, self.searcher, self.note = 1.0, None, "stand-in search"
        self._encoder, self.lock = None, threading.Lock()

    def encoder(self):
        return self.retriever_tower, 0.0

    def nearest(self, query, top_k, live):
        k = min(top_k, len(IDS))
        return np.full(k, 0.5, np.float32), np.arange(k)


class StandInRetriever:
    """A Retriever's surface for the service: each document's result is one hit; images by StandInImages."""

    entities = None
    image_search = StandInImages

    def __init__(self, tower: StandInTower, max_top_k: int):
        self.tower = tower
        self.config = SimpleNamespace(retrieval=SimpleNamespace(top_k=max_top_k))
        self.texts: list[str] = []

    def retrieve_many(self, docs, progress=False):
        self.texts += [d.text for d in docs]
        return [Retrieval([RankedImage(1, IDS[0], 0.5, 0)], [], [], "a summary", "", 1, {"er": 0.1}) for _ in docs]

    def describe_image(self, image_id):
        return f"the caption of {image_id}", ""


class NoImages:
    """A stand-in engine's image search (`image_query.prepare` makes it): none; its text path is under test."""

    def __init__(self, retriever):
        pass


def standin_index(engine, max_top_k: int = 50, serve=None) -> Index:
    """The library's `Index` over a stand-in engine, opened as a service opens its methods (one: "cfir"), over a
    workdir that is not there (version 0); its config: retrieval.top_k and the serve section (`settings()`)."""
    serve = serve if serve is not None else settings()
    config = SimpleNamespace(retrieval=SimpleNamespace(top_k=max_top_k), serve=serve)
    index = Index(config, "W", "cfir", make=lambda *args, **options: engine)
    index.open_methods(["cfir"])
    return index


class Generation(SimpleNamespace):
    """A LoadedIndex's surface; like one, it takes weak references (the batcher holds damage against it by one)."""


class StandInHolder:
    """The IndexHolder's surface: one loaded stand-in index, never reloaded."""

    reloading, last_reload = False, None

    def __init__(self, retriever: StandInRetriever, max_top_k: int, serve=None):
        self.current = Generation(
            index=standin_index(retriever, max_top_k, serve), methods=("cfir",), version=3, entity_pool=None,
            max_top_k=max_top_k, workdir="W",
            fingerprint="standin", loaded_at=0.0,
            describe=lambda: {"workdir": "W", "version": 3, "methods": ["cfir"], "max_top_k": max_top_k,
                              "loaded_at": "1970-01-01T00:00:00Z"})

    def close(self) -> None:
        pass


def settings(**overrides):
    """The config's serve section, its defaults, with `overrides`; the background verification off."""
    s = serve_config()
    s.update(verify_mb_per_s=0.0, **overrides)
    return s


@contextlib.contextmanager
def serving(tower_delay_s: float = 0.0, max_top_k: int = 50, retriever=None, **overrides):
    """Serves the app over the stand-in index on 127.0.0.1: yields (url, service, retriever); stops it after. The
    log records the service writes (an internal error, a traceback) are in `service.log_records`. retriever: the
    engine (default: a StandInRetriever)."""
    retriever = retriever if retriever is not None else StandInRetriever(StandInTower(tower_delay_s), max_top_k)
    serve = settings(**overrides)
    svc = Service(StandInHolder(retriever, max_top_k, serve), serve)
    records: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = records.append
    watched = [logging.getLogger(name) for name in ("cfir_jax.serve", "uvicorn.error", "uvicorn")]
    for logger in watched:
        logger.addHandler(catcher)
    svc.log_records = records
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning", access_log=False, lifespan="on",
                                           timeout_keep_alive=5, http=http_protocol()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", svc, retriever
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        for logger in watched:
            logger.removeHandler(catcher)

"""Search by image: the nearest images of an image over the live rows of the image cache.

An image given as encoded bytes is decoded with the cache's own preprocessing (`cfir_jax.model.preprocess`) and
embedded by the vision tower that built the cache (`cfir_jax.model.image_tower`, at the cache's compute dtype): the
tower of the model that scores the Retriever's queries, whose vision fingerprint the cache's must equal
(`cfir_jax.retrieve.stores`). An image already indexed may be named by its id instead: its cache row is the query.

The answer is the query's nearest live rows by dot product, searched as the entity index's switch
`index.entity_index.backend` says: 'scann' with the ScaNN searcher the entity index kept over this cache (rows
appended since searched exactly, `cfir_jax.search.knn.search_with_tail`), 'exact' with the SR front end's exact
whole-cache search (on the devices when SR runs there), 'auto' as the entity index was built. Without a stored
searcher (or an entity index: the dense methods open none) the search is exact, and the result's note says which
search answered. Removed rows never answer (`cfir_jax.search.live_rows`). A Ray front embeds here and searches its
shards, through its Retriever's scoring (`cfir_jax.cluster.scoring.ShardedSR`).

What an image search reads is opened with the Retriever (`prepare`, called where the Retriever is opened, under
the same version's reading: the library's `Index`, the service's load and reload): a later commit that replaces the
entity index cannot pair this cache with another version's ScaNN tree. The tower is made by `warm` (the service, at
load: its one program, a batch of one image padded to the local device count, compiles then) or on the first
image. An image's pixels are counted from its header before it is decoded (`max_pixels`: serve.max_image_pixels),
and it is decoded outside the lock that serialises the tower, so a slow decode holds no other search back; past its
`deadline` a search stops before its next stage. The records are the pipeline's `Retrieval` and `RankedImage`,
with no entities.
"""

from __future__ import annotations

import io
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import QueryRefused, check_top_k
from cfir_jax.retrieve.pipeline import RankedImage, Retrieval, Retriever
from cfir_jax.retrieve.queries import read_bounded
from cfir_jax.search.knn import ScannSearcher, search_with_tail
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.stores.integrity import check_embeddings, check_scores, row_norm_bound

__all__ = ["Expired", "ImageSearch", "QueryImageTooLarge", "UnknownImage", "UnsupportedImage", "UnusableImage",
           "prepare", "read_image", "search_image", "warm"]


class UnusableImage(CfirError):
    """The image cannot be searched with: empty, undecodable, too large, or this index has no tower to embed it."""


class QueryImageTooLarge(UnusableImage):
    """The image announces more pixels than serve.max_image_pixels (or PIL's bomb limit): refused undecoded."""


class UnsupportedImage(UnusableImage):
    """The image is in a format outside JPEG, PNG, WebP, GIF, BMP and TIFF: refused unread (a service's 415)."""


class UnknownImage(CfirError):
    """No live image of the index has the id given."""


class Expired(CfirError):
    """The search's deadline passed before its next stage: it stopped there."""


def read_image(path: str | Path, limit: int) -> bytes:
    """The bytes of an image file, refused in one line when missing, not a file, empty or over `limit` bytes."""
    return read_bounded(path, "image", limit, lambda size: f"{size:,} bytes, over serve.max_image_bytes={limit:,}",
                        UnusableImage)


class ImageSearch:
    """What one Retriever's image queries share: its stores, the tower (made on the first image), the searcher.
    A subclass may search elsewhere: `_searcher` (which search, its note) and `nearest` (query [1, D] -> hits)."""

    def __init__(self, retriever: Retriever):
        # Parts, not the Retriever: the Retriever keys this object weakly, so nothing here may hold it.
        self.stores, self.sr = retriever.stores, retriever.sr
        self.entities = retriever.entities
        self.cache = self.stores.cache
        self.norm = row_norm_bound(self.cache.manifest)  # the largest norm of a stored row
        self._encoder = None
        self.lock = threading.Lock()  # one tower call and search at a time per Retriever (buffers, making the tower)
        self.searcher, self.note = self._searcher(str(retriever.config.index.entity_index.backend))

    def exact_note(self) -> str:
        """The result's note when every live row is searched exactly."""
        return f"nearest images: exact search over {self.stores.live.num_live:,} live images"

    def wants_scann(self, backend: str) -> bool:
        """Whether `backend` (index.entity_index.backend) asks for ScaNN: 'scann', or 'auto' when the entity index
        was built with ScaNN."""
        index = self.stores.entity_index
        return not (backend == "exact" or index is None or
                    (backend == "auto" and index.manifest.get("backend") != "scann"))

    def _searcher(self, backend: str) -> tuple[ScannSearcher | None, str]:
        """The ScaNN searcher the entity index kept over this very cache when `backend` asks for it
        (`wants_scann`); None (exact) otherwise. Also the note that says which search answered."""
        exact, index = self.exact_note(), self.stores.entity_index
        if not self.wants_scann(backend):
            return None, exact
        same_cache = index.manifest.get("cache_fingerprint", self.cache.content_fingerprint) == \
            self.cache.content_fingerprint
        if not index.manifest.get("has_searcher") or not same_cache:
            return None, exact + f" (index.entity_index.backend={backend}, but the entity index kept no ScaNN " \
                "searcher over this cache)"
        loaded = self.entities.searcher if self.entities is not None else None
        return loaded or ScannSearcher.load(index.searcher_dir()), (
            f"nearest images: ScaNN over {self.stores.live.num_live:,} live images (the entity index's searcher, "
            f"index.entity_index.backend={backend})")

    @property
    def has_tower(self) -> bool:
        """Whether the cache was made by this index's vision tower (not imported), so a new image can be embedded."""
        manifest = self.cache.manifest
        return manifest.get("source", "model") == "model" and not str(self.cache.fingerprint).startswith("precomputed:")

    def check_tower(self) -> None:
        """Refuses (one line) an image that this index cannot embed: its cache was imported."""
        if not self.has_tower:
            raise UnusableImage(
                f"{self.cache.path}: its embeddings were imported (index.image_cache.precomputed), not made by a "
                "vision tower of this index, so a new image cannot be embedded like them: query an indexed "
                "image by its id, or rebuild the cache with --config.index.image_cache.precomputed= --stages "
                "image_cache")

    def encoder(self) -> tuple[object, float]:
        """The vision tower (made and compiled on the first call) and the ms that call spent making it."""
        if self._encoder is not None:
            return self._encoder, 0.0
        self.check_tower()
        manifest = self.cache.manifest
        # why: flax and the vision tower load only when a tower is made (the service's load, or a first image)
        from cfir_jax.model.image_tower import ImageEncoder

        t0 = time.perf_counter()
        encoder = ImageEncoder(self.stores.model, str(manifest.get("compute_dtype", "float32")), batch_size=1)
        # The one compile, now: the zero image's shape is every query's.
        np.asarray(encoder(np.zeros((encoder.batch_size, encoder.image_size, encoder.image_size, 3), np.float32)))
        self._encoder = encoder
        return encoder, 1e3 * (time.perf_counter() - t0)

    def decode(self, image: bytes, max_pixels: int | None, times: dict[str, float]) -> np.ndarray:
        """Encoded image bytes -> its pixels [S, S, 3] float32 (the cache's preprocessing), the ms into `times`;
        refused undecoded past `max_pixels` (QueryImageTooLarge) and when this index has no tower to embed them."""
        # why: PIL loads only when an image is decoded
        from cfir_jax.model.preprocess import ImageDecodeError, ImageTooLarge, UnsupportedImageFormat, decode_image

        self.check_tower()
        t0 = time.perf_counter()
        try:
            pixels = decode_image(image, int(self.image_size), max_pixels)
        except ImageTooLarge as e:
            raise QueryImageTooLarge(f"the image ({len(image):,} bytes) is too large: {e}") from None
        except UnsupportedImageFormat as e:
            raise UnsupportedImage(f"the image ({len(image):,} bytes) cannot be used: {e}") from None
        except ImageDecodeError as e:
            raise UnusableImage(f"the image ({len(image):,} bytes) cannot be used: {e}") from None
        times["decode"] = 1e3 * (time.perf_counter() - t0)
        return pixels

    @property
    def image_size(self) -> int:
        """The side the tower takes (the model's image size): what an image is resized to."""
        return int(self.stores.model.config.image_size)

    def embed(self, pixels: np.ndarray, times: dict[str, float]) -> np.ndarray:
        """Pixels [S, S, 3] -> their embedding [1, D] float32 by the tower (made here on first use), the ms into
        `times`. The caller holds `lock`."""
        encoder, load_ms = self.encoder()
        if load_ms:
            times["tower_load"] = load_ms
        batch = np.zeros((encoder.batch_size, *pixels.shape), np.float32)
        batch[0] = pixels
        t1 = time.perf_counter()
        query = np.asarray(encoder(batch))[:1]
        times["tower"] = 1e3 * (time.perf_counter() - t1)
        check_embeddings(query, self.stores.model_dir or self.stores.layout.model, "image")
        return query

    def row_of(self, image_id: str) -> int:
        """The cache row of a live image, refused (UnknownImage) when unknown, skipped or removed; the refusal
        names the id, never the workdir's path (a service answers it to anyone)."""
        row = self.cache.row(image_id) if isinstance(image_id, str) else None
        shown = repr(image_id) if len(repr(image_id)) <= 80 else repr(image_id)[:77] + "..."
        if row is None:
            raise UnknownImage(f"image id {shown} is not in the index (unknown, or skipped when the image cache "
                               "was built: its skipped.tsv says why)")
        if self.stores.live.is_removed(np.asarray([row]))[0]:
            raise UnknownImage(f"image id {shown} was removed (index.py --remove): it answers no query and is none")
        return row

    def nearest(self, query: np.ndarray, top_k: int, live: LiveRows) -> tuple[np.ndarray, np.ndarray]:
        """The query's top_k rows of `live` (the live rows, or a filter's): (scores [k'], rows [k']), best first,
        padding dropped."""
        if self.searcher is not None:
            scores, rows = search_with_tail(self.searcher, self.cache.embeddings, query, top_k, live.removed)
        else:
            scores, rows = self.sr.exact_search(query, top_k, live)
        scores, rows = np.asarray(scores[0]), np.asarray(rows[0])
        return scores[rows >= 0], rows[rows >= 0]


_SEARCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Retriever -> ImageSearch
_SEARCHES_LOCK = threading.Lock()


def prepare(retriever: Retriever) -> ImageSearch:
    """The retriever's image search, opened now (call it where the Retriever is opened, under the same version's
    reading): an ImageSearch, or what the retriever's class names as its `image_search` (a stand-in's). A
    Retriever never prepared gets one on its first image."""
    with _SEARCHES_LOCK:
        if retriever not in _SEARCHES:
            _SEARCHES[retriever] = getattr(type(retriever), "image_search", ImageSearch)(retriever)
        return _SEARCHES[retriever]


def warm(retriever: Retriever) -> float:
    """Makes the retriever's tower and runs one small image through decoding and the tower (its one program
    compiled), as a service does before it says it is ready; the seconds it took. The search itself is the text
    path's (its warm-up runs it; a cluster's shards load their version only later). Nothing to do (0) when the
    cache was imported."""
    engine = prepare(retriever)
    if not engine.has_tower:
        return 0.0
    # why: PIL loads only to make the warm-up's image
    from PIL import Image as PILImage

    t0 = time.perf_counter()
    png = io.BytesIO()
    PILImage.new("RGB", (8, 8), (128, 96, 64)).save(png, "PNG")
    pixels = engine.decode(png.getvalue(), None, {})
    with engine.lock:
        engine.embed(pixels, {})
    return time.perf_counter() - t0


def search_image(retriever: Retriever, *, image: bytes | None = None, image_id: str | None = None, top_k: int,
                 max_pixels: int | None = None, deadline: float | None = None, where=None) -> Retrieval:
    """The top_k nearest live images of an image: given as encoded bytes (`image`: JPEG, PNG, WebP, ...; embedded
    by the index's vision tower) or as the id of an indexed image (`image_id`: its cached row). max_pixels: the
    most pixels an image's header may announce (serve.max_image_pixels; None: PIL's own limit); deadline: a
    time.monotonic() past which the search stops before its next stage. Raises UnusableImage (bad bytes, no
    tower; QueryImageTooLarge past max_pixels), UnknownImage (no live image of that id), Expired, or CfirError
    (arguments). where: filters on the images' fields (`cfir_jax.retrieve.filters`): only images that pass
    answer (the query image itself need not pass).

    times_ms: decode, tower (and tower_load on the query that made it) or lookup; search; hits."""
    if (image is None) == (image_id is None):
        raise CfirError("give an image's bytes (image) or an indexed image's id (image_id), not both or neither")
    if check_top_k(top_k) < 1:  # an int; the doors held it to retrieval.top_k (the rule), a search needs one hit
        raise QueryRefused(f"top_k={top_k} out of range: at least 1")
    if image is not None and not (isinstance(image, (bytes, bytearray, memoryview)) and len(image)):
        raise UnusableImage("the image is empty" if isinstance(image, (bytes, bytearray, memoryview))
                            else f"image must be the image's bytes, got {type(image).__name__}")
    engine = prepare(retriever)
    times: dict[str, float] = {}
    pixels = engine.decode(bytes(image), max_pixels, times) if image is not None else None  # outside the lock
    with engine.lock:
        _in_time(deadline, "embedding the image" if image is not None else "its search")
        if pixels is not None:
            query, query_norm = engine.embed(pixels, times), 1.0
            _in_time(deadline, "its search")
        else:
            t0 = time.perf_counter()
            query = engine.cache.gather([engine.row_of(image_id)])
            times["lookup"], query_norm = 1e3 * (time.perf_counter() - t0), engine.norm
        t1 = time.perf_counter()
        live, note = retriever.filters.rows(tuple(where), engine.stores.live) if where else (engine.stores.live, "")
        scores, rows = engine.nearest(query, top_k, live)
        searched = live.num_live
        t2 = time.perf_counter()
    check_scores(scores, query_norm * engine.norm, str(engine.cache.path))  # a damaged row: one line, never a hit
    ids = engine.cache.ids
    hits = [RankedImage(n + 1, ids[int(r)], float(s), int(r)) for n, (s, r) in enumerate(zip(scores, rows))]
    times.update(search=1e3 * (t2 - t1), hits=1e3 * (time.perf_counter() - t2))
    return Retrieval(hits, [], [], "", "; ".join(n for n in (engine.note, note) if n), searched, times)


def _in_time(deadline: float | None, before: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise Expired(f"the deadline passed before {before}: the search stopped there")

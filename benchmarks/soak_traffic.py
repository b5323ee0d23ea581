"""The soak's traffic and its checks (`benchmarks/serve_soak.py`): the requests it sends (text searches, with filters,
without folding, in French; batches; images by id and uploaded; `cfir_jax.Client` searches with its retries; a
few hostile bodies), what one process answers to each at every committed version (`Reference`, an in-process
`cfir_jax.Index` opened once per version), and the tally of every answer against it (ids and order at the version
the answer names; refusals by kind; 500s; requests never answered)."""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
import threading
import time
from pathlib import Path

EXACT = {"retrieval__sr": "exact"}  # the soak's services and its reference score exactly (shards merge bit-equal)
TOP_K = 10
FRENCH = ["Le musée d'Elmwood conserve les archives du village, la cathédrale et la forêt, selon Kevin Thomas.",
          "Une vieille photographie du port et de la grève, prise depuis l'autoroute au nord du village."]
HOSTILE = [(b"{not json", "application/json"), (b"[1, 2]", "application/json"), (b'{"text": ""}', "application/json"),
           (b'{"text": "x", "top_k": 0}', "application/json"), (b'{"text": "\xff\xfe"}', "application/json"),
           (b'{"documents": [1, 2]}', "application/json"), (b"\x89PNG\r\n\x1a\n" + bytes(40), "image/png"),
           (b'{"text": "x", "where": ["colour=red"]}', "application/json"), (b"x" * 300, "text/plain"),
           (b'{"image_id": ["a"]}', "application/json")]
HOSTILE_PATHS = ["/v1/search", "/v1/search/batch", "/v1/search/image", "/v1/search/html"]


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of the mix: kind, the reference keys its answer is checked against (a batch: one per document),
    and what is sent."""
    kind: str
    keys: tuple[str, ...]
    path: str
    json: dict | None = None
    data: dict | None = None
    files: dict | None = None
    raw: tuple[bytes, str] | None = None


@dataclasses.dataclass
class Record:
    """An answer: when it was sent (s since the start), the ask, its HTTP status (0: none came; -1: the client's
    own error), the version it names, the hit ids (a batch: a list per document) or the error line, latency."""
    t: float
    ask: Ask
    status: int
    version: int | None
    got: object
    latency_s: float


def make_asks(documents: list[tuple[str, str]], image_ids: list[str], image: bytes) -> list[Ask]:
    """The mix, as weights by repetition: text searches most, then each other kind."""
    asks = []
    for i, t in documents:
        asks += [Ask("text", (f"text:{i}",), "/v1/search", {"text": t, "id": i, "top_k": TOP_K})] * 3
        asks.append(Ask("filter", (f"where:{i}",), "/v1/search", {"text": t, "id": i, "top_k": TOP_K,
                                                                   "where": ["n<=1"]}))
        asks.append(Ask("nofold", (f"nofold:{i}",), "/v1/search", {"text": t, "id": i, "top_k": TOP_K,
                                                                    "fold": False}))
        asks.append(Ask("client", (f"text:{i}",), "client", {"text": t, "id": i}))
    for n, t in enumerate(FRENCH):
        asks.append(Ask("french", (f"fr:{n}",), "/v1/search", {"text": t, "id": f"fr{n}", "top_k": TOP_K,
                                                               "lang": "fr"}))
    for n in range(0, len(documents) - 2, 2):
        part = documents[n:n + 3]
        asks.append(Ask("batch", tuple(f"text:{i}" for i, _ in part), "/v1/search/batch",
                        {"documents": [{"id": i, "text": t} for i, t in part], "top_k": TOP_K}))
    for image_id in image_ids:
        asks.append(Ask("image_id", (f"image:{image_id}",), "/v1/search/image",
                        data={"image_id": image_id, "top_k": str(TOP_K)}))
    asks += [Ask("upload", ("upload",), "/v1/search/image", data={"top_k": str(TOP_K)},
                 files={"image": ("p.png", image, "image/png")})] * 2
    asks += [Ask("hostile", (), HOSTILE_PATHS[n % len(HOSTILE_PATHS)], raw=h) for n, h in enumerate(HOSTILE)]
    return asks


class Reference:
    """What one process answers at each committed version: {version: {key: hit ids, or ("refused", line)}}."""

    def __init__(self, documents, image_ids, image: bytes):
        self.documents, self.image_ids, self.image = documents, image_ids, image
        self.answers: dict[int, dict[str, object]] = {}
        self.seconds: list[float] = []

    def record(self, workdir: str) -> int:
        """The answers of the version the workdir holds now (the soak commits nothing meanwhile); that version."""
        import cfir_jax
        from cfir_jax.core.errors import CfirError
        from cfir_jax.core.query_rule import Query

        t0 = time.monotonic()
        out: dict[str, object] = {}
        with cfir_jax.open(workdir, **EXACT) as index:
            def keep(key, *args, **kwargs):
                try:
                    out[key] = index.search(*args, top_k=TOP_K, **kwargs).ids
                except CfirError as e:
                    out[key] = ("refused", str(e))

            for i, t in self.documents:
                keep(f"text:{i}", t, id=i)
                keep(f"where:{i}", t, id=i, where=["n<=1"])
                keep(f"nofold:{i}", Query(t, id=i, top_k=TOP_K, fold=False))
            for n, t in enumerate(FRENCH):
                keep(f"fr:{n}", t, id=f"fr{n}", lang="fr")
            for image_id in self.image_ids:
                keep(f"image:{image_id}", image_id=image_id)
            keep("upload", image=self.image)
            version = index.version
        self.answers[version] = out
        self.seconds.append(time.monotonic() - t0)
        return version


class Traffic:
    """`threads` senders, each picking asks at random until `end`; every outcome kept as a Record."""

    def __init__(self, url: str, asks: list[Ask], end: float, t0: float, timeout_s: float, seed: int = 26):
        self.url, self.asks, self.end, self.t0, self.timeout_s = url, asks, end, t0, timeout_s
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self.seed = seed

    def run(self, threads: int) -> None:
        workers = [threading.Thread(target=self._send, args=(n,), daemon=True) for n in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _send(self, n: int) -> None:
        import httpx

        import cfir_jax

        rng = random.Random(self.seed + n)
        client = cfir_jax.Client(self.url, deadline_s=self.timeout_s)
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as http:
            while time.monotonic() < self.end:
                ask = rng.choice(self.asks)
                t = time.monotonic()
                record = self._one(http, client, ask)
                record.t, record.latency_s = t - self.t0, time.monotonic() - t
                with self.lock:
                    self.records.append(record)

    def _one(self, http, client, ask: Ask) -> Record:
        import httpx

        from cfir_jax.api.client import ServiceError
        from cfir_jax.core.errors import CfirError

        if ask.path == "client":
            try:
                r = client.search(ask.json["text"], id=ask.json["id"], top_k=TOP_K)
                return Record(0, ask, 200, r.version, r.ids, 0)
            except ServiceError as e:
                return Record(0, ask, e.status, None, str(e), 0)
            except CfirError as e:  # no answer within the deadline, every retry included
                return Record(0, ask, 0, None, str(e), 0)
        try:
            if ask.raw is not None:
                r = http.post(ask.path, content=ask.raw[0], headers={"content-type": ask.raw[1]})
            else:
                r = http.post(ask.path, json=ask.json, data=ask.data, files=ask.files)
        except httpx.HTTPError as e:
            return Record(0, ask, 0, None, f"{type(e).__name__}: {e}", 0)
        version = r.headers.get("x-index-version", "")
        version = int(version) if version.isdigit() else None
        try:
            body = json.loads(r.content)
            one_line = isinstance(body, dict) and b"\n" not in r.content.rstrip(b"\n")
        except ValueError:
            body, one_line = None, False
        if r.status_code != 200:
            error = body.get("error") if isinstance(body, dict) else None
            got = error if one_line and isinstance(error, str) else f"not one JSON line: {r.text[:120]!r}"
            return Record(0, ask, r.status_code, version, got, 0)
        if ask.kind == "batch":
            return Record(0, ask, 200, version, [[h["image_id"] for h in a["hits"]] for a in body["results"]], 0)
        return Record(0, ask, 200, version, [h["image_id"] for h in body["hits"]], 0)


def refusal_kind(status: int, line: str) -> str:
    """A refusal's kind: its status and the words before its details ("503 shard 1 unavailable")."""
    words = re.split(r"[:(;]", line, maxsplit=1)[0].strip()
    return f"{status} {re.sub(r'[0-9]{3,}', 'N', words)[:60]}"


def tally(records: list[Record], reference: Reference) -> dict:
    """Every answer against the reference at the version it names: answered (the reference's ids, in order),
    refused (by kind: the one process's own refusal of that request counts as answered), wrong, lost (no answer at
    all), 500s, and answers that were not one JSON line."""
    out = collections.Counter()
    kinds, wrong = collections.Counter(), []
    for r in records:
        out["requests"] += 1
        if r.status == 0:
            out["lost"] += 1
            kinds[f"lost: {str(r.got)[:60]}"] += 1
            continue
        if r.status >= 500 and r.status != 503 and r.status != 504:
            out["http_500"] += r.status == 500
            out["other_5xx"] += r.status != 500
        if r.ask.kind == "hostile":  # refused in one JSON line: 4xx, or 503/504 when it waited past its deadline
            if str(r.got).startswith("not one JSON line") or not (400 <= r.status < 500 or r.status in (503, 504)):
                wrong.append(r)
            elif r.status < 500:
                out["hostile_refused"] += 1
            else:
                out["refused"] += 1
                kinds[refusal_kind(r.status, str(r.got))] += 1
            continue
        if str(r.got).startswith("not one JSON line"):
            out["not_one_line"] += 1
            kinds[refusal_kind(r.status, str(r.got))] += 1
            continue
        want = reference.answers.get(r.version, {}) if r.version is not None else {}
        expected = [want.get(k) for k in r.ask.keys]
        if r.status == 200:
            got = r.got if r.ask.kind == "batch" else [r.got]
            if r.version in reference.answers and got == expected:
                out["answered"] += 1
            else:
                wrong.append(r)
            continue
        refusal = ("refused", r.got)  # a refusal names no version: one process refuses it at some version
        if len(r.ask.keys) == 1 and any(v.get(r.ask.keys[0]) == refusal for v in reference.answers.values()):
            out["answered"] += 1  # refused as one process refuses it
            continue
        out["refused"] += 1
        kinds[refusal_kind(r.status, str(r.got))] += 1
    out["wrong"] = len(wrong)
    return {"counts": dict(out), "refusals": dict(kinds.most_common()),
            "wrong_examples": [(w.t, w.ask.kind, w.ask.keys, w.status, w.version, str(w.got)[:200]) for w in wrong[:8]]}


def removal_candidate(reference: Reference, removed: set[str], added: set[str], turn: int) -> str | None:
    """An image the latest version answers a text search with (so that its removal shows), not removed yet."""
    latest = reference.answers[max(reference.answers)]
    keys = sorted(k for k in latest if k.startswith("text:"))
    for k in keys[turn % len(keys):] + keys[:turn % len(keys)]:
        ids = latest[k]
        if isinstance(ids, list):
            for image in ids[1:]:
                if image not in removed and image not in added:
                    return image
    return None


def write_addition(folder: Path, rows: list[dict], turn: int) -> list[str]:
    """A folder `index.py --add` takes: rows of an images file (their image and precomputed embedding, as the
    collection's carry them), each under a new id with a field n (the filter's)."""
    import shutil

    (folder / "images").mkdir(parents=True, exist_ok=True)
    out, ids = [], []
    for k, row in enumerate(rows):
        image_id = f"soak{turn:03d}x{k}"
        shutil.copy(row["source"], folder / "images" / f"{image_id}.png")
        out.append({"id": image_id, "path": f"images/{image_id}.png", "caption": f"{row['caption']} ({turn}.{k})",
                    **({"embedding": row["embedding"]} if "embedding" in row else {}), "n": k % 4})
        ids.append(image_id)
    (folder / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    return ids

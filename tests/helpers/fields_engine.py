"""A stand-in engine whose images carry fields, filtered by the real `RowFilter` (`cfir_jax.retrieve.filters`: the
masks, the live rows, the notes) over real columns (`builders.image_fields.columns_of`): the library's `Index`, the
service (`standin_service.serving(retriever=...)`) and the client answer a filtered query with the ids of the rows
that pass, best first (row order), without a model. A document whose text is BOOM fails while its batch runs; one
whose text is HOLD waits for the engine's `gate` (the requests sent meanwhile queue into the next batch)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
from standin_service import NoImages

from cfir_jax.builders.image_fields import columns_of
from cfir_jax.core.image_field_types import FieldTypes
from cfir_jax.retrieve.filters import RowFilter
from cfir_jax.retrieve.pipeline import RankedImage, Retrieval
from cfir_jax.search.live_rows import LiveRows

BOOM = "boom: this document fails its batch"
HOLD = "hold: this document waits for the gate"


class Fields:
    """An image_fields store's surface: `columns` and `num_rows` of `rows` (dicts of field values)."""

    def __init__(self, rows: list[dict], kinds: dict[str, str] | None = None):
        self.columns, self.num_rows = columns_of(rows, FieldTypes(kinds).kinds), len(rows)


class FieldsFilter(RowFilter):
    """The real RowFilter over a Fields store given (not a workdir's)."""

    def __init__(self, fields: Fields):
        super().__init__(SimpleNamespace(live=LiveRows(None, fields.num_rows)))
        self._fields = fields
        self.checked = 0

    def check(self, where):
        self.checked += 1
        return super().check(where)


class FieldsEngine:
    """A Retriever's surface: each document's ranking is every live row that passes its filter, row 0 first."""

    entities = None
    image_search = NoImages

    def __init__(self, rows: list[dict], kinds: dict[str, str] | None = None, max_top_k: int = 50):
        self.filters = FieldsFilter(Fields(rows, kinds))
        self.ids = [f"img-{n}" for n in range(len(rows))]
        self.config = SimpleNamespace(retrieval=SimpleNamespace(top_k=max_top_k))
        self.batches: list[list[str]] = []
        self.gate = threading.Event()

    def retrieve_many(self, docs, progress=False, live=None):
        return self.filters.run(docs, self.filters.stores.live if live is None else live, self._ranked,
                                lambda note, n: [Retrieval([], [], [], "", note) for _ in range(n)])

    def _ranked(self, docs, live):
        self.batches.append([d.doc_id for d in docs])
        if any(d.text == HOLD for d in docs):
            self.gate.wait(30)
        if any(d.text == BOOM for d in docs):
            raise RuntimeError("the engine fell over on one document")
        rows = live.keep(np.arange(len(self.ids)))
        hits = [RankedImage(n + 1, self.ids[int(r)], 1.0 - n / 1e6, int(r)) for n, r in enumerate(rows)]
        return [Retrieval(list(hits), [], [], "", times_ms={"er": 0.1}, lang=d.lang or "en") for d in docs]

    def describe_image(self, image_id):
        return "", ""


async def together_and_alone(mb, engine: FieldsEngine, make_job, names, outcome) -> tuple[list, list]:
    """What each of `names`'s jobs gets in one micro-batch, and what each gets alone. The jobs (`make_job(loop, name,
    n)`) queue behind a HOLD job the engine's worker holds at its gate, so that they run as one batch; then each is
    submitted alone. `outcome(job)` awaits a job's answer as the test compares it."""
    loop = asyncio.get_running_loop()
    engine.gate.clear()
    holder = make_job(loop, "hold", 0)
    mb.submit(holder)
    held = [d.doc_id for d in holder.docs]
    while not engine.batches or engine.batches[-1] != held:  # the worker holds it: the rest queue behind
        await asyncio.sleep(0.005)
    jobs = [make_job(loop, name, n) for n, name in enumerate(names)]
    for job in jobs:
        mb.submit(job)
    engine.gate.set()
    await holder.future
    together = [await outcome(job) for job in jobs]
    alone = []
    for n, name in enumerate(names):
        job = make_job(loop, name, n)
        mb.submit(job)
        alone.append(await outcome(job))
    return together, alone

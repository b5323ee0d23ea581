"""One document's way through a batch of the Retriever (`cfir_jax.retrieve.pipeline`): its candidate lists (ER), their
union, its ranking, note and times so far."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Ranking:
    """One document's way through a batch: its candidate lists (ER), union, ranking and times so far."""

    lists: list = dataclasses.field(default_factory=list)
    scores: list | None = None
    used: list[str] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)
    union: np.ndarray | None = None
    ranked: tuple[np.ndarray, np.ndarray] | None = None
    note: str = ""
    agreement: float | None = None
    added: int = 0  # candidates BM25 added to ER's union
    times_ms: dict[str, float] = dataclasses.field(default_factory=dict)

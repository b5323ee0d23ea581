"""The service's Prometheus metrics (prometheus_client), in a registry of its own so that each app has its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Seconds: a query is tens of milliseconds; a queue under load, seconds.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("cfir_requests", "HTTP requests by endpoint and status", ("endpoint", "status"),
                                registry=r)
        self.latency = Histogram("cfir_request_seconds", "HTTP request latency by endpoint", ("endpoint",),
                                 buckets=_LATENCY, registry=r)
        self.stages = Histogram("cfir_stage_seconds", "per-document time of each retrieval stage (Result.times_ms)",
                                ("stage",), buckets=_LATENCY, registry=r)
        self.in_flight = Gauge("cfir_requests_in_flight", "search requests received and not yet answered", registry=r)
        self.queue_depth = Gauge("cfir_queue_depth", "documents waiting for a batch", registry=r)
        self.queue_wait = Histogram("cfir_queue_wait_seconds", "time a request waited before its batch ran",
                                    buckets=_LATENCY, registry=r)
        self.batch_docs = Histogram("cfir_batch_documents", "documents per micro-batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.dropped = Counter("cfir_dropped_requests", "requests dropped before their batch ran", ("reason",),
                               registry=r)
        self.rejected = Counter("cfir_rejected_requests", "requests refused because the queue was full", registry=r)
        self.reloads = Counter("cfir_reloads", "index reloads by outcome", ("outcome",), registry=r)
        self.entity_restarts = Counter("cfir_entity_worker_restarts", "spaCy worker processes replaced, by reason "
                                       "(died, deadline, start)", ("reason",), registry=r)
        self.entity_degraded = Gauge("cfir_entity_pool_degraded", "1 when worker crashes made the retrieval thread "
                                     "parse entities", registry=r)
        self.stores_damaged = Gauge("cfir_stores_damaged", "files the background verification found damaged",
                                    registry=r)
        self.index = Info("cfir_index", "the index being served", registry=r)

    def observe_stages(self, times_ms: dict[str, float]) -> None:
        for stage, ms in times_ms.items():
            self.stages.labels(stage).observe(ms / 1e3)

    def set_index(self, loaded) -> None:
        self.index.info({"version": str(loaded.version), "fingerprint": loaded.fingerprint, "workdir": loaded.workdir,
                         "methods": ",".join(loaded.methods), "loaded_at": loaded.describe()["loaded_at"]})

"""The config's `serve` section: the resident HTTP service (`retrieve.py --index W --serve`, `cfir_jax.serve`), in one
process or on Ray Serve. `cfir_jax.core.config.defaults` puts it under every experiment."""

from __future__ import annotations

import ml_collections


def serve_config() -> ml_collections.ConfigDict:
    """The `serve` section: the resident HTTP service (`retrieve.py --index W --serve`, `cfir_jax.serve`)."""
    return ml_collections.ConfigDict(
        dict(
            host="127.0.0.1",  # localhost unless told otherwise (--host)
            port=8080,
            methods=("cfir",),  # the methods answered (one Retriever each); the first is a request's default
            max_batch=16,  # documents per micro-batch (1: micro-batching off)
            max_wait_ms=5.0,  # how long a batch's first request waits for others (only while requests arrive together)
            verify_mb_per_s=32.0,  # the background re-read of every store against checksums.json (0: off)
            verify_interval_s=3600.0,  # pause between two background passes
            verify_on_reload=True,  # a reload verifies the new workdir's stores before swapping it in
            queue_size=64,  # documents waiting at most; past it a request is answered 503 with Retry-After
            deadline_ms=10000.0,  # a request not answered by then gets 504 (and is dropped if not yet started)
            # A request's whole body must arrive by then, from its start, whatever its pace; past it 408 and the
            # connection closed (a body dripped a byte at a time holds nothing longer). Raise it for large images
            # over slow links: serve.max_image_bytes at the clients' rate.
            body_deadline_ms=5000.0,
            max_text_bytes=65536,  # UTF-8 bytes of a query's text at every door (commands, library, service): 413
            max_batch_docs=64,  # documents in one POST /v1/search/batch
            # A query's filter (`where`, docs/filters.md) at every door (commands: exit 2; library; service: 413):
            # its conditions, the values of one condition (an `in` list), the UTF-8 bytes of all its fields and values.
            max_filter_conditions=16,
            max_filter_values=1024,
            max_filter_bytes=16384,
            max_image_bytes=20 << 20,  # bytes of one query image (POST /v1/search/image, --query-image); past it 413
            max_image_pixels=50_000_000,  # a query image's pixels, read from its header before decoding; past it 413
            image_queue_size=8,  # images waiting to be searched at most; past it a request is answered 503
            summary_cache=1024,  # query summaries kept by document hash (0: none); each costs a summary's text
            admin_token="",  # enables POST /v1/admin/reload (Bearer token); also read from CFIR_ADMIN_TOKEN
            # The cluster (serve.engine="ray": Ray Serve, cfir_jax.cluster; pip install -e ".[cluster]").
            engine="local",  # "local": this one process; "ray": fronts and index shards as Ray Serve deployments
            address="",  # a running Ray cluster to join ("auto", "HOST:6379"); "": start a local Ray (or --address)
            shards=1,  # index shards: shard s holds rows [s*N/S, (s+1)*N/S) of the image cache, memory-mapped
            shard_replicas=1,  # replicas of each shard (2: a dead replica costs no request)
            front_replicas=1,  # replicas of the front (entities, summary, query encoding, fan-out and merge)
            gateway_replicas=1,  # replicas of the HTTP ingress (no model: checks requests, sends them to a live front)
            # What Ray reserves per replica: GPUs of a front (the summarizer and text encoder run there), CPUs. The
            # sum over every replica must fit the head this command starts, or the free room of a cluster it joins.
            front_num_gpus=0.0, front_num_cpus=0.5, shard_num_cpus=0.25, gateway_num_cpus=0.25,
            head_num_cpus=0,  # logical CPUs of a Ray this command starts (0: every replica's sum, at least the cores)
            ready_timeout_s=600.0,  # every replica placed and loaded by then, or one line naming what waits; exit 2
            shard_timeout_s=2.0,  # a shard call not answered by then is sent again beside it (503 after deadline/2)
            object_store_mb=512,  # the object store of a Ray this command starts (not of a cluster it joins)
        )
    )


"""The served query of `accelerator.sh --parts serve`, three units each in its own process:

  serve:build  a real-size workdir (benchmarks/realsize.py: the paper's text tower, BART-large-CNN's shape, a
               4M x 768 cache, K = 10,000; random weights) built, or reused when every part is already at size;
  serve:local  `retrieve.py --serve --engine local` on it;
  serve:ray    `retrieve.py --serve --engine ray` with 1 shard (its front holds the GPU on an accelerator).

Each server is the real command on a free 127.0.0.1 port, at the paper's settings (top 1,000, fast SR, BART with 4
beams), with no summary cache (every request pays its summary) and no background verification. Measured: one
untimed request (it compiles the documents' length bucket), then p50/p95 at concurrency 1 and documents/s at
concurrency 16. The per-stage split (spaCy, BART, text tower, ER, SR: mean ms per document over the concurrency-1
requests) is the service's own `cfir_stage_seconds` from `/metrics`; the Ray gateway does not export its fronts'
stages, so the split is the single process's (the same work in the same order).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx

# Result.times_ms's stages as the issue names them.
STAGES = {"entities": "spaCy", "summary": "BART", "encode": "tower", "er": "ER", "score": "SR"}
SETTINGS = ("--config.serve.deadline_ms=600000", "--config.serve.queue_size=256", "--config.serve.summary_cache=0",
            "--config.serve.verify_mb_per_s=0")
_STAGE_LINE = re.compile(r'^cfir_stage_seconds_(sum|count)\{stage="(\w+)"\} ([0-9.e+-]+)$', re.M)


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """{stage: (seconds, documents)} so far, from the server's /metrics (empty where it exports no stages)."""
    return parse_stage_totals(httpx.get(f"{url}/metrics", timeout=60).text)


def parse_stage_totals(text: str) -> dict[str, tuple[float, float]]:
    """{stage: (seconds, documents)} of the `cfir_stage_seconds` histogram in a Prometheus text exposition."""
    out: dict[str, list[float]] = {}
    for kind, stage, value in _STAGE_LINE.findall(text):
        out.setdefault(stage, [0.0, 0.0])[kind == "count"] = float(value)
    return {stage: (s, n) for stage, (s, n) in out.items()}


def stage_split(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per document of each stage between two stage_totals."""
    split = {}
    for stage in STAGES:
        seconds, docs = after.get(stage, (0.0, 0.0))
        seconds0, docs0 = before.get(stage, (0.0, 0.0))
        if docs > docs0:
            split[STAGES[stage]] = 1e3 * (seconds - seconds0) / (docs - docs0)
    return split


def build(out: Path, sizes, world: str | None) -> list[dict]:
    # why: realsize sets JAX_PLATFORMS=cpu for its process (it builds from shapes on the host's CPU)
    import realsize

    t = time.perf_counter()
    reused = (out / "work" / "index.json").is_file()
    work = realsize.build(out, sizes.serve_size, sizes.serve_rows, Path(world) if world else None)
    spec = realsize.SIZES[sizes.serve_size]
    index = json.loads((work / "entity_index" / "manifest.json").read_text())  # a larger world raises the rows
    return [{"what": f"serve: the {sizes.serve_size} real-size workdir", "workdir": str(work),
             "shape": f"{index['n_images']:,} rows, K = {index['k']:,}, the {spec['model']} text tower",
             "seconds": time.perf_counter() - t, "reused": reused}]


# SR on the device, as "auto" picks it on a GPU or TPU; the dry run also shards the cache over its CPU devices.
DEVICE_SR = ("--config.retrieval.sr_backend=device",)
FORCED_SR = DEVICE_SR + ("--config.retrieval.sr_device_shard=always",)


def served(engine: str, work: Path, sizes, env: dict, accelerated: bool, forced: bool = False) -> list[dict]:
    """One engine's row: ready time, p50/p95 at concurrency 1, documents/s at concurrency 16, the stage split. SR
    runs on the device (forced on the CPU by the dry run)."""
    # why: realsize (the query documents) sets JAX_PLATFORMS=cpu in this process; the server keeps `env`
    import realsize
    import serve_load

    docs = realsize.query_documents(work, 1 + sizes.serve_c1 + sizes.serve_c16, sizes.serve_words)
    extra = ["--engine", engine]
    if engine == "ray":
        extra += ["--config.serve.shards=1"] + (["--config.serve.front_num_gpus=1"] if accelerated else [])
    server = serve_load.Server(str(work), *SETTINGS, *(FORCED_SR if forced else DEVICE_SR), *extra, env=env)
    try:
        timeout = 1800.0
        first = asyncio.run(serve_load.load(server.url, serve_load.search_bodies(docs[:1]), 1, timeout))
        before = stage_totals(server.url)
        c1 = asyncio.run(serve_load.load(server.url, serve_load.search_bodies(docs[1 : 1 + sizes.serve_c1]), 1,
                                         timeout))
        split = stage_split(before, stage_totals(server.url))
        c16 = asyncio.run(serve_load.load(server.url, serve_load.search_bodies(docs[1 + sizes.serve_c1 :]), 16,
                                          timeout))
    finally:
        code = server.stop()
    if code != 0 or c1["ok"] < c1["n"] or c16["ok"] < c16["n"] or first["ok"] < first["n"]:
        raise SystemExit(f"served ({engine}): {first['ok'] + c1['ok'] + c16['ok']} of "
                         f"{first['n'] + c1['n'] + c16['n']} requests answered, server exit {code}")
    label = "single process" if engine == "local" else "Ray, 1 shard" + (" (front on the GPU)" if accelerated else "")
    return [{"what": f"served, {label}", "served": engine, "sr": "device", "ready_s": server.ready_s,
             "first_ms": first["p50"],
             "p50_ms": c1["p50"], "p95_ms": c1["p95"], "c1": f"{c1['ok']}/{c1['n']}", "docs_s": c16["rate"],
             "c16": f"{c16['ok']}/{c16['n']}", "stages_ms": split, "exit": code,
             "words": sizes.serve_words, "load": "/".join(f"{x:.2f}" for x in os.getloadavg())}]


def run(which: str, sizes, realsize_dir: str, world: str | None = None, accelerated: bool = False,
        forced: bool = False) -> list[dict]:
    """The rows of unit serve:WHICH (build, local or ray); forced: a dry run's (SR sharded over the CPU devices)."""
    env = dict(os.environ)  # before realsize's import: the servers take the accelerator when there is one
    out = Path(realsize_dir)
    if which == "build":
        return build(out, sizes, world)
    if not (out / "work" / "index.json").is_file():
        raise SystemExit(f"{out}/work: no real-size workdir (serve:build did not finish)")
    return served(which, out / "work", sizes, env, accelerated, forced)


def markdown(rows: list[dict]) -> list[str]:
    """The served query's lines of accelerator.md: the workdir, then one table row per engine."""
    lines = ["", "The served query (`--parts serve`, benchmarks/accelerator_serve.py): "]
    for r in rows:
        if "workdir" in r:
            how = "reused" if r["reused"] else "built"
            lines[-1] += f"{r['workdir']} ({r['shape']}), {how} in {r['seconds']:.0f} s."
    lines += ["", "| engine | ready s | p50 c=1 ms | p95 c=1 ms | documents/s c=16 | ok c=1, c=16 | "
              + " | ".join(f"{name} ms" for name in STAGES.values()) + " | load |",
              "|---|---|---|---|---|---|" + "---|" * len(STAGES) + "---|"]
    for r in rows:
        if "served" in r:
            stages = " | ".join(f"{r['stages_ms'][n]:.1f}" if n in r["stages_ms"] else "-" for n in STAGES.values())
            lines.append(f"| {r['what'][len('served, '):]} | {r['ready_s']:.0f} | {r['p50_ms']:.1f} | "
                         f"{r['p95_ms']:.1f} | {r['docs_s']:.2f} | {r['c1']}, {r['c16']} | {stages} | {r['load']} |")
    lines += ["", "Stages: mean ms per document over the concurrency-1 requests, from the server's /metrics; the Ray "
              "gateway does not export its fronts' stages (theirs are the single process's work)."]
    return lines

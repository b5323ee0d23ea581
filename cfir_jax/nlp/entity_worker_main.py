"""One entity worker's own side (the process `cfir_jax.nlp.entity_workers` starts, which holds the pool's side): the
lines it reads and writes, JSON on its pipes.

It loads the pipeline once (`load_spacy`, `EntityExtractor`: the entities its parent would find), says so in a first
line (`"ready"`, or `{"error": ...}`: the one-line error of its parent's own load), then answers each line
`[task, [texts]]` with `[task, [entities per text]]` (or `[task, {"error": ...}]`). It ignores SIGINT and SIGTERM
(the process group's signals are the parent's, which drains and then stops it) and ends when its stdin closes: when
the pool closes it, or when the parent is gone. It loads the standard library only until spaCy.
"""

from __future__ import annotations

import json
import signal
import sys

READY = "ready"


def worker_main() -> None:
    """A worker's main: load the pipeline, say so, then answer each `[task, [texts]]` line with its entities."""
    # why: spaCy loads here, in the worker, never in the process that started it
    from cfir_jax.core.errors import first_line
    from cfir_jax.nlp.entities import EntityExtractor, load_spacy

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process group's signals are the parent's to act on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spacy_model, labels = json.loads(sys.argv[2])
    try:
        extractor = EntityExtractor(load_spacy(spacy_model or None), labels)
        list(extractor.extract(["warm up"]))
    except Exception as e:  # noqa: BLE001 - said to the parent in one line, which raises it as its own
        return _say({"error": first_line(e)})
    _say(READY)
    for line in sys.stdin:  # its end: the pool closed it, or the parent is gone
        task, texts = json.loads(line)
        try:
            _say([task, list(extractor.extract(texts))])
        except Exception as e:  # noqa: BLE001 - the chunk's own error, raised in the caller
            _say([task, {"error": first_line(e)}])


def _say(message) -> None:  # a worker's line
    try:
        print(json.dumps(message), flush=True)
    except (BrokenPipeError, OSError, ValueError):  # the parent closed its end: nobody will read it
        sys.exit(0)

"""A document's named entities parsed in a helper process started ahead of need, so that spaCy's import and model
load (about a second on a CPU) run beside the model's restore and the programs' loading, on a second core, instead
of before them. `retrieve.py --query` starts one (`start`) before it imports JAX; the query's entity ranking takes it
(`claim`) in place of loading spaCy itself. The helper runs the same `load_spacy` and `EntityExtractor` as the
in-process path, so the entities are the same; a pipeline it cannot load is the same one-line `CfirError`.

The helper reads one JSON string (a text) a line on its stdin and answers each with one JSON line (its entities),
after a first line saying that the pipeline is loaded (or why not: `{"error": ...}`). It ends when this process
closes it (`EntityHelper.close`, at exit at the latest), or when its stdin closes (this process died).
"""

from __future__ import annotations

import atexit
import json
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from cfir_jax.core.errors import CfirError

READY = "ready"
# The helper's own program: the package's folder first on its path (a script run from elsewhere finds it too).
_PROGRAM = "import sys; sys.path.insert(0, sys.argv[1]); from cfir_jax.nlp.entity_process import serve; serve()"
_STARTED: dict[str, EntityHelper] = {}


def _key(spacy_model: str | None, labels) -> str:
    return json.dumps([spacy_model or "", labels if labels is None or isinstance(labels, str) else list(labels)])


def start(spacy_model: str | None, labels: str | Sequence[str] | None) -> None:
    """Starts a helper for the pipeline `spacy_model` ('' or None: the default ones) and `labels` (as
    `EntityExtractor` takes them), unless one for them was started already."""
    key = _key(spacy_model, labels)
    if key not in _STARTED:
        _STARTED[key] = EntityHelper(key)


def claim(spacy_model: str | None, labels: str | Sequence[str] | None) -> EntityHelper | None:
    """The helper started for this pipeline and these labels (handed out once), or None when none was."""
    return _STARTED.pop(_key(spacy_model, labels), None)


class EntityHelper:
    """The helper process of one pipeline and label set: `extract(texts)` as `EntityExtractor.extract` does."""

    def __init__(self, key: str):
        root = str(Path(__file__).resolve().parents[2])
        # Its stderr is this process's (spaCy's warnings show as they would here); its answers come on stdout.
        self._proc = subprocess.Popen([sys.executable, "-c", _PROGRAM, root, key], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, encoding="utf-8")
        self._ready = False
        atexit.register(self.close)

    def ready(self) -> None:
        """Waits until the helper has loaded its pipeline; CfirError with its reason when it could not."""
        if not self._ready:
            said = self._proc.stdout.readline()
            if said.strip() != json.dumps(READY):
                raise self._failure(json.loads(said).get("error", "") if said.startswith("{") else "")
            self._ready = True

    def extract(self, texts: Iterable[str]) -> Iterator[list[str]]:
        """Yields, per text, its unique entity surface forms in order of first mention."""
        self.ready()
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise CfirError(f"document #{i}: text is {type(text).__name__}, expected str; fix the corpus reader")
            try:
                self._proc.stdin.write(json.dumps(text) + "\n")
                self._proc.stdin.flush()
            except OSError:  # the helper ended: its reason is on its stderr
                raise self._failure() from None
            line = self._proc.stdout.readline()
            if not line:
                raise self._failure()
            yield json.loads(line)

    def close(self) -> None:
        """Ends the helper at once (killed: it holds nothing but its pipes, and its own exit, spaCy's teardown, took
        a fifth of a second that a command's end waited for)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def _failure(self, reason: str = "") -> CfirError:
        """The helper's one-line reason (or its exit status, when it died: its traceback is on stderr)."""
        self.close()
        return CfirError(reason or f"the entity helper process ended (exit {self._proc.returncode})")


def serve() -> None:
    """The helper's main: load the pipeline, say so, then answer each text's line with its entities' line."""
    # why: spaCy loads here, in the helper, never in the process that started it
    from cfir_jax.nlp.entities import EntityExtractor, load_spacy

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the starting process's to report; stdin's end ends this
    spacy_model, labels = json.loads(sys.argv[2])
    try:
        extractor = EntityExtractor(load_spacy(spacy_model or None), labels)
    except CfirError as e:  # said by the process that started this one, as its own error
        print(json.dumps({"error": str(e)}), flush=True)
        return
    print(json.dumps(READY), flush=True)
    for line in sys.stdin:
        (found,) = extractor.extract([json.loads(line)])
        print(json.dumps(found), flush=True)

"""A document's named entities parsed in a helper process started ahead of need, so that spaCy's import and model
load (about a second on a CPU) run beside the model's restore and the programs' loading, on a second core, instead
of before them. `retrieve.py --query` starts one (`start`) before it imports JAX; the query's entity ranking takes it
(`claim`) in place of loading spaCy itself. The helper runs the same `load_spacy` and `EntityExtractor` as the
in-process path, so the entities are the same; a pipeline it cannot load is the same one-line `CfirError`.

The helper reads one JSON string (a text) a line on its stdin and answers each with one JSON line (its entities),
after a first line saying that the pipeline is loaded (or why not: `{"error": ...}`). It ends when this process
closes it (`EntityHelper.close`, at exit at the latest), or when its stdin closes (this process died).

It runs as hardened as the command: `python -E -P`, so neither the folder the command runs in nor PYTHONPATH is on
its path (a `json.py` there is never imported), and this process's own `cfir_jax` is loaded by its path. Every read
of its answers waits at most `deadline_s` (retrieval.entity_deadline_ms): a helper that hangs, dies or answers
nonsense is killed, said in one log line, and the rest of the texts are parsed in this process (the same pipeline,
the same entities); a pipeline that cannot load is the one-line error this process's own load gives.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from cfir_jax.core.errors import CfirError

log = logging.getLogger("cfir_jax.entities")
READY = "ready"
# The helper's own program: this process's `cfir_jax` loaded from its folder (argv[1]) by path, so that nothing else
# is put on the helper's path (-P keeps the working folder off it, -E ignores PYTHONPATH).
_PROGRAM = ("import importlib.util, sys; p = sys.argv[1]; s = importlib.util.spec_from_file_location("
            "'cfir_jax', p + '/__init__.py', submodule_search_locations=[p]); "
            "m = sys.modules['cfir_jax'] = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "from cfir_jax.nlp.entity_process import serve; serve()")
_STARTED: dict[str, EntityHelper] = {}


def label_spec(labels) -> str | tuple[str, ...] | None:
    """index.entities.labels as one hashable value (a config's list is a tuple; a name such as "picturable" or "all",
    or None, stays): the one label normalisation of the processes' keys (here: this module loads before the helper
    starts, stdlib only)."""
    return tuple(labels) if isinstance(labels, (list, tuple)) else labels


def _key(spacy_model: str | None, labels) -> str:
    spec = label_spec(labels)
    return json.dumps([spacy_model or "", list(spec) if isinstance(spec, tuple) else spec])


def start(spacy_model: str | None, labels: str | Sequence[str] | None, deadline_s: float = 60.0) -> None:
    """Starts a helper for the pipeline `spacy_model` ('' or None: the default ones) and `labels` (as
    `EntityExtractor` takes them), unless one for them was started already; deadline_s: the longest wait for one of
    its answers (retrieval.entity_deadline_ms)."""
    key = _key(spacy_model, labels)
    if key not in _STARTED:
        _STARTED[key] = EntityHelper(key, deadline_s)


def claim(spacy_model: str | None, labels: str | Sequence[str] | None) -> EntityHelper | None:
    """The helper started for this pipeline and these labels (handed out once), or None when none was."""
    return _STARTED.pop(_key(spacy_model, labels), None)


class _Broken(Exception):
    """The helper hung, died or answered nonsense: its texts are parsed in this process from then on."""


class EntityHelper:
    """The helper process of one pipeline and label set: `extract(texts)` as `EntityExtractor.extract` does."""

    def __init__(self, key: str, deadline_s: float = 60.0):
        self.key, self.deadline_s = key, float(deadline_s)
        package = str(Path(__file__).resolve().parents[1])
        # Its stderr is this process's (spaCy's warnings show as they would here); its answers come on stdout.
        self._proc = subprocess.Popen([sys.executable, "-E", "-P", "-c", _PROGRAM, package, key],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="cfir-entity-helper", daemon=True).start()
        self._ready = False
        self._here = None  # the extractor of this process, once the helper failed
        atexit.register(self.close)

    def _read(self) -> None:
        """Its answers, a line at a time, into a queue that a reader waits on with a deadline; None at their end."""
        try:
            for line in self._proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):  # closed by close()
            pass
        self._lines.put(None)

    def _line(self, doing: str) -> str:
        try:
            line = self._lines.get(timeout=self.deadline_s)
        except queue.Empty:
            raise _Broken(f"the entity helper process (pid {self._proc.pid}) did not answer within "
                          f"{self.deadline_s:g} s while {doing}") from None
        if line is None:
            raise _Broken(f"the entity helper process (pid {self._proc.pid}) ended (exit {self._proc.wait()}) while "
                          f"{doing}")
        return line

    def ready(self) -> None:
        """Waits until the helper has loaded its pipeline (or, when it cannot, until this process has); CfirError with
        the pipeline's reason when it cannot be loaded here either."""
        if self._ready or self._here is not None:
            return
        try:
            said = self._line("loading spaCy")
        except _Broken as e:
            return self._fall_back(str(e))
        if said.strip() != json.dumps(READY):
            self.close()
            self._here = self._in_process()  # a pipeline that cannot load: this process's own one-line error
            return
        self._ready = True

    def extract(self, texts: Iterable[str]) -> Iterator[list[str]]:
        """Yields, per text, its unique entity surface forms in order of first mention."""
        self.ready()
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise CfirError(f"document #{i}: text is {type(text).__name__}, expected str; fix the corpus reader")
            if self._here is None:
                try:
                    yield self._ask(text)
                    continue
                except _Broken as e:
                    self._fall_back(str(e))
            yield next(iter(self._here.extract([text])))

    def _ask(self, text: str) -> list[str]:
        try:
            self._proc.stdin.write(json.dumps(text) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the helper ended: its reason is on its stderr
            raise _Broken(f"the entity helper process (pid {self._proc.pid}) ended (exit {self._proc.wait()})") \
                from None
        line = self._line("parsing a text")
        try:
            found = json.loads(line)
        except json.JSONDecodeError:
            found = None
        if not isinstance(found, list) or not all(isinstance(e, str) for e in found):
            raise _Broken(f"the entity helper process (pid {self._proc.pid}) answered {line[:60]!r}, not a list of "
                          "entities")
        return found

    def _fall_back(self, reason: str) -> None:
        log.warning("%s; it is stopped and this process parses the entities from now on", reason)
        self.close()
        self._here = self._in_process()

    def _in_process(self):
        """The same pipeline and extractor, loaded in this process."""
        # why: spaCy loads in this process only when its helper failed
        from cfir_jax.nlp.entities import EntityExtractor, load_spacy

        spacy_model, labels = json.loads(self.key)
        return EntityExtractor(load_spacy(spacy_model or None), labels)

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

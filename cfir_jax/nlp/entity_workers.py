"""The one way spaCy runs in another process: a supervised pool of entity workers.

A worker (`cfir_jax.nlp.entity_worker_main`, its own side) is a fresh interpreter as hardened as the command
(`python -E -P`: neither the working folder nor PYTHONPATH on its path; this process's own `cfir_jax` loaded by its
path) that loads the pipeline once, then answers chunks of texts with their entities; it ends when its stdin closes.

Its users each hold a pool of `Settings.of(config, use)` (the config's `entity_workers` section): the service
(`serve`, a short deadline), bulk retrieval (`bulk`) and index.py's entity stage (`index`), and a query's pool of one
(`start`, before JAX loads, so that spaCy loads beside the models; `claim`, by the query's entity ranking). The pool
supervises its workers:
- a worker that dies (SIGKILL, the OOM killer), answers nonsense or holds a chunk past its deadline (stopped, stuck)
  is killed and replaced, in one log line, and counted (`restarts`, `on_restart`); the chunks it held are parsed
  again by another (one that took `MAX_ATTEMPTS` workers down is parsed in the calling thread);
- more than `max_restarts` replacements within `restart_window_s` is a crash loop: the pool stops its workers and
  the calling thread parses from then on (`state == "degraded"`), rather than failing. A chunk's second and third
  kills are that chunk's (a text that kills spaCy), not the pool's, and are not counted toward it.
A pool is driven from one thread; `state` and `describe` may be read from any, and `close` called from any: a call in
flight then raises `PoolClosed` at once and no worker starts again. Its thread never writes to a worker's pipe (a
writer thread per worker does): a stopped worker holds at most the pipe's 64 KB, so a write could block for ever where
only a deadline can end it. This module loads the standard library only: the query command imports it before JAX.
It is over 400 lines because the pool is one protocol (start, supervise, replace, close) its threads share.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.nlp.entity_worker_main import READY

log = logging.getLogger("cfir_jax.entities")

PIPELINE_DEPTH = 2  # chunks queued per worker: it starts the next while the parent reads the last
MAX_ATTEMPTS = 3  # workers a chunk may take down with it before the calling thread parses it
# index.py's default pool: a worker per this many documents to parse (a pool's start, about 1.7 s here, costs the
# parse of about 45 documents in one process: 2 workers overtake the main thread from about 110; RESULTS.md)
DOCUMENTS_PER_WORKER = 100
_POLL_S = 0.5  # the supervisor's longest wait between two looks at its workers' deadlines
# The slowest parse a chunk's deadline allows for: a chunk of more characters than deadline x this has that many
# seconds (spaCy's small English pipeline parses about 50,000 characters a second on one core here), so that a
# request of long texts (a service's 64 of 64 KiB: 16 to a chunk, ~20 s) is never taken for a stuck worker
CHARS_PER_S = 16_000
# The worker's program: this process's `cfir_jax` loaded from its folder (argv[1]) by path, so that nothing else is
# put on the worker's path (-P keeps the working folder off it, -E ignores PYTHONPATH).
_PROGRAM = ("import importlib.util, sys; p = sys.argv[1]; s = importlib.util.spec_from_file_location("
            "'cfir_jax', p + '/__init__.py', submodule_search_locations=[p]); "
            "m = sys.modules['cfir_jax'] = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "from cfir_jax.nlp.entity_worker_main import worker_main; worker_main()")


def label_spec(labels) -> str | tuple[str, ...] | None:
    """index.entities.labels as one hashable value (a config's list is a tuple; a name such as "picturable" or "all",
    or None, stays): the one label normalisation of the pools' keys."""
    return tuple(labels) if isinstance(labels, (list, tuple)) else labels


def _key(spacy_model: str | None, labels) -> str:  # the worker's argv; '' and None: the default pipelines
    spec = label_spec(labels)
    return json.dumps([spacy_model or "", list(spec) if isinstance(spec, tuple) else spec])


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a pool runs: its workers, a chunk's and a load's deadlines, its crash loop (> max_restarts a window)."""

    workers: int = 1
    deadline_s: float = 60.0
    max_restarts: int = 5
    restart_window_s: float = 60.0
    start_timeout_s: float = 120.0
    # texts `ahead` holds that no call asked for yet, at most (0: none parsed ahead); not compared: a reload that
    # changes the service's queue keeps its pool (and its running batcher, the queue it had)
    ahead_texts: int = dataclasses.field(default=0, compare=False)

    @classmethod
    def of(cls, config, use: str, documents: int | None = None) -> Settings:
        """The config's `entity_workers` section for one use: "serve", "bulk", "index" (their worker counts; index's
        0: `usable_cores()`, no more than the `documents` it will parse fill at DOCUMENTS_PER_WORKER each: the one
        place it is resolved), or "query" (one worker); the service's deadline is serve_deadline_ms, the others'
        deadline_ms; the service's pool parses up to its queue's documents ahead (`ahead`)."""
        w = config.entity_workers
        workers = 1 if use == "query" else int(w[use])
        if use == "index" and workers == 0:
            fill = usable_cores() if documents is None else documents // DOCUMENTS_PER_WORKER
            workers = max(1, min(usable_cores(), fill))
        deadline_s = float(w.serve_deadline_ms if use == "serve" else w.deadline_ms) / 1e3
        # the service's: its queue and a batch that runs (the requests `ahead` parses queue behind it)
        ahead_texts = int(config.serve.queue_size) + int(config.serve.max_batch) if use == "serve" else 0
        return cls(workers, deadline_s, int(w.max_restarts), float(w.restart_window_s), ahead_texts=ahead_texts)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's, cgroup cpuset's or taskset's limit, not the
    host's count), on whichever host it runs."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _parsed(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class PoolClosed(CfirError):
    """A pool closed (from another thread) while a call was using it: the caller parses without it."""


class _Worker:
    """One worker process, with a thread that puts each of its lines (then None, at its end) in the pool's inbox, and
    one that writes the chunks sent to it (only it touches the worker's stdin)."""

    def __init__(self, slot: int, key: str, inbox: queue.Queue):
        self.slot, self.started = slot, time.monotonic()
        package = str(Path(__file__).resolve().parents[1])
        # Its stderr is this process's (spaCy's warnings show as they would here); its answers come on stdout.
        self.proc = subprocess.Popen([sys.executable, "-E", "-P", "-c", _PROGRAM, package, key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")
        self.loaded = threading.Event()  # set by the reader thread: readable while nobody pumps (GET /readyz)
        self.ready = False  # set by the pool's thread once it has read the "ready" line
        self.inflight: collections.deque[int] = collections.deque()
        self.progress = self.started  # when it last received work while idle, or answered
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # lines for its stdin; None: close it
        threading.Thread(target=self._read, args=(inbox,), name=f"cfir-entities-{slot}", daemon=True).start()
        threading.Thread(target=self._write, name=f"cfir-entities-{slot}-in", daemon=True).start()

    def _read(self, inbox: queue.Queue) -> None:
        try:
            for line in self.proc.stdout:
                if line.strip() == json.dumps(READY):
                    self.loaded.set()
                inbox.put((self, line))
        except (OSError, ValueError):  # closed by kill()
            pass
        inbox.put((self, None))

    def _write(self) -> None:
        # A write past the pipe's buffer waits for the worker to read: a stopped one never does, and then only its
        # kill (SIGKILL at its deadline, or close) ends the write, with EPIPE.
        with contextlib.suppress(OSError, ValueError):  # it ended: its end is on its way through the inbox
            while (line := self._outbox.get()) is not None:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()

    def send(self, task: int, texts: list[str]) -> None:
        self._outbox.put(json.dumps([task, texts]) + "\n")

    def kill(self) -> None:
        # SIGKILL: a worker ignores SIGTERM, and a stopped (SIGSTOP) process acts on nothing else; it holds nothing
        # but its pipes (its own exit, spaCy's teardown, took a fifth of a second that a command's end waited for).
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._outbox.put(None)  # its writer closes stdin: a write it was blocked in has ended with the process
        with contextlib.suppress(OSError):
            self.proc.stdout.close()


def _kill_all(workers: list) -> None:
    """At exit (or when the pool is collected) without close(): no worker outlives this process's end."""
    for w in list(workers):
        if w.proc.poll() is None:
            w.proc.kill()
        w._outbox.put(None)  # its writer thread ends too


class EntityWorkers:
    """Entity extraction in `settings.workers` supervised worker processes, the pipeline (`spacy_model`, '': the
    default ones) and `labels` as `EntityExtractor` takes them: the same entities as in this process. With `wait`,
    every worker has loaded the pipeline when this returns (else `wait_ready` waits); a pipeline that cannot load is
    one CfirError line. on_restart(reason) is called once per replaced worker ("died", "deadline", "start",
    "answer")."""

    def __init__(self, spacy_model: str | None, labels, settings: Settings = Settings(), *, wait: bool = True):
        self.key = (spacy_model or "", label_spec(labels))
        self.settings, self.workers = settings, max(1, int(settings.workers))
        self.restarts: collections.Counter[str] = collections.Counter()
        self.on_restart: Callable[[str], None] | None = None
        self.degraded_reason = ""
        self._recent: collections.deque[float] = collections.deque()  # times of recent restarts
        self._inbox: queue.Queue = queue.Queue()
        self._next_id, self._started = 0, False  # _started: a worker loaded; a load failing from then is a restart
        self._texts: dict[int, list[str]] = {}  # the chunks of the current call and of `ahead`, until given up
        self._ahead: dict[str, tuple[int, int]] = {}  # a text `ahead` parses -> (its chunk, its place there)
        self._holders: collections.Counter[str] = collections.Counter()  # a text in `_ahead` -> `ahead` calls for it
        self._pending: collections.deque[int] = collections.deque()  # of those, not given to a worker
        self._done: dict[int, list[list[str]] | BaseException] = {}
        self._attempts: collections.Counter[int] = collections.Counter()
        self._local = None  # this process's EntityExtractor, once the calling thread had to parse
        self._workers: list[_Worker] = []
        # The pool's state, against close() and a replacement's start and `ahead` (any thread); _texts, _pending,
        # _done and a worker's inflight change only under it.
        self._lock, self._closed = threading.RLock(), False
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self._workers += [_Worker(i, _key(*self.key), self._inbox) for i in range(self.workers)]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Waits until every worker has loaded the pipeline (or the pool degraded); CfirError when it cannot."""
        try:
            while not self.degraded and not all(w.ready for w in self._workers):
                self._pump(_POLL_S)
        except BaseException:
            self.close()
            raise

    @property
    def degraded(self) -> bool:
        return bool(self.degraded_reason)

    @property
    def state(self) -> str:
        """"healthy" (every worker loaded), "restarting" (one is loading), or "degraded" (a crash loop: the calling
        thread parses)."""
        if self.degraded:
            return "degraded"
        return "healthy" if all(w.loaded.is_set() for w in list(self._workers)) else "restarting"

    def describe(self) -> dict:
        return {"state": self.state, "workers": self.workers, "restarts": sum(self.restarts.values()),
                "pids": [w.proc.pid for w in list(self._workers)],
                **({"reason": self.degraded_reason} if self.degraded else {})}

    def entities(self, texts: Sequence[str]) -> list[list[str]]:
        """Each text's entities, the texts split in `workers` contiguous slices parsed at once."""
        return list(self._gather(texts, None))

    def stream(self, texts: Sequence[str], chunk: int) -> Stream:
        """Each text's entities in order, lazily: the workers start at once and parse ahead (two chunks each) while
        the caller encodes and scores (the documents already yielded, or the batch before it reads the first)."""
        return self._gather(texts, max(1, chunk))

    def extract(self, texts: Iterable[str]) -> Stream:
        """As `EntityExtractor.extract`: per text, its unique entity surface forms in order of first mention."""
        texts = list(texts)
        return self.stream(texts, -(-len(texts) // (self.workers * PIPELINE_DEPTH)))

    def ahead(self, texts: Sequence[str], chunk: int) -> None:
        """Starts parsing `texts` (in chunks of `chunk`) before any call asks for them, from any thread: a service's
        request as it queues behind the batch that runs (`cfir_jax.serve.batcher`), so that the workers parse it
        while the driving thread encodes, ranks and answers that batch. A later call (`stream`, `entities`) that
        asks for a text parsed ahead takes its chunk (the chunk's other texts are parsed again if asked later).
        Past `settings.ahead_texts` texts not asked for, the oldest chunks are given up (`give_up` says which will
        never be asked for): a pool of the default settings parses nothing ahead."""
        _check_texts(texts)
        chunk = max(1, chunk)
        with self._lock:
            if self._closed or not self.settings.ahead_texts:
                return
            self._holders.update(dict.fromkeys(texts, 1))
            new = [t for t in dict.fromkeys(texts) if t not in self._ahead]
            for a in range(0, len(new), chunk):
                task = self._add(new[a : a + chunk])
                self._ahead.update((text, (task, i)) for i, text in enumerate(self._texts[task]))
            while len(self._ahead) > self.settings.ahead_texts:
                self._forget([self._claim(next(iter(self._ahead.values()))[0])])
            self._assign()

    def give_up(self, texts: Sequence[str]) -> None:
        """One `ahead` call's `texts` no call will ask for (its request withdrawn, past its deadline, refused, or
        answered without its entities): a chunk none of whose texts another `ahead` call still holds is given up,
        never parsed if no worker has it yet, and the bound holds the others' texts."""
        with self._lock:
            held = [t for t in dict.fromkeys(texts) if t in self._ahead]
            self._holders.subtract(held)
            tasks = {self._ahead[t][0] for t in held}
            dropped = [self._claim(t) for t in tasks if all(self._holders[x] <= 0 for x in self._texts.get(t, ()))]
            self._forget(dropped)

    def parsed_ahead(self, texts: Sequence[str]) -> bool:
        """Whether `ahead` parses (or parsed) every one of `texts`, none of them asked for since."""
        return all(t in self._ahead for t in texts)

    def _held_ahead(self, task: int) -> bool:
        """Whether `task` is a chunk `ahead` made that no call has taken."""
        return any(self._ahead.get(text, (None,))[0] == task for text in self._texts.get(task, ()))

    def _claim(self, task: int) -> int:
        """A chunk `ahead` made, taken out of what it holds."""
        for text in self._texts.get(task, ()):
            if self._ahead.get(text, (None,))[0] == task:
                del self._ahead[text]
                del self._holders[text]
        return task

    def _add(self, texts: list[str]) -> int:
        task, self._next_id = self._next_id, self._next_id + 1
        self._texts[task] = texts
        self._pending.append(task)
        return task

    def _gather(self, texts: Sequence[str], chunk: int | None) -> Stream:
        """texts' entities, from the chunks `ahead` made for some (this call takes them) and from chunks of the
        others (`chunk` texts each; None: `workers` even slices); the chunks it needs go to the workers first, in
        order."""
        _check_texts(texts)
        with self._lock:
            rest = [t for t in texts if t not in self._ahead]
            if chunk is None:
                n = max(1, min(self.workers, len(rest)))
                bounds = [len(rest) * i // n for i in range(n + 1)]
                spans = list(zip(bounds, bounds[1:]))
            else:
                spans = [(a, min(a + chunk, len(rest))) for a in range(0, len(rest), chunk)]
            made = [self._add(rest[a:b]) for a, b in spans if b > a]
            places = iter((task, i) for task in made for i in range(len(self._texts[task])))
            refs = [self._ahead[t] if t in self._ahead else next(places) for t in texts]
            needed = list(dict.fromkeys(task for task, _ in refs))
            owned = [self._claim(task) for task in needed]
            first = {task: n for n, task in enumerate(needed)}
            self._pending = collections.deque(sorted(self._pending, key=lambda t: first.get(t, len(first))))
            self._assign()  # the workers start now: the caller may do other work before it reads the first answer
        return Stream(self._answers(refs, owned, set(made)), lambda: self._forget(owned))

    def _forget(self, ids: list[int]) -> None:
        """Chunks given up (a call's, or the oldest `ahead` holds): those still with workers are dropped when they
        come back."""
        with self._lock:
            for task_id in ids:
                self._texts.pop(task_id, None)
                self._done.pop(task_id, None)
                self._attempts.pop(task_id, None)
            self._pending = collections.deque(t for t in self._pending if t in self._texts)

    def _answers(self, refs: list[tuple[int, int]], owned: list[int], made: set[int]) -> Iterator[list[str]]:
        """Each text's entities, its place (chunk, index) waited for in turn. A chunk the call made is given up once
        its last text is read (a long stream holds little); the others it took from `ahead`, at its end."""
        try:
            for task_id, i in refs:
                result = self._wait(task_id)
                if isinstance(result, BaseException) and task_id not in made and len(self._texts[task_id]) > 1:
                    # a chunk `ahead` made may hold another request's texts, and its failure be theirs: this text
                    # is parsed again alone, so that it fails only for what it is
                    with self._lock:
                        task_id, i = self._add([self._texts[task_id][i]]), 0
                        owned.append(task_id)
                    made.add(task_id)
                    result = self._wait(task_id)
                if isinstance(result, BaseException):
                    raise result
                if task_id in made and i == len(result) - 1:
                    self._forget([task_id])
                yield result[i]
        finally:  # read to its end, or abandoned part way
            self._forget(owned)

    def _wait(self, task_id: int) -> list[list[str]] | BaseException:
        """Chunk `task_id`'s entities (one list per text) or its error, once a worker (or, past MAX_ATTEMPTS or
        degraded, this thread) has parsed it."""
        while task_id not in self._done:
            if self._closed:
                raise PoolClosed("the entity workers were closed while parsing (stopped, none restarted)")
            if task_id not in self._texts:  # given up meanwhile: never, in one thread
                raise CfirError(f"entity chunk {task_id} was given up while a call waited for it")
            if self.degraded or self._attempts[task_id] >= MAX_ATTEMPTS:
                self._parse_here(task_id)
                break
            self._assign()
            self._pump(_POLL_S)
        return self._done[task_id]

    def _parse_here(self, task_id: int) -> None:
        with self._lock:
            if task_id in self._pending:
                self._pending.remove(task_id)
            texts = self._texts[task_id]
        if self._local is None:
            # why: spaCy loads in this process only when its workers could not parse
            from cfir_jax.nlp.entities import EntityExtractor, load_spacy

            self._local = EntityExtractor(load_spacy(self.key[0] or None), self.key[1])
        try:
            found: list | Exception = list(self._local.extract(texts))
        except Exception as e:  # noqa: BLE001 - the chunk's error, kept as a worker's is: whose it is, `_answers` finds
            found = e
        with self._lock:
            if task_id in self._texts:
                self._done[task_id] = found

    def _assign(self) -> None:
        with self._lock:
            now = time.monotonic()
            for depth in range(1, PIPELINE_DEPTH + 1):  # one chunk to every worker before a second to any
                for w in list(self._workers):
                    if self._pending and w.ready and len(w.inflight) < depth:
                        task_id = self._pending.popleft()
                        if not w.inflight:
                            w.progress = now
                        w.inflight.append(task_id)
                        w.send(task_id, self._texts[task_id])

    def _pump(self, timeout: float) -> None:
        """Reads the workers' lines for up to `timeout`; replaces the dead and those past their deadline."""
        lines: list = []
        try:
            lines.append(self._inbox.get(timeout=timeout))
            while True:
                lines.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for w, line in lines:
            if w not in self._workers:  # replaced already: what it still said is dropped
                continue
            if line is None:
                self._replace(w, "died", f"exited with {_exit_text(w.proc.wait())}")
            else:
                self._receive(w, line)
        now = time.monotonic()
        for w in list(self._workers):
            if w.ready and w.inflight and now - w.progress > (deadline := self._deadline(w.inflight[0])):
                self._replace(w, "deadline", f"held a chunk past its deadline of {round(deadline, 1):g} s")
            elif not w.ready and now - w.started > self.settings.start_timeout_s:
                self._replace(w, "start", f"did not load the pipeline in {self.settings.start_timeout_s:g} s")

    def _deadline(self, task_id: int) -> float:
        """Seconds a worker may hold chunk `task_id`: the settings' deadline, or its characters at CHARS_PER_S."""
        return max(self.settings.deadline_s, sum(map(len, self._texts.get(task_id, ()))) / CHARS_PER_S)

    def _receive(self, w: _Worker, line: str) -> None:
        with self._lock:
            message = _parsed(line)
            if not w.ready:
                if message == READY:
                    w.ready, w.progress, self._started = True, time.monotonic(), True
                elif isinstance(message, dict) and not self._started:  # spaCy or its pipeline missing: one line
                    raise CfirError(str(message.get("error")))
                else:
                    self._replace(w, "start", f"could not load the pipeline ({line.strip()[:80]})")
                return
            # a chunk's entities (one list per text) or its error
            if not (isinstance(message, list) and len(message) == 2 and message[0] in w.inflight
                    and (isinstance(message[1], dict) or isinstance(message[1], list)
                         and len(message[1]) == len(self._texts.get(message[0], message[1])))):
                return self._replace(w, "answer", f"answered {line.strip()[:60]!r}, not a chunk's entities")
            task_id, value = message
            w.inflight.remove(task_id)
            w.progress = time.monotonic()
            if task_id in self._texts and task_id not in self._done:
                self._done[task_id] = value if isinstance(value, list) else CfirError(str(value.get("error")))
                self._attempts.pop(task_id, None)

    def _replace(self, w: _Worker, reason: str, what: str) -> None:
        pid = w.proc.pid
        w.kill()
        with self._lock:  # no worker starts once close() has stopped them
            if self._closed:
                return
            lost = [t for t in w.inflight if t in self._texts and t not in self._done]
            # a chunk parsed ahead that no call took yet is given up, not tried again: its request may never run
            # (withdrawn, refused), and the calls behind would retry it past MAX_ATTEMPTS; a call that asks for its
            # texts later makes its own chunk
            dropped = [self._claim(t) for t in lost if self._held_ahead(t)]
            lost = [t for t in lost if t not in dropped]
            self._forget(dropped)
            # a worker lost while holding only chunks that took one down before is those chunks' doing (one
            # request's text that kills spaCy), not the pool's: it is not counted toward the crash loop, so that
            # one client's text cannot degrade the pool for every request until a reload
            again = bool(lost) and all(self._attempts[t] >= 1 for t in lost)
            for task_id in lost:
                self._attempts[task_id] += 1
            self._pending.extendleft(reversed(lost))  # first in line again, in order
            self._workers.remove(w)
            self.restarts[reason] += 1
            now = time.monotonic()
            if not again:
                self._recent.append(now)
            while self._recent and now - self._recent[0] > self.settings.restart_window_s:
                self._recent.popleft()
            if self.on_restart is not None:
                self.on_restart(reason)
            if len(self._recent) > self.settings.max_restarts:
                self.degraded_reason = (f"{len(self._recent)} worker restarts within {self.settings.restart_window_s:g}"
                                        " s: parsing in the calling thread")
                log.error("entity worker %d (pid %s) %s; %s", w.slot, pid, what, self.degraded_reason)
                for other in self._workers:
                    other.kill()
                self._workers.clear()
                return
            fresh = _Worker(w.slot, _key(*self.key), self._inbox)
            self._workers.insert(min(w.slot, len(self._workers)), fresh)
            log.warning("entity worker %d (pid %s) %s; replaced by pid %s (restart %d), %d chunk(s) to parse again",
                        w.slot, pid, what, fresh.proc.pid, sum(self.restarts.values()), len(lost))

    def close(self) -> None:
        """Stops the workers at once (they hold nothing but their pipes), from any thread: a call in flight raises
        PoolClosed in its own thread, and no worker starts from then on."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        self._finalizer.detach()
        for w in workers:
            w.kill()
        self._inbox.put((None, None))  # wakes a call waiting for its workers' lines


class Stream:
    """The entities of a call's texts, in order, as the pool's workers answer (`EntityWorkers.stream`). The workers
    start on them when it is made; `close` gives up what has not been read, even before the first read (a batch that
    raised first: its chunks would otherwise wait in the pool, and the next call's behind them, for good)."""

    def __init__(self, answers: Iterator[list[str]], forget: Callable[[], None]):
        self._answers, self._forget = answers, forget

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> list[str]:
        return next(self._answers)

    def close(self) -> None:
        self._answers.close()  # a started read gives up its chunks itself; one never started does here
        self._forget()


def _check_texts(texts: Sequence[str]) -> None:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CfirError(f"document #{i}: text is {type(text).__name__}, expected str; fix the corpus reader")


def _exit_text(code: int | None) -> str:
    signals = {-int(s): s.name for s in signal.Signals}
    return signals.get(code, f"status {code}") if code is not None else "status None"


# --------------------------------------------------------------------------------------- a query's pool of one
_STARTED: dict[str, EntityWorkers] = {}


def start(spacy_model: str | None, labels, settings: Settings = Settings()) -> None:
    """Starts a pool of one worker for the pipeline and labels, unless one was started already; it loads spaCy
    beside what this process loads meanwhile, and is handed out once by `claim`."""
    key = _key(spacy_model, labels)
    if key not in _STARTED:
        _STARTED[key] = EntityWorkers(spacy_model, labels, dataclasses.replace(settings, workers=1), wait=False)


def claim(spacy_model: str | None, labels) -> EntityWorkers | None:
    """The pool started for this pipeline and these labels (handed out once), or None when none was."""
    return _STARTED.pop(_key(spacy_model, labels), None)

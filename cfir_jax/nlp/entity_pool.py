"""A supervised pool of spaCy worker processes: the entities of many documents parsed on every core, surviving the
loss of its workers.

Each worker is a fresh interpreter (`spawn`: never a fork of this multithreaded JAX process, and not a child of
the shared forkserver either, which dies of a SIGTERM to the process group and takes with it the parent's view of
every worker it started: each would read as exited with status 255), loads the pipeline once, ignores SIGINT
and SIGTERM (signals to the process group belong to the parent, which drains and then stops its workers) and
exits by itself when the parent is gone. The parent supervises them:

- a worker that dies (SIGKILL, the OOM killer, a crash) is replaced, and the chunks it held are parsed again by
  another worker (a chunk that has killed `MAX_ATTEMPTS` workers is parsed in the calling thread);
- a worker that holds a chunk past `deadline_s` (stopped, stuck) is killed and replaced the same way;
- every replacement is logged in one line and counted (`restarts`, `on_restart`);
- more than `max_restarts` replacements within `restart_window_s` is a crash loop: the pool stops its workers and
  parses in the calling thread from then on (`state == "degraded"`), rather than failing requests.

The pool is driven from one thread (the service's retrieval thread, or bulk retrieval's main thread).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait

from cfir_jax.core.errors import CfirError
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_process import label_spec

log = logging.getLogger("cfir_jax.entities")

PIPELINE_DEPTH = 2  # chunks queued per worker: it starts the next while the parent reads the last
MAX_ATTEMPTS = 3  # workers a chunk may take down with it before the calling thread parses it
_POLL_S = 0.5  # how often a worker checks that its parent is alive; the supervisor's longest wait


# ------------------------------------------------------------------------------------------------ the worker side
def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_POLL_S)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(0)  # the parent is gone: nobody will read what this worker parses
        except PermissionError:  # the pid was reused by another user's process: ours is gone
            os._exit(0)


def _worker_main(spacy_model: str, labels, tasks, results, parent_pid: int, loaded=None) -> None:
    """A worker: loads the pipeline, says "ready", then parses (task id, texts) from `tasks` until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    try:
        extractor = EntityExtractor(load_spacy(spacy_model or None), labels)
        list(extractor.extract(["warm up"]))
    except Exception as e:  # noqa: BLE001 - said to the parent in one line, which refuses to start
        _say(results, ("failed", None, str(e).splitlines()[0] if str(e) else type(e).__name__))
        return
    if loaded is not None:
        loaded.set()  # readable from any thread of the parent (GET /readyz), unlike the message below
    _say(results, ("ready", None, None))
    while (task := tasks.get()) is not None:
        task_id, texts = task
        try:
            out = ("ok", task_id, list(extractor.extract(texts)))
        except Exception as e:  # noqa: BLE001 - the chunk's own error, raised in the caller
            out = ("error", task_id, str(e).splitlines()[0] if str(e) else type(e).__name__)
        _say(results, out)


def _say(results, message: tuple) -> None:
    try:
        results.send(message)
    except OSError:  # the parent closed its end (it replaced this worker, or is gone): nothing to tell
        os._exit(0)


# ------------------------------------------------------------------------------------------------ the parent side
class _Worker:
    def __init__(self, ctx, slot: int, key: tuple, parent_pid: int):
        self.slot = slot
        self.tasks = ctx.Queue()
        self.conn, child_conn = ctx.Pipe(duplex=False)
        self.loaded = ctx.Event()
        self.proc = ctx.Process(target=_worker_main, args=(*key, self.tasks, child_conn, parent_pid, self.loaded),
                                name=f"cfir-entities-{slot}", daemon=True)
        self.proc.start()
        child_conn.close()
        self.started = time.monotonic()
        self.ready = False
        self.inflight: collections.deque[int] = collections.deque()
        self.progress = self.started  # when it last received work while idle, or answered

    def kill(self) -> None:
        # SIGKILL: the workers ignore SIGTERM, and a stopped (SIGSTOP) process acts on nothing else.
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.tasks.cancel_join_thread()
        self.tasks.close()
        self.conn.close()


def _kill_all(workers: list) -> None:
    """At exit (or when the pool is collected) without close(): no worker outlives this process's end."""
    for w in list(workers):
        if w.proc.is_alive():
            w.proc.kill()


class EntityPool:
    """Entity extraction in `workers` supervised processes (a script that starts one needs the `if __name__ ==
    "__main__":` guard of every spawn start) with the spaCy pipeline loaded once each: the same
    pipeline, labels and normalisation as `EntityExtractor`, hence the same entities. Bulk retrieval
    (`retrieval.entity_workers`) and the service (`serve.entity_workers`) use it.

    deadline_s: how long a worker may hold a chunk before it is killed and replaced; start_timeout_s: how long a
    new worker may take to load the pipeline; max_restarts within restart_window_s: past it the pool degrades to
    parsing in the calling thread. on_restart(reason) is called once per replaced worker ("died", "deadline",
    "start")."""

    def __init__(self, spacy_model: str, labels, workers: int, *, deadline_s: float = 60.0,
                 start_timeout_s: float = 120.0, max_restarts: int = 5, restart_window_s: float = 60.0):
        self.key = (spacy_model, label_spec(labels))
        self.workers = int(workers)
        self.deadline_s, self.start_timeout_s = float(deadline_s), float(start_timeout_s)
        self.max_restarts, self.restart_window_s = int(max_restarts), float(restart_window_s)
        self.restarts: collections.Counter[str] = collections.Counter()
        self.on_restart: Callable[[str], None] | None = None
        self.degraded_reason = ""
        self._recent: collections.deque[float] = collections.deque()  # times of recent restarts
        self._ctx = multiprocessing.get_context("spawn")
        self._pid = os.getpid()
        self._next_id = 0
        self._texts: dict[int, list[str]] = {}  # the current call's chunks not yet parsed
        self._pending: collections.deque[int] = collections.deque()  # of those, not given to a worker
        self._done: dict[int, list[list[str]] | BaseException] = {}
        self._attempts: collections.Counter[int] = collections.Counter()
        self._local: EntityExtractor | None = None
        self._workers: list[_Worker] = []
        self._started = False
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        try:
            self._workers += [_Worker(self._ctx, i, self.key, self._pid) for i in range(self.workers)]
            # Every worker loaded now, not in the first documents' time.
            until = time.monotonic() + self.start_timeout_s
            while not self.degraded and not all(w.ready for w in self._workers):
                if time.monotonic() > until + self.start_timeout_s:
                    raise CfirError(f"the spaCy workers did not start in {2 * self.start_timeout_s:.0f} s")
                self._pump(_POLL_S)
            self._started = True
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------- state
    @property
    def degraded(self) -> bool:
        return bool(self.degraded_reason)

    @property
    def state(self) -> str:
        """"healthy" (every worker ready), "restarting" (a replacement is loading), or "degraded" (crash loop:
        the calling thread parses)."""
        if self.degraded:
            return "degraded"
        return "healthy" if all(w.loaded.is_set() for w in list(self._workers)) else "restarting"

    def describe(self) -> dict:
        return {"state": self.state, "workers": self.workers, "restarts": sum(self.restarts.values()),
                "pids": [w.proc.pid for w in list(self._workers)], **({"reason": self.degraded_reason}
                                                                 if self.degraded else {})}

    # ---------------------------------------------------------------------------------------------- parsing
    def entities(self, texts: Sequence[str]) -> list[list[str]]:
        """Each text's entities, the texts split in `workers` contiguous slices parsed at once."""
        n = max(1, min(self.workers, len(texts)))
        bounds = [len(texts) * i // n for i in range(n + 1)]
        return list(self._gather(texts, list(zip(bounds, bounds[1:]))))

    def stream(self, texts: Sequence[str], chunk: int) -> Iterator[list[str]]:
        """Each text's entities in order, lazily: the workers parse ahead (two chunks each) while the caller
        encodes and scores the documents already yielded."""
        starts = range(0, len(texts), max(1, chunk))
        return self._gather(texts, [(a, min(a + chunk, len(texts))) for a in starts])

    def _gather(self, texts: Sequence[str], spans: list[tuple[int, int]]) -> Iterator[list[str]]:
        ids = []
        for a, b in spans:
            if b > a:
                ids.append(self._next_id)
                self._texts[self._next_id] = list(texts[a:b])
                self._pending.append(self._next_id)
                self._next_id += 1
        try:
            for task_id in ids:
                while task_id not in self._done:
                    if self.degraded or self._attempts[task_id] >= MAX_ATTEMPTS:
                        self._parse_here(task_id)
                        break
                    self._assign()
                    self._pump(_POLL_S)
                result = self._done.pop(task_id)
                del self._texts[task_id]
                if isinstance(result, BaseException):
                    raise result
                yield from result
        finally:  # an abandoned stream: its chunks still with workers are dropped when they come back
            for task_id in ids:
                self._texts.pop(task_id, None)
                self._done.pop(task_id, None)
                self._attempts.pop(task_id, None)
            self._pending = collections.deque(t for t in self._pending if t in self._texts)

    def _parse_here(self, task_id: int) -> None:
        if task_id in self._pending:
            self._pending.remove(task_id)
        if self._local is None:
            self._local = EntityExtractor(load_spacy(self.key[0] or None), self.key[1])
        self._done[task_id] = list(self._local.extract(self._texts[task_id]))

    def _assign(self) -> None:
        now = time.monotonic()
        for depth in range(1, PIPELINE_DEPTH + 1):  # one chunk to every worker before a second to any
            for w in self._workers:
                if self._pending and w.ready and len(w.inflight) < depth:
                    task_id = self._pending.popleft()
                    if not w.inflight:
                        w.progress = now
                    w.inflight.append(task_id)
                    w.tasks.put((task_id, self._texts[task_id]))

    def _pump(self, timeout: float) -> None:
        """Waits up to `timeout` for the workers' answers; replaces the dead and those past their deadline."""
        by_conn = {w.conn: w for w in self._workers}
        by_sentinel = {w.proc.sentinel: w for w in self._workers}
        for ready in wait([*by_conn, *by_sentinel], timeout):
            w = by_conn.get(ready) or by_sentinel.get(ready)
            if w not in self._workers:  # replaced already in this round
                continue
            try:
                while w.conn.poll():  # what it said before it died still counts
                    self._receive(w, w.conn.recv())
            except (EOFError, OSError):
                pass
            if w in self._workers and not w.proc.is_alive():
                self._replace(w, "died", f"exited with {_exit_text(w.proc.exitcode)}")
        now = time.monotonic()
        for w in list(self._workers):
            if w.ready and w.inflight and now - w.progress > self.deadline_s:
                self._replace(w, "deadline", f"held a chunk past its deadline of {self.deadline_s:g} s")
            elif not w.ready and now - w.started > self.start_timeout_s:
                self._replace(w, "start", f"did not load the pipeline in {self.start_timeout_s:g} s")

    def _receive(self, w: _Worker, message: tuple) -> None:
        kind, task_id, value = message
        if kind == "ready":
            w.ready, w.progress = True, time.monotonic()
        elif kind == "failed":
            if not self._started:  # spaCy or its pipeline missing: the pool cannot start (one line)
                raise CfirError(f"spaCy worker: {value}")
            self._replace(w, "start", f"could not load the pipeline ({value})")  # a crash loop if it persists
        else:
            if task_id in w.inflight:
                w.inflight.remove(task_id)
            w.progress = time.monotonic()
            if task_id in self._texts and task_id not in self._done:
                self._done[task_id] = value if kind == "ok" else CfirError(value)
                self._attempts.pop(task_id, None)

    def _replace(self, w: _Worker, reason: str, what: str) -> None:
        pid = w.proc.pid
        w.kill()
        lost = [t for t in w.inflight if t in self._texts and t not in self._done]
        for task_id in lost:
            self._attempts[task_id] += 1
        self._pending.extendleft(reversed(lost))  # first in line again, in order
        self._workers.remove(w)
        self.restarts[reason] += 1
        now = time.monotonic()
        self._recent.append(now)
        while self._recent and now - self._recent[0] > self.restart_window_s:
            self._recent.popleft()
        if self.on_restart is not None:
            self.on_restart(reason)
        if len(self._recent) > self.max_restarts:
            self.degraded_reason = (f"{len(self._recent)} worker restarts within {self.restart_window_s:g} s: "
                                    "parsing in the retrieval thread")
            log.error("entity worker %d (pid %s) %s; %s", w.slot, pid, what, self.degraded_reason)
            for other in self._workers:
                other.kill()
            self._workers.clear()
            return
        fresh = _Worker(self._ctx, w.slot, self.key, self._pid)
        self._workers.insert(w.slot if w.slot <= len(self._workers) else len(self._workers), fresh)
        log.warning("entity worker %d (pid %s) %s; replaced by pid %s (restart %d), %d chunk(s) to parse again",
                    w.slot, pid, what, fresh.proc.pid, sum(self.restarts.values()), len(lost))

    def close(self) -> None:
        """Stops the workers: each finishes its chunk and exits (killed after a few seconds otherwise)."""
        for w in self._workers:
            try:
                w.tasks.put(None)
            except (OSError, ValueError):
                pass
        until = time.monotonic() + 5
        for w in self._workers:
            w.proc.join(max(0.0, until - time.monotonic()))
            w.kill()
        self._workers.clear()
        self._finalizer.detach()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"status {code}"

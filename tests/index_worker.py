"""Runs index.py as one process of a jax.distributed job on localhost, for the multi-host index tests.

    python index_worker.py PID NPROC PORT CALLS_LOG KILL_AFTER INDEX_ARGS...

NPROC > 1: process PID of NPROC (the coordinator on 127.0.0.1:PORT), through the same JAX_COORDINATOR_ADDRESS
variables a cluster sets for index.py (which then picks gloo CPU collectives itself). Every chunk of a chunked
stage (entities, summaries) that this process computes is appended to CALLS_LOG as "<stage>.partial/<chunk file>"
once written; with KILL_AFTER >= 0 the process SIGKILLs itself right after writing its (KILL_AFTER + 1)-th
summaries chunk: a crash at an exact point mid-stage, with no race against a poller.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def main() -> None:
    pid, nproc, port, calls_log, kill_after = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]),
                                               int(sys.argv[5]))
    if nproc > 1:
        os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
                          JAX_PROCESS_ID=str(pid))
    from cfir_jax import store

    write = store.write_json_atomic
    summaries_written = []

    def logged(path, obj) -> None:
        write(path, obj)
        path = Path(path)
        if path.name.startswith("chunk-") and path.parent.name.endswith(".partial"):
            with open(calls_log, "a") as f:
                f.write(f"{path.parent.name}/{path.name}\n")
            if path.parent.name == "summaries.partial":
                summaries_written.append(path.name)
                if len(summaries_written) == kill_after + 1:
                    os.kill(os.getpid(), signal.SIGKILL)

    store.write_json_atomic = logged
    sys.argv = ["index.py", *sys.argv[6:]]
    os.chdir(ROOT)
    runpy.run_path(str(ROOT / "index.py"), run_name="__main__")


if __name__ == "__main__":
    main()

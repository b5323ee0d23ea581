"""Runs index.py as one process of a jax.distributed job on localhost, for the multi-host index tests.

    python index_worker.py PID NPROC PORT CALLS_LOG KILL_AFTER INDEX_ARGS...
    python index_worker.py model PID PORT DIR     # process 0 of 2 saves a tiny model to DIR, both load it

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

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]


def model_round_trip(pid: int, port: str, directory: Path) -> None:
    """What the caption pretraining's export and every index stage do with a model directory in a 2-process run:
    process 0 writes it alone, then each process loads its own copy; prints the loaded model's fingerprints."""
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
    from cfir_jax.core import cli, hosts
    from cfir_jax.core.config import model_config
    from cfir_jax.model import checkpoint
    from cfir_jax.model.beit3 import create_model

    cli.maybe_initialize_distributed()
    cfg = model_config("tiny", embed_dim=32, num_layers=1, num_heads=2, ffn_dim=64, image_size=32, vocab_size=100)
    if hosts.is_main():
        checkpoint.save_model(create_model(cfg, seed=3), directory)
    hosts.barrier("saved")
    model = checkpoint.load_model(directory)
    print(checkpoint.fingerprint(model, "vision"), checkpoint.fingerprint(model, "text"), flush=True)


def main() -> None:
    if sys.argv[1] == "model":
        return model_round_trip(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    pid, nproc, port, calls_log, kill_after = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]),
                                               int(sys.argv[5]))
    if nproc > 1:
        os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
                          JAX_PROCESS_ID=str(pid))
    from cfir_jax.builders import chunks

    write = chunks.write_json_atomic
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

    chunks.write_json_atomic = logged  # every chunk a build writes (cfir_jax.builders.chunks)
    sys.argv = ["index.py", *sys.argv[6:]]
    os.chdir(ROOT)
    runpy.run_path(str(ROOT / "index.py"), run_name="__main__")


if __name__ == "__main__":
    main()

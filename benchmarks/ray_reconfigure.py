"""What Ray Serve's `user_config` / `reconfigure()` does to a deployment's replicas, measured: why the cluster's reload
does not rest on it (docs/serving.md, "Ray Serve's mechanisms").

    flock /tmp/cfir-bench.lock python benchmarks/ray_reconfigure.py

A deployment of 2 replicas, each holding a "version" (a stand-in for an index version: its reconfigure sleeps
--load-s, as a load would) and answering requests with it, is served by a client thread without pause while the
driver changes the user_config three times with `serve.run`:
  1. a version that loads: how long until every replica answers with it, and how many requests failed meanwhile;
  2. a version whose reconfigure raises (a refused reload): whether the replicas that held the old version live on
     (their process ids), and what the application's status becomes;
  3. the same from a replica's side: which process could change it (only a driver that deploys the application).
Each line prints the load average. A local Ray of its own (HOME should be an empty folder).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from common import hardware_description  # also puts the repository root on sys.path


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load-s", type=float, default=2.0, help="how long a replica's reconfigure takes (a load)")
    args = p.parse_args()
    import ray
    from ray import serve

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0.1}, health_check_period_s=1)
    class Holder:
        def __init__(self):
            self.version = None

        def reconfigure(self, config: dict):
            if config.get("fail"):
                raise RuntimeError(f"version {config['version']} refused")
            time.sleep(config.get("load_s", 0.0))
            self.version = config["version"]

        def __call__(self, _=None):
            return os.getpid(), self.version

    def deploy(config: dict, wait: bool = False):
        app = serve.RunTarget(target=Holder.options(user_config=config).bind(), name="holder", route_prefix=None)
        return serve.run_many([app], wait_for_applications_running=wait)[0]

    print(f"{hardware_description()}; load {load_averages()}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    handle = deploy({"version": 1}, wait=True)
    seen, failed, stop = [], [0], threading.Event()

    def client():
        while not stop.is_set():
            try:
                seen.append((time.monotonic(), *handle.remote().result(timeout_s=30)))
            except Exception:  # noqa: BLE001 - counted
                failed[0] += 1

    threading.Thread(target=client, daemon=True).start()
    time.sleep(2.0)
    pids = {pid for _, pid, _ in seen}
    t0 = time.monotonic()
    deploy({"version": 2, "load_s": args.load_s})
    while {v for at, _, v in seen[-20:] if at > t0} != {2}:
        time.sleep(0.05)
    answered = time.monotonic() - t0
    time.sleep(args.load_s + 3.0)
    now = {pid for at, pid, _ in seen[-20:]}
    print(f"1. a version that loads in {args.load_s:g} s: every replica answers with it {answered:.1f} "
          f"s after serve.run; {failed[0]} requests failed; replicas {sorted(pids)} -> {sorted(now)} (new "
          f"processes: {sorted(now - pids) or 'none'}); load {load_averages()}", flush=True)
    pids = now
    failed[0], t1 = 0, time.monotonic()
    deploy({"version": 3, "fail": True})
    time.sleep(15.0)
    after = {pid for at, pid, _ in seen if at > t1 + 10}
    status = serve.status().applications["holder"]
    print(f"2. a version whose reconfigure raises: replicas {sorted(pids)} -> {sorted(after)} (the same: "
          f"{after <= pids}); versions answered since: {sorted({v for at, _, v in seen if at > t1 + 10})}; "
          f"{failed[0]} requests failed; the application {status.status}: "
          f"{(status.deployments['Holder'].message or '').splitlines()[0][:160] if status.deployments else ''}; "
          f"load {load_averages()}", flush=True)
    stop.set()
    print("3. user_config changes only with serve.run (a deploy from a driver): a replica that finds its version gone, "
          "or an admin request a replica holds, cannot change it", flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()

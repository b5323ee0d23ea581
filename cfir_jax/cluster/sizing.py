"""What the cluster service reserves in Ray, and whether the Ray it starts or joins has room for it: every
replica's logical CPUs and GPUs, refused in one line before anything starts (a head too small) or after connecting
(a cluster without room), and an address where nothing listens refused at once."""

from __future__ import annotations

import dataclasses
import math
import socket

from cfir_jax.core.errors import CfirError

_EPS = 1e-6  # Ray counts resources in 1e-4 units


@dataclasses.dataclass(frozen=True)
class Needs:
    """What the application reserves in Ray: CPUs, GPUs, and the sum written out for a refusal."""
    cpus: float
    gpus: float
    parts: str


def needs(s) -> Needs:
    """Every replica's reservation (serve.*_replicas x serve.*_num_cpus / front_num_gpus): the shard replicas with 2
    shards or more (one shard is each front's own), the gateways with 2 fronts or more (one front is the ingress)."""
    fronts = int(s.front_replicas)
    shard_replicas = int(s.shards) * int(s.shard_replicas) if int(s.shards) > 1 else 0
    gateways = int(s.gateway_replicas) if fronts > 1 else 0
    terms = [(fronts, "front", float(s.front_num_cpus)), (shard_replicas, "shard replica", float(s.shard_num_cpus)),
             (gateways, "gateway", float(s.gateway_num_cpus))]
    parts = " + ".join(f"{n} {name}{'s' if n > 1 else ''} x {cpus:g}" for n, name, cpus in terms if n)
    return Needs(sum(n * cpus for n, _, cpus in terms), fronts * float(s.front_num_gpus), parts)


def head_cpus(s, need: Needs, cores: int) -> int:
    """The logical CPUs of a head this command starts: serve.head_num_cpus, or (0) enough for every replica and at
    least the machine's cores. One line when serve.head_num_cpus is too few, before anything starts."""
    if int(s.head_num_cpus) <= 0:
        return max(cores, math.ceil(need.cpus - _EPS))
    if need.cpus > int(s.head_num_cpus) + _EPS:
        raise CfirError(f"the application needs {need.cpus:g} CPUs ({need.parts}), the head has "
                        f"{int(s.head_num_cpus)} (serve.head_num_cpus): lower serve.*_num_cpus or the replicas, or "
                        "raise serve.head_num_cpus (0: sized for the replicas)")
    return int(s.head_num_cpus)


def check_room(need: Needs, free: dict, where: str) -> None:
    """One line when the Ray at `where` has fewer free CPUs or GPUs than the application reserves."""
    cpus, gpus = float(free.get("CPU", 0.0)), float(free.get("GPU", 0.0))
    if need.cpus > cpus + _EPS:
        raise CfirError(f"the application needs {need.cpus:g} CPUs ({need.parts}), {where} has {cpus:g} free: lower "
                        "serve.*_num_cpus or the replicas, or add a host to the cluster")
    if need.gpus > gpus + _EPS:
        raise CfirError(f"the application needs {need.gpus:g} GPUs (serve.front_replicas x serve.front_num_gpus), "
                        f"{where} has {gpus:g} free: lower serve.front_num_gpus, or add a host with GPUs")


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """One line when nothing listens at HOST:PORT (Ray's driver would retry for minutes without a word)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():  # "auto", a ray:// address: Ray resolves it
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise CfirError(f"cannot join the cluster at {address}: {e.strerror or type(e).__name__}; is its head "
                        "running (ray start --head) and the address serve.address / --address right?") from None

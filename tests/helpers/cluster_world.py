"""A cluster in one process for the reload protocol's tests: the real protocol classes (`cfir_jax.cluster.reload`:
the command's Coordinator and Reloader, the Relay, each front's Follower, each shard replica's ShardVersions) over
fakes of what surrounds them, on a fake clock:

- `Disk`: the workdir, holding its newest version only: commits (an image removed), a restore of an older version
  (a backup: the same id as before), a rebuild from scratch (version 1 again, another id), a damaged version;
- `ShardReplica`: Ray Serve's model multiplexing as Ray runs it (a version loaded on its first request, the last
  SHARD_VERSIONS kept, least recently used out) over the real load rule; a load may be slow;
- `Front`: a front replica whose own side loads what the disk holds, searching through the shards as RayShards does
  (a replica that holds the version first, any other next; a version found gone told to the follower);
- routing as Ray's: a call goes to a live replica that holds the version, else to any live one.

Every answer is recorded with the version each shard answered at and the images it can show."""

from __future__ import annotations

import collections
import dataclasses
import random

from cfir_jax.cluster.follow import Follower, ShardVersions
from cfir_jax.cluster.reload import Coordinator, Relay, Reloader, Target, VersionGone, version_id, version_number
from cfir_jax.core.errors import CfirError

SHARD_VERSIONS = 2  # cfir_jax.cluster.deployments.SHARD_VERSIONS
IMAGES = tuple(f"p{i}" for i in range(8))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclasses.dataclass(frozen=True)
class Content:
    removed: frozenset
    branch: int  # a restore or a rebuild starts a new branch: the removals of another branch do not apply


class Disk:
    """The workdir: its committed version id, and each id's content."""

    def __init__(self):
        self.content: dict[str, Content] = {}
        self.branch, self.number, self.made = 0, 0, 0
        self.bad: set[str] = set()  # ids that fail the command's checks (damaged, another model family)
        self.current = self._new(frozenset())
        self.removals: list[tuple[str, str]] = []  # (image, the id that removed it)

    def _new(self, removed: frozenset) -> str:
        self.number, self.made = self.number + 1, self.made + 1
        vid = version_id(self.number, f"b{self.branch}-{self.made}")
        self.content[vid] = Content(removed, self.branch)
        return vid

    def commit(self, image: str | None = None, bad: bool = False) -> str:
        removed = self.content[self.current].removed | ({image} if image else set())
        self.current = self._new(frozenset(removed))
        if image:
            self.removals.append((image, self.current))
        if bad:
            self.bad.add(self.current)
        return self.current

    def restore(self, vid: str) -> None:
        """A backup of an older version put back: its id again; the commits after it start a new branch."""
        self.current, self.branch = vid, self.branch + 1
        self.number = version_number(vid)

    def rebuild(self) -> None:
        """index.py from scratch: version 1 again, another id."""
        self.branch, self.number = self.branch + 1, 0
        self.current = self._new(frozenset())


class Workdir:
    """The command's view (`cfir_jax.cluster.reload.Workdir`)."""

    def __init__(self, disk: Disk):
        self.disk = disk

    def current(self) -> str:
        return self.disk.current

    def check(self, vid: str) -> None:
        if vid in self.disk.bad:
            raise CfirError(f"damaged: version {version_number(vid)}")


@dataclasses.dataclass(frozen=True)
class ShardSearch:
    """A stand-in for `cfir_jax.cluster.shard.ShardSearch`: the version it was opened at."""

    vid: str


class ShardReplica:
    """One replica of one shard: Ray's multiplexing over the real ShardVersions rule."""

    def __init__(self, shard: int, disk: Disk, clock: Clock, relay):
        self.shard, self.disk, self.clock = shard, disk, clock
        self.models: collections.OrderedDict[str, ShardSearch] = collections.OrderedDict()
        self.load_s = 0.0  # the next load's time (a slow load)
        self.versions = ShardVersions(lambda: disk.current, self._open, f"shard {shard}: ")
        self.alive, self.relay = True, relay
        self.poll()  # as the deployment's ShardReplica.__init__ loads the target before it answers

    def poll(self) -> None:
        """As the deployment's ShardReplica._follow, every period: the target loaded when the disk holds it."""
        try:
            vid = self.versions.wanted(self.relay.target())
            if vid is not None:
                self.at_version(vid)
        except (TimeoutError, CfirError):  # the relay restarting, the version gone
            pass

    def _open(self, vid: str) -> ShardSearch:
        self.clock.advance(self.load_s)
        self.load_s = 0.0
        return ShardSearch(vid)

    def at_version(self, vid: str) -> ShardSearch:
        if vid in self.models:
            self.models.move_to_end(vid)
            return self.models[vid]
        opened = self.versions.load(vid)  # VersionGone when the disk holds another
        if len(self.models) >= SHARD_VERSIONS:
            self.models.popitem(last=False)
        self.models[vid] = opened
        return opened


class Shards:
    """The replicas of every shard, routed as Ray routes a call by its multiplexed id."""

    def __init__(self, count: int, per_shard: int, disk: Disk, clock: Clock, relay, rng: random.Random):
        self.disk, self.clock, self.relay, self.rng = disk, clock, relay, rng
        self.replicas = [[ShardReplica(s, disk, clock, relay) for _ in range(per_shard)] for s in range(count)]

    def route(self, shard: int, vid: str) -> list[ShardReplica]:
        """The live replicas of a shard in the order Ray tries them: holders of vid first."""
        live = [r for r in self.replicas[shard] if r.alive]
        self.rng.shuffle(live)
        return sorted(live, key=lambda r: vid not in r.models)

    def prepare(self, vid: str, timeout_s: float) -> None:
        """The command's `Shards`: every shard loads vid (one replica each, as one routed call loads it)."""
        for s in range(len(self.replicas)):
            route = self.route(s, vid)
            if not route:
                raise CfirError(f"shard {s} could not load version {vid}: no live replica")
            start = self.clock()
            route[0].at_version(vid)  # VersionGone when the disk moved on
            if self.clock() - start > timeout_s:
                raise CfirError(f"shard {s} could not load version {vid}: not in {timeout_s:g} s")

    def restart(self, shard: int, n: int) -> None:
        """Ray replaces a dead replica: a new process, empty, which preloads the target when the disk holds it."""
        self.replicas[shard][n] = ShardReplica(shard, self.disk, self.clock, self.relay)


class Front:
    """A front replica: its own side is the version it loaded (only the one the disk holds), its searches go through
    the shards as RayShards sends them; the real Follower follows the target."""

    def __init__(self, relay, disk: Disk, shards: Shards, clock: Clock):
        self.disk, self.shards = disk, shards
        self.target: Target | None = None
        self.follower = Follower(relay, self, clock, spawn=lambda fn: fn())
        self.alive = True

    def serving(self) -> Target | None:
        return self.target

    def follow(self, target: Target) -> None:
        if self.target is not None and target.vid == self.target.vid:
            self.target = target
            return
        if self.disk.current != target.vid:
            raise VersionGone(target.vid, self.disk.current, "front: ")
        for s in range(len(self.shards.replicas)):  # the warm-up's searches, through the shards
            self._ask(s, target.vid)
        self.target = target

    def poll(self) -> None:
        try:
            self.follower.poll()
        except Exception:  # noqa: BLE001 - as FrontService._poll: the next report tries again
            pass

    def _ask(self, s: int, vid: str) -> str:
        """One shard's answer at vid (the id it answered at), or CfirError as RayShards' Unavailable."""
        why = "no live replica"
        for replica in self.shards.route(s, vid):
            try:
                return replica.at_version(vid).vid
            except VersionGone as e:
                why = str(e)
                self.follower.gone(vid, why)
        raise CfirError(f"shard {s} unavailable: {why}")

    def search(self) -> tuple[str, list[str], frozenset] | None:
        """(the front's version, each shard's answering version, the images shown), or None: 503."""
        if self.target is None:
            return None
        vid = self.target.vid
        try:
            answered = [self._ask(s, vid) for s in range(len(self.shards.replicas))]
        except CfirError:
            return None
        shown = frozenset(IMAGES) - self.disk.content[vid].removed
        return vid, answered, shown


class Relays:
    """The relay as the parts reach it: an actor that may restart (empty) or not answer for a while."""

    def __init__(self, clock: Clock):
        self.clock, self.relay, self.down = clock, Relay(clock), False

    def restart(self) -> None:
        self.relay = Relay(self.clock)

    def __getattr__(self, name: str):
        method = getattr(self.relay, name)

        def call(*args):
            if self.down:
                raise TimeoutError(f"the relay did not answer {name}")
            return method(*args)

        return call


class World:
    """Everything together: the command (Coordinator + Reloader, its reloads run when `run_reloads` says so), the
    relay, the fronts, the shards; `answers` holds every search's outcome."""

    def __init__(self, shards: int = 2, per_shard: int = 1, fronts: int = 2, seed: int = 0):
        self.rng = random.Random(seed)
        self.clock, self.disk = Clock(), Disk()
        self.relays = Relays(self.clock)
        target = Target(1, self.disk.current)
        self.relays.publish(target)
        self.shards = Shards(shards, per_shard, self.disk, self.clock, self.relays, self.rng)
        self.coordinator = Coordinator(Workdir(self.disk), self.shards, self.relays, target, prepare_timeout_s=900.0,
                                       clock=self.clock)
        self.lines: list[str] = []
        self.jobs: list = []  # reloads started and not yet run (a thread that has not run yet)
        self.reloader = Reloader(self.coordinator, self.relays, self.jobs.append, self.lines.append)
        self.fronts = [self._front() for _ in range(fronts)]
        self.answers: list[tuple[str, list[str], frozenset]] = []
        self.failed = 0
        self.followed = False  # a tick since the last reload, the relay answering: each replica saw the target
        self.settle()

    def _front(self) -> Front:
        front = Front(self.relays, self.disk, self.shards, self.clock)
        front.poll()
        return front

    def holds_the_target(self) -> bool:
        """Every live shard replica holds the target, once a tick passed since it was published and while the
        workdir holds it (what makes a dead replica cost no request while its shard has another)."""
        target = self.coordinator.target
        if not self.followed or self.disk.current != target.vid:
            return True
        return all(target.vid in r.models or r.versions.gone == target.vid
                   for replicas in self.shards.replicas for r in replicas if r.alive)

    def restart_front(self, n: int) -> None:
        self.fronts[n] = self._front()

    def run_reloads(self) -> None:
        self.followed = self.followed and not self.jobs
        while self.jobs:
            self.jobs.pop(0)()  # Coordinator.reload never raises: a failed reload is a line

    def tick(self, seconds: float = 1.0, sighups: int = 0) -> None:
        """Time passes: the command's tick, every live front's report (and follow)."""
        self.clock.advance(seconds)
        self.reloader.tick(sighups)
        for replica in (r for replicas in self.shards.replicas for r in replicas if r.alive):
            replica.poll()
        self.followed = not self.relays.down and not self.jobs  # every replica has seen the published target
        for front in self.fronts:
            if front.alive:
                front.poll()

    def search(self, n: int) -> bool:
        answer = self.fronts[n].search() if self.fronts[n].alive else None
        if answer is None:
            self.failed += 1
            return False
        self.answers.append(answer)
        return True

    def settle(self, rounds: int = 40) -> int:
        """Time passes with no step but the parts' own: reports, asks, reloads. Returns the reloads it took."""
        reloads = 0
        for _ in range(rounds):
            self.tick(2.0)
            reloads += len(self.jobs)
            self.run_reloads()
        return reloads

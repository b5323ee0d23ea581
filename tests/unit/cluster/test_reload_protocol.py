"""The cluster's reload protocol (cfir_jax/cluster/reload.py), its real classes in one process over fake replicas and
a fake clock (tests/helpers/cluster_world.py): a case for each failure of the protocol it replaced, then the
interleavings (hypothesis.stateful) of every step the cluster meets, with the invariants that must hold after each:

- every answer comes from the version its shards hold;
- a removed image never answers at or after its removal's version (of the same branch of the workdir's history);
- once the steps stop, the cluster serves the newest version that passed its checks within a bounded number of
  reloads, with no 503 (unless the workdir holds a version that fails its checks and the served one is gone);
- a reload never raises: a failed one is a line, and the served version stays."""

import threading
import time

import pytest
from cluster_world import IMAGES, World
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cfir_jax.cluster import follow, reload
from cfir_jax.cluster.reload import Coordinator, Outcome, Relay, Reloader, Target, version_number

# ------------------------------------------------------------------------------------------ one case per failure


def test_a_shard_replica_restarted_after_a_commit_recovers_without_a_sighup():
    """Item 1: a commit, the only replica of a shard dies and comes back holding the new version alone: the fronts'
    calls at the served version find it gone, the command reloads to the committed version (checked), and the
    searches answer again within 90 s, with no SIGHUP."""
    w = World(shards=2, per_shard=1, fronts=2)
    old = w.coordinator.target
    w.disk.commit("p0")
    w.shards.restart(0, 0)
    start = w.clock()
    assert not w.search(0)  # the served version is gone from shard 0: 503 now
    while not (w.search(0) and w.search(1)):
        assert w.clock() - start <= 90, w.lines
        w.tick(1.0)
        w.run_reloads()
    assert w.coordinator.target.generation == old.generation + 1 and w.coordinator.target.vid == w.disk.current
    assert all("p0" not in shown for vid, _, shown in w.answers if vid == w.disk.current)
    assert any("asked by a part" in line for line in w.lines)


def test_a_failed_or_timed_out_reload_is_one_line_and_the_served_version_stays():
    """Item 2: a version that fails its checks, a shard's load past the reload's time, a relay that does not answer
    while the new version is published: each SIGHUP is one line, the served version answers on (the relay's case:
    it is published again at the next tick)."""
    w = World(shards=2, per_shard=1, fronts=1)
    served = w.coordinator.target
    w.disk.commit("p1", bad=True)
    w.tick(sighups=1)
    w.run_reloads()
    assert w.lines[-1].startswith("reload: refused (SIGHUP), still serving version 1: damaged")
    w.disk.commit("p2")
    w.shards.replicas[1][0].load_s = 1000.0  # past the reload's 900 s
    w.tick(sighups=1)
    w.run_reloads()
    assert "not in 900 s" in w.lines[-1] and w.coordinator.target == served
    assert w.search(0) and w.answers[-1][0] == served.vid
    w.relays.down = True  # the relay restarting while the reload publishes
    w.tick(sighups=1)
    w.run_reloads()
    w.relays.down = False
    assert w.coordinator.target.version == 3 and w.lines[-1].startswith("reload: version 1 -> 3 (SIGHUP)")
    w.settle(3)
    assert w.search(0) and w.answers[-1][0] == w.disk.current


def test_the_command_keeps_checking_its_head_while_a_reload_runs():
    """Item 2: a reload that hangs (a shard that never answers) runs in a thread of its own; the command's loop
    still notices its head dying within a second, and never waits for the reload."""
    from cfir_jax.cluster import command

    release = threading.Event()

    class Hanging:
        def prepare(self, vid, timeout_s):
            release.wait(30)

    class Disk:
        def current(self):
            return "2:new"

        def check(self, vid):
            pass

    relay = Relay()
    coordinator = Coordinator(Disk(), Hanging(), relay, Target(1, "1:old"))
    reloader = Reloader(coordinator, relay, lambda fn: threading.Thread(target=fn, daemon=True).start(), [].append)
    dies_at = time.monotonic() + 1.0

    class Head:
        def lost(self):
            return "raylet (pid 7)" if time.monotonic() > dies_at else None

    signals = type("Signals", (), {"take_reloads": lambda self: 1})()
    t0 = time.monotonic()
    with pytest.raises(command._Lost, match="raylet"):
        command._serve(command._Run(head=Head()), signals, reloader)
    assert time.monotonic() - t0 < 3 and reloader.busy  # the reload still hangs; the command did not wait
    release.set()


def test_a_workdir_whose_version_goes_down_is_served_without_a_reload_loop():
    """Item 3: a backup of an older version restored, then a rebuild from scratch (version 1 again): one reload each,
    then nothing more."""
    w = World(shards=2, per_shard=2, fronts=2)
    w.disk.commit("p3")
    w.tick(sighups=1)
    w.run_reloads()
    older = next(v for v in w.disk.content if version_number(v) == 1)
    for change in (lambda: w.disk.restore(older), w.disk.rebuild):
        change()
        w.tick(sighups=1)
        reloads = len(w.jobs)
        w.run_reloads()
        reloads += w.settle(20)
        assert reloads == 1 and w.coordinator.target.vid == w.disk.current, w.lines
        assert all(f.target.vid == w.disk.current for f in w.fronts)


def test_a_refused_concurrent_reload_changes_nothing_of_the_running_one():
    """Item 4: an operator's reload while one runs is refused at once, and the running one completes: every front
    then serves its version and every shard holds it."""
    w = World(shards=2, per_shard=2, fronts=2)
    w.disk.commit("p4")
    w.tick(sighups=1)  # a reload started (its thread has not run yet)
    ticket = w.relays.ask("admin", w.coordinator.target.vid)
    w.tick()
    assert w.relays.outcome(ticket).line.endswith("a reload is already running")
    w.run_reloads()
    w.settle(3)
    assert w.coordinator.target.vid == w.disk.current
    assert all(f.target.vid == w.disk.current for f in w.fronts)
    assert all(any(w.disk.current in r.models for r in replicas) for replicas in w.shards.replicas)


def test_a_restarted_front_serves_the_checked_version_never_the_workdir_unchecked():
    """Item 5: a front restarted after a commit that fails its checks serves nothing of it (nor do the others,
    which answer on at the served version); after a good commit, a restarted front makes the command check it,
    and the cluster serves it once it passed."""
    w = World(shards=2, per_shard=1, fronts=2)
    served = w.coordinator.target
    bad = w.disk.commit("p5", bad=True)
    w.restart_front(0)
    w.settle(10)
    assert w.coordinator.target == served and w.fronts[0].target is None
    assert w.search(1) and w.answers[-1][0] == served.vid
    assert all(vid != bad for vid, _, _ in w.answers)
    good = w.disk.commit("p6")
    w.restart_front(0)
    w.settle(10)
    assert w.coordinator.target.vid == good and all(f.target.vid == good for f in w.fronts)


def test_a_relay_that_restarted_empty_is_whole_again_within_a_tick():
    w = World(shards=2, per_shard=1, fronts=1)
    w.relays.restart()
    assert w.relays.target() is None
    w.tick()
    assert w.relays.target() == w.coordinator.target
    ticket = w.relays.ask("admin", "x")
    w.relays.restart()
    assert not w.relays.outcome(ticket).ok  # an ask it lost: the asker is told to ask again


# ------------------------------------------------------------------------------------------------ interleavings


class Cluster(RuleBasedStateMachine):
    """Commits, SIGHUPs (two at once), operators' reloads, replicas, fronts and the relay dying and coming back, a
    workdir whose version goes down, damaged versions, slow loads, time passing; searches throughout."""

    @initialize(seed=st.integers(0, 2**16), per_shard=st.integers(1, 2), fronts=st.integers(1, 2))
    def start(self, seed, per_shard, fronts):
        self.w = World(shards=2, per_shard=per_shard, fronts=fronts, seed=seed)

    @rule(image=st.sampled_from(IMAGES), bad=st.booleans())
    def commit(self, image, bad):
        self.w.disk.commit(image, bad=bad and self.w.rng.random() < 0.3)

    @rule(n=st.integers(1, 2))
    def sighup(self, n):
        self.w.tick(0.1, sighups=n)

    @rule()
    def admin_reload(self):
        try:
            self.w.relays.ask("admin", self.w.coordinator.target.vid)
        except TimeoutError:  # the front answers 503: the relay does not answer
            pass
        self.w.tick(0.1)

    @rule()
    def reloads_run(self):
        self.w.run_reloads()

    @rule(shard=st.integers(0, 1), n=st.integers(0, 1))
    def shard_replica_dies_and_restarts(self, shard, n):
        """A replica killed: the searches of the fronts go on on the shard's other replica, if it has one, then Ray
        starts a new one."""
        w = self.w
        replicas = w.shards.replicas[shard]
        replicas[n % len(replicas)].alive = False
        held = w.holds_the_target() and w.followed and w.disk.current == w.coordinator.target.vid
        for i, front in enumerate(w.fronts):
            if held and len(replicas) > 1 and front.target == w.coordinator.target:
                assert w.search(i), f"front {i}: a dead replica cost a request"
        w.shards.restart(shard, n % len(replicas))

    @rule(n=st.integers(0, 1))
    def front_dies_and_restarts(self, n):
        self.w.restart_front(n % len(self.w.fronts))

    @rule()
    def relay_restarts(self):
        self.w.relays.restart()
        self.w.followed = False  # empty until the command's next tick publishes the target again

    @rule(down=st.booleans())
    def relay_slow(self, down):
        self.w.relays.down = down
        self.w.followed = self.w.followed and not down

    @rule(rebuild=st.booleans())
    def version_goes_down(self, rebuild):
        older = [v for v in self.w.disk.content if version_number(v) < version_number(self.w.disk.current)]
        if rebuild or not older:
            self.w.disk.rebuild()
        else:
            self.w.disk.restore(self.w.rng.choice(older))

    @rule(shard=st.integers(0, 1), seconds=st.sampled_from([5.0, 1000.0]))
    def slow_load(self, shard, seconds):
        for replica in self.w.shards.replicas[shard]:
            replica.load_s = seconds

    @rule(seconds=st.sampled_from([0.5, 1.0, 5.0, 30.0]))
    def time_passes(self, seconds):
        self.w.tick(seconds)

    @rule(n=st.integers(0, 1))
    def search(self, n):
        self.w.search(n % len(self.w.fronts))

    @invariant()
    def every_answer_is_of_the_version_its_shards_hold(self):
        for vid, answered, shown in self.w.answers:
            assert answered == [vid] * len(answered), (vid, answered)
            assert shown == frozenset(IMAGES) - self.w.disk.content[vid].removed

    @invariant()
    def a_removed_image_never_answers_at_or_after_its_removal(self):
        disk = self.w.disk
        for image, removed_at in disk.removals:
            branch, at = disk.content[removed_at].branch, version_number(removed_at)
            for vid, _, shown in self.w.answers:
                if disk.content[vid].branch == branch and version_number(vid) >= at:
                    assert image not in shown, (image, removed_at, vid)

    @invariant()
    def every_live_shard_replica_holds_the_served_version(self):
        assert self.w.holds_the_target(), [list(r.models) for rs in self.w.shards.replicas for r in rs]

    @invariant()
    def a_version_that_fails_its_checks_is_never_served(self):
        assert self.w.coordinator.target.vid not in self.w.disk.bad
        assert all(f.target is None or f.target.vid not in self.w.disk.bad for f in self.w.fronts)

    @rule()
    def steps_stop(self):
        """The steps stop (every replica back, the relay answering, loads fast), searches go on: within a bounded
        number of reloads the cluster serves its target at every front, then reloads no more."""
        w = self.w
        w.relays.down = False
        for replicas in w.shards.replicas:
            for replica in replicas:
                replica.load_s = 0.0
        reloads = []
        for _ in range(40):
            w.tick(2.0)
            reloads.append(len(w.jobs))
            w.run_reloads()
            for n in range(len(w.fronts)):
                w.search(n)
        assert sum(reloads) <= 4 and not any(reloads[-20:]), (reloads, w.lines[-8:])
        if w.disk.current in w.disk.bad:  # and the served version may be gone: nothing it can serve then
            return
        for n, front in enumerate(w.fronts):
            assert front.target == w.coordinator.target, (n, front.target, w.coordinator.target, w.lines[-5:])
            assert w.search(n), (n, w.lines[-5:])


SHORT = settings(max_examples=60, stateful_step_count=30, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))
TestCluster = Cluster.TestCase
TestCluster.settings = SHORT


@pytest.mark.slow
def test_the_protocol_over_many_long_interleavings():
    """The same machine, longer (the slow tier)."""
    from hypothesis.stateful import run_state_machine_as_test

    # 400 sequences of up to 80 steps (1,000 took a minute of the suite; 18 s alone now); the quick tier runs 60 of 30
    run_state_machine_as_test(Cluster, settings=settings(SHORT, max_examples=400, stateful_step_count=80))


def test_the_protocol_constants_leave_a_front_room_to_recover():
    assert reload.FOLLOW_RETRY_MAX_S < reload.STUCK_S and reload.ASK_AGAIN_S < 90 and follow.Follower
    assert isinstance(Outcome(True, "x"), Outcome)

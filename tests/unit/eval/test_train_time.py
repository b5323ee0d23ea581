"""Training time per epoch from a run's timing log: segments of resumed runs, hardware, and a log that is not one."""

from __future__ import annotations

import pytest

from cfir_jax.eval import train_time as tt


def test_seconds_per_epoch_sums_the_segments_of_a_resumed_run(tmp_path):
    # 10 steps per epoch. First process: steps 0 -> 40 in 80 s (killed after step 40's log, its checkpoint at 30);
    # the resumed one: 30 -> 60 in 30 s on other hardware. Timed: 70 steps in 110 s -> 15.71 s per epoch.
    tt.start_segment(tmp_path, 0, "1 x cpu (2 cores)", 10)
    for step in (20, 40):
        tt.log_step(tmp_path, step, 2.0 * step)
    tt.start_segment(tmp_path, 30, "8 x TPU v4", 10)
    tt.log_step(tmp_path, 60, 30.0)
    t = tt.train_time(tmp_path)
    assert t.steps == 70 and t.seconds_per_epoch == pytest.approx(110 / 70 * 10)
    assert t.hardware == "1 x cpu (2 cores); 8 x TPU v4"
    assert t.label() == f"{110 / 70 * 10:.1f} s (1 x cpu (2 cores); 8 x TPU v4)"


def test_hours_label_and_runs_without_a_usable_log(tmp_path):
    assert tt.TrainTime(45 * 3600.0, "64 x A100", 100).label() == "45.00 h (64 x A100)"
    assert tt.TrainTime(95.0, "1 x cpu (2 cores)", 10).label() == "1.6 min (1 x cpu (2 cores))"
    assert tt.TrainTime(2.44, "1 x cpu (2 cores)", 10).label() == "2.4 s (1 x cpu (2 cores))"
    assert tt.train_time(tmp_path) is None  # no log (a run trained before the log existed)
    tt.start_segment(tmp_path, 0, "1 x cpu (2 cores)", 10)
    assert tt.train_time(tmp_path) is None  # started, no step logged yet
    (tmp_path / tt.TIMING_FILE).write_bytes(b"\xff\xfe not json")
    assert tt.train_time(tmp_path) is None


def test_hardware_label_names_the_device_kind_and_count():
    import os

    import jax

    assert tt.hardware_label(jax.devices()[:1]) == f"1 x cpu ({os.cpu_count()} cores)"


def test_hardware_label_of_accelerators_names_their_kind_without_the_hosts_cores():
    """On a GPU or TPU the label is the devices' kind and count (faked devices: this host has none); on the CPU it
    adds the cores."""
    from types import SimpleNamespace

    gpus = [SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", platform="gpu")] * 8
    assert tt.hardware_label(gpus) == "8 x NVIDIA H100 80GB HBM3"
    tpus = [SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")] * 4
    assert tt.hardware_label(tpus) == "4 x TPU v5 lite"

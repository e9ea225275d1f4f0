"""The connector fault points, driven through their real control file."""

import json
import os

from leasekit.vllm.faultpoints import FaultPoints, read_state, write_control


def test_disabled_without_a_control_file(monkeypatch):
    monkeypatch.delenv("LEASEKIT_FAULT_FILE", raising=False)
    faults = FaultPoints.from_env(0)
    assert not faults.enabled
    faults.poll()
    assert faults.forward_stall() == 0.0


def test_drop_then_delay_next_then_send(tmp_path):
    path = str(tmp_path / "faults" / "decode.json")
    faults = FaultPoints(path, tp_rank=1)
    write_control(path, {"heartbeats": {"drop_next": 2, "delay_next_s": 0.5, "duplicate": 2}})
    faults.poll()
    actions = [faults.heartbeat_action() for _ in range(4)]
    assert actions == [("drop", 0, 0.0), ("drop", 0, 0.0), ("delay", 0, 0.5), ("send", 2, 0.0)]
    faults.record_heartbeat("drop", ["a"])
    state = read_state(path, 1)
    assert state["heartbeat_batches_seen"] == 4 and len(state["dropped"]) == 1
    assert state["pid"] == os.getpid() and "perf_counter" in state and "time" in state


def test_forward_stall_fires_once_per_control_seq(tmp_path):
    path = str(tmp_path / "c.json")
    faults = FaultPoints(path)
    write_control(path, {"forward_stall_s": 1.5, "seq": 1})
    faults.poll()
    assert faults.forward_stall() == 1.5 and faults.forward_stall() == 0.0
    write_control(path, {"forward_stall_s": 2.0, "seq": 2})
    os.utime(path, ns=(1, 1))  # a different mtime even within the same clock tick
    faults.poll()
    assert faults.forward_stall() == 2.0


def test_a_broken_control_file_is_counted_not_fatal(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    faults = FaultPoints(str(path))
    faults.poll()
    assert faults.state["errors"] == 1 and faults.forward_stall() == 0.0
    path.write_text(json.dumps([1, 2]))
    os.utime(path, ns=(5, 5))
    faults.poll()
    assert faults.state["errors"] == 2


def test_heartbeats_disturbed_while_any_heartbeat_fault_is_set(tmp_path):
    path = str(tmp_path / "c.json")
    faults = FaultPoints(path)
    write_control(path, {"forward_stall_s": 1.0, "seq": 1})
    faults.poll()
    assert not faults.heartbeats_disturbed()  # a stall is not a heartbeat fault
    for n, heartbeats in enumerate(({"drop_next": 1}, {"delay_next_s": 0.5}, {"drop_fraction": 0.5},
                                    {"delay_s": 1.0}, {"duplicate": 2}), start=2):
        write_control(path, {"heartbeats": heartbeats, "seq": n})
        os.utime(path, ns=(n, n))
        faults.poll()
        assert faults.heartbeats_disturbed(), heartbeats
    write_control(path, {"heartbeats": {"drop_next": 1}, "seq": 9})
    os.utime(path, ns=(9, 9))
    faults.poll()
    faults.heartbeat_action()  # the one drop is spent
    assert not faults.heartbeats_disturbed()


def test_a_push_writer_stall_is_given_once_per_control_and_reported(tmp_path):
    from leasekit.vllm.faultpoints import FaultPoints, read_state, write_control

    path = str(tmp_path / "prefill.json")
    points = FaultPoints(path)
    points.poll()
    assert points.writer_stall() == 0.0  # no control file yet
    write_control(path, {"writer_stall_s": 2.5, "seq": 1})
    points.poll()
    assert points.forward_stall() == 0.0  # a writer stall is not a forward-pass stall
    assert points.writer_stall() == 2.5
    assert points.writer_stall() == 0.0  # once per seq
    points.record_writer_stall(10.0, 12.5)
    state = read_state(path)
    assert state["seq"] == 1 and state["writer_stalls"] == [{"start_perf_s": 10.0, "end_perf_s": 12.5, "seconds": 2.5}]
    write_control(path, {"writer_stall_s": 1.0, "seq": 2})
    os.utime(path, ns=(1, 1))  # a new mtime even within the filesystem's timestamp granularity
    points.poll()
    assert points.writer_stall() == 1.0 and read_state(path)["writer_stalls"] == []  # a fresh state per seq

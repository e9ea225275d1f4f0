"""Host arguments are checked with clear errors, and the host agent's cleanup (run by teardown and
by the watchdog) kills only processes of its own run, removes what the run registered, and the
watchdog cleans up on its own once the heartbeat stops. Real local processes, no SSH."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from leasekit.cluster import hostagent
from leasekit.cluster.hosts import Host
from leasekit.cluster.localhost import LocalHost
from leasekit.cluster.sshhost import SshHost


def _running(pid: int) -> bool:
    stat = hostagent._stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def test_bad_arguments_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="host name"):
        Host("gpu b")
    with pytest.raises(ValueError, match=r"stale_s \(1\) must be >= 2 \* heartbeat_s"):
        Host("gpu-b", heartbeat_s=1, stale_s=1)
    with pytest.raises(ValueError, match="port of host 'gpu-b' must be an int in 1..65535"):
        SshHost("gpu-b", "10.237.0.2", port=0)
    host = LocalHost()
    with pytest.raises(ValueError, match="argv must be a non-empty list of strings"):
        host.spawn("sleep 1")
    with pytest.raises(ValueError, match="name must match"):
        host.spawn(["true"], name="../escape")
    with pytest.raises(ValueError, match="cores must be a non-empty list"):
        host.pin(123, [])
    with pytest.raises(ValueError, match="not spawned by this run"):
        host.signal_group(os.getpid(), signal.SIGCONT)
    assert not host._ready, "refused calls must not create anything on the host"


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "leasekit-run"
    path.mkdir()
    (path / "manifest").write_text("")
    return str(path)


def _start(run_dir: str, marked: bool) -> subprocess.Popen:
    env = dict(os.environ, **({hostagent.MARKER: run_dir} if marked else {}))
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)


def test_cleanup_kills_marked_groups_only_and_removes_registered_paths(run_dir, tmp_path):
    ours, stranger = _start(run_dir, True), _start(run_dir, False)  # stranger: a reused pgid
    extra_file, extra_dir = tmp_path / "spans.json", tmp_path / "scratch"
    extra_file.write_text("{}")
    extra_dir.mkdir()
    for kind, value in [("group", ours.pid), ("group", stranger.pid), ("file", extra_file), ("dir", extra_dir)]:
        hostagent.register(run_dir, kind, str(value))
    try:
        summary = hostagent.cleanup(run_dir, kill_watchdog=True)
        assert ours.wait(timeout=5) == -signal.SIGKILL
        assert stranger.poll() is None, "a process without this run's marker was killed"
        assert summary["killed"] == [ours.pid] and summary["left"] == [] and summary["errors"] == []
        assert not extra_file.exists() and not extra_dir.exists() and not os.path.exists(run_dir)
        assert summary["removed"][-1] == run_dir
    finally:
        for proc in (ours, stranger):
            proc.kill()
            proc.wait()


def test_register_refuses_unknown_kinds(run_dir):
    with pytest.raises(ValueError, match="kind must be one of"):
        hostagent.register(run_dir, "socket", "/x")


def test_watchdog_cleans_up_once_the_heartbeat_stops(run_dir):
    proc = _start(run_dir, True)
    hostagent.register(run_dir, "group", str(proc.pid))
    with open(os.path.join(run_dir, "heartbeat"), "w") as handle:
        handle.write("1")
    watchdog = subprocess.Popen([sys.executable, hostagent.__file__, "watchdog", run_dir, "--stale-s", "0.5",
                                 "--interval-s", "0.05"], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = watchdog.communicate(timeout=10)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        report = json.loads(out.strip().splitlines()[-1])
        assert report["watchdog"] == "heartbeat stale" and report["killed"] == [proc.pid]
        assert not os.path.exists(run_dir)
    finally:
        watchdog.kill()
        proc.kill()
        proc.wait()


def test_watchdog_waits_while_the_heartbeat_changes(run_dir):
    beat = os.path.join(run_dir, "heartbeat")
    with open(beat, "w") as handle:
        handle.write("0")
    watchdog = subprocess.Popen([sys.executable, hostagent.__file__, "watchdog", run_dir, "--stale-s", "0.5",
                                 "--interval-s", "0.05"], stdout=subprocess.DEVNULL)
    try:
        for count in range(1, 12):  # 1.1 s of beats every 0.1 s: more than twice the stale limit
            with open(beat, "w") as handle:
                handle.write(str(count))
            assert watchdog.poll() is None, f"fired at beat {count}"
            time.sleep(0.1)
        assert os.path.exists(run_dir)
        assert watchdog.wait(timeout=5) == 0  # no more beats: it cleans up and exits
        assert not os.path.exists(run_dir)
    finally:
        watchdog.kill()
        watchdog.wait()


def test_the_run_directory_is_named_once_nothing_was_made_yet(tmp_path):
    """A host first made for the host checks (a random run name) takes the suite's name when its
    first server starts; once the run directory exists, its name stays."""
    host = LocalHost(workdir=str(tmp_path))
    assert host.run(["true"])[0] == 0  # a host check: makes nothing
    assert host.name_run("20261202-kill-decode") and host.run_dir == str(tmp_path / "20261202-kill-decode")
    with pytest.raises(ValueError, match="run_name must match"):
        host.name_run("../up")
    with host:
        host.write_file("x", "1")  # the run directory now exists
        assert not host.name_run("another") and host.run_dir == str(tmp_path / "20261202-kill-decode")

"""Process-group teardown on real processes: nothing survives, not even a child in its own group."""

import os
import subprocess
import sys
import time

import psutil

from leasekit.cluster import procs


def test_terminate_group_kills_the_whole_tree():
    # a session leader with a child that ignores SIGTERM and a grandchild that leaves the group
    script = (
        "import os, signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "subprocess.Popen([sys.executable, '-c', 'import os,time; os.setpgid(0, 0); time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    assert procs.wait_until(lambda: len(psutil.Process(leader.pid).children(recursive=True)) == 2, 10)
    tree = [leader.pid] + [c.pid for c in psutil.Process(leader.pid).children(recursive=True)]
    t0 = time.monotonic()
    killed = procs.terminate_group(leader.pid, leader.pid, grace_s=1.0)
    leader.wait(timeout=5)
    assert time.monotonic() - t0 < 10
    assert killed  # the SIGTERM-ignoring child needed SIGKILL
    for pid in tree:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_pin_threads_sets_affinity():
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", "import threading,time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"])
    try:
        time.sleep(0.5)
        assert procs.pin_threads([proc.pid], cores[-1]) >= 2
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == {cores[-1]}
    finally:
        proc.kill()
        proc.wait()


def test_background_children_run_batch_at_nice_10_until_given_normal_priority():
    child = subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"],
                             preexec_fn=procs.child_preexec(None, die_with_parent=False, idle=True))
    try:
        time.sleep(0.5)
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 2
        assert all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in tids)
        assert all(os.getpriority(os.PRIO_PROCESS, t) == procs.BACKGROUND_NICE for t in tids)
        assert procs.normal_priority([child.pid]) == len(tids)
        assert all(os.sched_getscheduler(t) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, t) == 0 for t in tids)
        assert procs.normal_priority([child.pid]) == 0  # nothing left to change
    finally:
        child.kill()
        child.wait()

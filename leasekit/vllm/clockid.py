"""The identity of this process's ``time.perf_counter`` clock, for the grant pledge (leasekit/lease/pledge.py).

On Linux ``perf_counter`` reads ``CLOCK_MONOTONIC``: one clock for every process of one boot, shifted in a
time namespace by that namespace's offset (``/proc/<pid>/timens_offsets``). Two processes whose ids are
equal (same boot id, same offsets) therefore read the same clock: P's scheduler (which writes the pledge) and
P's workers (which stamp acknowledgements), and a P restarted on the same host, whose samples stay valid
because the clock did not change. A restart on another host, with another time-namespace offset, or after a
reboot gets another id (computed once at start: a process checkpointed and restored elsewhere, CRIU, keeps
a stale one), and D then has no sample of it (no fast path until an ack arrives).
"""

from __future__ import annotations

import hashlib
import os
import time


def local_clock_id() -> str | None:
    """16 hex digits naming this process's ``perf_counter`` clock (``sha256`` of the boot id and the time
    namespace's offsets, ``/proc/self/timens_offsets``), or None when it cannot be named: ``perf_counter`` is not ``CLOCK_MONOTONIC``, no boot id
    is readable, or libfaketime fakes monotonic clocks in this process (``LD_PRELOAD`` names faketime
    without ``FAKETIME_DONT_FAKE_MONOTONIC=1``). Never raises."""
    try:
        if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
            return None
        if "faketime" in os.environ.get("LD_PRELOAD", "") and os.environ.get("FAKETIME_DONT_FAKE_MONOTONIC") != "1":
            return None
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
        if not boot:
            return None
        try:  # the offsets themselves, not the namespace's inode number (the kernel reuses those)
            with open("/proc/self/timens_offsets", encoding="ascii") as handle:
                offsets = " ".join(handle.read().split())
        except OSError:  # a kernel without time namespaces: one monotonic clock per boot
            offsets = "-"
        return hashlib.sha256(f"{boot}/{offsets}".encode()).hexdigest()[:16]
    except Exception:
        return None

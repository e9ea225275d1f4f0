"""The libfaketime sleep shim, and building it on a host.

libfaketime 0.9.10 (Debian bookworm) with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` breaks
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` (wolfcw/libfaketime#426): every Python >= 3.11
``time.sleep`` then raises ``OSError: [Errno 22]``. A process whose wall clock is faked preloads this
shim ahead of libfaketime; it sends monotonic and boottime sleeps straight to the kernel.
:mod:`leasekit.cluster.clockshift` builds it on this machine; :func:`install_on_host` builds it on a
server's host (a server started over SSH preloads the host's copy, not this machine's).
"""

from __future__ import annotations

import hashlib

from leasekit.cluster.hosttypes import HostError

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
/* leasekit: monotonic/boottime sleeps go to the kernel, bypassing libfaketime (#426). */
typedef int (*cns_fn)(clockid_t, int, const struct timespec *, struct timespec *);
int clock_nanosleep(clockid_t id, int flags, const struct timespec *req, struct timespec *rem) {
    static cns_fn next;
    if (id == CLOCK_MONOTONIC || id == CLOCK_BOOTTIME) {
        return syscall(SYS_clock_nanosleep, id, flags, req, rem) == 0 ? 0 : errno;
    }
    if (!next) next = (cns_fn)dlsym(RTLD_NEXT, "clock_nanosleep");
    return next ? next(id, flags, req, rem) : ENOSYS;
}
"""


def build_command(src: str, out: str, compiler: str) -> list[str]:
    """The compiler command that builds the shim from C source ``src`` into ``out`` (on any host)."""
    return [compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-ldl"]


def shim_name() -> str:
    """The shim's file name, ``faketime-sleepfix-<16 hex digits of SOURCE's SHA-256>.so``: a changed
    source gets a new name, so a stale build is never preloaded."""
    return f"faketime-sleepfix-{hashlib.sha256(SOURCE.encode()).hexdigest()[:16]}.so"


def install_on_host(host) -> str:
    """Build the shim on ``host`` (a :class:`leasekit.cluster.hosts.Host`) in its run directory,
    ``lib/<shim_name()>``, unless it is there; returns its path on the host. The C source is
    written there and compiled with the host's ``gcc`` (or ``cc``).

    Raises:
        HostError: the host has no C compiler (fix: install gcc there) or the build failed.
    """
    target = host.path(f"lib/{shim_name()}")
    if host.run(["test", "-f", target])[0] == 0:
        return target
    compiler = host.which("gcc") or host.which("cc")
    if compiler is None:
        raise HostError(f"host {host.name}: no C compiler to build the libfaketime sleep shim (a wall-clock skew "
                        "launches D with it); fix: install gcc on that host (apt-get install gcc)")
    host.check(["mkdir", "-p", host.path("lib")])
    source = host.write_file(f"lib/{shim_name()}.c", SOURCE)
    host.check(build_command(source, f"{target}.tmp", compiler), timeout_s=120)
    host.check(["mv", "-f", f"{target}.tmp", target])
    return target

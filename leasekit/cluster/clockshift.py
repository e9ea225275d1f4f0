"""Launch-time clock shifts: they change how a server is started, not the running process (the
chaos suite's clock-skew launch conditions, set by :class:`leasekit.cluster.pair.PDPair`).

- :func:`time_namespace_prefix`: run the command in a new Linux time namespace whose
  ``CLOCK_MONOTONIC`` (what ``time.monotonic``/``time.perf_counter`` read: the lease clock) and
  ``CLOCK_BOOTTIME`` are shifted; the wall clock (``time.time``) is untouched.
- :func:`faketime_env`: LD_PRELOAD libfaketime so the wall clock (``CLOCK_REALTIME``) is shifted
  and/or runs at another rate, while monotonic clocks stay real (``FAKETIME_DONT_FAKE_MONOTONIC``).

libfaketime 0.9.10 (Debian bookworm) with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` breaks
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` (it passes a negative deadline: EINVAL), which
is how Python >= 3.11 implements ``time.sleep``: every ``time.sleep`` raises ``OSError: [Errno 22]``
(wolfcw/libfaketime#426). :func:`faketime_env` therefore preloads, ahead of libfaketime, a tiny
shim (compiled once with ``gcc``, cached) that sends monotonic/boottime ``clock_nanosleep`` calls
straight to the kernel; pass ``sleep_fix=False`` to leave libfaketime alone.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from leasekit.cluster.sleepfix import SOURCE as _SLEEP_FIX_SOURCE
from leasekit.cluster.sleepfix import build_command, shim_name

#: The kernel refuses time-namespace offsets beyond KTIME_SEC_MAX / 2 seconds.
MAX_OFFSET_S = 4_611_686_018
RATE_RANGE = (0.001, 1000.0)
DEBIAN_LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/{lib}"
LIBFAKETIME_GLOBS = ("/usr/lib/*/faketime/{lib}", "/usr/lib/faketime/{lib}",
                     "/usr/local/lib/faketime/{lib}", "/usr/local/lib/{lib}")


class ClockShiftError(RuntimeError):
    """A clock shift cannot be set up on this machine (a tool, kernel feature or library is missing,
    or the sleep shim did not build); the message says what and how to fix it."""


def _check_offset(field: str, value: object, lowest_s: float) -> int:
    """A whole number of seconds in (lowest_s, MAX_OFFSET_S]; ValueError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number of seconds, got {value!r}")
    if value != int(value):
        raise ValueError(f"{field} must be a whole number of seconds (unshare takes integers), got {value!r}")
    if not lowest_s < value <= MAX_OFFSET_S:
        raise ValueError(f"{field} must be in {math.floor(lowest_s) + 1}..{MAX_OFFSET_S} seconds "
                         f"(the clock may not go below 0), got {value!r}")
    return int(value)


def time_namespace_prefix(monotonic_offset_s: float, *, boottime_offset_s: float | None = None,
                          check: bool = True) -> list[str]:
    """``unshare --time --fork --kill-child --monotonic=<N> --boottime=<M>``: prefix a command with
    it to run that command with ``CLOCK_MONOTONIC`` shifted by ``monotonic_offset_s`` seconds
    (``CLOCK_BOOTTIME`` by ``boottime_offset_s``, default the same). Needs root (CAP_SYS_ADMIN).
    ``--kill-child`` SIGKILLs the command when ``unshare`` dies, so killing the prefix kills it.

    Offsets are whole seconds (util-linux ``unshare`` rejects fractions); a negative offset may not
    take the clock below zero (the kernel answers ERANGE). ``check=False`` (a plan) skips looking for
    ``unshare`` and time namespaces on this machine.

    Raises:
        ValueError: an offset is not a whole number in (-current clock value, 4611686018].
        ClockShiftError: ``unshare`` is missing or the kernel has no time namespaces (``check`` only).
    """
    mono = _check_offset("monotonic_offset_s", monotonic_offset_s, -time.clock_gettime(time.CLOCK_MONOTONIC))
    boot = mono if boottime_offset_s is None else _check_offset(
        "boottime_offset_s", boottime_offset_s, -time.clock_gettime(time.CLOCK_BOOTTIME))
    if boot < -time.clock_gettime(time.CLOCK_BOOTTIME):
        raise ValueError(f"boottime_offset_s {boot} would take CLOCK_BOOTTIME below 0")
    unshare = shutil.which("unshare")
    if not check:
        return [unshare or "unshare", "--time", "--fork", "--kill-child", f"--monotonic={mono}", f"--boottime={boot}"]
    if unshare is None:
        raise ClockShiftError("unshare not found: install the util-linux package")
    if not os.path.exists("/proc/self/ns/time"):
        raise ClockShiftError("this kernel has no time namespaces (Linux >= 5.6 with CONFIG_TIME_NS)")
    return [unshare, "--time", "--fork", "--kill-child", f"--monotonic={mono}", f"--boottime={boot}"]


def find_libfaketime(multithreaded: bool = False) -> str:
    """Path of ``libfaketime.so.1`` (``libfaketimeMT.so.1`` if ``multithreaded``).

    Raises:
        ClockShiftError: not installed (names the Debian package ``faketime``).
    """
    lib = "libfaketimeMT.so.1" if multithreaded else "libfaketime.so.1"
    for pattern in LIBFAKETIME_GLOBS:
        found = sorted(glob.glob(pattern.format(lib=lib)))
        if found:
            return found[0]
    raise ClockShiftError(f"{lib} not found under /usr/lib/*/faketime/: install the Debian package "
                     f"`faketime` (apt-get install faketime), which brings libfaketime")


def sleep_fix_path() -> Path:
    """Where the compiled clock_nanosleep shim lives (``$XDG_CACHE_HOME/leasekit`` or
    ``~/.cache/leasekit``, named after its source's hash); it may not be built yet."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leasekit"
    return cache / shim_name()


def sleep_fix_build_command(src: str | Path, out: str | Path, gcc: str | None = None) -> list[str]:
    """The compiler command that builds the shim from C source ``src`` into ``out`` (what
    :func:`sleep_fix_library` runs in a temporary directory before moving ``out`` into the cache)."""
    return build_command(str(src), str(out), gcc or shutil.which("gcc") or "gcc")


def sleep_fix_library() -> str:
    """Path of the compiled clock_nanosleep shim (built with ``gcc`` on first use, then cached
    at :func:`sleep_fix_path`).

    Raises:
        ClockShiftError: ``gcc`` is missing or the build failed.
    """
    target = sleep_fix_path()
    cache = target.parent
    if target.exists():
        return str(target)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise ClockShiftError("gcc not found: needed once to build the libfaketime sleep shim "
                         "(apt-get install gcc), or pass sleep_fix=False")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / "sleepfix.c", Path(tmp) / "sleepfix.so"
        src.write_text(_SLEEP_FIX_SOURCE)
        build = subprocess.run(sleep_fix_build_command(src, out, gcc),
                               capture_output=True, text=True, check=False)
        if build.returncode != 0:
            raise ClockShiftError(f"building the libfaketime sleep shim failed: {build.stderr.strip()}")
        os.replace(out, target)  # atomic: concurrent builders each install a complete file
    return str(target)


def faketime_spec(offset_s: float = 0.0, rate: float = 1.0) -> str:
    """The ``FAKETIME`` value: relative offset in seconds, then ``x<rate>`` if rate != 1
    (e.g. ``"+3600"``, ``"-1.5 x2"``; libfaketime needs the offset even when it is 0)."""
    offset = f"{int(offset_s):+d}" if offset_s == int(offset_s) else f"{offset_s:+.6f}".rstrip("0")
    return offset if rate == 1 else f"{offset} x{rate:g}"


def faketime_env(offset_s: float = 0.0, rate: float = 1.0, *, multithreaded: bool = False,
                 sleep_fix: bool = True, build: bool = True) -> dict[str, str]:
    """Environment variables that make a launched process see the wall clock (``time.time()``)
    shifted by ``offset_s`` seconds and running ``rate`` times as fast, monotonic clocks real.

    Returns ``{"LD_PRELOAD", "FAKETIME", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}``; merge it over the
    child's environment (it replaces any LD_PRELOAD there). ``LD_PRELOAD`` lists the sleep shim
    first (see the module docstring) unless ``sleep_fix`` is False. ``build=False`` (a plan) builds
    and looks for nothing: the shim's cache path and libfaketime's Debian path stand in.

    Raises:
        ValueError: ``offset_s`` not finite or would make the wall clock negative or exceed
            4611686018 s; ``rate`` not in 0.001..1000.
        ClockShiftError: libfaketime (Debian ``faketime``) missing, or the shim could not be built
            (``build`` only).
    """
    if isinstance(offset_s, bool) or not isinstance(offset_s, (int, float)) or not math.isfinite(offset_s) \
            or not -time.time() < offset_s <= MAX_OFFSET_S:
        raise ValueError(f"offset_s must be a finite number of seconds in ({-int(time.time())}, "
                         f"{MAX_OFFSET_S}], got {offset_s!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) \
            or not RATE_RANGE[0] <= rate <= RATE_RANGE[1]:
        raise ValueError(f"rate must be a number in {RATE_RANGE[0]}..{RATE_RANGE[1]}, got {rate!r}")
    if build:
        preload = [find_libfaketime(multithreaded)]
        if sleep_fix:
            preload.insert(0, sleep_fix_library())
    else:
        try:
            preload = [find_libfaketime(multithreaded)]
        except ClockShiftError:
            preload = [DEBIAN_LIBFAKETIME.format(lib="libfaketimeMT.so.1" if multithreaded else "libfaketime.so.1")]
        if sleep_fix:
            preload.insert(0, str(sleep_fix_path()))
    return {
        "LD_PRELOAD": " ".join(preload),
        "FAKETIME": faketime_spec(float(offset_s), float(rate)),
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def plan_commands(wall_offset_s: float = 0.0, wall_rate: float = 1.0) -> list[dict]:
    """Commands a launch-time clock shift runs besides the server's own ``unshare`` prefix and
    faketime environment (both part of the server command line): building the libfaketime sleep
    shim once, when the wall clock is faked and the shim is not cached yet. Plan steps
    ``{"argv": [...], "what": ...}``; nothing is run."""
    if (not wall_offset_s and wall_rate == 1.0) or sleep_fix_path().exists():
        return []
    return [{"argv": sleep_fix_build_command("<tmp>/sleepfix.c", "<tmp>/sleepfix.so"),
             "what": f"build the libfaketime sleep shim once (C source written to <tmp>, then moved to {sleep_fix_path()})"}]

"""The nemesis: fault injectors act on real processes and transports, never on the checks.

Every injector has ``inject()``, ``recover()`` where meaningful, and an idempotent ``cleanup()``
that always restores the system, and fills ``record`` (a dict, in place) with what it did:
targets, and ``*_monotonic_s`` (``time.monotonic()``) / ``*_wall_s`` (``time.time()``) stamps.

- :mod:`.kill`: :class:`KillFault` (whole process group or the engine core only).
- :mod:`.stall`: :class:`SigstopStall`, :class:`FreezerStall` (cgroup v2/v1 freezer).
- :mod:`.netns`: :class:`NetworkNamespace` with nftables rules inside it; :mod:`.nft`: :class:`NftFault`.
- :mod:`.partition`: partitions between P's host and D's host (nftables in one host's namespace).
- :mod:`.toxiproxy`: :class:`ToxiproxyClient`, :class:`ToxiproxyFault` (``TOXIPROXY_URL``).

Clock skew is a launch condition, not an injector: :mod:`leasekit.cluster.clockshift` (time-namespace
prefix, libfaketime environment), applied when :class:`leasekit.cluster.pair.PDPair` starts a server.

Importing has no side effects; acting needs root (signals to others' processes, cgroups,
namespaces) and ``ip``/``nft`` as each module says.
"""

from leasekit.chaos.faults._common import FaultError
from leasekit.chaos.faults.kill import KillFault, find_engine_core_pids
from leasekit.chaos.faults.netns import NetworkNamespace
from leasekit.chaos.faults.nft import NftFault
from leasekit.chaos.faults.stall import FreezerStall, SigstopStall, detect_freezer
from leasekit.chaos.faults.toxiproxy import (
    ToxiproxyClient,
    ToxiproxyError,
    ToxiproxyFault,
)

__all__ = [
    "FaultError",
    "FreezerStall",
    "KillFault",
    "NetworkNamespace",
    "NftFault",
    "SigstopStall",
    "ToxiproxyClient",
    "ToxiproxyError",
    "ToxiproxyFault",
    "detect_freezer",
    "find_engine_core_pids",
]

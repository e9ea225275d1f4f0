""":class:`NftFault`: one nftables block/loss rule inside a :class:`NetworkNamespace`, as an
injector (``inject`` adds the rule, ``recover``/``cleanup`` delete it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from leasekit.chaos.faults._common import FaultError, stamp
from leasekit.chaos.faults._netlink import (
    ACTIONS,
    CHAINS,
    MATCHES,
    PROTOCOLS,
    check_choice,
    check_int,
)

if TYPE_CHECKING:
    from leasekit.chaos.faults.netns import NetworkNamespace

MODES = ("block", "loss")


class NftFault:
    """Block (``mode="block"``: drop or reject) or randomly drop ``percent`` % (``mode="loss"``)
    of the packets on ``port`` inside ``netns``.

    Arguments are validated at construction, so a bad scenario fails before anything starts.
    ``record`` (in place): kind, namespace, rule parameters, ``handle``, and
    ``injected_*``/``recovered_*`` stamps (``_monotonic_s``: ``time.monotonic()``, ``_wall_s``:
    ``time.time()``). The namespace itself belongs to the caller: cleanup never destroys it.

    Raises:
        ValueError: ``mode`` not ``block``/``loss``, port not 1..65535, percent not an int in
            0..100, or action/chain/protocol/match outside their allowed sets.
    """

    def __init__(self, netns: NetworkNamespace, port: int, *, mode: str = "block",
                 action: str = "drop", chain: str = "input", protocol: str = "tcp",
                 match: str = "dport", percent: int = 100):
        check_choice("mode", mode, MODES)
        check_int("port", port, 1, 65535)
        check_int("percent", percent, 0, 100)
        check_choice("action", action, ACTIONS)
        check_choice("chain", chain, CHAINS)
        check_choice("protocol", protocol, PROTOCOLS)
        check_choice("match", match, MATCHES)
        self.netns = netns
        self.params = {"port": port, "mode": mode, "action": action, "chain": chain,
                       "protocol": protocol, "match": match, "percent": percent}
        self.handle: int | None = None
        self.record: dict = {}

    def inject(self) -> None:
        """Add the rule now.

        Raises:
            FaultError: already injected, or ``nft`` failed.
        """
        if self.handle is not None:
            raise FaultError(f"NftFault already injected (rule handle {self.handle})")
        p = self.params
        self.record.clear()
        self.record.update({"kind": "nft", "namespace": self.netns.name, **p})
        stamp(self.record, "injected")
        common = {"chain": p["chain"], "protocol": p["protocol"], "match": p["match"]}
        if p["mode"] == "block":
            self.handle = self.netns.block(p["port"], action=p["action"], **common)
        else:
            self.handle = self.netns.loss(p["port"], p["percent"], **common)
        self.record["handle"] = self.handle

    def recover(self) -> None:
        """Delete the rule (no-op if not injected or the namespace is already gone)."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        if not self.netns.destroyed:
            self.record["packets_matched"] = self.netns.rule_packets(handle)
            self.netns.unblock(handle)
        stamp(self.record, "recovered")

    def cleanup(self) -> None:
        """Make sure the rule is gone; idempotent."""
        self.recover()

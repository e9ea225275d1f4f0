"""Push registrations as vLLM's D sends them, and P's side as :class:`PushRegGuard` sees it (test_pushreg_*)."""

import msgspec

from leasekit.lease.pushreg import PUSH_REG_PREFIX, PushRegGuard, decode_push_reg


MAX_BYTES = 1 << 16
USED = ("request_id", "decode_engine_id", "decode_host", "decode_port", "decode_tp_size", "local_block_ids")
_DELETE = object()


def reg_dict(**over):
    """A registration as vLLM's D builds it (``_send_registration_to_p``'s ``reg_data``); ``_DELETE`` drops a key."""
    reg = dict(request_id="cmpl-7f3a-0-1a2b3c4d", decode_engine_id="engine-d-0", decode_host="10.0.0.2",
               decode_port=5600, decode_tp_size=1, local_block_ids=[[1, 2, 3]], remote_engine_id="engine-p-0",
               remote_host="10.0.0.1", remote_port=5601, remote_tp_size=1, remote_pp_size=1)
    reg.update(over)
    return {k: v for k, v in reg.items() if v is not _DELETE}


def notif(**over) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(reg_dict(**over))


def decode(msg, max_bytes=MAX_BYTES, **kw):
    return decode_push_reg(msg, max_bytes=max_bytes, **kw)


class World:
    """P's side as the guard sees it: ``leases`` maps a registration's request id to P's lease id (base-id
    matching is the ``live`` callable's job), ``hosts`` the addresses P may dial."""

    def __init__(self, leases=None, hosts=("10.0.0.2",)):
        self.leases = dict(leases or {})
        self.hosts = set(hosts)

    def guard(self, hold_s=2.0, max_held=8, max_bytes=MAX_BYTES, **kw):
        return PushRegGuard(live=self.leases.get, allowed=self.hosts.__contains__, hold_s=hold_s,
                            max_bytes=max_bytes, max_held=max_held, **kw)

"""The notification tap and telemetry error reports (pure logic: the NIXL wrapper is a stand-in)."""

import logging

import pytest

from leasekit.vllm.taps import NotificationTap, TelemetryErrors


class _Wrapper:
    def __init__(self, fail=False):
        self.sent, self.fail = [], fail

    def send_notif(self, agent, notif_msg):
        if self.fail:
            raise RuntimeError("UCX down")
        self.sent.append((agent, notif_msg))

    def get_new_notifs(self):
        return {"agent-d": [b"HB:a,b", b"a:1"]}

    def other(self):
        return "delegated"


def test_tap_reports_heartbeat_sends_and_remembers_the_sender():
    seen = []
    tap = NotificationTap(_Wrapper(), lambda agent, msg, ok: seen.append((agent, msg, ok)))
    tap.send_notif("p-agent", b"HB:r1")
    tap.send_notif("p-agent", b"r1:1")  # not a heartbeat: not reported
    assert seen == [("p-agent", b"HB:r1", True)]
    assert tap.get_new_notifs() == {"agent-d": [b"HB:a,b", b"a:1"]}
    assert tap.agent_of(b"a:1") == "agent-d" and tap.agent_of(b"x") is None
    assert tap.other() == "delegated"
    failing = NotificationTap(_Wrapper(fail=True), lambda agent, msg, ok: seen.append((agent, msg, ok)))
    with pytest.raises(RuntimeError):  # still raised to vLLM, which logs it
        failing.send_notif("p-agent", b"HB:r2")
    assert seen[-1] == ("p-agent", b"HB:r2", False)


def test_telemetry_errors_are_rate_limited(caplog):
    logger = logging.getLogger("test.leasekit.taps")
    errors = TelemetryErrors(logger, interval_s=60)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        errors.report("grant", KeyError("x"))
        errors.report("grant", KeyError("y"))
    assert len(caplog.records) == 1
    assert "telemetry failed in grant (KeyError" in caplog.records[0].getMessage()

"""The notification tap is transparent for code written against the NIXL wrapper: attribute reads,
writes and deletes reach the wrapped object (vLLM's own unit tests inject failures that way), while
the tap still sees every ``send_notif`` and ``get_new_notifs``."""

from unittest import mock

import pytest

from leasekit.vllm.taps import NotificationTap


class _Wrapper:
    def __init__(self):
        self.sent = []
        self.fail_send_notif = False

    def send_notif(self, agent, notif_msg):
        if self.fail_send_notif:
            raise RuntimeError("injected")
        self.sent.append((agent, notif_msg))

    def get_new_notifs(self):
        return {}

    def release_xfer_handle(self, handle):
        return handle


def _tap(seen):
    return NotificationTap(_Wrapper(), lambda agent, msg, ok: seen.append((agent, msg, ok)))


def test_writes_reach_the_wrapped_object_and_the_tap_still_sees_heartbeats():
    seen = []
    tap = _tap(seen)
    tap.fail_send_notif = True  # vLLM's failure injection: an attribute of the NIXL wrapper
    assert tap._wrapped.fail_send_notif is True and "fail_send_notif" not in vars(tap)
    with pytest.raises(RuntimeError, match="injected"):
        tap.send_notif("p", b"HB:r1")
    assert seen == [("p", b"HB:r1", False)]


def test_a_replaced_method_is_called_through_the_tap():
    seen = []
    tap = _tap(seen)
    sent = []
    tap.send_notif = lambda agent, notif_msg: sent.append(notif_msg)  # what vLLM's tests do
    tap.get_new_notifs = lambda: {"d": [b"HB:x"]}
    tap.send_notif("p", b"HB:r2")
    assert sent == [b"HB:r2"] and seen == [("p", b"HB:r2", True)]
    assert tap.get_new_notifs() == {"d": [b"HB:x"]} and tap.agent_of(b"HB:x") == "d"


def test_mock_patch_object_applies_and_undoes_on_the_wrapped_object():
    tap = _tap([])
    wrapped = tap._wrapped
    with mock.patch.object(tap, "release_xfer_handle") as release, mock.patch.object(tap, "send_notif") as send:
        tap.release_xfer_handle(7)
        tap.send_notif("p", b"r:1")
        assert wrapped.release_xfer_handle is release
    release.assert_called_once_with(7)
    send.assert_called_once_with("p", b"r:1")
    assert "release_xfer_handle" not in vars(wrapped) and "send_notif" not in vars(wrapped)
    tap.send_notif("p", b"r:2")
    assert wrapped.sent == [("p", b"r:2")]


def test_delete_reaches_the_wrapped_object_and_own_attributes_stay_on_the_tap():
    tap = _tap([])
    tap.extra = 1
    del tap.extra
    assert not hasattr(tap._wrapped, "extra")
    with pytest.raises(AttributeError):
        tap.extra
    tap.rewrite = lambda agent, msg, started: msg + b",x"
    assert "rewrite" in vars(tap) and not hasattr(tap._wrapped, "rewrite")
    tap.send_notif("p", b"HB:r3")
    assert tap._wrapped.sent == [("p", b"HB:r3,x")]


def test_isinstance_sees_the_wrapped_class_but_type_is_the_tap():
    tap = _tap([])
    assert isinstance(tap, _Wrapper) and isinstance(tap, NotificationTap)
    assert type(tap) is NotificationTap


def test_half_built_tap_has_no_attribute_recursion():
    tap = NotificationTap.__new__(NotificationTap)
    with pytest.raises(AttributeError):
        tap.anything

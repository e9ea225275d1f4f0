"""The vLLM release guard of LeaseKitConnector."""

import pytest

from leasekit.vllm.version import SUPPORTED_VLLM_RELEASES, UnsupportedVllmError, check_hooks, check_vllm_release


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_supported_release_loads(version):
    check_vllm_release(version, allow_unsupported=False)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.32.1", "garbage"])
def test_unsupported_release_is_refused_naming_the_supported_ones(version):
    with pytest.raises(UnsupportedVllmError) as info:
        check_vllm_release(version, allow_unsupported=False)
    message = str(info.value)
    assert version in message
    for supported in SUPPORTED_VLLM_RELEASES:
        assert supported in message


def test_env_override_allows_an_unsupported_release(monkeypatch):
    monkeypatch.setenv("LEASEKIT_ALLOW_UNSUPPORTED_VLLM", "1")
    check_vllm_release("0.99.0")
    monkeypatch.setenv("LEASEKIT_ALLOW_UNSUPPORTED_VLLM", "0")
    with pytest.raises(UnsupportedVllmError):
        check_vllm_release("0.99.0")


def test_missing_private_hook_is_named():
    class Worker:
        def start_load_kv(self):
            pass

    with pytest.raises(UnsupportedVllmError, match="_handle_heartbeat"):
        check_hooks(Worker, ("start_load_kv", "_handle_heartbeat"))


def test_installed_vllm_is_supported_and_connector_imports():
    vllm = pytest.importorskip("vllm")
    check_vllm_release(vllm.__version__, allow_unsupported=False)
    from leasekit.vllm.connector import LeaseKitConnector  # the import runs the guard and hook checks

    assert LeaseKitConnector.__mro__[1].__name__ == "NixlPullConnector"

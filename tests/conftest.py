"""Shared fixtures. Tests marked ``pair`` start real vLLM servers (tens of seconds each); they fail,
not skip, when vLLM is missing, unless ``LEASEKIT_SKIP_PAIR=1`` says so explicitly."""

import os

import pytest


@pytest.fixture(scope="session")
def vllm_available():
    """Import vLLM once; fail (or skip when LEASEKIT_SKIP_PAIR=1) if the CPU stack is missing."""
    try:
        import nixl  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("LEASEKIT_SKIP_PAIR") == "1":
            pytest.skip(f"LEASEKIT_SKIP_PAIR=1 and the vLLM CPU stack is missing ({exc})")
        pytest.fail(f"the vLLM CPU stack is missing ({exc}); run ./setup.sh (or set LEASEKIT_SKIP_PAIR=1)")
    return True

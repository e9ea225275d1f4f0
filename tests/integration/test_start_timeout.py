"""A server that is not healthy by the start timeout: PDPair starts it once more on fresh ports,
keeps the first log, then fails with the diagnosis, and leaves no process behind (real vLLM servers
given a 2 s start timeout, so they never get there)."""

import psutil
import pytest

from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.cluster.server import ServerStartTimeout

pytestmark = pytest.mark.pair


def test_start_timeout_restarts_once_then_fails_with_diagnosis(vllm_available, tmp_path):
    pair = PDPair(PairSpec.pinned(warm_up=False), tmp_path / "run", start_timeout_s=2.0)
    first = pair.prefill
    with pytest.raises(ServerStartTimeout) as caught:
        pair.start()
    message = str(caught.value)
    assert "prefill not healthy after 2 s" in message
    assert "why prefill is not healthy (leasekit start diagnosis)" in message
    assert "busiest processes on the host:" in message
    assert len(pair.start_retries) == 1 and pair.start_retries[0].startswith("prefill: prefill not healthy")
    assert (tmp_path / "run" / "logs" / "prefill-start-timeout.log").exists()
    assert pair.prefill is not first and not first.alive()  # the second start was a new server
    for server in (pair.prefill, pair.decode):
        assert not server.alive()
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], leftovers

"""The lease secrets D keeps for its proofs: forgotten when a request finishes, kept for takeovers, and bounded."""

from leasekit.lease.proof import lease_secret
from leasekit.vllm.decode.heartbeats import DLeaseSecrets
from tests.unit.d_proofs_helpers import _close_gates  # noqa: F401 - autouse: closes the gates a test built
from tests.unit.d_proofs_helpers import AGENT, KEY, entry, make_d


# -- state ----------------------------------------------------------------------------------------------


def test_finish_forgets_the_requests_secret_and_its_ids_go_plain():
    d = make_d()
    d.gate.protect([entry("d1", "P1"), entry("d2", "P2")])
    assert len(d.gate.secrets) == 2
    d.gate.finish(["d1"])
    assert d.gate.secrets.secret("P1") is None and d.gate.secrets.secret("P2") is not None
    assert len(d.gate.secrets) == 1 and d.gate.secrets._remote_of == {"d2": "P2"}
    assert d.gate.sequence_heartbeat(AGENT, b"HB:P1", 0.0) == b"HB:P1"
    kwargs = {"request_id": "d1", "remote_request_id": "P1", "expected_consumers": 1}
    assert d.gate.proved_read(kwargs) is kwargs
    d.gate.finish(["d2", "never-protected"])
    assert len(d.gate.secrets) == 0 and d.gate.secrets._remote_of == {}


def test_a_p_request_taken_over_by_another_d_request_survives_the_first_ones_finish():
    s = DLeaseSecrets()
    s.add("d1", "E", "P1", lease_secret(KEY, "P1"))
    s.add("d2", "E", "P1", lease_secret(KEY, "P1"))
    s.finish("d1")
    assert s.secret("P1") == lease_secret(KEY, "P1")
    s.finish("d2")
    assert s.secret("P1") is None and len(s) == 0


def test_the_secrets_d_keeps_are_bounded_per_request_and_per_engine():
    s = DLeaseSecrets(max_requests=3, max_engines=2)
    for i in range(6):
        s.add(f"d{i}", f"E{i % 3}", f"P{i}", lease_secret(KEY, f"P{i}"))
    assert len(s) == 3 and [s.secret(f"P{i}") is not None for i in range(6)] == [False] * 3 + [True] * 3
    assert sorted(s._remote_of) == ["d3", "d4", "d5"]
    assert s.hello_proof("E0") is None and s.hello_proof("E2")[0] == "P5"
    assert s.hello_proof("E2", prefer="P4")[0] == "P4"  # the lease being read, when it has a secret
    assert s.hello_proof("E2", prefer="P0")[0] == "P5"  # forgotten: the engine's latest


def test_an_id_too_long_to_carry_a_tag_or_unfit_for_a_hello_is_handled_without_breaking_others():
    s = DLeaseSecrets()
    s.add("d1", "E", "x" * 1020, lease_secret(KEY, "x"))  # 1020 + 17 > 1024: P would refuse the heartbeat
    assert len(s) == 0
    s.add("d2", "E", "has space", lease_secret(KEY, "has space"))
    s.add("d3", "E", "ctl\x01", lease_secret(KEY, "ctl\x01"))
    assert s.secret("has space") is not None and s.secret("ctl\x01") is not None and s.hello_proof("E") is None

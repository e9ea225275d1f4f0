"""Evidence from servers on other hosts: for the LeaseKit target the span files of P *and* D come
back (D's read-gate spans are what say a late read was discarded), for the stock target P's log.
Two real hosts of the Host interface on this machine (the same code an SSH host runs); real files."""

import json
from types import SimpleNamespace

import pytest

from leasekit.chaos.evidence import EvidenceReader
from leasekit.cluster.localhost import LocalHost
from leasekit.lease.config import LeaseTiming
from leasekit.telemetry import semconv as sc


def server_on(host, name: str, lines: list[dict]):
    run_dir = host.path(f"pairs/01-leasekit/{name}")
    host.check(["mkdir", "-p", f"{run_dir}/spans"])
    host.write_file(f"{run_dir}/spans/{name}.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    fetched = []
    return SimpleNamespace(host=host, run_dir=run_dir, fetch_log=lambda: fetched.append(name), fetched=fetched)


@pytest.fixture
def two_hosts(tmp_path):
    with LocalHost("prefill", workdir=str(tmp_path / "p"), run_name="run") as p, \
            LocalHost("decode", workdir=str(tmp_path / "d"), run_name="run") as d:
        yield p, d


@pytest.mark.parametrize("target", ["leasekit", "stock"])
def test_span_files_of_p_and_d_come_back_for_leasekit_and_p_log_for_stock(two_hosts, tmp_path, target):
    p_host, d_host = two_hosts
    prefill = server_on(p_host, "kv_producer-e1-tp0", [{"name": "p"}])
    decode = server_on(d_host, "kv_consumer-e2-tp0", [{"name": sc.READ_SPAN_NAME}])
    pair = SimpleNamespace(prefill=prefill, decode=decode, span_dir=tmp_path / "here" / "spans")
    EvidenceReader(pair, target, LeaseTiming.from_lease_duration(6)).collect()
    copied = sorted(p.name for p in pair.span_dir.glob("*")) if pair.span_dir.exists() else []
    if target == "leasekit":
        assert copied == ["kv_consumer-e2-tp0.jsonl", "kv_producer-e1-tp0.jsonl"]
        assert sc.READ_SPAN_NAME in (pair.span_dir / "kv_consumer-e2-tp0.jsonl").read_text()
        assert not prefill.fetched and not decode.fetched
    else:
        assert copied == [] and prefill.fetched == ["kv_producer-e1-tp0"] and not decode.fetched


def test_a_torn_down_host_is_skipped(two_hosts, tmp_path):
    p_host, d_host = two_hosts
    prefill = server_on(p_host, "kv_producer-e1-tp0", [{"name": "p"}])
    decode = server_on(d_host, "kv_consumer-e2-tp0", [{"name": "d"}])
    d_host.closed = True
    pair = SimpleNamespace(prefill=prefill, decode=decode, span_dir=tmp_path / "here" / "spans")
    EvidenceReader(pair, "leasekit", LeaseTiming.from_lease_duration(6)).collect()
    assert sorted(p.name for p in pair.span_dir.glob("*")) == ["kv_producer-e1-tp0.jsonl"]

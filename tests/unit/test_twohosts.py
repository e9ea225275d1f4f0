"""The two-host deployment's pair file, and faults routed to a server's host: a partition's rules
put into a host's own network stack by ``nft`` run through the host, with the SSH port kept out."""

import json
import subprocess
import sys
import tomllib

import pytest

from leasekit.chaos.faults.netns import NetworkNamespace
from leasekit.chaos.faults.onhost import HostPartitionInjector, host_of, monotonic_offset_on_host, remote_site
from leasekit.chaos.faults.partition import PartitionSite, partition_rules
from leasekit.cluster.localhost import LocalHost
from leasekit.cluster.pair import PairSpec, PDPair
from leasekit.cluster.pairfile import PairFileError, parse_pair_file
from leasekit.cluster.twohosts import pair_file_text

HOSTS = {name: {"address": address, "ssh_port": 22, "identity_file": f"/keys/{name}", "known_hosts": f"/keys/{name}.known"}
         for name, address in (("prefill", "10.237.200.2"), ("decode", "10.237.200.3"))}


def test_the_written_pair_file_is_a_normal_one_with_two_ssh_hosts():
    pair = parse_pair_file(tomllib.loads(pair_file_text(HOSTS, python=sys.executable, workdir="/tmp/leasekit")))
    assert pair.remote_roles() == ["prefill", "decode"]
    assert pair.host("decode").known_hosts == "/keys/decode.known" and pair.host("decode").address == "10.237.200.3"
    assert pair.role("prefill").env == {"UCX_TLS": "^sm"}


def test_known_hosts_makes_a_host_remote_and_must_be_a_path():
    data = {"hosts": {"b": {"address": "127.0.0.1", "known_hosts": "/k", "python": "/p"}}, "decode": {"host": "b"}}
    assert parse_pair_file(data).remote_roles() == ["decode"]
    data["hosts"]["b"]["known_hosts"] = ""
    with pytest.raises(PairFileError, match="known_hosts"):
        parse_pair_file(data)


def test_two_hosts_of_a_pair_file_make_no_namespaces_of_their_own(tmp_path):
    pair = parse_pair_file(tomllib.loads(pair_file_text(HOSTS, python=sys.executable, workdir="/tmp/leasekit")))
    planned = PDPair.planned(PairSpec(network_namespace=True, deployment=pair), tmp_path)
    assert planned.testbed is None
    assert planned.decode.spec.url_host == "10.237.200.3" and planned.decode.spec.bind_host == "0.0.0.0"


def test_local_servers_keep_the_local_injectors(tmp_path):
    planned = PDPair.planned(PairSpec(network_namespace=True), tmp_path)
    assert host_of(planned.prefill) is None and remote_site(planned) is None


class NamespaceHost(LocalHost):
    """This machine's LocalHost with every command run inside network namespace ``ns``."""

    def run(self, argv, timeout_s=30.0, input=None):
        return super().run(["ip", "netns", "exec", self.ns, *argv], timeout_s, input)


def _rules(ns: str) -> list[tuple[str, str]]:
    """``(chain, rule expression as JSON)`` of table ``inet leasekit`` in ``ns``, in chain order."""
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet", "leasekit"],
                         capture_output=True, text=True).stdout
    return [(item["rule"]["chain"], json.dumps(item["rule"]["expr"])) for item in json.loads(out or '{"nftables": []}')["nftables"] if "rule" in item]


def test_partition_on_a_host_keeps_its_ssh_port_out_and_leaves_nothing(tmp_path):
    with NetworkNamespace() as ns:
        host = NamespaceHost("prefill", workdir=str(tmp_path))
        host.ns = ns.name
        try:
            site = PartitionSite("10.237.200.2", "10.237.200.3", "host prefill", "host decode", 5600, 5601, 8000, 8001)
            injector = HostPartitionInjector(host, partition_rules("all", "both", "drop", 100, "prefill", site), ssh_port=2222)
            injector.inject()
            rules = _rules(ns.name)
            assert len(rules) == 4  # an SSH accept at the head of input and output, then the two drops
            for chain, field in (("input", "dport"), ("output", "sport")):
                first, second = [expr for c, expr in rules if c == chain]
                assert f'"{field}"' in first and "2222" in first and '"accept"' in first
                assert '"drop"' in second and "2222" not in second
            assert injector.record["ssh_port_kept_out"] == 2222 and injector.record["namespace"] == "host prefill"
            injector.recover()
            assert _rules(ns.name) == [] and injector.record["packets_matched"] == 0
        finally:
            host.teardown()


def test_time_namespace_offset_is_read_on_the_host(tmp_path):
    with LocalHost("decode", workdir=str(tmp_path)) as host:
        assert monotonic_offset_on_host(host, 1) == 0.0
        assert monotonic_offset_on_host(host, 2**22 + 12345) is None


def test_testbed_builds_its_own_pair_file_so_pair_and_plan_are_refused(capsys):
    from leasekit.cli import EXIT_USAGE, main

    assert main(["chaos", "run", "kill-decode", "--testbed", "two-hosts", "--pair", "pairs/cpu-local.toml"]) == EXIT_USAGE
    assert "--testbed builds its own pair file" in capsys.readouterr().err
    assert main(["chaos", "run", "kill-decode", "--testbed", "two-hosts", "--plan"]) == EXIT_USAGE

"""Partition rules between P's host and D's host as text: which chain, which peer address, which
ports, which packets (every one, or only data one way), which verdict; the scenario fields that
choose them; and the plan that shows them without running anything."""

from types import SimpleNamespace

import pytest

from leasekit.chaos.faults.netns import partition_plan
from leasekit.chaos.faults.partition import DATA, PartitionSite, cuts_heartbeats, partition_rules
from leasekit.chaos.scenario import ScenarioError, _validate
from leasekit.chaos.schema import PartitionFault

P, D = "10.237.128.2", "10.237.128.3"
SITE = PartitionSite(P, D, "lk-abcdef-prefill", "lk-abcdef-decode", 4100, 4200, 8100, 8200)


def texts(*args, **kwargs) -> list[str]:
    return [f"{r.chain}: {r.match} -> {r.verdict}" for r in partition_rules(*args, site=SITE, **kwargs)]


def test_all_both_drops_every_packet_to_and_from_the_peer_host():
    assert texts("all", "both", "drop", 100, "prefill") == [
        f"input: ip saddr {D} -> drop", f"output: ip daddr {D} -> drop"]
    assert texts("all", "both", "drop", 100, "decode") == [
        f"input: ip saddr {P} -> drop", f"output: ip daddr {P} -> drop"]
    rule = partition_rules("all", "both", "drop", 100, "prefill", SITE)[0]
    assert rule.text() == f"add rule inet leasekit input ip saddr {D} counter drop"


@pytest.mark.parametrize("target, chain, peer", [("prefill", "input", f"ip saddr {D}"), ("decode", "output", f"ip daddr {P}")])
def test_one_way_decode_to_prefill_drops_only_what_d_sends_as_data(target, chain, peer):
    # wherever the rules live, only the D -> P leg is cut, and only data: bare TCP ACKs pass
    assert texts("all", "decode_to_prefill", "drop", 100, target) == [
        f"{chain}: {peer} meta l4proto != tcp -> drop", f"{chain}: {peer} meta l4proto tcp {DATA} -> drop"]


@pytest.mark.parametrize("target, chain, peer", [("prefill", "output", f"ip daddr {D}"), ("decode", "input", f"ip saddr {P}")])
def test_one_way_prefill_to_decode_drops_only_what_p_sends_as_data(target, chain, peer):
    assert texts("all", "prefill_to_decode", "drop", 100, target) == [
        f"{chain}: {peer} meta l4proto != tcp -> drop", f"{chain}: {peer} meta l4proto tcp {DATA} -> drop"]


def test_nixl_spares_connections_to_either_side_channel():
    # one conntrack match: the connection's original destination port is neither side channel
    spare = "meta l4proto tcp ct original proto-dst != { 4100, 4200 }"
    assert texts("nixl", "both", "drop", 100, "prefill") == [
        f"input: ip saddr {D} meta l4proto != tcp -> drop", f"input: ip saddr {D} {spare} -> drop",
        f"output: ip daddr {D} meta l4proto != tcp -> drop", f"output: ip daddr {D} {spare} -> drop"]
    assert texts("nixl", "decode_to_prefill", "drop", 100, "decode")[1] == f"output: ip daddr {P} {spare} {DATA} -> drop"


def test_side_channel_and_http_cut_the_targets_port():
    assert texts("side_channel", "both", "drop", 100, "prefill") == [
        f"input: ip saddr {D} tcp dport 4100 -> drop", f"output: ip daddr {D} tcp sport 4100 -> drop"]
    assert texts("side_channel", "decode_to_prefill", "drop", 100, "prefill") == [
        f"input: ip saddr {D} tcp dport 4100 {DATA} -> drop"]
    # HTTP comes from the router in the root namespace: any source
    assert texts("http", "both", "reject", 100, "decode") == [
        "input: tcp dport 8200 tcp flags & rst == 0 -> reject with tcp reset",
        "output: tcp sport 8200 tcp flags & rst == 0 -> reject with tcp reset"]


def test_reject_resets_tcp_and_refuses_the_rest_but_lets_its_own_errors_through():
    # the reset / ICMP error the rule in one chain sends must not be rejected by the rule in the other
    assert texts("all", "both", "reject", 100, "prefill") == [
        f"input: ip saddr {D} meta l4proto != {{ tcp, icmp }} -> reject with icmpx type admin-prohibited",
        f"input: ip saddr {D} meta l4proto tcp tcp flags & rst == 0 -> reject with tcp reset",
        f"output: ip daddr {D} meta l4proto != {{ tcp, icmp }} -> reject with icmpx type admin-prohibited",
        f"output: ip daddr {D} meta l4proto tcp tcp flags & rst == 0 -> reject with tcp reset"]


def test_loss_is_a_random_draw_per_packet():
    assert texts("all", "both", "loss", 30, "prefill")[0] == f"input: ip saddr {D} numgen random mod 100 < 30 -> drop"
    # numgen yields 0..99 and nft refuses the constant 100: 100 % is written "<= 99"
    assert texts("all", "both", "loss", 100, "prefill")[0].endswith("numgen random mod 100 <= 99 -> drop")
    assert texts("all", "both", "loss", 0.0, "prefill")[0].endswith("numgen random mod 100 < 0 -> drop")


@pytest.mark.parametrize("args, message", [
    (("everything", "both", "drop", 100, "prefill"), "path must be one of"),
    (("all", "sideways", "drop", 100, "prefill"), "direction must be one of"),
    (("all", "both", "delay", 100, "prefill"), "action must be one of"),
    (("all", "both", "drop", 100, "router"), "target must be one of"),
    (("all", "both", "loss", 101, "prefill"), "loss_percent must be a whole number in 0..100"),
    (("all", "both", "loss", 12.5, "prefill"), "loss_percent"),
    (("http", "decode_to_prefill", "drop", 100, "prefill"), "direction must be 'both' for path = 'http'"),
])
def test_bad_arguments_name_the_field_and_the_allowed_values(args, message):
    with pytest.raises(ValueError, match=message):
        partition_rules(*args, site=SITE)


def test_which_partitions_silence_heartbeats():
    assert cuts_heartbeats("all", "both", "drop") and cuts_heartbeats("nixl", "decode_to_prefill", "reject")
    assert cuts_heartbeats("all", "both", "loss", 100)
    assert not cuts_heartbeats("all", "both", "loss", 99)
    assert not cuts_heartbeats("all", "prefill_to_decode", "drop")  # D's heartbeats still reach P
    assert not cuts_heartbeats("side_channel", "both", "drop") and not cuts_heartbeats("http", "both", "drop")


def test_plan_shows_the_nft_script_and_its_removal_without_running_it():
    fault = SimpleNamespace(path="all", direction="decode_to_prefill", action="drop", loss_percent=100,
                            target="prefill", duration_s=8.0)
    plan = partition_plan(fault, site=SITE)
    assert plan.namespace == "lk-abcdef-prefill" and len(plan.rules) == 2
    text = str(plan)
    assert text.startswith("# partition all decode_to_prefill (drop) in prefill's host\n")
    assert "ip netns exec lk-abcdef-prefill nft --echo --handle -f - <<'EOF'\nadd table inet leasekit\n" in text
    assert f"add rule inet leasekit input ip saddr {D} meta l4proto tcp {DATA} counter drop\n" in text
    assert "\nsleep 8\n" in text and "nft delete rule inet leasekit input handle <handle of rule 2>" in text
    # no pair yet: placeholders, from the pair: its testbed's addresses and its servers' ports
    assert "ip saddr <decode address>" in partition_plan(fault).script()
    testbed = SimpleNamespace(address=lambda role: {"prefill": P, "decode": "10.237.128.9"}[role],
                              namespace=lambda role: f"lk-000000-{role}")
    pair = SimpleNamespace(testbed=testbed, prefill=SimpleNamespace(side_channel_port=5001, http_port=0),
                           decode=SimpleNamespace(side_channel_port=5002, http_port=0))
    nixl = SimpleNamespace(path="nixl", direction="both", action="drop", loss_percent=100, target="decode", duration_s=1)
    script = partition_plan(nixl, pair=pair).script()
    assert f"input ip saddr {P} meta l4proto tcp ct original proto-dst != {{ 5001, 5002 }} counter drop" in script
    http = SimpleNamespace(path="http", direction="both", action="drop", loss_percent=100, target="prefill", duration_s=1)
    assert "tcp dport <prefill http port>" in partition_plan(http, pair=pair).script()


BASE = {"name": "p", "description": "d", "incident": "K08", "launch": {"network_namespace": True},
        "expect": {"checks": ["liveness"]}}


def scenario_with(**fault):
    return _validate({**BASE, "faults": [{"kind": "partition", "duration_s": 2, **fault}]}, "test")


def test_scenario_fields_default_to_the_old_meaning_and_validate():
    old = scenario_with(target="prefill")  # a file written before paths and directions
    assert (old.faults[0].path, old.faults[0].direction) == ("side_channel", "both")
    new = scenario_with(path="all", direction="decode_to_prefill")
    assert isinstance(new.faults[0], PartitionFault) and new.faults[0].direction == "decode_to_prefill"
    for fault, message in [({"path": "nixl_data"}, "faults.0.partition.path"),
                           ({"direction": "d2p"}, "faults.0.partition.direction"),
                           ({"path": "http", "direction": "prefill_to_decode"}, "direction must be 'both' for path = 'http'"),
                           ({"action": "loss", "loss_percent": 2.5}, "loss_percent must be a whole number")]:
        with pytest.raises(ScenarioError, match=message):
            scenario_with(**fault)

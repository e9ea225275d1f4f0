"""Lease config: --kv-transfer-config parsing and lint (vllm 0.32.0 base_scheduler.py, base_worker.py)."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasekit.lease.config import (
    DEFAULT_DECODER_KV_BLOCKS_TTL_S,
    DEFAULT_LEASE_DURATION_S,
    LeaseConfig,
    LeaseConfigError,
    LeaseTiming,
    LintFinding,
    lint_kv_transfer_config,
    lint_timing,
    lint_timing_findings,
)

L_FIELD = "kv_connector_extra_config.kv_lease_duration"
TTL_FIELD = "kv_connector_extra_config.decoder_kv_blocks_ttl"


def _cfg(role="kv_producer", **extra):
    doc = {"kv_connector": "NixlConnector", "kv_role": role}
    if extra:
        doc["kv_connector_extra_config"] = extra
    return json.dumps(doc)


def _by_field(findings):
    out = {}
    for f in findings:
        out.setdefault(f.field, []).append(f)
    return out


# --- defaults and LeaseConfig -------------------------------------------------------------------


def test_defaults_are_vllms():
    assert DEFAULT_LEASE_DURATION_S == 30 and DEFAULT_DECODER_KV_BLOCKS_TTL_S == 480
    cfg = LeaseConfig.from_kv_transfer_config(_cfg())
    assert cfg.timing == LeaseTiming(30, 5, 20)
    assert cfg.decoder_kv_blocks_ttl_s == 480
    assert cfg.source["kv_role"] == "kv_producer"


def test_values_are_read_from_the_extra_config():
    cfg = LeaseConfig.from_kv_transfer_config(_cfg(kv_lease_duration=12, decoder_kv_blocks_ttl=60))
    assert cfg.timing == LeaseTiming.from_lease_duration(12) == LeaseTiming(12, 2, 8)
    assert cfg.decoder_kv_blocks_ttl_s == 60


def test_accepts_a_mapping_and_copies_it():
    doc = {"kv_role": "kv_consumer", "kv_connector_extra_config": {"kv_lease_duration": 7.5}}
    cfg = LeaseConfig.from_kv_transfer_config(doc)
    assert cfg.timing == LeaseTiming(7.5, 1.0, 5.0)  # float floor division, as vLLM
    doc["kv_connector_extra_config"]["kv_lease_duration"] = 99
    assert cfg.source["kv_connector_extra_config"]["kv_lease_duration"] == 7.5
    assert cfg == LeaseConfig.from_kv_transfer_config(_cfg(kv_lease_duration=7.5))  # source not compared
    hash(cfg)


def test_short_leases_parse_but_lint():
    cfg = LeaseConfig.from_kv_transfer_config(_cfg(kv_lease_duration=1))  # vLLM runs it: lint, do not refuse
    assert cfg.timing == LeaseTiming(1, 0, 0)


@pytest.mark.parametrize(
    "config, field",
    [
        ("{not json", "kv_transfer_config"),
        ("[1, 2]", "kv_transfer_config"),
        ("30", "kv_transfer_config"),
        (42, "kv_transfer_config"),
        ('{"kv_connector_extra_config": []}', "kv_connector_extra_config"),
        ('{"kv_connector_extra_config": null}', "kv_connector_extra_config"),
        (_cfg(kv_lease_duration="30"), L_FIELD),
        (_cfg(kv_lease_duration=True), L_FIELD),  # bool is not a number here
        (_cfg(kv_lease_duration=None), L_FIELD),  # explicit null is not the default: vLLM gets None
        (_cfg(kv_lease_duration=0), L_FIELD),
        (_cfg(kv_lease_duration=-6), L_FIELD),
        ('{"kv_connector_extra_config": {"kv_lease_duration": NaN}}', L_FIELD),
        ('{"kv_connector_extra_config": {"kv_lease_duration": Infinity}}', L_FIELD),
        ('{"kv_connector_extra_config": {"kv_lease_duration": 1e400}}', L_FIELD),  # parses as inf
        (_cfg(decoder_kv_blocks_ttl="480"), TTL_FIELD),
        (_cfg(decoder_kv_blocks_ttl=False), TTL_FIELD),
        (_cfg(decoder_kv_blocks_ttl=0), TTL_FIELD),
        (_cfg(decoder_kv_blocks_ttl=-1.5), TTL_FIELD),
    ],
)
def test_invalid_configs_raise_naming_the_field(config, field):
    with pytest.raises(LeaseConfigError) as info:
        LeaseConfig.from_kv_transfer_config(config)
    assert str(info.value).startswith(field + ":")
    assert "fix:" in str(info.value)
    # and lint reports the same problem as an error on the same field
    assert any(f.field == field and f.severity == "error" for f in lint_kv_transfer_config(config))


def test_role_is_not_checked_by_the_parser():
    LeaseConfig.from_kv_transfer_config('{"kv_role": "nonsense"}')


# --- lint_timing (kept for existing callers) ------------------------------------------------------


def test_lint_timing_strings_are_unchanged():
    assert lint_timing(LeaseTiming.from_lease_duration(30)) == []
    assert lint_timing(LeaseTiming.from_lease_duration(5)) == [
        "kv_lease_duration=5 < 6 gives heartbeat interval H=0: D sends a heartbeat batch every engine step; "
        "fix: kv_lease_duration >= 6"
    ]
    assert lint_timing(LeaseTiming.from_lease_duration(1)) == [
        "kv_lease_duration=1 < 2 gives extension E=0: heartbeats do nothing and every lease expires at grant + L "
        "even while D is healthy; fix: kv_lease_duration >= 6",
        "kv_lease_duration=1 < 6 gives heartbeat interval H=0: D sends a heartbeat batch every engine step; "
        "fix: kv_lease_duration >= 6",
    ]
    assert lint_timing(LeaseTiming(10, 5, 5)) == [
        "extension E=5 <= heartbeat interval H=5: leases can expire between heartbeats; fix: kv_lease_duration >= 6"
    ]


def test_lint_timing_findings_carry_field_and_severity():
    findings = lint_timing_findings(LeaseTiming.from_lease_duration(1), field=L_FIELD)
    assert [(f.field, f.severity) for f in findings] == [(L_FIELD, "error"), (L_FIELD, "warning")]
    assert [str(f) for f in findings] == lint_timing(LeaseTiming.from_lease_duration(1))
    assert lint_timing_findings(LeaseTiming(10, 5, 5))[0].severity == "error"


@given(st.one_of(st.integers(1, 10_000), st.floats(0.01, 1e4)))
def test_lint_timing_is_lint_timing_findings_as_strings(L):
    timing = LeaseTiming.from_lease_duration(L)
    assert lint_timing(timing) == [f"{f.message}; fix: {f.fix}" for f in lint_timing_findings(timing)]
    assert bool(lint_timing(timing)) == (L < 6)


# --- lint_kv_transfer_config ----------------------------------------------------------------------


def test_clean_configs_have_no_findings():
    assert lint_kv_transfer_config(_cfg()) == []
    assert lint_kv_transfer_config(_cfg("kv_consumer", kv_lease_duration=6, decoder_kv_blocks_ttl=60)) == []
    assert lint_kv_transfer_config({"kv_role": "kv_producer"}) == []


@pytest.mark.parametrize(
    "L, expected",
    [
        (5, [(L_FIELD, "warning")]),  # H = 0
        (2, [(L_FIELD, "warning")]),  # H = 0, E = 1
        (1, [(L_FIELD, "error"), (L_FIELD, "warning")]),  # E = 0 and H = 0
        (6, []),
        (7.5, [(L_FIELD, "warning")]),  # float
        (30.0, [(L_FIELD, "warning")]),  # float, even when whole
        (1.2, [(L_FIELD, "warning"), (L_FIELD, "error"), (L_FIELD, "warning")]),  # float, E = 0.0, H = 0.0
        (1.5, [(L_FIELD, "warning"), (L_FIELD, "warning")]),  # float, E = 1.0, H = 0.0
    ],
)
def test_lease_duration_findings(L, expected):
    findings = lint_kv_transfer_config(_cfg(kv_lease_duration=L))
    assert [(f.field, f.severity) for f in findings] == expected


def test_float_lease_warning_shows_float_h_and_e():
    (finding,) = lint_kv_transfer_config(_cfg(kv_lease_duration=7.5))
    assert "H=1.0" in finding.message and "E=5.0" in finding.message
    assert "whole number" in finding.fix


@pytest.mark.parametrize(
    "role, severity",
    [(None, "error"), ("kv_prod", "error"), (1, "error"), (["kv_producer"], "error"), ("kv_both", "warning")],
)
def test_role_findings(role, severity):
    doc = {"kv_connector_extra_config": {}} if role is None else {"kv_role": role}
    (finding,) = lint_kv_transfer_config(doc)
    assert finding.field == "kv_role" and finding.severity == severity
    assert "kv_producer" in finding.fix and "kv_consumer" in finding.fix


def test_ttl_within_the_turn2_margin_warns():
    (finding,) = lint_kv_transfer_config(_cfg(decoder_kv_blocks_ttl=5))
    assert (finding.field, finding.severity) == (TTL_FIELD, "warning")
    assert lint_kv_transfer_config(_cfg(decoder_kv_blocks_ttl=5.5)) == []


def test_every_problem_is_reported_at_once():
    config = '{"kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": "30", "decoder_kv_blocks_ttl": -Infinity}}'
    findings = _by_field(lint_kv_transfer_config(config))
    assert set(findings) == {"kv_role", L_FIELD, TTL_FIELD}
    assert findings[L_FIELD][0].severity == findings[TTL_FIELD][0].severity == "error"
    assert "str" in findings[L_FIELD][0].message


def test_findings_name_field_and_fix():
    for config in ["{", _cfg(kv_lease_duration=0), _cfg(kv_lease_duration=1), _cfg("kv_both"), "{}"]:
        for f in lint_kv_transfer_config(config):
            assert isinstance(f, LintFinding)
            assert f.field and f.message and f.fix and f.severity in ("error", "warning")


def test_lint_never_raises_on_hostile_input():
    class Exploding(dict):
        def get(self, *a):
            raise RuntimeError("boom")

    for config in ["[" * 100_000, b"\xff\xfe", None, object(), Exploding(), "\ud800", {"kv_role": {}}]:
        findings = lint_kv_transfer_config(config)
        assert findings and all(isinstance(f, LintFinding) for f in findings)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)


@given(
    st.one_of(
        st.text(max_size=200),
        st.binary(max_size=64),
        _json_values,
        st.fixed_dictionaries(
            {},
            optional={
                "kv_role": _json_values | st.sampled_from(["kv_producer", "kv_consumer", "kv_both"]),
                "kv_connector_extra_config": st.fixed_dictionaries(
                    {}, optional={"kv_lease_duration": _json_values, "decoder_kv_blocks_ttl": _json_values}
                )
                | _json_values,
            },
        ),
    )
)
def test_lint_never_raises_and_agrees_with_the_parser(config):
    findings = lint_kv_transfer_config(config)
    assert all(isinstance(f, LintFinding) for f in findings)
    lease_errors = [f for f in findings if f.severity == "error" and f.field != "kv_role"]
    try:
        LeaseConfig.from_kv_transfer_config(config)
    except LeaseConfigError:
        assert lease_errors  # the parser refuses exactly what lint calls a lease error
    else:
        assert not [f for f in lease_errors if f.field != L_FIELD or "E=" not in f.message]


def test_lease_config_error_is_a_value_error():
    assert issubclass(LeaseConfigError, ValueError)
    with pytest.raises(ValueError):
        LeaseConfig.from_kv_transfer_config(_cfg(kv_lease_duration=math.nan))


def test_findings_come_in_a_fixed_order():
    config = _cfg("kv_both", kv_lease_duration=1, decoder_kv_blocks_ttl=-1)
    fields = [f.field for f in lint_kv_transfer_config(config)]
    assert fields == ["kv_role", L_FIELD, L_FIELD, TTL_FIELD]


def _leasekit(role="kv_producer", policy=None, **extra):
    doc = {"kv_connector": "LeaseKitConnector", "kv_connector_module_path": "leasekit.vllm.connector", "kv_role": role, "kv_connector_extra_config": {"kv_lease_duration": 6, **extra}}
    if policy:
        doc["kv_load_failure_policy"] = policy
    return json.dumps(doc)


def test_leasekit_keys_are_linted_as_the_connector_refuses_them():
    """leasekit_* keys: lint reports what LeaseKitConnector refuses at start (leasekit/lease/settings.py),
    a misspelled key with the closest real one, and a key the role ignores."""
    by_field = {f.field: f for f in lint_kv_transfer_config(_leasekit(leasekit_fail_closed="yes", leasekit_failclosed=True))}
    bad = by_field["kv_connector_extra_config.leasekit_fail_closed"]
    assert bad.severity == "error" and "must be true or false" in bad.message and "JSON boolean" in bad.fix
    typo = by_field["kv_connector_extra_config.leasekit_failclosed"]
    assert typo.severity == "warning" and typo.fix == "did you mean leasekit_fail_closed?"
    findings = lint_kv_transfer_config(_leasekit("kv_consumer", "recompute", leasekit_fail_closed=True, leasekit_max_hold_s=3))
    assert [(f.field, f.severity) for f in findings] == [
        ("kv_connector_extra_config.leasekit_max_hold_s", "error"),  # 3 < L = 6 (refused on every role)
        ("kv_connector_extra_config.leasekit_fail_closed", "warning"),  # only P acts on it
    ]
    (role,) = [f for f in lint_kv_transfer_config(_leasekit("kv_consumer", "recompute", leasekit_max_hold_s=60))]
    assert role.severity == "warning" and "only on P (kv_producer)" in role.message
    assert "[kv_lease_duration=6, 86400]" in findings[0].message


def test_a_long_lease_needs_no_max_hold_and_a_clean_leasekit_config_has_no_findings():
    assert lint_kv_transfer_config(_leasekit(kv_lease_duration=600)) == []  # default max(480, L)
    assert lint_kv_transfer_config(_leasekit("kv_consumer", "recompute", leasekit_verdict_timeout_s=2)) == []


def test_a_leasekit_d_without_recompute_is_warned_a_stock_d_is_not():
    (finding,) = lint_kv_transfer_config(_leasekit("kv_consumer"))
    assert finding.field == "kv_load_failure_policy" and finding.severity == "warning"
    assert "recompute" in finding.fix
    assert lint_kv_transfer_config(_cfg("kv_consumer")) == []


def test_a_connector_vllm_cannot_load_or_that_ignores_the_leasekit_keys_is_named():
    def fields(doc):
        return [(f.field, f.severity) for f in lint_kv_transfer_config(doc)]

    base = {"kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": 30}}
    assert fields({**base, "kv_connector": "LeaseKitConnector"}) == [("kv_connector_module_path", "error")]
    assert fields({**base, "kv_connector": "LeaseKitPushConnector",
                   "kv_connector_module_path": "leasekit.vllm.connectr"}) == [("kv_connector_module_path", "error")]
    assert fields({**base, "kv_connector": "LeaseKitConnector", "kv_connector_module_path": "leasekit.vllm.connector"}) == []
    assert fields({**base, "kv_connector": "FooConnector"}) == [("kv_connector", "warning")]
    stock = {"kv_role": "kv_producer", "kv_connector": "NixlConnector",
             "kv_connector_extra_config": {"kv_lease_duration": 30, "leasekit_pledge_s": 1}}
    (finding,) = lint_kv_transfer_config(stock)
    assert finding.field == "kv_connector_extra_config.leasekit_pledge_s" and finding.severity == "warning"
    assert "LeaseKitConnector" in finding.fix and "ignores" in finding.message

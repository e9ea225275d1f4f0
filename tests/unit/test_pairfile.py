"""Pair files: the shipped examples load; bad files and hosts that cannot take them are refused
before anything starts, naming the field, the bad value and the fix."""

import sys
from pathlib import Path

import pytest

from leasekit.cluster.deploy import TINY_KV_CACHE_BYTES, require_local, server_fields
from leasekit.cluster.pairfile import PairFile, PairFileError, load_pair_file, parse_pair_file
from leasekit.cluster.preflight import GPU_QUERY, check_role, local_runner, preflight

PAIRS = Path(__file__).resolve().parents[2] / "pairs"


def load_text(tmp_path, text: str, name: str = "pair.toml") -> PairFile:
    path = tmp_path / name
    path.write_text(text)
    return load_pair_file(path)


def test_cpu_local_example_is_the_default():
    pair = load_pair_file(PAIRS / "cpu-local.toml")
    assert not pair.remote_roles()
    for role in ("prefill", "decode"):
        assert pair.role(role).tiny and pair.python(role) == sys.executable
        fields = server_fields(pair, role)
        assert fields == server_fields(PairFile(), role) | ({"max_num_seqs": 8} if role == "prefill" else {})
        assert fields["load_format"] == "dummy" and fields["dtype"] == "float32" and fields["skip_tokenizer_init"]
        assert fields["kv_cache_bytes"] == TINY_KV_CACHE_BYTES and "cpu" not in fields and "model_dir" not in fields


def test_gpu_one_node_example():
    pair = load_pair_file(PAIRS / "gpu-one-node.toml")
    assert pair.prefill.cuda_visible_devices == [0] and pair.decode.cuda_visible_devices == [1]
    fields = server_fields(pair, "decode")
    assert fields["model_dir"] == "Qwen/Qwen2.5-0.5B-Instruct" and fields["load_format"] == "auto"
    assert fields["extra_env"]["HF_HUB_OFFLINE"] == "1"  # the local cache only
    assert fields["kv_cache_bytes"] is None and fields["cpu"] is None and not fields["skip_tokenizer_init"]


def without_ssh_support(monkeypatch):
    """This installation as if it had no SSH host support (the refusal path)."""
    for name in ("server_on_host", "runner_for"):
        monkeypatch.delattr(f"leasekit.cluster.remote.{name}", raising=False)


def test_gpu_two_hosts_example(monkeypatch):
    without_ssh_support(monkeypatch)
    pair = load_pair_file(PAIRS / "gpu-two-hosts.toml")
    assert pair.remote_roles() == ["prefill", "decode"]
    assert pair.prefill.tensor_parallel_size == 2 and pair.decode.tensor_parallel_size == 1
    assert pair.python("prefill") == "/opt/leasekit/.venv/bin/python"
    p = server_fields(pair, "prefill")
    assert (p["bind_host"], p["url_host"], p["side_channel_host"]) == ("0.0.0.0", "10.0.0.11", "10.0.0.11")
    with pytest.raises(PairFileError, match=r"prefill.host = 'gpu-a' is another machine .*needs SSH host support"):
        require_local(pair)


@pytest.mark.parametrize("text, expected", [
    ('[decode]\ndevcie = "cuda"\n', ["decode.devcie: Extra inputs are not permitted", "fix: remove it or check the spelling"]),
    ('[prefill]\ndevice = "tpu"\n', ["prefill.device: Input should be 'cpu' or 'cuda'", "(got 'tpu')"]),
    ('[prefill]\ndevice = "cuda"\ntensor_parallel_size = 2\ncuda_visible_devices = [0]\n',
     ["prefill.tensor_parallel_size: 2 needs as many GPUs, but prefill.cuda_visible_devices = [0] lists 1"]),
    ('[prefill]\ndevice = "cuda"\ncuda_visible_devices = [0]\ncpus = [1]\n', ["prefill.cpus: only for device = 'cpu' (got [1])"]),
    ('[decode]\ndevice = "cuda"\n', ["decode.cuda_visible_devices: required with device = 'cuda'", "fix: e.g. cuda_visible_devices = [0]"]),
    ('[decode]\ncuda_visible_devices = [0]\n', ["decode.cuda_visible_devices: only for device = 'cuda'"]),
    ('[decode]\nkv_buffer_device = "cuda"\n', ["decode.kv_buffer_device: 'cuda' needs device = 'cuda'"]),
    ('[decode]\ndevice = "cuda"\ncuda_visible_devices = [0, -1]\n', ["decode.cuda_visible_devices[1]: GPU index must satisfy 0 <= index"]),
    ('[decode]\nhost = "gpu-b"\n', ["decode.host: 'gpu-b' is not a [hosts] table (have: local)", "fix: add [hosts.gpu-b]"]),
    ('[hosts.gpu-b]\naddress = "10.0.0.2"\n[decode]\nhost = "gpu-b"\n', ["hosts.gpu-b.python: required for a remote host"]),
    ('[hosts.local]\nssh_port = 2222\n', ["hosts.local: this machine is not reached over SSH"]),
    ('[prefill]\nmodel = "/m/a"\n', ["decode.model: P and D must serve the same model", "prefill.model = '/m/a'"]),
    ('[prefill]\nmodel = "org/a"\n[decode]\nmodel = "org/b"\n', ["decode.model: P and D must serve the same model"]),
    ('[prefill]\nload_format = "auto"\n', ["prefill.load_format: the embedded tiny model has no weights: only 'dummy'"]),
    ('[prefill]\nload_format = "magic"\n', ["prefill.load_format: Input should be 'auto'"]),
    ('[prefill]\nvllm_args = ["--port=9"]\n', ["prefill.vllm_args[0]: '--port=9' is set by leasekit; fix: use http_port"]),
    ('[prefill]\nvllm_args = ["--max_num_seqs", "2", "--kv_transfer_config", "{}"]\n',
     ["prefill.vllm_args[0]: '--max_num_seqs' is set by leasekit; fix: use max_num_seqs",
      "prefill.vllm_args[2]: '--kv_transfer_config' is set by leasekit"]),
    ('[decode]\nvllm_args = ["--kv-transfer-config.kv_connector=X"]\n', ["decode.vllm_args[0]: '--kv-transfer-config.kv_connector=X' is set"]),
    ('[prefill]\nenv = { CUDA_VISIBLE_DEVICES = "1" }\n', ["prefill.env.CUDA_VISIBLE_DEVICES: set by leasekit; fix: use cuda_visible_devices"]),
    ('[decode]\nmax_num_seqs = 4\n', ["decode.max_num_seqs: D's running slots are set by each scenario"]),
    ('[prefill]\nhttp_port = 70000\n', ["prefill.http_port: Input should be less than or equal to 65535", "(got 70000)"]),
    ('[prefill]\nhttp_port = 8100\n[decode]\nhttp_port = 8100\n', ["decode.http_port: 8100 is also prefill.http_port on the same host"]),
    ('[prefill]\ncpus = [0, 1]\n[decode]\ncpus = [1]\n', ["decode.cpus: shares cores [1] with prefill.cpus"]),
    ('[prefill]\ndevice = "cuda"\ncuda_visible_devices = [0]\nmodel = "o/m"\n[decode]\ndevice = "cuda"\n'
     'cuda_visible_devices = [0]\nmodel = "o/m"\n', ["decode.gpu_memory_utilization: P and D share GPU(s) [0]"]),
    ('lease_duration_s = 0\n', ["lease_duration_s: Input should be greater than 0"]),
    ('[prefill]\nmodel = "not a model!"\n[decode]\nmodel = "not a model!"\n', ["prefill.model: 'not a model!' is neither a path"]),
])
def test_bad_pair_files_name_the_field(tmp_path, text, expected):
    with pytest.raises(PairFileError) as info:
        load_text(tmp_path, text)
    message = str(info.value)
    assert message.startswith(f"invalid pair file {tmp_path / 'pair.toml'}:")
    for part in expected:
        assert part in message, message


@pytest.mark.parametrize("text, expected", [
    ('[hosts.gpu-b]\npython = "/p"\n[prefill]\nhost = "gpu-b"\n[decode]\nhost = "gpu-b"\n',
     ["hosts.gpu-b.address: required", "fix: e.g. address = '10.0.0.12'"]),
    ('[prefill]\nhttp_port = 8100\n[decode]\nside_channel_port = 8100\n',
     ["decode.side_channel_port: 8100 is also prefill.http_port on the same host ('local'); fix: another port"]),
    ('[prefill]\nside_channel_port = 5600\n[decode]\nhttp_port = 5600\n', ["decode.http_port: 5600 is also prefill.side_channel_port"]),
    ('[prefill]\nhttp_port = 8100\nside_channel_port = 8100\n[decode]\n', ["prefill.side_channel_port: 8100 is also prefill.http_port"]),
    ('[prefill]\ndtype = "float16"\n[decode]\n',  # the tiny model too: the KV layout
     ["decode.dtype: P and D must use the same dtype", "prefill.dtype = 'float16' and decode.dtype = 'float32'", "fix: give both"]),
    ('[prefill]\nmodel = "/m/a"\n[decode]\nmodel = "/m/b"\n',
     ["decode.model: P and D on the same host must load the same model directory", "fix: the same path for both"]),
    ('', ["(top level): no [prefill] and no [decode] table", "the minimal file is the two lines [prefill] and [decode]",
          "fix: add [prefill] and [decode]"]),
    ('lease_duration_s = 6\n[prefill]\n', ["(top level): no [decode] table", "fix: add [decode]"]),
    ('[prefill]\ndevice = "tpu"\n[decode]\n', ["prefill.device: Input should be 'cpu' or 'cuda'", "fix: device = 'cpu' or device = 'cuda'"]),
    ('[prefill]\nhttp_port = -1\n[decode]\nside_channel_port = -5\n',
     ["prefill.http_port: Input should be greater than or equal to 0 (got -1); fix: a port from 1 to 65535, or 0",
      "decode.side_channel_port: Input should be greater than or equal to 0 (got -5); fix: a port"]),
    ('lease_duration_s = 0\n[prefill]\n[decode]\n', ["lease_duration_s: Input should be greater than 0 (got 0); fix: seconds with 0 < L <= 3600"]),
    ('[hosts.gpu-b]\naddress = "10.0.0.12"\npython = "/p"\n[prefill]\n[decode]\nhost = "gpu-b"\n',
     ["prefill.host: prefill runs on this machine ('local', listening on 127.0.0.1 only) and decode on host 'gpu-b' (10.0.0.12)",
      "fix: put both on [hosts] reachable from each other"]),
])
def test_more_bad_pair_files_name_the_field_and_the_fix(tmp_path, text, expected):
    with pytest.raises(PairFileError) as info:
        load_text(tmp_path, text)
    message = str(info.value)
    for part in expected:
        assert part in message, message
    assert all("fix:" in line for line in message.splitlines()[1:]), message


def test_fields_that_are_allowed(tmp_path):
    minimal = load_text(tmp_path, "[prefill]\n[decode]\n")
    assert minimal == PairFile() and not minimal.remote_roles()
    mixed = load_text(tmp_path, '[hosts.local]\naddress = "10.0.0.11"\n[hosts.gpu-b]\naddress = "10.0.0.12"\npython = "/p"\n'
                                '[prefill]\n[decode]\nhost = "gpu-b"\n')  # this machine has an address D reaches
    assert mixed.remote_roles() == ["decode"] and server_fields(mixed, "prefill")["url_host"] == "10.0.0.11"
    ssh_here = parse_pair_file({"hosts": {"b": {"address": "127.0.0.1", "ssh_port": 2222, "python": "/p"}},
                                "prefill": {}, "decode": {"host": "b"}})  # over SSH, but this machine: loopback reaches it
    assert ssh_here.remote_roles() == ["decode"]
    two = load_text(tmp_path, '[hosts.a]\naddress = "10.0.0.1"\npython = "/p"\n[hosts.b]\naddress = "10.0.0.2"\npython = "/p"\n'
                              '[prefill]\nhost = "a"\nmodel = "/m/a"\nhttp_port = 8100\n[decode]\nhost = "b"\nmodel = "/m/b"\n'
                              'side_channel_port = 8100\n')  # ports and model paths are per host
    assert two.decode.side_channel_port == 8100 and two.decode.model == "/m/b"


def test_unreadable_files(tmp_path):
    with pytest.raises(PairFileError, match="not found"):
        load_pair_file(tmp_path / "nope.toml")
    with pytest.raises(PairFileError, match="not valid TOML"):
        load_text(tmp_path, "[prefill\n")


def test_relative_model_path_is_relative_to_the_file(tmp_path):
    pair = load_text(tmp_path, '[prefill]\nmodel = "./m"\n[decode]\nmodel = "./m"\n')
    assert pair.prefill.model == str(tmp_path / "m")


def test_a_loopback_host_without_ssh_is_this_machine():
    pair = parse_pair_file({"hosts": {"box": {"address": "127.0.0.1"}}, "prefill": {"host": "box"}})
    assert pair.is_local("box") and not pair.remote_roles()
    ssh = parse_pair_file({"hosts": {"box": {"address": "127.0.0.1", "ssh_port": 2222, "python": "/p"}}, "prefill": {"host": "box"}})
    assert ssh.remote_roles() == ["prefill"]


def test_missing_model_path_is_refused_on_the_host(tmp_path):
    pair = parse_pair_file({"prefill": {"model": str(tmp_path / "none")}, "decode": {"model": str(tmp_path / "none")}})
    with pytest.raises(PairFileError) as info:
        preflight(pair)
    assert f"prefill.model: {tmp_path / 'none'} is not a model directory on this machine (no config.json)" in str(info.value)
    assert "nothing was started" in str(info.value)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text("{}")
    preflight(pair)  # now it is there


def test_hugging_face_ids_come_from_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pair = parse_pair_file({"prefill": {"model": "org/tiny"}, "decode": {"model": "org/tiny"}})
    problems = check_role(pair, "decode", local_runner)
    assert len(problems) == 1 and "decode.model: 'org/tiny' is not in the Hugging Face cache on this machine" in problems[0]
    assert "huggingface-cli download org/tiny" in problems[0]
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    assert check_role(pair, "decode", local_runner) == []
    allowed = parse_pair_file({"prefill": {"model": "org/x", "allow_download": True}, "decode": {"model": "org/x", "allow_download": True}})
    assert check_role(allowed, "prefill", local_runner) == []  # checked by vLLM at start instead


def test_gpu_indices_are_checked_on_their_host():
    pair = parse_pair_file({
        "hosts": {"local": {"address": "10.0.0.11"}, "gpu-b": {"address": "10.0.0.12", "python": "/opt/py"}},
        "prefill": {"device": "cuda", "cuda_visible_devices": [0]},
        "decode": {"host": "gpu-b", "device": "cuda", "cuda_visible_devices": [0, 3], "tensor_parallel_size": 2},
    })
    seen = []

    def gpu_b(argv):  # a host with GPUs 0 and 1 (stands in for the SSH runner)
        seen.append(argv)
        return (0, "0\n1\n", "") if argv == GPU_QUERY else (0, "", "")

    problems = check_role(pair, "decode", gpu_b)
    assert problems == ["decode.cuda_visible_devices[1]: GPU 3 does not exist on host gpu-b (it has 0,1); "
                        "fix: use indices `nvidia-smi -L` lists on gpu-b"]
    assert ["/opt/py", "-c", "import vllm, leasekit; print(vllm.__version__)"] in seen  # the host's own interpreter
    no_smi = check_role(pair, "prefill", lambda argv: (127, "", "nvidia-smi: command not found"))
    assert no_smi == ["prefill.device: 'cuda' but nvidia-smi is not installed on this machine; fix: run this server "
                      "on a host with NVIDIA GPUs and drivers, or set device = 'cpu'"]


def test_cores_and_tools_are_checked_on_this_machine():
    pair = parse_pair_file({"prefill": {"cpus": [60000]}})
    problems = check_role(pair, "prefill", local_runner, ["no-such-tool-leasekit"])
    assert any(p.startswith("prefill.cpus[0]: core 60000 is not usable on this machine (usable: ") for p in problems), problems
    assert any("no-such-tool-leasekit is not installed on this machine" in p for p in problems), problems

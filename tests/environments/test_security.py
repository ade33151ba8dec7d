"""Attacks on the sandbox, on each backend (bwrap; docker where an engine runs): each must be blocked or
contained, and the host left as it was. A gap a backend has by design is a strict xfail that says so."""

from __future__ import annotations

import os
import random
import sys
import socket
import subprocess
import threading
import time
import uuid

from pathlib import Path

import pytest

from environments import collect_files
from environments.sandbox.bwrap import _python_roots


def _host_pids(marker: str) -> list[int]:
    """Host processes whose command line contains `marker` (sandboxed processes are host processes too)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_gone(marker: str, seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (pids := _host_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def _marker() -> str:
    return f"{random.randint(100000, 999999)}.{random.randint(1, 9)}"  # a `sleep` argument nobody else uses


@pytest.fixture
def host_sleeper():
    """A host process the sandbox must neither see nor signal."""
    marker = _marker()
    proc = subprocess.Popen(["sleep", marker])
    yield proc, marker
    proc.kill()
    proc.wait()


NET_PROBE = """
import socket, sys
port = int(sys.argv[1])
for target in [("1.1.1.1", 80), ("8.8.8.8", 53), ("127.0.0.1", port)]:
    try:
        socket.create_connection(target, timeout=2).close()
        print("CONNECTED", target)
    except OSError as exc:
        print("blocked", target, exc.__class__.__name__)
try:
    print("RESOLVED", socket.getaddrinfo("deb.debian.org", 80)[0][4])
except OSError as exc:
    print("blocked dns", exc.__class__.__name__)
print(open("/proc/net/dev").read())
"""


def test_network_egress_dns_and_host_loopback_are_unreachable(make):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    try:
        box = make(timeout_s=20)
        box.write_file("probe.py", NET_PROBE)
        r = box.exec(["python", "probe.py", str(server.getsockname()[1])])
        assert r.exit_code == 0, r
        assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout, r.stdout
        assert r.stdout.count("blocked") == 4
        interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines() if ":" in line and "|" not in line]
        assert [i for i in interfaces if i.startswith(("eth", "ens", "enp", "wl", "docker", "br"))] == [], interfaces
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached the host's loopback service
    finally:
        server.close()


def test_host_files_environment_and_proc_are_hidden(make, tmp_path, host_sleeper, monkeypatch):
    proc, marker = host_sleeper
    secret = tmp_path / f"secret-{uuid.uuid4().hex}.txt"
    secret.write_text("host secret\n")
    monkeypatch.setenv("AGENTIC_RL_HOST_SECRET", "s3cr3t-value")
    box = make()
    # Of the host's home, at most the folder of the Python installation that bwrap binds read-only.
    python_homes = {Path(p).relative_to("/root").parts[0] for p in _python_roots() if p.startswith("/root/")}
    listing = box.exec("ls -A /root")
    assert listing.exit_code != 0 or set(listing.stdout.split()) <= python_homes, listing
    r = box.exec(f"cat {secret} 2>&1; cat /etc/shadow 2>&1; env; "
                 f"cat /proc/{proc.pid}/cmdline /proc/{proc.pid}/environ 2>&1; "
                 "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]'")
    assert "host secret" not in r.stdout and "s3cr3t-value" not in r.stdout
    assert "root:" not in r.stdout  # no shadow file content
    assert marker not in r.stdout  # the host's processes are not in this /proc
    assert int(r.stdout.strip().splitlines()[-1]) < 10  # only this sandbox's processes


def test_runs_unprivileged_without_capabilities(make):
    r = make().exec("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    lines = r.stdout.split("\n")
    assert lines[0] != "0"
    fields = dict(line.split(":\t") for line in lines[1:] if line)
    assert fields["CapEff"].strip("0") == "" and fields["NoNewPrivs"] == "1", fields


def test_writing_outside_the_workspace_fails_and_the_host_is_untouched(make):
    name = f"agentic-rl-escape-{uuid.uuid4().hex}"
    box = make()
    r = box.exec(f"for p in /usr/local/{name} /{name} /etc/{name} /usr/bin/{name}; do "
                 f"echo x > $p && echo WROTE $p; done 2>/dev/null; echo x > /tmp/{name} && echo tmp-ok; "
                 f"touch /workspace/ok && echo ws-ok")
    assert "WROTE" not in r.stdout and "ws-ok" in r.stdout, r
    for path in (f"/usr/local/{name}", f"/{name}", f"/etc/{name}", f"/usr/bin/{name}", f"/tmp/{name}"):
        assert not os.path.exists(path), path  # a private /tmp, if any, is not the host's
    box.exec("ln -s /usr/bin link")
    with pytest.raises(OSError):
        box.write_file("link/evil", "x")  # written from inside: the read-only target refuses it
    # Links planted for the host-side reader of the workspace (the grader's copy) are not followed.
    box.exec("ln -s /etc/hostname leak.txt; ln -s / rootdir; echo mine > real.txt")
    assert collect_files(box.workspace) == {"ok": "", "real.txt": "mine\n"}


NAMESPACE_PROBE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
nr = NUMBERS
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr[name], *[ctypes.c_long(a) for a in args])
    if r == 0 and name == "clone":  # the child of a clone that went through: leave at once
        os._exit(0)
    return f"{name}={r}/{ctypes.get_errno()}"
print(" ".join([call("unshare", 0x10000000), call("unshare", 0x20000), call("unshare", 0x40000000),
                call("clone", 0x10000000 | 17, 0, 0, 0, 0), call("clone", 0x20000000 | 17, 0, 0, 0, 0),
                call("setns", os.open("/proc/self/ns/uts", os.O_RDONLY), 0),
                call("keyctl", 0, -3, 0), call("bpf", 0, 0, 0), call("perf_event_open", 0, 0, -1, -1, 0),
                call("clone3", 0, 0)]))
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="the filter has tables for these")
def test_no_namespace_can_be_made_inside(make):
    """Inside the sandbox (as root it has no user namespace of its own) the agent cannot make one: `unshare -U`,
    `unshare -r`, a mount or net namespace, clone() with a namespace flag, setns, and the kernel interfaces a task
    never needs (keyctl, bpf, perf_event_open) are refused with EPERM; clone3 answers ENOSYS (glibc falls back to
    clone). Threads, subprocesses and pytest still work."""
    box = make()
    for cmd in ("unshare -U id", "unshare -r id", "unshare -m true", "unshare -n true", "unshare -pf true"):
        r = box.exec(cmd)
        assert r.exit_code != 0 and "Operation not permitted" in r.stdout + r.stderr, (cmd, r)
    from environments.sandbox.seccomp import _TABLES

    box.write_file("probe.py", NAMESPACE_PROBE.replace("NUMBERS", repr(_TABLES[os.uname().machine][1])))
    r = box.exec(["python3", "probe.py"])
    results = dict(item.split("=") for item in r.stdout.split())
    assert r.exit_code == 0, r
    for name in ("unshare", "clone", "setns", "keyctl", "bpf", "perf_event_open"):
        assert results[name] == "-1/1", (name, r.stdout)  # EPERM
    assert results["clone3"] == "-1/38", r.stdout  # ENOSYS
    ok = box.exec("python3 -c 'import threading, subprocess; t = threading.Thread(target=int); t.start(); "
                  "t.join(); print(subprocess.run([\"echo\", \"child\"], capture_output=True).stdout.decode())'")
    assert ok.exit_code == 0 and "child" in ok.stdout


def test_fork_bomb_is_contained(make):
    box = make(timeout_s=10, max_processes=32)
    started = time.monotonic()
    r = box.exec("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=6)
    assert r.exit_code in (0, 124) and time.monotonic() - started < 30
    r = box.exec("bomb() { bomb | bomb & }; bomb; sleep 100", timeout=3)  # still forking at the timeout
    assert r.timed_out and r.exit_code == 124
    assert box.exec("echo usable").stdout == "usable\n"  # the sandbox recovers
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_memory_bomb_is_contained(make):
    box = make(memory_mb=256)
    r = box.exec("python -c \"x = b'x' * (1024 ** 3); print('allocated')\"")
    assert r.exit_code != 0 and "allocated" not in r.stdout, r
    r = box.exec("python -c \"x = [bytearray(1 << 20) for _ in range(2048)]; print('allocated')\"")
    assert r.exit_code != 0 and "allocated" not in r.stdout, r
    assert box.exec("echo usable").stdout == "usable\n"
    assert subprocess.run(["true"]).returncode == 0


FILL = "i=0; while [ $i -lt 64 ]; do i=$((i+1)); head -c 1000000 /dev/zero > {dir}/fill$i || break; done; du -skc {dir}/fill* | tail -1"


def test_disk_fill_is_capped(make):
    """64 files of 1 MB, each under the file-size limit: the workspace and /tmp must stop them."""
    box = make(workspace_mb=16, tmp_mb=16)
    for where in ("/workspace", "/tmp"):
        r = box.exec(FILL.format(dir=where), timeout=60)
        used_kb = int(r.stdout.split()[-2])
        assert used_kb <= 17 * 1024, (where, used_kb)
    assert box.exec("rm -f fill*; echo x > after && cat after").stdout == "x\n"  # usable once freed


def test_sleeping_past_the_timeout_is_killed(make):
    box = make(timeout_s=30)
    started = time.perf_counter()
    r = box.exec("sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 124 and time.perf_counter() - started < 10
    assert box.exec("echo after").stdout == "after\n"


def test_timeout_kills_the_whole_tree(make):
    box = make(timeout_s=10)
    marker = _marker()
    r = box.exec(f"(setsid sh -c 'while true; do date > alive; sleep 0.1; done' &); sleep {marker}", timeout=1)
    assert r.timed_out and r.exit_code == 124
    assert _wait_gone(marker) == []
    alive = box.workspace / "alive"
    time.sleep(0.5)
    if alive.exists():
        stamp = alive.stat().st_mtime
        time.sleep(0.5)
        assert alive.stat().st_mtime == stamp, "a daemonised child survived the timeout"


def test_orphans_and_daemons_die_with_the_call_and_after_close(make):
    box = make(timeout_s=20)
    m1, m2, m3 = _marker(), _marker(), _marker()
    started = time.perf_counter()
    r = box.exec(f"(setsid sleep {m1} &); nohup sleep {m2} >/dev/null 2>&1 & "
                 f"sh -c 'sleep {m3} &'; (setsid sh -c 'while true; do date > alive; sleep 0.1; done' &); "
                 "echo started")
    assert r.stdout == "started\n" and time.perf_counter() - started < 10  # a daemon does not hold the call
    assert _wait_gone(m1) == [] and _wait_gone(m2) == [] and _wait_gone(m3) == []
    box.close()
    assert all(_host_pids(m) == [] for m in (m1, m2, m3))


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_cannot_signal_the_host_or_other_sandboxes(make, host_sleeper):
    proc, _ = host_sleeper
    a, b = make(timeout_s=20), make(timeout_s=20)
    result = {}
    other = threading.Thread(target=lambda: result.setdefault("b", b.exec("touch ready; sleep 5; echo b-done")))
    other.start()
    _wait_for(Path(b.workspace) / "ready")  # b runs: a's kills have something to miss
    r = a.exec(f"kill -9 {proc.pid}; echo host=$?; pkill -9 -x sleep; echo pkill=$?; kill -9 -1; echo after")
    other.join()
    assert "host=1" in r.stdout and "pkill=1" in r.stdout, r
    assert proc.poll() is None  # the host process lives
    assert result["b"].exit_code == 0 and result["b"].stdout == "b-done\n"  # and the other sandbox's


def test_concurrent_sandboxes_cannot_see_each_other(make):
    a, b = make(), make()
    assert a.uid != b.uid and a.workspace != b.workspace
    running = threading.Thread(target=a.exec, args=("echo secret > /tmp/a-secret; touch ready; sleep 5",))
    running.start()
    _wait_for(Path(a.workspace) / "ready")  # a's secret and its sleep are there to be seen, if they could be
    seen = b.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; ls /tmp").stdout
    running.join()
    assert "sleep 5" not in seen and "a-secret" not in seen
    a.write_file("secret.txt", "x")
    assert b.exec("ls -A /workspace").stdout.strip() == ""
    assert b.exec(f"cat {a.workspace}/secret.txt").exit_code != 0


HOST_SCRIPT = """
import sys
from environments import make_sandbox
kind, marker = sys.argv[1], sys.argv[2]
box = make_sandbox("bwrap", resident=kind == "bwrap")
box.exec(f"sleep {marker}", timeout=60)
"""


def test_the_sandbox_dies_with_the_host_process(sandbox_kind):
    """The process that owns a sandbox is killed mid-call: nothing it ran in the sandbox lives on."""
    if sandbox_kind == "docker":
        pytest.skip("a Docker container belongs to the engine, not to the process that started it")
    marker = _marker()
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, sandbox_kind, marker],
                            cwd=str(Path(__file__).resolve().parents[2]))
    deadline = time.monotonic() + 30
    while not _host_pids(marker):
        assert host.poll() is None and time.monotonic() < deadline, "the sandboxed command never started"
        time.sleep(0.1)
    host.kill()
    host.wait()
    assert _wait_gone(marker, 10.0) == []

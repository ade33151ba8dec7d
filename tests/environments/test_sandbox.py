"""The bubblewrap sandbox, for real: isolation, limits and cleanup."""

import os
import time

import pytest

from environments import make_sandbox


@pytest.fixture
def box():
    with make_sandbox("bwrap", timeout_s=10) as b:
        yield b


def test_exec_write_read(box):
    box.write_file("pkg/a.txt", "hello\n")
    assert box.read_file("pkg/a.txt") == "hello\n"
    r = box.exec("cat pkg/a.txt; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("hello\n", "err\n", 3, False)
    assert (box.workspace / "pkg" / "a.txt").read_text() == "hello\n"


def test_runs_as_unprivileged_user_without_network(box):
    r = box.exec("id -u; python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"")
    assert r.stdout.split()[0] != "0"
    assert "Network is unreachable" in r.stderr or r.exit_code != 0


def test_host_files_hidden_and_system_read_only(box):
    r = box.exec("ls /root/.cache 2>&1; ls /etc/passwd 2>&1; touch /usr/x 2>&1; ls /proc | grep -c '^[0-9]'")
    assert "agentic-rl" not in r.stdout
    assert "No such file" in r.stdout or "cannot access" in r.stdout
    assert "Read-only" in r.stdout or "Permission denied" in r.stdout
    assert int(r.stdout.strip().splitlines()[-1]) < 10  # only this sandbox's processes


def test_writing_outside_workspace_fails(box):
    r = box.exec("echo x > /usr/local/evil 2>&1; echo x > /evil 2>&1; echo $?")
    assert r.stdout.strip().endswith("1") or r.stdout.strip().endswith("2")
    box.exec("ln -s /usr/bin link")
    with pytest.raises(OSError):
        box.write_file("link/evil", "x")


def test_timeout_kills_the_whole_tree(box):
    marker = box.workspace / "alive"
    started = time.perf_counter()
    r = box.exec("(setsid sh -c 'while true; do date > alive; sleep 0.1; done' &) ; sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 124 and time.perf_counter() - started < 10
    time.sleep(0.5)
    if marker.exists():
        stamp = marker.stat().st_mtime
        time.sleep(0.5)
        assert marker.stat().st_mtime == stamp, "a daemonised child survived the timeout"


def test_fork_bomb_and_memory_bomb_are_contained():
    with make_sandbox("bwrap", timeout_s=10, max_processes=32, memory_mb=256) as b:
        r = b.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo survived", timeout=5)
        assert r.exit_code in (0, 124)
        r = b.exec("python -c \"x = bytearray(1024 * 1024 * 1024); print('allocated')\"")
        assert r.exit_code != 0 and "allocated" not in r.stdout
    assert os.system("true") == 0  # the host can still fork


def test_file_size_and_output_caps():
    with make_sandbox("bwrap", max_file_mb=1, max_output_bytes=1000) as b:
        r = b.exec("head -c 3000000 /dev/zero > big; stat -c %s big; echo done | awk '{print $1}'")
        assert int(r.stdout.split()[0]) <= 1024 * 1024 and r.stdout.split()[-1] == "done"
        r = b.exec("yes | head -c 100000")
        assert r.truncated and len(r.stdout) < 2000 and "omitted" in r.stdout


def test_concurrent_sandboxes_are_isolated():
    import threading

    with make_sandbox("bwrap") as a, make_sandbox("bwrap") as b:
        assert a.uid != b.uid
        running = threading.Thread(target=a.exec, args=("sleep 3",))
        running.start()
        time.sleep(0.5)
        seen = b.exec("ps -eo comm").stdout.split()
        killed = b.exec("pkill -x sleep; echo $?").stdout.strip()
        running.join()
        assert "sleep" not in seen and killed == "1"  # b can neither see nor signal a's processes
        a.write_file("secret.txt", "x")
        assert b.exec("ls /workspace").stdout.strip() == ""


def test_close_cleans_up():
    b = make_sandbox("bwrap")
    b.write_file("a", "b")
    ws = b.workspace
    b.close()
    assert not ws.exists()
    with pytest.raises(RuntimeError):
        b.exec("true")


def test_unknown_backend_and_limits():
    with pytest.raises(ValueError):
        make_sandbox("qemu")
    with pytest.raises(TypeError, match="unknown sandbox limits"):
        make_sandbox("bwrap", memroy_mb=1)

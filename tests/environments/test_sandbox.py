"""The sandbox contract, for real, on each backend (bwrap; docker where an engine runs): exec, files, limits,
caps, cleanup, errors. Attacks on the sandbox are in test_security.py."""

import pytest

from environments import make_sandbox


def test_exec_write_read(make):
    box = make(timeout_s=10)
    box.write_file("pkg/a.txt", "hello\n")
    assert box.read_file("pkg/a.txt") == "hello\n"
    r = box.exec("cat pkg/a.txt; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("hello\n", "err\n", 3, False)
    assert (box.workspace / "pkg" / "a.txt").read_text() == "hello\n"  # the host sees the workspace
    (box.workspace / "host.txt").write_text("from the host\n")  # as setup_workspace writes task files
    assert box.exec(["cat", "host.txt"]).stdout == "from the host\n"
    assert box.exec("cat", stdin="piped\n").stdout == "piped\n"
    assert box.exec("pwd; echo $HOME").stdout.split() == ["/workspace", "/workspace"]
    assert box.exec("kill -9 $$").exit_code == 137  # killed by a signal: 128 + signal, as a shell says
    with pytest.raises(FileNotFoundError):
        box.read_file("missing.txt")


def test_python_and_pytest_run_inside(make):
    box = make()
    box.write_file("test_x.py", "def test_ok():\n    assert 1 + 1 == 2\n")
    r = box.exec("python -m pytest -q -p no:cacheprovider test_x.py")
    assert r.exit_code == 0 and "1 passed" in r.stdout, r


def test_file_size_and_output_caps(make):
    box = make(max_file_mb=1, max_output_bytes=1000)
    r = box.exec("head -c 3000000 /dev/zero > big; stat -c %s big; echo done | awk '{print $1}'")
    assert int(r.stdout.split()[0]) <= 1024 * 1024 and r.stdout.split()[-1] == "done"
    r = box.exec("yes | head -c 100000")
    assert r.truncated and len(r.stdout) < 2000 and "omitted" in r.stdout
    assert r.stdout.startswith("y\ny\n") and r.stdout.endswith("y\ny\n")


def test_close_cleans_up(make):
    b = make()
    b.write_file("a", "b")
    ws = b.workspace
    b.close()
    b.close()  # twice is fine
    assert not ws.exists()
    with pytest.raises(RuntimeError):
        b.exec("true")


def test_unknown_backend_and_limits():
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        make_sandbox("qemu")
    with pytest.raises(TypeError, match="unknown sandbox limits"):
        make_sandbox("bwrap", memroy_mb=1)
    with pytest.raises(TypeError, match="unknown sandbox limits"):
        make_sandbox("docker", memroy_mb=1)
    with pytest.raises(TypeError, match="options of the docker backend"):
        make_sandbox("bwrap", image="agentic-rl/python:bookworm")
    with pytest.raises(ValueError, match="cpus"):
        make_sandbox("docker", cpus=0)
    with pytest.raises(ValueError, match="workspace_mb"):
        make_sandbox("docker", workspace_mb="big")
    with pytest.raises(ValueError, match="image"):
        make_sandbox("docker", image="")


def test_resident_executor_recovers_when_killed(tmp_path):
    """The resident bwrap executor killed from outside mid-call (as root, where it runs): the call returns a
    failure at once instead of hanging, and the next call gets a fresh sandbox with the same workspace."""
    import os
    import signal
    import threading
    import time

    with make_sandbox("bwrap", timeout_s=30) as box:
        if not box.resident:
            pytest.skip("the resident executor needs root")
        box.write_file("kept.txt", "still here\n")
        doomed = box._executor  # bwrap and its namespace's init: the executor and the command go with them
        threading.Timer(1.0, lambda: os.killpg(doomed.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        r = box.exec("sleep 20; echo never")
        assert r.exit_code != 0 and "never" not in r.stdout and time.monotonic() - started < 15, r
        assert box.exec("cat kept.txt").stdout == "still here\n"
        assert box._executor is not doomed


def test_a_sandbox_outlives_the_thread_that_made_it(make):
    """Sandboxes are made in pool threads and used from others (the rollout worker does): the thread's end must
    not take the sandbox with it (bwrap's --die-with-parent follows the thread, not the process)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        boxes = list(pool.map(lambda _: make(), range(2)))
    for box in boxes:
        assert box.exec("echo alive").stdout == "alive\n"

"""What only the Docker backend has: the container's settings, a task's own image, grading in Docker, the
orphan reaper, and the stream reader (the only part tested on made-up bytes)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import pytest

from environments import grade, make_sandbox
from environments.sandbox.docker import DEFAULT_IMAGE, _Capped, _Demux, docker_client, reap_orphans
from environments.sandbox import task_sandbox_options


def test_container_settings(docker_engine):
    with make_sandbox("docker", memory_mb=300, max_processes=40, max_file_mb=2, max_open_files=128, cpus=0.5,
                      workspace_mb=20, tmp_mb=10) as box:
        box.exec("true")
        host = box.container.attrs["HostConfig"]
        assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True and host["Init"] is True
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
        assert host["Privileged"] is False and host["Memory"] == host["MemorySwap"] == 300 * 2 ** 20
        assert host["PidsLimit"] == 42 and host["NanoCpus"] == 5 * 10 ** 8
        ulimits = {u["Name"]: u["Hard"] for u in host["Ulimits"]}
        assert ulimits["fsize"] == 2 * 2 ** 20 and ulimits["nofile"] == 128
        assert "size=10m" in host["Tmpfs"]["/tmp"]
        assert box.container.attrs["Config"]["User"] == "65534:65534"  # PID 1 is not the agent's uid
        r = box.exec("df -k /workspace /tmp | tail -2; ulimit -f; ulimit -n")
        sizes = [int(line.split()[1]) for line in r.stdout.splitlines()[:2]]
        assert sizes == [20 * 1024, 10 * 1024] and r.stdout.split()[-2:] == ["2048", "128"]  # bash: -f in KB
        assert not (box.workspace.stat().st_dev == os.stat(box.workspace.parent).st_dev)  # a mount of its own
    with pytest.raises(Exception, match="container"):
        docker_client().containers.get(box.container.id)  # removed at close


def test_bind_only_before_the_container_starts(docker_engine, tmp_path):
    with make_sandbox("docker") as box:
        box.bind(tmp_path, "/grader", writable=True)
        assert box.exec("touch /grader/report && echo ok").stdout == "ok\n"
        assert (tmp_path / "report").exists()
        with pytest.raises(RuntimeError, match="before the first exec"):
            box.bind(tmp_path, "/late")


def test_a_task_names_its_own_image(docker_engine, task_by_id):
    task = task_by_id["add_two_numbers"]
    client = docker_client()
    client.images.get(DEFAULT_IMAGE).tag("agentic-rl/task-image-test", "v1")
    try:
        own = type(task)(**{**vars(task), "metadata": {**task.metadata,
                                                       "docker_image": "agentic-rl/task-image-test:v1"}})
        assert task_sandbox_options(own, "bwrap") == {}
        options = task_sandbox_options(own, "docker")
        with make_sandbox("docker", **options) as box:
            box.exec("true")
            assert "agentic-rl/task-image-test:v1" in box.container.image.tags
        solved = {f.path: f.content for f in own.files + own.reference_solution}
        assert grade(own, solved, backend="docker").reward == 1.0
        missing = type(task)(**{**vars(task), "metadata": {"docker_image": "agentic-rl/no-such-image:1"}})
        with pytest.raises(RuntimeError, match="no image 'agentic-rl/no-such-image:1'.*build_image.sh"):
            grade(missing, solved, backend="docker")
        bad = type(task)(**{**vars(task), "metadata": {"docker_image": 3}})
        with pytest.raises(ValueError, match="docker_image"):
            task_sandbox_options(bad, "docker")
    finally:
        client.images.remove("agentic-rl/task-image-test:v1")


def test_grading_in_docker_matches_bwrap(docker_engine, shipped_tasks):
    """One task per domain: the reference solution passes, the start does not, on both backends alike."""
    by_domain = {}
    for task in shipped_tasks.tasks:
        by_domain.setdefault(task.domain, task)
    for task in by_domain.values():
        start = {f.path: f.content for f in task.files}
        solved = {**start, **{f.path: f.content for f in task.reference_solution}}
        for files in (solved, start):
            ours, theirs = grade(task, files, backend="docker"), grade(task, files, backend="bwrap")
            assert (ours.reward, ours.details["outcomes"]) == (theirs.reward, theirs.details["outcomes"]), task.id
        assert grade(task, solved, backend="docker").reward == 1.0


def test_reaper_removes_sandboxes_of_dead_processes(docker_engine):
    """A worker that dies without closing its sandbox leaves a container and a mounted workspace; the reaper
    removes both."""
    code = textwrap.dedent("""
        import os
        from environments import make_sandbox
        box = make_sandbox("docker")
        box.exec("true")
        print(box.container.id, box.workspace, flush=True)
        os._exit(0)  # no close, no finaliser
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    container_id, workspace = out.stdout.split()
    assert os.path.ismount(workspace)
    assert container_id in reap_orphans()
    assert not os.path.exists(workspace)
    with pytest.raises(Exception):
        docker_client().containers.get(container_id)


def _frame(stream: int, data: bytes) -> bytes:
    return bytes([stream, 0, 0, 0]) + struct.pack(">I", len(data)) + data


def test_stream_reader_demultiplexes_and_caps():
    out, err = _Capped(10), _Capped(10)
    demux = _Demux(out, err)
    stream = _frame(1, b"hello ") + _frame(2, b"oops") + _frame(1, b"world")
    for i in range(0, len(stream), 3):  # frames split anywhere across reads
        demux.feed(stream[i:i + 3])
    assert out.text() == ("hello world"[:5] + "\n[... 1 bytes of output omitted ...]\n" + "world", True)
    assert err.text() == ("oops", False)
    big = _Capped(8)
    for chunk in (b"abcd", b"efgh", b"ijkl", b"mnop"):
        big.add(chunk)
    assert big.text() == ("abcd\n[... 8 bytes of output omitted ...]\nmnop", True)


def test_a_dead_container_is_started_again(docker_engine):
    with make_sandbox("docker") as box:
        box.write_file("kept.txt", "still here\n")
        box.container.kill()  # as when the OOM killer picks its init
        assert box.exec("cat kept.txt").stdout == "still here\n"


def test_docker_image_in_task_records(tmp_path, shipped_tasks):
    import json

    from environments import SHIPPED_TASKS, load_tasks

    good = json.loads(open(SHIPPED_TASKS).readline())
    rows = [{**good, "id": "own", "docker_image": "me/img:1"}, {**good, "id": "bad", "docker_image": ""},
            {**good, "id": "worse", "docker_image": ["x"]}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = load_tasks(str(path))
    assert [t.id for t in loaded.tasks] == ["own"] and loaded.tasks[0].metadata["docker_image"] == "me/img:1"
    assert len(loaded.skipped) == 2 and all("docker_image" in reason for _, reason in loaded.skipped)
    assert task_sandbox_options(loaded.tasks[0], "docker") == {"image": "me/img:1"}

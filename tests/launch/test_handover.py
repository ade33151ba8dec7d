"""launch/gpu/handover.sh: a folder made on the GPU machine reaches a later session's machine byte for byte,
over calls that each bring back or carry only a few parts (pack → fetch → keep → gather → unpack)."""

import hashlib
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "gpu" / "handover.sh"


def handover(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_folder_travels_in_parts_and_comes_back_identical(tmp_path):
    source = tmp_path / "made" / "sft" / "hf"
    source.mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024))  # incompressible: 2 parts of 2 MiB
    gpu_then, here, gpu_later = tmp_path / "gpu_then", tmp_path / "carry", tmp_path / "gpu_later"
    env_then = {"HANDOVER_DIR": str(gpu_then), "CARRY_DIR": str(here), "HANDOVER_PART": "2M"}
    env_later = {"HANDOVER_DIR": str(gpu_later), "CARRY_DIR": str(here)}

    packed = handover("pack", str(source), "sft", env=env_then)
    assert packed.returncode == 0 and "2 parts" in packed.stdout, packed.stdout + packed.stderr
    for call in range(2):  # two calls of one part each bring back both
        out = tmp_path / f"out{call}"
        out.mkdir()
        fetched = handover("fetch", "sft", "1", env={**env_then, "OUT": str(out)})
        assert fetched.returncode == 0, fetched.stderr
        assert len(list(out.glob("part*"))) == 1
        assert handover("keep", "sft", str(out), env=env_later).returncode == 0
    assert "2 of 2 parts fetched" in fetched.stdout

    destination = tmp_path / "later" / "sft"
    kept = sorted((here / "handover" / "sft").glob("part*"))
    missing = kept.pop()
    missing.rename(tmp_path / "held_back")  # a later call has not carried it yet
    assert handover("gather", env=env_later).returncode == 0
    early = handover("unpack", "sft", str(destination), env=env_later)
    assert early.returncode == 1 and "incomplete" in early.stdout and not destination.exists()

    (tmp_path / "held_back").rename(missing)
    assert handover("gather", env=env_later).returncode == 0
    done = handover("unpack", "sft", str(destination), env=env_later)
    assert done.returncode == 0, done.stdout + done.stderr
    assert digest(destination / "hf") == digest(source)


def test_a_damaged_part_is_refused(tmp_path):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(1024))
    env = {"HANDOVER_DIR": str(tmp_path / "box"), "CARRY_DIR": str(tmp_path / "carry")}
    assert handover("pack", str(source), "x", env=env).returncode == 0
    part = tmp_path / "box" / "x" / "part00"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    refused = handover("unpack", "x", str(tmp_path / "dest"), env=env)
    assert refused.returncode == 1 and "checksum" in refused.stdout and not (tmp_path / "dest").exists()

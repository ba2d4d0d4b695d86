"""A changed model copies only what changed: the plan (which hosts lack which files, one relay per set of files),
the tar of only those files, and the receiving host's assembly in a real shell: what arrived plus hard links to
the files it holds in another model, every file checked against the manifest, the old model never written to."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

from raycluster_cli.config import inventory
from raycluster_cli.delivery import model_delta, models, receive
from raycluster_cli.delivery.model_delta import Holdings

from .test_models import INVENTORY  # one head host whose state folder is under tmp_path


def _folder(root: Path, shards: int = 3) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    for index in range(shards):
        (root / f"model-{index:05d}.safetensors").write_bytes(bytes([index]) * 20000)
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text("{}")
    return root


def _inventory(tmp_path: Path) -> inventory.Inventory:
    (tmp_path / "host" / "demo").mkdir(parents=True, exist_ok=True)
    return inventory.parse(INVENTORY.format(state=tmp_path / "host"), "inv.yaml")


def _send(
    tmp_path: Path, model: models.ModelFolder, shipment: model_delta.Shipment
) -> subprocess.CompletedProcess[str]:
    """The relay's receive script with the model's use step, the shipment's tar on stdin (as the operator sends
    it), checked against the shipment's SHA-256."""
    inv = _inventory(tmp_path)
    use = models.use_command(inv, inv.hosts[0], model)
    staged = f"{tmp_path}/staging/model-{model.digest}-part.tar"
    command = receive.receive_script(receive.receive_command(staged, shipment.sha256, use))
    files = None if shipment.whole else shipment.files
    with models.open_tar(model, files) as source:
        stream = source.read()
    done = subprocess.run(["bash", "-c", command], input=stream, capture_output=True, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def _holdings(tmp_path: Path) -> Holdings:
    inv = _inventory(tmp_path)
    command = model_delta.holdings_command(inv, inv.hosts[0])
    return model_delta.parse_holdings(subprocess.run(["bash", "-c", command], capture_output=True, text=True).stdout)


def _stored(tmp_path: Path, model: models.ModelFolder) -> Path:
    return tmp_path / "host" / "demo" / "models" / model.digest


def _sums(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def _change(folder: Path, name: str = "model-00001.safetensors") -> models.ModelFolder:
    (folder / name).write_bytes(b"changed" * 100)
    return models.read_model_folder(folder)


def test_hosts_are_sent_the_files_they_hold_in_no_model_one_relay_per_set_of_files(tmp_path: Path) -> None:
    old = models.read_model_folder(_folder(tmp_path / "m"))
    new = _change(tmp_path / "m")
    had = Holdings(frozenset({old.digest}), frozenset(f.sha256 for f in old.files))
    held = {
        "10.0.0.1": had,
        "10.0.0.2": Holdings(frozenset(), frozenset()),  # new to the cluster
        "10.0.0.3": Holdings(frozenset({new.digest}), frozenset(f.sha256 for f in new.files)),
        "10.0.0.4": had,
    }
    first, second = model_delta.plan_shipments(new, held)
    assert first.hosts == ("10.0.0.1", "10.0.0.4") and not first.whole  # the larger relay first
    assert [f.path for f in first.files] == ["model-00001.safetensors"] and first.reused(new) == len(new.files) - 1
    assert second.hosts == ("10.0.0.2",) and second.whole and second.files == new.files
    assert (second.size, second.sha256) == (new.tar_size, new.tar_sha256)
    assert first.size < new.tar_size // 10  # the changed file (700 bytes), its header and the manifest


def test_a_file_moved_or_copied_within_the_model_travels_not_at_all(tmp_path: Path) -> None:
    old = models.read_model_folder(_folder(tmp_path / "m"))
    (tmp_path / "m" / "model-00000.safetensors").rename(tmp_path / "m" / "renamed.safetensors")
    new = models.read_model_folder(tmp_path / "m")
    (shipment,) = model_delta.plan_shipments(
        new, {"h": Holdings(frozenset({old.digest}), frozenset(f.sha256 for f in old.files))}
    )
    assert shipment.files == () and shipment.reused(new) == len(new.files)


def test_the_part_tar_holds_only_the_lacking_files_and_the_whole_manifest(tmp_path: Path) -> None:
    model = models.read_model_folder(_folder(tmp_path / "m"))
    files = model.files[1:2]
    size, sha256 = model_delta.tar_of(model, files)
    with models.open_tar(model, files) as source:
        data = source.read()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha256)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == [files[0].path, models.MANIFEST]
        assert tar.extractfile(models.MANIFEST).read() == model.manifest.encode()  # type: ignore[union-attr]


def test_holdings_are_read_from_recorded_output() -> None:
    digest, sha = "a" * 32, "b" * 64
    text = f"{digest}\t1234\ttiny\n{sha}\n{'c' * 64}\nnot a line\n{'g' * 64}\n"
    assert model_delta.parse_holdings(text) == Holdings(frozenset({digest}), frozenset({sha, "c" * 64}))


def test_a_host_assembles_the_changed_model_from_what_arrived_and_links_to_what_it_held(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    old = models.read_model_folder(folder)
    (whole,) = model_delta.plan_shipments(old, {"h": _holdings(tmp_path)})
    assert whole.whole
    done = _send(tmp_path, old, whole)
    assert done.returncode == 0 and models.RECEIVED in done.stdout, done.stderr
    old_sums = _sums(_stored(tmp_path, old))

    new = _change(folder)
    (part,) = model_delta.plan_shipments(new, {"h": _holdings(tmp_path)})  # what the real cache says it holds
    assert [f.path for f in part.files] == ["model-00001.safetensors"]
    done = _send(tmp_path, new, part)
    assert done.returncode == 0 and models.RECEIVED in done.stdout, done.stderr

    stored = _stored(tmp_path, new)
    assert _sums(stored) == _sums(folder)  # byte-identical to the operator's folder
    assert _sums(_stored(tmp_path, old)) == old_sums  # the old model is as it was
    for file in ("config.json", "model-00000.safetensors", "tok/tokenizer.json"):  # reused: the same inode
        assert os.stat(stored / file).st_ino == os.stat(_stored(tmp_path, old) / file).st_ino
        assert not os.stat(stored / file).st_mode & 0o222
    assert (
        os.stat(stored / "model-00001.safetensors").st_ino
        != os.stat(_stored(tmp_path, old) / "model-00001.safetensors").st_ino
    )
    assert models.parse_held(_holdings_text(tmp_path)) == {old.digest, new.digest}
    assert sorted(p.name for p in stored.parent.iterdir()) == sorted([old.digest, new.digest])  # no unpacking left


def _holdings_text(tmp_path: Path) -> str:
    inv = _inventory(tmp_path)
    return subprocess.run(["bash", "-c", models.held_command(inv, inv.hosts[0])], capture_output=True, text=True).stdout


def test_a_part_for_a_host_that_no_longer_holds_the_rest_stores_nothing(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    old = models.read_model_folder(folder)
    new = _change(folder)
    (part,) = model_delta.plan_shipments(new, {"h": Holdings(frozenset(), frozenset(f.sha256 for f in old.files))})
    done = _send(tmp_path, new, part)  # the host's cache has no model at all (removed since it was asked)
    assert done.returncode != 0 and "neither arrived nor is in a model this host holds" in done.stderr
    assert models.RECEIVED not in done.stdout
    assert list((tmp_path / "host" / "demo" / "models").iterdir()) == []


def test_a_held_file_that_no_longer_matches_is_never_used_and_the_old_model_keeps_its_modes(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    old = models.read_model_folder(folder)
    (whole,) = model_delta.plan_shipments(old, {"h": _holdings(tmp_path)})
    assert _send(tmp_path, old, whole).returncode == 0
    rotten = _stored(tmp_path, old) / "model-00000.safetensors"  # a disk that went bad under the old model
    rotten.chmod(0o644)
    rotten.write_bytes(b"rot" * 10)
    rotten.chmod(0o444)
    new = _change(folder)
    (part,) = model_delta.plan_shipments(new, {"h": _holdings(tmp_path)})
    done = _send(tmp_path, new, part)
    assert done.returncode != 0 and "model-00000.safetensors does not match the manifest" in done.stderr
    assert not _stored(tmp_path, new).exists()
    for file in _stored(tmp_path, old).rglob("*"):  # the failed unpack made no file of the old model writable
        if file.is_file():
            assert not file.stat().st_mode & 0o222, file

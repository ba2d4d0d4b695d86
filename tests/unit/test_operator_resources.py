"""The operator machine's own resources, read with psutil: disk before caching an image archive, memory and
cores before `lab up`."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from raycluster_cli.delivery import deliver as images
from raycluster_cli.errors import OperationError
from raycluster_cli.lab import hosts as lab

GIB = 2**30


def test_room_for_the_archive_is_checked_on_the_real_disk(tmp_path: Path) -> None:
    free = psutil.disk_usage(str(tmp_path)).free
    images.ensure_room(tmp_path, 1, "one byte")
    with pytest.raises(OperationError) as info:
        images.ensure_room(tmp_path, free + 10 * GIB, "the compressed archive of raycluster/node:x")
    message = info.value.message
    assert str(tmp_path) in message and "the compressed archive of raycluster/node:x" in message
    assert f"needs up to {(free + 10 * GIB) / GIB:.1f} GiB" in message and "GiB free" in message
    assert "RAYCLUSTER_STATE_DIR" in info.value.hint


def test_archive_refuses_before_docker_save_when_the_image_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in `docker` reports an image larger than the disk; `docker save` must never start."""
    saved = tmp_path / "save-was-called"
    docker = tmp_path / "docker"
    too_big = psutil.disk_usage(str(tmp_path)).free + 50 * GIB
    docker.write_text(
        f'#!/bin/sh\ncase "$1 $2" in\n  "image inspect") echo {too_big} ;;\n  save*) touch {saved} ;;\nesac\n'
    )
    docker.chmod(0o755)
    monkeypatch.setattr(images, "docker_here", lambda: str(docker))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "old.tar.gz").write_bytes(b"x")
    events: list[object] = []
    with pytest.raises(OperationError, match=r"needs up to .* GiB"):
        images._archive("raycluster/node:x", "sha256:" + "a" * 64, "gzip", cache, events.append)
    assert not saved.exists() and list(cache.iterdir()) == []  # the old archive went first, no partial file
    assert events == []


def test_lab_refuses_when_the_new_hosts_do_not_fit_in_memory() -> None:
    with pytest.raises(OperationError) as info:
        lab.judge_resources(starting=20, total=20, available=1 * GIB, cores=2)
    assert "20 lab host(s) needs about 2.5 GiB" in info.value.message and "1.0 GiB available" in info.value.message
    assert "--hosts" in info.value.hint


def test_lab_warns_with_numbers_about_ray_nodes_and_cores() -> None:
    warnings = lab.judge_resources(starting=3, total=3, available=3 * GIB, cores=2)
    assert warnings == [
        "3.0 GiB of memory available: enough for 3 lab hosts, not for a Ray node on each (about 4.5 GiB); "
        "`up` may fail or swap"
    ]
    assert lab.judge_resources(starting=3, total=3, available=20 * GIB, cores=2) == []
    crowded = lab.judge_resources(starting=9, total=9, available=20 * GIB, cores=2)
    assert crowded == ["9 lab hosts share 2 core(s): Ray nodes on all of them will be slow to start"]


def test_a_lab_that_already_runs_is_not_judged_again() -> None:
    assert lab.judge_resources(starting=0, total=40, available=1 * GIB, cores=1) == []

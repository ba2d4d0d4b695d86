"""The bench's counted run multiplies in the forms its calibration measured (what the service runs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray")

from raycluster_cli.models.batched import linears  # noqa: E402
from raycluster_cli.models.decoder import ModelConfig, Stage  # noqa: E402
from raycluster_cli.models.matmuls import FLIPPED, PACKED, Matmuls, pack, packable  # noqa: E402
from raycluster_cli.node import stage_worker  # noqa: E402


def _worker(cfg: ModelConfig) -> stage_worker._StageWorker:
    worker = object.__new__(stage_worker._StageWorker)  # its Ray-bound __init__ is not what is under test
    worker.cfg, worker.forms = cfg, None
    return worker


def test_setup_takes_the_calibrated_plan_for_the_same_shapes_and_measures_for_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=4, max_seq=16, seed=3)
    stage = Stage(cfg, 3, cfg.num_units, emit="tokens")  # the last blocks and the head
    worker = _worker(cfg)
    calibrated = {1: (FLIPPED, 2), 2: (FLIPPED, 2)}
    worker.forms = (stage_worker._shapes(cfg), Matmuls(calibrated), Matmuls({1: (FLIPPED, 3)}))
    worker._set_forms(stage)
    assert stage.mm.plan == calibrated and stage.head_mm.plan == {1: (FLIPPED, 3)}

    if packable(torch.float32):  # a stage without the head, after a calibration whose head plan packs
        head_packed = Matmuls({}, {m: pack(m.weight) for m in linears(Stage(cfg, 0, cfg.num_units))[1]}, large=PACKED)
        worker.forms = (stage_worker._shapes(cfg), Matmuls(calibrated), head_packed)
        headless = Stage(cfg, 0, 2, emit="tokens")
        worker._set_forms(headless)
        assert headless.mm.plan == calibrated and headless.head_mm.plan == {} and headless.head_mm.packed == {}

    deeper = ModelConfig(**{**cfg.to_dict(), "layers": 8})  # `--layers` sized after calibration: same shapes
    worker.cfg = deeper
    again = Stage(deeper, 1, 5, emit="tokens")
    worker._set_forms(again)
    assert again.mm.plan == calibrated

    wider = ModelConfig(**{**cfg.to_dict(), "d_model": 64})  # other shapes: the calibration's plan is not theirs
    worker.cfg = wider
    other = Stage(wider, 1, 3, emit="tokens")
    measured = (Matmuls({4: (FLIPPED, 4)}), Matmuls({5: (FLIPPED, 5)}))
    monkeypatch.setattr(stage_worker, "measure_forms", lambda stage, spare: measured)
    worker._set_forms(other)
    assert (other.mm, other.head_mm) == measured

"""serve's launcher places the stages within each node's measured memory, and refuses a model that cannot fit
(a throwaway single-node local Ray, a tiny Llama checkpoint)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from raycluster_cli.serve.__main__ import _placement  # noqa: E402
from raycluster_cli.serve.options import LaunchOptions  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..llama_checkpoint import GQA, write_llama  # noqa: E402
from ..local_ray import one_node_ray  # noqa: E402


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with one_node_ray(_node_ip_address="127.0.0.1"):
        yield


def test_placement_measures_memory_and_refuses_what_cannot_fit(local_ray: None, tmp_path: Path) -> None:
    path = write_llama(tmp_path / "tiny", **GQA)
    common = {"model_path": str(path), "no_auth": True, "max_seq": 64, "calibrate_repeats": 1}
    args = LaunchOptions.model_validate({**common, "slots": 2, "calibrate_sample_s": 0.01})
    placed = _placement(args, ServeSettings(model_path=str(path), dtype="float32"), layers=3)
    [plan] = placed.plans
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 5
    assert "within each node's memory" in plan.why
    # a KV budget of a billion tokens fits no node: refused before any stage is built, with the numbers
    args = LaunchOptions.model_validate({**common, "slots": 2, "kv_tokens": 10**9, "no_measure": True})
    with pytest.raises(SystemExit, match=r"serve: the model does not fit the nodes' memory: it needs .* GB"):
        _placement(args, ServeSettings(model_path=str(path), dtype="float32"), layers=3)


def test_every_nodes_bfloat16_instructions_are_read_on_the_node(local_ray: None) -> None:
    from raycluster_cli.node.nodes import all_native_bf16, native_bf16

    node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    # the one node is this machine: its answer, read in a task placed on it, is this process's reading
    assert all_native_bf16(node_ids, timeout_s=60) is native_bf16()
    assert all_native_bf16([], timeout_s=1) is False  # no node: nothing to run bfloat16 on

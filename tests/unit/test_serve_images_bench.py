"""`bench --serve`'s image runs without a service: what counts as an image, and T_i between two status reads."""

from __future__ import annotations

import base64

from raycluster_cli.verbs.serve_images_bench import PNG_SIGNATURE, check_answer, prompt_of, replica_times


def _answer(raw: bytes) -> dict[str, object]:
    return {"data": [{"b64_json": base64.b64encode(raw).decode()}]}


def test_only_one_base64_png_counts_as_an_image() -> None:
    assert check_answer(200, _answer(PNG_SIGNATURE + b"rest")) == (len(PNG_SIGNATURE) + 4, None)
    assert check_answer(200, _answer(b"GIF89a"))[1] == "the image is not a PNG"
    assert check_answer(200, {"data": [{"b64_json": "%%%"}]})[1] == "the b64_json is not base64"
    assert "without one b64_json image (0 item(s))" in str(check_answer(200, {"data": []})[1])
    refused = check_answer(503, {"error": {"message": "the service is full"}})
    assert refused == (0, "HTTP 503: the service is full")


def test_prompts_repeat_for_a_seed_and_differ_between_requests() -> None:
    assert prompt_of(3, 7) == prompt_of(3, 7) != prompt_of(4, 7)
    assert all(3 <= len(prompt_of(i, 0).split()) <= 8 for i in range(20))


def test_busy_time_and_images_are_counted_between_the_two_reads() -> None:
    def status(busy: tuple[float, float], served: tuple[int, int]) -> dict[str, object]:
        nodes = [{"node_id": f"n{i}", "node_ip": f"10.0.0.{i}", "parts": ["text", "unet", "vae"], "busy_s": b,
                  "calls": s} for i, (b, s) in enumerate(zip(busy, served, strict=True))]  # fmt: skip
        pipelines = [{"index": i, "state": "live", "served": s, "stages": [{"node_ip": f"10.0.0.{i}"}]}
                     for i, s in enumerate(served)]  # fmt: skip
        return {"nodes": nodes, "pipelines": pipelines}

    got = replica_times(status((1.0, 2.0), (1, 1)), status((5.0, 6.0), (9, 3)), wall_s=4.0)
    assert [s["busy_s"] for s in got["stages"]] == [4.0, 4.0] and [s["calls"] for s in got["stages"]] == [8, 2]
    assert [r["images"] for r in got["replicas"]] == [8, 2]
    assert got["imbalance"] == 0.0 and got["t_max_minus_t_min_s"] == 0.0

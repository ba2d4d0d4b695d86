"""The request fields that change the logits, and the health answer (pure: no model, no Ray)."""

from __future__ import annotations

import json

import pytest

from raycluster_cli.serve import protocol
from raycluster_cli.serve.protocol import APIError, ChatRequest, CompletionRequest


def _parse(model: type, body: dict) -> object:
    return protocol.parse(model, json.dumps(body).encode())


def test_logit_bias_becomes_checked_token_ids() -> None:
    body = _parse(CompletionRequest, {"model": "m", "prompt": "x", "logit_bias": {"7": 2.5, "0": -100}})
    assert isinstance(body, CompletionRequest)
    assert body.biases(vocab=8) == ((7, 2.5), (0, -100.0))
    with pytest.raises(APIError) as outside:
        body.biases(vocab=7)
    assert outside.value.status == 400 and outside.value.param == "logit_bias"
    for bad in ({"cat": 1.0}, {"-1": 1.0}, {"3": 100.5}, {"\u00b2": 1.0}, {"\u0663": 1.0}):  # "²", Arabic 3
        with pytest.raises(APIError) as refused:
            _parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": bad})
        assert refused.value.param == "logit_bias", bad


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", -2.1), ("frequency_penalty", 2.1), ("repetition_penalty", 0), ("top_k", -2),
     ("min_p", 1.5), ("min_tokens", -1), ("seed", 2**63), ("seed", -(2**63) - 1)],
)  # fmt: skip
def test_out_of_range_sampling_fields_are_a_400_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(APIError) as refused:
        _parse(CompletionRequest, {"model": "m", "prompt": "x", field: value})
    assert refused.value.status == 400 and refused.value.param == field


def test_health_is_ok_while_a_replica_lives_and_503_with_retry_after_when_none() -> None:
    assert protocol.health(2, retry_after=3) == {"status": "ok", "replicas": 2}
    with pytest.raises(APIError) as down:
        protocol.health(0, retry_after=3)
    assert down.value.status == 503 and down.value.headers == {"Retry-After": "3"}
    assert down.value.body()["error"]["type"] == "server_error"

"""`make demo`'s serving steps on this machine: the tiny chat checkpoint `python -m raycluster_cli.models.tiny_chat`
writes is one `transformers` loads and chats with, and scripts/demo_chat.py fails the demo (exit 1, one line) when
the service does not answer, or refuses (exit 2) a document that is not `serve --json`'s."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "demo_chat.py"


def _script_module() -> Any:
    spec = importlib.util.spec_from_file_location("demo_chat", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


def test_the_demo_checkpoint_is_a_chat_model_transformers_loads(tmp_path: Path) -> None:
    done = _run("-m", "raycluster_cli.models.tiny_chat", str(tmp_path / "tiny-chat"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"   {tmp_path / 'tiny-chat'}: a random Llama (3 blocks") and not done.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tiny-chat"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tiny-chat")).eval()
    assert model.config.num_hidden_layers == 3  # one block per lab host
    prompt = _script_module().PROMPT
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tokenizer.unk_token_id not in ids  # every word of the demo's prompt is in the vocabulary
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)
    assert tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip()  # it answers words


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _document(tmp_path: Path, url: str) -> Path:
    key = tmp_path / "default.key"
    key.write_text("rcs-demo-key-0123456789abcdef\n")
    doc = {
        "url": url,
        "model": "tiny-chat",
        "replicas": 1,
        "split": [[0, 1], [1, 2], [2, 3]],
        "model_digest": "0" * 64,
        "copies": [],
        "pipelines": [],
        "api_key_file": str(key),
        "seconds": 1.0,
    }
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_service_that_does_not_answer_fails_the_demo_in_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    done = _run(str(SCRIPT), str(_document(tmp_path, url)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"serving tiny-chat at {url}" in done.stdout  # where it was called, as `serve` shows it
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"demo: the chat request to {url} failed: "), done.stderr


def test_a_document_without_the_key_file_is_refused(tmp_path: Path) -> None:
    path = _document(tmp_path, "http://127.0.0.1:9/v1")
    doc = json.loads(path.read_text())
    del doc["api_key_file"]
    path.write_text(json.dumps(doc))
    done = _run(str(SCRIPT), str(path))
    assert done.returncode == 2 and "no 'api_key_file'" in done.stderr, done.stderr

"""`make demo`'s chat step against the real service on a throwaway local Ray: scripts/demo_chat.py, given a
`serve --json` document, calls it with the real `openai` client and the service's own key, and prints exactly what
``transformers`` answers greedily to the same chat; a key the service does not hold (the cluster's Ray token)
fails the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("openai")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..serve_checkpoint import write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402
from ..unit.test_demo_serve import ROOT, SCRIPT, _script_module  # noqa: E402
from .test_serve_openai import TOKEN, _wait_ready  # noqa: E402

KEY = TOKEN  # the key _wait_ready calls with
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    path = write_chat_llama(tmp_path_factory.mktemp("demo") / MODEL)  # the demo's checkpoint (same writer)
    settings = ServeSettings(
        model_path=str(path),
        keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": KEY}),
        stages=3,
        split=(1, 1, 1),
        num_threads=1,
        model_id=MODEL,
        limits=Limits(slots=4, step_tokens=32, prefill_chunk=16, max_seq=128, max_waiting=8),  # the demo's flags
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV, num_cpus=3) as root:
        _wait_ready(f"{root}/v1")
        yield f"{root}/v1", path


def _call(tmp_path: Path, url: str, key: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "default.key").write_text(key + "\n")
    doc = {
        "url": url,
        "model": MODEL,
        "replicas": 1,
        "split": [[0, 1], [1, 2], [2, 3]],
        "model_digest": None,
        "copies": [],
        "pipelines": [],
        "api_key_file": str(tmp_path / "default.key"),
        "seconds": 1.0,
    }
    (tmp_path / "serve.json").write_text(json.dumps(doc))
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "serve.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


def test_the_demo_chat_prints_the_models_own_answer(served: tuple[str, Path], tmp_path: Path) -> None:
    url, path = served
    done = _call(tmp_path, url, KEY)
    assert done.returncode == 0, done.stdout + done.stderr
    script = _script_module()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": script.PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=script.NEW_TOKENS)
    want = in_context(tokenizer, ids, out[0, len(ids) :].tolist())  # as it reads after the prompt
    assert f"   {MODEL} (random weights: random words): {want.strip()}\n" in done.stdout, done.stdout


def test_the_clusters_token_is_refused_and_fails_the_demo(served: tuple[str, Path], tmp_path: Path) -> None:
    done = _call(tmp_path, served[0], "0123456789abcdef" * 4)  # what a Ray token looks like: not a service key
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"demo: the chat request to {served[0]} failed: ") and "401" in done.stderr

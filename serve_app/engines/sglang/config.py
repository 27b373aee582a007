"""Options of the SGLang backend and the ``sglang.Engine`` arguments built from them.

Importable without sglang: the options are validated when ``serve run`` reads the YAML, long
before an engine starts, and on machines where sglang cannot even be installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Server arguments that make SGLang silently turn ``--speculative-adaptive`` off
# (``adaptive_unsupported_reason`` in srt/speculative/adaptive_spec_params.py), or that break
# the one-engine-per-replica layout the plugin assumes. Refused up front, with the reason.
_REFUSED_EXTRA = {
    "enable_two_batch_overlap": "two-batch overlap turns adaptive speculation off",
    "enable_pdmux": "pdmux turns adaptive speculation off",
    "attn_dp_size": "attention DP turns adaptive speculation off",
    "enable_dp_attention": "attention DP turns adaptive speculation off",
    "enable_multi_layer_eagle": "multi-layer EAGLE has no adaptive worker",
    "dp_size": "one engine per replica: scale with Serve replicas, not SGLang DP",
    "pp_size": "the plugin's policy runs on the last PP rank only; use TP",
    "skip_tokenizer_init": "the engine streams text, so SGLang must detokenize",
}

# Keys build_server_args sets itself (extra_server_args may not override them).
_OWNED = {
    "model_path",
    "tp_size",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_adaptive",
    "speculative_adaptive_config",
    "enable_metrics",
    "incremental_streaming_output",
    "mem_fraction_static",
    "nccl_port",
    "context_length",
    "max_running_requests",
}


def _is_off(value: Any) -> bool:
    """False, None, or a width of at most 1 (``True == 1`` in Python, hence the type test)."""
    return value is None or value is False or (type(value) is int and value <= 1)


class SGLangOptions(BaseModel):
    """How a replica runs its in-process ``sglang.Engine`` (TP-8, EAGLE-3, adaptive steps)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, description="Target model: local folder or Hugging Face repo id.")
    draft_model_path: str = Field(min_length=1, description="EAGLE-3 draft head for the target.")
    tp_size: int = Field(default=8, ge=1, description="Tensor-parallel width; the replica must hold this many GPUs.")
    candidate_steps: list[int] = Field(
        default_factory=lambda: [0, 3, 5],
        description="Every num_steps the controller may command; SGLang builds one runtime state "
        "(CUDA graphs for draft, verify, draft-extend) per entry. Must include 0.",
    )
    initial_steps: int | None = Field(
        default=None, description="Steps the engine starts with until the controller speaks; default the largest."
    )
    step_policy: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="fixed: every decode batch runs the commanded steps; adaptive: the command is a ceiling and "
        "SGLang's own acceptance-EMA policy (per batch-size slot, adaptive_slots) picks under it.",
    )
    adaptive_slots: dict[int, list[int]] | None = Field(
        default=None,
        description="step_policy adaptive: SGLang's batch-size slots, {smallest batch size: candidate steps}; "
        "their union must be candidate_steps. Default: one slot of every candidate for every batch size.",
    )
    speculative_eagle_topk: Literal[1] = Field(default=1, description="Adaptive speculation needs topk 1.")
    spec_max_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Local guard: a decode batch larger than this runs 0 steps whatever is commanded.",
    )
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    nccl_port: int | None = Field(
        default=29600, ge=1024, le=65535, description="Pinned so a replica's ports are known; null lets SGLang pick."
    )
    context_length: int | None = Field(default=None, ge=1)
    max_running_requests: int | None = Field(default=None, ge=1)
    enable_metrics: bool = True
    rpc_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a switch waits for SGLang's schedulers; past it the engine keeps its last "
        "step count, the failure is counted and the next broadcast retries.",
    )
    draft_context_overwrite: bool = Field(
        default=False,
        description="Let SGLang run the draft past its own max_position_embeddings when the target's "
        "context is longer (sets SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 in the engine's processes).",
    )
    zero_step_draft_extend: bool = Field(
        default=True,
        description="At 0 steps SGLang still extends the draft's KV cache each step so that it stays warm. "
        "False skips it (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 in the engine's processes): 0 steps ran "
        "2.0x faster at batch 1 and 1.5x at 64 on an H200 (docs/sglang.md), with a cold draft on resume.",
    )
    adaptive_config_dir: str | None = Field(
        default=None, description="Where the adaptive-config JSON is written; default a folder under the temp dir."
    )
    extra_server_args: dict[str, Any] = Field(
        default_factory=dict, description="Further sglang.Engine keyword arguments, passed through unchanged."
    )

    @field_validator("candidate_steps")
    @classmethod
    def _check_steps(cls, steps: list[int]) -> list[int]:
        if any(s < 0 for s in steps) or len(set(steps)) != len(steps):
            raise ValueError(f"candidate_steps must be distinct non-negative integers, got {steps}")
        if 0 not in steps or max(steps) == 0:
            raise ValueError(f"candidate_steps must include 0 and at least one positive step count, got {steps}")
        return sorted(steps)

    @model_validator(mode="after")
    def _check(self) -> SGLangOptions:
        if self.initial_steps is not None and self.initial_steps not in self.candidate_steps:
            raise ValueError(f"initial_steps {self.initial_steps} is not one of candidate_steps {self.candidate_steps}")
        if self.adaptive_slots is not None:
            if self.step_policy != "adaptive":
                raise ValueError("adaptive_slots: only step_policy adaptive reads them")
            union = sorted({s for steps in self.adaptive_slots.values() for s in steps})
            if union != self.candidate_steps or min(self.adaptive_slots) < 1 or not all(self.adaptive_slots.values()):
                raise ValueError(f"adaptive_slots: batch sizes >= 1, each with steps, whose union is candidate_steps "
                                 f"{self.candidate_steps}; got {self.adaptive_slots}")
        for key, value in self.extra_server_args.items():
            if key in _OWNED:
                raise ValueError(f"extra_server_args.{key}: set by specserve; use the option of that name instead")
            if key in _REFUSED_EXTRA and not _is_off(value):
                raise ValueError(f"extra_server_args.{key}={value!r}: {_REFUSED_EXTRA[key]}")
        self._check_draft_context()
        return self

    def _check_draft_context(self) -> None:
        """SGLang gives the draft the target's context length and refuses to start when the
        draft's own is shorter (configs/model_config.py ``_derive_context_length``). Checked
        here, where both models are local folders, so the YAML fails before any GPU work."""
        draft = local_context_length(self.draft_model_path)
        target = self.context_length or local_context_length(self.model_path)
        if draft is None or target is None or target <= draft or self.draft_context_overwrite:
            return
        raise ValueError(
            f"the draft {self.draft_model_path} has a context of {draft} tokens and the target runs {target}: "
            f"SGLang refuses to start so. Set context_length: {draft} (or less), or draft_context_overwrite: true "
            "to let the draft run past its trained length (acceptance may fall on long contexts)"
        )

    @property
    def deterministic(self) -> bool:
        """SGLang honours a request's seed only with deterministic inference on."""
        return bool(self.extra_server_args.get("enable_deterministic_inference"))

    @property
    def start_steps(self) -> int:
        """The step count SGLang starts with (``speculative_num_steps``)."""
        return self.initial_steps if self.initial_steps is not None else max(self.candidate_steps)

    @property
    def max_num_steps(self) -> int:
        """The deepest step count the engine has loaded (AppArgs checks the policy against it)."""
        return max(self.candidate_steps)

    @property
    def num_draft_tokens(self) -> int:
        """``speculative_num_draft_tokens``: with topk 1 the draft is a chain, steps + 1 tokens
        (SGLang's adaptive mode derives the same value and overrides anything else)."""
        return self.start_steps + 1


# SGLang's CONTEXT_LENGTH_KEYS (srt/utils/hf_transformers/common.py), first found wins.
_CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def local_context_length(model_path: str) -> int | None:
    """The context length SGLang derives from a local model folder's config.json
    (``get_context_length``: the first context key, times a plain rope-scaling factor);
    None for a hub id or an unreadable config."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rope = config.get("rope_scaling") or {}
    factor = rope.get("factor", 1)
    if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        factor = 1
    for key in _CONTEXT_LENGTH_KEYS:
        if config.get(key) is not None:
            return int(factor * config[key])
    return 2048


def adaptive_config(opts: SGLangOptions) -> dict:
    """The ``--speculative-adaptive-config`` JSON. One batch-size slot ("1") holds every candidate,
    so SGLang captures CUDA graphs of every step count for every batch size: the controller,
    not the batch size, picks the step count. With ``step_policy: adaptive`` and
    ``adaptive_slots``, SGLang's own policy picks from each slot's steps (our policy still has
    every step captured at every batch size, since the ceiling may cap any slot's choice)."""
    if opts.step_policy == "adaptive" and opts.adaptive_slots:
        return {str(bs): {"candidate_steps": sorted(steps)} for bs, steps in sorted(opts.adaptive_slots.items())}
    return {"1": {"candidate_steps": list(opts.candidate_steps)}}


def write_adaptive_config(opts: SGLangOptions) -> Path:
    """Write the adaptive config where SGLang's scheduler processes can read it; content-addressed,
    so replicas on one node and restarts share one file and never see a half-written one."""
    text = json.dumps(adaptive_config(opts), sort_keys=True)
    folder = Path(opts.adaptive_config_dir or Path(tempfile.gettempdir()) / "specserve-sglang")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"adaptive-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    if not path.exists():
        tmp = folder / f".{path.name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def build_server_args(opts: SGLangOptions) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine(**kwargs)`` (names and types of sglang 0.5.23's
    ``ServerArgs``); writes the adaptive config file they point at."""
    args: dict[str, Any] = {
        "model_path": opts.model_path,
        "tp_size": opts.tp_size,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": opts.draft_model_path,
        "speculative_num_steps": opts.start_steps,
        "speculative_eagle_topk": opts.speculative_eagle_topk,
        "speculative_num_draft_tokens": opts.num_draft_tokens,
        "speculative_adaptive": True,
        "speculative_adaptive_config": str(write_adaptive_config(opts)),
        "enable_metrics": opts.enable_metrics,
        # Each streamed chunk carries only the new tokens and text (O(1) per step).
        "incremental_streaming_output": True,
    }
    optional = {
        "mem_fraction_static": opts.mem_fraction_static,
        "nccl_port": opts.nccl_port,
        "context_length": opts.context_length,
        "max_running_requests": opts.max_running_requests,
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    return {**args, **opts.extra_server_args}

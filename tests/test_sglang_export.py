"""The SGLang export: the converted draft, run the way SGLang's EAGLE-3 path runs it, drafts
what our head drafts; the target folder holds transformers' GGUF tensors; bad inputs fail clearly.

SGLang's model class is not imported: sglang is no CI dependency, and it cannot be imported
on a CPU machine anyway (its utils need orjson and more at import, its layers sgl_kernel,
a tensor-parallel group, a ForwardBatch and an attention backend). ``SGLangDraft`` restates
``LlamaForCausalLMEagle3`` and the EAGLE-3 worker from the sglang 0.5.23 source, each step
citing its lines (0.5.17's in brackets where they differ); the math is the same in both.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from serve_app.engines.embedded.eagle import EagleDrafter, load_head
from serve_app.engines.sglang.config import local_context_length
from serve_app.tools import export_sglang as export

EXPORT_PY = Path(export.__file__)
# LlamaForCausalLMEagle3's parameters with one layer and an untied head: llama_eagle3.py
# 145 (embed_tokens), 163 (fc), 67/82/86 (qkv_proj, mlp, hidden_norm; o_proj and the two layer
# norms from llama.py's LlamaDecoderLayer), 206 (norm), 309 (lm_head) [17: 137, 155, 59/74/78, 197, 298].
PARAMS = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight"} | {
    f"model.layers.0.{n}.weight" for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                             "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
                                             "hidden_norm")}


def sglang_load_weights(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``LlamaForCausalLMEagle3.load_weights`` (llama_eagle3.py 325-378 [17: 314-367]), with
    the tp=1 weight loaders of QKVParallelLinear (linear.py 1179-1183: q, k, v at row offsets
    0, q_size, q_size + kv_size [17: 1017-1021]) and MergedColumnParallelLinear (813: shard i
    at sum(output_sizes[:i]) [17: 655]). A name it cannot place is skipped silently, as there."""
    stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
               (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
    legacy = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
              "aux_norm_high": "fc_norm.2"}
    params, shards, hot = {}, {}, None
    for name, w in tensors.items():
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])  # d2t stores diffs between draft id and target id
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, shard in stacked:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)
            full = f"model.{name}" if name not in PARAMS else name
            if full in PARAMS:
                shards.setdefault(full, {})[shard] = w
            break
        else:
            full = name if name in PARAMS else f"model.{name}"
            if full in PARAMS:
                params[full] = w
    for full, parts in shards.items():
        params[full] = torch.cat([parts[s] for s in (("q", "k", "v") if "qkv" in full else (0, 1))])
    return params, hot


def rms_norm(x, weight, eps, residual=None):
    """``RMSNorm.forward_native`` (layernorm.py 828-877 [17: 644-692]): with a residual, add it
    first and return the sum as the new residual."""
    if residual is not None:
        x = x + residual
        residual = x
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return x if residual is None else (x, residual)


def rope(x, positions, theta, rotary_dim):
    """``RotaryEmbedding``: inv_freq and the cos/sin cache in float32 (rotary_embedding/base.py
    233-266 [17: 149-180]), applied neox-style (utils.py ``apply_rotary_emb`` 36-62)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.einsum("i,j -> ij", positions.float(), inv_freq)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SGLangDraft:
    """One request through SGLang's EAGLE-3 draft, fp32, read from the exported folder only."""

    def __init__(self, folder: Path, embed: torch.Tensor, tensors: dict | None = None):
        self.config = c = AutoConfig.from_pretrained(folder)  # SGLang reads configs through transformers
        self.w, self.hot = sglang_load_weights(tensors or load_file(folder / "model.safetensors"))
        self.w = {k: v.float() for k, v in self.w.items()}
        self.embed = embed  # the target's: eagle_worker_v2.py 356-363 [17: 288-295] set_embed (tie false, own lm_head)
        # llama.py LlamaAttention 196-203 (head_dim, rotary_dim, scaling) and rope from
        # rope_parameters (322-328) [17: 173-180, 294-300]
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
        rope_params = c.rope_parameters
        assert rope_params.get("rope_type", "default") == "default"  # factory.py 227 [17: 164]: plain RotaryEmbedding
        self.theta, self.eps = rope_params.get("rope_theta", 10000), c.rms_norm_eps
        self.k_cache, self.v_cache = [], []  # the draft's KV pool for this request, by position

    def capture(self, layer_inputs: torch.Tensor, num_target_layers: int) -> torch.Tensor:
        """The target's aux hidden states: eagle_config's layer ids (spec_aux_hidden_state.py
        187-196 [17: 84-94]) plus one (llama.py set_eagle3_layers_to_capture 929-941 [17: 885-897]),
        each the residual stream entering that layer (llama.py 485-492, layer_boundary/stage.py
        446-459 [17: llama.py 435-437 ``hidden_states + residual``]), in layer order, concatenated
        (aux_hidden_states.py pack_aux_hidden_states 97-102 [17: 55-58])."""
        ids = (getattr(self.config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        capture = [2, num_target_layers // 2, num_target_layers - 3] if ids is None else [i + 1 for i in ids]
        return torch.cat([layer_inputs[i] for i in range(num_target_layers) if i in capture], dim=-1)

    def forward(self, positions, input_ids, hidden_states):
        """``LlamaModel.forward`` (llama_eagle3.py 209-269 [17: 200-260]) of the one input layer
        (``LlamaDecoderLayer.forward`` 88-119 [17: 80-111]); returns (logits, aux hidden)."""
        w, c, p = self.w, self.config, "model.layers.0."
        embeds = F.embedding(input_ids, self.embed)
        if hidden_states.shape[-1] != embeds.shape[-1]:  # target features: project (238-247 [17: 229-238])
            hidden_states = hidden_states @ w["model.fc.weight"].T
        residual = hidden_states  # 99-102 [17: 91-94]: norms on each input, embeddings first
        hidden_states = rms_norm(hidden_states, w[p + "hidden_norm.weight"], self.eps)
        embeds = rms_norm(embeds, w[p + "input_layernorm.weight"], self.eps)
        hidden_states = torch.cat([embeds, hidden_states], dim=-1)
        # LlamaAttention (llama.py 243-247, 264-288 [17: 219-223, 240-264]): qkv, rope, attention, o_proj
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = (hidden_states @ w[p + "self_attn.qkv_proj.weight"].T).split([q_size, kv_size, kv_size], -1)
        q = rope(q.view(-1, self.heads, self.head_dim), positions, self.theta, self.head_dim)
        k = rope(k.view(-1, self.kv_heads, self.head_dim), positions, self.theta, self.head_dim)
        self.k_cache.append(k)
        self.v_cache.append(v.view(-1, self.kv_heads, self.head_dim))
        keys, values = torch.cat(self.k_cache), torch.cat(self.v_cache)  # positions 0 .. max(positions)
        group = self.heads // self.kv_heads  # query head h reads KV head h // group
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * self.head_dim**-0.5
        causal = torch.arange(len(keys))[None, :] <= positions[:, None]
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), values)
        hidden_states = attn.reshape(len(positions), -1) @ w[p + "self_attn.o_proj.weight"].T
        hidden_states, residual = rms_norm(hidden_states, w[p + "post_attention_layernorm.weight"], self.eps,
                                           residual)  # 114 [17: 106]
        gate_up = hidden_states @ w[p + "mlp.gate_up_proj.weight"].T  # LlamaMLP, SiluAndMul.forward_native
        d = gate_up.shape[-1] // 2  # (activation.py 141-143 [17: 138-140])
        hidden_states = (F.silu(gate_up[..., :d]) * gate_up[..., d:]) @ w[p + "mlp.down_proj.weight"].T
        to_logits, to_aux = rms_norm(hidden_states, w["model.norm.weight"], self.eps, residual)  # 263-268 [17: 254-259]
        assert not getattr(c, "norm_output", False)  # aux is the pre-norm sum
        return to_logits @ w["lm_head.weight"].T, to_aux  # logits_processor.py _compute_lm_head 1144 [17: 754]

    def draft(self, aux: torch.Tensor, token_ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
        """EAGLEWorkerV2 with topk 1: draft extend after the target's prefill, then decode steps."""
        n = len(aux)
        # input ids shifted left by one, the target's next token last (eagle_worker_v2.py 993-996 [17: 749-752])
        logits, hidden = self.forward(torch.arange(n), torch.tensor(token_ids[1:n + 1]), aux)
        logits, hidden = logits[-1:], hidden[-1:]  # CaptureHiddenMode.LAST: the last position
        position = n  # decode positions start at seq_lens (eagle_worker_common.py 357-360 [17: 303])
        out_logits, out_ids = [], []
        for step in range(steps):  # draft_forward 742-900 [17: 548-692]
            index = logits.max(-1).indices  # fast_topk, topk 1 (utils/common.py 3941-3944 [17: 3399-3402])
            token = self.hot[index]  # draft -> target ids (757-758, 897-898 [17: 560-561, 690-691])
            out_logits.append(logits[0])
            out_ids.append(int(token))
            if step + 1 < steps:
                logits, hidden = self.forward(torch.tensor([position]), token, hidden)
                position += 1  # forward_batch.positions.add_(1)
        return torch.stack(out_logits), out_ids


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    assert export.main(["--out", str(out), "--only", "draft"]) == 0
    return out / "draft"


def test_converted_draft_under_sglang_math_drafts_what_our_head_drafts(draft_dir):
    head, _ = load_head(export.HEAD)  # float32
    g = torch.Generator().manual_seed(0)
    num_layers, n, steps = 30, 13, 5  # SmolLM2-135M has 30 layers
    embed = torch.randn(head.config.target_vocab_size, head.config.hidden_size, generator=g) * 0.05
    layer_inputs = torch.randn(num_layers, n, head.config.hidden_size, generator=g) * 2
    tokens = torch.randint(0, head.config.target_vocab_size, (n + 1,), generator=g).tolist()

    sglang = SGLangDraft(draft_dir, embed)
    assert set(sglang.w) == PARAMS - {"model.embed_tokens.weight"} and sglang.hot is not None, "a weight SGLang skips"
    sg_logits, sg_ids = sglang.draft(sglang.capture(layer_inputs, num_layers), tokens, steps)

    # ours as the embedded engine runs it: features are the inputs of feature_layers
    # (model.py forward with taps), drafting is EagleDrafter.observe + propose
    ours_logits, logits = [], head.logits
    head.logits = lambda a: ours_logits.append(logits(a)) or ours_logits[-1]
    drafter = EagleDrafter(head, embed, max_num_seqs=1, capacity=64)
    drafter.observe(["r"], torch.cat([layer_inputs[i] for i in head.config.feature_layers], -1)[None], [n])
    ours_ids = drafter.propose(["r"], [tokens], steps)[0]

    assert sg_ids == ours_ids
    torch.testing.assert_close(sg_logits, torch.cat(ours_logits), rtol=1e-5, atol=1e-4)  # logits reach ~40

    # The comparison tells the two norms apart: SGLang with them swapped drafts differently.
    tensors = load_file(draft_dir / "model.safetensors")
    a, b = "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight"
    tensors[a], tensors[b] = tensors[b], tensors[a]
    swapped = SGLangDraft(draft_dir, embed, tensors)
    swapped_logits, _ = swapped.draft(swapped.capture(layer_inputs, num_layers), tokens, steps)
    assert (swapped_logits - sg_logits).abs().max() > 0.1


def test_draft_config_is_eagle3_of_the_heads_shape_and_bf16(draft_dir):
    config = json.loads((draft_dir / "config.json").read_text())
    info = json.loads(export.HEAD.with_suffix(".json").read_text())["config"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert (config["vocab_size"], config["draft_vocab_size"]) == (info["target_vocab_size"], info["draft_vocab_size"])
    assert config["tie_word_embeddings"] is False and config["dtype"] == "bfloat16"
    assert config["max_position_embeddings"] == export.DEFAULT_MAX_POSITIONS  # no target beside it
    tensors = load_file(draft_dir / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k != "d2t")
    head, _ = load_head(export.HEAD)
    assert torch.equal(tensors["d2t"] + torch.arange(len(tensors["d2t"])), head.d2t)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet, the 256 base tokens of a gpt2-model GGUF tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer Llama GGUF shaped like the shipped one (Q4_1 matrices, a Q8_0 embedding, F32
    norms, tied head, a gpt2 tokenizer with a chat template): the real one takes ~30 s to
    dequantize on a small CPU, this one under a second."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    rng = np.random.default_rng(0)
    d, layers, heads, kv_heads, ffn, head_dim = 64, 2, 4, 2, 128, 16
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode(), "he"]
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")

    def tensor(name, shape, kind):
        x = rng.standard_normal(shape, dtype=np.float32) * 0.1
        w.add_tensor(name, x) if kind == Q.F32 else w.add_tensor(name, quantize(x, kind), raw_dtype=kind)

    tensor("token_embd.weight", (len(tokens), d), Q.Q8_0)
    for i in range(layers):
        for name, shape, kind in [("attn_norm", (d,), Q.F32), ("ffn_norm", (d,), Q.F32),
                                  ("attn_q", (heads * head_dim, d), Q.Q4_1), ("attn_k", (kv_heads * head_dim, d), Q.Q4_1),
                                  ("attn_v", (kv_heads * head_dim, d), Q.Q4_1), ("attn_output", (d, d), Q.Q4_1),
                                  ("ffn_gate", (ffn, d), Q.Q4_1), ("ffn_up", (ffn, d), Q.Q4_1),
                                  ("ffn_down", (d, ffn), Q.Q4_1)]:
            tensor(f"blk.{i}.{name}.weight", shape, kind)
    tensor("output_norm.weight", (d,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_target_folder_holds_the_gguf_loaders_tensors_and_loads_without_gguf(tiny_gguf, tmp_path):
    assert export.main(["--out", str(tmp_path), "--gguf", str(tiny_gguf)]) == 0
    target = tmp_path / "target"
    ref = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
    got = load_file(target / "model.safetensors")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) and got[k].dtype == torch.bfloat16 for k in expected)

    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    # a plain Hugging Face folder: same logits as the GGUF model with the same bf16 weights
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 259]])
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16))
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    tokenizer, ref_tokenizer = AutoTokenizer.from_pretrained(target), AutoTokenizer.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = [{"role": "user", "content": "hello there"}]
    assert tokenizer.apply_chat_template(text, tokenize=False) == "<|im_start|>user\nhello there<|im_end|>\n"
    assert tokenizer("hello there").input_ids == ref_tokenizer("hello there").input_ids
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == 2
    # SGLang gives the draft the target's context length and refuses a draft with less
    assert local_context_length(str(tmp_path / "draft")) == local_context_length(str(target)) == 512


def test_file_runs_alone_without_pydantic_or_serve_app(draft_dir, tmp_path):
    """GPU nodes lack most of serve_app's dependencies: the file itself runs with torch and safetensors."""
    blocked = "import runpy, sys; sys.modules.update(pydantic=None, serve_app=None); " \
              f"sys.argv[0] = {str(EXPORT_PY)!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    run = subprocess.run([sys.executable, "-c", blocked, "--out", str(tmp_path), "--only", "draft"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "draft: 14 tensors" in run.stderr
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (tmp_path / "draft", draft_dir)]
    assert digest[0] == digest[1]


@pytest.mark.parametrize("case", ["missing head", "tampered head", "out is a file", "exists", "missing gguf"])
def test_bad_inputs_fail_with_one_clear_line(case, tmp_path, capsys):
    out, args = tmp_path / "out", ["--only", "draft"]
    if case == "missing head":
        args += ["--head", str(tmp_path / "none.safetensors")]
        message = f"no draft head file at {tmp_path / 'none.safetensors'}"
    elif case == "tampered head":
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(export.HEAD.read_bytes()[:-1] + b" ")
        bad.with_suffix(".json").write_text(export.HEAD.with_suffix(".json").read_text())
        args += ["--head", str(bad)]
        message = "does not match the sha256 in bad.json"
    elif case == "out is a file":
        out.write_text("")
        message = f"--out {out} is a file, not a folder"
    elif case == "exists":
        (out / "draft").mkdir(parents=True)
        message = f"{out / 'draft'} exists; pass --force to replace it"
    else:
        args = ["--only", "target", "--gguf", str(tmp_path / "none.gguf")]
        message = f"no GGUF file at {tmp_path / 'none.gguf'}"
    assert export.main(["--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.endswith(f"{message}\n") and err.count("\n") == 1, err
    assert not list(tmp_path.rglob("*.partial")), "a half-written folder was left behind"
    if case == "exists":
        assert export.main(["--out", str(out), "--only", "draft", "--force"]) == 0
        assert (out / "draft" / "model.safetensors").is_file()

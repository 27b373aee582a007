"""Train an EAGLE-style draft head for an embedded model by self-distillation.

    python -m serve_app.tools.train_draft_head --out serve_app/engines/embedded/heads/smollm2-135m-instruct.safetensors

1. Prompts: ``chat_prompts`` builds varied chat requests from templates and topics (no
   downloads); the benchmark's own chat prompts are left out.
2. Data: the target answers them greedily (its own outputs, so the head learns what the
   target will actually say); one more forward over prompt + answer records the fused
   features (inputs of the head's ``feature_layers``) and the target's argmax at every
   position, which are the labels.
3. Vocabulary: the ``--draft-vocab`` tokens the target outputs most often.
4. Training with training-time test (EAGLE-3): the head is unrolled ``--ttt-steps`` times on
   its own output features, each step attending to real positions up to its context and to
   its own earlier draft positions, exactly as drafting does at run time.

Phases are time-boxed (``--gen-seconds``, ``--train-seconds``) so one run fits a lease. One
file past 300 lines: the four phases of one command, in the order they run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from serve_app.engines.embedded.eagle import EagleHead, HeadConfig, save_head
from serve_app.engines.embedded.kv_cache import KVCache
from serve_app.engines.embedded.model import Llama
from serve_app.engines.embedded.weights import load_model

_TOPICS = """the water cycle|photosynthesis|black holes|the stock market|compound interest|climate change|the Roman Empire
|the printing press|electric cars|solar panels|how the internet works|machine learning|the human heart|sleep|coffee
|meditation|learning a new language|public speaking|time management|saving money|starting a small business
|writing a resume|remote work|healthy breakfast ideas|running a marathon|growing tomatoes|keeping houseplants alive
|training a puppy|adopting a cat|bees|volcanoes|earthquakes|the moon landing|the Renaissance|World War I
|the Industrial Revolution|democracy|the immune system|antibiotics|vitamins|recycling|plastic pollution|the ocean
|rainforests|deserts|the Great Wall of China|ancient Egypt|the Olympic Games|football|chess|jazz music
|classical music|learning to draw|photography|baking bread|making pasta|a budget travel plan|visiting Japan
|camping|hiking safety|first aid|stress at work|friendship|raising teenagers|online privacy|strong passwords
|cloud computing|databases|Python programming|JavaScript|version control with git|smartphones|batteries
|3D printing|robots|space exploration|Mars|the solar system|gravity|electricity|magnets|light and color
|sound waves|the theory of evolution|dinosaurs|DNA|nutrition|drinking enough water|exercise for beginners
|yoga|mental health|reading more books|writing poetry|a job interview|negotiating a salary|buying a house
|renting an apartment|car maintenance|bicycles|public transport|city planning|renewable energy|nuclear power
|wind turbines|weather forecasts|hurricanes|snow|the seasons|calendars|clocks|money and banks|credit scores
|inflation|taxes|insurance|voting|the United Nations|libraries|museums|board games|video games|social media
|artificial intelligence|self-driving cars|email etiquette|cooking rice|vegetarian meals|chocolate|tea
|wine tasting|cheese making|composting|birds|whales|elephants|wolves|spiders|butterflies""".replace("\n", "").split("|")

_TEMPLATES = """What is {t}?|Explain {t} in simple terms.|Can you tell me about {t}?|Why is {t} important?
|Give me three interesting facts about {t}.|How does {t} work?|What are the pros and cons of {t}?
|Write a short paragraph about {t}.|What should a beginner know about {t}?|Summarize the history of {t}.
|Write a short poem about {t}.|Write a short story that involves {t}.|What are common mistakes people make with {t}?
|Give me some tips about {t}.|How would you explain {t} to a child?|What is the future of {t}?
|List five questions someone might ask about {t}, with short answers.|Describe {t} in a few sentences.
|What are the main ideas behind {t}?|How can I learn more about {t}?|Compare {t} and {u}.
|What do {t} and {u} have in common?|Write a friendly email to a colleague about {t}.
|I am curious about {t}. Where should I start?|Is {t} a good topic for a school presentation? Suggest an outline.
|What is a surprising thing about {t}?|Give me a step-by-step guide related to {t}.
|Why do people disagree about {t}?|Write a haiku about {t}.|Explain {t} like I am five years old.""".replace(
    "\n", "").split("|")

_OPENERS = ["", "", "", "Hi! ", "Quick question: ", "Please help me. ", "I'm a student. ", "Hello, ",
            "I have always wondered about this. ", "In a few sentences, "]


def chat_prompts(n: int, seed: int = 0, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct chat requests built from templates, topics and openers."""
    rng = random.Random(seed)
    out, seen = [], set(exclude)
    while len(out) < n and len(seen) < 10 * n + len(exclude):
        t, u = rng.sample(_TOPICS, 2)
        p = rng.choice(_OPENERS) + rng.choice(_TEMPLATES).format(t=t, u=u)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


# -- data -----------------------------------------------------------------------------------
def messages(text: str, system: str | None) -> list[dict[str, str]]:
    """A one-turn chat: the user's ``text``, after ``system`` if one is given."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def eos_ids(loaded) -> set[int]:
    """The ids that end a turn: the model's and its tokenizer's."""
    tok = loaded.tokenizer
    return set(loaded.shape.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())


def pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Greedy at temperature 0, else a nucleus sample; logits [B, V] -> ids [B]."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    sp, si = probs.sort(-1, descending=True)
    sp[(sp.cumsum(-1) - sp) > top_p] = 0.0
    choice = torch.multinomial(sp, 1, generator=gen)
    return si.gather(-1, choice)[:, 0]


@torch.inference_mode()
def generate(model: Llama, prompts: list[list[int]], max_new: int, eos: set[int], batch: int,
             seconds: float = math.inf, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             log=None) -> list[tuple[list[int], list[int]]]:
    """Answers (cut after the first eos), batched, greedy unless ``temperature``; stops starting
    batches after ``seconds``. A row that reaches ``max_new`` without eos is kept as it is."""
    s, dev, t0 = model.shape, model.device, time.monotonic()
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    out = []
    for b0 in range(0, len(prompts), batch):
        if time.monotonic() - t0 > seconds:
            break
        chunk = prompts[b0:b0 + batch]
        B, width = len(chunk), max(map(len, chunk))
        cache = KVCache(s.num_layers, B, s.num_kv_heads, width + max_new + 1, s.head_dim, dev, model.dtype)
        tokens = torch.zeros((B, width), dtype=torch.long)
        for r, ids in enumerate(chunk):
            tokens[r, :len(ids)] = torch.tensor(ids)
        lens = torch.tensor([len(ids) for ids in chunk], device=dev)
        logits, _ = model.forward(tokens.to(dev), torch.zeros_like(lens), cache, logit_index=(lens - 1)[:, None])
        nxt = pick(logits[:, 0], temperature, top_p, gen)
        answers = [nxt]
        eos_t = torch.tensor(sorted(eos), device=dev)
        done = torch.isin(nxt, eos_t)
        for _ in range(max_new - 1):
            if bool(done.all()):
                break
            logits, _ = model.forward(nxt[:, None], lens, cache)
            lens = lens + 1
            nxt = pick(logits[:, 0], temperature, top_p, gen)
            answers.append(nxt)
            done |= torch.isin(nxt, eos_t)
        ans = torch.stack(answers, 1).tolist()
        for ids, a in zip(chunk, ans, strict=True):
            cut = next((i + 1 for i, t in enumerate(a) if t in eos), len(a))
            out.append((ids, a[:cut]))
        if log:
            log(f"generate: {len(out)}/{len(prompts)} in {time.monotonic() - t0:.0f}s")
    return out


def magpie_prompts(model: Llama, tok, n: int, system_prompts: list[str | None], eos: set[int], *, batch: int,
                   temperature: float = 1.0, top_p: float = 0.95, max_new: int = 64, seed: int = 0,
                   exclude: set[str] = frozenset(), seconds: float = math.inf, log=None) -> list[str]:
    """User requests written by the target itself (Magpie, Xu et al. 2024): render the chat
    template up to the start of a user turn and sample what follows until the turn ends.
    Kept: turns that end within ``max_new`` tokens, of 3 to 80 words, not seen before. Stops
    after ``seconds`` or 20 samples per request asked for, whichever comes first."""
    marker = "\u2063"  # a character no template emits: the user turn is cut where it stands
    prefixes = []
    for system in system_prompts:
        text = tok.apply_chat_template(messages(marker, system), tokenize=False, add_generation_prompt=False)
        prefixes.append(tok(text[:text.index(marker)], add_special_tokens=False).input_ids)
    out, seen, t0, round_ = [], {p.strip().lower() for p in exclude}, time.monotonic(), 0
    while len(out) < n and time.monotonic() - t0 < seconds and round_ * batch < 20 * n:
        ids = [prefixes[(round_ * batch + i) % len(prefixes)] for i in range(batch)]
        for _, turn in generate(model, ids, max_new, eos, batch, temperature=temperature, top_p=top_p,
                                seed=seed + round_):
            if not turn or turn[-1] not in eos:
                continue
            text = tok.decode(turn[:-1], skip_special_tokens=True).strip()
            key = " ".join(text.lower().split())
            if 3 <= len(text.split()) <= 80 and key not in seen:
                seen.add(key)
                out.append(text)
        round_ += 1
        if log:
            log(f"magpie: {len(out)}/{n} distinct requests after {round_ * batch} samples, "
                f"{time.monotonic() - t0:.0f}s")
    return out[:n]


@torch.inference_mode()
def extract(model: Llama, samples: list[tuple[list[int], list[int]]], taps: tuple[int, ...], batch: int,
            store_dtype=torch.bfloat16) -> list[dict]:
    """Per sample: tokens, the target's features and argmax at every position, prompt length."""
    s, dev = model.shape, model.device
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]) + len(samples[i][1]))
    rows: list[dict | None] = [None] * len(samples)
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        seqs = [samples[i][0] + samples[i][1] for i in idx]
        width = max(map(len, seqs))
        cache = KVCache(s.num_layers, len(seqs), s.num_kv_heads, width, s.head_dim, dev, model.dtype)
        tokens = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, ids in enumerate(seqs):
            tokens[r, :len(ids)] = torch.tensor(ids)
        logits, feats = model.forward(tokens.to(dev), torch.zeros(len(seqs), dtype=torch.long, device=dev), cache,
                                      taps=taps)
        amax = logits.argmax(-1)
        for r, i in enumerate(idx):
            n = len(seqs[r])
            rows[i] = {"tokens": tokens[r, :n].to(dev), "feats": feats[r, :n].to(store_dtype),
                       "argmax": amax[r, :n], "prompt_len": len(samples[i][0])}
    return rows


def draft_vocab(rows: list[dict], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent target outputs (sorted ids) and their coverage of answer positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["argmax"][r["prompt_len"] - 1:-1].cpu(), minlength=vocab_size)
    top = counts.topk(min(size, vocab_size)).indices.sort().values
    return top, float(counts[top].sum() / counts.sum().clamp(min=1))


# -- training -------------------------------------------------------------------------------
def ttt_mask(T: int, j: int, device) -> torch.Tensor:
    """Step j's queries [T] over the keys of steps 0..j [(j+1)T]: real context up to i - j,
    then the draft position of each earlier step on the same chain."""
    i = torch.arange(T, device=device)[:, None]
    m = torch.arange(T, device=device)[None, :]
    blocks = [m <= i - j] + [m == i - j + s for s in range(1, j + 1)]
    return torch.cat(blocks, dim=1)


def make_batch(rows: list[dict], t2d: torch.Tensor, device):
    """Head inputs for a batch: index i reads feature i and token i + 1, predicts argmax i + 1."""
    T = max(len(r["tokens"]) for r in rows) - 1
    B, D = len(rows), rows[0]["feats"].shape[-1]
    feats = torch.zeros((B, T, D), device=device, dtype=rows[0]["feats"].dtype)
    tokens = torch.zeros((B, T), dtype=torch.long, device=device)
    labels = torch.full((B, T), -1, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        n = len(r["tokens"]) - 1
        feats[b, :n] = r["feats"][:n]
        tokens[b, :n] = r["tokens"][1:]
        lab = t2d[r["argmax"][1:n + 1]]
        lab[:max(r["prompt_len"] - 2, 0)] = -1  # learn the answer, not the prompt
        lab[n - 1:] = -1  # the last argmax has no next token in the data
        labels[b, :n] = lab
    return feats, tokens, labels


def head_loss(head: EagleHead, embed: torch.Tensor, feats, tokens, labels, steps: int, weight: float = 0.8):
    """Training-time test: unroll ``steps`` drafting steps; (loss, per-step correct [steps, B, T], valid)."""
    B, T = tokens.shape
    dev = tokens.device
    cos, sin = head.rope(torch.arange(T, device=dev), torch.float32)
    e = F.embedding(tokens, embed)
    g = head.fc(feats.to(torch.float32) if feats.dtype != torch.float32 else feats)
    keys, values, loss, correct = [], [], 0.0, []
    valid, a = labels >= 0, g
    for j in range(steps):
        if j:
            g = torch.cat([torch.zeros_like(a[:, :1]), a[:, :-1]], dim=1)
        q, k, v = head.qkv_proj(g, e, cos, sin)
        keys.append(k)
        values.append(v)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                                              torch.cat(values, 1).transpose(1, 2),
                                              attn_mask=ttt_mask(T, j, dev), enable_gqa=True)
        a = head.finish(g, attn)
        logits = head.logits(a).float()
        ok = valid.clone()
        ok[:, :j] = False
        loss = loss + weight ** j * F.cross_entropy(logits[ok], labels[ok])
        correct.append((logits.argmax(-1) == labels) & ok)
    return loss, torch.stack(correct), valid


def accepted_per_verify(correct: torch.Tensor, valid: torch.Tensor, k: int) -> float:
    """Mean accepted drafts of k (consecutive correct steps from each real context end c)."""
    steps, B, T = correct.shape
    k = min(k, steps)
    total, run = torch.zeros(B, T - k + 1, device=correct.device), torch.ones(B, T - k + 1, device=correct.device)
    for j in range(k):
        run = run * correct[j, :, j:T - k + 1 + j]
        total += run
    ctx = valid[:, :T - k + 1]
    return float(total[ctx].mean()) if ctx.any() else 0.0


def train(head: EagleHead, embed: torch.Tensor, rows: list[dict], val: list[dict], t2d: torch.Tensor, *,
          steps: int, batch: int, lr: float, seconds: float, max_updates: int = 100_000, log=print) -> dict:
    dev = embed.device
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu",
                                                                                                     enabled=False)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["tokens"]))
    batches = [make_batch([rows[i] for i in order[b:b + batch]], t2d, dev) for b in range(0, len(order), batch)]
    t0, update, total = time.monotonic(), 0, max_updates
    rng = random.Random(0)
    history = []
    while update < total:
        rng.shuffle(batches)
        for b in batches:
            if update >= total:
                break
            lr_now = lr * min(1.0, (update + 1) / 50) * 0.5 * (1 + math.cos(math.pi * update / total))
            for group in opt.param_groups:
                group["lr"] = lr_now
            with autocast:
                loss, _, _ = head_loss(head, embed, *b, steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            update += 1
            if update == 10:
                t_mark, mark = time.monotonic(), 10
            if update in (40, 200, 1000, 2000):  # fit the cosine schedule into the time box; the first
                now = time.monotonic()  # updates run slow, so the rate is re-read over the latest stretch
                per, t_mark, mark = (now - t_mark) / (update - mark), now, update
                total = max(update + 1, min(max_updates, update + int((seconds - (now - t0)) / per)))
                log(f"train: {per * 1000:.0f} ms/update, {total} updates planned")
            if update % 500 == 0:
                log(f"train: update {update}/{total} loss {loss.item():.3f} {time.monotonic() - t0:.0f}s")
                history.append((update, round(loss.item(), 4)))
    return {"updates": update, "seconds": round(time.monotonic() - t0, 1), "loss_history": history} | evaluate(
        head, embed, val, t2d, steps, batch)


@torch.inference_mode()
def evaluate(head: EagleHead, embed, rows: list[dict], t2d, steps: int, batch: int) -> dict:
    if not rows:
        return {}
    corrects, valids, acc = [], [], []
    for i in range(0, len(rows), batch):
        _, correct, valid = head_loss(head, embed, *make_batch(rows[i:i + batch], t2d, embed.device), steps)
        acc.append([float(correct[j].sum() / (valid[:, j:].sum()).clamp(min=1)) for j in range(steps)])
        corrects.append(correct)
        valids.append(valid)
    per_step = [round(sum(a[j] for a in acc) / len(acc), 4) for j in range(steps)]
    apv = {k: round(sum(accepted_per_verify(c, v, k) for c, v in zip(corrects, valids, strict=True)) / len(corrects), 3)
           for k in range(1, steps + 1)}
    return {"val_step_accuracy": per_step, "val_accepted_per_verify": apv}


def render(tok, text: str, system: str | None) -> list[int]:
    return tok(tok.apply_chat_template(messages(text, system), tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids


def bench_chat_eval(model: Llama, head: EagleHead, tok, loaded, t2d, steps: int, system: str,
                    prompts: list[str], max_new: int = 128) -> dict:
    """The head on the engine benchmark's chat prompts (never trained on): the target's greedy
    answers, then the same training-time-test measure as validation."""
    eos = eos_ids(loaded)
    samples = generate(model, [render(tok, p, system) for p in prompts], max_new, eos, len(prompts))
    rows = extract(model, samples, head.config.feature_layers, batch=len(prompts))
    return evaluate(head, model.embed, rows, t2d, steps, len(rows))


def build_head(model: Llama, vocab: torch.Tensor) -> EagleHead:
    head = EagleHead(HeadConfig.for_target(model.shape, len(vocab))).to(model.device)
    with torch.no_grad():
        head.d2t.copy_(vocab.to(model.device))
        head.lm_head.weight.copy_(model.lm_head[head.d2t].float())
    return head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="engine model name or path")
    p.add_argument("--out", required=True, help="the head's .safetensors (a .json is written beside it)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-prompts", type=int, default=12000)
    p.add_argument("--magpie-fraction", type=float, default=0.8,
                   help="share of the prompts the target writes itself (Magpie); the rest from templates")
    p.add_argument("--magpie-batch", type=int, default=1024)
    p.add_argument("--magpie-temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=384)
    p.add_argument("--gen-seconds", type=float, default=200, help="stop starting new generation batches after this")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-seconds", type=float, default=180)
    p.add_argument("--max-updates", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny-layers", type=int, default=2)
    p.add_argument("--save-samples", default=None, help="also save the generated (prompt, answer) ids here (.pt)")
    p.add_argument("--samples-only", action="store_true", help="stop after saving the samples (--save-samples)")
    p.add_argument("--samples", default=None, help="train on samples saved by --save-samples instead of generating")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    t_start = time.monotonic()
    loaded = load_model(a.model, tiny_layers=a.tiny_layers, seed=a.seed)
    dev = torch.device(a.device)
    model = Llama(loaded.shape, loaded.state_dict, dev, torch.float32)
    tok = loaded.tokenizer
    from serve_app.tools.bench.prompts import CHAT_PROMPTS, SYSTEM_PROMPT

    log = lambda m: print(m, flush=True)  # noqa: E731
    n_magpie = 0
    t0 = time.monotonic()
    if a.samples:
        saved = torch.load(a.samples)
        flat = saved["ids"].split(saved["lengths"].tolist())
        samples = [(flat[i].tolist(), flat[i + 1].tolist()) for i in range(0, len(flat), 2)]
        n_magpie = int(saved.get("magpie", 0))
    else:
        eos = eos_ids(loaded)
        n_magpie = round(a.num_prompts * a.magpie_fraction)
        texts = magpie_prompts(model, tok, n_magpie, [SYSTEM_PROMPT, None], eos, batch=a.magpie_batch,
                               temperature=a.magpie_temperature, seed=a.seed, exclude=set(CHAT_PROMPTS),
                               seconds=a.gen_seconds / 4, log=log) if n_magpie else []
        n_magpie = len(texts)
        texts += chat_prompts(a.num_prompts - n_magpie, a.seed, exclude=set(CHAT_PROMPTS) | set(texts))
        random.Random(a.seed).shuffle(texts)
        ids = [render(tok, t, SYSTEM_PROMPT if i % 4 else None) for i, t in enumerate(texts)]
        samples = generate(model, ids, a.max_new_tokens, eos, a.gen_batch, a.gen_seconds, log=log)
    gen_s = time.monotonic() - t0
    n_answer = sum(len(s[1]) for s in samples)
    print(f"generated {len(samples)} answers, {n_answer} tokens in {gen_s:.0f}s", flush=True)
    if a.save_samples:
        flat = [torch.tensor(x, dtype=torch.int32) for s in samples for x in s]
        torch.save({"ids": torch.cat(flat), "lengths": torch.tensor([len(x) for x in flat]),
                    "magpie": n_magpie}, a.save_samples)
        print(f"wrote {a.save_samples}", flush=True)
    if a.samples_only:
        return 0
    head_cfg = HeadConfig.for_target(loaded.shape, a.draft_vocab)
    t0 = time.monotonic()
    rows = extract(model, samples, head_cfg.feature_layers, batch=64)
    print(f"features in {time.monotonic() - t0:.0f}s", flush=True)
    rng = random.Random(a.seed)
    rng.shuffle(rows)
    n_val = max(1, len(rows) // 40)
    val, rows = rows[:n_val], rows[n_val:]
    vocab, coverage = draft_vocab(rows, a.draft_vocab, loaded.shape.vocab_size)
    val_cov = {}
    for size in (2048, 4096, 8192, 16384, 32768):
        val_cov[size] = round(draft_vocab(rows, size, loaded.shape.vocab_size)[1], 4)
    print(f"draft vocab {len(vocab)}: covers {coverage:.4f} of answer tokens; by size {val_cov}", flush=True)
    t2d = torch.full((loaded.shape.vocab_size,), -1, dtype=torch.long, device=dev)
    t2d[vocab.to(dev)] = torch.arange(len(vocab), device=dev)
    head = build_head(model, vocab)
    torch.backends.cuda.matmul.allow_tf32 = True  # the features are taken: train fast
    result = train(head, model.embed, rows, val, t2d, steps=a.ttt_steps, batch=a.batch, lr=a.lr,
                   seconds=a.train_seconds, max_updates=a.max_updates, log=lambda m: print(m, flush=True))
    result["bench_chat"] = bench_chat_eval(model, head, tok, loaded, t2d, a.ttt_steps, SYSTEM_PROMPT, CHAT_PROMPTS)
    print(json.dumps({k: v for k, v in result.items() if k != "loss_history"}), flush=True)
    meta = {
        "target": a.model,
        "data": {"prompts": len(samples), "answer_tokens": n_answer, "max_new_tokens": a.max_new_tokens,
                 "prompt_generator": "train_draft_head.magpie_prompts + chat_prompts",
                 "magpie_requests_written": n_magpie, "seed": a.seed,
                 "samples_file": a.samples, "validation_sequences": len(val), "draft_vocab_coverage": round(coverage, 4),
                 "coverage_by_vocab_size": val_cov},
        "training": {"ttt_steps": a.ttt_steps, "batch": a.batch, "lr": a.lr} | result,
        "hardware": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "seconds": {"generate": round(gen_s, 1), "total": round(time.monotonic() - t_start, 1)},
        "command": " ".join(["python -m serve_app.tools.train_draft_head", *(argv or sys.argv[1:])]),
    }
    save_head(head, Path(a.out), meta)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What happens to the target's logits between the forward pass and the choice of a token.

Two things, both position by position inside a verified draft, so that speculation changes
nothing:

- ``LogitsState``: a request's penalties (presence, frequency, repetition) and logit bias. At
  position i of a verify step the output so far is the request's output plus draft[:i], which
  is exactly what plain decoding would have produced there if the draft is accepted up to i.
  So position i is penalised with those counts, by the same element-wise arithmetic a plain
  step uses, and a greedy penalised request emits the same tokens with speculation on or off.
- ``Logprobs``: log-probabilities of the emitted tokens and the most likely alternatives, from
  the logits as the model gives them (before temperature, penalties and bias: vLLM's "raw"
  logprobs). With speculation on they come from the verify pass, which computes each position
  as a plain step does.
"""

from __future__ import annotations

import torch

from ..base import Logprob, SamplingParams


class LogitsState:
    """One request's penalties and bias, with the counts of its output tokens so far."""

    __slots__ = ("params", "counts", "seen", "bias_ids", "bias_values")

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.params = params
        self.counts = torch.zeros(vocab_size)  # output tokens so far, by id
        self.seen = None  # the prompt's tokens, for the repetition penalty
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    def append(self, tokens: list[int]) -> None:
        """Count output tokens (called as they are emitted)."""
        for t in tokens:
            self.counts[t] += 1

    def apply(self, logits: torch.Tensor, draft: list[int]) -> None:
        """Penalise and bias ``logits`` [n, V] in place: row i follows the output plus draft[:i]."""
        p = self.params
        n = logits.shape[0]
        counts = self.counts.expand(n, -1)
        if n > 1:
            counts = counts.clone()
            for i, t in enumerate(draft[:n - 1]):
                counts[i + 1:, t] += 1
        if self.bias_ids is not None:
            logits[:, self.bias_ids] += self.bias_values
        if self.seen is not None:
            hit = self.seen | (counts > 0)
            rp = p.repetition_penalty
            logits.copy_(torch.where(hit, torch.where(logits > 0, logits / rp, logits * rp), logits))
        if p.frequency_penalty or p.presence_penalty:
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


class Logprobs:
    """Turns rows of logits into :class:`Logprob` entries, with each token's text and bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        if self._byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text alone and its bytes (cached)."""
        got = self._pieces.get(token_id)
        if got is None:
            raw = None
            if self._byte_level:
                name = self.tokenizer.convert_ids_to_tokens(token_id)
                if name is not None and all(c in self._byte_of for c in name):
                    raw = bytes(self._byte_of[c] for c in name)
            text = self.tokenizer.decode([token_id])
            got = (text, list(raw if raw is not None else text.encode("utf-8")))
            self._pieces[token_id] = got
        return got

    def entry(self, token_id: int, logprob: float | None, top: list[Logprob] | None = None) -> Logprob:
        text, raw = self.piece(token_id)
        return Logprob(token_id, text, raw, logprob, top or [])

    def entries(self, logits: torch.Tensor, tokens: list[int], k: int) -> list[Logprob]:
        """The logprob of ``tokens[i]`` under row i of ``logits`` [>= len(tokens), V], each with
        the ``k`` most likely tokens of its row."""
        if not tokens:
            return []
        lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
        tops: list[list[Logprob]] = [[] for _ in tokens]
        if k > 0:
            values, ids = lp.topk(k, dim=-1)
            tops = [[self.entry(i, v) for i, v in zip(row_ids, row_values, strict=True)]
                    for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
        return [self.entry(t, c, top) for t, c, top in zip(tokens, chosen, tops, strict=True)]

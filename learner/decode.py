"""One decoder for the learner's torch model: greedy or sampled, on the model's KV cache.

Pretraining's sample report, the held-out replay (learner.eval) and the learning benchmark
(ops/bench/learn.py) all decode with `decode`, so a completion means the same everywhere:

    prefill   the prompt in one forward into a fresh `KVCache` (logits of the last position only)
    step      each new token is one forward of one position against the cache
    choose    greedy: the logits' argmax; sampled: softmax(logprobs / temperature), drawn from
              `generator`; either way the raw logprob of the token is kept, as the replica
              records it (the learner's behaviour policy)
    stop      at one of `stop_ids`, the model's EOS tokens (learner.formats; kept as the last
              token: it is the "stop here" action the RL loss trains), at a `stop` string (the text is cut before it, as vLLM returns
              it; its tokens stay), or after `max_tokens` ("length")
    window    the context keeps its last max_seq_len tokens: once the cache is full, the last
              window is prefilled afresh, which is what a forward without cache over it computes

`room` is how a replica clamps `max_tokens` to the window; the replay and the benchmark use it
so they never reach the sliding case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from learner.model import KVCache, Transformer, WeightHook


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # the tokens generated: the stop string's included, the EOS token last when it ended there
    logprobs: list[float]  # the model's logprob of each (before temperature)
    text: str  # as served: decoded without the EOS token, cut before the stop string
    finish: str  # stop | length
    stop_token: int | None = None  # the EOS token it ended on (the last of `ids`), if any

    @property
    def content_ids(self) -> list[int]:
        """The tokens without a final EOS token: what the text was decoded from."""
        return self.ids[:-1] if self.stop_token is not None else self.ids


def room(window: int, prompt_tokens: int, max_tokens: int) -> int:
    """`max_tokens` clamped to what the window leaves after the prompt, and at least 1, as a
    replica clamps a request's."""
    return max(1, min(max_tokens, window - prompt_tokens))


@torch.no_grad()
def decode(
    model: Transformer,
    tok: Tokenizer,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    stop_ids: Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop: str | Sequence[str] | None = None,
    fp4: WeightHook | None = None,
) -> Completion:
    """A completion of `prompt_ids` of at most `max_tokens` tokens (see the module docstring).
    `stop_ids`: the model's EOS tokens (ModelFormat.eos_ids); `stop`: one stop string or several;
    `temperature` 0: greedy; `fp4`: the model's weight hook (the QAT view of the weights)."""
    stops = frozenset(stop_ids)
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    window = model.args.max_seq_len
    device = next(model.parameters()).device
    context = list(prompt_ids)

    def prefill() -> tuple[KVCache, torch.Tensor]:
        cache = KVCache()
        ids_BS = torch.tensor([context[-window:]], device=device)
        return cache, model(ids_BS, cache=cache, logits_to_keep=1, fp4=fp4)[0, -1]

    cache, logits_V = prefill()
    out: list[int] = []
    logprobs: list[float] = []
    finish = "length"
    while len(out) < max_tokens:
        logp_V = F.log_softmax(logits_V.float(), dim=-1)
        if temperature > 0:
            nxt = int(torch.multinomial((logp_V / temperature).softmax(-1), 1, generator=generator))
        else:
            nxt = int(logits_V.argmax())
        out.append(nxt)
        logprobs.append(float(logp_V[nxt]))
        if nxt in stops or (stop_strings and any(st in tok.decode(out) for st in stop_strings)):
            finish = "stop"
            break
        if len(out) == max_tokens:
            break
        context.append(nxt)
        if len(cache) == window:
            cache, logits_V = prefill()
        else:
            logits_V = model(torch.tensor([[nxt]], device=device), cache=cache, fp4=fp4)[0, -1]
    stop_token = out[-1] if out and out[-1] in stops else None
    text = tok.decode(out[:-1] if stop_token is not None else out)
    cuts = [i for st in stop_strings if (i := text.find(st)) >= 0]
    if cuts:  # the first stop string in the text ends it, as in vLLM
        text = text[: min(cuts)]
    return Completion(out, logprobs, text, finish, stop_token)

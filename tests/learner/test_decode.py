"""The decoder: on the KV cache it decodes what the forward without cache decodes (greedy and
sampled), past the window too, and it stops where serving stops."""

from __future__ import annotations

import random

import pytest
import torch

from learner.corpus import SourceFile
from learner.decode import decode, room
from learner.eval import prompt_builder, site_prompt
from learner.judge import cursor_sites
from learner.model import ModelArgs, Transformer
from learner.prompts import EDITOR_STOP
from learner.train.pretrain import fp4_hook

WINDOW = 128


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tok) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=WINDOW))
    m.init_weights(0.1)  # clear logit margins: greedy tokens do not hinge on rounding
    return m.eval()


@pytest.fixture(scope="module")
def prompts(tok, fmt) -> list[list[int]]:
    import inspect
    import textwrap

    files = [SourceFile("textwrap.py", inspect.getsource(textwrap))]
    builder = prompt_builder(tok, fmt, WINDOW)
    return [site_prompt(builder, s)[0] for s in cursor_sites(files, 4, random.Random(0))]


@pytest.fixture(scope="module")
def eos(fmt) -> tuple[int, ...]:
    return fmt.eos_ids


@torch.no_grad()
def reference(model, prompt, n, eos, *, fp4=None, temperature=0.0, generator=None):
    """Decoding with the forward without cache over the last max_seq_len tokens: (ids, logprobs)."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids[-model.args.max_seq_len :]]), fp4=fp4)[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        t = (
            int(torch.multinomial((lp / temperature).softmax(-1), 1, generator=generator))
            if temperature
            else int(logits.argmax())
        )
        out.append(t)
        lps.append(float(lp[t]))
        ids.append(t)
        if t in eos:
            break
    return out, lps


def test_greedy_on_the_cache_is_greedy_without_it(tok, model, prompts, eos):
    for hook in (None, fp4_hook("nvfp4")):
        for prompt in prompts:
            c = decode(model, tok, prompt, 16, stop_ids=eos, fp4=hook)
            want, want_lps = reference(model, prompt, 16, eos, fp4=hook)
            assert c.ids == want and c.finish == ("stop" if want[-1] in eos else "length")
            assert c.logprobs == pytest.approx(want_lps, abs=1e-4)
            assert c.text == tok.decode(c.content_ids)


def test_past_the_window_the_context_keeps_its_last_tokens(tok, model, prompts, eos):
    prompt = (prompts[0] * 3)[-(WINDOW - 4) :]  # full after 4 new tokens: the rest slide the window
    c = decode(model, tok, prompt, 24, stop_ids=eos)
    assert c.ids == reference(model, prompt, 24, eos)[0]
    long_prompt = prompts[1] * 4  # longer than the window itself
    assert len(long_prompt) > WINDOW
    assert decode(model, tok, long_prompt, 6, stop_ids=eos).ids == reference(model, long_prompt, 6, eos)[0]


def test_sampling_draws_what_the_replica_draws(tok, model, prompts, eos):
    for prompt in prompts[:2]:
        c = decode(model, tok, prompt, 12, stop_ids=eos, temperature=0.7, generator=torch.Generator().manual_seed(3))
        want, want_lps = reference(model, prompt, 12, eos, temperature=0.7, generator=torch.Generator().manual_seed(3))
        assert c.ids == want and c.logprobs == pytest.approx(want_lps, abs=1e-4)
        again = decode(
            model, tok, prompt, 12, stop_ids=eos, temperature=0.7, generator=torch.Generator().manual_seed(3)
        )
        assert again == c


def test_a_stop_string_ends_the_text_before_it(tok, model, prompts, eos):
    for prompt in prompts:
        free = decode(model, tok, prompt, 16, stop_ids=eos)
        text = tok.decode(free.content_ids)
        stop = next((text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip()), None)
        if stop is None:
            continue
        c = decode(model, tok, prompt, 16, stop_ids=eos, stop=stop)
        k = next(k for k in range(1, len(free.ids) + 1) if stop in tok.decode(free.ids[:k]))
        assert c.ids == free.ids[:k] and c.finish == "stop"  # the stop string's tokens are kept
        assert c.text == tok.decode(c.ids)[: tok.decode(c.ids).find(stop)] and stop not in c.text
    assert EDITOR_STOP not in decode(model, tok, prompts[0], 32, stop_ids=eos, stop=EDITOR_STOP).text


def test_several_stop_strings_end_the_text_at_the_first_one_written(tok, model, prompts, eos):
    for prompt in prompts:
        free = decode(model, tok, prompt, 16, stop_ids=eos)
        text = tok.decode(free.content_ids)
        pieces = [text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip()]
        if len(pieces) < 2:
            continue
        first, later = pieces[0], pieces[-1]
        never = "\x00never\x00"
        c = decode(model, tok, prompt, 16, stop_ids=eos, stop=(never, later, first))
        alone = [decode(model, tok, prompt, 16, stop_ids=eos, stop=s) for s in (first, later)]
        assert c == min(alone, key=lambda a: len(a.ids))  # whichever is written first, wherever it is listed


def test_end_of_text_is_the_last_token_and_no_text(tok):
    torch.manual_seed(0)
    abstains = Transformer(ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=WINDOW)).eval()
    with torch.no_grad():
        abstains.lm_head.weight.zero_()  # every logit 0: argmax is the lowest id, taken as the EOS token here
    c = decode(abstains, tok, [7, 8, 9], 8, stop_ids=(0,))
    assert (c.ids, c.content_ids, c.text, c.finish, c.stop_token) == ([0], [], "", "stop", 0)
    not_eos = decode(abstains, tok, [7, 8, 9], 3, stop_ids=(5,))  # id 0 is just a token when it is not an EOS
    assert not_eos.ids == [0, 0, 0] and not_eos.finish == "length" and not_eos.content_ids == [0, 0, 0]
    assert c.logprobs == pytest.approx([-torch.log(torch.tensor(float(tok.get_vocab_size()))).item()])


def test_room_clamps_max_tokens_to_the_window_as_a_replica_does():
    assert room(128, 100, 64) == 28 and room(128, 10, 64) == 64 and room(128, 128, 64) == 1

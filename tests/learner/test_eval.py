"""The held-out evaluation: the replay matches serving and the simulated editor, is deterministic,
and its stats are what the gate blocks on."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import textwrap
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from feedback.reward import reward
from learner import eval as E
from learner.corpus import SourceFile
from learner.decode import decode
from learner.fim import fim_prompt_ids
from learner.formats import own_format
from learner.judge import Site, judge
from learner.languages import LINE_STOP, editor_stops
from learner.model import ModelArgs, Transformer
from learner.tokenizer import EOS, train_tokenizer
from learner.train import gate as G
from learner.train.pretrain import fp4_hook
from serving.engine import Sample
from serving.http.completions import _tabby_request
from serving.replica import CompletionService
from serving.schemas import TabbyCompletionRequest
from serving.settings import ServeSettings

WINDOW = 128
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared machine: one thread is faster (see heldout_replay's `threads`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)], vocab_size=512)


@pytest.fixture(scope="module")
def fmt(tok):
    return own_format(tok, WINDOW)


@pytest.fixture(scope="module")
def eos(tok) -> int:
    return tok.token_to_id(EOS)


@pytest.fixture(scope="module")
def sites():
    import bisect
    import heapq

    files = [SourceFile(f"{m.__name__}.py", inspect.getsource(m)) for m in (bisect, heapq, textwrap)]
    return E.heldout_sites(files, 16, seed=0)


def random_model(tok) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=WINDOW))
    model.init_weights(0.1)  # clear logit margins: greedy tokens do not hinge on rounding
    return model.eval()


def scripted_model(tok, default: int, after: dict[int, int] | None = None) -> Transformer:
    """A model whose next token depends only on the current one: `after[t]` after token t,
    else `default`. Attention and expert outputs are zeroed, so the residual stream is the
    token's embedding, a one-hot of its class; lm_head maps each class to its next token."""
    after = after or {}
    model = random_model(tok)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            for expert in layer.mlp.experts:
                expert.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0
        head.zero_()
        head[default, 0] = 1.0
        for c, (t, nxt) in enumerate(after.items(), start=1):
            emb[t].zero_()
            emb[t, c] = 1.0
            head[nxt, c] = 1.0
    return model


def token_of(tok, text: str) -> int:
    ids = tok.encode(text).ids
    assert len(ids) == 1, ids
    return ids[0]


def failed(result: G.GateResult) -> set[str]:
    return {r.split(":", 1)[0] for r in result.reasons}


# --- the replay ----------------------------------------------------------------------------------------


def test_replay_counts_are_consistent_and_deterministic(tok, fmt, sites):
    model = random_model(tok).train()
    torch.set_num_threads(2)
    st = E.heldout_replay(model, tok, fmt, sites, max_tokens=MAX_TOKENS)
    assert model.training and torch.get_num_threads() == 2  # both restored
    torch.set_num_threads(1)
    assert st.n == len(st.results) == len(sites) == 16
    assert st.shown == sum(bool(r.text) for r in st.results) and st.accepted <= st.shown
    assert sum(st.outcomes.values()) == st.n
    assert st.reward_sum == pytest.approx(sum(r.reward for r in st.results))
    budget = ServeSettings().fitted_to(WINDOW).context_budget
    for site, r in zip(sites, st.results):
        assert r.prompt_tokens <= budget and r.prompt_tokens + r.tokens <= WINDOW and r.tokens <= MAX_TOKENS
        v = judge(r.text, site.truth)
        assert (r.verdict, r.accepted_chars) == (v.type, v.accepted_chars)
        assert r.reward == reward(E.editor_feedback(r.text, v))[0]
    assert st.length_capped == sum(r.finish == "length" for r in st.results if r.text)
    summary = st.summary()
    json.dumps(summary, allow_nan=False)
    assert summary["n"] == 16 and 0 <= summary["suggestion_rate"] <= 1

    again = E.heldout_replay(model, tok, fmt, sites, max_tokens=MAX_TOKENS)
    assert again.results == st.results
    assert G.check(again, st, online_reward_trend=None, kl=0.0).passed  # the same model passes its own gate


def test_replay_suggestions_are_the_decoders_greedy_middles(tok, fmt, sites):
    model = random_model(tok)
    st = E.heldout_replay(model, tok, fmt, sites[:4], max_tokens=MAX_TOKENS)
    builder = E.prompt_builder(tok, fmt, WINDOW)
    for site, r in zip(sites, st.results):
        stops = editor_stops(site.language, site.prefix)
        c = decode(model, tok, E.site_prompt(builder, site)[0], MAX_TOKENS, stop_ids=fmt.eos_ids, stop=stops)
        assert (r.text, r.tokens, r.finish) == (c.text, len(c.content_ids), c.finish)
        assert not any(s in r.text for s in stops)


def greedy_suggestions(model, tok, fmt, sites) -> list:
    """The decoder's greedy completion at each site, prompted as the replay prompts it."""
    builder = E.prompt_builder(tok, fmt, WINDOW)
    return [
        decode(
            model,
            tok,
            E.site_prompt(builder, site)[0],
            MAX_TOKENS,
            stop_ids=fmt.eos_ids,
            stop=editor_stops(site.language, site.prefix),
        )
        for site in sites
    ]


def test_the_confidence_gate_withholds_what_serving_would_and_counts_it(tok, fmt, sites):
    """min_confidence (model.min_confidence): a suggestion whose first token the model gave less
    probability is not shown, scored as the sink scores a withheld one; the rest are unchanged."""
    import math

    model = random_model(tok)
    open_ = E.heldout_replay(model, tok, fmt, sites, max_tokens=MAX_TOKENS)
    first = [math.exp(c.logprobs[0]) for c in greedy_suggestions(model, tok, fmt, sites)]
    threshold = sorted(first)[len(first) // 2]  # withholds about half of them
    gated = E.heldout_replay(model, tok, fmt, sites, max_tokens=MAX_TOKENS, min_confidence=threshold)
    hidden = [bool(o.text) and p < threshold for o, p in zip(open_.results, first)]
    assert 0 < sum(hidden) < len(sites) and gated.withheld == sum(hidden) == gated.summary()["withheld"]
    for o, g, h in zip(open_.results, gated.results, hidden):
        if h:
            assert (g.text, g.withheld, g.verdict, g.outcome, g.reward, g.exact) == (
                "",
                True,
                "none",
                "withheld",
                0.0,
                False,
            )
        else:
            assert g == o
    assert gated.shown == open_.shown - sum(hidden)
    # the gate only hides: the same stats from the replay without it (what `--gate-curve` reports)
    assert open_.gated(threshold).results == gated.results and open_.gated(0.0).results == open_.results


def test_a_versions_show_policy_withholds_in_the_replay_as_in_serving(tok, fmt, sites):
    """learner/show.py: the replay applies the version's policy after the gate, with serving's
    `withheld`; what it hides stays hidden at every gate threshold (`--gate-curve`)."""
    from learner.confidence import withheld
    from tests.helpers import logprob_policy

    model = random_model(tok)
    suggestions = greedy_suggestions(model, tok, fmt, sites)
    mean_lp = sorted(sum(c.logprobs) / len(c.logprobs) for c in suggestions if c.text)
    # a policy on the mean logprob alone, at its median: withholds about half
    policy = logprob_policy(
        mean=(0.0, mean_lp[len(mean_lp) // 2], 0.0, 0.0, 0.0),
        weights=(0.0, 5.0, 0.0, 0.0, 0.0),
        bias=0.0,
        threshold=0.5,
    )
    open_ = E.heldout_replay(model, tok, fmt, sites, max_tokens=MAX_TOKENS)
    shown = E.heldout_replay(model, tok, fmt, sites, max_tokens=MAX_TOKENS, show_policy=policy)
    hidden = [bool(c.text) and withheld(c.logprobs, 0.0, c.text, policy) for c in suggestions]
    assert 0 < sum(hidden) < len(sites) and shown.withheld == sum(hidden)
    assert [r.policy_withholds for r in shown.results] == hidden
    for o, r, h in zip(open_.results, shown.results, hidden):
        expected = ("", "withheld") if h else (o.text, o.outcome)
        assert (r.text, r.outcome) == expected
    assert shown.gated(0.0).results == shown.results  # the gate's threshold does not bring them back


def test_an_accepted_suggestion_earns_the_sinks_reward_for_an_edit(tok):
    assert reward(E.editor_feedback("foo(x)", judge("foo(x)", "foo(x)")))[0] == 0.75  # full accept, kept verbatim
    partial, parts = reward(E.editor_feedback("foo(y)", judge("foo(y)", "foo(x)")))  # the word `foo(` kept
    assert parts["outcome"] == "edit" and 0 < partial < 0.75
    assert reward(E.editor_feedback("bar", judge("bar", "foo")))[0] == -0.25
    assert reward(E.editor_feedback("", judge("", "foo")))[1]["outcome"] == "no_suggestion"


def test_an_always_abstaining_candidate_is_blocked_though_its_reward_is_higher(tok, fmt, eos, sites):
    at = token_of(tok, "@")
    stable = scripted_model(tok, at, {at: eos})  # suggests "@" everywhere: dismissed
    hacked = scripted_model(tok, eos)  # never suggests: reward 0 beats -0.25
    stable_stats, cand_stats = E.evaluate_candidate(hacked, stable, tok, fmt, sites, max_tokens=MAX_TOKENS)
    result = G.check(cand_stats, stable_stats, online_reward_trend=0.2, kl=0.01)
    assert stable_stats.suggestion_rate == 1.0 and stable_stats.outcomes == {"dismiss": 16}
    assert cand_stats.shown == 0 and cand_stats.outcomes == {"no_suggestion": 16} and cand_stats.mean_reward == 0.0
    assert cand_stats.mean_reward > stable_stats.mean_reward
    assert not result.passed and failed(result) == {"suggestion_rate"}
    assert result.metrics["candidate"]["suggestion_rate"] == 0.0


def test_a_candidate_that_repeats_one_token_is_blocked(tok, fmt, eos, sites):
    at = token_of(tok, "@")
    stable = scripted_model(tok, at, {at: eos})  # "@", then stop: 1 token
    stable_stats = E.heldout_replay(stable, tok, fmt, sites, max_tokens=MAX_TOKENS)
    assert stable_stats.mean_completion_tokens == 1.0
    repeats = scripted_model(tok, at)  # "@@@@@@@@" to max_tokens
    same_stable, cand_stats = E.evaluate_candidate(
        repeats, stable, tok, fmt, sites, max_tokens=MAX_TOKENS, stable_stats=stable_stats
    )
    result = G.check(cand_stats, same_stable, online_reward_trend=None, kl=0.01)
    assert same_stable is stable_stats
    assert cand_stats.length_capped == 16 and cand_stats.results[0].text == "@" * MAX_TOKENS
    assert not result.passed and failed(result) == {"completion_length"}


def test_replay_refuses_a_bad_max_tokens_and_clamps_to_the_window(tok, fmt, sites):
    with pytest.raises(ValueError, match="max_tokens"):
        E.heldout_replay(random_model(tok), tok, fmt, sites, max_tokens=0)
    st = E.heldout_replay(random_model(tok), tok, fmt, sites[:4], max_tokens=10 * WINDOW)  # the replica clamps it too
    assert all(r.prompt_tokens + r.tokens <= WINDOW for r in st.results)


def test_base_model_replay_against_itself_passes(tmp_path):
    """A (tiny) pretrained base against itself, in FP4 as served: identical stats, so the gate passes."""
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer
    from learner.train.pretrain import (
        ensure_base_model,
        find_base_model,
        load_master_weights,
        load_training_corpus,
        pretrain_section,
    )
    from tests.learner.train.learn_support import make_corpus, tiny_learn_settings

    s = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    ensure_base_model(s, Console(file=io.StringIO()))
    folder = find_base_model(s)
    model, _ = load_master_weights(folder)
    base_tok = load_tokenizer(folder / "tokenizer")
    base_fmt = read_format(folder / "hf")
    held = E.heldout_sites(load_training_corpus(pretrain_section(s)).heldout, 48)
    stable, cand = E.evaluate_candidate(
        model, model, base_tok, base_fmt, held, max_tokens=32, fp4_hook=fp4_hook("nvfp4")
    )
    result = G.check(cand, stable, online_reward_trend=None, kl=0.0)
    assert result.passed and cand.results == stable.results and cand.n == 48
    assert replace(cand, seconds=0.0, results=[]) == replace(stable, seconds=0.0, results=[])


# --- the replay prompts what serving prompts -----------------------------------------------------------


class _PromptRecorder:
    """An engine that records the completion prompts and cannot summarize, so serving falls back
    to truncating a long prefix, the replay's rule."""

    def __init__(self):
        self.prompts, self.specs = [], []

    async def generate(self, prompt_ids, spec, request_id):
        if request_id.startswith("sum-"):
            raise RuntimeError("no summaries here")
        self.prompts.append(list(prompt_ids))
        self.specs.append(spec)
        yield [Sample(index=0, token_ids=[], text="", finish_reason="stop")]

    async def abort(self, request_id):
        pass


def test_replay_prompts_equal_servings_for_editor_requests(tok, fmt, sites):
    cfg = ServeSettings().fitted_to(WINDOW)
    engine = _PromptRecorder()
    service = CompletionService(engine, tok, fmt, cfg, version=1)
    builder = E.prompt_builder(tok, fmt, WINDOW)
    short = Site("pkg/m.py", "python", "def f(x):\n    ret", "\n\nprint(f(1))\n", "urn x")
    for site in [short, *sites]:
        # The body ops.simulate sends, through serving's own request translation.
        body = TabbyCompletionRequest(
            language=site.language, segments={"prefix": site.prefix, "suffix": site.suffix, "filepath": site.path}
        )
        req = _tabby_request(SimpleNamespace(cfg=cfg), body, "c-1")
        # Each site's cursor follows code on its line: the suggestion is the rest of the line.
        assert req.spec.stop == editor_stops(site.language, site.prefix) == (LINE_STOP,)
        asyncio.run(service.complete(req))
        ids, truncated = E.site_prompt(builder, site)
        assert engine.prompts[-1] == ids, site.path
        assert engine.specs[-1].max_tokens == min(cfg.default_max_tokens, WINDOW - len(ids))
    assert E.site_prompt(builder, short) == (
        fim_prompt_ids(fmt, tok, short.prefix, short.suffix, path="pkg/m.py"),
        0,
    )
    assert any(E.site_prompt(builder, s)[1] > 0 for s in sites)  # long prefixes were truncated, and still matched


@pytest.mark.parametrize("window", [64, 128, 256, 1024, 2048, 8192])
def test_replay_budget_is_servings_fitted_to_the_models_window(tok, fmt, window):
    cfg = ServeSettings().fitted_to(window)
    builder = E.prompt_builder(tok, fmt, window)
    assert (builder.budget, builder.chunk_tokens) == (cfg.context_budget, cfg.summary_chunk_tokens)


# --- confidence intervals: hand-computed values --------------------------------------------------------


def test_wilson_interval_equals_the_hand_computed_one():
    # 10 of 50, z = 1.959964: p = 0.2, z²/n = 0.0768292, centre = (0.2 + 0.0384146) / 1.0768292 = 0.2214043,
    # half = 1.959964 * sqrt(0.2 * 0.8 / 50 + 3.841459 / 10000) / 1.0768292 = 0.1089668
    i = E.wilson(10, 50)
    assert (i.value, i.n, i.method) == (0.2, 50, "wilson")
    assert i.low == pytest.approx(0.2214043 - 0.1089668, abs=1e-6) and i.high == pytest.approx(0.3303711, abs=1e-6)
    # none of 20: the interval starts at 0 and does not collapse onto it (z² / (n + z²) = 0.1611)
    none = E.wilson(0, 20)
    assert none.low == 0.0 and none.high == pytest.approx(3.841459 / 23.841459, abs=1e-6)
    assert E.wilson(20, 20).high == 1.0 and E.wilson(20, 20).low == pytest.approx(1 - 3.841459 / 23.841459, abs=1e-6)
    assert E.wilson(0, 0) == E.Interval(None, None, None, 0, "wilson")
    with pytest.raises(ValueError, match="0 <= k <= n"):
        E.wilson(7, 6)


def _site(verdict: str) -> E.SiteResult:
    """A replayed site: accepted ("select"), dismissed, or nothing shown ("none")."""
    text = "" if verdict == "none" else "x"
    return E.SiteResult("f.py", text, 1, "stop", verdict, None, 1 if verdict == "select" else 0, verdict, 0.0, 8, 0)


def test_paired_accept_ratio_sees_a_version_that_withholds_only_dismissals():
    """Base shows 100 suggestions, 25 accepted; the new version withholds 10 it dismissed and
    shows the rest, the same. Pairing the sites, the new rate is above the base's in nearly every
    resample (p ~ 0); as two independent samples (25/100 against 25/90) nothing is shown."""
    from ops.rollout.stats import two_proportion_ztest

    base = [_site("select")] * 25 + [_site("dismiss")] * 75
    new = [_site("select")] * 25 + [_site("none")] * 10 + [_site("dismiss")] * 65
    r = E.paired_accept_ratio(base, new, rounds=2000)
    assert r.ratio == pytest.approx((25 / 90) / (25 / 100)) and r.rounds == 2000
    assert r.p < 0.01 and 1.0 <= r.low < r.ratio < r.high
    assert two_proportion_ztest(25, 100, 25, 90).p > 0.3
    assert E.paired_accept_ratio(base, new, rounds=2000) == r  # deterministic for a seed


def test_paired_accept_ratio_of_a_replay_against_itself_and_refusals():
    same = [_site("select")] * 10 + [_site("dismiss")] * 30 + [_site("none")] * 5
    r = E.paired_accept_ratio(same, same, rounds=500)
    assert r.ratio == 1.0 and r.low == r.high == 1.0 and r.p == 1.0  # never above itself
    # a worse version: it withholds accepted suggestions
    worse = [_site("none")] * 5 + [_site("select")] * 5 + [_site("dismiss")] * 30 + [_site("none")] * 5
    assert E.paired_accept_ratio(same, worse, rounds=500).p > 0.95
    assert E.paired_accept_ratio(same, [_site("none")] * 45).p is None  # nothing shown: no rate
    assert E.paired_accept_ratio([], []).ratio is None
    none_accepted = [_site("dismiss")] * 20
    r = E.paired_accept_ratio(none_accepted, [_site("select")] * 5 + [_site("dismiss")] * 15, rounds=500)
    assert r.ratio is None and r.p < 0.05  # no ratio to 0, but the test still sees the gain
    # a p of 0 is below the resamples' resolution, and says so
    assert E.PairedRatio(1.3, 1.1, 1.5, 0.0, 10_000).p_text() == "< 0.0001"
    assert E.PairedRatio(1.3, 1.1, 1.5, 0.0123, 10_000).p_text() == "0.0123"
    with pytest.raises(ValueError, match="the same sites: 45 against 3"):
        E.paired_accept_ratio(same, same[:3])


def test_t_interval_equals_the_hand_computed_one():
    # 1..10: mean 5.5, s = sqrt(82.5 / 9) = 3.0276504, s / sqrt(10) = 0.9574271, t(0.975, 9) = 2.2621572
    i = E.t_interval([float(x) for x in range(1, 11)])
    assert (i.value, i.n, i.method) == (5.5, 10, "t")
    assert i.low == pytest.approx(5.5 - 2.2621572 * 0.9574271, abs=1e-6)
    assert i.high == pytest.approx(5.5 + 2.2621572 * 0.9574271, abs=1e-6)
    assert E.t_interval([3.0]) == E.Interval(3.0, None, None, 1, "t")  # one value: no spread to go on
    assert E.t_interval([2.0, 2.0, 2.0]) == E.Interval(2.0, 2.0, 2.0, 3, "t")
    assert E.t_interval([]).value is None


@pytest.mark.parametrize(
    "df, expected",
    # two-sided 95% critical values of Student's t, as printed in statistical tables (6 decimals)
    [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (9, 2.262157), (29, 2.045230), (120, 1.979930)]
    + [(499, 1.964729), (1000, 1.962339), (5000, 1.960439)],
)
def test_t_quantile_matches_the_tables(df, expected):
    assert E.t_quantile(0.95, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_refuses_nonsense():
    with pytest.raises(ValueError):
        E.t_quantile(1.0, 5)
    with pytest.raises(ValueError):
        E.t_quantile(0.95, 0)


def test_replay_intervals_are_the_formulas_on_its_own_counts(tok, fmt, sites):
    st = E.heldout_replay(random_model(tok), tok, fmt, sites, max_tokens=MAX_TOKENS)
    iv = st.intervals()
    assert set(iv) == {
        "accept_rate",
        "accepted_chars_per_request",
        "suggestion_rate",
        "exact_match",
        "mean_reward",
        "latency_ms",
        "token_accuracy",
    }
    assert iv["token_accuracy"].n == 0 and iv["token_accuracy"].value is None  # not asked for
    assert iv["accept_rate"] == E.wilson(st.accepted, st.shown)
    assert iv["suggestion_rate"] == E.wilson(st.shown, st.n)
    assert iv["exact_match"] == E.wilson(st.exact, st.n)
    assert iv["accepted_chars_per_request"] == E.t_interval([r.accepted_chars for r in st.results])
    assert iv["mean_reward"].value == pytest.approx(st.mean_reward)
    assert iv["latency_ms"].n == st.n and 0 < iv["latency_ms"].low <= iv["latency_ms"].value <= iv["latency_ms"].high
    summary = st.summary()
    json.dumps(summary, allow_nan=False)
    assert summary["intervals"]["accept_rate"]["method"] == "wilson" and summary["confidence"] == 0.95
    # built from aggregates only (no per-site results): the means carry no bounds rather than wrong ones
    bare = replace(st, results=[])
    assert bare.intervals()["accepted_chars_per_request"].low is None
    assert bare.intervals()["accept_rate"] == iv["accept_rate"]


def test_token_accuracy_is_the_argmax_of_each_prefix_of_the_truth(tok, fmt, sites):
    model = random_model(tok)
    st = E.heldout_replay(model, tok, fmt, sites[:6], max_tokens=MAX_TOKENS, token_accuracy=True)
    builder = E.prompt_builder(tok, fmt, WINDOW)
    per_site = []
    for site, r in zip(sites[:6], st.results, strict=True):
        prompt, _ = E.site_prompt(builder, site)
        truth = tok.encode(site.truth, add_special_tokens=False).ids[: WINDOW - len(prompt)]
        # one forward per truth token, no cache: what the single teacher-forced forward must equal
        with torch.no_grad():
            hits = sum(
                int(model(torch.tensor([prompt + truth[:k]]))[0, -1].argmax()) == truth[k] for k in range(len(truth))
            )
        assert (r.truth_hits, r.truth_tokens) == (hits, len(truth))
        if truth:
            per_site.append(hits / len(truth))
    assert st.token_accuracy == pytest.approx(sum(per_site) / len(per_site))
    assert st.intervals()["token_accuracy"] == E.t_interval(per_site)
    # the rest of the replay is the same with or without it
    plain = E.heldout_replay(model, tok, fmt, sites[:6], max_tokens=MAX_TOKENS)
    assert [replace(r, truth_tokens=0, truth_hits=0) for r in st.results] == plain.results
    assert "token accuracy" in _table_text(E.report_table({"m": st}, title="t"))
    assert "token accuracy" not in _table_text(E.report_table({"m": plain}, title="t"))


def test_prefix_only_prompts_are_the_prefix_alone(tok, fmt, sites):
    plain = E.prefix_only(fmt)
    assert plain.fim is None and plain.eos_ids == fmt.eos_ids and plain.window == fmt.window
    builder = E.prompt_builder(tok, plain, WINDOW)
    fim_tokens = {fmt.fim.prefix, fmt.fim.suffix, fmt.fim.middle}
    for site in sites[:6]:
        prompt, _ = E.site_prompt(builder, site)
        assert not fim_tokens & set(prompt)
        assert tok.decode(prompt).endswith(site.prefix[-20:].lstrip()) or len(site.prefix) < 20


def _table_text(table) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    return out.getvalue()


def test_exact_match_is_the_rest_of_the_line():
    assert E.line_matches("urn x", "urn x") and E.line_matches("urn x\n    y = 1", "urn x")
    assert E.line_matches("urn x  ", "urn x")  # trailing whitespace aside
    assert not E.line_matches("urn", "urn x") and not E.line_matches("urn x + 1", "urn x")
    assert not E.line_matches("", "") and not E.line_matches("\nfoo", "")  # abstaining is no match


def test_replay_reports_each_site_as_it_goes(tok, fmt, sites):
    seen = []
    st = E.heldout_replay(random_model(tok), tok, fmt, sites[:5], max_tokens=MAX_TOKENS, progress=seen.append)
    assert seen == st.results and all(r.latency_s > 0 for r in seen)


def test_report_table_shows_each_metric_with_its_interval(tok, fmt, sites):
    st = E.heldout_replay(random_model(tok), tok, fmt, sites, max_tokens=MAX_TOKENS)
    out = io.StringIO()
    Console(file=out, width=200).print(E.report_table({"a": st, "b": st}, title="t"))
    text = out.getvalue()
    lo, hi = E.wilson(st.shown, st.n).low, E.wilson(st.shown, st.n).high
    assert f"{st.suggestion_rate:.1%} [{lo:.1%}, {hi:.1%}]" in text
    for label in ("accept rate", "accepted chars / request", "exact match", "latency", "95% confidence"):
        assert label in text

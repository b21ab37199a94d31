"""`flywheel eval`: a tiny base trained in the test, evaluated from the command line in each form
of --model, with the same numbers as the in-process replay; bad input is one line."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from learner import eval as E
from learner import store as S
from learner.export import load_hf
from learner.formats import read_format
from learner.tokenizer import load_tokenizer
from learner.train.eval_settings import EvalSettings
from learner.train.pretrain import ensure_base_model, find_base_model, load_training_corpus
from tests.helpers import flywheel
from tests.learner.train.learn_support import make_corpus, tiny_learn_settings

SITES = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(config file, settings, run folder) of a tiny base trained once for the module."""
    root = tmp_path_factory.mktemp("evalbase")
    learn = tiny_learn_settings(root, make_corpus(root / "corpus"), root / "cache")
    ensure_base_model(learn, Console(file=io.StringIO()))
    pretrain = learn.pretrain.model_dump(mode="json", exclude_none=True)
    lines = [f'cache_dir = "{root / "cache"}"', f'data_dir = "{root / "data"}"', "[pretrain]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in pretrain.items()]
    config = root / "flywheel.toml"
    config.write_text("\n".join(lines) + "\n")
    s = EvalSettings.load(config, [])
    return config, s, find_base_model(s)


def run_eval(base, tmp_path, *args: str):
    config = base[0]
    return flywheel("eval", "--config", str(config), "--sites", str(SITES), *args, tmp_path=tmp_path, timeout=300)


def test_eval_json_reports_the_in_process_replays_numbers_with_intervals(base, tmp_path):
    _, s, folder = base
    r = run_eval(base, tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # stdout is the JSON alone; progress went to stderr
    assert report["sites"] == SITES and report["seed"] == 0 and report["model"].startswith("base model")
    st = report["stats"]
    assert set(st["intervals"]) == {
        "accept_rate",
        "accepted_chars_per_request",
        "suggestion_rate",
        "exact_match",
        "mean_reward",
        "latency_ms",
        "token_accuracy",
    }
    assert st["intervals"]["token_accuracy"]["n"] > 0  # eval.token_accuracy is on by default
    for name in ("suggestion_rate", "exact_match"):
        i = st["intervals"][name]
        assert i["method"] == "wilson" and i["n"] == SITES and 0 <= i["low"] <= i["value"] <= i["high"] <= 1
    assert st["intervals"]["latency_ms"]["method"] == "t"

    model, _ = load_hf(folder / "hf")
    tok = load_tokenizer(folder / "hf")
    files = load_training_corpus(s.pretrain).heldout  # the CLI's sites: eval.seed 0 on pretraining's split
    fmt = read_format(folder / "hf")
    gate = s.model.min_confidence  # serving's confidence gate, on by default: the replay applies it too
    assert report["min_confidence"] == gate > 0
    here = E.evaluate(
        model,
        tok,
        fmt,
        files,
        sites=SITES,
        seed=0,
        max_tokens=s.eval.max_tokens,
        token_accuracy=True,
        min_confidence=gate,
    )
    assert (st["n"], st["shown"], st["accepted"], st["exact"]) == (here.n, here.shown, here.accepted, here.exact)
    assert st["withheld"] == here.withheld
    assert st["intervals"]["token_accuracy"] == pytest.approx(here.intervals()["token_accuracy"].as_dict())
    assert st["outcomes"] == here.outcomes and st["mean_reward"] == pytest.approx(here.mean_reward, abs=1e-6)
    assert st["intervals"]["suggestion_rate"] == pytest.approx(here.intervals()["suggestion_rate"].as_dict())


def test_the_gate_curve_is_one_replay_seen_at_each_threshold(base, tmp_path):
    """`--gate-curve`: suggestion rate, accept rate and accepted characters at each threshold; the
    current setting's row is the report itself, 0 shows everything."""
    _, s, _ = base
    r = run_eval(base, tmp_path, "--json", "--gate-curve", "0.5", "0", str(s.model.min_confidence))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    curve = {row["min_confidence"]: row for row in report["gate_curve"]}
    assert list(curve) == sorted({0.0, 0.5, s.model.min_confidence})
    st = report["stats"]
    mine = curve[s.model.min_confidence]
    assert (mine["shown"], mine["accepted"], mine["withheld"]) == (st["shown"], st["accepted"], st["withheld"])
    assert curve[0.0]["withheld"] == 0 and curve[0.0]["shown"] >= mine["shown"] >= curve[0.5]["shown"]
    assert all(row["n"] == SITES and "accept_rate" in row["intervals"] for row in curve.values())

    table = run_eval(base, tmp_path, "--gate-curve", "0", "0.5")
    assert table.returncode == 0, table.stderr
    assert "the confidence gate's trade-off" in table.stdout and "0.5" in table.stdout
    bad = run_eval(base, tmp_path, "--gate-curve", "1.5")
    assert bad.returncode != 0 and "gate_curve" in bad.stderr and "Traceback" not in bad.stderr


def test_every_form_of_model_gives_the_same_replay(base, tmp_path):
    """The run folder, its hf/ folder and the base published as store version 0 are the same served
    weights (FP4 dequantized), so they replay the same sites identically."""
    _, s, folder = base
    # the data_dir the CLI runs with (tests.helpers.flywheel sets FLYWHEEL_DATA_DIR)
    store = S.open_store(S.default_store_uri(s.model_copy(update={"data_dir": tmp_path / "data"})))
    store.publish(S.load_packed_artifact(folder / "fp4"), None, version=0)

    def counts(*model: str) -> tuple:
        r = run_eval(base, tmp_path, "--json", *model)
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)["stats"]
        return st["shown"], st["accepted"], st["exact"], st["outcomes"], st["mean_reward"]

    default = counts()
    assert counts("--model", str(folder)) == default
    assert counts("--model", str(folder / "hf")) == default
    assert counts("--model", "v0") == default


def test_a_store_versions_served_mismatch_is_measured_on_what_it_served(base, tmp_path):
    from feedback import db
    from learner.train.learn import model_from_packed
    from learner.train.mismatch import served_mismatch, served_samples
    from tests.learner.train.learn_support import record_served, rerouted_samples

    _, s, folder = base
    store = S.open_store(S.default_store_uri(s.model_copy(update={"data_dir": tmp_path / "data"})))
    store.publish(S.load_packed_artifact(folder / "fp4"), None, version=0)
    r = run_eval(base, tmp_path, "--model", "v0", "--served-mismatch", "4")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]  # no schema there yet: nothing was served
    assert r.returncode == 1 and len(lines) == 1 and "cannot read completions from sqlite" in lines[0], r.stderr

    engine = db.make_engine(f"sqlite:///{tmp_path / 'data' / 'flywheel.db'}")
    db.upgrade(engine)
    r = run_eval(base, tmp_path, "--model", "v0", "--served-mismatch", "4")
    assert r.returncode == 0 and "v0 served no completion with routes" in r.stdout, r.stderr

    served = model_from_packed(store.materialize(0), load_hf(folder / "hf")[0].args)
    record_served(engine, rerouted_samples(served, 6, reroute_every=4, version=0))
    r = run_eval(base, tmp_path, "--json", "--model", "v0", "--served-mismatch", "4")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["served_mismatch"]
    want = served_mismatch(
        served, served.args, read_format(folder / "hf"), served_samples(engine, 0, 4, served.args.vocab_size), version=0
    ).as_dict()
    assert got.pop("ratio_interval") == pytest.approx(list(want.pop("ratio_interval")))
    assert got == pytest.approx(want)
    assert got["completions"] == 4 and got["ratio"] < 0.01
    r = run_eval(base, tmp_path, "--model", "v0", "--served-mismatch", "4")
    assert f"on the newest 4 completions it served ({got['tokens']} tokens)" in r.stdout, r.stdout
    engine.dispose()


def test_compare_prefix_replays_the_same_sites_without_the_fim_template(base, tmp_path):
    _, s, folder = base
    r = run_eval(base, tmp_path, "--json", "--compare-prefix")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    fim, plain = report["stats"], report["prefix_only_stats"]
    assert fim["n"] == plain["n"] == SITES

    model, _ = load_hf(folder / "hf")
    tok, fmt = load_tokenizer(folder / "hf"), read_format(folder / "hf")
    files = load_training_corpus(s.pretrain).heldout
    here = E.evaluate(
        model,
        tok,
        E.prefix_only(fmt),
        files,
        sites=SITES,
        seed=0,
        max_tokens=s.eval.max_tokens,
        min_confidence=s.model.min_confidence,  # an editor's request has a suffix: gated either way
    )
    assert (plain["shown"], plain["accepted"], plain["exact"]) == (here.shown, here.accepted, here.exact)
    assert plain["outcomes"] == here.outcomes

    table = run_eval(base, tmp_path, "--compare-prefix")
    assert table.returncode == 0, table.stderr
    assert "base, FIM" in table.stdout and "base, prefix only" in table.stdout


def test_cursor_in_brackets_replays_the_in_bracket_sites(base, tmp_path):
    _, s, folder = base
    r = run_eval(base, tmp_path, "--json", "--cursor", "in_brackets")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["cursor"] == "in_brackets" and report["stats"]["n"] == SITES

    model, _ = load_hf(folder / "hf")
    tok, fmt = load_tokenizer(folder / "hf"), read_format(folder / "hf")
    files = load_training_corpus(s.pretrain).heldout
    kwargs = dict(sites=SITES, seed=0, max_tokens=s.eval.max_tokens, min_confidence=s.model.min_confidence)
    here = E.evaluate(model, tok, fmt, files, cursor="in_brackets", **kwargs)
    st = report["stats"]
    assert (st["shown"], st["accepted"], st["exact"], st["outcomes"]) == (
        here.shown,
        here.accepted,
        here.exact,
        here.outcomes,
    )
    sites = E.heldout_sites(files, SITES, seed=0, cursor="in_brackets")
    assert all(site.suffix[:1] in ")]}" for site in sites)  # the closing bracket right after the cursor
    assert sites != E.heldout_sites(files, SITES, seed=0)


def test_eval_prints_a_table_with_intervals(base, tmp_path):
    r = run_eval(base, tmp_path, "--seed", "3")
    assert r.returncode == 0, r.stderr
    for label in ("accept rate (of shown)", "accepted chars / request", "suggestion rate", "exact match", "latency"):
        assert label in r.stdout
    assert "95% confidence interval" in r.stdout and f"{SITES} sites" in r.stdout and "seed 3" in r.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--model", "v7"), "not in the weight store"),
        (("--model", "no/such/folder"), "no such folder"),
        (("--sites", "0"), "eval.sites"),
        (("--corpus", "/no/such/corpus"), "does not exist"),
        (("--cursor", "middle"), "--cursor"),
        (("--served-mismatch", "3"), "needs a store version (--model vN)"),
    ],
)
def test_bad_input_is_one_line(base, tmp_path, args, fragment):
    r = run_eval(base, tmp_path, *args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("flywheel: error:") and fragment in lines[0], lines
    assert "Traceback" not in r.stdout + r.stderr


def test_a_folder_that_is_no_model_is_one_line(base, tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_eval(base, tmp_path, "--model", str(tmp_path / "empty"))
    assert r.returncode == 1 and "neither a Hugging Face folder" in r.stderr and "Traceback" not in r.stderr


def test_no_base_model_says_what_to_do(tmp_path):
    r = flywheel("eval", "--set", f"cache_dir={tmp_path / 'cache'}", "--set", "pretrain.size=tiny", tmp_path=tmp_path)
    assert r.returncode == 1 and "run `flywheel pretrain` first" in r.stderr, r.stderr


def test_a_store_version_of_another_base_is_one_line(base, tmp_path):
    from learner.model import ModelArgs, Transformer

    other = Transformer(ModelArgs.from_name("tiny", vocab_size=400, dim=96, max_seq_len=96))  # wider than the base
    S.open_store(tmp_path / "data" / "weights").publish(S.pack_checkpoint(other.state_dict()), None, version=0)
    r = run_eval(base, tmp_path, "--model", "v0")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "does not fit the base model" in lines[0], r.stderr

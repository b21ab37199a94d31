"""`flywheel bench show` fits each show policy on the same training outcomes and replays it on the
same held-out suggestions as the gate alone (a tiny base trained in the test)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from feedback.core.errors import UserError
from learner import eval as E
from learner import show
from learner import store as S
from learner.formats import read_format
from learner.tokenizer import load_tokenizer
from learner.train.learn import model_from_packed
from learner.train.learn_settings import ShowSection
from learner.train.pretrain import ensure_base_model, find_base_model, load_master_weights, load_training_corpus
from ops.bench.show import BenchLearnSettings, policies, run_bench
from tests.learner.train.learn_support import make_corpus, tiny_learn_settings


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-show")
    tiny = tiny_learn_settings(tmp, make_corpus(tmp / "corpus"), tmp / "cache")
    s = BenchLearnSettings(
        # the tiny base is unsure of every first token: without the gate its suggestions are shown
        **{**tiny.model_dump(), "model": {**tiny.model.model_dump(), "min_confidence": 0.0}},
        eval={"sites": 6, "max_tokens": 8},
    )
    ensure_base_model(s, Console(file=io.StringIO()))
    return s


def test_every_policy_withholds_from_the_same_suggestions_the_gate_shows(settings, monkeypatch, tmp_path):
    s = settings
    fitted: list[tuple[list, list[str]]] = []

    def fit(self, rows, withheld=()):  # a policy that withholds everything, to see what each row replays
        fitted.append((rows, list(self.features)))
        return show.ShowPolicy(
            mean=(0.0,),
            scale=(1.0,),
            weights=(0.0,),
            bias=-10.0,
            threshold=0.25,
            samples=len(rows),
            accepts=0,
            features=("first_logprob",),
        )

    monkeypatch.setattr(ShowSection, "fit", fit)
    out = io.StringIO()
    result = run_bench(s, Console(file=out, width=300), train_sites=10, out=str(tmp_path / "r.json"), command="t")
    gate_alone, *policy_rows = result["rows"]
    assert [r["policy"] for r in policy_rows] == [name for name, _ in policies()]
    # the fits: the same outcomes, every feature then the label; the features each policy names
    assert len(fitted) == 4 and all(rows == fitted[0][0] for rows, _ in fitted)
    assert all(len(r) == len(show.FEATURES) + 1 for r in fitted[0][0]) and 0 < len(fitted[0][0]) <= 10
    assert [names for _, names in fitted] == [list(show.LOGPROB_FEATURES)] * 2 + [list(show.FEATURES)] * 2
    # the gate alone is flywheel eval's replay of the base as served
    folder = find_base_model(s)
    master, args = load_master_weights(folder)
    here = E.evaluate(
        model_from_packed(S.pack_checkpoint(master.state_dict(), "nvfp4"), args),
        load_tokenizer(folder / "hf"),
        read_format(folder / "hf"),
        load_training_corpus(s.pretrain).heldout,
        sites=6,
        seed=s.eval.seed,
        max_tokens=8,
    )
    assert gate_alone["suggestion_rate"] == here.suggestion_rate > 0
    assert gate_alone["accepted_chars_per_request"] == here.accepted_chars_per_request
    for r in policy_rows:  # withholding everything: nothing shown, every accept withheld
        assert r["suggestion_rate"] == 0 and r["accepts_withheld"] == here.accepted
        assert r["chars_vs_base"]["mean"] == pytest.approx(-here.accepted_chars_per_request)
    assert "accepted suggestions withheld" in out.getvalue() and (tmp_path / "r.json").is_file()


def test_too_few_outcomes_to_fit_is_one_clear_error(settings):
    s = settings.model_copy(
        update={"learn": settings.learn.model_copy(update={"show": ShowSection(min_samples=10_000)})}
    )
    with pytest.raises(UserError, match="too few outcomes to fit a show policy on .* raise --train-sites"):
        run_bench(s, Console(file=io.StringIO()), train_sites=4, out=None, command="t")

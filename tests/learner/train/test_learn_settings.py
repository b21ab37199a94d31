"""The learner's settings parse without torch: the CLI validates a config before importing anything heavy."""

import subprocess
import sys

from tests.helpers import REPO


def test_the_settings_modules_import_no_torch():
    code = (
        "import sys, learner.train.learn_settings, learner.train.pretrain_settings; "
        "learner.train.learn_settings.LearnSection(); "
        "heavy = sorted(m for m in ('torch', 'learner.model', 'learner.train.gate') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gate_thresholds_keep_their_keys_and_defaults():
    from learner.train.learn_settings import GateSection, GateThresholds, LearnSection

    assert LearnSection().gate == GateSection() and isinstance(GateSection(), GateThresholds)
    assert GateThresholds().model_dump() == {
        "min_sites": 16,
        "reward_tolerance": 0.03,
        "divergence_tolerance": 0.01,
        "min_suggestion_ratio": 0.5,
        "min_suggestion_rate": 0.05,
        "min_length_ratio": 0.5,
        "max_length_ratio": 2.0,
        "max_kl": 0.2,
    }


def test_workers_default_to_one_and_must_fit_the_batch():
    import pytest
    from pydantic import ValidationError

    from learner.train.learn_settings import LearnSection

    assert LearnSection().workers == 1 and not LearnSection().gpu
    assert LearnSection(workers=4, batch_size=4).workers == 4
    with pytest.raises(ValidationError, match=r"learn.workers \(5\) must not exceed learn.batch_size \(4\)"):
        LearnSection(workers=5, batch_size=4)
    with pytest.raises(ValidationError, match="workers"):
        LearnSection(workers=0)
    with pytest.raises(ValidationError, match="learn.gpu applies to data-parallel workers"):
        LearnSection(gpu=True)


def test_train_weights_must_be_regular_expressions():
    import pytest
    from pydantic import ValidationError

    from learner.train.learn_settings import LearnSection

    assert LearnSection().train_weights is None  # the default: see the next test
    assert LearnSection(train_weights=[r"mlp\.experts\."]).train_weights == [r"mlp\.experts\."]
    with pytest.raises(ValidationError, match=r"train_weights: 'experts\(' is not a regular expression"):
        LearnSection(train_weights=["experts("])
    with pytest.raises(ValidationError):
        LearnSection(train_weights=[])


def test_train_weights_default_is_the_experts_of_a_moe_model_and_every_weight_of_a_dense_one():
    """Unset, learn.train_weights trains a mixture-of-experts model's routed experts (the FP4
    tensors: the others add nothing to a delta) and every weight of a dense model, which has no
    experts; patterns given are taken as they are."""
    from learner.model import ModelArgs, Transformer
    from learner.train.learn import EXPERTS, train_only, train_weights

    moe = Transformer(ModelArgs.from_name("tiny", vocab_size=64, max_seq_len=32))
    dense = Transformer(ModelArgs.from_name("tiny", vocab_size=64, max_seq_len=32, n_experts=0, ffn_dim=64))
    assert train_weights(moe, None) == [EXPERTS] and train_weights(dense, None) == [".*"]
    assert train_weights(moe, [".*"]) == [".*"]
    trained, total = train_only(moe, None)
    experts = sum(w.numel() for n, w in moe.named_parameters() if ".mlp.experts." in n)
    assert trained == experts < total
    assert all(w.requires_grad == (".mlp.experts." in n) for n, w in moe.named_parameters())
    assert train_only(dense, None) == (sum(w.numel() for w in dense.parameters()),) * 2


def test_show_features_must_be_known_and_distinct():
    import pytest
    from pydantic import ValidationError

    from learner.show import FEATURES, LOGPROB_FEATURES
    from learner.train.learn_settings import ShowSection

    assert ShowSection().features == list(FEATURES)
    assert ShowSection(features=list(LOGPROB_FEATURES)).features == list(LOGPROB_FEATURES)
    for bad in (["first_logprob", "line_colour"], ["first_logprob", "first_logprob"], []):
        with pytest.raises(ValidationError, match="show features must be distinct|at least 1 item"):
            ShowSection(features=bad)

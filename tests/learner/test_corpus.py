import pytest
import torch

from learner.corpus import TrainingData, heldout_windows, is_heldout, load_corpus, token_stream
from learner.formats import own_format
from learner.tokenizer import EOS, FILE_SEP, FIM_PREFIX, SUMMARY_START, train_tokenizer


def write_corpus(root, n=30):
    for i in range(n):
        sub = root / ("pkg" if i % 2 else "lib") / f"m{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(
            f"import os\n\nclass C{i}:\n    def f(self, x={i}):\n        return x * {i}\n\n\ndef g{i}(a, b):\n    return a + b\n"
            * 3
        )
    (root / "notes.bin").write_bytes(b"\xff\xfe binary")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "skip.py").write_text("x = 1\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "skip.py").write_text("x = 1\n")
    return root


def test_split_is_deterministic_disjoint_and_by_path(tmp_path):
    root = write_corpus(tmp_path)
    a = load_corpus(root, heldout_fraction=0.2)
    b = load_corpus(root, heldout_fraction=0.2)
    train, held = {f.path for f in a.train}, {f.path for f in a.heldout}
    assert train and held and not train & held
    assert len(train | held) == 30  # hidden, cache and non-source files skipped
    assert held == {f.path for f in b.heldout} and a.fingerprint == b.fingerprint
    assert all(is_heldout(p, 0.2) for p in held) and not any(is_heldout(p, 0.2) for p in train)

    # adding a file moves no other file across; changing content changes the fingerprint
    (root / "new.py").write_text("y = 2\n")
    c = load_corpus(root, heldout_fraction=0.2)
    assert {f.path for f in c.heldout} - {"new.py"} == held
    assert c.fingerprint != a.fingerprint


def test_default_corpus_is_the_stdlib_without_tests():
    c = load_corpus(None)
    paths = {f.path for f in c.train + c.heldout}
    assert "textwrap.py" in paths and "asyncio/tasks.py" in paths
    assert not any(p.startswith("test/") or "/tests/" in p or "site-packages" in p for p in paths)
    assert 0.02 < len(c.heldout) / len(paths) < 0.1


def test_bad_corpus_folders(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "a.txt").write_text("not code")
    with pytest.raises(ValueError, match="usable source file"):
        load_corpus(tmp_path)


def test_training_rows_are_a_function_of_seed_and_step(tmp_path):
    c = load_corpus(write_corpus(tmp_path), heldout_fraction=0.2)
    tok = train_tokenizer((f.text for f in c.train), 400)
    fmt = own_format(tok, 64)
    data = TrainingData(tok, fmt, c.train, seq_len=64, batch_size=32, fim_rate=0.5, summary_rate=0.3, seed=0)
    b = data.batch(7)
    assert b.shape == (32, 65) and b.dtype == torch.long
    assert torch.equal(b, data.batch(7)) and not torch.equal(b, data.batch(8))
    other = TrainingData(tok, fmt, c.train, seq_len=64, batch_size=32, fim_rate=0.5, summary_rate=0.3, seed=1)
    assert not torch.equal(b, other.batch(7))
    starts = b[:, 0].tolist()
    fim_prefix, file_sep, summary_start = (tok.token_to_id(t) for t in (FIM_PREFIX, FILE_SEP, SUMMARY_START))
    assert fim_prefix in starts and file_sep in starts  # FIM rows with and without the path header
    assert (b == summary_start).any()  # summary rows

    stream = token_stream(fmt, tok, c.heldout)
    assert (stream == tok.token_to_id(EOS)).sum() == len(c.heldout)
    w = heldout_windows(stream, 16, 4)
    assert w.shape[1] == 17 and torch.equal(w, heldout_windows(stream, 16, 4))


def test_middle_weight_marks_each_fim_middle_and_its_end_of_text(tmp_path):
    c = load_corpus(write_corpus(tmp_path), heldout_fraction=0.2)
    tok = train_tokenizer((f.text for f in c.train), 400)
    fmt = own_format(tok, 64)
    kw = dict(seq_len=64, batch_size=32, fim_rate=0.6, summary_rate=0.2, seed=0)
    plain = TrainingData(tok, fmt, c.train, **kw)
    assert plain.weighted(4)[1] is None  # weight 1: no weights to carry
    rows, weights = TrainingData(tok, fmt, c.train, middle_weight=5.0, **kw).weighted(4)
    assert torch.equal(rows, plain.batch(4))  # the weight changes the loss, never the rows
    assert weights.shape == (32, 64) and set(weights.unique().tolist()) == {1.0, 5.0}
    eos, fim_prefix, summary_start = (tok.token_to_id(t) for t in (EOS, FIM_PREFIX, SUMMARY_START))
    targets = rows[:, 1:]
    for r in range(len(rows)):
        heavy = (weights[r] == 5.0).nonzero().flatten().tolist()
        is_fim = bool((rows[r] == fim_prefix).any()) and rows[r, 0] != summary_start
        assert bool(heavy) == is_fim, r  # every FIM row has a middle, no other row does
        runs = [[heavy[0]]] if heavy else []
        for t in heavy[1:]:
            runs[-1].append(t) if t == runs[-1][-1] + 1 else runs.append([t])
        for run in runs:
            assert targets[r, run[-1]] == eos  # a middle ends with its end-of-text...
            assert not (targets[r, run[:-1]] == eos).any()
            # ...and starts right after the prefix: in the suffix-first layout, after <|fim_prefix|>
            # and the prefix, so <|fim_prefix|> comes before it with no end-of-text in between
            before = rows[r, : run[0] + 1].tolist()
            assert fim_prefix in before and eos not in before[len(before) - before[::-1].index(fim_prefix) :]


def test_fim_rows_carry_other_files_of_the_folder_as_serving_lays_them_out(tmp_path):
    c = load_corpus(write_corpus(tmp_path), heldout_fraction=0.2)
    tok = train_tokenizer((f.text for f in c.train), 400)
    fmt = own_format(tok, 512)
    kw = dict(seq_len=512, batch_size=16, fim_rate=1.0, summary_rate=0.0, seed=0)
    without = TrainingData(tok, fmt, c.train, **kw).batch(3)
    data = TrainingData(tok, fmt, c.train, context_rate=1.0, **kw)
    rows = data.batch(3)
    assert torch.equal(rows, data.batch(3)) and not torch.equal(rows, without)
    file_sep, fim_prefix = tok.token_to_id(FILE_SEP), tok.token_to_id(FIM_PREFIX)
    folders = {f.path: f.path.split("/")[0] for f in c.train}
    # Before a row's first <|fim_prefix|>: `<|file_sep|>path\n` blocks, the context's, then the
    # file's own header (when the example has one). Every block names a file of one folder, each once.
    checked = 0
    for row in rows.tolist():
        if fim_prefix not in row:
            continue
        first = row[: row.index(fim_prefix)]
        paths = [tok.decode(first[i + 1 :]).split("\n", 1)[0] for i, t in enumerate(first) if t == file_sep]
        if len(paths) < 2:
            continue
        assert len(set(paths)) == len(paths) and len({folders[p] for p in paths}) == 1
        checked += 1
    assert checked >= 3
    assert rows.shape == (16, 513)


def test_fim_middles_are_mostly_shaped_like_editor_requests():
    import random

    from learner.corpus import fim_span

    text = "import os\n\n\ndef f(x):\n    y = x + 1\n    return y\n\n\nclass A:\n    n = 2\n" * 4
    rng, shapes = random.Random(0), {"line": 0, "lines": 0, "other": 0}
    for _ in range(4000):
        a, b = fim_span(text, rng)
        assert 0 <= a <= b <= len(text)
        middle, suffix = text[a:b], text[b:]
        line_start = text.rfind("\n", 0, a) + 1
        line = text[line_start : text.find("\n", a)]
        cursor_in_code = bool(line.strip()) and a - line_start >= len(line) - len(line.lstrip())
        if cursor_in_code and suffix.startswith("\n") and "\n" not in middle:
            shapes["line"] += 1  # the rest of a line of code, the newline left to the suffix
        elif cursor_in_code and suffix[:1] in ("\n", "") and 1 <= middle.count("\n") <= 3:
            shapes["lines"] += 1
        else:
            shapes["other"] += 1
    # 45% rest of line, 20% a few lines, 35% anywhere (some of which look like the others).
    assert 0.42 <= shapes["line"] / 4000 <= 0.60, shapes
    assert 0.15 <= shapes["lines"] / 4000 <= 0.30, shapes
    assert 0.20 <= shapes["other"] / 4000 <= 0.36, shapes

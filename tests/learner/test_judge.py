"""The simulated user: cursor sites in real lines, and what it keeps of a suggestion."""

import random

import pytest

from learner.corpus import SourceFile
from learner.judge import cursor_sites, editor_events, judge

CODE = "import os\n\n\ndef join_all(parts):\n    result = os.path.join(*parts)\n    return result.strip()\n\n\nclass Box:\n    size = 3\n"


@pytest.mark.parametrize(
    "suggestion, truth, expected",
    [
        ("", "x = 1", ("none", None, 0)),
        ("path.join(*parts)", "path.join(*parts)", ("select", "full", 17)),
        ("path.join(*parts)\n    return", "path.join(*parts)", ("select", "line", 17)),
        ("path.split(x)", "path.join(*parts)", ("select", "word", 5)),
        ("path.join(a)", "path.join(*parts)", ("select", "word", 10)),
        ("zzz", "path.join(*parts)", ("dismiss", None, 0)),
        ("  ", "x", ("dismiss", None, 0)),
    ],
)
def test_judge(suggestion, truth, expected):
    v = judge(suggestion, truth)
    assert (v.type, v.select_kind, v.accepted_chars) == expected
    if v.type == "select":
        assert truth.startswith(v.kept_text) and len(v.kept_text) == v.accepted_chars


def test_cursor_sites_split_a_real_line():
    sites = cursor_sites([SourceFile("pkg/m.py", CODE)], 20, random.Random(0))
    assert len(sites) == 20
    for s in sites:
        assert CODE.startswith(s.prefix) and s.truth
        assert (s.prefix + s.truth + s.suffix).startswith(CODE.rstrip("\n")[: len(s.prefix) + len(s.truth)])
        assert "\n" not in s.truth and s.language == "python"


def test_in_brackets_sites_put_the_closing_bracket_in_the_suffix():
    sites = cursor_sites([SourceFile("pkg/m.py", CODE)], 20, random.Random(0), cursor="in_brackets")
    assert len(sites) == 20
    for s in sites:
        assert s.prefix + s.truth + s.suffix == CODE  # the file, cut twice
        line_rest = s.suffix.split("\n", 1)[0]
        assert line_rest[:1] in (")", "]", "}") and len(s.truth) >= 4 and "\n" not in s.truth
        opener = "([{"[")]}".index(line_rest[0])]
        assert opener in s.prefix.rsplit("\n", 1)[-1]  # the pair the cursor sits in
    assert cursor_sites([SourceFile("pkg/m.py", CODE)], 5, random.Random(0)) != sites[:5]
    with pytest.raises(ValueError, match="cursor"):
        cursor_sites([SourceFile("pkg/m.py", CODE)], 1, random.Random(0), cursor="middle")


@pytest.mark.parametrize(
    "line, cut_range",
    [
        ("    x = foo(alpha, beta)\n", ("    x = foo(", "alpha, beta")),
        ("def f(alpha, beta):\n", ("def f(", "alpha, beta")),
        ("    d[some_key] = g(h(value))\n", ("    d[some_key] = g(h(", "value")),  # the innermost pair
    ],
)
def test_in_brackets_site_sits_inside_the_innermost_closing_pair(line, cut_range):
    text = "a = 1\n" * 6 + line
    sites = cursor_sites([SourceFile("m.py", text)], 10, random.Random(1), cursor="in_brackets")
    head, inside = cut_range
    assert sites
    for s in sites:
        cursor_line = s.prefix.rsplit("\n", 1)[-1]
        assert cursor_line.startswith(head) and (cursor_line[len(head) :] + s.truth) == inside


@pytest.mark.parametrize(
    "line", ["    # call(this_one)\n", "    x = (a)\n", "    return value\n", "    f(a, b), g(c)\n"]
)
def test_no_in_brackets_site_where_no_closing_pair_holds_enough(line):
    text = "a = 1\n" * 6 + line
    assert cursor_sites([SourceFile("m.py", text)], 3, random.Random(1), cursor="in_brackets") == []


@pytest.mark.parametrize(
    "suggestion, truth, events",
    [
        (
            "path.join(*parts)",
            "path.join(*parts)",
            [("view", None, None, None), ("select", "full", 17, None), ("edit", None, None, "path.join(*parts)")],
        ),
        (
            "path.split(x)",
            "path.join(*parts)",
            [("view", None, None, None), ("select", "word", 5, None), ("edit", None, None, "path.")],
        ),
        ("zzz", "path.join(*parts)", [("view", None, None, None), ("dismiss", None, None, None)]),
        ("", "path.join(*parts)", []),
    ],
)
def test_editor_events_report_the_verdict(suggestion, truth, events):
    got = editor_events(judge(suggestion, truth))
    assert [(e.type, e.select_kind, e.accepted_chars, e.kept_text) for e in got] == events


def test_file_walks_go_down_one_file_and_each_prefix_holds_the_previous_line_whole():
    import random

    from learner.corpus import SourceFile
    from learner.judge import file_walks

    text = "".join(f"value_{i} = compute_something({i}, {i + 1})\n" for i in range(60))
    files = [SourceFile("a.py", text), SourceFile("b.py", text.replace("value", "other"))]
    walks = file_walks(files, 20, random.Random(3), per_file=6, max_gap=3)
    assert sum(len(w) for w in walks) == 20 and all(len(w) <= 6 for w in walks)
    for walk in walks:
        assert len({s.path for s in walk}) == 1
        for prev, nxt in zip(walk, walk[1:]):
            # The user finished the previous line (kept or typed), then moved 1 to 3 lines down.
            assert nxt.prefix.startswith(prev.prefix + prev.truth + "\n")
            lines_between = nxt.prefix[len(prev.prefix + prev.truth) :].count("\n")
            assert 1 <= lines_between <= 3
    assert file_walks([], 5, random.Random(0)) == []

"""The implicit-feedback judge on tiny strings: each outcome, each reason not to judge."""

from __future__ import annotations

from feedback.implicit import Judgement, find_cursor, judge_next, kept_prefix

BEFORE = "def area(r):\n    "
AFTER = "\n\nprint(area(2))\n"


def judged(suggestion: str, new_before: str, new_after: str = AFTER, *, before=BEFORE, after=AFTER) -> Judgement:
    return judge_next(suggestion, before, after, new_before, new_after)


def test_kept_fully_with_the_cursor_after_it():
    j = judged("return 3.14 * r * r", BEFORE + "return 3.14 * r * r")
    assert j == Judgement("full", 19, "full")


def test_kept_fully_and_typed_on_from_there():
    j = judged("return 3.14", BEFORE + "return 3.14 * r * r\n\n", "print(area(2))\n")
    assert j == Judgement("full", 11, "full")


def test_first_words_kept_partly():
    j = judged("return math.pi * r", BEFORE + "return math.tau")
    assert j == Judgement("partial", len("return math."), "word")


def test_first_line_kept_partly():
    j = judged("return x\n\nx = 1", BEFORE + "return x\n\ny = 2")
    assert j == Judgement("partial", len("return x"), "line")


def test_not_kept():
    assert judged("pass", BEFORE + "return 0") == Judgement("none")


def test_nothing_typed_and_the_cursor_moved_elsewhere():
    # The next request comes from further down the same file; the old cursor still has AFTER.
    assert judged("return r", BEFORE + AFTER + "x = 1") == Judgement("none")


def test_a_kept_r_before_return_is_not_a_full_accept():
    j = judged("r", BEFORE + "return r")
    assert j.outcome is None and j.not_judged == "mid_word"


def test_the_start_of_a_word_is_not_a_partial_accept():
    assert judged("return_value", BEFORE + "return_val").not_judged in ("mid_word", "window")
    assert judged("return_value + 1", BEFORE + "return_v = 2").not_judged == "mid_word"


def test_a_kept_lone_space_is_not_an_accept():
    before = "x ="
    j = judge_next(" compute(a)", before, "\n", "x = 5\n", "")
    assert j == Judgement("none")


def test_blank_suggestions_are_not_judged():
    assert judged("   ", BEFORE + "   ").not_judged == "blank"
    assert judged("\n", BEFORE + "\n").not_judged == "blank"


def test_edits_elsewhere_are_tolerated():
    # A line above the old cursor changed and a line was added far below: the anchor still holds.
    body = "x = 1\n" * 5 + BEFORE
    new_before = "# a new header\n" + body + "return 2 * r"
    j = judge_next("return 2 * r", "# old header\n" + body, AFTER, new_before, AFTER + "more = 1\n")
    assert j.outcome == "full"


def test_an_anchor_found_nowhere_is_not_judged():
    assert judged("return r", "something else entirely").not_judged == "anchor_missing"


def test_an_ambiguous_anchor_is_not_judged():
    before = "x = 1\n"
    text = "x = 1\ny = 2\nx = 1\nz"
    j = judge_next("y = 2", before, "", text, "")
    assert j.outcome is None and j.not_judged == "anchor_ambiguous"


def test_a_repeated_tail_is_told_apart_by_more_of_the_text_before():
    block = "    value = compute(1)\n"
    before = "def first():\n" + block
    new = "def first():\n" + block + "flag = True\n" + "def second():\n" + block + "other()\n"
    assert new.count(before[-24:]) == 2 and new.count(before) == 1
    j = judge_next("flag = True", before, "", new, "")
    assert j == Judgement("full", len("flag = True"), "full")
    assert find_cursor("ab" * 30, "zz" + "ab" * 30 + "cd") == (62, None)
    assert find_cursor("ab" * 30, "ab" * 60)[1] == "anchor_ambiguous"


def test_no_text_before_the_cursor_is_not_judged():
    assert judge_next("import os", "", "", "import os\n", "").not_judged == "no_anchor"
    assert judge_next("import os", "\n\n", "", "\n\nimport os\n", "").not_judged == "no_anchor"


def test_a_suggestion_that_already_stood_after_the_cursor_is_not_judged():
    # The closing parenthesis was there before: the new text proves nothing about the suggestion.
    j = judge_next(")", "print(x", ")\n", "print(x)\n", "")
    assert j.not_judged == "already_there"


def test_a_window_that_ends_inside_the_suggestion_is_not_judged():
    for typed in ("return al", "return alpha", "return alpha "):
        assert judge_next("return alpha + beta", BEFORE, "", BEFORE + typed, "").not_judged == "window"


def test_kept_prefix_cuts_at_word_ends():
    assert kept_prefix("foo.bar(1)", "foo.bar(2)") == len("foo.bar(")
    assert kept_prefix("foo.bar(1)", "foo.baz") == len("foo.")
    assert kept_prefix("r", "return") == 0
    assert kept_prefix("x  ", "x  y") == 3  # trailing blanks belong to the whole suggestion
    assert kept_prefix("", "anything") == 0

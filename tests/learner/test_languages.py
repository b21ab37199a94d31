from learner.languages import LINE_STOP, editor_stops
from learner.prompts import EDITOR_STOP


def test_a_cursor_after_code_on_its_line_ends_the_suggestion_with_the_line():
    assert editor_stops("python", "import os\n\ndef f(x):\n    return os.path.") == (LINE_STOP,)
    assert editor_stops("go", "x :=") == (LINE_STOP,)  # the first line of a file
    assert editor_stops(None, "a\n  b ") == (LINE_STOP,)  # trailing spaces after code are still after code


def test_a_cursor_at_the_start_of_a_line_may_get_a_block_up_to_a_blank_line_or_the_next_definition():
    python = editor_stops("python", "class A:\n    def f(self):\n        ")
    assert python[0] == EDITOR_STOP and "\ndef " in python and "\nclass " in python
    assert LINE_STOP not in python
    assert editor_stops("python", "") == python  # an empty file
    assert editor_stops("python", "x = 1\n") == python  # right after a newline
    assert editor_stops("brainfuck", "    ") == (EDITOR_STOP,)  # an unknown language: the blank line only

"""`flywheel serve` refuses to start without what it needs: one line, non-zero exit."""

from tests.helpers import flywheel
from tests.ops.cli.test_main import assert_one_line_error


def test_serve_without_editor_tokens(tmp_path):
    assert_one_line_error(
        flywheel("serve", "--set", f"serve.model_dir={tmp_path}", tmp_path=tmp_path), "no editor tokens"
    )


def test_serve_with_a_folder_that_is_no_model(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# editors\nabc\n")
    r = flywheel(
        "serve", "--set", f"serve.model_dir={tmp_path}", "--set", f"serve.auth_tokens_file={tokens}", tmp_path=tmp_path
    )
    assert_one_line_error(r, "not an exported model folder")


def test_serve_with_an_unreadable_token_file(tmp_path):
    r = flywheel("serve", "--set", f"serve.auth_tokens_file={tmp_path / 'missing'}", tmp_path=tmp_path)
    assert_one_line_error(r, "cannot read serve.auth_tokens_file")


def test_context_budget_must_fit_the_engine(tmp_path):
    r = flywheel("serve", "--set", "serve.context_budget=4096", tmp_path=tmp_path)
    assert_one_line_error(r, "context_budget")

"""ddp_course.harness.notebook: the table and source helpers every lesson uses."""

import pytest

from ddp_course.harness.notebook import markdown_table, show_source


def test_markdown_table_has_a_header_a_rule_and_one_line_per_row():
    text = markdown_table(["rank", "bytes"], [(0, 12), (1, 8)])
    assert text.splitlines() == ["| rank | bytes |", "|---|---|", "| 0 | 12 |", "| 1 | 8 |"]


def test_a_row_of_the_wrong_length_is_an_error_not_a_shifted_table():
    with pytest.raises(ValueError, match="3 cells, the header 2"):
        markdown_table(["a", "b"], [(1, 2, 3)])


class _Example:
    def method(self, x):
        """A docstring to cut."""
        return x + 1


def _function(x):
    """One line.

    And more.
    """
    return x * 2


def test_show_source_prints_each_object_and_can_cut_docstrings(capsys):
    show_source(_function, _Example.method)
    shown = capsys.readouterr().out
    assert "And more." in shown and "A docstring to cut." in shown
    show_source(_function, _Example.method, docstrings=False)
    cut = capsys.readouterr().out
    assert "One line" not in cut and "A docstring to cut." not in cut
    assert "return x * 2" in cut and "return x + 1" in cut
    assert cut.index("def _function") < cut.index("def method")

"""Runs the Python programs of docs/pytorch.md, and checks the output the page shows."""

import contextlib
import io
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "pytorch.md"


def blocks(kind):
    """The fenced blocks of the page whose fence names `kind` ("" for none), in order."""
    out, lang, lines = [], None, []
    for line in PAGE.read_text().splitlines(keepends=True):
        if lang is None and line.startswith("```"):
            lang, lines = line[3:].strip(), []
        elif lang is not None and line.strip() == "```":
            if lang == kind:
                out.append("".join(lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return out


@pytest.mark.parametrize("index", range(2))
def test_the_programs_on_the_page_run(index):
    programs = blocks("python")
    assert len(programs) == 2
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(programs[index], f"docs/pytorch.md, program {index + 1}", "exec"), {})
    if index == 1:
        shown = [b for b in blocks("") if b.startswith("step 0:")]
        assert len(shown) == 1
        assert out.getvalue() == shown[0], "docs/pytorch.md shows other output than its program prints"

"""The README's quickstart runs as written."""

import contextlib
import io
import pathlib

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _block(heading):
    text = README.read_text()
    start = text.index("```python", text.index(heading)) + len("```python\n")
    return text[start : text.index("```", start)]


def test_quickstart_runs_as_written():
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(_block("## Quickstart"), "README quickstart", "exec"), {})
    assert "updates: 16" in output.getvalue()

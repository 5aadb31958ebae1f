"""The README's snippet runs as written, on any backend, and shows what its
comments say (it is the first thing a new user copies)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_snippet_runs(capsys):
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Try it \(runs on a CPU\)\n\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its 'Try it' snippet"
    exec(compile(match.group(1), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("(1, 64, 32) "), out  # out [G, S, T], as the snippet's comment says
    assert "[(64, 8, 64), (256, 64), (64, 8)]" in out, out

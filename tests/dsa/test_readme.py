"""The README's dsa_attention snippet runs as written on any backend and
prints what its comments say."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_dsa_attention_snippet_runs(capsys):
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## DSA attention layer \(runs on a CPU\)\n\n.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its dsa_attention snippet"
    scope = {}
    exec(compile(match.group(1), "README.md", "exec"), scope)
    out = capsys.readouterr().out.splitlines()
    assert out == ["(64, 16, 512) (64,) (64, 1, 16) (64, 16)", "[ 0  1  2 -1]"], out
    assert all(float(abs(g.astype("float32")).max()) > 0 for g in scope["grads"])

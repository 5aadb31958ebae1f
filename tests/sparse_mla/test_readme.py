"""The README's sparse_mla snippet runs as written on any backend and prints
what its comments say."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_sparse_mla_snippet_runs(capsys):
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Sparse MLA forward \(runs on a CPU\)\n\n.*?```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its sparse_mla snippet"
    exec(compile(match.group(1), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("(16, 16, 512) (16, 16) [") and out.rstrip().endswith("] (16,)"), out
    sums = [float(x) for x in out.split("[", 1)[1].split("]", 1)[0].split()]
    assert len(sums) == 2 and all(abs(x - 16) < 1e-3 for x in sums), out  # each of the 16 heads sums to 1

"""Where kernels ran, for the command-buffer tests' child processes: a
jax.profiler trace of a few calls, and how many of each kernel's activity
events carry a CUDA graph id (kernel activity launched from a CUDA graph
does; graph launches show up as API calls)."""

from __future__ import annotations

import glob
import gzip
import json
import os

import jax


def _in_graph(event) -> bool:
    return any("graph" in str(key).lower() and str(val) not in ("0", "", "None", "-1")
               for key, val in (event.get("args") or {}).items())


def graph_summary(call, prof_dir: str, kernels: dict, calls: int = 4) -> dict:
    """Profiles ``call(i)`` for i < ``calls``. For each ``key: kernel name
    substring`` of ``kernels``: ``{key}_events``, ``{key}_events_in_graph``
    and the first events' args ``{key}_args``; ``graph_launch_events``; and
    ``error``: None, or the profiler's exception (a profiler problem must not
    hide the results the child saved before)."""
    try:
        with jax.profiler.trace(prof_dir):
            for i in range(calls):
                jax.block_until_ready(call(i))
        files = sorted(glob.glob(os.path.join(prof_dir, "**", "*.trace.json.gz"), recursive=True))
        with gzip.open(files[-1]) as fh:
            events = json.load(fh)["traceEvents"]
        summary = dict(error=None,
                       graph_launch_events=sum("graphlaunch" in str(e.get("name", "")).lower() for e in events))
        for key, name in kernels.items():
            hits = [e for e in events if name in str(e.get("name", ""))]
            summary[f"{key}_events"] = len(hits)
            summary[f"{key}_events_in_graph"] = sum(map(_in_graph, hits))
            summary[f"{key}_args"] = [e.get("args") for e in hits[:4]]
    except Exception as e:  # noqa: BLE001 (reported, not raised)
        summary = dict(error=repr(e))
    return summary


def write_graph_summary(call, prof_dir: str, kernels: dict) -> None:
    """graph_summary's result as JSON at ``prof_dir + ".json"``."""
    with open(prof_dir + ".json", "w") as fh:
        json.dump(graph_summary(call, prof_dir, kernels), fh, default=str)

"""The summary of a GPU check (scripts/gpu_check.sh): one Markdown table of figures, printed and
written to ``OUT/summary.md`` (and ``OUT/summary.json``), from the files the check left in OUT.

Reads (each optional; what is missing is said so in the table):
  steps.tsv    one line per step: name, status, seconds, limit (written by gpu_check.sh)
  facts.json   device, driver, Python, torch and CUDA versions (the facts step)
  tests-*.log  pytest's last line: passed / failed / skipped / deselected counts
  bench.log    benchmarks/gpu_resnet50.py's Markdown tables: the ms/iteration rows
  codec.json   benchmarks/codec_cost.py's rows: ms per MB of encode, decode and mean

Usage: python scripts/gpu_summary.py OUT_DIR

Standard library only: it must run where torch is broken.
"""

import json
import os
import re
import sys
from typing import Any

__all__ = ["bench_rows", "collect", "pytest_counts", "render", "step_rows"]

_PYTEST_TOTALS = re.compile(
    r"(\d+) (passed|failed|skipped|deselected|error|errors|xfailed|xpassed)\b"
)


def step_rows(text: str) -> list[dict[str, str]]:
    """The rows of ``steps.tsv`` (header line first), as dicts."""
    lines = [line.split("\t") for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0]
    return [dict(zip(header, cells)) for cells in lines[1:]]


def pytest_counts(log: str) -> dict[str, int]:
    """The counts of pytest's final summary line (``== 3 passed, 1 skipped in 9.1s ==``) in a
    log, ``deselected`` included; empty when pytest never got that far (killed by its timeout)."""
    for line in reversed(log.splitlines()):
        if line.startswith("=") and " in " in line and _PYTEST_TOTALS.search(line):
            counts: dict[str, int] = {}
            for n, what in _PYTEST_TOTALS.findall(line):
                key = "error" if what == "errors" else what
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def bench_rows(log: str) -> dict[str, Any]:
    """benchmarks/gpu_resnet50.py's output: the header line (model, batch, device, torch), the
    optimizer rows (ms/iteration, min-max, vs plain torch, memory; or why a row did not run) and
    the targets' rows (measure, value, target, met)."""
    out: dict[str, Any] = {"header": None, "optimizers": [], "targets": []}
    table = None
    for line in log.splitlines():
        if line.startswith("| optimizer |"):
            table = "optimizers"
            continue
        if line.startswith("| measure |"):
            table = "targets"
            continue
        if line.startswith("|---"):
            continue
        if line.startswith("| ") and table:
            cells = _cells(line)
            if table == "optimizers":
                keys = ("optimizer", "ms", "min-max", "vs plain", "memory")
            else:
                keys = ("measure", "value", "target", "met")
            out[table].append(dict(zip(keys, cells)))
            continue
        table = None
        if out["header"] is None and "parameters" in line and "batch" in line:
            out["header"] = line.strip()
    return out


def collect(out_dir: str) -> dict[str, Any]:
    """Everything the summary shows, read from ``out_dir``."""

    def read(name: str) -> str | None:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            return None
        with open(path, errors="replace") as f:
            return f.read()

    steps = step_rows(read("steps.tsv") or "")
    for row in steps:
        log = read(f"{row['step']}.log") if row["step"].startswith("tests") else None
        if log is not None:
            row["tests"] = pytest_counts(log)
    facts_text, codec_text, bench_text = read("facts.json"), read("codec.json"), read("bench.log")
    try:
        codec = json.loads(codec_text) if codec_text else None
    except json.JSONDecodeError:
        codec = None
    return {
        "facts": json.loads(facts_text) if facts_text else None,
        "steps": steps,
        "bench": bench_rows(bench_text) if bench_text else None,
        "codec": codec,
    }


def _tests_cell(row: dict[str, Any]) -> str:
    """A test group's pytest counts, or what is known when there are none: it selected no test
    (the check's status says so, or every collected test was deselected), it timed out, or its
    log says why."""
    counts = row.get("tests")
    if counts is None:
        return ""
    if "no test selected" in row["status"] or (counts and set(counts) == {"deselected"}):
        deselected = counts.get("deselected")
        return "no test selected" + (f" ({deselected} deselected)" if deselected else "")
    if not counts:
        if row["status"].startswith("TIMED OUT"):
            return "no pytest summary (timed out)"
        return f"no pytest summary (see {row['step']}.log)"
    return ", ".join(f"{n} {what}" for what, n in counts.items())


def render(summary: dict[str, Any]) -> str:
    """The summary as Markdown."""
    lines = ["## GPU check summary", ""]
    facts = summary["facts"]
    if facts:
        gpus = "; ".join(facts.get("gpus") or []) or "none"
        lines += [
            f"- device: {gpus}",
            f"- driver {facts.get('driver') or '?'}, CUDA {facts.get('cuda') or '?'} (torch's), "
            f"torch {facts.get('torch')}, Python {facts.get('python')}",
        ]
    else:
        lines.append("- device: unknown (the facts step did not run)")
    lines += ["", "| step | status | seconds (limit) | tests |", "|---|---|---|---|"]
    for row in summary["steps"]:
        lines.append(
            f"| {row['step']} | {row['status']} | {row['seconds']} ({row['limit']}) | "
            f"{_tests_cell(row)} |"
        )
    bench = summary["bench"]
    lines.append("")
    if bench and bench["optimizers"]:
        if bench["header"]:
            lines += [bench["header"], ""]
        lines += ["| optimizer | ms/iteration | vs plain torch |", "|---|---|---|"]
        for r in bench["optimizers"]:
            lines.append(f"| {r['optimizer']} | {r.get('ms', '')} | {r.get('vs plain', '')} |")
        if bench["targets"]:
            lines += ["", "| measure | value | target | met |", "|---|---|---|---|"]
            lines += [
                f"| {r['measure']} | {r.get('value', '')} | {r.get('target', '')} | "
                f"{r.get('met', '')} |"
                for r in bench["targets"]
            ]
    else:
        lines.append("benchmark: no figures (the bench step did not run or did not finish)")
    codec = summary["codec"]
    lines.append("")
    if codec and codec.get("rows"):
        lines += [
            f"codec cost per MB of float32 ({codec.get('mb')} MB, median of "
            f"{codec.get('repeats')}):",
            "",
            "| codec | device | encode ms/MB | decode ms/MB | mean ms/MB |",
            "|---|---|---|---|---|",
        ]
        for r in codec["rows"]:
            if r.get("error"):
                lines.append(f"| {r['codec']} | {r['device']} | n/a: {r['error']} | | |")
                continue
            lines.append(
                f"| {r['codec']} | {r['device']} | {r['encode_ms_per_mb']:.4f} | "
                f"{r['decode_ms_per_mb']:.4f} | {r['mean_ms_per_mb']:.4f} |"
            )
    else:
        lines.append("codec cost: no figures (the codec step did not run or did not finish)")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print(
            "usage: gpu_summary.py OUT_DIR (the --out folder of scripts/gpu_check.sh)",
            file=sys.stderr,
        )
        return 2
    out_dir = argv[0]
    summary = collect(out_dir)
    text = render(summary)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(text, end="")
    print(f"(written to {os.path.join(out_dir, 'summary.md')} and summary.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Write the fault matrix's and the chaos run's tables of docs/results/reliability.md from the
runs' own output, so the page shows what a run of the code gave (nothing typed by hand).

Inputs:
    --matrix: one or more files of the JSON lines that ``HVD_SLOWMO_FAULT_MATRIX_JSON=PATH``
        makes tests/test_fault_matrix.py write (one object per cell run), in run order: a cell
        found again in a later file (a rerun) shows the later outcome, marked, with the earlier
        one listed under the table.
    --matrix-run: a JSON object describing the runs: {"machine": str, "runs": [{"command",
        "commit", "start", "end"}, ...]} (start and end in Unix seconds).
    --chaos: scripts/chaos.py's output files (its final JSON report is read), with
        --chaos-run describing those runs as above.
    --docs: the page; the text between ``<!-- begin: NAME -->`` and ``<!-- end: NAME -->``
        (NAME: fault-matrix, chaos) is replaced. Without it the tables go to stdout.

Usage: python scripts/reliability_tables.py --matrix m1.jsonl [m2.jsonl ...] --matrix-run m.json
       [--chaos c1.log c2.log --chaos-run c.json] [--docs docs/results/reliability.md]
"""

import argparse
import json
import re
import sys
import time

ENGINES = ("horovod-gloo", "horovod-mpi", "torchdist-gloo")
CONFIGS = ("plain", "overlap2", "frag4", "int8")
FAULTS = ("kill", "freeze", "raise", "late_join", "link_down")


def _when(info: dict) -> str:
    lines = [f"On {info['machine']}:\n"]
    for run in info["runs"]:
        start = time.strftime("%Y-%m-%d %H:%M", time.gmtime(run["start"]))
        minutes = (run["end"] - run["start"]) / 60
        lines.append(
            f"- {start} UTC, wall time {minutes:.0f} min, commit `{run['commit'][:7]}`: "
            f"`{run['command']}`"
        )
    return "\n".join(lines) + "\n"


def _cell_text(cell: dict | None) -> str:
    if cell is None:
        return "not run"
    if cell["outcome"] in ("not run", "skipped"):
        return "not run (below)" if cell.get("why") else "not run"
    if cell["outcome"] == "FAILED":
        return f"**FAILED** ({cell.get('why', '')[:80]})".replace("|", "/")
    text = cell["outcome"]
    if cell["outcome"] == "stops":
        if cell.get("named_by") == "launcher":
            text += ", launcher"
        else:
            text += f", {cell['error']}, {cell['after_fault']:.0f} s after"
    return f"{text} ({cell['seconds']:.0f} s)" + (" (rerun)" if cell.get("rerun") else "")


def _error_lines(last: dict) -> list[str]:
    """One line per (engine, error type): the error's first line and hvd_slowmo's note."""
    lines = []
    seen = set()
    for c in sorted(last.values(), key=lambda c: (c["engine"], c["fault"], c["config"])):
        if c["outcome"] != "stops":
            continue
        key = (c["engine"], c.get("error"))
        if key in seen:
            continue
        seen.add(key)
        msg = c.get("message") or c.get("error", "")
        first, *rest = msg.splitlines() or [""]
        note = next((r for r in rest if r.startswith("hvd_slowmo:")), "")
        first = first if len(first) <= 220 else first[:217] + "..."
        where = f"{c['engine']} {c['config']} {c['fault']}"
        lines.append(f"- {where}: `{first}`" + (f" / `{note}`" if note else ""))
    return lines


def _merge(runs: list[list[dict]]) -> tuple[dict, dict]:
    """Each cell's last outcome (a rerun marked), and the earlier outcomes of rerun cells."""
    last: dict[tuple[str, str, str], dict] = {}
    earlier: dict[tuple[str, str, str], list[dict]] = {}
    for cells in runs:
        for c in cells:
            if c["outcome"] == "FAILED" and c.get("why") == "KeyboardInterrupt":
                continue  # the run was stopped (Ctrl-C) inside this cell: no outcome
            key = (c["engine"], c["config"], c["fault"])
            if key in last:
                earlier.setdefault(key, []).append(last[key])
                c = {**c, "rerun": True}
            last[key] = c
    return last, earlier


def matrix_tables(runs: list[list[dict]], info: dict) -> str:
    """The outcome table (engine x configuration, one column per fault), the counts, and the
    distinct error texts (the first line and hvd_slowmo's note of each error type per engine).

    Args:
        runs: each run's cells, in run order (a later run's cell replaces an earlier one's).
        info: the runs' description (see the module's docstring).
    """
    last, earlier = _merge(runs)
    counts: dict[str, int] = {}
    for c in last.values():
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    checkpoints = sum(c.get("checkpoints", 0) for c in last.values())
    lines = [_when(info)]
    lines.append(
        f"{len(last)} cells: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + ". Every cell with an outcome was checked: no temporary file, and all "
        f"{checkpoints} checkpoints left load (no partial checkpoint).\n"
    )
    lines.append("| Engine | Configuration | " + " | ".join(FAULTS) + " |")
    lines.append("|---|---|" + "---|" * len(FAULTS))
    for e in ENGINES:
        for cfg in CONFIGS:
            row = [_cell_text(last.get((e, cfg, f))) for f in FAULTS]
            lines.append(f"| {e} | {cfg} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append(
        "A cell reads: the outcome; for `stops`, who named the fault (the survivor's error type, "
        "or `launcher`: mpirun or torchrun ended the job first, its message naming the killed "
        "rank) and the seconds from the fault to the last error; in brackets, the seconds from "
        "launch to the end of the launch.\n"
    )
    for key, before in earlier.items():
        was = "; ".join(f"{b['outcome']}: {b.get('why', b.get('error', ''))}" for b in before)
        lines.append(f"- rerun {' '.join(key)}: the earlier run gave {was}")
    if earlier:
        lines.append("")
    lines.append("The errors (first line, then hvd_slowmo's note), one of each type per engine:\n")
    lines += _error_lines(last)
    why = {c["why"] for c in last.values() if c["outcome"] in ("not run", "skipped")}
    for w in sorted(why):
        lines.append(f"- not run: {w}")
    return "\n".join(lines) + "\n"


def chaos_report(path: str) -> dict:
    """scripts/chaos.py's final JSON report (the last object in its output)."""
    text = open(path).read()
    start = max(m.start() for m in re.finditer(r"^\{", text, re.M))
    return json.loads(text[start:])


def chaos_table(reports: list[dict], info: dict) -> str:
    lines = [_when(info)]
    lines.append(
        "| Engine | Kills | Recovered (bit for bit) | Stopped cleanly | Hung | Lost state "
        "| Partial checkpoint | Mean seconds per kill |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for report in reports:
        for engine, r in report.items():
            if "error" in r:
                lines.append(f"| {engine} | uninterrupted run failed: {r['error'][:80]} |||||||")
                continue
            o, runs = r["outcomes"], r["runs"]
            mean = sum(k["seconds"] for k in runs) / max(len(runs), 1)
            cols = ("recovered", "stopped cleanly", "hung", "lost state", "partial checkpoint")
            lines.append(
                f"| {engine} | {r['kills']} | "
                + " | ".join(str(o.get(k, 0)) for k in cols)
                + f" | {mean:.0f} s |"
            )
    return "\n".join(lines) + "\n"


def replace_block(page: str, name: str, body: str) -> str:
    begin, end = f"<!-- begin: {name} -->", f"<!-- end: {name} -->"
    if begin not in page or end not in page:
        raise ValueError(f"--docs: the page has no {begin} ... {end} block to replace")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", nargs="*", default=[])
    parser.add_argument("--matrix-run")
    parser.add_argument("--chaos", nargs="*", default=[])
    parser.add_argument("--chaos-run")
    parser.add_argument("--docs")
    args = parser.parse_args()
    blocks = {}
    if args.matrix:
        runs = [[json.loads(line) for line in open(p) if line.strip()] for p in args.matrix]
        blocks["fault-matrix"] = matrix_tables(runs, json.load(open(args.matrix_run)))
    if args.chaos:
        reports = [chaos_report(p) for p in args.chaos]
        blocks["chaos"] = chaos_table(reports, json.load(open(args.chaos_run)))
    if not args.docs:
        sys.stdout.write("\n".join(blocks.values()))
        return
    page = open(args.docs).read()
    for name, body in blocks.items():
        page = replace_block(page, name, body)
    with open(args.docs, "w") as f:
        f.write(page)


if __name__ == "__main__":
    main()

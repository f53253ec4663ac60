"""The user guides (docs/guide/): their code is the scripts of docs/snippets/, which the pages
include (MkDocs' snippets extension) and these tests run, so a guide cannot show code that does
not work. At one process here (no launcher: Horovod and torch.distributed at size 1), and under
``horovodrun -np 2`` and ``torchrun --nproc-per-node 2`` in the launch tier. The pages also keep
to what a user guide is: no lab-notebook "round", no deprecated spelling, and every measured
figure or dated run beside a link to the results page that holds its machine and commit; so does
each of the README's headline figures. The settings guide's planner command runs as written, the
usage page names every argument of the constructor, and the benchmarks page every results page."""

import os
import re
import subprocess
import sys

import pytest

from horovod_launch import ROOT, horovodrun, launch_env, needs_horovod
from torchrun_launch import free_port, torchrun

GUIDE = os.path.join(ROOT, "docs", "guide")
SNIPPETS = os.path.join(ROOT, "docs", "snippets")
PAGES = sorted(os.path.join(GUIDE, f) for f in os.listdir(GUIDE) if f.endswith(".md"))
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$')


def code_blocks(text):
    """The ```python blocks of a page, as their lines."""
    return [block.strip().splitlines() for block in re.findall(r"```python\n(.*?)```", text, re.S)]


def test_guide_code_is_only_included_snippets_and_every_snippet_is_shown():
    shown = set()
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            for lines in code_blocks(f.read()):
                match = INCLUDE.match(lines[0]) if len(lines) == 1 else None
                assert match, f"{page}: a python block must include a tested snippet: {lines[:3]}"
                assert os.path.exists(os.path.join(SNIPPETS, match[1])), match[1]
                shown.add(match[1])
    assert shown == {f for f in os.listdir(SNIPPETS) if f.endswith(".py")}


def run_script(script, args, env=None, timeout=180):
    cmd = [sys.executable, os.path.join(SNIPPETS, script), *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=launch_env(env), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def epochs_printed(stdout):
    # horovodrun prefixes each line with its rank ("[0]<stdout>:", "[1,0]<stdout>:").
    line = r"^(?:\[[\d,]+\]<stdout>:)?epoch (\d+): loss of the averaged model"
    return [int(m) for m in re.findall(line, stdout, re.M)]


@pytest.mark.slow
def test_horovod_script_trains_and_resumes_from_its_checkpoint(tmp_path):
    needs_horovod()
    ckpt = str(tmp_path / "ckpt.pt")
    assert epochs_printed(run_script("train_horovod.py", ["--epochs", "2", "--checkpoint", ckpt]))
    # [0, 1] then, resumed from the file, only the epoch that is left.
    out = run_script("train_horovod.py", ["--epochs", "3", "--checkpoint", ckpt])
    assert epochs_printed(out) == [2]


@pytest.mark.slow
def test_torchrun_script_trains_and_resumes_with_a_node_as_worker(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    args = ["--checkpoint", ckpt, "--worker", "node"]
    first = run_script(
        "train_torchrun.py", [*args, "--epochs", "2"], env | {"MASTER_PORT": str(free_port())}
    )
    assert epochs_printed(first) == [0, 1]
    again = run_script(
        "train_torchrun.py", [*args, "--epochs", "3"], env | {"MASTER_PORT": str(free_port())}
    )
    assert epochs_printed(again) == [2]


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_horovod_script_under_horovodrun(tmp_path):
    needs_horovod()
    args = [os.path.join(SNIPPETS, "train_horovod.py"), "--epochs", "2"]
    proc = horovodrun(2, "gloo", [*args, "--checkpoint", str(tmp_path / "ckpt.pt")])
    assert epochs_printed(proc.stdout) == [0, 1]


@pytest.mark.torchdist
@pytest.mark.timeout(400)
def test_torchrun_script_under_torchrun(tmp_path):
    args = [os.path.join(SNIPPETS, "train_torchrun.py"), "--epochs", "2"]
    (proc,) = torchrun(2, [*args, "--checkpoint", str(tmp_path / "ckpt.pt")])
    assert epochs_printed(proc.stdout) == [0, 1]


def nav_pages(section):
    """The pages of one top-level section of mkdocs.yml's nav."""
    import yaml  # mkdocs' own dependency

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.safe_load(f)["nav"]
    (entries,) = [e[section] for e in nav if isinstance(e, dict) and section in e]
    return [p for e in entries for p in e.values()]


# A lab notebook's words: a run's "round", not rounding ("round to nearest", "rounds of gossip").
NOTEBOOK = re.compile(
    r"\b(?:this|last|next|first|second|third|fourth|fifth|earlier|previous|later) rounds?\b"
    r"|\bround's\b",
    re.I,
)
DEPRECATED = re.compile(r'compression="(?:fp16|bf16|int8|fp8|sparse)"|eager=(?:True|False)\b')
# A measured figure: a mean ± spread, a speed-up or a ratio to compute speed ("4.5x sooner";
# not "one host 2x slower", a setting), or a time something took ("the builds took 148 s", "built
# it in about 100 s"; not a budget or a timeout: "6 minutes for the whole run", "deadline 2 s").
FIGURE = re.compile(
    r"\d ± \d|\b\d+(?:\.\d+)?x (?:sooner|faster|compute)"
    r"|\b(?:took|in) (?:about )?\d+(?:\.\d+)?(?:-\d+)? ?(?:ms|s|min|minutes)\b"
)
# A dated record of a run ("2026-11-26 23:00 UTC", "Last run here, 2026-11-26"): it belongs on a
# results page, which the guide links. Dates inside a link's target (an anchor) do not count.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def sections(text):
    """(heading, body) of each section of a page, code blocks left out (a shell comment is not
    a heading)."""
    parts = re.split(r"^(#{1,3} .*)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return list(zip(["(top)", *parts[1::2]], parts[0::2]))


def test_user_guide_pages_read_as_a_guide():
    # Paths, not file names: docs/results/reliability.md is not the guide's reliability.md.
    results = {os.path.normpath(p) for p in nav_pages("Results")}
    problems = []
    for page in nav_pages("User guide"):
        with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
            text = f.read()
        for line in text.splitlines():
            if NOTEBOOK.search(line):
                problems.append(f"{page}: a lab notebook's round: {line.strip()[:100]}")
            if DEPRECATED.search(line) and "eprecat" not in line:
                problems.append(f"{page}: deprecated spelling: {line.strip()[:100]}")
        for heading, body in sections(text):
            targets = re.findall(r"\]\(([^)]+)\)", body)
            here = os.path.dirname(page)
            linked = {os.path.normpath(os.path.join(here, t.split("#")[0])) for t in targets}
            if FIGURE.search(body) and not linked & results:
                problems.append(f"{page}, {heading}: a measured figure without a results link")
            if DATE.search(re.sub(r"\]\([^)]*\)", "]", body)) and not linked & results:
                problems.append(f"{page}, {heading}: a dated record without a results link")
    assert not problems, "\n".join(problems)


def test_readme_headline_figures_link_their_results_pages():
    # The README's front page holds the same care: each paragraph of its headline figures (a
    # table belongs to the paragraph above it) that states a measured figure links the results
    # page with its machine, commit and command.
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    headline = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    paragraphs = []
    for block in headline.strip().split("\n\n"):
        if block.startswith("|") and paragraphs:
            paragraphs[-1] += "\n" + block
        else:
            paragraphs.append(block)
    # Here any ratio, share or time is a figure: the headline section states no settings.
    figure = re.compile(r"\d(?:x\b|%| ?ms\b| s\b)|±")
    unlinked = [p[:80] for p in paragraphs if figure.search(p) and "](docs/results/" not in p]
    assert not unlinked, unlinked


def test_usage_page_names_every_argument():
    # The arguments table of docs/usage.md follows the constructor: a new argument fails here
    # until the page says what it does.
    import inspect

    import hvd_slowmo

    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        table = f.read().split("## Arguments", 1)[1]
    shown = set(re.findall(r"^\| ([^|]+) \|", table, re.M))
    named = {n for cell in shown for n in re.findall(r"`(\w+)", cell)}
    params = inspect.signature(hvd_slowmo.DistributedOptimizer).parameters.values()
    wanted = {p.name for p in params if p.kind is not p.VAR_KEYWORD}
    assert wanted <= named, sorted(wanted - named)


def test_benchmarks_index_links_every_results_page():
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        linked = {t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", f.read())}
    pages = set(nav_pages("Results")) - {"benchmarks.md"}
    assert pages <= linked, sorted(pages - linked)


def test_front_pages_have_no_round_nor_deprecated_spelling():
    # The README, the home page and the list of what was not verified are read as the library's
    # description too.
    problems = []
    for page in ("README.md", "docs/index.md", "docs/limitations.md"):
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            for line in f:
                if NOTEBOOK.search(line):
                    problems.append(f"{page}: a lab notebook's round: {line.strip()[:100]}")
                if DEPRECATED.search(line) and "eprecat" not in line:
                    problems.append(f"{page}: deprecated spelling: {line.strip()[:100]}")
    assert not problems, "\n".join(problems)


def test_the_settings_guide_planner_command_runs(capsys):
    # The first step of "Choose settings for your link" is a command line: run it as written.
    import shlex

    from hvd_slowmo.plan import main

    with open(os.path.join(GUIDE, "settings.md"), encoding="utf-8") as f:
        (command,) = re.findall(r"`(python -m hvd_slowmo\.plan [^`]+)`", f.read())
    argv = shlex.split(" ".join(command.split()))[3:]
    text = main(argv)
    assert "Recommended: " in text and "Its arguments: DistributedOptimizer(" in text

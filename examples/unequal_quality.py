"""Quality with one worker slowed 2x (issue 37): count-based periods against time-based periods,
with the plain and the sample-weighted merge, on MNIST-1D (time to accuracy) and the language
model (validation loss at equal seconds); 4 thread workers, several paired seeds.

    python examples/unequal_quality.py run --task mnist1d --out runs/unequal_quality.jsonl
    python examples/unequal_quality.py run --task lm --out runs/unequal_quality.jsonl --jobs 2
    python examples/unequal_quality.py report runs/unequal_quality.jsonl

Time is emulated (``--emulated-step 1``, examples/unequal.py): a base step takes 1 emulated
second on three workers and 2 on the last, so the step counts, and the evaluations' dates, are a
function of the flags and not of this machine's load. Every policy trains with the same period
length in emulated seconds, so the outer steps (the exchanges) are as many and as frequent in
each; what differs is whether the fast workers idle:

- ``count``: ``tau`` base steps on every worker; a period lasts ``tau x 2`` seconds (the slow
  worker's), the fast workers wait half of it;
- ``time``: ``period_seconds = tau x 2``: the fast workers take ``2 tau`` steps, the slow one
  ``tau``; the plain mean;
- ``time-samples``: the same, the exact average weighted by each worker's samples
  (``merge="samples"``).

Each run's lr schedule is read at the cluster's progress (examples/unequal.py ``schedule_step``),
so every policy decays at the same emulated second. The settings are the tuned ones of the
count-based runs (MNIST-1D: the main job's Local SGD + SlowMo; the language model: the 137K
size's outer Nesterov from docs/regime_lm_sizes.jsonl at tau 16), not tuned again per policy.
One JSON line per finished run (resumable); ``report`` prints per task the final metric at
equal emulated seconds, the time to a target and the paired t-tests against ``count``.
"""

import argparse
import json
import os
import sys
from concurrent.futures import Executor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import regime_map
from launch import run_in_threads

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slowmo_lab.report import fmt_mean_std, mean_std
from slowmo_lab.time_to_accuracy import time_to_accuracy, value_at_seconds

WORKERS = 4
SLOW_FACTOR = 2.0
#: The policies: the flags each adds (``{period}``: tau x the slow factor, emulated seconds).
POLICIES = {
    "count": [],
    "time": ["--period-seconds", "{period}"],
    "time-samples": ["--period-seconds", "{period}", "--merge", "samples"],
}
#: The language model's size: the 137K row of scripts/lm_size_sweep.sh (512 steps).
LM_FLAGS = ["--width", "64", "--layers", "2", "--heads", "4", "--context", "64"]
LM_FLAGS += [
    "--batch-size",
    "16",
    "--steps-per-epoch",
    "32",
    "--epochs",
    "16",
    "--val-batches",
    "4",
]
LM_ROWS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
LM_ROWS = os.path.join(LM_ROWS, "regime_lm_sizes.jsonl")
#: Times to targets: the count-based runs' mean final value less these (accuracy, points) or
#: plus these (loss, nats): from a value reached early to one most seeds reach near the end.
MARGINS = {"mnist1d": (10.0, 5.0, 1.0), "lm": (0.2, 0.1, 0.02)}


def task_flags(task: str) -> tuple[list[str], int]:
    """The training script's flags of a task's Local SGD + SlowMo at its tuned setting, and tau.

    Args:
        task: ``"mnist1d"`` or ``"lm"``.
    """
    if task == "mnist1d":
        import mnist1d_cnn

        tuned, tau = mnist1d_cnn.TUNED["localsgd-slowmo"], 12
        flags = ["--algo", "localsgd", "--slowmo", "--lr", str(tuned["lr"])]
        flags += ["--slow-momentum", str(tuned["slow_momentum"]), "--buffers", tuned["buffers"]]
        return flags, tau
    if task == "lm":
        tau = 16
        outer = regime_map.tuned_outer(regime_map._done(LM_ROWS), LM_FLAGS, tau)
        flags = regime_map.LM_METHODS["local-adamw-slowmo"] + LM_FLAGS + ["--device", "cpu"]
        return flags + ["--slow-lr", str(outer[0]), "--slow-momentum", str(outer[1])], tau
    raise ValueError(f"--task {task!r}: choose mnist1d or lm")


def _run(task: str, policy: str, seed: int, out: str, logdir: str) -> dict[str, Any]:
    """Train one run on thread workers and append its row to ``out``."""
    flags, tau = task_flags(task)
    period = f"{tau * SLOW_FACTOR:g}"
    flags += ["--tau", str(tau), "--seed", str(seed), "--slow-factor", f"{SLOW_FACTOR:g}"]
    flags += ["--emulated-step", "1", *(f.format(period=period) for f in POLICIES[policy])]
    name = f"{task}_{policy}_s{seed}"
    flags += ["--no-progress", "--log-every", "1000000", "--logdir", logdir, "--run-name", name]
    if task == "mnist1d":
        import mnist1d_cnn as script
    else:
        import char_lm as script
    summary = run_in_threads(WORKERS, lambda: script.main(flags))[0]
    metric = "val_accuracy" if task == "mnist1d" else "val_loss"
    row = dict(task=task, policy=policy, seed=seed, tau=tau, slow_factor=SLOW_FACTOR)
    row.update(final=summary[metric], curve=summary["emulated_curve"])
    row.update(steps_all_workers=summary["steps_all_workers"], diverged=summary["diverged"])
    row.update(wall_s=summary["wall_s"], flags=flags)
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")  # one write of one line: safe beside another job's
    print(json.dumps(row), flush=True)
    return row


def run(args: argparse.Namespace, pool: Executor | None = None) -> None:
    """Every policy x seed not yet in ``args.out``, ``args.jobs`` at a time (a process each).

    Args:
        args: the ``run`` command's arguments.
        pool: the executor (default: ``args.jobs`` spawned processes).
    """
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        raise ValueError(f"--policies: {sorted(unknown)} unknown; choose from {list(POLICIES)}")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: needs at least 1 (runs at a time)")
    task_flags(args.task)  # a missing tuning fails here, before any run
    done = {(r["task"], r["policy"], r["seed"]) for r in regime_map._done(args.out)}
    todo = [
        (args.task, policy, seed)
        for seed in range(args.seed_from, args.seed_from + args.seeds)
        for policy in args.policies.split(",")
        if (args.task, policy, seed) not in done
    ]
    regime_map.run_queue(_run, [(*t, args.out, args.logdir) for t in todo], args.jobs, pool)


def report(rows: list[dict[str, Any]]) -> str:
    """Per task: each policy's final metric at equal emulated seconds and its times to targets
    (mean ± std over the seeds every policy finished), with paired t-tests against ``count``.

    Args:
        rows: ``run``'s rows.
    """
    out = []
    for task in sorted({r["task"] for r in rows}):
        lower = task != "mnist1d"
        by = {(r["policy"], r["seed"]): r for r in rows if r["task"] == task}
        policies = [p for p in POLICIES if any(k[0] == p for k in by)]
        seeds = sorted(set.intersection(*({s for (q, s) in by if q == p} for p in policies)))
        if "count" not in policies or not seeds:
            out.append(f"{task}: no seed with every policy and 'count' yet")
            continue
        base = [by["count", s]["final"] for s in seeds]
        sign = 1.0 if lower else -1.0
        targets = [mean_std(base)[0] + sign * m for m in MARGINS[task]]
        horizon = min(by[p, s]["curve"][-1][0] for p in policies for s in seeds)
        unit, spec = ("nats", ".3f") if lower else ("%", ".2f")
        out.append(
            f"\n{task}: {len(seeds)} seeds {seeds}, one worker of {WORKERS} slowed "
            f"{SLOW_FACTOR:g}x, tau {by['count', seeds[0]]['tau']}; the final value at equal "
            f"emulated seconds ({horizon:g}); emulated seconds to each target (count's mean "
            f"{'+' if lower else '-'} {', '.join(f'{m:g}' for m in MARGINS[task])}), over the "
            "seeds that reached it"
        )
        cols = [f"s to {t:{spec}}" for t in targets]
        out.append(f"| policy | final {unit} | vs count (paired) | " + " | ".join(cols) + " |")
        out.append("|---" * (3 + len(cols)) + "|")
        times = {
            p: [[time_to_accuracy(by[p, s]["curve"], t, lower) for s in seeds] for t in targets]
            for p in policies
        }
        tests = []
        for p in policies:
            final = [value_at_seconds(by[p, s]["curve"], horizon) for s in seeds]
            paired = "-" if p == "count" else regime_map._paired(final, base)
            cells = [
                f"{fmt_mean_std(ts, '.0f')} ({sum(x is not None for x in ts)}/{len(seeds)})"
                for ts in times[p]
            ]
            out.append(
                f"| {p} | {fmt_mean_std(final, spec)} | {paired} | " + " | ".join(cells) + " |"
            )
            for t, mine, theirs in zip(targets, times[p], times["count"]):
                pairs = [(a, b) for a, b in zip(mine, theirs) if a is not None and b is not None]
                if p != "count" and pairs:
                    a, b = (list(v) for v in zip(*pairs))
                    tests.append(
                        f"time to {t:{spec}}, {p} against count ({len(pairs)} seeds both "
                        f"reached): {regime_map._paired(a, b)}"
                    )
        if {"time", "time-samples"} <= set(policies):  # what the weights add on their own
            final = {
                p: [value_at_seconds(by[p, s]["curve"], horizon) for s in seeds]
                for p in ("time", "time-samples")
            }
            tests.append(
                "final, time-samples against time (the weights alone): "
                + regime_map._paired(final["time-samples"], final["time"])
            )
        out += tests
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--task", choices=("mnist1d", "lm"), required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--seed-from", type=int, default=0)
    r.add_argument("--policies", default=",".join(POLICIES))
    r.add_argument("--jobs", type=int, default=1, help="runs at a time, a process each")
    r.add_argument("--logdir", default="runs/unequal_quality")
    rep = sub.add_parser("report")
    rep.add_argument("jsonl")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "run":
        run(args)
    else:
        if not os.path.exists(args.jsonl):
            raise ValueError(f"report: {args.jsonl} not found; name run's --out file")
        print(report(regime_map._done(args.jsonl)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The regime map on MNIST-1D (issue 30): per cell (tau, workers), AR-SGD, Local SGD and Local
SGD + SlowMo at equal steps and samples (``--epoch-steps``: the same budget whatever tau is),
on thread workers of this one process (``launch.run_in_threads``: no launcher).

    python examples/regime_map.py run --out runs/regime.jsonl --cells 16x96,16x48
    python examples/regime_map.py report runs/regime.jsonl --png docs/figures/regime_map.png
    python examples/regime_map.py lm --out runs/lm.jsonl --taus 16,64 --seeds 3 -- --width 64
    python examples/regime_map.py lm --out runs/lm.jsonl --methods local-adamw-slowmo \
        --taus 64 --seed-from 100 --outer 0.4/0.9,0.7/0.9,1/0.9 -- --width 64
    python examples/regime_map.py lm --out runs/lm.jsonl --outer tuned --tune-tau 64 \
        --jobs 2 -- --width 64
    python examples/regime_map.py lm-report runs/lm.jsonl --png share.png

``lm`` is the language-model table (examples/char_lm.py on 4 thread workers): AR-AdamW, Local
AdamW with a plain average, and Local AdamW + SlowMo with an outer Nesterov at each ``--outer``
setting (outer lr / momentum; default DiLoCo's 0.7 / 0.9) per tau and seed, the validation loss
at equal steps; flags after ``--`` go to char_lm.py (the model's size, the steps), and a run
is known by them too, so one file holds several sizes. Seeds 100-102 are the tuning seeds;
``--outer tuned`` runs the setting the size's tuning at ``--tune-tau`` chose. ``lm-report``
prints, per size (parameters, steps), the tuning table and the test tables (the tuning seeds
left out), and draws the share of the gap SlowMo wins back against the size.

Every method at every worker count trains with the same peak lr (``--peak-lr``, 0.1: the
value tuned at 4 workers), not the linearly scaled one: at 8 and 16 workers the scaled peak
(0.2, 0.4) left AR-SGD itself unstable in the map's 576 steps. Per cell, SlowMo's beta is tuned
on the validation split (seeds 100-102, beta from ``--betas``, default the paper's grid
0.4..0.8, alpha = 1, the base's lr, buffers reset) with docs/mnist1d_tuning.md's rule: a
setting with a failing seed is rejected (diverged, fell back > 5 points from its best, or
trails its siblings by > 5 points), the best mean among the rest is chosen. Then every method
runs the test seeds. One JSON line per finished run, so an interrupted map keeps what finished.
"""

import argparse
import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import run_in_threads
from mnist1d_cnn import BETA_GRID, LR_BATCH
from mnist1d_cnn import main as mnist1d_main

#: The margin of the tuning rule (points), as slowmo_lab.report.FAIL_MARGIN.
FAIL_MARGIN = 5.0
TUNING_SEEDS = (100, 101, 102)
#: The per-worker batch of examples/mnist1d_cnn.py (its default, which the map keeps).
BATCH = 32


def lr_flag(peak_lr: float, workers: int) -> float:
    """The ``--lr`` that gives examples/mnist1d_cnn.py this peak lr at this worker count.

    The example scales its ``--lr`` by the global batch (``lr x 32 x workers / 128``); the map
    undoes that scaling so that every worker count trains at the same peak lr.

    Args:
        peak_lr: the peak learning rate wanted.
        workers: the worker count.
    """
    if workers < 1:
        raise ValueError(f"workers={workers}: needs at least one worker")
    return peak_lr * LR_BATCH / (BATCH * workers)


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``"4x12,8x96"`` -> ``[(4, 12), (8, 96)]`` (workers x tau).

    Args:
        text: comma-separated ``WORKERSxTAU`` cells.
    """
    cells = []
    for cell in text.split(","):
        try:
            w, t = (int(v) for v in cell.strip().split("x"))
        except ValueError:
            raise ValueError(f"--cells: {cell!r} is not WORKERSxTAU (e.g. 4x96)") from None
        if w < 1 or t < 1:
            raise ValueError(f"--cells: {cell!r} needs workers >= 1 and tau >= 1")
        cells.append((w, t))
    return cells


def _run(out: str, workers: int, tau: int, method: str, seed: int, beta: float, args) -> dict:
    """Train one run on thread workers and append its row to ``out``."""
    flags = ["--tau", str(tau), "--seed", str(seed), "--lr", str(lr_flag(args.peak_lr, workers))]
    flags += ["--batch-size", str(BATCH), "--epoch-steps", str(args.epoch_steps)]
    flags += ["--epochs", str(args.epochs)]
    flags += ["--no-progress", "--log-every", "1000000", "--logdir", args.logdir]
    if method == "allreduce":
        flags += ["--algo", "allreduce", "--no-slowmo"]
    elif method == "localsgd":
        flags += ["--algo", "localsgd", "--no-slowmo", "--buffers", "maintain"]
    else:
        flags += ["--algo", "localsgd", "--slowmo", "--slow-lr", "1", "--buffers", "reset"]
        flags += ["--slow-momentum", str(beta)]
    split = "validation" if seed in TUNING_SEEDS else "test"
    if split == "validation":
        flags.append("--validation")
    name = f"w{workers}_tau{tau}_{method}_b{beta}_s{seed}"
    summary = run_in_threads(workers, lambda: mnist1d_main(flags + ["--run-name", name]))[0]
    row = dict(workers=workers, tau=tau, method=method, beta=beta, seed=seed, split=split)
    row.update(peak_lr=args.peak_lr)
    row.update({k: summary[k] for k in ("val_accuracy", "best_val_accuracy", "train_loss")})
    row.update(train_full_loss=summary.get("train_full_loss"), steps=summary["steps"])
    row.update(diverged=summary["diverged"], wall_s=summary["wall_s"])
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


#: The language-model table's methods: char_lm.py's flags for each (SlowMo's outer lr and
#: momentum are added per run: ``lm --outer``).
LM_METHODS = {
    "ar-adamw": ["--algo", "allreduce", "--no-slowmo"],
    "local-adamw": ["--algo", "localsgd", "--no-slowmo"],
    "local-adamw-slowmo": ["--algo", "localsgd", "--slowmo", "--outer-optimizer", "nesterov"],
}
#: DiLoCo's outer Nesterov (outer lr, momentum): the starting point, and the setting of the rows
#: written before ``--outer`` existed.
DILOCO_OUTER = (0.7, 0.9)


def parse_outer(text: str) -> list[tuple[float, float]]:
    """``"0.7/0.9,1/0.8"`` -> ``[(0.7, 0.9), (1.0, 0.8)]`` (SlowMo's outer lr / momentum).

    Args:
        text: comma-separated ``LR/MOMENTUM`` pairs.
    """
    pairs = []
    for item in text.split(","):
        try:
            lr, mom = (float(v) for v in item.strip().split("/"))
        except ValueError:
            raise ValueError(f"--outer: {item!r} is not LR/MOMENTUM (e.g. 0.7/0.9)") from None
        if not (lr > 0 and 0 <= mom < 1):
            raise ValueError(f"--outer: {item!r} needs an outer lr > 0 and 0 <= momentum < 1")
        pairs.append((lr, mom))
    return pairs


def lm_outer(row: dict) -> tuple[float, float] | None:
    """A language-model row's SlowMo setting (outer lr, momentum); None for the other methods.

    Args:
        row: a row of ``lm``'s JSON lines.
    """
    if row["method"] != "local-adamw-slowmo":
        return None
    return (row.get("slow_lr", DILOCO_OUTER[0]), row.get("slow_momentum", DILOCO_OUTER[1]))


def lm_run_key(row: dict) -> tuple:
    """A language-model row's run: (method, tau, seed, outer setting, char_lm.py's flags).

    Args:
        row: a row of ``lm``'s JSON lines.
    """
    return (row["method"], row["tau"], row["seed"], lm_outer(row), tuple(row.get("flags", ())))


def tuned_outer(rows: list[dict], flags: list[str], tau: int) -> tuple[float, float]:
    """The outer setting :func:`lm_tuning` chose at ``tau`` among the rows of one size (the
    rows run with char_lm.py's ``flags``).

    Args:
        rows: ``lm``'s rows.
        flags: char_lm.py's flags of the size (the size, the steps).
        tau: the tau the tuning ran at (``--tune-tau``).
    """
    same = [r for r in rows if tuple(r.get("flags", ())) == tuple(flags)]
    chosen = lm_tuning(same)[1].get(tau)
    if chosen is None:
        raise ValueError(
            f"--outer tuned: no complete tuning at tau {tau} for the flags {flags}; run the "
            f"grid first (--methods local-adamw-slowmo --taus {tau} --seed-from "
            f"{TUNING_SEEDS[0]} --seeds {len(TUNING_SEEDS)} --outer LR/MOM,...) or name --outer"
        )
    return chosen


def _lm_run(args, method: str, tau: int, seed: int, outer: tuple[float, float] | None) -> dict:
    """Train one language-model run on thread workers and append its row to ``args.out``."""
    import char_lm

    flags = LM_METHODS[method] + ["--tau", str(tau), "--seed", str(seed)]
    name = f"{method}_tau{tau}_s{seed}"
    if outer is not None:
        flags += ["--slow-lr", str(outer[0]), "--slow-momentum", str(outer[1])]
        name += f"_o{outer[0]:g}m{outer[1]:g}"
    flags += ["--no-progress", "--log-every", "1000000", "--device", "cpu"]
    flags += ["--logdir", args.logdir, "--run-name", name]
    flags += args.lm_flags
    summary = run_in_threads(args.workers, lambda: char_lm.main(flags))[0]
    row = dict(method=method, tau=tau, seed=seed, workers=args.workers)
    if outer is not None:
        row.update(slow_lr=outer[0], slow_momentum=outer[1])
    row.update({k: summary[k] for k in ("val_loss", "train_loss", "steps", "wall_s")})
    row.update(diverged=summary["diverged"], params=summary["params"])
    row.update(corpus_sha256=summary["corpus_sha256"], flags=args.lm_flags)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")  # one write of one line: safe beside another job's
    print(json.dumps(row), flush=True)
    return row


def run_lm(args, pool: Executor | None = None) -> None:
    """Per seed: AR-AdamW once (it does not depend on tau), then per tau Local AdamW and Local
    AdamW + SlowMo at each ``--outer`` setting (``tuned``: the one the size's tuning at
    ``--tune-tau`` chose); ``args.jobs`` runs at a time, each in a process of its own (``pool``:
    another executor, for tests); one JSON line per finished run, finished runs are not run
    again.

    Args:
        args: the ``lm`` command's arguments.
        pool: the executor (default: ``args.jobs`` spawned processes).
    """
    unknown = set(args.methods.split(",")) - set(LM_METHODS)
    if unknown:
        raise ValueError(f"--methods: {sorted(unknown)} unknown; choose from {list(LM_METHODS)}")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: needs at least 1 (runs at a time)")
    rows = _done(args.out)
    if args.outer == "tuned":
        outers = [tuned_outer(rows, args.lm_flags, args.tune_tau)]
    else:
        outers = parse_outer(args.outer)
    # A run is its method, tau, seed, outer setting and char_lm.py's flags (the size, the
    # steps): one file holds several sizes.
    done = {lm_run_key(r) for r in rows}
    taus = [int(t) for t in args.taus.split(",")]
    todo = []
    for seed in range(args.seed_from, args.seed_from + args.seeds):
        plan: list[tuple[str, int, tuple[float, float] | None]] = [("ar-adamw", taus[0], None)]
        for t in taus:
            plan.append(("local-adamw", t, None))
            plan += [("local-adamw-slowmo", t, o) for o in outers]
        todo += [
            (method, tau, seed, outer)
            for method, tau, outer in plan
            if method in args.methods.split(",")
            and (method, tau, seed, outer, tuple(args.lm_flags)) not in done
        ]
    run_queue(_lm_run, [(args, *run) for run in todo], args.jobs, pool)


def run_queue(fn, calls: list[tuple], jobs: int, pool: Executor | None = None) -> None:
    """``fn(*call)`` for every call, ``jobs`` at a time, each in a process of its own; a call
    that raises stops the queue (the running ones finish) and is raised here.

    Args:
        fn: a module-level function (spawned processes import it).
        calls: its arguments, one tuple per run.
        jobs: runs at a time.
        pool: the executor (default: ``jobs`` spawned processes; tests pass another).
    """
    pool = pool or ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        futures = [pool.submit(fn, *call) for call in calls]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def lm_paired(rows: list[dict], outer: tuple[float, float]) -> dict[int, dict[str, list]]:
    """Per tau with test runs of all three methods: the seeds every method finished and their
    validation losses in seed order (AR-AdamW's from any tau: it does not depend on tau).

    Args:
        rows: ``lm``'s rows of one size (the tuning seeds, TUNING_SEEDS, are left out).
        outer: SlowMo's setting (outer lr, momentum).

    Returns:
        ``{tau: {"seeds", "ar", "lo", "sm"}}``, the last three lists of losses.
    """
    by = {
        (r["method"], r["tau"], r["seed"]): r["val_loss"]
        for r in rows
        if r["seed"] not in TUNING_SEEDS and lm_outer(r) in (None, outer)
    }
    ar = {s: v for (m, _, s), v in by.items() if m == "ar-adamw"}
    out = {}
    for tau in sorted({t for (m, t, _) in by if m != "ar-adamw"}):
        lo = {s: v for (m, t, s), v in by.items() if m == "local-adamw" and t == tau}
        sm = {s: v for (m, t, s), v in by.items() if m == "local-adamw-slowmo" and t == tau}
        seeds = sorted(set(ar) & set(lo) & set(sm))
        if seeds:
            out[tau] = {"seeds": seeds} | {
                k: [d[s] for s in seeds] for k, d in (("ar", ar), ("lo", lo), ("sm", sm))
            }
    return out


def won_back(paired: dict[str, list]) -> float | None:
    """The share of Local AdamW's mean gap to AR-AdamW that SlowMo wins back (1: all of it);
    None where there is no gap to win back.

    Args:
        paired: one tau of :func:`lm_paired`.
    """
    n = len(paired["seeds"])
    gap = (sum(paired["lo"]) - sum(paired["ar"])) / n
    return (sum(paired["lo"]) - sum(paired["sm"])) / n / gap if gap > 0 else None


def lm_table(rows: list[dict], outer: tuple[float, float] = DILOCO_OUTER) -> str:
    """The language-model table: validation loss (nats per byte, mean ± std over the seeds
    every method of that tau finished) per tau, with paired t-tests of each difference and
    the share of Local AdamW's gap to AR-AdamW that SlowMo wins back.

    Args:
        rows: ``lm``'s rows of one size (the tuning seeds, TUNING_SEEDS, are left out).
        outer: the SlowMo setting (outer lr, momentum) the table shows.
    """
    lines = [
        f"| tau | seeds | AR-AdamW | Local AdamW | + SlowMo (Nesterov {outer[0]:g}/{outer[1]:g}) "
        "| local - AR (paired) | SlowMo - local (paired) | won back |",
        "|---" * 8 + "|",
    ]
    for tau, p in lm_paired(rows, outer).items():
        a, b, c = p["ar"], p["lo"], p["sm"]
        gap, change = (sum(b) - sum(a)) / len(a), (sum(c) - sum(b)) / len(a)
        share = won_back(p)
        lines.append(
            f"| {tau} | {len(a)} | {_mean_std(a, 3)} | {_mean_std(b, 3)} | "
            f"{_mean_std(c, 3)} | {gap:+.3f} ({_paired(b, a)}) | "
            f"{change:+.3f} ({_paired(c, b)}) | {'-' if share is None else f'{share:.0%}'} |"
        )
    return "\n".join(lines)


def lm_sizes(rows: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """The rows by size, (parameters, steps), smallest first; a run recorded twice (two files
    read together) is kept once, the first.

    Args:
        rows: ``lm``'s rows, of one file or several.
    """
    out: dict[tuple[int, int], list[dict]] = {}
    seen = set()
    for r in rows:
        key = (r["params"], r["steps"])
        if (key, lm_run_key(r)) not in seen:
            seen.add((key, lm_run_key(r)))
            out.setdefault(key, []).append(r)
    return dict(sorted(out.items()))


def lm_report(rows: list[dict], tune_tau: int) -> tuple[str, dict[int, dict[int, tuple]]]:
    """Per size: its tuning table, and its test tables, the setting its tuning at ``tune_tau``
    chose first (every tested setting: the others are shown too, labelled by their setting).

    Args:
        rows: ``lm``'s rows, of one size or several.
        tune_tau: the tau whose tuning picks the size's setting.

    Returns:
        (the text, ``{params: {tau: (share won back or None, seeds)}}`` at the chosen setting).
    """
    parts, shares = [], {}
    for (params, steps), rs in lm_sizes(rows).items():
        flags = " ".join(rs[0].get("flags", []))
        parts.append(f"## {params:,} parameters, {steps} steps: {flags}")
        tuning, chosen = lm_tuning(rs)
        if tuning.count("\n") > 1:
            parts.append(f"Tuning (seeds {TUNING_SEEDS[0]}-{TUNING_SEEDS[-1]}):\n{tuning}")
        outer = chosen.get(tune_tau)
        tested = {lm_outer(r) for r in rs if r["seed"] not in TUNING_SEEDS} - {None}
        if outer is None:
            parts.append(f"Not tuned at tau {tune_tau} (yet): the table of every tested setting.")
        elif outer not in tested:
            parts.append(f"Tuned at tau {tune_tau}: {outer[0]:g}/{outer[1]:g}; no test run yet.")
        else:
            paired = lm_paired(rs, outer)
            shares[params] = {t: (won_back(p), len(p["seeds"])) for t, p in paired.items()}
        for o in sorted(tested, key=lambda o: o != outer):
            parts.append(lm_table(rs, o))
    return "\n\n".join(parts), shares


def share_figure(shares: dict[int, dict[int, tuple]], png: str) -> None:
    """The share of Local AdamW's gap that SlowMo wins back against the model's size, a line
    per tau, each point labelled with its paired seeds (:func:`lm_report`'s ``shares``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for tau in sorted({t for per in shares.values() for t in per}):
        pts = [
            (p, per[tau])
            for p, per in sorted(shares.items())
            if per.get(tau, (None,))[0] is not None
        ]
        ax.plot([p for p, _ in pts], [100 * s for _, (s, _) in pts], "o-", label=f"tau {tau}")
        for p, (s, n) in pts:
            ax.annotate(f"{n} seeds", (p, 100 * s), textcoords="offset points", xytext=(4, 4))
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("gap won back by SlowMo (%)")
    ax.set_title("Byte-level LM, 4 workers: Local AdamW's gap to AR-AdamW\nthat SlowMo wins back")
    if shares:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def lm_tuning(rows: list[dict]) -> tuple[str, dict[int, tuple[float, float]]]:
    """The outer lr / momentum tuning of the language model: per tau and setting, the mean ±
    std validation loss over the tuning seeds (all of them finished, none diverged), and per
    tau the setting with the lowest mean.

    Args:
        rows: ``lm``'s rows; only SlowMo's on the tuning seeds (TUNING_SEEDS) count.

    Returns:
        (a markdown table, tau -> the chosen (outer lr, momentum)).
    """
    # A run recorded twice (a sweep restarted while it ran) counts once, its first row: else its
    # setting would hold more rows than seeds and never be chosen.
    runs: dict[tuple[int, tuple[float, float]], dict[int, dict]] = {}
    for r in rows:
        outer = lm_outer(r)
        if outer is not None and r["seed"] in TUNING_SEEDS:
            runs.setdefault((r["tau"], outer), {}).setdefault(r["seed"], r)
    lines = ["| tau | outer lr | momentum | seeds | validation loss |", "|---" * 5 + "|"]
    best: dict[int, tuple[float, tuple[float, float]]] = {}
    for (tau, outer), by_seed in sorted(runs.items()):
        rs = list(by_seed.values())
        losses = [r["val_loss"] for r in rs]
        ok = len(rs) == len(TUNING_SEEDS) and not any(
            r["diverged"] or not math.isfinite(r["val_loss"]) for r in rs
        )
        cell = _mean_std(losses, 3) + ("" if ok else " (incomplete or diverged: not chosen)")
        lines.append(f"| {tau} | {outer[0]:g} | {outer[1]:g} | {len(rs)} | {cell} |")
        mean = sum(losses) / len(losses)
        if ok and (tau not in best or mean < best[tau][0]):
            best[tau] = (mean, outer)
    return "\n".join(lines), {tau: outer for tau, (_, outer) in best.items()}


def _fails(rows: list[dict]) -> bool:
    finals = [r["val_accuracy"] for r in rows]
    for i, r in enumerate(rows):
        if r["diverged"] or not math.isfinite(r["val_accuracy"]):
            return True
        if r["val_accuracy"] < (r["best_val_accuracy"] or 0) - FAIL_MARGIN:
            return True
        others = finals[:i] + finals[i + 1 :]
        if others and r["val_accuracy"] < max(others) - FAIL_MARGIN:
            return True
    return False


def _done(out: str) -> list[dict]:
    if not os.path.exists(out):
        return []
    with open(out, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _key(r: dict) -> tuple:
    """A row's run: (workers, tau, method, seed, beta)."""
    return (r["workers"], r["tau"], r["method"], r["seed"], r["beta"])


def choose_beta(have: dict[tuple, dict], w: int, t: int, betas: list[float]) -> dict | None:
    """The tuning of cell (w, t) from its finished runs: None while a tuning run is missing,
    else ``{"beta": the chosen beta or None (every setting failed), "means": {beta: mean}}``.

    Args:
        have: finished rows by :func:`_key`.
        w: workers.
        t: tau.
        betas: the grid.
    """
    means: dict[float, float] = {}
    for b in betas:
        rows = [have.get((w, t, "slowmo", s, b)) for s in TUNING_SEEDS]
        if any(r is None for r in rows):
            return None
        if not _fails(rows):
            means[b] = sum(r["val_accuracy"] for r in rows) / len(rows)
    return {"beta": max(means, key=means.get, default=None), "means": means}


def ready_runs(args, have: dict[tuple, dict]) -> list[tuple]:
    """Every run still needed that can start now, in priority order: cell by cell, its tuning
    runs, AR-SGD's and Local SGD's test runs, and SlowMo's test runs once its tuning finished.

    Args:
        args: the ``run`` command's arguments.
        have: finished rows by :func:`_key`.
    """
    betas = [float(b) for b in args.betas.split(",")]
    out: list[tuple] = []
    for w, t in parse_cells(args.cells):
        if args.beta is not None:
            beta = args.beta
        else:
            out += [(w, t, "slowmo", s, b) for b in betas for s in TUNING_SEEDS]
            tuning = choose_beta(have, w, t, betas)
            beta = tuning["beta"] if tuning else None
        for s in range(args.seeds):
            out += [(w, 12, "allreduce", s, 0.0), (w, t, "localsgd", s, 0.0)]  # AR: any tau
            if beta is not None:
                out.append((w, t, "slowmo", s, beta))
    return [r for i, r in enumerate(out) if r not in have and r not in out[:i]]


def run(args, pool: Executor | None = None) -> None:
    """Run the cells' runs, ``args.jobs`` at a time, each in a process of its own (``pool``:
    another executor, for tests), appending each finished run's row to ``args.out``; what
    ``args.out`` already holds is not run again.

    Args:
        args: the ``run`` command's arguments.
        pool: the executor (default: ``args.jobs`` spawned processes).
    """
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: needs at least 1 (runs at a time)")
    pool = pool or ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
    running: dict[tuple, Future] = {}
    told: set[tuple] = set()
    with pool:
        while True:
            have = {_key(r): r for r in _done(args.out) if r.get("peak_lr") == args.peak_lr}
            for w, t in parse_cells(args.cells):
                betas = [float(b) for b in args.betas.split(",")]
                tuning = None if args.beta is not None else choose_beta(have, w, t, betas)
                if tuning and (w, t) not in told:
                    told.add((w, t))
                    print(f"cell {w}x{t}: beta chosen {tuning['beta']} from {tuning['means']}")
            todo = [r for r in ready_runs(args, have) if r not in running]
            for r in todo[: max(0, args.jobs - len(running))]:
                running[r] = pool.submit(_run, args.out, *r, args)
            if not running:
                return
            finished, _ = wait(list(running.values()), return_when=FIRST_COMPLETED)
            for r, f in list(running.items()):
                if f in finished:
                    del running[r]
                    f.result()  # a run that raised stops the map (the others finish first)


def _mean_std(v: list[float], digits: int = 2) -> str:
    if not v:
        return "-"
    m = sum(v) / len(v)
    sd = (sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def _paired(a: list[float], b: list[float]) -> str:
    """Paired t-test of a - b over seeds: "t = .., p = .." (scipy), or why not."""
    if len(a) < 2:
        return "n < 2"
    diff = [x - y for x, y in zip(a, b)]
    if max(diff) - min(diff) <= 1e-9 * max(1.0, abs(diff[0])):
        return "the same difference on every seed: no t"
    from scipy.stats import ttest_rel

    res = ttest_rel(a, b)
    return f"t = {res.statistic:.2f}, p = {res.pvalue:.3f}"


def cell_stats(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """Per cell (workers, tau) with test runs of all three methods: the paired seeds' numbers.

    AR-SGD does not depend on tau: its runs of a worker count (recorded at tau 12) are the
    reference of every cell of that count. Only seeds that all three methods finished count.

    Args:
        rows: the driver's JSON lines.

    Returns:
        ``{(workers, tau): {"seeds", "beta", "acc", "loss"}}`` with ``acc`` and ``loss`` dicts
        ``{"ar", "lo", "sm"}`` of lists in seed order.
    """
    test = [r for r in rows if r["split"] == "test"]
    by: dict[tuple, dict[int, dict]] = {}
    for r in test:
        by.setdefault((r["workers"], r["tau"], r["method"]), {})[r["seed"]] = r
    out = {}
    for w, t in sorted({(r["workers"], r["tau"]) for r in test if r["method"] != "allreduce"}):
        runs = {
            "ar": by.get((w, 12, "allreduce"), {}),
            "lo": by.get((w, t, "localsgd"), {}),
            "sm": by.get((w, t, "slowmo"), {}),
        }
        seeds = sorted(set(runs["ar"]) & set(runs["lo"]) & set(runs["sm"]))
        if not seeds:
            continue
        out[(w, t)] = {
            "seeds": seeds,
            "beta": runs["sm"][seeds[0]]["beta"],
            "acc": {k: [d[s]["val_accuracy"] for s in seeds] for k, d in runs.items()},
            "loss": {k: [d[s]["train_full_loss"] for s in seeds] for k, d in runs.items()},
        }
    return out


TABLE_HEAD = (
    "| workers | tau | seeds | AR-SGD | Local SGD | + SlowMo (beta) | base - AR (paired) | "
    "SlowMo - base (paired) | train loss AR / base / SlowMo |\n" + "|---" * 9 + "|"
)


def table_row(cell: tuple[int, int], st: dict) -> str:
    """One cell's markdown row (see :func:`cell_stats` for ``st``)."""
    acc = st["acc"]
    gap = [a - b for a, b in zip(acc["lo"], acc["ar"])]
    diff = [a - b for a, b in zip(acc["sm"], acc["lo"])]
    return (
        f"| {cell[0]} | {cell[1]} | {len(st['seeds'])} | {_mean_std(acc['ar'])} | "
        f"{_mean_std(acc['lo'])} | {_mean_std(acc['sm'])} ({st['beta']}) | "
        f"{sum(gap) / len(gap):+.2f} ({_paired(acc['lo'], acc['ar'])}) | "
        f"{sum(diff) / len(diff):+.2f} ({_paired(acc['sm'], acc['lo'])}) | "
        + " / ".join(f"{sum(v) / len(v):.3f}" for v in st["loss"].values())
        + " |"
    )


def cells_table(rows: list[dict]) -> tuple[str, dict]:
    """The markdown table of every cell with test runs, and {(workers, tau): SlowMo's change}."""
    stats = cell_stats(rows)
    change = {
        c: sum(a - b for a, b in zip(st["acc"]["sm"], st["acc"]["lo"])) / len(st["seeds"])
        for c, st in stats.items()
    }
    return "\n".join([TABLE_HEAD] + [table_row(c, st) for c, st in stats.items()]), change


def clearest_cell(rows: list[dict]) -> tuple[int, int] | None:
    """The cell where SlowMo's change over its base is most significant (the smallest paired
    p-value over seeds, either sign; ties: the larger mean change), among cells with >= 3
    paired seeds; None if there is none.

    Args:
        rows: the driver's JSON lines.
    """
    from scipy.stats import ttest_rel

    best, best_key = None, None
    for cell, st in cell_stats(rows).items():
        sm, lo = st["acc"]["sm"], st["acc"]["lo"]
        if len(sm) < 3:
            continue
        diff = [a - b for a, b in zip(sm, lo)]
        if all(d == diff[0] for d in diff):  # no spread: the t-test is undefined
            p = 0.0 if diff[0] else 1.0
        else:
            p = float(ttest_rel(sm, lo).pvalue)
        k = (p, -abs(sum(diff) / len(diff)))
        if best_key is None or k < best_key:
            best, best_key = cell, k
    return best


def heat_map(change: dict, png: str) -> None:
    """SlowMo's mean change (points) per cell; cells without test runs are marked not run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    taus, workers = [12, 24, 48, 96], [4, 8, 16]
    grid = np.full((len(workers), len(taus)), np.nan)
    for (w, t), v in change.items():
        grid[workers.index(w), taus.index(t)] = v
    fig, ax = plt.subplots(figsize=(6, 3.2))
    lim = max(1.0, float(np.nanmax(np.abs(grid)))) if change else 1.0
    im = ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim)
    for i in range(len(workers)):
        for j in range(len(taus)):
            v = grid[i, j]
            ax.text(j, i, "not run" if np.isnan(v) else f"{v:+.1f}", ha="center", va="center")
    ax.set_xticks(range(len(taus)), [str(t) for t in taus])
    ax.set_yticks(range(len(workers)), [str(w) for w in workers])
    ax.set_xlabel("tau")
    ax.set_ylabel("workers")
    ax.set_title("MNIST-1D test acc.: Local SGD + SlowMo minus Local SGD (points)")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def parser() -> argparse.ArgumentParser:
    """The driver's command line."""
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--cells", default="16x96,16x48,8x96,8x48,16x24,4x96")
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--jobs", type=int, default=1, help="runs at a time, a process each")
    r.add_argument("--epoch-steps", type=int, default=36)
    r.add_argument("--epochs", type=int, default=16)
    r.add_argument("--logdir", default="runs/regime")
    r.add_argument(
        "--peak-lr", type=float, default=0.1, help="the peak lr of every method and worker count"
    )
    r.add_argument(
        "--betas",
        default=",".join(str(b) for b in BETA_GRID),
        help="SlowMo's tuning grid (comma-separated; default the paper's 0.4..0.8)",
    )
    r.add_argument(
        "--beta",
        type=float,
        default=None,
        help="skip the per-cell tuning and use this beta everywhere (a shortcut: say so)",
    )
    rep = sub.add_parser("report")
    rep.add_argument("jsonl")
    rep.add_argument("--png", default=None)
    lm = sub.add_parser("lm")
    lm.add_argument("--out", required=True)
    lm.add_argument("--taus", default="16,64")
    lm.add_argument("--seeds", type=int, default=3)
    lm.add_argument("--seed-from", type=int, default=0, help="seeds SEED_FROM..+SEEDS-1")
    lm.add_argument(
        "--methods", default=",".join(LM_METHODS), help=f"a subset of {','.join(LM_METHODS)}"
    )
    lm.add_argument(
        "--outer",
        default="{:g}/{:g}".format(*DILOCO_OUTER),
        help="SlowMo's settings, OUTER_LR/MOMENTUM pairs, comma-separated (default: DiLoCo's), "
        "or 'tuned': the one the size's tuning rows in --out chose at --tune-tau",
    )
    lm.add_argument("--tune-tau", type=int, default=16, help="the tau of --outer tuned's tuning")
    lm.add_argument("--jobs", type=int, default=1, help="runs at a time, a process each")
    lm.add_argument("--workers", type=int, default=4)
    lm.add_argument("--logdir", default="runs/regime_lm")
    lm.add_argument("lm_flags", nargs="*", help="after --: char_lm.py's flags (size, steps)")
    lm_rep = sub.add_parser("lm-report")
    lm_rep.add_argument("jsonl", nargs="+", help="lm's rows (several files: read together)")
    lm_rep.add_argument("--tune-tau", type=int, default=16, help="the tau whose tuning is used")
    lm_rep.add_argument("--png", default=None, help="the figure of the share won back per size")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "run":
        run(args)
        return 0
    if args.cmd == "lm":
        run_lm(args)
        return 0
    if args.cmd == "lm-report":
        missing = [p for p in args.jsonl if not os.path.exists(p)]
        if missing:
            raise ValueError(f"lm-report: {missing} not found; name lm's --out files")
        text, shares = lm_report([r for p in args.jsonl for r in _done(p)], args.tune_tau)
        print(text)
        if args.png:
            share_figure(shares, args.png)
        return 0
    table, change = cells_table(_done(args.jsonl))
    print(table)
    if args.png:
        heat_map(change, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

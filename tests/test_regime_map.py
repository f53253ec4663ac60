"""examples/regime_map.py (the regime map's driver) and compare.py's recorded cell, with the
training replaced by a fake whose accuracies are written by hand: the lr rule, the per-cell
beta tuning with the failing-seed rule, resuming from the JSON lines, the paired table and the
clearest cell."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import char_lm  # noqa: E402
import compare  # noqa: E402
import mnist1d_cnn  # noqa: E402
import regime_map  # noqa: E402

#: Validation accuracy of SlowMo per beta and tuning seed: 0.8 is best on average but seed 101
#: trails its siblings by > 5 points, so the rule rejects it and 0.6 wins.
TUNING = {0.4: (80.0, 81.0, 79.0), 0.6: (85.0, 86.0, 84.0), 0.8: (95.0, 70.0, 95.0)}


def fake_training(calls: list[list[str]]):
    """A stand-in for mnist1d_cnn.main: records its flags, returns a hand-made summary."""

    def main(flags: list[str]) -> dict:
        calls.append(flags)
        value = lambda name: flags[flags.index(name) + 1]  # noqa: E731
        seed, algo = int(value("--seed")), value("--algo")
        if "--validation" in flags:
            acc = TUNING[float(value("--slow-momentum"))][seed - 100]
        elif algo == "allreduce":
            acc = 90.0 + seed
        elif "--slowmo" in flags:
            acc = 86.0 + seed + (seed % 2)  # +1 or +2 over the base: over seeds 0-4, +1.4
        else:
            acc = 85.0 + seed
        return dict(
            val_accuracy=acc,
            best_val_accuracy=acc,
            train_loss=0.5,
            train_full_loss=0.5,
            steps=576,
            diverged=False,
            wall_s=1.0,
        )

    return main


def run_map(argv: list[str]) -> None:
    """The driver's ``run``, its runs on threads of this process (where the fake applies)."""
    args = regime_map.parser().parse_args(argv)
    regime_map.run(args, pool=ThreadPoolExecutor(args.jobs))


@pytest.fixture
def fake(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(regime_map, "mnist1d_main", fake_training(calls))
    monkeypatch.setattr(regime_map, "run_in_threads", lambda n, fn: [fn()])
    return calls


def test_every_worker_count_trains_at_the_same_peak_lr():
    for workers in (4, 8, 16):
        lr = regime_map.lr_flag(0.1, workers)
        # mnist1d_cnn.py's own scaling of --lr, at the map's per-worker batch
        peak = lr * regime_map.BATCH * workers / mnist1d_cnn.LR_BATCH
        assert peak == pytest.approx(0.1, rel=1e-12)
    assert regime_map.lr_flag(0.1, 4) == pytest.approx(0.1)
    assert regime_map.lr_flag(0.1, 16) == pytest.approx(0.025)


def test_cells_parse_and_bad_cells_are_named():
    with pytest.raises(ValueError, match="--jobs 0"):
        regime_map.run(regime_map.parser().parse_args(["run", "--out", "x", "--jobs", "0"]))
    assert regime_map.parse_cells("4x12, 8x96") == [(4, 12), (8, 96)]
    with pytest.raises(ValueError, match="'4-12'"):
        regime_map.parse_cells("4-12")
    with pytest.raises(ValueError, match="tau >= 1"):
        regime_map.parse_cells("4x0")


def test_run_tunes_beta_with_the_failing_seed_rule_then_runs_the_test_seeds(tmp_path, fake):
    out = str(tmp_path / "map.jsonl")
    argv = ["run", "--out", out, "--cells", "8x48", "--betas", "0.4,0.6,0.8", "--seeds", "3"]
    argv += ["--logdir", str(tmp_path), "--jobs", "3"]
    run_map(argv)
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 9 + 3 * 3  # 3 betas x 3 tuning seeds, then 3 methods x 3 test seeds
    assert {r["peak_lr"] for r in rows} == {0.1}
    tuning = [r for r in rows if r["split"] == "validation"]
    assert sorted({r["beta"] for r in tuning}) == [0.4, 0.6, 0.8]
    test_slowmo = [r for r in rows if r["split"] == "test" and r["method"] == "slowmo"]
    assert {r["beta"] for r in test_slowmo} == {0.6}  # 0.8 has the better mean but a failing seed
    for flags in fake:  # 8 workers: --lr 0.05 gives the peak 0.1; the map's equal budget
        assert float(flags[flags.index("--lr") + 1]) == pytest.approx(0.05)
        assert flags[flags.index("--epoch-steps") + 1] == "36"
    ar = [f for f in fake if "allreduce" in f]
    assert len(ar) == 3 and all("--validation" not in f for f in ar)
    # SlowMo's test runs start only once the whole tuning finished
    first_test_slowmo = min(
        i for i, f in enumerate(fake) if "--slowmo" in f and "--validation" not in f
    )
    assert sum("--validation" in f for f in fake[:first_test_slowmo]) == 9

    # Resuming runs nothing that finished.
    n = len(fake)
    run_map(argv)
    assert len(fake) == n and len(open(out).readlines()) == len(rows)


def test_table_and_clearest_cell_from_the_rows(tmp_path, fake):
    out = str(tmp_path / "map.jsonl")
    argv = ["run", "--out", out, "--cells", "4x24", "--betas", "0.4", "--seeds", "5"]
    run_map(argv + ["--logdir", str(tmp_path), "--jobs", "2"])
    rows = [json.loads(line) for line in open(out)]
    # a second cell whose SlowMo rows equal the base's: no effect, not the clearest
    for r in [r for r in rows if r["split"] == "test" and r["method"] != "allreduce"]:
        copy = dict(r, tau=96)
        if r["method"] == "slowmo":
            copy["val_accuracy"] = 85.0 + r["seed"]
        rows.append(copy)
    table, change = regime_map.cells_table(rows)
    assert change[(4, 24)] == pytest.approx(1.4)  # seeds 0..4: +1, +2, +1, +2, +1
    assert change[(4, 96)] == 0.0
    line = table.splitlines()[2]
    head = "| 4 | 24 | 5 | 92.00 ± 1.58 | 87.00 ± 1.58 | 88.40 ± 1.67 (0.4) | -5.00"
    assert line.startswith(head)
    assert regime_map.clearest_cell(rows) == (4, 24)

    path = tmp_path / "recorded.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    missing = str(tmp_path / "missing.jsonl")
    text = compare.recorded_regime_cell([missing, str(path)])
    assert text.startswith("Recorded, not run now") and "4 workers x tau 24" in text
    assert line in text and "--cells 4x24" in text and "beta tuned on the validation" in text
    untuned = tmp_path / "untuned.jsonl"
    untuned.write_text("".join(json.dumps(r) + "\n" for r in rows if r["split"] == "test"))
    text = compare.recorded_regime_cell([str(untuned)])
    assert "beta fixed at 0.4, NOT tuned" in text and "--beta 0.4 --peak-lr 0.1" in text
    assert compare.recorded_regime_cell([missing]) is None


def test_lm_table_pairs_the_seeds_every_method_finished():
    rows = [dict(method="ar-adamw", tau=16, seed=s, val_loss=2.0 + s) for s in range(3)]
    rows += [
        dict(method="local-adamw", tau=t, seed=s, val_loss=2.5 + s)
        for t in (16, 64)
        for s in range(3)
    ]
    rows += [
        dict(method="local-adamw-slowmo", tau=16, seed=s, val_loss=2.2 + s + 0.1 * s)
        for s in range(2)
    ]
    lines = regime_map.lm_table(rows).splitlines()
    assert len(lines) == 3  # tau 64 has no SlowMo run: no row; tau 16 pairs seeds 0 and 1
    assert lines[2].startswith("| 16 | 2 | 2.500 ± 0.707 | 3.000 ± 0.707 | 2.750 ± 0.778 | +0.500")
    assert lines[2].endswith("| -0.250 (t = -5.00, p = 0.126) | 50% |")  # of the 0.5 gap


def test_lm_outer_settings_are_parsed_and_tuned():
    assert regime_map.parse_outer("0.7/0.9, 1/0.8") == [(0.7, 0.9), (1.0, 0.8)]
    for bad in ("0.7", "0.7/1.0", "0/0.9", "a/b"):
        with pytest.raises(ValueError, match="--outer"):
            regime_map.parse_outer(bad)
    # Rows written before --outer existed are DiLoCo's setting.
    assert regime_map.lm_outer(dict(method="local-adamw-slowmo")) == (0.7, 0.9)
    assert regime_map.lm_outer(dict(method="local-adamw")) is None

    def row(lr, mom, seed, loss, diverged=False):
        return dict(
            method="local-adamw-slowmo",
            tau=64,
            seed=seed,
            slow_lr=lr,
            slow_momentum=mom,
            val_loss=loss,
            diverged=diverged,
        )

    rows = [row(0.7, 0.9, s, 2.30 + 0.01 * k) for k, s in enumerate(regime_map.TUNING_SEEDS)]
    rows += [row(1.0, 0.8, s, 2.28) for s in regime_map.TUNING_SEEDS]
    rows += [row(0.4, 0.9, s, 2.0, diverged=s == 101) for s in regime_map.TUNING_SEEDS]
    rows += [row(1.0, 0.9, 100, 1.0)]  # one seed only: not complete
    rows += [row(0.4, 0.8, 0, 1.0)]  # a test seed: not tuning
    table, chosen = regime_map.lm_tuning(rows)
    assert chosen == {64: (1.0, 0.8)}  # lowest mean among the complete, finite settings
    # A run recorded twice (a restarted sweep) is one seed: its setting is still chosen.
    twice = [row(1.0, 0.7, s, 2.20) for s in regime_map.TUNING_SEEDS]
    twice_table, twice_chosen = regime_map.lm_tuning(rows + twice + twice[:1])
    assert twice_chosen == {64: (1.0, 0.7)}
    assert "| 64 | 1 | 0.7 | 3 | 2.200 ± 0.000 |" in twice_table
    assert "| 64 | 0.7 | 0.9 | 3 | 2.310 ± 0.010 |" in table
    assert "| 64 | 0.4 | 0.9 | 3 | 2.000 ± 0.000 (incomplete or diverged: not chosen) |" in table
    assert "| 64 | 1 | 0.9 | 1 | 1.000 ± 0.000 (incomplete or diverged: not chosen) |" in table
    assert "0.4 | 0.8" not in table


def test_lm_table_shows_one_outer_setting_and_no_tuning_seed():
    rows = [dict(method="ar-adamw", tau=16, seed=s, val_loss=2.0) for s in (0, 1, 100)]
    rows += [dict(method="local-adamw", tau=16, seed=s, val_loss=2.5) for s in (0, 1, 100)]
    rows += [dict(method="local-adamw-slowmo", tau=16, seed=s, val_loss=2.4) for s in (0, 1)]
    rows += [
        dict(
            method="local-adamw-slowmo",
            tau=16,
            seed=s,
            val_loss=2.2,
            slow_lr=1.0,
            slow_momentum=0.8,
        )
        for s in (0, 1, 100)
    ]
    default = regime_map.lm_table(rows).splitlines()
    assert "Nesterov 0.7/0.9" in default[0] and default[2].startswith("| 16 | 2 |")
    assert "| 2.400 ± 0.000 |" in default[2]
    tuned = regime_map.lm_table(rows, (1.0, 0.8)).splitlines()
    assert "Nesterov 1/0.8" in tuned[0] and "| 2.200 ± 0.000 |" in tuned[2]


def test_lm_rejects_an_unknown_method(tmp_path):
    with pytest.raises(ValueError, match="'adam'"):
        regime_map.main(["lm", "--out", str(tmp_path / "x.jsonl"), "--methods", "adam"])


def fake_lm(calls: list[list[str]]):
    """A stand-in for char_lm.main: records its flags; the loss is set by the method, the seed
    and (SlowMo) the outer lr, so that the outer lr 1 is the best setting."""

    def main(flags: list[str]) -> dict:
        calls.append(flags)
        value = lambda name: flags[flags.index(name) + 1]  # noqa: E731
        loss = 2.0 + 0.01 * int(value("--seed"))
        if "--slowmo" in flags:
            loss += 0.2 + abs(float(value("--slow-lr")) - 1.0)
        elif "localsgd" in flags:
            loss += 0.4
        steps = 32 * int(value("--epochs"))
        return dict(
            val_loss=loss,
            train_loss=loss,
            steps=steps,
            wall_s=1.0,
            diverged=False,
            params=100 * int(value("--width")),
            corpus_sha256="fake",
        )

    return main


def test_lm_keys_runs_by_size_and_runs_the_setting_the_size_tuned(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(char_lm, "main", fake_lm(calls))
    monkeypatch.setattr(regime_map, "run_in_threads", lambda n, fn: [fn()])
    out = str(tmp_path / "lm.jsonl")

    def lm(argv: list[str], width: int) -> None:
        argv = ["lm", "--out", out, "--logdir", str(tmp_path), "--jobs", "2"] + argv
        args = regime_map.parser().parse_args(argv + ["--", "--width", str(width), "--epochs", "2"])
        regime_map.run_lm(args, pool=ThreadPoolExecutor(args.jobs))

    tune = ["--methods", "local-adamw-slowmo", "--taus", "16", "--seed-from", "100"]
    tune += ["--outer", "0.4/0.8,1/0.8"]
    with pytest.raises(ValueError, match="--outer tuned: no complete tuning at tau 16"):
        lm(["--outer", "tuned"], 64)
    lm(tune, 64)
    assert len(calls) == 2 * 3  # 2 settings x 3 tuning seeds
    lm(tune, 96)  # another size in the same file: its runs are not the first size's
    assert len(calls) == 12
    lm(tune, 64)  # resumed: nothing left to run
    assert len(calls) == 12
    with pytest.raises(ValueError, match="no complete tuning at tau 64"):
        lm(["--outer", "tuned", "--tune-tau", "64"], 64)
    lm(["--outer", "tuned", "--taus", "16,64", "--seeds", "2"], 64)
    test = calls[12:]
    assert len(test) == 2 * 5  # per seed: AR, then Local and SlowMo at tau 16 and 64
    slowmo = [f for f in test if "--slowmo" in f]
    assert len(slowmo) == 4 and all(f[f.index("--slow-lr") + 1] == "1.0" for f in slowmo)
    assert all(f[f.index("--width") + 1] == "64" for f in test)
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 22 and {r["params"] for r in rows} == {6400, 9600}


def lm_rows(params: int, gap: float, won: float, tested: bool = True) -> list[dict]:
    """One size's rows: its tuning at tau 16 (1/0.8 the best) and, if ``tested``, test seeds 0-2
    at tau 16 where Local AdamW trails AR-AdamW by ``gap`` and SlowMo wins back ``won`` of it."""
    size = dict(params=params, steps=512, flags=["--width", str(params)], diverged=False)
    rows = [
        dict(
            size,
            method="local-adamw-slowmo",
            tau=16,
            seed=s,
            slow_lr=lr,
            slow_momentum=0.8,
            val_loss=loss,
        )
        for lr, loss in ((1.0, 2.1), (0.4, 2.2))
        for s in regime_map.TUNING_SEEDS
    ]
    for s in (0, 1, 2) if tested else ():
        base = 2.0 + 0.01 * s
        rows.append(dict(size, method="ar-adamw", tau=16, seed=s, val_loss=base))
        rows.append(dict(size, method="local-adamw", tau=16, seed=s, val_loss=base + gap))
        loss = base + gap * (1 - won)
        rows.append(
            dict(
                size,
                method="local-adamw-slowmo",
                tau=16,
                seed=s,
                slow_lr=1.0,
                slow_momentum=0.8,
                val_loss=loss,
            )
        )
    return rows


def test_lm_report_prints_each_size_and_the_share_it_wins_back(tmp_path, capsys):
    small, big, untested = (
        lm_rows(1000, 0.1, 0.5),
        lm_rows(9000, 0.2, 0.25),
        lm_rows(500, 0, 0, False),
    )
    sizes = regime_map.lm_sizes(big + small + small + untested)  # small twice: kept once
    assert list(sizes) == [(500, 512), (1000, 512), (9000, 512)]
    assert sizes[(1000, 512)] == small

    text, shares = regime_map.lm_report(big + small + untested, tune_tau=16)
    assert shares.keys() == {1000, 9000}
    assert shares[1000][16][0] == pytest.approx(0.5) and shares[1000][16][1] == 3
    assert shares[9000][16][0] == pytest.approx(0.25)
    assert text.index("## 500 parameters") < text.index(
        "## 1,000 parameters, 512 steps: --width 1000"
    )
    assert "| 16 | 1 | 0.8 | 3 | 2.100 ± 0.000 |" in text and "Nesterov 1/0.8" in text
    assert "Tuned at tau 16: 1/0.8; no test run yet." in text  # the untested size
    assert "| +0.100 (the same difference on every seed: no t) |" in text and "| 50% |" in text
    text, shares = regime_map.lm_report(small, tune_tau=64)
    assert shares == {} and "Not tuned at tau 64 (yet)" in text and "| 50% |" in text
    assert regime_map.won_back(dict(seeds=[0], ar=[2.0], lo=[2.0], sm=[1.9])) is None  # no gap

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in small))
    second.write_text("".join(json.dumps(r) + "\n" for r in small + big))
    png = tmp_path / "share.png"
    regime_map.main(["lm-report", str(first), str(second), "--png", str(png)])
    printed = capsys.readouterr().out
    assert printed.count("## ") == 2 and printed.count("| 50% |") == 1
    assert png.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="missing.jsonl"):
        regime_map.main(["lm-report", str(tmp_path / "missing.jsonl")])


def test_the_committed_map_has_a_clearest_cell():
    # compare.py (the main job) prints it: the committed rows must hold one complete cell.
    text = compare.recorded_regime_cell()
    assert text is not None and "paired seeds" in text


def test_the_main_job_shows_the_recorded_language_model(tmp_path):
    # compare.py prints the language model's table at the outer setting its tuning chose.
    text = compare.recorded_lm_table()
    assert text is not None and "won back" in text and "tuned on seeds 100-102" in text
    rows = [dict(method="ar-adamw", tau=16, seed=s, val_loss=2.0) for s in (0, 1)]
    rows += [dict(method="local-adamw", tau=16, seed=s, val_loss=2.5) for s in (0, 1)]
    rows += [dict(method="local-adamw-slowmo", tau=16, seed=s, val_loss=2.4) for s in (0, 1)]
    path = tmp_path / "lm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = compare.recorded_lm_table(str(path))
    assert "Nesterov 0.7/0.9 (DiLoCo's, not tuned)" in text and "| 16 | 2 |" in text
    assert compare.recorded_lm_table(str(tmp_path / "missing.jsonl")) is None

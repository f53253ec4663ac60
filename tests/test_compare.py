"""examples/compare.py, the main job's driver: the methods it parses, each method's flags at
its own tuned settings, the results table (mean ± std over seeds), and a tiny real run of two
methods x two seeds in one ``horovodrun -np 2 --gloo`` launch."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from slowmo_lab import report

from horovod_launch import needs_horovod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import char_lm  # noqa: E402
import compare  # noqa: E402
import mnist1d_cnn  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_compare_parses_algorithms():
    assert compare.parse_algo("sgp-slowmo") == ("sgp", True)
    assert compare.parse_algo("localsgd") == ("localsgd", False)
    with pytest.raises(ValueError, match="unknown algorithm 'adam'"):
        compare.parse_algo("adam")
    with pytest.raises(ValueError, match="allreduce-slowmo"):
        compare.parse_algo("allreduce-slowmo")


def test_compare_runs_each_method_at_its_own_settings():
    ns = SimpleNamespace(overlap=0, fragments=1, eager=None)
    settings = {"lr": 0.05, "slow_momentum": 0.6, "buffers": "reset"}
    flags = compare.run_args("sgp-slowmo", settings, 2, ns)
    assert flags == [
        "--algo",
        "sgp",
        "--slowmo",
        "--tau",
        "12",
        "--lr",
        "0.05",
        "--buffers",
        "reset",
        "--seed",
        "2",
        "--run-name",
        "sgp-slowmo/seed2",
        "--slow-lr",
        "1",
        "--slow-momentum",
        "0.6",
    ]
    assert compare.run_args(
        "sgp-slowmo", settings, 2, SimpleNamespace(overlap=1, fragments=1, eager=None)
    )[-2:] == [
        "--overlap",
        "1",
    ]
    flags = compare.run_args("localsgd", {"lr": 0.1, "buffers": "maintain"}, 0, ns)
    assert flags[:3] == ["--algo", "localsgd", "--no-slowmo"] and "--slow-momentum" not in flags
    # Every default method has tuned settings; SlowMo keeps its base's lr (the paper's protocol).
    for method in compare.DEFAULT_ALGOS.split(","):
        assert method in mnist1d_cnn.TUNED
        if method.endswith("-slowmo"):
            base = method[: -len("-slowmo")]
            assert mnist1d_cnn.TUNED[method]["lr"] == mnist1d_cnn.TUNED[base]["lr"]
            assert mnist1d_cnn.TUNED[method]["slow_momentum"] in mnist1d_cnn.BETA_GRID
            assert mnist1d_cnn.TUNED[method]["buffers"] == "reset"
        else:
            assert mnist1d_cnn.TUNED[method]["lr"] in mnist1d_cnn.LR_GRID


def test_compare_results_table_is_mean_std_over_seeds():
    summaries = {
        f"localsgd/seed{k}": {
            "train_full_loss": loss,
            "train_loss": 9.0,
            "val_accuracy": acc,
            "best_val_accuracy": acc + 1,
            "ms_per_iter": 2.0,
            "wall_s": 10.0,
        }
        for k, (loss, acc) in enumerate([(0.25, 90.0), (0.5, 92.0), (0.75, 94.0)])
    }
    settings = {"localsgd": {"lr": 0.1, "buffers": "maintain"}, "sgp": {"lr": 0.1}}
    table = compare.results_table(["localsgd", "sgp"], settings, summaries)
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert rows["localsgd"].split() == [
        "localsgd",
        "0.1",
        "-",
        "maintain",
        "3",
        "0.5000",
        "±",
        "0.2500",
        "92.00",
        "±",
        "2.00",
        "93.00",
        "±",
        "2.00",
        "2.0",
        "±",
        "0.0",
        "30",
    ]
    assert rows["sgp"].split()[4] == "0"  # no run finished: said, not hidden


def test_compare_language_model_settings():
    """--task char_lm: tau 64, an outer Nesterov (tuned) for SlowMo, the CPU size first."""
    spec = compare.TASKS["char_lm"]
    assert spec.tau == 64 and spec.target == "val_loss"
    assert list(spec.flags) == char_lm.CPU_SIZE
    for method in ",".join(spec.algos.values()).split(","):
        assert method in spec.settings
    ns = SimpleNamespace(overlap=0, fragments=1, eager=None)
    flags = compare.run_args("localsgd-slowmo", spec.settings["localsgd-slowmo"], 1, ns, spec.tau)
    assert flags[flags.index("--tau") + 1] == "64"
    assert flags[flags.index("--slow-lr") + 1] == "0.7"
    assert flags[flags.index("--slow-momentum") + 1] == "0.8"  # tuned: docs/results/regimes.md
    assert flags[-2:] == ["--outer-optimizer", "nesterov"]
    flags = compare.run_args("allreduce", spec.settings["allreduce"], 1, ns, spec.tau)
    assert "--slow-lr" not in flags and "--outer-optimizer" not in flags


def test_compare_results_table_of_a_loss():
    summaries = {
        f"localsgd/seed{k}": {
            "train_loss": 2.5,
            "val_loss": v,
            "best_val_loss": v - 0.01,
            "ms_per_iter": 2.0,
            "wall_s": 10.0,
        }
        for k, v in enumerate([2.3, 2.4])
    }
    table = compare.results_table(
        ["localsgd"], {"localsgd": {"lr": 1e-3}}, summaries, target="val_loss"
    )
    head, _, row = table.splitlines()
    assert "Val loss (final)" in head and "Val loss (best)" in head and "Test acc" not in head
    assert "2.350 ± 0.071" in row and "2.340 ± 0.071" in row


@pytest.mark.horovod
def test_compare_tiny_budget(tmp_path):
    """The main job's path on MNIST-1D, tiny: two methods x two seeds in one launch, the
    averaged model's metrics as mean ± std, Table 1 with the seeds counted, the PNG."""
    needs_horovod()
    pytest.importorskip("mnist1d", reason="pip install mnist1d (scripts/setup_env.sh installs it)")
    cmd = [
        sys.executable,
        os.path.join(EXAMPLES, "compare.py"),
        "--np",
        "2",
        "--epochs",
        "2",
        "--max-steps",
        "12",
        "--algos",
        "sgp,localsgd-slowmo",
        "--seeds",
        "0,1",
        "--logdir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    out = proc.stdout
    assert "4 runs (2 methods x 2 seeds), 2 workers, 2 epochs, tau 12, one horovodrun launch" in out
    for name in ("sgp/seed0", "sgp/seed1", "localsgd-slowmo/seed0", "localsgd-slowmo/seed1"):
        assert f"{name} " in out  # one line per finished run, with its wall time
    table = out[out.index("Method") : out.index("Table 1")]
    rows = {
        line.split()[0]: line.split()
        for line in table.splitlines()
        if line.startswith(("sgp ", "localsgd"))
    }
    assert set(rows) == {"sgp", "localsgd-slowmo"}
    for cells in rows.values():
        assert cells[4] == "2" and cells[6] == "±"  # two seeds, mean ± std
        assert 0 < float(cells[5]) < 2.5 and 0 <= float(cells[8]) <= 100
    t1 = out[out.index("Table 1") : out.index("Table 2")]
    mean_std, pct = r"\d\.\d{4} ± \d\.\d{4}", r"\d+\.\d\d% ± \d+\.\d\d%"
    assert re.search(rf"mnist1d_cnn +SGP +2 / - +{mean_std} +- +{pct}", t1)
    assert re.search(r"mnist1d_cnn +Local SGD +- / 2 +- +\d\.\d{4} ± \d\.\d{4}", t1)
    runs = report.load_runs([str(tmp_path / "runs" / "mnist1d")])
    expected = [os.path.join(m, f"seed{k}") for m in ("sgp", "localsgd-slowmo") for k in (0, 1)]
    assert sorted(r.name for r in runs) == sorted(expected)
    assert all([s for s, _ in r.scalars["train/full_loss"]] == [12, 24] for r in runs)
    png = out.split("Figure: ")[1].split()[0]
    assert os.path.getsize(png) > 0
    assert "Total wall time:" in out
    # beside today's table, the regime map's clearest cell, labelled as recorded
    recorded = out[out.index("Recorded, not run now") :]
    assert "| workers | tau | seeds |" in recorded and "Reproduce" in recorded

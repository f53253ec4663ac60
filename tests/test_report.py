"""The report (slowmo_lab.report) against event files written here with known values (one seed
per setting, and several seeds averaged as mean ± std), and the metrics it reads
(slowmo_lab.metrics) on in-process thread workers. No Horovod needed."""

import json
import math
import os

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

import hvd_slowmo
from hvd_slowmo.comm.local import run_threads
from slowmo_lab import report
from slowmo_lab.metrics import CONFIG_FILE, TAGS, TrainingMonitor, consensus_distance

pytestmark = pytest.mark.timeout(120)


def write_run(root, name, config, scalars):
    """One run folder: config.json (unless config is None) and scalars {key: [(step, value)]}."""
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    if config is not None:
        with open(os.path.join(folder, CONFIG_FILE), "w") as f:
            json.dump(config, f)
    w = SummaryWriter(folder)
    for key, points in scalars.items():
        for step, value in points:
            w.add_scalar(TAGS[key], value, step)
    w.close()
    return folder


@pytest.fixture
def runs_dir(tmp_path):
    # Dyadic values: exact in the float32 that TensorBoard stores.
    write_run(
        tmp_path,
        "localsgd_tau12",
        {"task": "digits", "algo": "localsgd", "slowmo": False, "optimizer": "sgd"},
        {
            "train_loss": [(10, 0.75), (20, 0.5), (30, 0.625)],
            "val_accuracy": [(15, 80.0), (30, 85.5), (45, 83.0)],
            "iter_ms": [(10, 50.0), (20, 10.0), (30, 20.0)],
            "compute_ms": [(10, 40.0), (20, 8.0), (30, 16.0)],
            "base_comm_ms": [(10, 0.0), (20, 0.0), (30, 0.0)],
            "average_ms": [(10, 10.0), (20, 2.0), (30, 4.0)],
            "slow_update_ms": [(10, 0.0), (20, 0.0), (30, 0.0)],
            "bytes_sent": [(10, 1e6), (20, 2e6), (30, 3e6)],
            "consensus": [(10, 0.5), (20, 0.25)],
        },
    )
    # Two SlowMo runs share a cell: the one with the better validation accuracy is shown.
    write_run(
        tmp_path,
        "localsgd-slowmo_tau12_a1_b0.7_reset",
        {"task": "digits", "algo": "localsgd", "slowmo": True, "optimizer": "sgd"},
        {
            "train_loss": [(10, 0.5), (20, 0.125), (30, 0.25)],
            "val_accuracy": [(15, 86.0), (30, 90.5)],
            "iter_ms": [(10, 40.0), (20, 12.0)],
        },
    )
    write_run(
        tmp_path,
        "localsgd-slowmo_tau12_a1_b0.5_reset",
        {"task": "digits", "algo": "localsgd", "slowmo": True, "optimizer": "sgd"},
        {
            "train_loss": [(10, 0.0625)],
            "val_accuracy": [(15, 88.0)],
            "iter_ms": [(10, 99.0)],
        },
    )
    # No config.json: algo and SlowMo come from the name.
    write_run(
        tmp_path,
        "allreduce",
        None,
        {
            "train_loss": [(10, 0.375)],
            "val_accuracy": [(15, 70.0), (30, 75.25)],
            "iter_ms": [(10, 30.0)],
        },
    )
    write_run(
        tmp_path,
        "ar",
        {"task": "digits", "algo": "allreduce", "slowmo": False, "optimizer": "sgd"},
        {
            "train_loss": [(10, 0.25)],
            "val_accuracy": [(15, 92.0)],
            "iter_ms": [(10, 20.0), (20, 24.0)],
        },
    )
    write_run(
        tmp_path,
        "wmt/localsgd-slowmo",
        {"task": "wmt", "algo": "localsgd", "slowmo": True, "optimizer": "adam"},
        {
            "train_loss": [(5, 3.5), (10, 2.5)],
            "val_nll": [(5, 3.0), (10, 2.25), (15, 2.5)],
            "iter_ms": [(5, 8.0), (10, 6.0), (15, 7.0)],
        },
    )
    return tmp_path


def row(table, *starts):
    """The cells of the table line whose first cells are ``starts``."""
    for line in table.splitlines():
        cells = [c for c in line.split("  ") if c.strip()]
        cells = [c.strip() for c in cells]
        if cells[: len(starts)] == list(starts):
            return cells
    raise AssertionError(f"no row starting with {starts} in:\n{table}")


def test_load_and_summarize(runs_dir):
    runs = {r.name: r for r in report.load_runs([str(runs_dir)])}
    assert sorted(runs) == sorted(
        [
            "localsgd_tau12",
            "localsgd-slowmo_tau12_a1_b0.7_reset",
            "localsgd-slowmo_tau12_a1_b0.5_reset",
            "allreduce",
            "ar",
            os.path.join("wmt", "localsgd-slowmo"),
        ]
    )
    s = report.summarize(runs["localsgd_tau12"])
    assert s["best_train_loss"] == 0.5
    assert (s["val_kind"], s["best_val"]) == ("accuracy", 85.5)
    assert s["iter_ms"] == 15.0  # the first window (50 ms, start-up) is left out
    assert (s["compute_ms"], s["average_ms"], s["base_comm_ms"]) == (12.0, 3.0, 0.0)
    assert s["bytes_sent"] == 3e6 and s["steps"] == 45
    assert s["consensus"] == 0.375
    a = report.summarize(runs["allreduce"])
    assert (a["algo"], a["slowmo"], a["iter_ms"], a["best_val"]) == (
        "allreduce",
        False,
        30.0,
        75.25,
    )
    w = report.summarize(runs[os.path.join("wmt", "localsgd-slowmo")])
    assert (w["val_kind"], w["best_val"], w["best_train_loss"], w["iter_ms"]) == (
        "nll",
        2.25,
        2.5,
        6.5,
    )


def test_tables(runs_dir):
    runs = report.load_runs([str(runs_dir)])
    t1 = report.table1(runs)
    # One seed per setting: the values alone; of the two SlowMo settings, the better one (b0.7).
    assert row(t1, "digits", "Local SGD") == [
        "digits",
        "Local SGD",
        "1 / 1",
        "0.5000",
        "0.1250",
        "85.50%",
        "90.50%",
    ]
    # No config.json: the task is unknown.
    assert row(t1, "-", "AR-SGD") == ["-", "AR-SGD", "1 / -", "0.3750", "-", "75.25%", "-"]
    assert row(t1, "digits", "AR-SGD") == [
        "digits",
        "AR-SGD",
        "1 / -",
        "0.2500",
        "-",
        "92.00%",
        "-",
    ]
    assert row(t1, "wmt", "Local Adam") == [
        "wmt",
        "Local Adam",
        "- / 1",
        "-",
        "2.5000",
        "-",
        "2.250",
    ]
    # The paper's order: Local SGD before AR-SGD.
    assert t1.index("digits  Local SGD") < t1.index("digits  AR-SGD")
    t2 = report.table2(runs)
    assert row(t2, "digits", "Local SGD") == ["digits", "Local SGD", "1 / 1", "15.00", "12.00"]
    assert row(t2, "digits", "AR-SGD") == ["digits", "AR-SGD", "1 / -", "24.00", "-"]
    assert row(t2, "-", "AR-SGD") == ["-", "AR-SGD", "1 / -", "30.00", "-"]  # one window: kept
    detail = report.runs_table(runs)
    assert row(detail, "localsgd_tau12") == [
        "localsgd_tau12",
        "45",
        "0.5000",
        "85.50%",
        "15.00",
        "12.00",
        "0.00",
        "3.00",
        "0.00",
        "3.00",
        "0.3750",
    ]


def test_main_prints_tables_and_saves_png(runs_dir, capsys):
    png = runs_dir / "out" / "fig.png"
    assert report.main([str(runs_dir), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Table 1" in out and "Table 2" in out and "Settings" in out and f"Figure: {png}" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def seeds_dir(tmp_path):
    """Three seeds of plain Local SGD, two of Local SGD + SlowMo, logged as the examples log them:
    the averaged model's full training loss and test accuracy per epoch, and minibatch losses."""

    def config(slowmo, seed, **kw):
        return dict(
            {
                "task": "mnist1d",
                "algo": "localsgd",
                "slowmo": slowmo,
                "optimizer": "sgd",
                "lr": 0.1,
                "tau": 12,
                "slow_momentum": 0.7 if slowmo else 0.0,
                "buffers": "reset" if slowmo else "maintain",
                "seed": seed,
            },
            **kw,
        )

    # (final full loss, accuracies at steps 12 and 24, ms/iter windows) per seed; dyadic values.
    for seed, (loss, acc, ms) in enumerate(
        [(0.25, (80.0, 90.0), 8.0), (0.5, (82.0, 92.0), 10.0), (0.75, (84.0, 94.0), 12.0)]
    ):
        write_run(
            tmp_path,
            f"localsgd/seed{seed}",
            config(False, seed),
            {
                "train_loss": [
                    (12, 9.0),
                    (24, 8.0),
                ],  # minibatch losses: left aside for the full ones
                "train_full_loss": [(12, 1.0), (24, loss)],
                "val_accuracy": [(12, acc[0]), (24, acc[1])],
                "iter_ms": [(12, 50.0), (24, ms)],
            },
        )
    for seed, (loss, acc) in enumerate([(0.125, (88.0, 95.0)), (0.375, (90.0, 94.0))]):
        write_run(
            tmp_path,
            f"localsgd-slowmo/seed{seed}",
            config(True, seed),
            {
                "train_full_loss": [(12, 0.5), (24, loss)],
                "val_accuracy": [(12, acc[0]), (24, acc[1])],
                "iter_ms": [(24, 4.0)],
            },
        )
    # Same name, another lr: a setting of its own, not a third seed.
    write_run(
        tmp_path,
        "localsgd-slowmo/seed2",
        config(True, 2, lr=0.05),
        {"train_full_loss": [(24, 2.0)], "val_accuracy": [(24, 50.0)]},
    )
    return tmp_path


def test_mean_std():
    assert report.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)  # sample std (n - 1)
    assert report.mean_std([5.0, None]) == (5.0, None, 1)
    assert report.mean_std([]) == (None, None, 0)
    # A diverged run (NaN loss) shows in the mean, it is not left out.
    assert all(math.isnan(x) for x in report.mean_std([1.0, float("nan")])[:2])
    assert report.fmt_mean_std([0.25, 0.5, 0.75], ".4f") == "0.5000 ± 0.2500"
    assert report.fmt_mean_std([90.0, 92.0, 94.0], ".2f", "%") == "92.00% ± 2.00%"
    assert report.fmt_mean_std([3.0], ".1f") == "3.0" and report.fmt_mean_std([None], ".1f") == "-"


def test_seeds_are_grouped_and_averaged(seeds_dir):
    runs = report.load_runs([str(seeds_dir)])
    settings = {(st.name, len(st.runs)) for st in report.group_settings(runs)}
    assert settings == {("localsgd", 3), ("localsgd-slowmo", 2), ("localsgd-slowmo", 1)}
    t1 = report.table1(runs)
    # The full training loss of the averaged model, not the minibatch loss; the better SlowMo
    # setting of the two.
    assert row(t1, "mnist1d", "Local SGD") == [
        "mnist1d",
        "Local SGD",
        "3 / 2",
        "0.5000 ± 0.2500",
        "0.2500 ± 0.1768",
        "92.00% ± 2.00%",
        "94.50% ± 0.71%",
    ]
    t2 = report.table2(runs)
    assert row(t2, "mnist1d", "Local SGD") == [
        "mnist1d",
        "Local SGD",
        "3 / 2",
        "10.00 ± 2.00",
        "4.00 ± 0.00",
    ]
    best = {st.runs[0].slowmo: st for st in report.best_settings(runs)}
    assert (best[False].name, len(best[False].runs)) == ("localsgd", 3)
    assert best[True].config["lr"] == 0.1 and len(best[True].runs) == 2
    table = report.settings_table(runs)
    assert row(table, "mnist1d", "localsgd-slowmo", "2") == [
        "mnist1d",
        "localsgd-slowmo",
        "2",
        "0.1",
        "12",
        "0.7",
        "reset",
        "0.2500 ± 0.1768",
        "94.50% ± 0.71%",
        "94.50% ± 0.71%",
        "0",
    ]
    lines = [line.split() for line in table.splitlines()]
    order = [cells[3] for cells in lines if cells[:2] == ["mnist1d", "localsgd-slowmo"]]
    assert order == ["0.1", "0.05"]  # best mean final val first


def test_seed_failures_rules():
    nan = float("nan")
    # The main job's AR-SGD at lr 0.15 on test seeds 0, 1, 2: two seeds trail the best one.
    out = report.seed_failures([0.01, 0.3, 1.2], [92.2, 82.4, 57.2], [92.6, 85.0, 60.0])
    assert out[0] is None and out[1].startswith("trails") and out[2].startswith("trails")
    # Seed noise within the margin passes; exactly at the margin still passes (strictly below).
    assert report.seed_failures([0.1] * 3, [92.0, 94.0, 89.0], [None] * 3) == [None] * 3
    # Diverged: a non-finite loss or metric, or none at all.
    assert report.seed_failures([nan, 0.1], [93.0, 93.0], [93.0, 93.0])[0].startswith("diverged")
    assert report.seed_failures([0.1, None], [93.0, 93.0], [None, None])[1].startswith("diverged")
    # Fell back from its own best toward chance, even with every seed alike (no sibling rule).
    out = report.seed_failures([2.3, 2.3], [9.8, 9.8], [31.6, 20.0])
    assert [o.split(":")[0] for o in out] == ["fell back", "fell back"]
    # A one-seed setting has no siblings; margin=None keeps only the divergence rule.
    assert report.seed_failures([0.5], [50.0], [50.0]) == [None]
    assert report.seed_failures([0.1, 0.1], [93.0, 50.0], [93.0, 90.0], margin=None) == [None] * 2
    assert report.seed_failures([0.1, 0.1], [93.0, 91.0], [93.0, 91.0], margin=1.0)[1]
    with pytest.raises(ValueError, match="one entry per seed"):
        report.seed_failures([0.1], [93.0, 92.0], [None, None])
    with pytest.raises(ValueError, match="margin"):
        report.seed_failures([0.1], [93.0], [None], margin=0.0)


def test_best_settings_skips_a_setting_with_a_failing_seed(tmp_path, capsys):
    # lr 0.2 has the best mean final accuracy (93.33) but its third seed trails by 11 points:
    # the rule rejects it and chooses lr 0.1 (mean 92.0), whose seeds agree.
    finals = {"0.2": [97.0, 97.0, 86.0], "0.1": [91.0, 92.0, 93.0]}
    for lr, accs in finals.items():
        for seed, acc in enumerate(accs):
            write_run(
                tmp_path,
                f"allreduce_lr{lr}/seed{seed}",
                {"task": "t", "algo": "allreduce", "slowmo": False, "lr": float(lr), "seed": seed},
                {"train_full_loss": [(36, 0.25)], "val_accuracy": [(36, acc)]},
            )
    runs = report.load_runs([str(tmp_path)])
    fails = {st.name: st.failures() for st in report.group_settings(runs)}
    assert list(fails["allreduce_lr0.2"]) == [os.path.join("allreduce_lr0.2", "seed2")]
    assert fails["allreduce_lr0.1"] == {}
    (best,) = report.best_settings(runs)
    assert best.config["lr"] == 0.1
    assert row(report.settings_table(runs), "t", "allreduce_lr0.2")[-1] == "1"
    # Every setting failing: no choice at all rather than a failing one.
    write_run(
        tmp_path,
        "allreduce_lr0.1/seed3",
        {"task": "t", "algo": "allreduce", "slowmo": False, "lr": 0.1, "seed": 3},
        {"train_full_loss": [(36, 2.3)], "val_accuracy": [(36, 9.8)]},
    )
    assert report.best_settings(report.load_runs([str(tmp_path)])) == []


def test_band_over_seeds_and_plot(seeds_dir):
    runs = report.load_runs([str(seeds_dir)])
    ls = [r for r in runs if r.name.split(os.sep)[0] == "localsgd"]
    steps, mean, low, high = report._band([r.scalars[TAGS["val_accuracy"]] for r in ls])
    assert (steps, mean, low, high) == ([12, 24], [82.0, 92.0], [80.0, 90.0], [84.0, 94.0])
    png = report.plot(runs, str(seeds_dir / "band.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_main_without_runs_fails(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 1
    assert "no TensorBoard event files" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a folder"):
        report.load_runs([str(tmp_path / "missing")])


def test_consensus_distance_exact():
    # Worker r holds ones * r over n elements: the mean is 1.5, worker r is |r - 1.5| sqrt(n) away.
    n = 9

    def worker(comm):
        params = [torch.full((2, 3), float(comm.rank)), torch.full((3,), float(comm.rank))]
        return consensus_distance(params, comm), comm.bytes_sent

    out = run_threads(4, worker)
    expected = (1.5 + 0.5 + 0.5 + 1.5) / 4 * math.sqrt(n)
    assert [d for d, _ in out] == [pytest.approx(expected, rel=1e-12)] * 4
    assert len({d for d, _ in out}) == 1  # bitwise the same everywhere
    assert all(b > 0 for _, b in out)


def test_consensus_distance_rejects_empty():
    with pytest.raises(ValueError, match="params is empty"):
        run_threads(1, lambda comm: consensus_distance([], comm))


def test_monitor_logs_window_and_consensus(tmp_path):
    """Two Local SGD workers (tau=2) on different data: consensus is measured before each exact
    average only, the logged loss is the mean over workers, measurement traffic is excluded."""
    logdir = str(tmp_path / "run")

    def worker(comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = hvd_slowmo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            base="localsgd",
            tau=2,
            slow_momentum=0.5,
            communicator=comm,
        )
        mon = TrainingMonitor(
            opt, logdir if comm.rank == 0 else None, {"algo": "localsgd", "slowmo": True}
        )
        measured = []
        x = torch.full((4, 3), float(comm.rank + 1))
        for _ in range(4):
            mon.start_iteration()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            before = mon.last_consensus
            at_average = opt.inner_step == opt.tau - 1
            mon.before_step()
            measured.append(mon.last_consensus is not before and at_average)
            opt.step()
            mon.end_iteration(float(comm.rank + 1))  # known "losses": 1 and 2
        out = mon.log_window(opt.num_steps)
        mon.close()
        return measured, out, opt.comm.bytes_sent, mon.measurement_bytes

    results = run_threads(2, worker)
    for measured, out, sent, extra in results:
        assert measured == [False, True, False, True]
        assert out["train_loss"] == 1.5
        assert extra > 0 and out["bytes_sent"] == sent - extra
        assert out["consensus"] > 0
        assert out["iter_ms"] == pytest.approx(
            out["compute_ms"] + out["base_comm_ms"] + out["average_ms"] + out["slow_update_ms"]
        )
    assert results[0][1]["consensus"] == results[1][1]["consensus"]
    (run,) = report.load_runs([logdir])
    assert run.values("train_loss") == [1.5]
    assert run.config == {"algo": "localsgd", "slowmo": True}
    assert os.listdir(tmp_path) == ["run"]  # rank 1 wrote nothing


def test_monitor_rejects_plain_optimizer():
    with pytest.raises(TypeError, match="hvd_slowmo.DistributedOptimizer"):
        TrainingMonitor(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), None, {})


def test_monitor_clock_counts_training_seconds_only(tmp_path):
    """time/train_s is 0 at the start and the summed iteration times at each evaluation; every
    scalar's TensorBoard wall time is the start plus those seconds, so a pause outside the
    iterations (an evaluation) moves neither."""
    import time

    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    logdir = str(tmp_path / "run")

    def worker(comm):
        model = torch.nn.Linear(2, 1)
        opt = hvd_slowmo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            base="localsgd",
            tau=2,
            communicator=comm,
        )
        mon = TrainingMonitor(opt, logdir, {"algo": "localsgd"})
        for _ in range(2):
            mon.start_iteration()
            model(torch.ones(1, 2)).sum().backward()
            time.sleep(0.05)
            mon.before_step()
            opt.step()
            mon.end_iteration(0.0)
        time.sleep(0.3)  # an evaluation: not training time
        mon.log_validation(opt.num_steps, {"val_accuracy": 50.0})
        mon.close()
        return mon.wall_start, mon.total_seconds

    ((start, trained),) = run_threads(1, worker)
    assert 0.1 <= trained < 0.3
    acc = EventAccumulator(logdir)
    acc.Reload()
    clock = acc.Tensors(TAGS["train_s"])  # scalars, as tensors of the scalars plugin
    values = [(e.step, float(make_ndarray(e.tensor_proto))) for e in clock]
    assert values == [(0, 0.0), (2, pytest.approx(trained))]
    assert [e.wall_time for e in clock] == [start, start + trained]
    (val,) = acc.Tensors(TAGS["val_accuracy"])
    assert val.wall_time == start + trained and float(make_ndarray(val.tensor_proto)) == 50.0

"""The examples, compare.py and the sweep runner.

Pure pieces (schedules, tokenizer, batching, the sweep's commands) run in-process. The scripts
themselves run under ``horovodrun -np 2 --gloo`` in their synthetic/tiny modes (CIFAR-10,
ImageNet and WMT cannot be downloaded here, so only the synthetic mode is exercised), and the
report reads their event files back.
"""
import json
import os
import shlex
import subprocess
import sys

import pytest

import hvd_slowmo
from hvd_slowmo.tools import report, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import common  # noqa: E402
import compare  # noqa: E402
import translation_transformer as tt  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def horovod_available():
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def needs_horovod():
    why = horovod_available()
    if why is not None:
        pytest.skip(f"Horovod is not importable ({why}); build it with scripts/install_horovod.sh")


def launch(args, timeout=420):
    cmd = sweep.horovodrun_command(2, "gloo") + [sys.executable] + args
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stdout[-5000:]}"
    return proc.stdout


# --- pure pieces ---------------------------------------------------------------------------
def test_warmup_multistep_schedule():
    f = lambda s: common.warmup_multistep(s, steps_per_epoch=10, warmup_epochs=5, milestones=[100, 150, 175])  # noqa: E731
    assert f(0) == pytest.approx(1 / 50) and f(49) == 1.0 and f(50) == 1.0
    assert f(999) == 1.0 and f(1000) == pytest.approx(0.1) and f(1500) == pytest.approx(0.01)
    assert f(1750) == pytest.approx(0.001)


def test_inverse_sqrt_schedule():
    assert common.inverse_sqrt(0, 4000) == 1 / 4000
    assert common.inverse_sqrt(3998, 4000) == 3999 / 4000
    assert common.inverse_sqrt(3999, 4000) == 1.0
    assert common.inverse_sqrt(15999, 4000) == pytest.approx(0.5)


def test_run_names_encode_settings():
    ns = lambda **kw: type("A", (), dict(dict(run_name=None, algo="sgp", slowmo=True, tau=48, slow_lr=1.0,  # noqa: E731
                                              slow_momentum=0.6, buffers="reset", no_average=False), **kw))
    assert common.run_name(ns()) == "sgp-slowmo_tau48_a1_b0.6_reset"
    assert common.run_name(ns(no_average=True)) == "sgp-slowmo-noavg_tau48_a1_b0.6_reset"
    assert common.run_name(ns(slowmo=False)) == "sgp"
    assert common.run_name(ns(algo="localsgd", slowmo=False, tau=12)) == "localsgd_tau12"
    assert common.run_name(ns(run_name="mine")) == "mine"


def test_translation_tokenizer_vocab_and_batches():
    assert tt.tokenize("Hello, world!") == ["Hello", ",", "world", "!"]
    vocab = tt.build_vocab(["a b a", "c a b"], max_size=6, min_freq=1)
    assert vocab == {"<pad>": 0, "<unk>": 1, "<bos>": 2, "<eos>": 3, "a": 4, "b": 5}
    assert tt.encode("a c b", vocab, max_len=2) == [4, tt.UNK]
    batches = tt.make_batches([([4, 5, 4], [5]), ([4], [4, 5])], batch_size=2)
    (src, tgt), = batches
    assert src.tolist() == [[4, 0, 0], [4, 5, 4]]  # sorted by length, padded
    assert tgt.tolist() == [[4, 5, tt.EOS], [5, tt.EOS, 0]]
    assert tt.teacher_forcing(tgt).tolist() == [[tt.BOS, 4, 5], [tt.BOS, 5, tt.EOS]]


def test_compare_parses_algorithms():
    assert compare.parse_algo("sgp-slowmo") == ("sgp", True)
    assert compare.parse_algo("localsgd") == ("localsgd", False)
    with pytest.raises(ValueError, match="unknown algorithm 'adam'"):
        compare.parse_algo("adam")
    with pytest.raises(ValueError, match="allreduce-slowmo"):
        compare.parse_algo("allreduce-slowmo")


def test_sweep_dry_run_prints_the_grid(capsys):
    assert sweep.main(["examples/digits.py", "--ablation", "alpha-beta", "--baseline", "--np", "3",
                       "--dry-run", "--", "--epochs", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2 * 5  # the baseline, then alpha in {0.5, 1} x beta in {0.4, ..., 0.8}
    cmds = [shlex.split(line) for line in lines]
    assert all(c[1:3] == ["-np", "3"] and "--gloo" in c and c[-2:] == ["--epochs", "5"] for c in cmds)
    assert "--no-slowmo" in cmds[0]
    grid = {(c[c.index("--slow-lr") + 1], c[c.index("--slow-momentum") + 1]) for c in cmds[1:]}
    assert grid == {(a, b) for a in ("0.5", "1") for b in ("0.4", "0.5", "0.6", "0.7", "0.8")}
    assert all(c[c.index("--logdir") + 1] == os.path.join("runs", "sweep-alpha-beta") for c in cmds)


def test_sweep_tau_ablation_and_overrides(capsys):
    assert sweep.main(["x.py", "--dry-run", "--algo", "sgp", "--buffers", "reset,maintain"]) == 0
    cmds = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert sorted((c[c.index("--tau") + 1], c[c.index("--buffers") + 1]) for c in cmds) == sorted(
        (t, b) for t in ("12", "24", "48", "96") for b in ("reset", "maintain"))
    assert all(c[c.index("--algo") + 1] == "sgp" for c in cmds)


@pytest.mark.parametrize("argv, match", [
    (["x.py", "--dry-run", "--buffers", "zero"], "--buffers: unknown strategy"),
    (["x.py", "--dry-run", "--taus", "12,many"], "--taus: 'many' is not a int"),
    (["x.py", "--dry-run", "--slow-momentums", ","], "--slow-momentums is empty"),
    (["x.py", "--dry-run", "--np", "0"], "np must be an integer >= 1"),
], ids=["buffers", "taus", "betas-empty", "np"])
def test_sweep_rejects_bad_input(argv, match):
    with pytest.raises(ValueError, match=match):
        sweep.main(argv)


# --- real runs under horovodrun -np 2 --gloo -------------------------------------------------
EXAMPLE_RUNS = {
    # script: (the algorithm flags, the validation tag, the report's row label)
    "cifar10_resnet18": (["--algo", "localsgd", "--slowmo", "--tau", "2", "--batch-size", "16"], "val_accuracy",
                         "Local SGD"),
    "imagenet_resnet50": (["--algo", "allreduce", "--no-slowmo", "--batch-size", "8"], "val_accuracy", "AR-SGD"),
    "translation_transformer": (["--algo", "sgp", "--slowmo", "--tau", "3", "--batch-size", "16"], "val_nll", "SGP"),
}


@pytest.mark.horovod
@pytest.mark.parametrize("example", sorted(EXAMPLE_RUNS))
def test_example_synthetic_under_horovodrun(example, tmp_path):
    needs_horovod()
    flags, val_key, label = EXAMPLE_RUNS[example]
    algo = flags[flags.index("--algo") + 1]
    if algo not in hvd_slowmo.BASES:
        pytest.skip(f"base {algo!r} is not registered in hvd_slowmo.BASES")
    summary_path = tmp_path / "summary.json"
    out = launch([os.path.join(EXAMPLES, f"{example}.py"), "--synthetic", "--epochs", "2", "--max-steps", "4",
                  "--log-every", "2", "--logdir", str(tmp_path / "runs"), "--no-progress",
                  "--checkpoint", str(tmp_path / "ckpt.pt"), "--summary-json", str(summary_path)] + flags)
    assert "epoch 1:" in out
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 8 and summary["workers"] == 2
    (run,) = report.load_runs([str(tmp_path / "runs")])
    assert run.config["task"] == example and run.config["algo"] == algo and run.config["workers"] == 2
    assert [s for s, _ in run.scalars["train/loss"]] == [2, 4, 6, 8]
    assert len(run.values(val_key)) == 2
    assert all(v > 0 for v in run.values("iter_ms"))
    s = report.summarize(run)
    assert s["best_train_loss"] is not None and s["val_kind"] == val_key[4:]
    if algo == "allreduce":
        assert s["consensus"] is None  # identical workers: not measured
        assert s["base_comm_ms"] > 0
    else:
        assert s["consensus"] is not None  # measured before each exact average
        assert s["average_ms"] > 0
    if algo == "localsgd":
        assert s["consensus"] > 0  # different data, no communication between averages
    # (two SGP workers mix with weights 1/2 each: that is an exact average, so no drift to see.)
    assert s["bytes_sent"] > 0
    assert os.path.exists(tmp_path / "ckpt.pt")
    assert f"{example}  {label}" in report.table1([run])


@pytest.mark.horovod
def test_digits_checkpoint_resume(tmp_path):
    """Two epochs, then a new launch resumes from the checkpoint for a third: the step count
    continues and TensorBoard gets the third epoch in the same run."""
    needs_horovod()
    common_flags = [os.path.join(EXAMPLES, "digits.py"), "--max-steps", "6", "--log-every", "3", "--tau", "4",
                    "--logdir", str(tmp_path / "runs"), "--no-progress", "--checkpoint", str(tmp_path / "c.pt"),
                    "--summary-json", str(tmp_path / "s.json"), "--amp"]
    launch(common_flags + ["--epochs", "2"])
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 12
    out = launch(common_flags + ["--epochs", "3", "--resume"])
    assert "epoch 2:" in out and "epoch 0:" not in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 18
    (run,) = report.load_runs([str(tmp_path / "runs")])
    assert [s for s, _ in run.scalars["train/loss"]] == [3, 6, 9, 12, 15, 18]


@pytest.mark.horovod
def test_compare_tiny_budget(tmp_path):
    needs_horovod()
    cmd = [sys.executable, os.path.join(EXAMPLES, "compare.py"), "--np", "2", "--epochs", "1",
           "--algos", "allreduce,localsgd", "--logdir", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-5000:]
    lines = proc.stdout[:proc.stdout.index("Table 1")].splitlines()  # compare.py's own table
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("allreduce ", "localsgd_tau12 "))}
    assert set(rows) == {"allreduce", "localsgd_tau12"}
    for cells in rows.values():
        loss, acc, best, ms = (float(c) for c in cells[1:5])
        assert 0 < loss < 2.5 and 0 <= acc <= best <= 100 and ms > 0
    t1 = proc.stdout[proc.stdout.index("Table 1"):proc.stdout.index("Table 2")]
    assert "digits_cnn  Local SGD" in t1 and "digits_cnn  AR-SGD" in t1
    assert "Table 2" in proc.stdout
    png = proc.stdout.split("Figure: ")[1].split()[0]
    assert os.path.getsize(png) > 0

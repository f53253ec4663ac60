"""The examples (examples/*.py and their one training loop, examples/common.py).

Pure pieces (schedules, tokenizer, batching, the epochs of whole outer steps, the averaged
model for evaluation, --plan) run in-process. compare.py (the main job) is tested in
test_compare.py, the sweep runner in test_sweep.py. The scripts themselves run
under ``horovodrun -np 2 --gloo`` in their synthetic/tiny modes (CIFAR-10, ImageNet and WMT
cannot be downloaded here, so only the synthetic mode is exercised), and the report reads
their event files back.
"""

import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import hvd_slowmo
from slowmo_lab import report, sweep

from horovod_launch import horovodrun_command, needs_horovod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import common  # noqa: E402
import mnist1d_cnn  # noqa: E402
import translation_transformer as tt  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def launch(args, timeout=420):
    cmd = horovodrun_command(2, "gloo", args)
    proc = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stdout[-5000:]}"
    return proc.stdout


# --- pure pieces ---------------------------------------------------------------------------
def test_warmup_multistep_schedule():
    def f(s):
        return common.warmup_multistep(
            s, steps_per_epoch=10, warmup_epochs=5, milestones=[100, 150, 175]
        )

    assert f(0) == pytest.approx(1 / 50) and f(49) == 1.0 and f(50) == 1.0
    assert f(999) == 1.0 and f(1000) == pytest.approx(0.1) and f(1500) == pytest.approx(0.01)
    assert f(1750) == pytest.approx(0.001)


def test_inverse_sqrt_schedule():
    assert common.inverse_sqrt(0, 4000) == 1 / 4000
    assert common.inverse_sqrt(3998, 4000) == 3999 / 4000
    assert common.inverse_sqrt(3999, 4000) == 1.0
    assert common.inverse_sqrt(15999, 4000) == pytest.approx(0.5)


def test_run_names_encode_settings():
    def ns(**kw):
        settings = dict(run_name=None, algo="sgp", slowmo=True, tau=48, slow_lr=1.0,
                        slow_momentum=0.6, buffers="reset", no_average=False,
                        overlap=0, codec="none", error_feedback=False, fragments=1,
                        eager=None, mix=0.0)  # fmt: skip
        return SimpleNamespace(**{**settings, **kw})

    assert common.run_name(ns()) == "sgp-slowmo_tau48_a1_b0.6_reset"
    assert common.run_name(ns(no_average=True)) == "sgp-slowmo-noavg_tau48_a1_b0.6_reset"
    assert common.run_name(ns(slowmo=False)) == "sgp"
    assert common.run_name(ns(algo="localsgd", slowmo=False, tau=12)) == "localsgd_tau12"
    assert common.run_name(ns(run_name="mine")) == "mine"
    assert common.run_name(ns(overlap=2)) == "sgp-slowmo_tau48_a1_b0.6_reset_overlap2"
    assert (
        common.run_name(ns(codec="int8", error_feedback=True))
        == "sgp-slowmo_tau48_a1_b0.6_reset_int8_ef"
    )
    assert common.run_name(ns(overlap=2, fragments=4, eager="shares")).endswith(
        "_overlap2_fragments4_eager"
    )
    assert common.run_name(ns(overlap=1, eager="local")).endswith("_overlap1_eager-local")
    assert common.run_name(ns(overlap=2, fragments=4, mix=0.25)).endswith("_fragments4_mix0.25")
    assert common.run_name(ns(period_seconds="2s", merge="samples")).endswith(
        "_reset_period2s_weighted"
    )
    assert common.run_name(ns(algo="localsgd", slowmo=False, tau=12, quorum=3)) == (
        "localsgd_tau12_quorum3"
    )


def test_translation_tokenizer_vocab_and_batches():
    assert tt.tokenize("Hello, world!") == ["Hello", ",", "world", "!"]
    vocab = tt.build_vocab(["a b a", "c a b"], max_size=6, min_freq=1)
    assert vocab == {"<pad>": 0, "<unk>": 1, "<bos>": 2, "<eos>": 3, "a": 4, "b": 5}
    assert tt.encode("a c b", vocab, max_len=2) == [4, tt.UNK]
    batches = tt.make_batches([([4, 5, 4], [5]), ([4], [4, 5])], batch_size=2)
    ((src, tgt),) = batches
    assert src.tolist() == [[4, 0, 0], [4, 5, 4]]  # sorted by length, padded
    assert tgt.tolist() == [[4, 5, tt.EOS], [5, tt.EOS, 0]]
    assert tt.teacher_forcing(tgt).tolist() == [[tt.BOS, 4, 5], [tt.BOS, 5, tt.EOS]]


def test_outer_step_epochs_end_at_outer_step_boundaries():
    # 4000 examples, 4 workers, batch 32: a pass is 31.25 steps; the nearest multiple of 12 is 36.
    shards = [common.OuterStepEpochs(4000, 32, r, 4, seed=3, tau=12) for r in range(4)]
    assert {s.steps_per_epoch for s in shards} == {36}
    epochs = [[torch.cat(s.epoch(e)) for s in shards] for e in range(3)]
    assert all(len(b) == 32 for s in shards for b in s.epoch(1))
    # Each pass over the data is dealt to the workers without overlap, and the stream runs on
    # across epochs (epoch 1 starts where epoch 0 stopped).
    stream0 = torch.cat([epochs[e][0] for e in range(3)])
    first_pass = torch.cat([torch.cat([epochs[e][r] for e in range(3)])[:1000] for r in range(4)])
    assert sorted(first_pass.tolist()) == list(range(4000))
    assert torch.equal(stream0[: 36 * 32], epochs[0][0])
    # A pure function of (seed, epoch): a resumed run reads the same batches.
    again = common.OuterStepEpochs(4000, 32, 0, 4, seed=3, tau=12)
    assert all(torch.equal(a, b) for a, b in zip(again.epoch(2), shards[0].epoch(2)))
    other = common.OuterStepEpochs(4000, 32, 0, 4, seed=4, tau=12)
    assert not torch.equal(torch.cat(other.epoch(0)), epochs[0][0])
    # Sized for another pass (a held-out validation split), capped, or at least one outer step.
    assert common.OuterStepEpochs(3500, 32, 0, 4, 0, 12, pass_examples=4000).steps_per_epoch == 36
    assert common.OuterStepEpochs(3500, 32, 0, 4, 0, 12).steps_per_epoch == 24
    assert common.OuterStepEpochs(4000, 32, 0, 4, 0, 12, max_steps=5).steps_per_epoch == 5
    assert common.OuterStepEpochs(400, 32, 0, 4, 0, 48).steps_per_epoch == 48
    with pytest.raises(ValueError, match="--batch-size 64 does not fit"):
        common.OuterStepEpochs(100, 64, 0, 4, 0, 12)


def test_run_cli_plan_trains_each_entry_in_one_process(tmp_path):
    seen = []
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([["--seed", "0"], ["--seed", "1"]]))
    assert common.run_cli(seen.append, ["--epochs", "2", "--plan", str(plan)]) == 0
    assert seen == [["--epochs", "2", "--seed", "0"], ["--epochs", "2", "--seed", "1"]]
    assert common.run_cli(seen.append, ["--epochs", "3"]) == 0 and seen[-1] == ["--epochs", "3"]
    plan.write_text(json.dumps({"seed": 0}))
    with pytest.raises(ValueError, match="must hold a JSON list of argument lists"):
        common.run_cli(seen.append, ["--plan", str(plan)])


def test_mnist1d_is_generated_offline_and_leaves_global_generators_alone():
    pytest.importorskip("mnist1d", reason="pip install mnist1d (scripts/setup_env.sh installs it)")
    random.seed(7)
    expected = random.random()
    random.seed(7)
    data = mnist1d_cnn.load_mnist1d()
    assert random.random() == expected  # make_dataset reseeds Python's generator: restored
    assert data["train"].tensors[0].shape == (4000, 1, 40)
    assert data["val"].tensors[0].shape == (1000, 1, 40)
    assert sorted(set(data["train"].tensors[1].tolist())) == list(range(10))
    val = mnist1d_cnn.load_mnist1d(validation=True)
    assert len(val["train"]) == 3500 and len(val["val"]) == 500
    # Held out of the training split, not taken from the test split.
    assert torch.equal(val["val"].tensors[0], data["train"].tensors[0][3500:])
    assert mnist1d_cnn.ConvNet1D()(data["val"].tensors[0][:3]).shape == (3, 10)


# --- real runs under horovodrun -np 2 --gloo -------------------------------------------------
EXAMPLE_RUNS = {
    # script: (the algorithm flags, the validation tag, the report's row label)
    "cifar10_resnet18": (
        ["--algo", "localsgd", "--slowmo", "--tau", "2", "--batch-size", "16"],
        "val_accuracy",
        "Local SGD",
    ),
    "imagenet_resnet50": (
        ["--algo", "allreduce", "--no-slowmo", "--batch-size", "8"],
        "val_accuracy",
        "AR-SGD",
    ),
    "translation_transformer": (
        ["--algo", "sgp", "--slowmo", "--tau", "3", "--batch-size", "16"],
        "val_nll",
        "SGP",
    ),
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
    out = launch(
        [
            os.path.join(EXAMPLES, f"{example}.py"),
            "--synthetic",
            "--epochs",
            "2",
            "--max-steps",
            "4",
            "--log-every",
            "2",
            "--logdir",
            str(tmp_path / "runs"),
            "--no-progress",
            "--checkpoint",
            str(tmp_path / "ckpt.pt"),
            "--summary-json",
            str(summary_path),
        ]
        + flags
    )
    assert "epoch 1:" in out
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 8 and summary["workers"] == 2
    (run,) = report.load_runs([str(tmp_path / "runs")])
    assert (
        run.config["task"] == example and run.config["algo"] == algo and run.config["workers"] == 2
    )
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
def test_gossip_checkpoint_resume_through_the_examples(tmp_path):
    """SGP + SlowMo on digits (--amp: bf16 autocast on CPU): two epochs, then a new launch resumes
    from the checkpoint for a third. Every rank calls opt.state_dict() (gossip), the step count
    continues, TensorBoard gets the third epoch in the same run, and the result equals an
    uninterrupted run's bitwise (epochs of whole outer steps: all state is common at a save).
    Epochs are shorter than --log-every: the printed train loss is the epoch's real mean."""
    needs_horovod()
    if "sgp" not in hvd_slowmo.BASES:
        pytest.skip("base 'sgp' is not registered in hvd_slowmo.BASES")
    flags = [
        os.path.join(EXAMPLES, "digits.py"),
        "--algo",
        "sgp",
        "--slowmo",
        "--max-steps",
        "8",
        "--tau",
        "4",
        "--log-every",
        "3",
        "--no-progress",
        "--amp",
    ]
    resumed = flags + [
        "--logdir",
        str(tmp_path / "runs"),
        "--checkpoint",
        str(tmp_path / "c.pt"),
        "--summary-json",
        str(tmp_path / "resumed.json"),
    ]
    out = launch(resumed + ["--epochs", "2", "--log-every", "100"])
    assert "nan" not in out
    assert 0 < float(re.search(r"epoch 1: train loss (\d+\.\d+) \(minibatches\)", out).group(1)) < 3
    assert json.loads((tmp_path / "resumed.json").read_text())["steps"] == 16
    out = launch(resumed + ["--epochs", "3", "--resume"])
    assert "epoch 2:" in out and "epoch 0:" not in out
    launch(
        flags
        + [
            "--logdir",
            str(tmp_path / "straight"),
            "--epochs",
            "3",
            "--summary-json",
            str(tmp_path / "straight.json"),
        ]
    )
    summary, straight = (
        json.loads((tmp_path / f"{n}.json").read_text()) for n in ("resumed", "straight")
    )
    assert summary["steps"] == straight["steps"] == 24 and summary["evaluated_at_boundary"]
    for key in ("train_full_loss", "val_loss", "val_accuracy"):
        assert summary[key] == straight[key], key
    (run,) = report.load_runs([str(tmp_path / "runs")])
    assert [s for s, _ in run.scalars["train/full_loss"]] == [8, 16, 24]
    assert [s for s, _ in run.scalars["train/loss"]][-2:] == [21, 24]


def test_epoch_steps_give_equal_work_whatever_tau():
    # Rounded to tau, a larger tau trains more steps (36, 48, 96 per epoch here); with
    # --epoch-steps every tau trains the same steps on the same batches.
    rounded = {
        t: common.OuterStepEpochs(4000, 32, 0, 4, 0, t).steps_per_epoch for t in (12, 48, 96)
    }
    assert rounded == {12: 36, 48: 48, 96: 96}
    equal = [common.OuterStepEpochs(4000, 32, 0, 4, 0, t, epoch_steps=36) for t in (12, 24, 48, 96)]
    assert {e.steps_per_epoch for e in equal} == {36}
    assert all(torch.equal(torch.cat(e.epoch(3)), torch.cat(equal[0].epoch(3))) for e in equal)
    with pytest.raises(ValueError, match="--epoch-steps must be an integer >= 0"):
        common.OuterStepEpochs(4000, 32, 0, 4, 0, 12, epoch_steps=-1)


def test_thread_workers_train_equal_steps_mid_period_and_reproducibly(tmp_path):
    # Two thread workers in this process (--threads), 2 epochs of 10 steps at tau 4 and 8: the
    # same 20 steps; at tau 8 the run stops inside an outer step (20 = 2 x 8 + 4) and the final
    # evaluation scores the workers' average (a copy), not one worker's model.
    def run(tau: int, seed: int = 0) -> dict:
        out = tmp_path / f"s{tau}_{seed}.json"
        argv = ["--threads", "2", "--algo", "localsgd", "--slowmo", "--tau", str(tau)]
        argv += ["--epoch-steps", "10", "--epochs", "2", "--no-progress", "--validation"]
        argv += ["--logdir", str(tmp_path), "--summary-json", str(out), "--seed", str(seed)]
        assert common.run_cli(mnist1d_cnn.main, argv) == 0
        return json.loads(out.read_text())

    a, b = run(4), run(8)
    assert a["steps"] == b["steps"] == 20 and a["workers"] == 2
    assert a["outer_steps"] == 5 and b["outer_steps"] == 2
    assert a["evaluated_at_boundary"] and not b["evaluated_at_boundary"]
    assert run(8)["val_loss"] == b["val_loss"]  # the shared generator is used in turns: same bits


def test_sweep_worker_counts_and_baselines_at_every_tau(capsys):
    argv = ["x.py", "--ablation", "tau", "--taus", "12,48", "--slow-momentums", "0.7"]
    argv += ["--workers", "4,8", "--launcher", "threads", "--baseline", "--allreduce"]
    argv += ["--epoch-steps", "36", "--seeds", "0,1", "--dry-run"]
    assert sweep.main(argv) == 0
    cmds = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(cmds) == 2 * 2 * (1 + 2 + 2)  # per count and seed: AR-SGD, base x 2 taus, SlowMo x 2
    for m in (4, 8):
        mine = [c for c in cmds if c[c.index("--threads") + 1] == str(m)]
        names = {c[c.index("--run-name") + 1].split("/")[0] for c in mine}
        assert names == {
            f"allreduce_tau12_maintain_w{m}",
            f"localsgd_tau12_maintain_w{m}",
            f"localsgd_tau48_maintain_w{m}",
            f"localsgd-slowmo_tau12_a1_b0.7_reset_w{m}",
            f"localsgd-slowmo_tau48_a1_b0.7_reset_w{m}",
        }
    assert all(c[c.index("--epoch-steps") + 1] == "36" for c in cmds)
    assert all("horovodrun" not in c[0] and c[1] == "x.py" for c in cmds)  # no launcher
    ar = [c for c in cmds if "allreduce_tau12" in c[c.index("--run-name") + 1]]
    assert all(c[len(c) - 1 - c[::-1].index("--algo") + 1] == "allreduce" for c in ar)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["x.py", "--workers", "4,x"], "--workers: 'x' is not a int"),
        (["x.py", "--workers", "0,4"], "every count must be >= 1"),
        (["x.py", "--epoch-steps", "-3"], "--epoch-steps must be >= 0"),
    ],
)
def test_sweep_rejects_bad_worker_counts(argv, match):
    with pytest.raises(ValueError, match=match):
        sweep.main(argv + ["--dry-run", "--launcher", "threads"])


@pytest.mark.parametrize(
    "flag,exchange", [("sparse", "allgather"), ("sparse-owners", "owners"), ("int8", "dense")]
)
def test_codec_flag_builds_the_codec_it_names(flag, exchange):
    """--codec sparse / sparse-owners: SparseCodec() and its owners exchange; a dense name as
    it is."""
    from hvd_slowmo.comm.local import run_threads

    args = SimpleNamespace(algo="localsgd", tau=4, buffers="reset", no_average=False,
                           slow_lr=1.0, slow_momentum=0.5, overlap=0, fragments=1, eager=None,
                           mix=0.0, codec=flag, error_feedback=True, slowmo=True)  # fmt: skip
    model = torch.nn.Linear(4, 2)

    def build(comm):
        opt = common.build_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, args, comm)
        return opt.config.codec

    (codec,) = run_threads(1, build)
    if exchange == "dense":
        assert codec == flag
    else:
        assert isinstance(codec, hvd_slowmo.SparseCodec) and codec.exchange == exchange


def test_char_lm_runs_a_few_steps_on_cpu(tmp_path):
    # A tiny byte-level transformer on the stdlib corpus, 2 thread workers, Local AdamW +
    # SlowMo with DiLoCo's outer Nesterov: 12 steps, a finite validation loss below the uniform
    # model's ln 256, and the corpus named and fingerprinted.
    import char_lm

    out = tmp_path / "lm.json"
    argv = ["--threads", "2", "--algo", "localsgd", "--slowmo", "--tau", "4", "--slow-lr", "0.7"]
    argv += ["--slow-momentum", "0.9", "--outer-optimizer", "nesterov", "--width", "32"]
    argv += ["--layers", "1", "--heads", "2", "--context", "32", "--steps-per-epoch", "6"]
    argv += ["--epochs", "2", "--val-batches", "1", "--no-progress", "--device", "cpu"]
    argv += ["--logdir", str(tmp_path), "--summary-json", str(out)]
    assert common.run_cli(char_lm.main, argv) == 0
    s = json.loads(out.read_text())
    assert s["steps"] == 12 and s["outer_steps"] == 3 and s["outer_optimizer"] == "nesterov"
    assert 0 < s["val_loss"] < math.log(256)
    assert s["corpus"].startswith("CPython 3.") and len(s["corpus_sha256"]) == 64
    default = char_lm.ByteLM(192, 4, 4, 128)
    assert 1_000_000 <= sum(p.numel() for p in default.parameters()) <= 5_000_000


def test_sweep_one_launch_puts_threads_on_the_launch_line(capsys):
    argv = ["x.py", "--taus", "12", "--workers", "2,3", "--launcher", "threads", "--one-launch"]
    assert sweep.main(argv + ["--epoch-steps", "4", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    heads = [shlex.split(line) for line in lines[0::2]]  # a launch line, then its plan
    assert [h[h.index("--threads") + 1] for h in heads] == ["2", "3"]
    assert all(h[h.index("--epoch-steps") + 1] == "4" and h[-2] == "--plan" for h in heads)

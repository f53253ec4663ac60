"""The islands mode of examples/char_lm.py (``--islands N``, docs/islands.md) and the page's
minimal script (examples/islands_minimal.py), under torchrun with 4 Gloo processes: 2 islands x 2
ranks, FSDP2 or DDP inside. The flag checks run in-process.
"""

import json
import math
import os
import sys
from types import SimpleNamespace

import pytest

from torchrun_launch import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import common  # noqa: E402

TINY = ["--width", "32", "--layers", "2", "--heads", "2", "--context", "32", "--batch-size", "4"]
TINY += ["--steps-per-epoch", "8", "--epochs", "2", "--tau", "4", "--val-batches", "1"]
TINY += ["--corpus-bytes", "200000", "--device", "cpu", "--no-progress"]


@pytest.mark.torchdist
def test_char_lm_trains_as_two_islands_with_fsdp_as_with_ddp(tmp_path):
    """The same run with FSDP2 and with DDP inside the islands: the same slices of the same
    batches, so the two agree up to float rounding (FSDP reduce-scatters where DDP all-reduces),
    validation loss and consensus distance (measured on shards summed over the island with
    FSDP, on whole replicas with DDP) alike."""
    from slowmo_lab import report

    runs = {}
    for inner in ("fsdp", "ddp"):
        out = tmp_path / inner
        args = [os.path.join(EXAMPLES, "char_lm.py"), *TINY, "--islands", "2"]
        args += ["--islands-inner", inner, "--logdir", str(out / "runs"), "--log-every", "4"]
        args += ["--summary-json", str(out / "summary.json")]
        (result,) = torchrun(4, args, env={"OMP_NUM_THREADS": "1"})
        s = json.loads((out / "summary.json").read_text())
        assert (s["islands"], s["ranks_per_island"], s["islands_inner"]) == (2, 2, inner)
        assert s["steps"] == 16 and s["outer_steps"] == 4 and s["evaluated_at_boundary"]
        # 16 steps of AdamW at lr 1e-3 take the byte model well below a uniform guess (ln 256).
        assert math.isfinite(s["val_loss"]) and s["val_loss"] < math.log(256) - 0.5
        assert f"2 islands x 2 ranks ({inner})" in result.stdout
        (run,) = report.load_runs([str(out / "runs")])
        runs[inner] = (s, run.values("consensus"))
    (fsdp, fsdp_consensus), (ddp, ddp_consensus) = runs["fsdp"], runs["ddp"]
    assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-4)
    assert len(fsdp_consensus) == 4 and all(c > 0 for c in fsdp_consensus)
    assert fsdp_consensus == pytest.approx(ddp_consensus, rel=1e-3)


@pytest.mark.torchdist
def test_the_guide_page_minimal_script_runs(tmp_path):
    """docs/islands.md includes examples/islands_minimal.py: it trains, saves each rank's state,
    and a second launch resumes from it."""
    script = os.path.join(EXAMPLES, "islands_minimal.py")
    (first,) = torchrun(4, [script, str(tmp_path), "8"], env={"OMP_NUM_THREADS": "1"})
    assert sorted(p.name for p in tmp_path.glob("ckpt.rank*.pt")) == [
        f"ckpt.rank{r}.pt" for r in range(4)
    ]
    (second,) = torchrun(4, [script, str(tmp_path), "12"], env={"OMP_NUM_THREADS": "1"})
    assert "resumed at step 8" in second.stdout
    assert "step 12" in second.stdout


def _flags(**kw):
    base = dict(islands=2, islands_inner="fsdp", batch_size=4, checkpoint=None, resume=False)
    return SimpleNamespace(**{**base, **kw})


def _job(size, engine="torch"):
    return SimpleNamespace(engine=engine, size=lambda: size)


@pytest.mark.parametrize(
    "flags, job, message",
    [
        (_flags(islands=3), _job(4), r"--islands 3 must divide the world size 4.*\[1, 2, 4\]"),
        (_flags(islands=0), _job(4), "--islands 0 must divide"),
        (_flags(), _job(4, "horovod"), "needs torch.distributed.*worker='node'"),
        (_flags(batch_size=5), _job(4), "--batch-size 5 is per island.*2 ranks"),
        (_flags(checkpoint="c.pt"), _job(4), "--checkpoint/--resume with --islands"),
    ],
    ids=["not-a-divisor", "zero", "horovod", "odd-batch", "checkpoint"],
)
def test_island_flags_are_checked_before_any_mesh(flags, job, message):
    with pytest.raises(ValueError, match=message):
        common.shard_islands(None, flags, job, None, [])

"""Worker for tests/test_amp_horovod.py, run under horovodrun: AMP overflows on one rank.

Usage: amp_worker.py OUT_DIR
For each base and recipe, the run with overflows forced on rank 1 and the reference run in
which those iterations never happen; writes this rank's results to OUT_DIR/amp.RANK.pt.
"""

import os
import sys
import warnings

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import amp_run

BASES = {
    "localsgd": dict(base="localsgd", tau=3, slow_momentum=0.6),
    # One bucket: Horovod fuses per-parameter averages by timing, which at 3 ranks can change
    # Gloo's sum order between the recipes compared bitwise here.
    "allreduce": dict(base="allreduce", tau=3, slow_momentum=0.6, bucket_mb=25),
    "sgp": dict(base="sgp", tau=3, slow_momentum=0.6),
}
STEPS, SKIPPED, BAD_RANK = 11, {1, 5}, 1


def main():
    out = sys.argv[1]
    hvd.init()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # GradScaler on CPU
    results = {}
    for case, kwargs in BASES.items():
        for recipe in ("reference", "scaler", "horovod"):
            model = amp_run.mlp()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            results[(case, recipe)] = amp_run.run(
                model, recipe, SKIPPED, BAD_RANK, STEPS, hvd.rank(), **kwargs
            )
    torch.save(results, os.path.join(out, f"amp.{hvd.rank()}.pt"))


if __name__ == "__main__":
    main()

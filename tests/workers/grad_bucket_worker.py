"""Worker for tests/test_grad_buckets_horovod.py: AR-SGD's bucketed gradient average under
horovodrun.

Usage: grad_bucket_worker.py OUT_DIR [node]
For every scenario of tests/grad_average_run.py, this rank's gradients after each backward pass
and parameters after each step, with small buckets, with one bucket, with the default (one
parameter per average: Horovod fuses them), and with fp16 compression
(``node``: ``worker="node"``, the NODE_CASES, small buckets only); written to
OUT_DIR/buckets.RANK.pt.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import grad_average_run as run


def main():
    out, node = sys.argv[1], sys.argv[2:] == ["node"]
    hvd.init(process_sets="dynamic" if node else None)
    torch.set_num_threads(1)
    results = {}
    for case in run.CASES:
        if node:
            if case in run.NODE_CASES:
                results[case] = run.train(run.Net(), case, hvd.rank(), worker="node")
            continue
        results[case] = run.train(run.Net(), case, hvd.rank())
        results[(case, "one bucket")] = run.train(run.Net(), case, hvd.rank(), bucket_mb=100)
        opts = []  # the default: one parameter per average, fused by Horovod itself
        results[(case, "default")] = run.train(
            run.Net(), case, hvd.rank(), opts=opts, bucket_mb=None
        )
        results[(case, "default buckets")] = len(opts[0]._grad_average.buckets)
    if not node:
        results[("plain", "fp16")] = run.train(
            run.Net(), "plain", hvd.rank(), compression=hvd.Compression.fp16
        )
    results["layout"] = (hvd.cross_rank(), hvd.local_rank())
    torch.save(results, os.path.join(out, f"buckets.{hvd.rank()}.pt"))


if __name__ == "__main__":
    main()

"""Streaming SlowMo (fragments) and eager updates under horovodrun (Gloo, 3 processes): anchors
bitwise identical on every rank after every step, and the run equal to the hand-written
reference (tests/reference_streaming.py). Gloo's ring allreduce sums the three workers in its
own order, not the reference's rank order, so the comparison with the reference allows the last
bits (rtol 1e-5); the ranks among themselves must agree exactly. The compressed exchange sums in
rank order, as the reference: there the parameters must equal it bit for bit (the model buffers,
still allreduced, within rtol)."""

import os

import pytest
import torch
from reference_compression import pseudo_gradient_average
from reference_streaming import reference_streaming

from horovod_launch import horovodrun
from reference import lr_at

WORKER = os.path.join(os.path.dirname(__file__), "workers", "streaming_worker.py")
pytestmark = pytest.mark.horovod
SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
REFS = {  # name: the reference's (tau, delay, fragments, eager, alpha, beta, buffers, nesterov)
    "p3-d2-eager": (6, 2, 3, True, 1.0, 0.6, "reset", False),
    "p2-d2-nesterov": (4, 2, 2, False, 0.8, 0.5, "reset", True),
    "p2-d2-int8-feedback": (4, 2, 2, False, 0.8, 0.6, "reset", False),
    "p2-d1-local": (4, 1, 2, "local", 0.8, 0.6, "reset", False),
}
CODECS = {"p2-d2-int8-feedback": ("int8", True)}  # name: (codec, error feedback)


def test_fragments_and_eager_match_the_reference_on_gloo(tmp_path):
    np_ = 3
    horovodrun(np_, "gloo", [WORKER, str(tmp_path)])
    results = [torch.load(tmp_path / f"train.{r}.pt", weights_only=False) for r in range(np_)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers
    try:
        for name, (tau, d, p, eager, alpha, beta, buffers, nesterov) in REFS.items():
            for per_rank in zip(*[res[name]["anchors"] for res in results]):
                for tensors in zip(*per_rank):
                    assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), name
            average = pseudo_gradient_average(*CODECS[name]) if name in CODECS else None
            want, anchors = reference_streaming(
                np_, 15, tau, d, p, eager, alpha, beta, SGD, buffers, lr_at, nesterov,
                average=average,
            )  # fmt: skip
            assert len(anchors) >= 4
            for got, value in zip(results[0][name]["anchors"][-1], anchors[-1]):
                torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=f"{name} anchor")
            params = {n for n, _ in want[0].named_parameters()}
            for rank, ref in enumerate(want):
                got = results[rank][name]["final"]
                for key, value in ref.state_dict().items():
                    where = f"{name} rank {rank} {key}"
                    if name in CODECS and key in params:
                        assert torch.equal(got[key], value), where
                    else:
                        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=where)
    finally:
        torch.set_num_threads(before)

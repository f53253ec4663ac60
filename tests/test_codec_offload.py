"""The codec's work off the training thread (hvd_slowmo/compression/offload.py): on thread
workers an average's start returns before its encode has run, the encode runs on the codec
thread, and the results (parameters, residual, bytes) are bit for bit those of the same
averages with the codec on the training thread."""

import os
import sys
import threading

import pytest
import torch

import hvd_slowmo.compression.exchange as dense_exchange
import hvd_slowmo.compression.sparse_exchange as sparse_exchange
from hvd_slowmo.comm.local import ThreadCommunicator, run_threads
from hvd_slowmo.compression.averager import PseudoGradientAverage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from sparse_worker import ROUND_CODECS, pseudo_gradient_rounds


class Inline(ThreadCommunicator):
    """A thread worker whose codec work stays on the training thread."""

    collectives_any_thread = False


@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("codec", list(ROUND_CODECS))
def test_offloaded_rounds_equal_the_inline_ones_bitwise(codec, m):
    got = run_threads(m, lambda comm: pseudo_gradient_rounds(comm, ROUND_CODECS[codec]))
    want = run_threads(
        m, lambda comm: pseudo_gradient_rounds(Inline(comm.world, comm.rank), ROUND_CODECS[codec])
    )
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["offloaded"] and not w["offloaded"]
        for a, b, first in zip(g["params"], w["params"], got[0]["params"]):
            assert torch.equal(a, b), f"rank {rank}: parameters differ from the inline run"
            assert torch.equal(a, first), f"rank {rank}: parameters differ from rank 0"
        assert torch.equal(g["residual"], w["residual"]) and g["residual"].abs().sum() > 0
        assert g["bytes"] == w["bytes"] > 0


@pytest.mark.parametrize(
    "module,function,native_codecs",
    [
        (sparse_exchange, "sparse_encode_with_feedback", None),
        (dense_exchange, "encode_rows", "0"),  # the eager torch path
        (dense_exchange, "native_encode_rows", "1"),  # the C kernels
    ],
    ids=["sparse", "dense-eager", "dense-native"],
)
def test_start_returns_before_the_encode_has_run(monkeypatch, module, function, native_codecs):
    """An instrumented encode that cannot finish until every worker's start has returned (and
    checked that no encode finished): a start that ran the encode itself would never return."""
    if native_codecs is not None:
        monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", native_codecs)
    m = 2
    release = threading.Event()
    barrier = threading.Barrier(m, timeout=30)
    finished: list[str] = []
    encode = getattr(module, function)

    def slow_encode(*args, **kwargs):
        assert release.wait(30), "never released"
        out = encode(*args, **kwargs)
        finished.append(threading.current_thread().name)
        return out

    monkeypatch.setattr(module, function, slow_encode)
    codec = ROUND_CODECS["sparse" if module is sparse_exchange else "int8"]

    def fn(comm):
        average = PseudoGradientAverage(comm, codec, error_feedback=True)
        anchor = [torch.zeros(300)]
        params = [torch.randn(300, generator=torch.Generator().manual_seed(comm.rank))]
        pending = average.start(params, anchor, "slow")
        none_before = not finished
        barrier.wait()  # every worker's start has returned
        release.set()
        pending.wait()
        return none_before, params[0]

    got = run_threads(m, fn)
    assert all(none_before for none_before, _ in got)
    assert finished and set(finished) == {"hvd_slowmo-codec"}  # not the training threads
    assert torch.equal(got[0][1], got[1][1])


def test_uncounted_starts_stay_uncounted():
    """A start inside ``comm.uncounted()`` is not counted, though its collectives run on the
    codec thread after the block has ended; one outside is."""

    def fn(comm):
        average = PseudoGradientAverage(comm, "int8", error_feedback=False)
        anchor = [torch.zeros(64)]
        with comm.uncounted():
            pending = average.start([torch.ones(64) * comm.rank], anchor, "a")
        pending.wait()
        hidden = comm.bytes_sent
        average.start([torch.ones(64) * comm.rank], anchor, "b").wait()
        return hidden, comm.bytes_sent

    for hidden, counted in run_threads(2, fn):
        assert hidden == 0 and counted > 0


def test_an_error_on_the_codec_thread_is_raised_at_the_wait():
    def fn(comm):
        average = PseudoGradientAverage(comm, "sparse", error_feedback=False)
        n = 100 + 5000 * comm.rank  # the workers disagree on the length: the gather says so
        pending = average.start([torch.ones(n)], [torch.zeros(n)], "bad")
        with pytest.raises(RuntimeError, match="disagree"):
            pending.wait()
        return True

    assert run_threads(2, fn) == [True, True]

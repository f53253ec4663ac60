"""The sparse codec (hvd_slowmo.compression.sparse) and its all-gather average on the thread
communicator: packets and decodes equal to the hand-written reference byte for byte, the average
bitwise equal to the reference and identical on every worker, error feedback with decay, the
bytes on the wire, edge cases and bad settings."""

import math
import time

import pytest
import torch
from reference_sparse import encode as reference_encode
from reference_sparse import sparse_mean as reference_mean
from reference_sparse import vector

from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import (
    PendingSparseMean,
    SparseCodec,
    packet_nbytes,
    sparse_decode_dense,
    sparse_encode,
    sparse_mean,
)
from hvd_slowmo.compression.averager import PseudoGradientAverage
from hvd_slowmo.compression.codecs import check_codec
from hvd_slowmo.compression.sparse import (
    pack_bits,
    sparse_decode_runs,
    sparse_encode_feedback,
    unpack_bits,
)

# n, density, bits, chunk: chunks cut short at the end, index widths below, at and above 8 bits
CODEC_CASES = {
    "d05-b2-c64": (1000, 0.05, 2, 64),
    "d10-b4-c100": (777, 0.1, 4, 100),
    "d30-b8-c7": (300, 0.3, 8, 7),
    "d02-b2-c4096": (9000, 0.02, 2, 4096),
    "d1-b2-c2": (11, 1.0, 2, 2),
    "d01-b4-c300": (500, 0.01, 4, 300),
    "short": (5, 0.5, 2, 64),
}


@pytest.mark.parametrize("case", list(CODEC_CASES))
def test_packet_and_decode_equal_the_reference(case):
    n, density, bits, chunk = CODEC_CASES[case]
    codec = SparseCodec(density=density, bits=bits, chunk=chunk)
    x = vector(0, n)
    packet = sparse_encode(x, codec)
    want_packet, want_decoded = reference_encode(x, density, bits, chunk)
    assert packet.numel() == packet_nbytes(n, codec) == want_packet.numel()
    assert torch.equal(packet, want_packet)
    decoded = sparse_decode_dense(packet, n, codec)
    assert torch.equal(decoded, want_decoded)
    # What is kept: k per chunk at most, the largest entry of each chunk (to the rounding of
    # lo + (L - 1) * step).
    k = codec.k
    assert int((decoded != 0).sum()) <= k * math.ceil(n / chunk)
    for c in range(0, n, chunk):
        part = x[c : c + chunk]
        top = int(part.abs().argmax())
        torch.testing.assert_close(decoded[c + top], part[top], rtol=1e-6, atol=0)


def _bits(t):
    return t.contiguous().view(torch.int32)


def _same(a, b):
    """Equal bits, a NaN equal to any NaN: which NaN ``-nan - nan`` gives is not promised (x86's
    subtraction returns its first NaN, torch's vectorized one its second)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        _bits(a.masked_fill(nan, 0)), _bits(b.masked_fill(nan, 0))
    )


@pytest.mark.parametrize("case", list(CODEC_CASES))
def test_feedback_and_run_decodes_equal_their_definitions_bitwise(case):
    """sparse_encode_feedback is ``residual - sparse_decode_dense(packet)`` and
    sparse_decode_runs the concatenation of sparse_decode_dense, bit for bit (a NaN's payload
    and sign aside): NaNs of both signs, infinities, negative zeros and a short last chunk
    included."""
    n, density, bits, chunk = CODEC_CASES[case]
    codec = SparseCodec(density=density, bits=bits, chunk=chunk)
    x = vector(0, n, seed=3)
    residual = vector(1, n, seed=4)
    for i, v in zip(range(0, n, 3), [float("nan"), -float("nan"), float("inf"), -0.0, 0.0]):
        x[i] = v
        residual[(i + 1) % n] = v
    residual[0] = -float("nan")
    want = residual - sparse_decode_dense(sparse_encode(x, codec), n, codec)
    got = residual.clone()
    assert torch.equal(sparse_encode_feedback(x, codec, got), sparse_encode(x, codec))
    assert _same(got, want)
    # Regions as the owners' exchange cuts them: whole chunks, the last one short, empty ones.
    chunks = -(-n // chunk)
    sizes = [min(n, chunk * (chunks // 2))] if chunks > 1 else []
    sizes += [n - sum(sizes), 0, 0]
    parts = x.split(sizes)
    packets = torch.cat([sparse_encode(p.contiguous(), codec) for p in parts])
    want = torch.cat(
        [
            sparse_decode_dense(sparse_encode(p.contiguous(), codec), p.numel(), codec)
            if p.numel()
            else p.clone()
            for p in parts
        ]
    )
    assert torch.equal(_bits(sparse_decode_runs(packets, sizes, codec)), _bits(want))


def test_two_bit_values_are_the_ends_of_the_kept_range():
    codec = SparseCodec(density=0.25, bits=2, chunk=8)
    x = torch.tensor([0.1, -4.0, 0.2, 1.0, -0.3, 2.9, 0.0, 0.05])  # keeps -4, 2.9
    decoded = sparse_decode_dense(sparse_encode(x, codec), 8, codec)
    assert decoded.tolist() == [0, -4.0, 0, 0, 0, pytest.approx(2.9), 0, 0]
    x = torch.tensor([1.0, -1.0, 0, 0, 0, 0, 0, 0])  # a tie in magnitude: the lower position
    codec = SparseCodec(density=1 / 8, bits=2, chunk=8)
    assert sparse_decode_dense(sparse_encode(x, codec), 8, codec).tolist()[:2] == [1.0, 0.0]


def test_zeros_and_non_finite_values():
    codec = SparseCodec(density=0.5, bits=4, chunk=8)
    x = torch.zeros(16)
    x[9] = 3.0  # chunk 1 has one non-zero and keeps 4: the kept zeros decode to zero
    decoded = sparse_decode_dense(sparse_encode(x, codec), 16, codec)
    assert torch.equal(decoded, x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.randn(16)
        y[2] = bad
        decoded = sparse_decode_dense(sparse_encode(y, codec), 16, codec)
        assert not decoded[:8].isfinite().all(), "a non-finite chunk decoded to finite values"
        assert decoded[8:].isfinite().all()


def test_bit_packing_round_trips():
    g = torch.Generator().manual_seed(0)
    for width in range(1, 9):
        for count in (0, 1, 7, 8, 9, 1001):
            values = torch.randint(0, 1 << width, (count,), generator=g)
            packed = pack_bits(values, width)
            assert packed.numel() == math.ceil(count * width / 8)
            assert torch.equal(unpack_bits(packed, count, width), values)


BAD = {
    "density-0": (dict(density=0.0), ValueError, "density must be in"),
    "density-big": (dict(density=1.5), ValueError, "density must be in"),
    "density-nan": (dict(density=float("nan")), ValueError, "density must be in"),
    "density-str": (dict(density="2%"), TypeError, "density"),
    "bits-3": (dict(bits=3), ValueError, "bits must be one of"),
    "bits-float": (dict(bits=2.0), TypeError, "bits"),
    "chunk-1": (dict(chunk=1), ValueError, "chunk must be in"),
    "chunk-huge": (dict(chunk=1 << 17), ValueError, "chunk must be in"),
    "chunk-float": (dict(chunk=4096.0), TypeError, "chunk"),
    "decay-big": (dict(ef_decay=1.1), ValueError, "ef_decay must be in"),
    "decay-bool": (dict(ef_decay=True), TypeError, "ef_decay"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_settings(case):
    kwargs, error, match = BAD[case]
    with pytest.raises(error, match=match):
        SparseCodec(**kwargs)


def test_codec_names():
    assert check_codec("sparse") == SparseCodec()
    spec = SparseCodec(density=0.01, bits=4)
    assert check_codec(spec) is spec
    with pytest.raises(ValueError, match="'sparse' or a SparseCodec"):
        check_codec("sparse2")


def run_mean(m, n, codec, feedback, polled=False):
    def fn(comm):
        residual = 0.1 * vector(comm.rank, n, seed=1) if feedback else None
        x = vector(comm.rank, n)
        if polled:
            pending = PendingSparseMean(comm, x, codec, "t", residual)
            deadline = time.monotonic() + 30
            while not pending.done():  # completes by polling alone (the progress thread)
                assert time.monotonic() < deadline, "the sparse mean never completed by polling"
                time.sleep(0.001)
            out = pending.wait()
        else:
            out = sparse_mean(comm, x, codec, "t", residual)
        return out, residual, comm.bytes_sent

    return run_threads(m, fn)


MEAN_CASES = {  # m, n, density, bits, chunk, feedback, decay
    "m2-plain": (2, 700, 0.05, 2, 64, False, 1.0),
    "m3-feedback": (3, 1001, 0.05, 2, 64, True, 1.0),
    "m3-decay": (3, 1001, 0.1, 4, 100, True, 0.95),
    "m4-b8": (4, 513, 0.2, 8, 16, True, 0.5),
    "m5-c4096": (5, 5000, 0.02, 2, 4096, True, 0.95),
}


@pytest.mark.parametrize("polled", [False, True], ids=["wait", "polled"])
@pytest.mark.parametrize("case", list(MEAN_CASES))
def test_mean_equals_reference_bitwise_on_every_worker(case, polled):
    m, n, density, bits, chunk, feedback, decay = MEAN_CASES[case]
    codec = SparseCodec(density=density, bits=bits, chunk=chunk, ef_decay=decay)
    got = run_mean(m, n, codec, feedback, polled)
    residuals = [0.1 * vector(r, n, seed=1) for r in range(m)] if feedback else None
    want, want_residuals, want_bytes = reference_mean(
        [vector(r, n) for r in range(m)], density, bits, chunk, residuals, decay
    )
    for rank, (out, residual, nbytes) in enumerate(got):
        assert torch.equal(out, want[rank]), f"rank {rank}: differs from the reference"
        assert torch.equal(out, got[0][0]), f"rank {rank}: differs from rank 0"
        assert nbytes == want_bytes[rank] == (m - 1) * packet_nbytes(n, codec)
        if feedback:
            assert torch.equal(residual, want_residuals[rank]), f"rank {rank}: residual"
    exact = sum(vector(r, n) for r in range(m)) / m
    assert not torch.equal(got[0][0], exact)  # a test of the test: really sparse


@pytest.mark.parametrize("m", [2, 3, 4])
def test_fifty_times_fewer_bytes_than_fp32_at_two_percent(m):
    """Bytes per exact average, measured by the communicator's counter: the fp32 allreduce of
    the parameters against the sparse all-gather (2%, 2 bits, chunks of 4096). The all-gather
    sends ``m - 1`` packets, so the ratio falls with ``m``: 108x at 2 workers, 54x at 4."""
    n = 4096 * 64
    codec = SparseCodec(density=0.02, bits=2, chunk=4096)

    def fn(comm):
        x = vector(comm.rank, n)
        before = comm.bytes_sent
        comm.average_([x.clone()], "fp32")
        fp32 = comm.bytes_sent - before
        sparse_mean(comm, x, codec, "s")
        return fp32, comm.bytes_sent - before - fp32

    for fp32, sparse in run_threads(m, fn):
        assert sparse == (m - 1) * packet_nbytes(n, codec)
        assert fp32 / sparse >= 50, f"{fp32} / {sparse} = {fp32 / sparse:.1f}"
    assert 4 * n / packet_nbytes(n, codec) > 108  # one packet against the float32 vector


def test_feedback_sends_what_was_dropped_later():
    """Plain error feedback (decay 1): over rounds of the same vector, the sum of what was sent
    approaches the sum of what was given (the residual stays bounded)."""
    codec = SparseCodec(density=0.1, bits=2, chunk=50)
    n, rounds = 500, 40

    def fn(comm):
        residual = torch.zeros(n)
        total = torch.zeros(n)
        x = vector(comm.rank, n)
        for _ in range(rounds):
            total += sparse_mean(comm, x, codec, "ef", residual)
        return total, residual

    got = run_threads(2, fn)
    given = rounds * (vector(0, n) + vector(1, n)) / 2
    sent = got[0][0]
    assert torch.equal(sent, got[1][0])
    residual_mean = (got[0][1] + got[1][1]) / 2
    assert torch.allclose(sent + residual_mean, given, atol=1e-3)  # nothing is lost
    assert residual_mean.abs().max() < given.abs().max() / 4


def test_one_worker_returns_its_vector():
    codec = SparseCodec()
    x = vector(0, 100)
    residual = torch.ones(100)

    def fn(comm):
        return sparse_mean(comm, x, codec, "t", residual), comm.bytes_sent

    ((out, nbytes),) = run_threads(1, fn)
    assert torch.equal(out, x) and nbytes == 0 and torch.equal(residual, torch.ones(100))


def test_pseudo_gradient_average_keeps_the_sparse_residual_in_its_state():
    codec = SparseCodec(density=0.1, bits=2, chunk=16, ef_decay=0.9)
    shapes = [(3, 5), (7,), (2, 2)]

    def fn(comm):
        avg = PseudoGradientAverage(comm, codec, error_feedback=True)
        g = torch.Generator().manual_seed(comm.rank)
        anchor = [torch.ones(s) for s in shapes]
        params = [a - torch.randn(a.shape, generator=g) for a in anchor]
        avg.average_(params, anchor, "pga")
        state = avg.state_dict()
        fresh = PseudoGradientAverage(comm, codec, error_feedback=True)
        fresh.load_state_dict(state)
        other = PseudoGradientAverage(comm, SparseCodec(density=0.2), error_feedback=True)
        other.load_state_dict(state)  # another codec's residual is not taken
        elsewhere = PseudoGradientAverage(comm, codec, error_feedback=True)
        elsewhere.load_state_dict({**state, "world_size": 3})  # nor another world's (elastic)
        return params, state, fresh.residual, other.residual, elsewhere.residual

    got = run_threads(2, fn)
    for params, state, loaded, other, elsewhere in got:
        assert all(torch.equal(a, b) for a, b in zip(params, got[0][0]))
        assert state["codec"] == codec.summary()
        assert torch.equal(loaded, state["residual"]) and state["residual"].abs().sum() > 0
        assert other is None and elsewhere is None

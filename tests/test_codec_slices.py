"""The codecs a slice at a time (hvd_slowmo.compression.codecs.SLICE and sparse.SLICE): with
slices far shorter than the vector, every mean still equals the hand-written reference bit for
bit, and the bytes an encode, a decode or a whole mean allocate stay under a bound set by the
slice, the packets and the result (where the whole vector's temporaries were several copies of
it), counted from torch.profiler's memory events on the calling thread."""

import pytest
import torch
from reference_compression import reference_compressed_mean, worker_vector
from reference_sparse import sparse_mean as reference_sparse_mean
from reference_sparse import vector
from torch.profiler import ProfilerActivity, profile

import hvd_slowmo.compression.codecs as codecs
import hvd_slowmo.compression.sparse as sparse
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import CODECS, SparseCodec, compressed_mean, sparse_mean
from hvd_slowmo.compression.codecs import decode_rows, encode_rows, encoded_nbytes


@pytest.fixture
def short_slices(monkeypatch):
    """Slices of 512 elements (dense: one or two blocks of 256 per row; sparse: one chunk)."""
    monkeypatch.setattr(codecs, "SLICE", 512)
    monkeypatch.setattr(sparse, "SLICE", 512)


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("codec", CODECS)
def test_sliced_dense_mean_equals_the_reference_bitwise(short_slices, codec, m, feedback):
    # Chunks of uneven lengths, each many slices long, blocks cut short at chunk ends.
    n = 9 * 256 * m + 5 * m + 1
    residuals = [0.1 * worker_vector(r, n, seed=1) for r in range(m)] if feedback else None

    def fn(comm):
        residual = None if residuals is None else residuals[comm.rank].clone()
        out = compressed_mean(comm, worker_vector(comm.rank, n), codec, "t", residual)
        return out, residual

    got = run_threads(m, fn)
    want, want_residuals, _ = reference_compressed_mean(
        [worker_vector(r, n) for r in range(m)], codec, 256, residuals
    )
    for rank, (out, residual) in enumerate(got):
        assert torch.equal(out, want[rank]), f"rank {rank}: differs from the reference"
        if feedback:
            assert torch.equal(residual, want_residuals[rank]), f"rank {rank}: residual"


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_sliced_sparse_mean_equals_the_reference_bitwise(short_slices, feedback):
    m, n, density, bits, chunk = 3, 5 * 512 + 77, 0.05, 2, 512  # six chunks, the last short
    codec = SparseCodec(density=density, bits=bits, chunk=chunk, ef_decay=0.95)
    residuals = [0.1 * vector(r, n, seed=1) for r in range(m)] if feedback else None

    def fn(comm):
        residual = None if residuals is None else residuals[comm.rank].clone()
        return sparse_mean(comm, vector(comm.rank, n), codec, "t", residual), residual

    got = run_threads(m, fn)
    want, want_residuals, _ = reference_sparse_mean(
        [vector(r, n) for r in range(m)], density, bits, chunk, residuals, 0.95
    )
    for rank, (out, residual) in enumerate(got):
        assert torch.equal(out, want[rank]), f"rank {rank}: differs from the reference"
        if feedback:
            assert torch.equal(residual, want_residuals[rank]), f"rank {rank}: residual"


def test_decode_rows_of_columns_equals_the_whole_decode(short_slices):
    rows = torch.randn(3, 2000, generator=torch.Generator().manual_seed(2))
    packets, _ = encode_rows(rows, "fp8", decoded=False)
    whole = decode_rows(packets, 2000, "fp8")
    assert torch.equal(decode_rows(packets, 2000, "fp8", columns=(512, 1700)), whole[:, 512:1700])
    with pytest.raises(ValueError, match="multiple of the block"):
        decode_rows(packets, 2000, "fp8", columns=(100, 300))


def peak_bytes(fn) -> int:
    """The most bytes allocated (and not yet freed) at once on this thread while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


SLICE = 1 << 14  # 64 kB of float32: the vectors below are 64 slices long
N = 64 * SLICE


@pytest.fixture
def slices(monkeypatch):
    monkeypatch.setattr(codecs, "SLICE", SLICE)
    monkeypatch.setattr(sparse, "SLICE", SLICE)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_an_encode_with_feedback_allocates_its_packet_and_a_few_slices(slices, codec):
    # The whole vector at once made its quotients and a padded copy: over two copies of it.
    rows = torch.randn(2, N // 2 + 100)  # a short block at each row's end
    packet = 2 * encoded_nbytes(N // 2 + 100, codec)
    peak = peak_bytes(lambda: encode_rows(rows, codec, decoded=False, feedback=True))
    assert peak <= packet + 4 * 4 * SLICE, (peak, packet)


def test_a_decode_allocates_its_result_and_a_few_slices(slices):
    rows = torch.randn(2, N // 2)
    packets, _ = encode_rows(rows, "fp8", decoded=False)
    peak = peak_bytes(lambda: decode_rows(packets, N // 2, "fp8"))
    assert peak <= 4 * N + 4 * 4 * SLICE, peak


def test_a_sparse_encode_allocates_its_entries_and_a_few_slices(slices):
    # The whole vector at once made int64 keys, their int32 masks and a padded copy: four
    # copies of it. Left: a few slices, and the kept entries' own temporaries (k = 82 of 4096:
    # their positions, values, levels and codes, a few int64 each: under a quarter of the
    # vector's bytes).
    codec = SparseCodec()
    x = torch.randn(N + 1000)  # a short last chunk
    residual = x.clone()
    peak = peak_bytes(lambda: sparse.sparse_encode_feedback(x, codec, residual))
    assert peak <= N + 4 * 4 * SLICE, peak


def test_a_dense_mean_allocates_its_result_its_packets_and_a_few_slices(slices):
    # int8 with error feedback at two workers: the packets sent, received and gathered (about
    # a quarter of the vector's bytes each) and the result; no other copy of the vector.
    def fn(comm):
        x = worker_vector(comm.rank, N)
        residual = torch.zeros(N)
        if comm.rank != 0:
            return compressed_mean(comm, x, "int8", "t", residual) is not None
        return peak_bytes(lambda: compressed_mean(comm, x, "int8", "t", residual))

    peak = run_threads(2, fn)[0]
    packets = encoded_nbytes(N, "int8")
    assert peak <= 4 * N + 3 * packets + 4 * 4 * SLICE, (peak, 4 * N + 3 * packets)

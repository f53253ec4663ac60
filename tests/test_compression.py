"""The compressed exact average (hvd_slowmo.compression) on the thread communicator: equal bit
for bit to the hand-written reference for every codec and 2..8 workers, identical on every
worker, the bytes on the wire, error feedback, and the codecs' edge cases."""

from functools import partial

import pytest
import torch
from reference_compression import reference_compressed_mean, worker_vector

from hvd_slowmo.comm.base import Communicator
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import CODECS, compressed_mean, decode, encode, encoded_nbytes
from hvd_slowmo.compression.averager import PseudoGradientAverage
from hvd_slowmo.compression.codecs import check_codec, from_bytes, to_bytes

SIZES = range(2, 9)


def run_mean(m: int, n: int, codec: str, feedback: bool, block: int = 256):
    """Every worker's (result, residual, bytes_sent) for worker_vector inputs."""

    def fn(comm):
        residual = 0.1 * worker_vector(comm.rank, n, seed=1) if feedback else None
        out = compressed_mean(comm, worker_vector(comm.rank, n), codec, "t", residual, block)
        return out, residual, comm.bytes_sent

    return run_threads(m, fn)


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("m", SIZES, ids=[f"m{m}" for m in SIZES])
@pytest.mark.parametrize("codec", CODECS)
def test_equals_reference_bitwise_on_every_worker(codec, m, feedback):
    # Chunks of uneven lengths (n % m != 0 for every m here), blocks cut short at chunk ends.
    n = 3 * 256 * m + 5 * m + 3 if m % 2 else 3 * 256 * m + 5 * m + 1
    got = run_mean(m, n, codec, feedback)
    residuals = [0.1 * worker_vector(r, n, seed=1) for r in range(m)] if feedback else None
    want, want_residuals, want_bytes = reference_compressed_mean(
        [worker_vector(r, n) for r in range(m)], codec, 256, residuals
    )
    for rank, (out, residual, nbytes) in enumerate(got):
        assert torch.equal(out, want[rank]), f"rank {rank}: differs from the reference"
        assert torch.equal(out, got[0][0]), f"rank {rank}: differs from rank 0"
        assert nbytes == want_bytes[rank], f"rank {rank}: {nbytes} bytes, reference {want_bytes}"
        if feedback:
            assert torch.equal(residual, want_residuals[rank]), f"rank {rank}: residual"


def test_fp32_codec_equals_the_exact_average():
    # The same fp32 sums in the same order as the thread communicator's allreduce.
    n = 1000

    def fn(comm):
        x = worker_vector(comm.rank, n)
        exact = x.clone()
        comm.average_([exact], "exact")
        return compressed_mean(comm, x, "fp32", "t"), exact

    for out, exact in run_threads(3, fn):
        assert torch.equal(out, exact)


def test_bytes_on_the_wire():
    m, n = 4, 4096 * 4  # whole blocks in every chunk: the byte counts are exact
    sent = {c: run_mean(m, n, c, False)[0][2] for c in CODECS}
    assert sent["fp32"] == 2 * (m - 1) * n * 4 // m  # a ring allreduce's volume of fp32
    assert sent["bf16"] * 2 == sent["fp32"] and sent["fp16"] == sent["bf16"]
    scales = 2 * (m - 1) * (n // 256) * 4 // m  # one float32 per 256 codes, both collectives
    assert sent["int8"] == sent["fp32"] // 4 + scales
    assert sent["fp8"] == sent["int8"]


def test_error_feedback_sends_what_was_lost_later():
    # Constant inputs: without feedback every round makes the same rounding error, so the sum of
    # K averages drifts K times it; with feedback the first-stage error stays bounded.
    m, n, rounds = 4, 2048, 32

    def fn(comm, feedback):
        x = worker_vector(comm.rank, n)
        residual = torch.zeros(n) if feedback else None
        total = torch.zeros(n)
        for _ in range(rounds):
            total += compressed_mean(comm, x, "int8", "t", residual)
        return total

    true = sum(worker_vector(r, n) for r in range(m)) / m * rounds
    drift = {fb: (run_threads(m, partial(fn, feedback=fb))[0] - true).norm() for fb in (0, 1)}
    assert drift[1] < 0.25 * drift[0], drift


def test_codec_edge_cases():
    x = torch.randn(700)
    x[256:512] = 0.0
    for codec in ("int8", "fp8"):
        enc = encode(x, codec)
        assert enc.scales.numel() == 3 and enc.scales[1] == 0
        out = decode(enc, codec)
        assert torch.equal(out[256:512], torch.zeros(256)), codec  # a zero block decodes to 0
        # Round trip: within half a code step of int8 (a relative 1/16 for e4m3's 3 bits).
        step = enc.scales.repeat_interleave(256)[:700]
        bound = step / 2 if codec == "int8" else x.abs() / 16 + step * 2**-9
        assert ((out - x).abs() <= bound * (1 + 1e-6)).all(), codec
        packet = to_bytes(enc)
        assert packet.numel() == encoded_nbytes(700, codec) == 700 + 3 * 4
        assert torch.equal(decode(from_bytes(packet, 700, codec), codec), out)
        # A non-finite value makes its whole block NaN, and only its block.
        bad = x.clone()
        bad[600] = float("inf")
        bad[10] = float("nan")
        out = decode(encode(bad, codec), codec)
        assert out[:256].isnan().all() and out[512:].isnan().all(), codec
        assert torch.equal(out[256:512], torch.zeros(256)), codec
    with pytest.raises(ValueError, match="bytes"):
        from_bytes(packet[:-1], 700, "fp8")
    with pytest.raises(ValueError, match="codec must be one of"):
        check_codec("int4")


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_decodes_give_the_bits_of_whole_block_products(codec):
    """decode, decode_rows and encode_rows' decoded rows: the bits of the codes cast to float32,
    zero-padded to whole blocks and multiplied by their scales, NaN codes times NaN scales in a
    short last block included (which NaN comes out depends on the kernel's path)."""
    from hvd_slowmo.compression.codecs import decode_rows, encode_rows

    block, size, count = 256, 700, 3  # two whole blocks and a short one per row
    rows = torch.randn(count, size, generator=torch.Generator().manual_seed(5))
    rows[0, 650] = float("nan")  # a NaN scale in the short block
    rows[1, 3] = -float("nan")
    rows[2, 690] = float("inf")
    packets, decoded = encode_rows(rows, codec, block)
    per_row = -(-size // block)
    scales = packets[:, : 4 * per_row].contiguous().view(torch.float32)
    # Codes of the short block, whose scale is NaN in row 0, set to NaN (fp8) or to 0 (int8):
    # a NaN code times a NaN scale at every position of the kernel's vector body and tail.
    packets[0, 4 * per_row + 640 :] = 0x7F if codec == "fp8" else 0
    packets[1, 4 * per_row + 690 :] = 0xFF if codec == "fp8" else 0
    dtype = torch.int8 if codec == "int8" else torch.float8_e4m3fn
    codes = packets[:, 4 * per_row :].contiguous().view(dtype).to(torch.float32)
    padded = torch.nn.functional.pad(codes, (0, per_row * block - size)).view(-1, block)
    want = (padded * scales.reshape(-1)[:, None]).view(count, -1)[:, :size]
    bits = partial(torch.Tensor.view, dtype=torch.int32)
    assert torch.equal(bits(decode_rows(packets, size, codec, block)), bits(want.contiguous()))
    for r in range(count):
        got = decode(from_bytes(packets[r].clone(), size, codec, block), codec, block)
        assert torch.equal(bits(got), bits(want[r].contiguous()))
    packets, decoded = encode_rows(rows, codec, block)  # before the NaN codes were written
    codes = packets[:, 4 * per_row :].contiguous().view(dtype).to(torch.float32)
    padded = torch.nn.functional.pad(codes, (0, per_row * block - size)).view(-1, block)
    want = (padded * scales.reshape(-1)[:, None]).view(count, -1)[:, :size]
    assert torch.equal(bits(decoded.contiguous()), bits(want.contiguous()))


def test_alltoall_sizes_must_agree():
    def fn(comm):
        sends = [torch.zeros(comm.rank + 1) for _ in range(comm.size)]
        return comm.alltoall_flat(sends, [1] * comm.size, "t")

    with pytest.raises(RuntimeError, match="expected"):
        run_threads(2, fn)


def test_a_communicator_without_the_collectives_says_what_to_implement():
    class Minimal(Communicator):  # the required operations only (a user's own transport)
        rank, size = 0, 2

        def _average_(self, tensors, name):
            return 0

        def _allgather_object(self, obj):
            return [obj, obj]

        def _broadcast_object(self, obj, root_rank):
            return obj

    comm = Minimal()
    assert not comm.supports_alltoall
    with pytest.raises(NotImplementedError, match="supports_alltoall = True implements"):
        comm.alltoall_flat([torch.zeros(1)] * 2, [1, 1], "t")
    with pytest.raises(NotImplementedError, match="implements _allgather_flat"):
        comm.allgather_flat([torch.zeros(1)], "t")
    # The compressed average refuses such a transport up front, naming the fix.
    with pytest.raises(ValueError, match="use codec=None"):
        compressed_mean(comm, torch.zeros(4), "int8", "t")


def test_pseudo_gradient_average_and_its_residual_state():
    # Parameters of mixed shapes and dtypes averaged as anchor - mean(anchor - params), where
    # the mean is the reference's; the residual is saved and taken back only by its own worker.
    m = 3
    anchor = [torch.linspace(-2, 2, 300).reshape(20, 15), torch.linspace(5, 6, 77)]

    def params_of(rank):
        return [a + 0.01 * worker_vector(rank, a.numel()).view_as(a) for a in anchor]

    def fn(comm):
        avg = PseudoGradientAverage(comm, "int8", error_feedback=True)
        params = params_of(comm.rank)
        avg.average_(params, anchor, "pg")
        saved = avg.state_dict()
        other = PseudoGradientAverage(comm, "int8", error_feedback=True)
        other.load_state_dict(saved)
        mine = other.residual
        other.load_state_dict(comm.broadcast_object(saved, root_rank=0))  # rank 0's residual
        return params, saved["residual"].clone(), mine, other.residual

    flat_anchor = torch.cat([a.reshape(-1) for a in anchor])
    grads = [flat_anchor - torch.cat([p.reshape(-1) for p in params_of(r)]) for r in range(m)]
    want, want_residuals, _ = reference_compressed_mean(grads, "int8", 256, [0 * g for g in grads])
    want_params = (flat_anchor - want[0]).split([a.numel() for a in anchor])
    for rank, (params, residual, mine, from_rank0) in enumerate(run_threads(m, fn)):
        for p, w in zip(params, want_params):
            assert torch.equal(p.reshape(-1), w), f"rank {rank}"
        assert torch.equal(residual, want_residuals[rank]) and torch.equal(mine, residual)
        assert (from_rank0 is None) == (rank != 0), f"rank {rank} took rank 0's residual"

"""The C kernels of the int8, fp16 and bf16 codecs (hvd_slowmo.compression.native): bitwise the
eager torch path for every phase (encode with and without error feedback, reduce, decode) on
awkward inputs, the compressed mean of both paths against the hand-written reference, the
threads' split, and the fallback where no compiler works."""

import warnings

import pytest
import torch
from reference_compression import reference_compressed_mean, worker_vector

import hvd_slowmo.compression.native as native
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import compressed_mean, encoded_nbytes
from hvd_slowmo.compression.codecs import decode_rows, encode, encode_rows, to_bytes
from hvd_slowmo.compression.exchange import PendingMean
from hvd_slowmo.compression.offload import Scratch
from hvd_slowmo.divide import div_


def awkward(n: int, seed: int) -> torch.Tensor:
    """Values over 90 decades (infinities, blocks whose scale underflows to 0, halves' and
    bf16's overflows and subnormals among them), a zero block, exact ties of the rounding (a
    block of absmax 127 has scale 1: x.5 values round to even), and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-45, 45, n)[torch.randperm(n, generator=g)]
    x[: min(n, 300)] = 0.0
    if n > 600:
        x[300:556] = torch.arange(256) / 2 - 64.25  # ties: k + 0.5 ... and quarters
        x[300] = 127.0
        x[400] = -0.0
    return x


def eager_reduce(codec: str, packets: torch.Tensor, size: int, block: int) -> torch.Tensor:
    """The eager path's reduce of ``packets`` (m rows): decode, sum in order, divide, encode."""
    received = decode_rows(packets, size, codec, block)
    total = received[0]
    for src in range(1, packets.shape[0]):
        total += received[src]
    return to_bytes(encode(div_(total, packets.shape[0]), codec, block))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that a NaN equals any NaN: which NaN an operation on two NaNs yields
    differs between torch's own kernels (its vectorized sub is a fused multiply-add, its
    ATEN_CPU_CAPABILITY=default one is not), so the eager path promises no payload either."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32)
    )


def same_packets(codec: str, a: torch.Tensor, b: torch.Tensor, size: int, block: int) -> bool:
    """Equal packets: int8's bytes (a NaN quotient is code 0 on every path); fp8's scales and
    the casts' codes as :func:`same` compares them, fp8's codes by what they decode to (torch's
    own casts give a NaN other bits with and without its vectorized kernels: bf16 0xffff and
    0x7fc0 here; a NaN code's sign)."""
    if codec == "int8":
        return torch.equal(a, b)
    width = encoded_nbytes(size, codec, block)
    a, b = a.reshape(-1, width), b.reshape(-1, width)
    if codec == "fp8":
        blocks = -(-size // block)
        scales_a = (
            a[:, : 4 * blocks].clone(memory_format=torch.contiguous_format).view(torch.float32)
        )
        scales_b = (
            b[:, : 4 * blocks].clone(memory_format=torch.contiguous_format).view(torch.float32)
        )
        if not same(scales_a, scales_b):
            return False
    return same(decode_rows(a, size, codec, block), decode_rows(b, size, codec, block))


#: (codec, block): the scaled codecs' blocks of 1 to 1000 elements; the casts have none.
CASES = [("int8", 1), ("int8", 3), ("int8", 256), ("int8", 1000), ("fp8", 3), ("fp8", 256)]
CASES += [("fp16", 256), ("bf16", 256)]
IDS = [f"{c}-b{b}" for c, b in CASES]


@pytest.mark.parametrize("codec,block", CASES, ids=IDS)
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_encode_equals_the_eager_path_bitwise(codec, block, feedback):
    count, size = 3, 2 * 1000 + 7  # short last blocks
    rows = awkward(count * size, seed=block).view(count, size)
    residual = 1e-3 * awkward(count * size, seed=block + 1).view(count, size)
    out = torch.empty(count, encoded_nbytes(size, codec, block), dtype=torch.uint8)
    want_out = torch.empty_like(out)
    if feedback:
        got_res, want_res = residual.clone(), torch.add(rows, residual)
        native.encode_rows(codec, got_res, block, out, rows, feedback=True)
        encode_rows(want_res, codec, block, want_out, decoded=False, feedback=True)
        assert same(got_res, want_res), "residuals differ"
    else:
        native.encode_rows(codec, rows, block, out)
        encode_rows(rows, codec, block, want_out, decoded=False)
    assert same_packets(codec, out, want_out, size, block), "packets differ"


@pytest.mark.parametrize("codec,block", CASES, ids=IDS)
@pytest.mark.parametrize("m", [2, 3, 8])
def test_reduce_and_decode_equal_the_eager_path_bitwise(codec, block, m):
    size = 1000 + 7
    values = awkward(m * size, seed=m).view(m, size)
    packets, _ = encode_rows(values, codec, block, decoded=False)
    got = native.reduce(codec, list(packets), size, block)
    assert same_packets(codec, got, eager_reduce(codec, packets, size, block), size, block)
    out = torch.empty(m, size)
    native.decode_rows(codec, packets, size, block, out)
    assert same(out, decode_rows(packets, size, codec, block))


def test_non_finite_blocks_keep_the_eager_bits():
    """A NaN or an infinity makes its block's scale NaN or infinite: the codes, the residual
    and the decode take the eager path's bits (NaNs: as :func:`same` says)."""
    x = torch.randn(4 * 256)
    x[5], x[300], x[700], x[701], x[900] = float("nan"), float("inf"), float("-inf"), 1.0, 3.0
    x[901] = float("nan")
    rows, residual = x.view(1, -1), torch.zeros(1, x.numel())
    out = torch.empty(1, encoded_nbytes(x.numel(), "int8"), dtype=torch.uint8)
    want_out, want_res = torch.empty_like(out), rows.clone()
    native.encode_rows("int8", residual, 256, out, rows, feedback=True)
    encode_rows(want_res, "int8", 256, want_out, decoded=False, feedback=True)
    assert torch.equal(out, want_out) and same(residual, want_res)
    decoded = torch.empty(1, x.numel())
    native.decode_rows("int8", out, x.numel(), 256, decoded)
    assert decoded.isnan().all()  # every block held a non-finite value
    assert same(decoded, decode_rows(want_out, x.numel(), "int8", 256))


@pytest.mark.parametrize("path", ["0", "1"], ids=["eager", "native"])
@pytest.mark.parametrize("m", [2, 3, 5])
@pytest.mark.parametrize("codec", native.CODECS)
def test_both_paths_equal_the_reference_on_every_worker(monkeypatch, codec, path, m):
    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", path)
    n = 4 * 256 * m + 3 * m + 1  # uneven chunks, short blocks

    def fn(comm):
        residual = 0.1 * worker_vector(comm.rank, n, seed=1)
        out = compressed_mean(comm, worker_vector(comm.rank, n), codec, "t", residual)
        return out, residual

    got = run_threads(m, fn)
    residuals = [0.1 * worker_vector(r, n, seed=1) for r in range(m)]
    want, want_res, _ = reference_compressed_mean(
        [worker_vector(r, n) for r in range(m)], codec, 256, residuals
    )
    for rank, (out, residual) in enumerate(got):
        assert torch.equal(out, want[rank]), f"rank {rank}: mean differs from the reference"
        assert torch.equal(residual, want_res[rank]), f"rank {rank}: residual differs"


@pytest.mark.parametrize("path", ["0", "1"], ids=["eager", "native"])
@pytest.mark.parametrize("codec", native.CODECS)
def test_kept_packet_buffers_serve_successive_means_of_any_size(monkeypatch, codec, path):
    """Means one after another through one scratch (as the codec thread runs them): each equals
    the reference, and the packets and the reduced chunk stay in the buffers the first made."""
    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", path)
    m, sizes = 3, [4 * 256 * 3 + 7, 100, 4 * 256 * 3 + 7]

    def fn(comm):
        scratch, outs, kept = Scratch(), [], []
        for seed, n in enumerate(sizes):
            residual = 0.1 * worker_vector(comm.rank, n, seed=10 + seed)
            flat = worker_vector(comm.rank, n, seed=seed)
            mean = PendingMean(comm, flat, codec, "t", residual, scratch=scratch).wait()
            outs.append((mean, residual))
            kept.append(sorted(b.data_ptr() for b in scratch.buffers))
        return outs, kept

    got = run_threads(m, fn)
    for i, n in enumerate(sizes):
        residuals = [0.1 * worker_vector(r, n, seed=10 + i) for r in range(m)]
        want, want_res, _ = reference_compressed_mean(
            [worker_vector(r, n, seed=i) for r in range(m)], codec, 256, residuals
        )
        for rank, (outs, kept) in enumerate(got):
            mean, residual = outs[i]
            assert torch.equal(mean, want[rank]), f"mean {i}, rank {rank}: differs"
            assert torch.equal(residual, want_res[rank]), f"mean {i}, rank {rank}: residual"
            assert len(kept[i]) == 2 and kept[i] == kept[0], "packets and reduced chunk kept"


@pytest.mark.parametrize("codec", native.CODECS)
@pytest.mark.parametrize("n", [0, 2, 4])
def test_fewer_elements_than_workers_leave_chunks_empty(codec, n):
    """5 workers, 0 to 4 elements: some chunks (and so packets) are empty."""

    def fn(comm):
        return compressed_mean(comm, worker_vector(comm.rank, n), codec, "t", torch.zeros(n))

    want, _, _ = reference_compressed_mean(
        [worker_vector(r, n) for r in range(5)], codec, 256, [torch.zeros(n)] * 5
    )
    assert all(torch.equal(g, w) for g, w in zip(run_threads(5, fn), want))


def on_1_2_and_3_threads(monkeypatch, fn):
    """``fn()``'s results on 1 thread, then on 2 and 3 (every phase split however small)."""
    outs = []
    for threads, least in ((1, 1 << 30), (2, 1), (3, 1)):
        monkeypatch.setattr(native, "_MIN_PER_THREAD", least)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(fn())
        finally:
            torch.set_num_threads(previous)
    return outs


@pytest.mark.parametrize("codec", native.CODECS)
def test_threads_split_the_work_without_changing_a_bit(monkeypatch, codec):
    size, block = 50 * 256 + 9, 256
    rows = awkward(2 * size, seed=7).view(2, size)

    def phases():
        out = torch.empty(2, encoded_nbytes(size, codec, block), dtype=torch.uint8)
        native.encode_rows(codec, rows, block, out)
        decoded = native.decode_rows(codec, out, size, block, torch.empty(2, size))
        return out, native.reduce(codec, list(out), size, block), decoded

    outs = on_1_2_and_3_threads(monkeypatch, phases)
    for got in outs[1:]:
        assert all(same(a.view(-1).float(), b.view(-1).float()) for a, b in zip(got, outs[0]))


def test_switched_off_and_other_devices_or_codecs_take_the_eager_path(monkeypatch):
    x = torch.zeros(4)
    assert native.usable("int8", x)
    assert all(native.usable(codec, x) for codec in ("fp8", "fp16", "bf16"))
    assert native.usable("sparse", x)  # its encode and sum
    assert not native.usable("fp32", x) and not native.usable("int8", torch.zeros(4, device="meta"))
    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", "0")
    assert not native.usable("int8", x)


def test_no_compiler_warns_once_and_the_eager_path_gives_the_same_mean(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_TRIED", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HVD_SLOWMO_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert not native.usable("int8", torch.zeros(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        assert not native.usable("int8", torch.zeros(1))
        got = run_threads(
            3, lambda comm: compressed_mean(comm, worker_vector(comm.rank, 999), "int8", "t")
        )
    want, _, _ = reference_compressed_mean([worker_vector(r, 999) for r in range(3)], "int8", 256)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_build_is_cached_by_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("HVD_SLOWMO_CACHE", str(tmp_path))
    first = native._build()
    stamp = first.stat().st_mtime_ns
    assert native._build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
    monkeypatch.setattr(native, "_cpu_features", lambda: "another machine")
    assert native._build() != first  # a build per kind of CPU


def test_fp8_rounds_every_tie_and_its_neighbours_as_torch_casts():
    """Every float8_e4m3fn value, every midpoint between two neighbours (a tie: to even), one
    ulp either side of it, and random values, in blocks whose scale is 1 (each block holds 448,
    so each value is its own quotient): the C cast's codes are torch's."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite() & (codes >= 0)].unique()  # 0 .. 448, subnormals included
    ties = (values[1:] + values[:-1]) / 2
    near = torch.cat([ties, ties.nextafter(ties + 1), ties.nextafter(ties - 1), values])
    near = torch.cat([near, -near, (torch.rand(50_000) - 0.5) * 896])
    blocks = -(-near.numel() // 255)
    rest = torch.zeros(blocks * 255)
    rest[: near.numel()] = near
    x = torch.cat([torch.full((blocks, 1), 448.0), rest.view(blocks, 255)], dim=1).view(1, -1)
    got = torch.empty(1, encoded_nbytes(x.numel(), "fp8"), dtype=torch.uint8)
    native.encode_rows("fp8", x, 256, got)
    want, _ = encode_rows(x, "fp8", 256, decoded=False)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def portable_cache(tmp_path_factory):
    """Where the portable builds of this module's tests are cached (one compile)."""
    return tmp_path_factory.mktemp("portable-kernels")


def use_build(monkeypatch, build: str, cache) -> None:
    """``native``: the library as built for this machine (-march=native: here AVX-512, the
    vector paths of the sparse codec); ``portable``: built for any x86-64 (no -march), so the
    scalar paths run, as on a CPU without AVX-512."""
    if build == "portable":
        monkeypatch.setattr(native, "_VARIANTS", (["-fopenmp"], []))
        monkeypatch.setenv("HVD_SLOWMO_CACHE", str(cache))
        monkeypatch.setattr(native, "_LIB", None)
        monkeypatch.setattr(native, "_TRIED", False)


@pytest.mark.parametrize(
    "chunk,density,bits",
    [(4096, 0.02, 2), (7, 0.5, 4), (64, 1.0, 8), (65536, 0.001, 2), (2, 0.5, 2)],
)
@pytest.mark.parametrize("layout", ["random", "increasing", "on-the-sample"])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_sparse_encode_equals_the_eager_encode(
    monkeypatch, portable_cache, build, chunk, density, bits, layout
):
    """The C encode keeps the entries of the eager ``topk`` of the codec's keys and packs them
    into the same bytes, and its error feedback (also with the decayed sum before it) leaves
    the same residual: magnitude ties (broken
    by position), NaN, infinities, signed zeros, a short last chunk, positions of more and fewer
    than 8 bits; magnitudes increasing along each chunk (every entry displaces one); and the
    large entries on exactly the sampled positions, so that fewer than k pass the threshold and
    every key is a candidate (the fallback). On both builds (:func:`use_build`)."""
    from hvd_slowmo.compression.sparse import (
        SparseCodec,
        sparse_encode,
        sparse_encode_feedback,
        sparse_encode_with_feedback,
    )

    n = 3 * chunk + chunk // 3 + 1
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(n, generator=g)
    if layout == "increasing":
        x = torch.linspace(-1, 1, n).abs() * torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)
    elif layout == "on-the-sample":
        x = 1e-3 * x
        x[::16] = torch.arange(x[::16].numel(), dtype=torch.float32) + 1
    x[::7] = x[::7].round()
    x[min(3, n - 1)], x[min(11, n - 1)], x[n // 2] = float("nan"), -float("inf"), -0.0
    codec = SparseCodec(density=density, bits=bits, chunk=chunk)
    use_build(monkeypatch, build, portable_cache)
    decayed = SparseCodec(density=density, bits=bits, chunk=chunk, ef_decay=0.9)
    carried = torch.randn(n, generator=g)

    def encodes():
        residual, summed = x.clone(), carried.clone()
        return (
            sparse_encode(x, codec),
            sparse_encode_feedback(residual, codec, residual),
            residual,
            sparse_encode_with_feedback(x, decayed, summed),  # 0.9 summed + x, then as above
            summed,
        )

    got = encodes()
    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", "0")
    want = encodes()
    for i in (0, 1, 3):  # packets
        assert torch.equal(got[i], want[i])
    assert same(got[2], want[2]) and same(got[4], want[4])  # residuals


@pytest.mark.parametrize("path", ["0", "1", "portable"], ids=["eager", "native", "portable"])
@pytest.mark.parametrize("m", [2, 3, 5])
def test_sparse_mean_of_both_paths_equals_the_reference(monkeypatch, portable_cache, path, m):
    """The all-gather sparse mean with decayed error feedback (the C encode and sum, on either
    build, or the eager ones) against the hand-written reference: every worker's mean and
    residual."""
    from reference_sparse import sparse_mean as reference_sparse_mean
    from reference_sparse import vector

    from hvd_slowmo.compression.sparse import SparseCodec
    from hvd_slowmo.compression.sparse_exchange import sparse_mean

    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", "0" if path == "0" else "1")
    use_build(monkeypatch, "portable" if path == "portable" else "native", portable_cache)
    n, codec = 5 * 64 + 13, SparseCodec(density=0.1, bits=4, chunk=64, ef_decay=0.95)

    def fn(comm):
        residual = 0.1 * vector(comm.rank, n, seed=1)
        return sparse_mean(comm, vector(comm.rank, n), codec, "t", residual), residual

    residuals = [0.1 * vector(r, n, seed=1) for r in range(m)]
    want, want_res, _ = reference_sparse_mean(
        [vector(r, n) for r in range(m)], 0.1, 4, 64, residuals, 0.95
    )
    for rank, (out, residual) in enumerate(run_threads(m, fn)):
        assert torch.equal(out, want[rank]), f"rank {rank}: mean differs from the reference"
        assert torch.equal(residual, want_res[rank]), f"rank {rank}: residual differs"


def test_sparse_threads_split_the_work_without_changing_a_bit(monkeypatch):
    from hvd_slowmo.compression.sparse import SparseCodec, sparse_encode_feedback, sparse_sum

    n, codec = 37 * 512 + 5, SparseCodec(density=0.05, bits=2, chunk=512)

    def phases():
        residual = awkward(n, seed=3)
        packet = sparse_encode_feedback(residual, codec, residual)
        return packet, residual, sparse_sum(torch.stack([packet] * 3), n, codec)

    outs = on_1_2_and_3_threads(monkeypatch, phases)
    for got in outs[1:]:
        assert torch.equal(got[0], outs[0][0])
        assert same(got[1], outs[0][1]) and same(got[2], outs[0][2])


def test_fp8_decodes_every_code_as_torch_casts():
    """Every one of the 256 codes (subnormals, both zeros, both NaNs) in a block of scale 1, also
    with subnormal floats flushed to zero (the C decode makes none on the way)."""
    codes = torch.arange(256, dtype=torch.uint8)
    packet = torch.cat([torch.ones(1).view(torch.uint8), codes]).view(1, -1)
    want = decode_rows(packet, 256, "fp8", 256)
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        try:
            got = native.decode_rows("fp8", packet, 256, 256, torch.empty(1, 256))
        finally:
            torch.set_flush_denormal(False)
        assert same(got, want), f"flush_denormal={flush}"


@pytest.mark.parametrize(
    "chunk,density,bits",
    [(4096, 0.02, 2), (256, 0.25, 4), (1000, 0.05, 8), (65536, 0.001, 2), (48, 0.75, 4)],
)
@pytest.mark.parametrize("build", ["native", "portable"])
def test_sparse_sum_equals_the_eager_sum(monkeypatch, portable_cache, build, chunk, density, bits):
    """The C sum of packets from different vectors (NaN, infinities, signed zeros among them)
    equals the eager decode and ``index_add_``, divided and not: positions of 8 bits and fewer
    (one stream) and more (low bytes and a stream), codes of 2, 4 and 8 bits, and k of 16 and more,
    so that the AVX-512 build decodes sixteen entries at a time and the group at the packet's
    end falls back to one at a time. On both builds (:func:`use_build`)."""
    from hvd_slowmo.compression.sparse import SparseCodec, sparse_encode, sparse_sum

    n = 3 * chunk + chunk // 3 + 1
    codec = SparseCodec(density=density, bits=bits, chunk=chunk)
    assert codec.k >= 16
    rows = []
    for seed in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        x[seed], x[n // 2 + seed], x[-1 - seed] = float("nan"), -float("inf"), -0.0
        rows.append(sparse_encode(x, codec))
    packets = torch.stack(rows)
    use_build(monkeypatch, build, portable_cache)
    got = [sparse_sum(packets, n, codec, divide=d).clone() for d in (1, 3)]
    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", "0")
    want = [sparse_sum(packets, n, codec, divide=d) for d in (1, 3)]
    for g, w in zip(got, want):
        assert same(g, w)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_sparse_encode_when_only_the_looser_threshold_passes_k(monkeypatch, portable_cache, build):
    """The AVX-512 encode tries a tight threshold from the sample first (its 8th largest of every
    16th magnitude for k = 82 of 4096) and, where fewer than k pass it, the looser one (the
    11th): here 8 pass the first and 91 the second, so the second pass runs; the packet and the
    residual equal the eager path's."""
    from hvd_slowmo.compression.sparse import SparseCodec, sparse_encode_with_feedback

    chunk = 4096
    codec = SparseCodec(density=0.02, bits=2, chunk=chunk)
    assert codec.k == 82
    x = 1e-3 * torch.randn(2 * chunk, generator=torch.Generator().manual_seed(5))
    x[0:176:16] = torch.arange(110, 99, -1, dtype=torch.float32)  # 11 samples: 110 ... 100
    between = torch.arange(1, 4096, 16)[20:100] + 3  # 80 positions off the sample
    x[between] = 100.5 + torch.arange(80, dtype=torch.float32) / 100  # between 100 and 103
    use_build(monkeypatch, build, portable_cache)

    def encode():
        residual = torch.zeros_like(x)
        return sparse_encode_with_feedback(x, codec, residual), residual

    got = encode()
    monkeypatch.setenv("HVD_SLOWMO_NATIVE_CODECS", "0")
    want = encode()
    assert torch.equal(got[0], want[0]) and same(got[1], want[1])

"""The fused codec kernels (hvd_slowmo.compression.fused, DenseCodec(kernels="compiled")) give
the eager path's bits: the encode of rows with and without error feedback (codes, scales,
residual), the reduce and the decode, on chunks with a short last block, blocks of zeros, a
block whose scale underflows, NaN and infinite blocks; a whole mean of 3 thread workers and a
SlowMo run with error feedback; each kernel compiled once. Every compiling test is ``slow``:
the first call of each kernel compiles it (tens of seconds on a loaded 2-core machine; the
file compiles 8 kernels: encode, encode with feedback, the 3-worker reduce and decode, for
int8 and fp8)."""

import os
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import hvd_slowmo.compression.codecs as codecs
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import DenseCodec, check_codec, fused
from hvd_slowmo.compression.codecs import decode_rows, encode_rows, encoded_nbytes
from hvd_slowmo.compression.exchange import reduce_packets
from hvd_slowmo.compression.means import mean_start
from hvd_slowmo.config import SlowMoConfig

from helpers import PLAIN_SGD, assert_same_models, run_slowmo
from horovod_launch import ROOT

B = 256
SIZE = 5 * B + 77  # five whole blocks and a short one
FUSED = ("int8", "fp8")
CODE_MAX = {"int8": 127.0, "fp8": 448.0}


@pytest.fixture
def short_slices(monkeypatch):
    """Slices of 512 elements: the chunks below span several, the eager path's and the fused
    one's (a last slice of one element joins the one before)."""
    monkeypatch.setattr(codecs, "SLICE", 512)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the thread workers run (torch.set_num_threads(1)): the kernels
    are compiled for the thread count, so the tests share one compile of each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float32 tensor (NaNs compared by their bits too)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def rows_with_specials(count: int, size: int, seed: int) -> torch.Tensor:
    """``count`` rows: random values of many scales, and in rows 0/1 a block of zeros, a block
    whose absmax / 448 and / 127 underflow to 0, a NaN block, an infinite block (+inf and
    -inf), the short last block with a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, size, generator=g) * torch.logspace(-3, 2, size)
    x[0, :B] = 0.0
    x[0, B : 2 * B] = torch.randn(B, generator=g) * 1e-44
    x[count - 1, 2 * B + 5] = float("nan")
    x[count - 1, 3 * B + 7] = float("inf")
    x[0, 3 * B + 9] = -float("inf")
    if size % B:
        x[min(1, count - 1), size - 3] = float("nan")
    x[0, 4 * B : 5 * B].clamp_(-0.5, 0.5)[0] = TELLING  # the block's absmax
    return x


def _telling() -> float:
    """An absmax whose scales (/ 127, / 448) differ from the products with the reciprocals."""
    v = torch.linspace(1.0, 2.0, 4096)
    by_127 = (v / torch.full_like(v, 127.0)) != v * torch.full_like(v, 1.0 / 127.0)
    by_448 = (v / torch.full_like(v, 448.0)) != v * torch.full_like(v, 1.0 / 448.0)
    return float(v[by_127 & by_448][0])


TELLING = _telling()


def reciprocal_differs(values: torch.Tensor, divisor: float) -> bool:
    """Whether a product with ``divisor``'s float32 reciprocal would change some quotient: the
    data can tell a fused division from that plausible bug."""
    v = values[values.isfinite()]
    quotient = v / torch.full_like(v, divisor)
    return bool((quotient != v * torch.full_like(v, 1.0 / divisor)).any())


@pytest.mark.slow
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("codec", FUSED)
def test_encode_rows_equals_eager_bitwise(short_slices, codec, feedback):
    first = True
    for count, size in [(3, SIZE), (1, 7 * B), (2, 4 * B + 1)]:
        x = rows_with_specials(count, size, seed=count)
        residual = torch.randn(count, size, generator=torch.Generator().manual_seed(9))
        want = torch.empty(count, encoded_nbytes(size, codec), dtype=torch.uint8)
        want_residual = residual.clone()
        if feedback:  # as the eager exchange: the sum in place, then the rows less their codes
            torch.add(x, want_residual, out=want_residual)
            encode_rows(want_residual, codec, B, want, decoded=False, feedback=True)
        else:
            encode_rows(x.clone(), codec, B, want, decoded=False)
        # The packets' rows inside a larger buffer, at an offset no 4-byte view could take.
        buffer = torch.zeros(count, want.shape[1] + 3, dtype=torch.uint8)
        got = buffer[:, 1 : 1 + want.shape[1]]
        got_residual = residual.clone()
        x_before = x.clone()
        fused.encode_rows(x, codec, B, got, got_residual if feedback else None)
        if first:  # compiled now; the other sizes, counts and offsets must not compile again
            graphs, first = counters["stats"]["unique_graphs"], False
        assert torch.equal(got, want), f"{count}x{size}: packets differ"
        assert torch.equal(bits(x), bits(x_before)), "the input rows were written"
        assert torch.equal(buffer[:, 0], torch.zeros(count, dtype=torch.uint8))
        if feedback:
            assert torch.equal(bits(got_residual), bits(want_residual)), f"{count}x{size}: residual"
    assert counters["stats"]["unique_graphs"] == graphs, "a kernel compiled again"
    # A test of the test: a scale made by a product with 1/127 (1/448) would differ.
    blocks = rows_with_specials(3, SIZE, seed=3)[:, : 5 * B].reshape(-1, B)
    assert reciprocal_differs(blocks.abs().amax(dim=1), CODE_MAX[codec])


def received(codec: str, m: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` workers' packets of one chunk (a NaN block on one, an infinite block on another,
    in the same block), and their values."""
    chunks = torch.stack([rows_with_specials(1, SIZE, seed=10 + r)[0] for r in range(m)])
    chunks[1, 3 * B + 20] = float("nan")  # NaN on worker 1, inf on worker 0: the same block
    packets, _ = encode_rows(chunks, codec, B, decoded=False)
    return packets, chunks


@pytest.mark.slow
@pytest.mark.parametrize("codec", FUSED)
def test_reduce_equals_eager_bitwise(short_slices, codec):
    packets, _ = received(codec)
    want = reduce_packets(packets, SIZE, codec, B)
    got = fused.reduce(packets, SIZE, codec, B)
    assert torch.equal(got, want)
    # A test of the test: a product with 1/3 instead of the division would change the mean.
    values = decode_rows(packets, SIZE, codec, B)
    assert reciprocal_differs(values[0] + values[1] + values[2], 3.0)


@pytest.mark.slow
@pytest.mark.parametrize("codec", FUSED)
def test_decode_rows_equals_eager_bitwise(codec):
    packets, _ = received(codec)
    want = decode_rows(packets, SIZE, codec, B)
    assert want.isnan().any() and want.isinf().logical_not().all()  # NaN blocks decoded
    out = torch.full((3, SIZE + 2), 7.0)
    fused.decode_rows(packets, SIZE, codec, B, out[:, 1 : 1 + SIZE])
    assert torch.equal(bits(out[:, 1 : 1 + SIZE]), bits(want))
    assert (out[:, 0] == 7.0).all() and (out[:, -1] == 7.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("codec", FUSED)
def test_mean_of_three_workers_equals_eager_bitwise(short_slices, codec):
    m, n = 3, 2 * SIZE + 1  # chunks of two lengths: two runs of rows
    vectors = [rows_with_specials(1, n, seed=20 + r)[0] for r in range(m)]
    vectors[2][:B] = torch.randn(B) * 1e-3  # finite everywhere but on rank 0's blocks

    def mean(kernels):
        codec_object = DenseCodec(codec, kernels=kernels)

        def fn(comm):
            residual = 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
            out = mean_start(codec_object, comm, vectors[comm.rank].clone(), "t", residual)
            return out.wait(), residual

        return run_threads(m, fn)

    for rank, ((got, got_res), (want, want_res)) in enumerate(zip(mean("compiled"), mean("eager"))):
        assert torch.equal(bits(got), bits(want)), f"rank {rank}: mean"
        assert torch.equal(bits(got_res), bits(want_res)), f"rank {rank}: residual"


@pytest.mark.slow
def test_slowmo_with_compiled_int8_equals_eager_bitwise():
    kwargs = dict(tau=3, slow_lr=0.7, slow_momentum=0.6, error_feedback=True)
    compiled = DenseCodec("int8", kernels="compiled")
    got = run_slowmo(3, 7, PLAIN_SGD, codec=compiled, **kwargs)
    want = run_slowmo(3, 7, PLAIN_SGD, codec="int8", **kwargs)
    for (model, snaps, _), (want_model, want_snaps, _) in zip(got, want):
        assert_same_models(model, want_model)
        assert len(snaps) == len(want_snaps) == 2
        for a, b in zip(snaps, want_snaps):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_codec_cost_compiled_rows_run_tiny(capsys):
    """benchmarks/codec_cost.py's compiled rows, in-process at a tiny size (the kernels above:
    3 workers, no new compile): positive times, the compile's seconds."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import codec_cost

    result = codec_cost.main(
        ["--mb", "0.02", "--repeats", "1", "--workers", "3", "--device", "cpu"]
        + ["--kernels", "compiled"]
    )
    rows = {r["codec"]: r for r in result["rows"]}
    assert sorted(rows) == ["fp8 (compiled)", "int8 (compiled)"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["compile_s"] > 0 and r["mean_ms_per_mb"] > 0 and r["encode_ms_per_mb"] > 0
    assert "int8 (compiled) (compile " in capsys.readouterr().out


def test_bad_kernels_are_refused():
    # Not slow: nothing here compiles.
    choices = r"kernels must be one of \('eager', 'compiled'\), got 'fast'"
    with pytest.raises(ValueError, match=choices):
        DenseCodec("int8", kernels="fast")
    with pytest.raises(ValueError, match="kernels='compiled' is for the codecs .* codec 'bf16'"):
        DenseCodec("bf16", kernels="compiled")
    # Where a codec name goes, a DenseCodec goes: its settings are its name (the same bits).
    codec = DenseCodec("fp8", kernels="compiled")
    assert check_codec(codec) is codec
    config = SlowMoConfig(codec=codec, error_feedback=True)
    assert config.codec is codec and config.summary()["codec"] == "fp8"


def test_a_dense_codec_s_block_is_checked_and_kept_in_its_settings():
    # Another block is other bits: it is in the settings every rank compares and a checkpoint
    # keeps; the default block leaves the settings as a name (as states saved before).
    for bad in (0, -256, 2.5, True):
        with pytest.raises(ValueError, match="block must be a positive int"):
            DenseCodec("int8", block=bad)
    assert DenseCodec("int8", block=128).summary() == {"name": "int8", "block": 128}
    assert SlowMoConfig(codec=DenseCodec("int8", block=128)).summary()["codec"] != "int8"
    assert DenseCodec("int8", kernels="compiled").summary() == "int8"


@pytest.mark.slow
def test_warm_up_compiles_what_a_mean_then_runs():
    # A 2-worker mean (its reduce is compiled per worker count: new in this file): warm_up
    # compiles, and the mean after it, on other sizes, compiles nothing.
    before = counters["stats"]["unique_graphs"]
    fused.warm_up("int8", workers=2)
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > before, "warm_up compiled nothing"
    rows = torch.randn(2, 3 * B + 11)
    packets = torch.empty(2, encoded_nbytes(3 * B + 11, "int8"), dtype=torch.uint8)
    fused.encode_rows(rows, "int8", B, packets, torch.zeros_like(rows))
    reduced = fused.reduce(packets, 3 * B + 11, "int8", B)
    assert torch.equal(reduced, reduce_packets(packets, 3 * B + 11, "int8", B))
    fused.decode_rows(packets, 3 * B + 11, "int8", B, torch.empty_like(rows))
    assert counters["stats"]["unique_graphs"] == warmed, "the mean compiled after warm_up"


def test_a_compiler_that_fails_leaves_the_eager_kernels_with_a_warning(monkeypatch):
    # Not slow: nothing compiles. Where torch cannot compile the kernels (seen: torch 2.14 under
    # ATEN_CPU_CAPABILITY=default), the mean runs the eager path, the same bits, and says so.
    def broken(*args, **kwargs):
        raise RuntimeError("C++ compile error: 'at::vec' has not been declared")

    monkeypatch.setattr(fused, "_READY", {})
    monkeypatch.setattr(fused, "warm_up", broken)
    n = 3 * B + 7
    vectors = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(3)]

    def mean(kernels):
        codec = DenseCodec("int8", kernels=kernels)
        return run_threads(3, lambda comm: mean_start(codec, comm, vectors[comm.rank], "t").wait())

    with pytest.warns(RuntimeWarning, match="torch.compile failed here.*eager kernels instead"):
        got = mean("compiled")
    assert all(torch.equal(g, w) for g, w in zip(got, mean("eager")))
    assert list(fused._READY.values()) == [False]  # tried once, not at every mean

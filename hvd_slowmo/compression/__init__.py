"""Compressed exact averages: codecs (:mod:`.codecs`, pure; every codec speaks
:class:`~.codecs.Codec`) and the reduction built from all-to-all and all-gather
(:mod:`.exchange`), with optional error feedback; the sparse codec (:mod:`.sparse`, pure) and
its all-gather average (:mod:`.sparse_exchange`); exact inside a node and compressed across
(:mod:`.hierarchical`)."""

from .codecs import (
    BLOCK_SIZE,
    CODECS,
    Codec,
    DenseCodec,
    Encoded,
    as_codec,
    check_codec,
    decode,
    encode,
    encoded_nbytes,
)
from .exchange import PendingMean, compressed_mean
from .hierarchical import hierarchical_mean
from .sparse import SparseCodec, packet_nbytes, sparse_decode, sparse_decode_dense, sparse_encode
from .sparse_exchange import PendingSparseMean, sparse_mean

__all__ = [
    "BLOCK_SIZE",
    "CODECS",
    "Codec",
    "DenseCodec",
    "Encoded",
    "PendingMean",
    "PendingSparseMean",
    "SparseCodec",
    "as_codec",
    "check_codec",
    "compressed_mean",
    "decode",
    "encode",
    "encoded_nbytes",
    "hierarchical_mean",
    "packet_nbytes",
    "sparse_decode",
    "sparse_decode_dense",
    "sparse_encode",
    "sparse_mean",
]

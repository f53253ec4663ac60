"""Compressed exact averages: codecs (:mod:`.codecs`, pure) and the reduction built from
all-to-all and all-gather (:mod:`.exchange`), with optional error feedback; the sparse codec
(:mod:`.sparse`, pure) and its all-gather average (:mod:`.sparse_exchange`)."""

from .codecs import BLOCK_SIZE, CODECS, Encoded, check_codec, decode, encode, encoded_nbytes
from .exchange import PendingMean, compressed_mean
from .sparse import SparseCodec, packet_nbytes, sparse_decode, sparse_decode_dense, sparse_encode
from .sparse_exchange import PendingSparseMean, sparse_mean

__all__ = [
    "BLOCK_SIZE",
    "CODECS",
    "Encoded",
    "PendingMean",
    "PendingSparseMean",
    "SparseCodec",
    "check_codec",
    "compressed_mean",
    "decode",
    "encode",
    "encoded_nbytes",
    "packet_nbytes",
    "sparse_decode",
    "sparse_decode_dense",
    "sparse_encode",
    "sparse_mean",
]

"""Compressed exact averages: codecs (:mod:`.codecs`, pure) and the reduction built from
all-to-all and all-gather (:mod:`.exchange`), with optional error feedback."""

from .codecs import BLOCK_SIZE, CODECS, Encoded, check_codec, decode, encode, encoded_nbytes
from .exchange import PendingMean, compressed_mean

__all__ = [
    "BLOCK_SIZE",
    "CODECS",
    "Encoded",
    "PendingMean",
    "check_codec",
    "compressed_mean",
    "decode",
    "encode",
    "encoded_nbytes",
]

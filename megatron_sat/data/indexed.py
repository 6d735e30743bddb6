"""Writer of Megatron indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``), one sequence per document.

    w = IndexWriter(prefix + ".bin", numpy.uint16)
    w.add(ids, lengths)          # documents back to back: ids [sum(lengths)], lengths [n_docs]
    w.finalize(prefix + ".idx")  # (w.abort() on failure)

The bytes equal megatron-core's ``IndexedDatasetBuilder`` (megatron/core/datasets/indexed_dataset.py) given
``add_document(doc, [len(doc)])`` per document, which tests/test_data.py checks byte for byte. Written here
rather than imported because importing megatron-core (and torch) costs seconds of start-up per preprocessing run,
and this is the whole of the format:

    .bin  the token ids of every document back to back, in the dataset dtype
    .idx  b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code,
          u64 sequence count n, u64 document count n + 1,
          i32 sequence lengths [n], i64 byte offsets of the sequences in .bin [n],
          i64 document indices [n + 1] (0, 1, ..., n: one sequence per document)
"""

from __future__ import annotations

import struct
from typing import List

import numpy

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron-core's DType codes
DTYPE_CODES = {numpy.dtype(numpy.uint8): 1, numpy.dtype(numpy.int8): 2, numpy.dtype(numpy.int16): 3,
               numpy.dtype(numpy.int32): 4, numpy.dtype(numpy.int64): 5, numpy.dtype(numpy.float64): 6,
               numpy.dtype(numpy.float32): 7, numpy.dtype(numpy.uint16): 8}


def optimal_dtype(vocab_size: int) -> numpy.dtype:
    """The token dtype megatron-core picks for a vocabulary (DType.optimal_dtype): uint16 below 65,500 ids."""
    return numpy.dtype(numpy.uint16 if vocab_size < 65500 else numpy.int32)


class IndexWriter:
    def __init__(self, bin_path: str, dtype) -> None:
        self.dtype = numpy.dtype(dtype)
        self.code = DTYPE_CODES[self.dtype]
        self.bin_path = bin_path
        self.data_file = open(bin_path, "wb")
        self.lengths: List[numpy.ndarray] = []

    def add(self, ids: numpy.ndarray, lengths: numpy.ndarray) -> None:
        """Append documents: ids of all of them back to back (cast to the dtype), and each one's length."""
        ids = numpy.asarray(ids)
        if ids.dtype != self.dtype:
            ids = ids.astype(self.dtype)
        self.data_file.write(memoryview(numpy.ascontiguousarray(ids)).cast("B"))
        self.lengths.append(numpy.asarray(lengths, dtype=numpy.int64))

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        lengths = numpy.concatenate(self.lengths) if self.lengths else numpy.zeros(0, numpy.int64)
        n = len(lengths)
        pointers = numpy.zeros(n, numpy.int64)
        numpy.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", self.code))
            f.write(struct.pack("<Q", n))
            f.write(struct.pack("<Q", n + 1))
            f.write(lengths.astype(numpy.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(numpy.arange(n + 1, dtype=numpy.int64).tobytes(order="C"))

    def abort(self) -> None:
        try:
            self.data_file.close()
        except OSError:
            pass

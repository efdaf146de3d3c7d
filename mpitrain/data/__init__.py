"""Training data: the HDF5 shard format, the per-rank reader, and batch preparation.

No MPI here: the reader takes ``rank`` and ``size`` as integers, and the trainer
gathers its I/O statistics through :mod:`mpitrain.comm`.
"""

from mpitrain.data.reader import Batch, IOStats, ShardReader
from mpitrain.data.shards import DataError, Dataset, open_dataset
from mpitrain.data.writer import DatasetWriter

__all__ = ["Batch", "DataError", "Dataset", "DatasetWriter", "IOStats", "ShardReader", "open_dataset"]

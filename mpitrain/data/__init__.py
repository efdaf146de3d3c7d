"""Training data: sources read into memory and seeded batch iterators (no MPI here)."""

from mpitrain.data.loader import ImageBatches, TextBatches
from mpitrain.data.sources import DataError, ImageData, TextData, mnist5k, shakespeare, text_file

__all__ = ["DataError", "ImageBatches", "ImageData", "TextBatches", "TextData", "mnist5k",
           "shakespeare", "text_file"]

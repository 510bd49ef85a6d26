"""minfer.gguf: reading GGUF files (lazy, mmap'd) and turning metadata into hyper-parameters."""

from minfer.gguf.parse import StringArray
from minfer.gguf.reader import GGUFFile, TensorInfo

__all__ = ["GGUFFile", "StringArray", "TensorInfo"]

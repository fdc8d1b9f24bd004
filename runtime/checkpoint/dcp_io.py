"""torch.distributed.checkpoint, adapted: many boxes of one tensor per rank, and a reader that unpickles safely.

DCP writes `.metadata` and `__{rank}_*.distcp` files. A rank's pieces of a parameter are boxes of the *full*
tensor (runtime.checkpoint.layout), handed to DCP through the protocol its planners use for DTensor shards
(`Boxes`), so what plan A wrote is read by plan B box by box. DCP's `.metadata` is a pickle: `SafeReader`
unpickles it with an allow-list that admits only DCP's metadata classes, torch.Size and dtypes, never
arbitrary objects; tensors are read as raw bytes.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from runtime.checkpoint.layout import Box
from runtime.checkpoint.manifest import CheckpointError

__all__ = ["Boxes", "LoadPlanner", "SafeReader", "SavePlanner", "quiet", "read_full"]


class Boxes:
    """A rank's boxes of one full tensor, in the protocol DCP's planners use for DTensor shards."""

    def __init__(self, size: Sequence[int], dtype: torch.dtype, boxes: list[tuple[Box, torch.Tensor]]):
        self._size, self.dtype, self.boxes = torch.Size(size), dtype, boxes
        self._by_offset = {torch.Size(b.offsets): t for b, t in boxes}
        if len(self._by_offset) != len(boxes):
            raise CheckpointError("internal: two boxes of one tensor start at the same offset")

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                              properties=TensorProperties(dtype=t.dtype), size=self._size))
                for b, t in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b, _ in self.boxes]

    def shard(self, offset: torch.Size) -> torch.Tensor:
        return self._by_offset[torch.Size(offset)]


class SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.shard(index.offset) if isinstance(obj, Boxes) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner first maps the state dict through _init_state_dict, which drops objects
        # that are not tensors (our Boxes) to None; nothing here lives on the meta device.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.shard(index.offset) if isinstance(obj, Boxes) else super().lookup_tensor(index)


# What DCP's `.metadata` pickle is made of; nothing else may be unpickled from a checkpoint.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64",
              "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "strided", "contiguous_format",
              "channels_last", "preserve_format", "dtype", "layout", "memory_format"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class _SafeUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; admit only the classes it is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _SafeUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: not a valid DCP metadata file ({e}); the checkpoint is corrupted or was "
                                  "not written by this project") from None
        md.storage_meta = getattr(md, "storage_meta", None)
        return md


def quiet(fn, *args: Any, **kwargs: Any) -> Any:
    """DCP warns that it assumes one process whenever no_dist=True: here that is the intent (each rank reads alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def read_full(d: Path, prefixes: Iterable[str]) -> dict[str, torch.Tensor]:
    md = SafeReader(str(d)).read_metadata()
    sd: dict[str, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if any(fqn.startswith(p) for p in prefixes) and hasattr(meta, "size"):
            sd[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        quiet(dcp.load, sd, storage_reader=SafeReader(str(d)), planner=LoadPlanner(), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{d}: reading the checkpoint failed: {type(e).__name__}: {str(e)[:400]}") from e
    return sd

"""Read PyTorch `.bin` state dicts without torch and without running pickled code.

`torch.save` (torch >= 1.6) writes a zip archive with one top folder:

    <name>/data.pkl      protocol-2 pickle of the object (an OrderedDict of tensors)
    <name>/data/<key>    raw bytes of each storage (uncompressed)
    <name>/byteorder     "little" or "big" (absent in older files: little)
    <name>/version       format version

Inside the pickle a tensor is the call
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])`
whose `storage` is the persistent id `("storage", torch.<Type>Storage, key, location, numel)`.

`load_torch_bin` unpickles with a `find_class` that resolves only those few
names, each to a function of ours, plus `collections.OrderedDict`. Any other
global (`os.system`, `builtins.eval`, a model class...) raises
`UnsafeCheckpointError` before it can be called. Storages are read with numpy;
views (offset, strides) are rebuilt with bounds checks, so a crafted file
cannot make us read outside a storage.

Non-goals: the legacy pre-1.6 (non-zip) format, TorchScript archives,
sparse/quantized torch tensors, tensor subclasses. float64 is read as float32.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np

# torch.<name>Storage -> numpy dtype of its elements (bfloat16 travels as uint16 bits)
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": np.uint16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class TorchBinError(pickle.UnpicklingError, ValueError):
    """A file that is not a readable torch state dict; the message says why."""


class UnsafeCheckpointError(TorchBinError):
    """The pickle asks for something a plain tensor state dict never contains."""


class _StorageType:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Storage:
    __slots__ = ("data", "bf16")

    def __init__(self, data: np.ndarray, bf16: bool):
        self.data, self.bf16 = data, bf16  # data: 1-D, exactly numel elements


class _Tensor:
    __slots__ = ("array", "bf16")

    def __init__(self, array: np.ndarray, bf16: bool):
        self.array, self.bf16 = array, bf16


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise TorchBinError(f"tensor {what} must be a tuple of non-negative ints, got {value!r}")
    return value


def _rebuild_tensor(storage, offset, size, stride, *_ignored) -> _Tensor:
    """Our `_rebuild_tensor_v2`: the view `storage[offset + sum(i * stride)]` of shape `size`."""
    if not isinstance(storage, _Storage):
        raise TorchBinError("a tensor's storage is not a storage record of this archive")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if not isinstance(offset, int) or offset < 0 or len(size) != len(stride):
        raise TorchBinError(f"bad tensor layout: offset {offset!r}, size {size}, stride {stride}")
    data = storage.data
    if 0 in size:
        return _Tensor(np.zeros(size, data.dtype), storage.bf16)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= data.size:
        raise TorchBinError(
            f"tensor of size {size}, stride {stride}, offset {offset} reaches element {last} "
            f"of a storage of {data.size}: the file is corrupt"
        )
    view = np.lib.stride_tricks.as_strided(
        data[offset:], shape=size, strides=[s * data.itemsize for s in stride], writeable=False
    )
    return _Tensor(np.array(view), storage.bf16)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *_state) -> _Tensor:
    return data  # an nn.Parameter is its tensor, for reading


# (module, name) -> what the restricted unpickler returns for it
_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, byteorder: str, where: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.byteorder, self.where = archive, prefix, byteorder, where
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.where}: the pickle asks for {module}.{name}, which a tensor state dict "
                "never needs; refusing to load it (unpickling it could run code). Use a "
                "safetensors copy of the checkpoint, or re-save it as a plain state dict."
            )
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[4], int) and pid[4] >= 0):
            raise UnsafeCheckpointError(f"{self.where}: unexpected persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        if key not in self.storages:
            self.storages[key] = self._read_storage(kind.name, key, numel)
        return self.storages[key]

    def _read_storage(self, kind: str, key: str, numel: int) -> _Storage:
        dtype = np.dtype(STORAGE_DTYPES[kind])
        name = f"{self.prefix}data/{key}"
        try:
            raw = self.archive.read(name)
        except KeyError:
            raise TorchBinError(f"{self.where}: storage {name} is missing from the archive") from None
        if len(raw) < numel * dtype.itemsize:
            raise TorchBinError(
                f"{self.where}: storage {name} has {len(raw)} bytes, {numel} x {kind} needs "
                f"{numel * dtype.itemsize}"
            )
        order = "<" if self.byteorder == "little" else ">"
        data = np.frombuffer(raw, dtype=dtype.newbyteorder(order), count=numel)
        return _Storage(data.astype(dtype, copy=False), kind == "BFloat16Storage")


def _to_mx(t: _Tensor):
    import mlx.core as mx

    a = t.array
    if t.bf16:
        return mx.array(a).view(mx.bfloat16)
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    return mx.array(a)


def load_torch_bin(path: str | Path) -> dict:
    """The tensors of a torch.save'd state dict, as {name: mx.array}; never runs pickled code."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise TorchBinError(
            f"{path} is not a torch zip archive (a legacy pre-1.6 torch file or not a "
            "checkpoint); re-save it with torch >= 1.6 or use a safetensors copy"
        )
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pkls = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkls) != 1:
            raise TorchBinError(
                f"{path}: expected one data.pkl in the archive, found {len(pkls)} "
                "(a TorchScript archive or another zip?)"
            )
        prefix = pkls[0][: -len("data.pkl")]
        byteorder = "little"
        if f"{prefix}byteorder" in names:
            byteorder = archive.read(f"{prefix}byteorder").decode().strip()
            if byteorder not in ("little", "big"):
                raise TorchBinError(f"{path}: unknown byteorder {byteorder!r}")
        unpickler = _Unpickler(archive.read(pkls[0]), archive, prefix, byteorder, str(path))
        try:
            obj = unpickler.load()
        except TorchBinError:
            raise
        except Exception as e:  # truncated or malformed pickle
            raise TorchBinError(f"{path}: not a readable torch state dict ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise TorchBinError(f"{path} holds a {type(obj).__name__}, not a state dict")
    bad = [k for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, _Tensor))]
    if bad:
        raise TorchBinError(f"{path}: entries that are not named tensors: {bad[:5]}")
    return {k: _to_mx(v) for k, v in obj.items()}

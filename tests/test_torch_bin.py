"""converters.torch_bin: torch.save archives read with numpy, and pickles that try to run code refused."""

from __future__ import annotations

import struct
import zipfile

import mlx.core as mx
import numpy as np
import pytest

from converters.common import ConversionError, read_tensors
from converters.torch_bin import TorchBinError, UnsafeCheckpointError, load_torch_bin
from eagle_fixtures import BF16, PickleWriter, write_torch_bin


def test_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.normal(size=(3, 5)).astype(np.float32)
    tensors = {
        "a.weight": f32,
        "b.half": rng.normal(size=(4,)).astype(np.float16),
        "c.bf16": BF16(f32),
        "d2t": np.array([5, -2, 0, 2**40], np.int64),
        "t2d": np.array([True, False, True]),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    write_torch_bin(tmp_path / "pytorch_model.bin", tensors)
    got = load_torch_bin(tmp_path / "pytorch_model.bin")
    assert set(got) == set(tensors)
    np.testing.assert_array_equal(np.array(got["a.weight"]), f32)
    assert got["b.half"].dtype == mx.float16
    np.testing.assert_array_equal(np.array(got["b.half"]), tensors["b.half"])
    assert got["c.bf16"].dtype == mx.bfloat16 and got["c.bf16"].shape == (3, 5)
    # bfloat16 keeps the top 16 bits of the float32
    truncated = (f32.view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(np.array(got["c.bf16"].astype(mx.float32)), truncated)
    assert got["d2t"].dtype == mx.int64 and np.array(got["d2t"]).tolist() == [5, -2, 0, 2**40]
    assert got["t2d"].dtype == mx.bool_ and np.array(got["t2d"]).tolist() == [True, False, True]
    assert got["scalar"].shape == () and got["scalar"].item() == 3.5
    assert got["empty"].shape == (0, 4)


def test_views_with_offsets_and_strides(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    views = {
        "transposed": ("base", 0, (6, 4), (1, 6)),  # base.T, as torch saves a non-contiguous view
        "row2": ("base", 12, (6,), (1,)),  # a slice sharing the storage at an offset
        "every_other": ("base", 1, (4, 3), (6, 2)),
    }
    write_torch_bin(tmp_path / "x.bin", {"base": base}, views=views)
    got = load_torch_bin(tmp_path / "x.bin")
    np.testing.assert_array_equal(np.array(got["transposed"]), base.T)
    np.testing.assert_array_equal(np.array(got["row2"]), base[2])
    np.testing.assert_array_equal(np.array(got["every_other"]), base[:, 1::2])


def test_big_endian_archive(tmp_path):
    x = np.linspace(-1, 1, 7).astype(np.float32)
    write_torch_bin(tmp_path / "be.bin", {"x": x, "h": BF16(x)}, byteorder="big")
    got = load_torch_bin(tmp_path / "be.bin")
    np.testing.assert_array_equal(np.array(got["x"]), x)
    np.testing.assert_allclose(np.array(got["h"].astype(mx.float32)), x, atol=1e-2)


def _archive(path, pickle_bytes, storages=None):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/byteorder", "little")
        for key, raw in (storages or {}).items():
            z.writestr(f"archive/data/{key}", raw)


def _system_call(command: str) -> bytes:
    w = PickleWriter()
    w.glob("os", "system")
    w.op(b"(")
    w.text(command)
    w.op(b"tR.")
    return bytes(w.out)


def test_code_in_the_pickle_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    _archive(tmp_path / "evil.bin", _system_call(f"touch {marker}"))
    with pytest.raises(UnsafeCheckpointError, match="os.system"):
        load_torch_bin(tmp_path / "evil.bin")
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [("builtins", "eval"), ("torch", "load"), ("__main__", "Net"),
                                         ("torch._utils", "_rebuild_qtensor"), ("subprocess", "Popen")])
def test_any_other_global_is_refused(tmp_path, module, name):
    w = PickleWriter()
    w.glob(module, name)
    w.op(b".")
    _archive(tmp_path / "x.bin", bytes(w.out))
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}"):
        load_torch_bin(tmp_path / "x.bin")


def test_code_hidden_inside_a_state_dict_entry_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    w = PickleWriter()
    w.glob("collections", "OrderedDict")
    w.op(b")R(")
    w.text("fc.weight")
    w.out += _system_call(f"touch {marker}")[2:-1]  # the call, without PROTO and STOP
    w.op(b"u.")
    _archive(tmp_path / "x.bin", bytes(w.out))
    with pytest.raises(UnsafeCheckpointError):
        load_torch_bin(tmp_path / "x.bin")
    assert not marker.exists()


def test_a_view_reaching_outside_its_storage_is_refused(tmp_path):
    w = PickleWriter()
    w.glob("collections", "OrderedDict")
    w.op(b")R(")
    w.text("x")
    w.tensor("FloatStorage", "0", 4, 2, (3,), (1,))  # elements 2..4 of a 4-element storage
    w.op(b"u.")
    _archive(tmp_path / "x.bin", bytes(w.out), {"0": struct.pack("<4f", 1, 2, 3, 4)})
    with pytest.raises(TorchBinError, match="reaches element 4 of a storage of 4"):
        load_torch_bin(tmp_path / "x.bin")


def test_not_a_zip_or_a_truncated_pickle_gives_clear_errors(tmp_path):
    (tmp_path / "old.bin").write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.")  # legacy magic
    with pytest.raises(TorchBinError, match="not a torch zip archive"):
        load_torch_bin(tmp_path / "old.bin")
    _archive(tmp_path / "cut.bin", b"\x80\x02ccollections\nOrderedDict\n)R(")
    with pytest.raises(TorchBinError, match="not a readable torch state dict"):
        load_torch_bin(tmp_path / "cut.bin")
    _archive(tmp_path / "missing.bin", PickleWriter().out + b"}.")  # fine pickle: an empty dict
    assert load_torch_bin(tmp_path / "missing.bin") == {}


def test_read_tensors_reads_bins_and_the_errors_are_conversion_errors(tmp_path):
    write_torch_bin(tmp_path / "pytorch_model.bin", {"fc.weight": np.ones((2, 2), np.float32)})
    assert np.array(read_tensors(tmp_path)["fc.weight"]).sum() == 4
    _archive(tmp_path / "pytorch_model.bin", _system_call("true"))
    with pytest.raises(ValueError):  # head.run reports ValueErrors as "error: ..." with exit 2
        read_tensors(tmp_path)
    assert issubclass(UnsafeCheckpointError, ValueError) and not issubclass(ConversionError, TorchBinError)

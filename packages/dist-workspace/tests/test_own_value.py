"""The receiver's own value (and a one-rank call's): a CPU copy shaped like a peer's, in
fresh memory. Every copy here is a one-rank call's, made as a receiver makes its own."""

from __future__ import annotations

import gc
import mmap
from typing import Any

import pytest
import torch

from dist_workspace import get_configs_parallel, get_tensors_parallel
from dist_workspace.exchange import host_buffer

MIB = 1024 * 1024


def own_tensor(tensor: torch.Tensor) -> torch.Tensor:
    with get_tensors_parallel(tensor, [0]) as [copy]:
        return copy


def own_config(config: Any) -> Any:
    with get_configs_parallel(config, [0], None) as [copy]:
        return copy


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.contiguous().reshape(-1).view(torch.uint8).tolist()


def test_copies_are_equal_contiguous_and_alias_nothing() -> None:
    whole = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    for given in (whole, whole[1:, ::2], whole.t(), torch.tensor(float("nan")), whole[:0]):
        copy = own_tensor(given)
        assert copy.shape == given.shape and copy.dtype == given.dtype
        assert copy.is_contiguous() and _bits(copy) == _bits(given)
        if given.numel():
            assert copy.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
            copy.reshape(-1)[0] = -1.0
            assert given.reshape(-1)[0] != -1.0


def test_large_values_are_copied_whole() -> None:
    big = torch.randn(3 * 1024 * 1024 // 4)
    copy = own_tensor(big)
    assert torch.equal(copy, big)
    copy.zero_()
    assert big.abs().sum() > 0


def _mapping_at(address: int) -> tuple[int, int, int] | None:
    """(start, end, resident bytes) of this process's mapping holding ``address``, or None.

    Read from /proc/self/smaps: the mapping's own pages, whatever the rest of the
    process allocates or frees meanwhile (a whole-process RSS moved by 33 MiB between two
    reads once, when gc.collect() freed an earlier test's garbage).
    """
    found: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # "start-end perms offset ..."
                start, end = (int(part, 16) for part in head.split("-"))
                found = (start, end) if start <= address < end else None
            elif found is not None and line.startswith("Rss:"):
                return found[0], found[1], int(line.split()[1]) * 1024
    return None


@pytest.mark.skipif(
    not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux's (Python 3.10+)"
)
def test_large_buffers_have_their_pages_before_the_copy_and_free_them_with_the_tensor() -> None:
    buffer = host_buffer(64 * MIB)
    mapping = _mapping_at(buffer.data_ptr())
    assert mapping is not None
    start, end, resident = mapping
    assert end - start >= 64 * MIB
    assert resident >= 64 * MIB  # allocated by mmap, before anything is written
    view = buffer[MIB : 2 * MIB]
    del buffer
    gc.collect()
    assert _mapping_at(start) == mapping  # a view keeps the mapping, every page of it
    view.fill_(7)
    del view
    gc.collect()
    after = _mapping_at(start)
    assert after is None or after[:2] != (start, end), "unmapped with the last view"


@pytest.mark.skipif(
    not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux's (Python 3.10+)"
)
def test_a_buffer_the_system_cannot_map_is_a_memory_error_naming_its_size() -> None:
    with pytest.raises(MemoryError, match=rf"cannot map {1 << 62} bytes for a CPU copy"):
        host_buffer(1 << 62)


def test_shared_storage_stays_shared_and_spans_are_copied_once() -> None:
    base = torch.arange(64, dtype=torch.float32)
    matrix = base[8:].view(7, 8)
    tensors = {
        "matrix": matrix,
        "transposed": matrix.t(),
        "row": matrix[3],
        "alone": torch.ones(5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
    }
    copies = own_config(tensors)
    assert list(copies) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(copies[name], tensor), name
        assert copies[name].stride() == tensor.stride() or name in ("alone", "empty")
    storage = copies["matrix"].untyped_storage().data_ptr()
    assert copies["transposed"].untyped_storage().data_ptr() == storage
    assert copies["row"].untyped_storage().data_ptr() == storage
    copies["matrix"][3, 0] = 1000.0
    assert copies["row"][0] == 1000.0 and copies["transposed"][0, 3] == 1000.0
    assert base[8 + 24] == 24.0 + 8  # the caller's tensors are untouched


def test_conjugate_and_negative_views_keep_the_values_they_show() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    copies = own_config({"z": z, "conj": z.conj(), "neg": z.conj().imag})
    assert copies["conj"].tolist() == [1 - 2j, 3 + 4j]
    assert copies["z"].tolist() == z.tolist()
    assert copies["neg"].tolist() == [-2.0, 4.0]


def test_config_comes_back_as_json_would_give_it() -> None:
    scale = torch.full((3,), 2.0)
    config = {"pair": (1, "x"), "scale": scale, "tied": scale, "nested": [{"t": scale[1:]}]}
    copy = own_config(config)
    assert copy["pair"] == [1, "x"]
    assert torch.equal(copy["scale"], scale) and copy["scale"] is not scale
    copy["scale"].add_(1.0)
    assert copy["tied"].tolist() == [3.0] * 3 and copy["nested"][0]["t"].tolist() == [3.0] * 2
    assert scale.tolist() == [2.0] * 3


def test_bad_values_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match=r"config\['s'\] is a builtins.set"):
        own_config({"s": {1}})
    with pytest.raises(TypeError, match=r"weights\['tensor'\] has layout torch\.sparse_coo"):
        own_tensor(torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match=r"weights\['tensor'\] is on the meta device"):
        own_tensor(torch.empty(2, device="meta"))
    with pytest.raises(TypeError, match=r"dist_workspace\.config\.0 has dtype torch\.complex128"):
        own_config({"c": torch.zeros(2, dtype=torch.complex128)})

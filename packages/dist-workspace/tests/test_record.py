"""Storage correctness: dtypes, views, shared storage, integrity, foreign files."""

from __future__ import annotations

import json
import os
import pickle
import posix
import struct
import sys
from pathlib import Path

import pytest
import torch

from dist_workspace import NFSWorkspace, WorkspaceError, writer
from dist_workspace.format import DIGEST_BYTES, header_digest, supported_dtypes


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparison of any dtype (NaNs included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    raw = torch.randint(
        0,
        256,
        (int(torch.tensor(shape).prod()) * dtype.itemsize,),
        dtype=torch.uint8,
        generator=generator,
    )
    if dtype == torch.bool:
        return (raw[: raw.numel()] % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _roundtrip(
    directory: Path, weights: dict[str, torch.Tensor], config: object = None
) -> tuple[object, dict[str, torch.Tensor]]:
    workspace = NFSWorkspace(directory / "ws")
    workspace.write_configs_and_weights(config, weights, rank=0)
    result_config, result = workspace.read_configs_and_weights_from_rank(0)
    assert result is not None
    return result_config, result


def test_every_dtype_round_trips_bit_exact(any_dir: Path) -> None:
    weights = {str(dtype): _random(dtype, (3, 5)) for dtype in supported_dtypes()}
    for name in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            assert str(getattr(torch, name)) in weights
    # NaN payloads and negative zero must survive: compare bits, not values.
    weights["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
    _, result = _roundtrip(any_dir, weights)
    assert list(result) == list(weights)
    for name, tensor in weights.items():
        assert result[name].dtype == tensor.dtype and result[name].shape == tensor.shape, name
        assert torch.equal(_bits(result[name]), _bits(tensor)), name


def test_noncontiguous_zero_d_and_empty(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    weights = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 7, dtype=torch.bfloat16),
        "empty_view": base[:, 6:],
    }
    _, result = _roundtrip(tmp_path, weights)
    for name, tensor in weights.items():
        assert result[name].shape == tensor.shape and result[name].dtype == tensor.dtype
        assert torch.equal(result[name], tensor), name


def test_view_of_large_buffer_writes_own_elements_only(tmp_path: Path) -> None:
    big = torch.zeros(4 * 1024 * 1024, dtype=torch.float32)  # 16 MiB
    pieces = {"narrow": big.narrow(0, 10, 100), "chunk": torch.ones(1000, 1000).chunk(10)[3]}
    workspace = NFSWorkspace(tmp_path)
    path = workspace.write_configs_and_weights(None, pieces, rank=0)
    assert path.stat().st_size < 500_000
    _, result = workspace.read_configs_and_weights_from_rank(0)
    assert result is not None
    assert torch.equal(result["narrow"], pieces["narrow"]) and torch.equal(
        result["chunk"], pieces["chunk"]
    )


def test_shared_storage_is_stored_once_and_sharing_restored(tmp_path: Path) -> None:
    embedding = torch.randn(50, 8)
    weights = {
        "embed.weight": embedding,
        "lm_head.weight": embedding,  # tied
        "embed.T": embedding.t(),
        "row": embedding[3],
        "other": torch.randn(4),
    }
    workspace = NFSWorkspace(tmp_path)
    path = workspace.write_configs_and_weights({}, weights, rank=0)
    assert path.stat().st_size < 2 * embedding.nbytes
    _, result = workspace.read_configs_and_weights_from_rank(0)
    assert result is not None and list(result) == list(weights)
    for name, tensor in weights.items():
        assert torch.equal(result[name], tensor), name
        assert result[name].stride() == tensor.stride(), name
    pointer = result["embed.weight"].untyped_storage().data_ptr()
    for name in ("lm_head.weight", "embed.T", "row"):
        assert result[name].untyped_storage().data_ptr() == pointer, name
    result["embed.weight"][3, 0] = 123.0
    assert result["lm_head.weight"][3, 0] == 123.0 and result["row"][0] == 123.0
    assert result["other"].untyped_storage().data_ptr() != pointer


def test_conjugate_and_negative_views_keep_their_values(tmp_path: Path) -> None:
    # A conj view shares its storage with its source: written as a view of that
    # storage it came back as the source's values, silently.
    complex_values = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], dtype=torch.complex64)
    real_values = torch.tensor([1.5, -2.0, 0.25])
    weights = {
        "z": complex_values,
        "z_conj": complex_values.conj(),
        "x": real_values,
        "x_neg": real_values._neg_view(),
        "conj_alone": torch.tensor([5 - 5j], dtype=torch.complex64).conj(),
    }
    workspace = NFSWorkspace(tmp_path)
    workspace.write_configs_and_weights({}, weights, rank=0)
    _, result = workspace.read_configs_and_weights_from_rank(0)
    assert result is not None
    for name, tensor in weights.items():
        assert torch.equal(result[name], tensor.resolve_conj().resolve_neg()), name
        assert not result[name].is_conj() and not result[name].is_neg(), name


def test_ties_are_found_before_the_copy_off_the_device(
    any_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Off a GPU every copy to CPU has a storage of its own; on CPU ``.cpu()`` is the
    # tensor itself. Make every copy to CPU a fresh storage, as from a GPU, so that
    # ties survive only if they are found on the tensors as given.
    copies: list[int] = []

    def fresh_copy(tensor: torch.Tensor) -> torch.Tensor:
        copies.append(tensor.numel())
        return tensor.clone()

    monkeypatch.setattr(writer, "to_host", fresh_copy)
    embedding = torch.randn(200, 8)  # large enough for the header not to matter
    scale = torch.ones(3)
    weights = {
        "emb.weight": embedding,
        "head.weight": embedding,
        "emb.T": embedding.t(),
        "other": torch.randn(4),
    }
    workspace = NFSWorkspace(any_dir / "ws")
    path = workspace.write_configs_and_weights({"a": scale, "b": scale[1:]}, weights, rank=0)
    assert path.stat().st_size < 2 * embedding.nbytes  # the tied block is stored once
    assert sorted(copies) == sorted([scale.nbytes, embedding.nbytes, 4])  # one copy per block
    config, result = workspace.read_configs_and_weights_from_rank(0)
    assert result is not None and isinstance(config, dict)
    for name, tensor in weights.items():
        assert torch.equal(result[name], tensor) and result[name].stride() == tensor.stride()
    pointer = result["emb.weight"].untyped_storage().data_ptr()
    assert result["head.weight"].untyped_storage().data_ptr() == pointer
    assert result["emb.T"].untyped_storage().data_ptr() == pointer
    result["emb.weight"][0, 0] = 123.0
    assert result["head.weight"][0, 0] == 123.0 and result["emb.T"][0, 0] == 123.0
    config["a"][1] = 5.0  # tensors in the config keep their ties too
    assert config["b"].tolist() == [5.0, 1.0]


def test_tensors_over_one_buffer_of_different_lengths_are_stored_once(tmp_path: Path) -> None:
    buffer = bytearray(torch.arange(16, dtype=torch.float32).numpy().tobytes())
    short = torch.frombuffer(buffer, dtype=torch.float32, count=4)
    whole = torch.frombuffer(buffer, dtype=torch.float32)
    _, result = _roundtrip(tmp_path, {"short": short, "whole": whole})
    assert torch.equal(result["short"], short) and torch.equal(result["whole"], whole)
    result["whole"][0] = -1.0
    assert result["short"][0] == -1.0


def test_config_json_values_and_tuples(tmp_path: Path) -> None:
    config = {"a": (1, (2, 3)), "b": [None, True, 1.5, "x"], "nested": {"k": {"deep": []}}}
    result, _ = _roundtrip(tmp_path, {}, config)
    assert result == {"a": [1, [2, 3]], "b": [None, True, 1.5, "x"], "nested": {"k": {"deep": []}}}
    for scalar in (None, 3, "text", [1, 2]):
        assert _roundtrip(tmp_path, {}, scalar)[0] == scalar


def test_config_with_hundreds_of_tensors(tmp_path: Path) -> None:
    config = {"layers": [{"scale": torch.full((4,), float(i)), "i": i} for i in range(300)]}
    result, _ = _roundtrip(tmp_path, {"w": torch.ones(2)}, config)
    assert isinstance(result, dict) and len(result["layers"]) == 300
    for i, layer in enumerate(result["layers"]):
        assert layer["i"] == i and torch.equal(layer["scale"], torch.full((4,), float(i)))


@pytest.mark.parametrize(
    ("config", "path_text"),
    [
        ({"a": {"b": [1, {1, 2}]}}, "config['a']['b'][1]"),
        ({"a": object()}, "config['a']"),
        ({"x": {3: "int key"}}, "config['x']"),
        ([1, float("nan")], "config[1]"),
        ({"bad": {"__dist_workspace_tensor__": "x"}}, "config['bad']"),
    ],
)
def test_non_json_config_raises_type_error_before_writing(
    tmp_path: Path, config: object, path_text: str
) -> None:
    workspace = NFSWorkspace(tmp_path)
    workspace.write_configs_and_weights({"v": 1}, {}, rank=0)
    before = (tmp_path / "rank-0.safetensors").read_bytes()
    with pytest.raises(TypeError) as raised:
        workspace.write_configs_and_weights(config, {"w": torch.ones(3)}, rank=0)
    assert path_text in str(raised.value)
    assert (tmp_path / "rank-0.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_bad_weights_are_refused(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path)
    with pytest.raises(TypeError, match="weights\\['w'\\]"):
        workspace.write_configs_and_weights({}, {"w": [1, 2]}, rank=0)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="reserved"):
        workspace.write_configs_and_weights({}, {"dist_workspace.pad.0": torch.ones(1)}, rank=0)
    assert not (tmp_path / "rank-0.safetensors").exists()


def _reseal(raw: bytes) -> bytes:
    """``raw`` with its integrity digest recomputed, as a deliberate forger would."""
    (header_size,) = struct.unpack("<Q", raw[:8])
    return raw[:-DIGEST_BYTES] + header_digest(raw[: 8 + header_size])


def _data_region(path: Path) -> tuple[int, int]:
    """Where the tensor data starts and where the last tensor ends (file offsets)."""
    raw = path.read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_size])
    end = max(
        spec["data_offsets"][1]
        for name, spec in header.items()
        if name != "__metadata__" and not name.startswith("dist_workspace.")
    )
    return 8 + header_size, 8 + header_size + end


def _flip_data_byte(path: Path, *, from_end: int = 1, mask: int = 0x01) -> None:
    """Flips bits of one data byte in place, ``from_end`` bytes before the data's end."""
    _, end = _data_region(path)
    with path.open("r+b") as handle:
        handle.seek(end - from_end)
        byte = handle.read(1)
        handle.seek(end - from_end)
        handle.write(bytes([byte[0] ^ mask]))


def test_one_flipped_byte_is_detected(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path)
    weights = {"a": torch.randn(1000), "b": torch.arange(500, dtype=torch.int16)}
    path = workspace.write_configs_and_weights({}, weights, rank=3)
    start, _ = _data_region(path)
    raw = bytearray(path.read_bytes())
    raw[start + 1234] ^= 0x01  # inside tensor a (its 4000 bytes come first)
    path.write_bytes(bytes(raw))
    with pytest.raises(
        WorkspaceError, match=r"rank 3.*rank-3\.safetensors.*checksum mismatch in tensor 'a'"
    ):
        workspace.read_configs_and_weights_from_rank(3)


def test_truncated_file_names_rank_and_path(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path)
    path = workspace.write_configs_and_weights({}, {"a": torch.randn(1000)}, rank=2)
    raw = path.read_bytes()
    for cut in (len(raw) - 100, 100, 5):
        path.write_bytes(raw[:cut])
        with pytest.raises(WorkspaceError, match=r"rank 2's file .*rank-2\.safetensors"):
            workspace.read_configs_and_weights_from_rank(2)


class _Planted:
    """Unpickling it would create the trace file."""

    def __init__(self, trace: str) -> None:
        self.trace = trace

    def __reduce__(self) -> tuple[object, ...]:
        # posix.system is os.system; the root conftest replaces the os attribute with a
        # guard that pickle cannot name.
        return (posix.system, (f"touch {self.trace}",))


@pytest.mark.processes
def test_planted_pickle_is_rejected_and_never_executed(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path / "ws")
    trace = tmp_path / "pwned"
    payload = pickle.dumps(_Planted(str(trace)))
    # Proof that the payload works when unpickled, in a scratch process.
    import subprocess

    subprocess.run(
        [sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"],
        input=payload,
        check=True,
    )
    assert trace.exists()
    trace.unlink()
    for planted in (payload, b"PK\x03\x04" + payload, torch_save_bytes()):
        (tmp_path / "ws" / "rank-1.safetensors").write_bytes(planted)
        with pytest.raises(WorkspaceError, match=r"rank 1's file .*not a dist-workspace record"):
            workspace.read_configs_and_weights_from_rank(1)
    assert not trace.exists()


def torch_save_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buffer)
    return buffer.getvalue()


def test_foreign_safetensors_and_renamed_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    workspace = NFSWorkspace(tmp_path)
    save_file({"w": torch.ones(3)}, str(tmp_path / "rank-4.safetensors"))
    with pytest.raises(WorkspaceError, match=r"rank 4's file .*dist_workspace\.format"):
        workspace.read_configs_and_weights_from_rank(4)
    path = workspace.write_configs_and_weights({}, {"w": torch.ones(3)}, rank=5)
    path.rename(tmp_path / "rank-6.safetensors")
    with pytest.raises(WorkspaceError, match=r"rank 6's file .*written by rank 5"):
        workspace.read_configs_and_weights_from_rank(6)
    # A header this package would accept but for its dtype, with a valid digest.
    path = workspace.write_configs_and_weights({}, {"w": torch.ones(1, dtype=torch.uint8)}, rank=7)
    raw = path.read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + header_size].replace(b'"w":{"dtype":"U8"', b'"w":{"dtype":"X9"')
    path.write_bytes(_reseal(raw[:8] + header + raw[8 + header_size :]))
    with pytest.raises(WorkspaceError, match=r"rank 7's file .*unknown dtype 'X9'"):
        workspace.read_configs_and_weights_from_rank(7)


def test_files_are_plain_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    workspace = NFSWorkspace(tmp_path)
    weights = {"a": torch.randn(3, 4).t(), "b": torch.arange(5)}
    path = workspace.write_configs_and_weights({"lr": 0.1}, weights, rank=0)
    with safe_open(str(path), "pt") as handle:
        assert json.loads(handle.metadata()["dist_workspace.config"]) == {"lr": 0.1}
        assert torch.equal(handle.get_tensor("a"), weights["a"])
        assert torch.equal(handle.get_tensor("b"), weights["b"])


def test_large_tensor_flip_in_last_chunk(tmp_path: Path) -> None:
    # Larger than two 16 MiB chunks: the CRC runs on a helper thread, chunk by chunk.
    workspace = NFSWorkspace(tmp_path)
    big = torch.arange(10 * 1024 * 1024, dtype=torch.int32)  # 40 MiB
    path = workspace.write_configs_and_weights({}, {"big": big}, rank=0)
    _, weights = workspace.read_configs_and_weights_from_rank(0)
    assert weights is not None and torch.equal(weights["big"], big)
    _flip_data_byte(path, from_end=3, mask=0x10)
    with pytest.raises(WorkspaceError, match="checksum mismatch in tensor 'big'"):
        workspace.read_configs_and_weights_from_rank(0)


def test_large_records_are_mapped_copy_on_write(any_dir: Path) -> None:
    # 8 MiB on a local file system: mapped, not read. Writing to the returned tensor
    # must not reach the file, and the file's checksum is still verified.
    workspace = NFSWorkspace(any_dir)
    big = torch.arange(2 * 1024 * 1024, dtype=torch.int32)
    path = workspace.write_configs_and_weights({"k": 1}, {"big": big}, rank=1)
    _, weights = workspace.read_configs_and_weights_from_rank(1)
    assert weights is not None and torch.equal(weights["big"], big)
    weights["big"].zero_()
    _, again = workspace.read_configs_and_weights_from_rank(1)
    assert again is not None and torch.equal(again["big"], big), "the file changed"
    _flip_data_byte(path)
    with pytest.raises(WorkspaceError, match=r"rank-1\.safetensors.*checksum mismatch.*'big'"):
        workspace.read_configs_and_weights_from_rank(1)


def test_a_truncated_large_record_is_an_error_not_a_sigbus(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path)
    path = workspace.write_configs_and_weights({}, {"big": torch.ones(3 * 1024 * 1024)}, rank=0)
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(WorkspaceError, match=r"rank 0's file .*rank-0\.safetensors"):
        workspace.read_configs_and_weights_from_rank(0)


def test_network_file_systems_are_read_into_private_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On NFS a mapped page may be fetched again later, after another client replaced
    # the file: there the reader copies, so its tensors never change under it.
    from dist_workspace import fsutil

    monkeypatch.setattr(fsutil, "filesystem_type", lambda path: "nfs4")
    workspace = NFSWorkspace(tmp_path)
    big = torch.arange(2 * 1024 * 1024, dtype=torch.int32)
    path = workspace.write_configs_and_weights({}, {"big": big}, rank=0)
    _, weights = workspace.read_configs_and_weights_from_rank(0)
    _flip_data_byte(path)  # in place: a mapped tensor would see it
    assert weights is not None and torch.equal(weights["big"], big)


def test_filesystem_type_reads_mountinfo() -> None:
    from dist_workspace.fsutil import filesystem_type, is_local_filesystem

    assert filesystem_type("/proc/self") == "proc"
    if Path("/dev/shm").is_dir():
        assert filesystem_type("/dev/shm") == "tmpfs" and is_local_filesystem("/dev/shm")


def _record_bytes(tmp_path: Path, config: object) -> bytearray:
    """A shared-memory style record (no CRCs) of one small tensor, as bytes."""
    record = writer.prepare_record(
        {"t": torch.arange(6.0)}, config, rank=2, job="j", checksums=False
    )
    path = tmp_path / f"record-{len(list(tmp_path.iterdir()))}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        writer.write_record(fd, record)
    finally:
        os.close(fd)
    return bytearray(path.read_bytes())


def test_a_header_seen_before_still_has_its_digest_and_padding_checked(tmp_path: Path) -> None:
    from dist_workspace.reader import parse_header

    def parse(raw: bytearray) -> object:
        return parse_header(lambda at, length: bytes(raw[at : at + length]), len(raw), "seg")

    config = {"call": "seen-before"}
    assert parse(_record_bytes(tmp_path, config)).rank == 2  # type: ignore[attr-defined]
    # The same header bytes again (a loop of calls of one shape sends exactly this) ...
    forged_digest = _record_bytes(tmp_path, config)
    forged_digest[-1] ^= 0x01
    with pytest.raises(WorkspaceError, match="seg: header checksum mismatch"):
        parse(forged_digest)
    dirty_padding = _record_bytes(tmp_path, config)
    (header_size,) = struct.unpack("<Q", dirty_padding[:8])
    header = json.loads(dirty_padding[8 : 8 + header_size])
    pad = next(spec for name, spec in header.items() if name.startswith("dist_workspace.pad"))
    dirty_padding[8 + header_size + pad["data_offsets"][0]] = 1
    with pytest.raises(WorkspaceError, match=r"seg: padding .* is not zeros"):
        parse(dirty_padding)

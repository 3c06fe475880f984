"""The read path against hostile and damaged files: explicit cases, then seeded mutations.

Every outcome must be a WorkspaceError that names the file, or a correct read: the
file unchanged, or (for a file whose digest a forger recomputed) exactly what
safetensors itself reads from it. Never another exception, a hang, a MemoryError or
a silently wrong tensor.
"""

from __future__ import annotations

import json
import mmap
import random
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dist_workspace import NFSWorkspace, WorkspaceError
from dist_workspace.format import ALIGNMENT, DIGEST_BYTES, header_digest
from dist_workspace.reader import assemble, parse_header, view_entries

SEED = 20261122
RAW_MUTATIONS = 2000
FORGED_MUTATIONS = 1000


# ---------------------------------------------------------------- file surgery


def _split(raw: bytes) -> tuple[str, bytes]:
    """The header text (padding stripped) and the data section of a record."""
    (size,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + size].decode().rstrip(" "), raw[8 + size :]


def _join(header: str | bytes, data: bytes, *, forge: bool) -> bytes:
    """A file from a header and a data section, padded; with a fresh digest if ``forge``."""
    encoded = header.encode() if isinstance(header, str) else header
    encoded += b" " * ((-(8 + len(encoded))) % ALIGNMENT)
    raw = struct.pack("<Q", len(encoded)) + encoded + data
    return _reseal(raw) if forge else raw


def _reseal(raw: bytes) -> bytes:
    """``raw`` with its integrity digest recomputed, as a deliberate forger would."""
    if len(raw) < 8 + DIGEST_BYTES:
        return raw
    (size,) = struct.unpack("<Q", raw[:8])
    if 8 + size + DIGEST_BYTES > len(raw):
        return raw
    return raw[:-DIGEST_BYTES] + header_digest(raw[: 8 + size])


def _edit_document(header: str, edit: Callable[[dict[str, object]], None]) -> str:
    document = json.loads(header)
    edit(document)
    return json.dumps(document, separators=(",", ":"))


# ---------------------------------------------------------------- seed corpus


def _seed_records(directory: Path) -> list[bytes]:
    workspace = NFSWorkspace(directory / "seeds", durable=False)
    embedding = torch.randn(6, 4)
    seeds = [
        (
            {"lr": 0.1, "layers": [{"act": "gelu", "dims": (4, 8)}], "name": "ünï"},
            {
                "w": torch.randn(3, 5),
                "b16": torch.randn(7).to(torch.bfloat16),
                "h16": torch.randn(7).to(torch.float16),
                "i": torch.arange(9, dtype=torch.int32),
                "mask": torch.tensor([True, False, True]),
                "empty": torch.empty(0, 3),
                "scalar": torch.tensor(2.5, dtype=torch.float64),
            },
        ),
        (
            {"scale": torch.ones(3), "half": torch.full((2,), 0.5)},
            {"emb": embedding, "head": embedding, "emb.T": embedding.t(), "row": embedding[2]},
        ),
        (None, {"f8": torch.randn(16).to(torch.float8_e4m3fn), "u8": torch.arange(5).byte()}),
    ]
    records = []
    for config, weights in seeds:
        path = workspace.write_configs_and_weights(config, weights, rank=0)
        records.append(path.read_bytes())
    return records


# ---------------------------------------------------------------- mutators

_SAME_SIZE_DTYPES = [("BF16", "F16"), ("F16", "BF16"), ("F32", "I32"), ("I32", "U32"), ("U8", "I8")]


def _raw_mutation(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """One byte-level change: flips, overwrites, cuts, growth, header length."""
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    kind = rng.choice(
        ["flip", "byte", "header_byte", "truncate", "extend", "insert", "delete", "length"]
    )
    data = bytearray(raw)
    if kind == "flip":
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == "header_byte":
        data[rng.randrange(8, header_end)] = rng.randrange(256)
    elif kind == "truncate":
        del data[rng.randrange(len(data)) :]
    elif kind == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100)))
    elif kind == "insert":
        position = rng.randrange(len(data))
        data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    elif kind == "delete":
        position = rng.randrange(len(data))
        del data[position : position + rng.randrange(1, 9)]
    else:
        value = rng.choice(
            [0, 1, 7, header_end - 8 - 1, header_end - 8 + 64, len(raw), 2**63, 2**64 - 1]
        )
        data[:8] = struct.pack("<Q", value)
    return kind, bytes(data)


def _header_mutation(rng: random.Random, raw: bytes, *, forge: bool) -> tuple[str, bytes]:
    """One change of the header's meaning (dtypes, shapes, offsets, keys, nesting, text)."""
    header, data = _split(raw)
    document = json.loads(header)
    names = [name for name in document if name != "__metadata__"]
    name = rng.choice(names)
    bomb = "[" * 1000 + "]" * 1000
    kind = rng.choice(
        [
            "dtype_swap",
            "dtype_list",
            "dtype_unknown",
            "shape_huge",
            "shape_negative",
            "shape_float",
            "shape_bomb",
            "offsets_overlap",
            "offsets_out_of_range",
            "offsets_reversed",
            "duplicate_key",
            "header_bomb",
            "layout_bomb",
            "config_bomb",
            "layout_edit",
            "config_edit",
            "metadata_drop",
            "metadata_extra",
            "non_utf8",
            "lone_surrogate",
            "name_change",
            "entry_drop",
            "nan_config",
            "huge_int",
        ]
    )

    def entry(edit: Callable[[dict[str, object]], None]) -> str:
        def apply(doc: dict[str, object]) -> None:
            spec = doc[name]
            assert isinstance(spec, dict)
            edit(spec)

        return _edit_document(header, apply)

    text: str | bytes
    if kind == "dtype_swap":
        before, after = rng.choice(_SAME_SIZE_DTYPES)
        text = header.replace(f'"dtype":"{before}"', f'"dtype":"{after}"', 1)
    elif kind == "dtype_list":
        text = entry(lambda spec: spec.update(dtype=[spec["dtype"]]))
    elif kind == "dtype_unknown":
        text = entry(lambda spec: spec.update(dtype=rng.choice(["X9", "", "f32", 7, None])))
    elif kind == "shape_huge":
        huge = rng.choice([2**62, 2**63, 2**64 + 1, 10**30])
        text = entry(lambda spec: spec.update(shape=[huge] * rng.randrange(1, 40)))
    elif kind == "shape_negative":
        text = entry(lambda spec: spec.update(shape=[-1, -4]))
    elif kind == "shape_float":
        text = entry(lambda spec: spec.update(shape=[1.0, True]))
    elif kind == "shape_bomb":
        text = header.replace(f'"{name}":{{"dtype"', f'"{name}":{{"x":{bomb},"dtype"', 1)
        text = re.sub(r'"shape":\[[0-9,]*\]', f'"shape":{bomb}', text, count=1)
    elif kind == "offsets_overlap":

        def overlap(spec: dict[str, object]) -> None:
            begin, end = spec["data_offsets"]  # type: ignore[misc]
            shift = rng.choice([-64, -1, 1, 64])
            spec["data_offsets"] = [max(0, begin + shift), max(0, end + shift)]

        text = entry(overlap)
    elif kind == "offsets_out_of_range":
        text = entry(
            lambda spec: spec.update(data_offsets=[0, len(data) + rng.randrange(1, 10**6)])
        )
    elif kind == "offsets_reversed":
        text = entry(lambda spec: spec.update(data_offsets=list(reversed(spec["data_offsets"]))))  # type: ignore[call-overload]
    elif kind == "duplicate_key":
        spec_text = json.dumps(document[name], separators=(",", ":"))
        other = spec_text.replace('"dtype":"', '"dtype":"F16","was":"', 1)
        text = header[:-1] + f',"{name}":{rng.choice([spec_text, other])}}}'
    elif kind == "header_bomb":
        text = header[:-1] + f',"bomb":{bomb}}}'
    elif kind == "layout_edit":

        def layout(doc: dict[str, object]) -> None:
            metadata = doc["__metadata__"]
            assert isinstance(metadata, dict)
            parsed = json.loads(metadata["dist_workspace.layout"])
            choice = rng.randrange(6)
            if choice == 0:
                parsed["order"] = parsed["order"] + parsed["order"][:1]
            elif choice == 1:
                parsed["order"] = ["dist_workspace.integrity"]
            elif choice == 2 and parsed["views"]:
                view = next(iter(parsed["views"].values()))
                view[rng.choice(["offset", "stride", "shape", "dtype", "blob"])] = rng.choice(
                    [10**9, [10**9], [1, 1, 1], "BF16", "dist_workspace.shared.9", -8, None]
                )
            elif choice == 3:
                parsed.pop(rng.choice(["order", "views", "crc32"]), None)
            elif choice == 4 and parsed.get("crc32"):
                key = next(iter(parsed["crc32"]))
                parsed["crc32"][key] = rng.choice(["0" * 8, "zz", 5, "F" * 8])
            else:
                parsed["views"] = {n: {"blob": "nope"} for n in parsed["order"][:1]}
            metadata["dist_workspace.layout"] = json.dumps(parsed)

        text = _edit_document(header, layout)
    elif kind in ("layout_bomb", "config_bomb"):
        key = "dist_workspace.layout" if kind == "layout_bomb" else "dist_workspace.config"

        def nest(doc: dict[str, object]) -> None:
            metadata = doc["__metadata__"]
            assert isinstance(metadata, dict)
            metadata[key] = rng.choice([bomb, '{"a":' * 1000 + "1" + "}" * 1000])

        text = _edit_document(header, nest)
    elif kind == "config_edit":

        def config(doc: dict[str, object]) -> None:
            metadata = doc["__metadata__"]
            assert isinstance(metadata, dict)
            value = metadata["dist_workspace.config"]
            assert isinstance(value, str)
            position = rng.randrange(len(value))
            metadata["dist_workspace.config"] = (
                value[:position] + rng.choice('0123456789"{}[],:ax ') + value[position + 1 :]
            )

        text = _edit_document(header, config)
    elif kind == "metadata_drop":
        key = rng.choice(["format", "config", "layout", "rank", "job"])
        text = _edit_document(
            header,
            lambda doc: doc["__metadata__"].pop(f"dist_workspace.{key}"),  # type: ignore[attr-defined]
        )
    elif kind == "metadata_extra":
        text = _edit_document(
            header,
            lambda doc: doc["__metadata__"].update(extra=rng.choice(["x", 1, [], {}])),  # type: ignore[attr-defined]
        )
    elif kind == "non_utf8":
        encoded = header.encode()
        position = rng.randrange(len(encoded))
        text = (
            encoded[:position]
            + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"])
            + encoded[position:]
        )
    elif kind == "lone_surrogate":
        text = header.replace(f'"{name}"', f'"{name}\\ud800"', 1)
    elif kind == "name_change":
        text = header.replace(f'"{name}"', f'"{name}x"', 1)
    elif kind == "entry_drop":
        text = _edit_document(header, lambda doc: doc.pop(name))
    elif kind == "nan_config":
        text = _edit_document(
            header,
            lambda doc: doc["__metadata__"].update({"dist_workspace.config": "[NaN, 1e999]"}),  # type: ignore[attr-defined]
        )
    else:
        text = header.replace('"shape":[', '"shape":[' + "9" * 5000 + ",", 1)
    return kind, _join(text, data, forge=forge)


# ---------------------------------------------------------------- oracle


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return list(left) == list(right) and all(
        left[k].dtype == right[k].dtype
        and left[k].shape == right[k].shape
        and left[k].stride() == right[k].stride()
        and _bits(left[k]) == _bits(right[k])
        for k in left
    )


def _check_file(
    workspace: NFSWorkspace,
    mutant: bytes,
    original: bytes,
    expected: tuple[object, dict[str, torch.Tensor]],
    forged: bool,
    label: str,
) -> str:
    """Reads ``mutant`` as rank 0's file; returns the outcome, fails on a wrong one."""
    path = workspace.rank_path(0)
    path.write_bytes(mutant)
    try:
        config, weights = workspace.read_configs_and_weights_from_rank(0)
    except WorkspaceError as error:
        assert str(path) in str(error), f"{label}: the error does not name the file: {error}"
        return "refused"
    except BaseException as error:
        pytest.fail(f"{label}: {type(error).__name__}: {error}")
    assert weights is not None
    if mutant == original:
        assert _same_config(config, expected[0]), f"{label}: the config differs"
        assert _same(weights, expected[1]), f"{label}: an unchanged file read back differently"
        return "unchanged"
    assert forged, f"{label}: a changed file was read without an error"
    # A forger may write any valid record: what comes back must be what it says.
    reference = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        recorded_config = json.loads(handle.metadata()["dist_workspace.config"])
    for name, tensor in weights.items():
        if name in reference:
            assert _same({name: tensor}, {name: reference[name]}), f"{label}: {name} differs"
    if not any(isinstance(value, torch.Tensor) for value in _leaves(config)):
        assert config == recorded_config, f"{label}: the config differs from the file's"
    return "forged and read as written"


def _same_config(left: object, right: object) -> bool:
    if isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor):
        return _same({"t": left}, {"t": right})
    if isinstance(left, dict) and isinstance(right, dict):
        return list(left) == list(right) and all(_same_config(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(_same_config, left, right))
    return type(left) is type(right) and left == right


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _check_segment(mutant: bytes, label: str) -> None:
    """The shared-memory reader (no CRC, a mapping) on the same bytes: refuse or read."""
    where = f"rank 0's segment test-{label}"
    if not mutant:
        return
    mapping = mmap.mmap(-1, len(mutant))
    mapping.write(mutant)
    try:
        header = parse_header(lambda o, n: mapping[o : o + n], len(mutant), where)
        assemble(view_entries(mapping, header), header, where)
    except WorkspaceError as error:
        assert where in str(error), f"{label}: the error does not name the segment: {error}"
    except BaseException as error:
        pytest.fail(f"{label} (segment): {type(error).__name__}: {error}")


# ---------------------------------------------------------------- the tests


@pytest.mark.timeout(300)
def test_seeded_mutations_are_refused_or_read_correctly(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    seeds = _seed_records(tmp_path)
    workspace = NFSWorkspace(tmp_path / "ws", durable=False)
    expected = []
    for raw in seeds:
        workspace.rank_path(0).write_bytes(raw)
        config, weights = workspace.read_configs_and_weights_from_rank(0)
        assert weights is not None
        expected.append((config, weights))
    outcomes: dict[str, int] = {}
    for index in range(RAW_MUTATIONS + FORGED_MUTATIONS):
        which = rng.randrange(len(seeds))
        forged = index >= RAW_MUTATIONS
        if forged or rng.random() < 0.5:
            kind, mutant = _header_mutation(rng, seeds[which], forge=forged)
        else:
            kind, mutant = _raw_mutation(rng, seeds[which])
        label = f"mutation {index} ({kind}{', forged' if forged else ''}) of seed {which}"
        outcome = _check_file(workspace, mutant, seeds[which], expected[which], forged, label)
        if kind not in ("flip", "byte", "truncate", "extend", "insert", "delete"):
            _check_segment(mutant, label)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # Raw damage is always refused; forged files mostly are (they break cross-checks).
    assert outcomes.get("refused", 0) >= RAW_MUTATIONS


def test_header_json_nested_1000_deep_is_refused_without_recursion(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path, durable=False)
    raw = workspace.write_configs_and_weights({"a": 1}, {"w": torch.ones(2)}, rank=0).read_bytes()
    header, data = _split(raw)
    bomb = "[" * 1000 + "]" * 1000
    cases = {
        "header": header[:-1] + f',"x":{bomb}}}',
        "shape": header.replace('"shape":[2]', f'"shape":{bomb}', 1),
        "layout": _edit_document(
            header,
            lambda doc: doc["__metadata__"].update({"dist_workspace.layout": bomb}),  # type: ignore[attr-defined]
        ),
        "config": _edit_document(
            header,
            lambda doc: doc["__metadata__"].update({"dist_workspace.config": bomb}),  # type: ignore[attr-defined]
        ),
    }
    for where, text in cases.items():
        for forge in (False, True):
            workspace.rank_path(0).write_bytes(_join(text, data, forge=forge))
            with pytest.raises(WorkspaceError, match=r"rank-0\.safetensors") as raised:
                workspace.read_configs_and_weights_from_rank(0)
            assert "nested deeper" in str(raised.value) or "checksum" in str(raised.value), where


def test_changed_dtype_and_config_bytes_and_duplicate_keys_are_errors(tmp_path: Path) -> None:
    # Each of these read back as silently wrong values in format 1.
    workspace = NFSWorkspace(tmp_path, durable=False)
    weights = {"w": torch.randn(4).to(torch.bfloat16)}
    raw = workspace.write_configs_and_weights({"lr": 0.125}, weights, rank=0).read_bytes()
    header, data = _split(raw)
    swapped = header.replace('"dtype":"BF16"', '"dtype":"F16"', 1)
    config = header.replace("0.125", "0.925", 1)
    duplicate = (
        header[:-1] + ',"w":' + json.dumps(json.loads(header)["w"]).replace("BF16", "F16") + "}"
    )
    assert swapped != header and config != header
    for text, message in [
        (swapped, "header checksum mismatch"),
        (config, "header checksum mismatch"),
        (duplicate, "appears twice"),
    ]:
        workspace.rank_path(0).write_bytes(_join(text, data, forge=False))
        with pytest.raises(WorkspaceError, match=message):
            workspace.read_configs_and_weights_from_rank(0)
    for text in (duplicate, header.replace('"dtype":"BF16"', '"dtype":["BF16"]', 1)):
        workspace.rank_path(0).write_bytes(_join(text, data, forge=True))
        with pytest.raises(WorkspaceError, match=r"rank-0\.safetensors.*(twice|unknown dtype)"):
            workspace.read_configs_and_weights_from_rank(0)


def test_a_format_1_file_says_so(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path, durable=False)
    raw = workspace.write_configs_and_weights({}, {"w": torch.ones(2)}, rank=0).read_bytes()
    header, data = _split(raw)
    old = header.replace('"dist_workspace.format":"2"', '"dist_workspace.format":"1"', 1)
    workspace.rank_path(0).write_bytes(_join(old, data, forge=False))
    with pytest.raises(
        WorkspaceError,
        match=r"rank-0\.safetensors: written in dist-workspace record format 1 .*reads format 2 "
        r"only\. Write it again with this version",
    ):
        workspace.read_configs_and_weights_from_rank(0)
    newer = header.replace('"dist_workspace.format":"2"', '"dist_workspace.format":"3"', 1)
    workspace.rank_path(0).write_bytes(_join(newer, data, forge=False))
    with pytest.raises(WorkspaceError, match=r"format '3'.*newer version\? Upgrade"):
        workspace.read_configs_and_weights_from_rank(0)


def test_every_file_the_writer_makes_opens_bit_exactly_in_safetensors(tmp_path: Path) -> None:
    from dist_workspace.format import supported_dtypes

    workspace = NFSWorkspace(tmp_path, durable=False)
    generator = torch.Generator().manual_seed(3)
    weights = {
        str(dtype): torch.randint(0, 256, (5, 3), dtype=torch.uint8, generator=generator).view(
            dtype
        )
        if dtype.itemsize == 1
        else torch.randint(
            0, 256, (5, 3 * dtype.itemsize), dtype=torch.uint8, generator=generator
        ).view(dtype)
        for dtype in supported_dtypes()
        if dtype != torch.bool
    }
    weights["bool"] = torch.tensor([True, False])
    weights["empty"] = torch.empty(0, 4)
    weights["scalar"] = torch.tensor(1.5)
    weights["view"] = torch.arange(40.0).reshape(5, 8)[:, 2:5]
    path = workspace.write_configs_and_weights({"t": torch.ones(3)}, weights, rank=0)
    loaded = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        opened = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    for name, tensor in weights.items():
        assert _same({name: loaded[name]}, {name: tensor.contiguous()}), name
        assert _same({name: opened[name]}, {name: tensor.contiguous()}), name

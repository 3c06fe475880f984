"""Configs as JSON: validation with key paths, and tensors carried beside the JSON.

A config is any JSON value (dict, list, str, int, float, bool, None). Tuples are
accepted and come back as lists, as JSON has no tuple. Anything else raises
:class:`TypeError` naming the key path (``config['layers'][3]['act']``) before a
single byte is written.

Tensors inside a config are allowed: each is moved to the tensor part of the record
under the name ``dist_workspace.config.{n}`` and replaced in the JSON by
``{"__dist_workspace_tensor__": "dist_workspace.config.{n}"}``. Decoding puts the
tensor back. A dict whose only key is ``__dist_workspace_tensor__`` is therefore
reserved and rejected on encode.

Configs nest at most :data:`MAX_DEPTH` levels (lists and dicts), on write and on
read, so that no hostile config can exhaust the parser's recursion.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from dist_workspace.safejson import JsonRefused, loads

TENSOR_MARKER = "__dist_workspace_tensor__"
MAX_DEPTH = 64
CONFIG_TENSOR_PREFIX = "dist_workspace.config."


def _path_text(path: list[str | int]) -> str:
    return "config" + "".join(f"[{part!r}]" for part in path)


def encode_config(config: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """Validates ``config`` and splits it into JSON text and the tensors it holds.

    Args:
        config: Any JSON value; tuples become lists, tensors are carried aside.

    Returns:
        The JSON text and the tensors it references, by their record names.

    Raises:
        TypeError: A value (or dict key) is not JSON; the message names its key path.
    """
    tensors: dict[str, torch.Tensor] = {}

    def convert(value: Any, path: list[str | int]) -> Any:
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise TypeError(
                    f"{_path_text(path)} is {value!r}: JSON has no NaN or infinity; "
                    "store it as a string or a tensor"
                )
            return float(value)
        if isinstance(value, torch.Tensor):
            name = f"{CONFIG_TENSOR_PREFIX}{len(tensors)}"
            tensors[name] = value
            return {TENSOR_MARKER: name}
        if isinstance(value, dict | list | tuple) and len(path) >= MAX_DEPTH:
            raise TypeError(
                f"{_path_text(path)} nests deeper than {MAX_DEPTH} lists and dicts, "
                "which dist-workspace refuses to read back: flatten it"
            )
        if isinstance(value, dict):
            if list(value) == [TENSOR_MARKER]:
                raise TypeError(
                    f"{_path_text(path)} is a dict with the single key {TENSOR_MARKER!r}, "
                    "which dist-workspace reserves for tensors inside configs"
                )
            result: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"{_path_text(path)} has the key {key!r} of type "
                        f"{type(key).__name__}: JSON object keys must be str"
                    )
                result[key] = convert(item, [*path, key])
            return result
        if isinstance(value, list | tuple):
            return [convert(item, [*path, index]) for index, item in enumerate(value)]
        raise TypeError(
            f"{_path_text(path)} is a {type(value).__module__}.{type(value).__qualname__}, "
            "which is not JSON (expected dict, list, tuple, str, int, float, bool, None "
            "or a torch.Tensor)"
        )

    converted = convert(config, [])
    return json.dumps(converted, separators=(",", ":"), allow_nan=False), tensors


def decode_config(text: str, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Parses config JSON and puts the referenced tensors back.

    Args:
        text: The JSON text written by :func:`encode_config`.
        tensors: The record's config tensors by name.
        where: Rank and path for error messages.

    Raises:
        ValueError: The JSON is invalid or references a tensor the record lacks.
    """
    try:
        # The JSON's own depth plus the tensor marker's object.
        parsed = loads(text, max_depth=MAX_DEPTH + 1)
    except JsonRefused as error:
        raise ValueError(f"{where}: the config is refused: {error}") from None

    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if list(value) == [TENSOR_MARKER]:
                name = value[TENSOR_MARKER]
                if not isinstance(name, str) or name not in tensors:
                    raise ValueError(f"{where}: the config references tensor {name!r:.200}, absent")
                return tensors[name]
            return {key: restore(item) for key, item in value.items()}
        if isinstance(value, list):
            return [restore(item) for item in value]
        return value

    return restore(parsed)

"""Validate a Kubernetes object (a dict, as sent to the API server) against the ``kubernetes`` client's models.

No API server runs here, so the OpenAPI models the official client is generated from are the
schema: every key must be a field of its model (camelCase, as on the wire), every value of its
type (strings never numbers, except resource quantities), and every field the model requires
present (the client's own checks when it builds the model).
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes.client as k8s

__all__ = ["validate", "model_errors"]

_LIST = re.compile(r"^(?:List\[|list\[)(.+)\]$")
_DICT = re.compile(r"^(?:Dict\[|dict\()str, (.+)[\])]$")
_QUANTITY_MAPS = ("limits", "requests", "capacity", "allocatable", "hard")


def model_errors(data: Any, type_name: str, path: str = "") -> list[str]:
    """Every place where ``data`` does not fit ``type_name`` (a model name such as V1Pod, or a primitive)."""
    if m := _LIST.match(type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list, got {type(data).__name__}"]
        return [e for i, item in enumerate(data) for e in model_errors(item, m.group(1), f"{path}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a map, got {type(data).__name__}"]
        inner = m.group(1)
        if inner == "str" and path.rsplit(".", 1)[-1] in _QUANTITY_MAPS:
            inner = "quantity"
        return [e for k, v in data.items() for e in model_errors(v, inner, f"{path}.{k}")]
    if type_name == "quantity":
        ok = isinstance(data, (str, int, float)) and not isinstance(data, bool)
        return [] if ok else [f"{path}: expected a quantity, got {data!r}"]
    if type_name in ("str", "datetime", "date", "bytes", "bytearray"):     # bytes: base64 text on the wire
        return [] if isinstance(data, str) else [f"{path}: expected a string, got {data!r}"]
    if type_name == "int":
        return [] if isinstance(data, int) and not isinstance(data, bool) else [f"{path}: expected an int, got {data!r}"]
    if type_name == "float":
        return [] if isinstance(data, (int, float)) and not isinstance(data, bool) else [f"{path}: expected a number"]
    if type_name == "bool":
        return [] if isinstance(data, bool) else [f"{path}: expected true/false, got {data!r}"]
    if type_name == "object":
        return []
    model = getattr(k8s, type_name, None)
    if model is None:
        return [f"{path}: the client has no model {type_name}"]
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} object, got {data!r}"]
    fields = {wire: attr for attr, wire in model.attribute_map.items()}
    errors = [f"{path}.{k}: no such field in {type_name} (valid: {', '.join(sorted(fields))})"
              for k in data if k not in fields]
    for k, v in data.items():
        if k in fields and v is not None:
            errors += model_errors(v, model.openapi_types[fields[k]], f"{path}.{k}")
    return errors


def validate(obj: dict, type_name: str | None = None) -> Any:
    """The model built from ``obj`` (``V1`` + its kind unless given); AssertionError listing every mismatch."""
    type_name = type_name or f"{obj['apiVersion'].split('/')[-1].upper()[:1]}{obj['apiVersion'].split('/')[-1][1:]}{obj['kind']}"
    errors = model_errors(obj, type_name, obj.get("kind", type_name))
    assert not errors, "\n".join(errors)
    try:   # the client's own required-field checks
        return k8s.ApiClient()._ApiClient__deserialize(obj, type_name)
    except ValueError as exc:
        raise AssertionError(f"{type_name} {obj.get('metadata', {}).get('name')}: {exc}") from None

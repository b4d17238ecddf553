"""What the barrier and the single flight share about their records: where they live, who wrote them,
and when a record read back is one nemo_safe wrote.

Both keep their records in a hidden folder of a directory that other users and programs may write
to as well, so a reader trusts a record only when every field has the type nemo_safe writes. A
record names its writer by host and pid (for the error messages) and by a random nonce (pids
repeat across hosts, pid namespaces and restarts; the nonce does not)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any

#: The hidden folder, inside the directory the ranks share, that holds barrier and lock records.
HIDDEN_DIRNAME = ".nemo_safe"


def new_nonce() -> str:
    """A random token naming one process's part in one barrier or flight (or one session)."""
    return secrets.token_hex(8)


def has_field_types(record: Any, fields: Mapping[str, type | tuple[type, ...]], required: Iterable[str] = ()) -> bool:
    """Whether ``record`` is a dict whose fields among ``fields`` have those types (``bool`` never
    passes for ``int``) and which has every ``required`` field."""
    if not isinstance(record, dict) or any(key not in record for key in required):
        return False
    for key, kind in fields.items():
        if key not in record:
            continue
        value = record[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and not _admits_bool(kind)):
            return False
    return True


def _admits_bool(kind: type | tuple[type, ...]) -> bool:
    return bool in (kind if isinstance(kind, tuple) else (kind,))

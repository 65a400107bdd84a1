"""Base-model identity: a base model's id (what workers register with) and its other names, e.g. the Hugging
Face repo id (set by an admin, or reported by workers from the checkpoint's ``config.json``).

An adapter's ``adapter_config.json`` names the model it was trained on (``base_model_name_or_path``). If that
name is neither the id it is pushed for nor one of that model's other names, the adapter was most likely
trained for other weights of the same shapes (an Instruct adapter pushed for the base model): the push is
refused with FAILED_PRECONDITION naming both, unless it says ``allow_base_mismatch`` (recorded in the
adapter's labels). A declared base that is a local path cannot be checked: accepted, with a warning.
"""

from __future__ import annotations

import json

from sqlalchemy.orm import sessionmaker

from loraserve.adapters.refs import is_hub_id
from loraserve.common.errors import FailedPrecondition, InvalidArgument, NotFound
from loraserve.registry.db import BaseModelRow

MISMATCH_LABEL = "loraserve.base-mismatch"
MAX_ALIASES = 32


def declared_base(config_bytes: bytes) -> str:
    try:
        value = json.loads(config_bytes).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        return ""  # the config parser reports a broken config on its own
    return value.strip() if isinstance(value, str) else ""


def is_local_path(name: str) -> bool:
    return not is_hub_id(name)


class BaseModels:
    def __init__(self, sessions: sessionmaker) -> None:
        self.sessions = sessions

    def names(self, model_id: str) -> list[str]:
        with self.sessions() as s:
            row = s.get(BaseModelRow, model_id)
            return [model_id, *(row.aliases if row is not None else [])]

    def check(
        self, model_id: str, config_bytes: bytes, allow_mismatch: bool
    ) -> tuple[dict[str, str], list[str]]:
        """(labels to record, warnings for the caller) for an adapter pushed for ``model_id``."""
        declared = declared_base(config_bytes)
        if not declared:
            return {}, []
        known = self.names(model_id)
        if declared in known:
            return {}, []
        if is_local_path(declared):
            return {}, [
                f"adapter_config.json names a local path as its base model ({declared[:200]}); "
                f"not checked against {model_id!r}"
            ]
        if allow_mismatch:
            return {MISMATCH_LABEL: declared[:256]}, [
                f"accepted for {model_id!r} although adapter_config.json names {declared!r} (--allow-base-mismatch)"
            ]
        raise FailedPrecondition(
            f"adapter_config.json names base model {declared!r}, but it is pushed for {model_id!r} "
            f"(known as: {', '.join(known)}); if the weights are the same, add the name to the base model "
            f"(loraserve adapters base {model_id} --alias {declared}), else push with --allow-base-mismatch"
        )

    def set_aliases(self, model_id: str, add: list[str], remove: list[str]) -> BaseModelRow:
        if not model_id:
            raise InvalidArgument("a base model id is required")
        bad = [a for a in add if not a or len(a) > 512]
        if bad:
            raise InvalidArgument("base model names must be 1-512 characters")
        with self.sessions() as s:
            row = s.get(BaseModelRow, model_id, with_for_update=True)
            if row is None:  # named before any worker registered it: shapes come with the first worker
                row = BaseModelRow(id=model_id, module_shapes={}, num_layers=0, aliases=[])
                s.add(row)
            names = [a for a in (row.aliases or []) if a not in remove]
            names += [a for a in add if a not in names and a != model_id]
            if len(names) > MAX_ALIASES:
                raise InvalidArgument(f"a base model has at most {MAX_ALIASES} other names")
            row.aliases = names
            s.commit()
            return row

    def get(self, model_id: str) -> BaseModelRow:
        with self.sessions() as s:
            row = s.get(BaseModelRow, model_id)
        if row is None:
            raise NotFound(f"base model {model_id!r} is not known")
        return row

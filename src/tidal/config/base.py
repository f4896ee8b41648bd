"""What every config block shares: strict models (an unknown key is an error), the error types, and the
checks of a name that is a built-in or `module:name`."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from tidal.config.names import registered

MODULE_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def config_error(reason: str) -> PydanticCustomError:
    """A validation error whose text is `reason` alone (a plain ValueError gets pydantic's "Value error, " prefix)."""
    return PydanticCustomError("tidal_config", "{reason}", {"reason": reason})


def built_in(kind: str) -> dict[str, Any]:
    """A field's `json_schema_extra` naming the registry its built-in names come from (the reference lists them)."""
    return {"built_in": kind}


def built_in_or_module(kind: str, name: str) -> str:
    """`name` when it is a built-in of `kind` (read from its registry) or has the form module:name."""
    known = registered(kind)
    if name in known or MODULE_NAME.match(name):
        return name
    raise config_error(f"unknown {kind} {name!r}: built in are {', '.join(known)}, or give module:name")

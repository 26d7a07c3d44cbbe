"""The base of every section, and the error a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from specrl.errors import UserError


class ConfigError(UserError):
    """A configuration problem, with a message that names the field and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

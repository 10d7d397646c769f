"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings,
or an EBNF grammar (vLLM's `structured_outputs` fields). Plain data: batcher.grammar compiles it."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StructuredOutputs(BaseModel):
    json_schema: Union[str, Dict[str, Any], None] = Field(
        None, alias="json", description="A JSON schema (an object, or its JSON text) the output must validate against."
    )
    json_object: bool = Field(False, description="Any JSON object (OpenAI's response_format json_object).")
    regex: Optional[str] = Field(None, description="A regular expression the whole output must match.")
    choice: Optional[List[str]] = Field(None, min_length=1, description="The output is exactly one of these.")
    grammar: Optional[str] = Field(None, description="An EBNF grammar (xgrammar's / GBNF dialect, rule `root`).")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_is_json(cls, v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if v is not None and not isinstance(v, dict):
            raise ValueError("a JSON schema must be an object")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [
            name
            for name, on in (
                ("json", self.json_schema is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if on
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of json, json_object, regex, choice and grammar (got {given or 'none'})"
            )
        return self

    @property
    def kind(self) -> str:
        return next(
            k
            for k, v in (
                ("json", self.json_schema),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if v is not None
        )

    def cache_key(self) -> str:
        """Equal for equal constraints (the schema's key order aside): compiled grammars are cached by it."""
        return json.dumps(self.model_dump(by_alias=True, exclude_defaults=True), sort_keys=True)

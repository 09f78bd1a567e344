"""The base every config model uses: unknown keys are errors, field docstrings are the docs."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A pydantic model that forbids unknown keys and takes each field's docstring as its description
    (which feeds `alignpipe show --schema`, the JSON schema and the Prefect UI form)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

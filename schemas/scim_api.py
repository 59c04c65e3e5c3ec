"""The SCIM 2.0 bodies (RFC 7643 resources, RFC 7644 messages) as the OpenAPI document
describes them: what a client sends and gets, in SCIM's own attribute names. The handlers
(gateway/identity/scim.py) read and write these shapes themselves, with SCIM's rules (case-
insensitive attribute names, attributes the service does not keep); these models are the
document's, and leave room (`extra="allow"`) for what RFC 7643 allows beside them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Scim(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ScimName(_Scim):
    given_name: str | None = Field(default=None, alias="givenName")
    family_name: str | None = Field(default=None, alias="familyName")
    formatted: str | None = None


class ScimEmail(_Scim):
    value: str
    primary: bool | None = None
    type: str | None = None


class ScimUser(_Scim):
    """A User resource (urn:ietf:params:scim:schemas:core:2.0:User)."""

    schemas: list[str]
    id: str | None = Field(default=None, description="assigned by the service; read-only")
    user_name: str | None = Field(
        default=None, alias="userName", description="required when one is written"
    )
    external_id: str | None = Field(default=None, alias="externalId")
    name: ScimName | None = None
    display_name: str | None = Field(default=None, alias="displayName")
    emails: list[ScimEmail] | None = None
    active: bool | None = None
    meta: dict[str, Any] | None = Field(default=None, description="read-only")


class ScimPatchOperation(_Scim):
    op: str = Field(description="add, replace or remove (any case)")
    path: str | None = None
    value: Any = None


class ScimPatchOp(_Scim):
    """A PatchOp message (urn:ietf:params:scim:api:messages:2.0:PatchOp)."""

    schemas: list[str]
    operations: list[ScimPatchOperation] = Field(alias="Operations")


class ScimSearchRequest(_Scim):
    """A SearchRequest message (urn:ietf:params:scim:api:messages:2.0:SearchRequest)."""

    schemas: list[str]
    filter: str | None = None
    start_index: int | None = Field(default=None, alias="startIndex")
    count: int | None = None
    attributes: list[str] | None = None
    excluded_attributes: list[str] | None = Field(default=None, alias="excludedAttributes")


class ScimListResponse(_Scim):
    """A ListResponse message: one page of resources."""

    schemas: list[str]
    total_results: int = Field(alias="totalResults")
    start_index: int = Field(alias="startIndex")
    items_per_page: int = Field(alias="itemsPerPage")
    resources: list[dict[str, Any]] = Field(alias="Resources")


class ScimErrorBody(_Scim):
    """An Error message (RFC 7644 section 3.12): every SCIM refusal (a 4xx); a failure of the
    service itself (a 5xx) is the service's own envelope."""

    schemas: list[str]
    status: str = Field(description="the HTTP status, as a string")
    scim_type: str | None = Field(default=None, alias="scimType")
    detail: str | None = None

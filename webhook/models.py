"""The AdmissionReview wire format (``admission.k8s.io/v1``): only the fields the webhook reads.

Field names are the wire's camelCase, as upstream names them. Unknown fields are ignored, so a
newer API server's additions never turn into a 400.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class GroupVersionKind(_Wire):
    """``request.kind``: the kind of the object as the webhook was registered for it."""

    group: str = ""
    version: str = Field(min_length=1)
    kind: str = Field(min_length=1)


class UserInfo(_Wire):
    """``request.userInfo``: who asks (the API server authenticated them)."""

    username: str = ""
    groups: tuple[str, ...] = ()


class AdmissionRequest(_Wire):
    """``request``: what is being admitted."""

    uid: str = Field(min_length=1)
    kind: GroupVersionKind
    subResource: str = ""
    operation: Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]
    namespace: str = ""
    name: str = ""
    object: dict[str, Any] | None = None
    oldObject: dict[str, Any] | None = None
    dryRun: bool = False
    userInfo: UserInfo = UserInfo()


class AdmissionReview(_Wire):
    """The request body the API server POSTs."""

    apiVersion: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


def review_response(
    uid: str,
    allowed: bool,
    *,
    message: str | None = None,
    warnings: Sequence[str] = (),
    audit_annotations: Mapping[str, str] | None = None,
    patch: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The AdmissionReview to answer with; a denial carries ``status`` with code 403 and the message,
    a mutation its JSON Patch (base64 of the JSON, as the wire wants it)."""
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(patch), separators=(",", ":")).encode()).decode()
    if not allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": message or "denied by vramguard"}
    if warnings:
        response["warnings"] = list(warnings)
    if audit_annotations:
        response["auditAnnotations"] = dict(audit_annotations)
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}

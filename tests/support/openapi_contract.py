"""Checks HTTP exchanges and pydantic models against the OpenAPI document at the repo root.

`Contract.check_response` looks up what the document says about a request (its operation, or
the answers for an unknown path or method) and fails with a readable message when the status,
a required header, the media type or the JSON body is not what the document promises. It
records each (operationId, status) it saw, so a test can tell which documented answers it never
produced. `schema_shape` reduces a JSON schema to what a client can observe, so the document's
schemas can be compared with the ones pydantic derives from the models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aiohttp.test_utils import TestClient
from openapi_schema_validator import OAS31Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).resolve().parents[2] / "openapi.yaml"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# What the document answers for a path it does not list.
NO_ROUTE_OPERATION = "<no route>"
_NO_ROUTE_RESPONSE = "/components/responses/RouteNotFound"
_BODY_EXCERPT_CHARS = 500


def load_spec() -> dict[str, Any]:
    with SPEC_PATH.open(encoding="utf-8") as spec_file:
        spec: dict[str, Any] = yaml.safe_load(spec_file)
    return spec


def _escape(token: str) -> str:
    """One JSON pointer token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _at(document: Any, pointer: str) -> Any:
    node = document
    for token in pointer.lstrip("/").split("/") if pointer else []:
        node = node[int(token)] if isinstance(node, list) else node[_unescape(token)]
    return node


def _deref(document: Any, pointer: str) -> tuple[str, Any]:
    """Follow local `$ref`s from `pointer`; the pointer and the node they end at."""
    node = _at(document, pointer)
    while isinstance(node, Mapping) and "$ref" in node:
        reference = node["$ref"]
        assert reference.startswith("#/"), f"only local references are supported: {reference}"
        pointer = reference[1:]
        node = _at(document, pointer)
    return pointer, node


@dataclass(frozen=True)
class Operation:
    operation_id: str
    method: str
    path: str
    pointer: str


class Contract:
    """The document, with lookups by operation and by concrete request."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._base_uri = SPEC_PATH.as_uri()
        resource = Resource.from_contents(spec, default_specification=DRAFT202012)
        self._registry: Registry[Any] = Registry().with_resource(self._base_uri, resource)
        self.operations: dict[str, Operation] = {}
        self._path_patterns: list[tuple[re.Pattern[str], str]] = []
        for path, path_item in spec["paths"].items():
            segments = re.split(r"(\{[^}]+\})", path)
            regex = "".join(
                "[^/]+" if segment.startswith("{") else re.escape(segment) for segment in segments
            )
            self._path_patterns.append((re.compile(f"^{regex}$"), path))
            for method in HTTP_METHODS:
                if method in path_item:
                    operation_id = path_item[method]["operationId"]
                    assert operation_id not in self.operations, f"{operation_id} is used twice"
                    self.operations[operation_id] = Operation(
                        operation_id,
                        method.upper(),
                        path,
                        f"/paths/{_escape(path)}/{method}",
                    )
        self.exercised: set[tuple[str, str]] = set()

    @classmethod
    def load(cls) -> Contract:
        return cls(load_spec())

    def documented_statuses(self) -> set[tuple[str, str]]:
        return {
            (operation.operation_id, status)
            for operation in self.operations.values()
            for status in _at(self.spec, operation.pointer)["responses"]
        }

    def schema_errors(self, pointer: str, instance: Any) -> list[str]:
        """Why `instance` does not validate against the schema at `pointer` (empty if it does)."""
        validator = OAS31Validator({"$ref": f"{self._base_uri}#{pointer}"}, registry=self._registry)
        return [
            f"{'/'.join(str(part) for part in error.absolute_path) or '<body>'}: {error.message}"
            for error in validator.iter_errors(instance)
        ]

    def request_errors(self, operation_id: str, body: Any) -> list[str]:
        """Why the JSON request body `body` does not match the operation's documented body."""
        operation = self.operations[operation_id]
        pointer, _ = _deref(self.spec, f"{operation.pointer}/requestBody")
        return self.schema_errors(f"{pointer}/content/application~1json/schema", body)

    def find_path(self, path: str) -> str | None:
        """The document's path template that `path` (its query string aside) falls under."""
        path = path.partition("?")[0]
        matches = [template for pattern, template in self._path_patterns if pattern.match(path)]
        assert len(matches) <= 1, f"{path} matches several documented paths: {matches}"
        return matches[0] if matches else None

    def check_response(
        self,
        method: str,
        path: str,
        status: int,
        headers: Mapping[str, str],
        body: bytes | None,
    ) -> Any:
        """Fail unless the document promises this answer to `method path`; return the JSON body.

        `body` is None when the connection switched protocols and there is no HTTP body to read.
        """
        where = f"{method} {path} answered {status}"
        template = self.find_path(path)
        if template is None:
            assert status == 404, f"{where}; openapi.yaml lists no such path, so expected 404"
            self.exercised.add((NO_ROUTE_OPERATION, "404"))
            return self._check_response_object(_NO_ROUTE_RESPONSE, where, headers, body)
        path_item = self.spec["paths"][template]
        operations = [
            self.operations[path_item[name]["operationId"]]
            for name in HTTP_METHODS
            if name in path_item
        ]
        operation = next((op for op in operations if op.method == method), None)
        if operation is None:
            # No operation to hold it: every operation of the path documents the 405.
            assert status == 405, f"{where}; openapi.yaml has no {method} {template}: expected 405"
            for other in operations:
                responses = _at(self.spec, other.pointer)["responses"]
                assert "405" in responses, f"{where}; {other.operation_id} documents no 405"
                self.exercised.add((other.operation_id, "405"))
            return self._check_response_object(
                f"{operations[0].pointer}/responses/405", where, headers, body
            )
        responses = _at(self.spec, operation.pointer)["responses"]
        assert str(status) in responses, (
            f"{where}, which openapi.yaml does not document for {operation.operation_id}"
            f" (documented: {', '.join(responses)}). Body: {_excerpt(body)}"
        )
        self.exercised.add((operation.operation_id, str(status)))
        return self._check_response_object(
            f"{operation.pointer}/responses/{status}",
            f"{where} ({operation.operation_id})",
            headers,
            body,
        )

    def _check_response_object(
        self, pointer: str, where: str, headers: Mapping[str, str], body: bytes | None
    ) -> Any:
        pointer, response = _deref(self.spec, pointer)
        for name, header in response.get("headers", {}).items():
            _, header = _deref(self.spec, f"{pointer}/headers/{_escape(name)}")
            if header.get("required"):
                assert name in headers, f"{where} without the documented header {name}"
        content = response.get("content")
        if not content:
            assert not body, f"{where} with a body, but the document gives none: {_excerpt(body)}"
            return None
        assert body is not None, f"{where}: the document gives a body, but there is none"
        media_type = headers.get("Content-Type", "").split(";")[0].strip().lower()
        assert media_type in content, (
            f"{where} with Content-Type {media_type!r}; documented: {', '.join(content)}"
        )
        if media_type in _TEXT_MEDIA_TYPES:
            # A text body is a string by the document; it must at least be text.
            return body.decode("utf-8", errors="strict")
        if media_type == "application/x-ndjson":  # each line is one JSON document
            schema_pointer = f"{pointer}/content/{_escape(media_type)}/schema"
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            for line in lines:
                errors = self.schema_errors(schema_pointer, line)
                assert not errors, f"{where}: a line does not match the document: {errors}"
            return lines
        assert media_type == "application/json", f"cannot check a {media_type} body"
        try:
            data = json.loads(body)
        except ValueError as error:
            raise AssertionError(
                f"{where} with a body that is not JSON: {_excerpt(body)}"
            ) from error
        schema_pointer = f"{pointer}/content/{_escape(media_type)}/schema"
        errors = self.schema_errors(schema_pointer, data)
        assert not errors, (
            f"{where} with a body that does not match openapi.yaml#{schema_pointer}:\n  "
            + "\n  ".join(errors)
            + f"\nBody: {_excerpt(body)}"
        )
        return data


_TEXT_MEDIA_TYPES = frozenset(
    {
        "text/plain",
        "text/event-stream",
        "application/yaml",
        "text/html",
        "text/javascript",
        "text/css",
    }
)


def _excerpt(body: bytes | None) -> str:
    if body is None:
        return "<none>"
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= _BODY_EXCERPT_CHARS else text[:_BODY_EXCERPT_CHARS] + "..."


# Keywords that do not change which JSON values a schema accepts.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "example", "examples", "deprecated", "$defs"}
)
# `not` carries the checks a pydantic AfterValidator makes, which pydantic's schema cannot show.
_VALIDATOR_ONLY = frozenset({"not"})
_NUMBER_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum"}
)
_KEYWORDS_BY_TYPE: dict[str, frozenset[str]] = {
    "string": frozenset({"pattern", "minLength", "maxLength", "format", "enum"}),
    "number": _NUMBER_KEYWORDS,
    "integer": _NUMBER_KEYWORDS,
    "boolean": frozenset({"enum"}),
    "null": frozenset(),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
}


def schema_shape(
    schema: Mapping[str, Any], document: Any, *, all_required: bool = False
) -> list[dict[str, Any]]:
    """The alternatives a schema accepts, one dict per JSON type, sorted; local `$ref`s resolved.

    `type: [string, "null"]` and `anyOf: [{type: string}, {type: "null"}]` give the same shape;
    so do `const: x` and `enum: [x]`. With `all_required`, every property of every object is
    required (a response model always serializes every field, defaults included).
    """
    if "$ref" in schema:
        reference = schema["$ref"]
        assert reference.startswith("#/"), f"only local references are supported: {reference}"
        return schema_shape(_at(document, reference[1:]), document, all_required=all_required)
    unknown = set(schema) - _ANNOTATIONS - _VALIDATOR_ONLY - {"type", "anyOf", "const"}
    unknown -= set().union(*_KEYWORDS_BY_TYPE.values())
    assert not unknown, f"schema_shape does not know the keywords {sorted(unknown)} in {schema}"
    if "anyOf" in schema:
        branches = [
            branch
            for alternative in schema["anyOf"]
            for branch in schema_shape(alternative, document, all_required=all_required)
        ]
        return sorted(branches, key=lambda branch: json.dumps(branch, sort_keys=True))
    types = schema.get("type")
    assert types is not None, f"a schema without a type: {schema}"
    branches = []
    for type_name in [types] if isinstance(types, str) else types:
        branch: dict[str, Any] = {"type": type_name}
        for keyword in _KEYWORDS_BY_TYPE[type_name] & set(schema):
            branch[keyword] = schema[keyword]
        if "const" in schema and type_name != "null":
            branch["enum"] = [schema["const"]]
        if type_name == "object":
            properties = {
                name: schema_shape(subschema, document, all_required=all_required)
                for name, subschema in schema.get("properties", {}).items()
            }
            extra = schema.get("additionalProperties", True)
            if isinstance(extra, Mapping):
                extra = schema_shape(extra, document, all_required=all_required)
            required = sorted(properties if all_required else schema.get("required", []))
            branch.update(properties=properties, required=required, additionalProperties=extra)
        if type_name == "array" and "items" in schema:
            branch["items"] = schema_shape(schema["items"], document, all_required=all_required)
        branches.append(branch)
    return sorted(branches, key=lambda branch: json.dumps(branch, sort_keys=True))


def shape_differences(documented: Any, expected: Any, where: str = "") -> list[str]:
    """Where two shapes differ, one line each: the path inside the shape and both values."""
    if isinstance(documented, dict) and isinstance(expected, dict):
        return [
            difference
            for key in sorted(set(documented) | set(expected))
            for difference in shape_differences(
                documented.get(key, "<missing>"), expected.get(key, "<missing>"), f"{where}.{key}"
            )
        ]
    if (
        isinstance(documented, list)
        and isinstance(expected, list)
        and len(documented) == len(expected)
        and all(isinstance(item, dict) for item in documented + expected)
    ):
        return [
            difference
            for index, (left, right) in enumerate(zip(documented, expected, strict=True))
            for difference in shape_differences(left, right, f"{where}[{index}]")
        ]
    if documented == expected:
        return []
    return [
        f"{where or '<schema>'}: document {json.dumps(documented)}, model {json.dumps(expected)}"
    ]


class Exchange:
    """Sends requests and checks every answer against the document."""

    def __init__(self, client: TestClient[Any, Any], contract: Contract) -> None:
        self.client = client
        self.contract = contract

    async def call(self, method: str, path: str, *, expect: int, **request: Any) -> Any:
        """Send the request; check the answer against the document and `expect`; its JSON."""
        async with self.client.request(method, path, **request) as response:
            # A 101 switched to the websocket protocol: there is no HTTP body to read.
            body = None if response.status == 101 else await response.read()
            data = self.contract.check_response(
                method, path, response.status, response.headers, body
            )
        assert response.status == expect, f"{method} {path}: {response.status}: {body!r}"
        return data

    async def call_stream(self, path: str, *, lines: int, **request: Any) -> Any:
        """GET an endless stream, check its first `lines` lines against the document."""
        async with self.client.get(path, **request) as response:
            body = b"".join([await response.content.readline() for _ in range(lines)])
            assert response.status == 200, f"GET {path}: {response.status}: {body!r}"
            return self.contract.check_response(
                "GET", path, response.status, response.headers, body
            )

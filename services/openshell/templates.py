"""The template RPCs of the 0.1 protocol: Create/Get/List/DeleteSandboxTemplate, over the
template store the HTTP API writes (services/common/templates.py), and what a CreateSandbox
naming ``workload_template`` resolves to.

Only the 0.1 generation has them (0.0 answers UNIMPLEMENTED for these paths: its schema has no
such methods), so requests are read and answered with the 0.1.5 schema. A template's
``metadata.labels`` are its sandboxes' labels (and what ``label_selector`` matches); its
``resource_version`` is the revision. A workload names an image (none: the gateway's default
image), environment variables and resources (``cpu`` as cores or millicores, ``memory`` in
bytes or with a binary or decimal suffix); GPUs, annotations, a driver config and a service
level are INVALID_ARGUMENT (sandstream has none). Scopes: sandbox:read to read, sandbox:write
to write, as over HTTP.
"""

from __future__ import annotations

import re
from decimal import Decimal, DecimalException
from typing import Final, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from pydantic import ValidationError

from events.common import SANDBOX_NAME_PATTERN, SandboxResources, SandboxSpec
from events.publisher import now
from services.common import templates
from services.common.templates import TemplateBody, TemplateInfo
from services.common.tokens import READ, WRITE
from services.openshell import mapping
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os_0_1
from services.openshell.service import Context, Door, abort

TEMPLATE_METHODS: Final = (
    "CreateSandboxTemplate",
    "GetSandboxTemplate",
    "ListSandboxTemplates",
    "DeleteSandboxTemplate",
)
DEFAULT_PAGE, MAX_PAGE = 100, 500
M = TypeVar("M", bound=Message)
# At most 30 digits each side of the point: far beyond any machine, and within what Decimal's
# context takes (a megabyte of digits overflowed it: INTERNAL).
_QUANTITY = re.compile(r"^([0-9]{1,30}(?:\.[0-9]{1,30})?)([A-Za-z]{0,2})$")
_MEMORY_UNITS: Final = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}  # fmt: skip
_MIB = 2**20


def cpu_millicores(text: str) -> int:
    """``500m``, ``0.5`` or ``2`` as millicores; InvalidRequest otherwise."""
    found = _QUANTITY.match(text.strip())
    if found is None or found.group(2) not in ("", "m"):
        raise mapping.InvalidRequest(f"spec.workload.resources.cpu: {text!r} is no CPU quantity")
    try:
        value = Decimal(found.group(1))
        return int(value if found.group(2) == "m" else value * 1000)
    except DecimalException:
        raise mapping.InvalidRequest(f"spec.workload.resources.cpu: {text!r}") from None


def memory_mib(text: str) -> int:
    """``256Mi``, ``1Gi``, ``512M`` or bytes as MiB (rounded up); InvalidRequest otherwise."""
    found = _QUANTITY.match(text.strip())
    if found is None or found.group(2) not in _MEMORY_UNITS:
        raise mapping.InvalidRequest(
            f"spec.workload.resources.memory: {text!r} is no memory quantity"
        )
    try:
        total = Decimal(found.group(1)) * _MEMORY_UNITS[found.group(2)]
    except DecimalException:
        raise mapping.InvalidRequest(f"spec.workload.resources.memory: {text!r}") from None
    return int(-(-total // _MIB))


def template_body(message: os_0_1.SandboxWorkloadTemplate, default_image: str) -> TemplateBody:
    """The stored template an OpenShell template asks for; InvalidRequest naming the field."""
    meta, spec = message.metadata, message.spec
    workload = spec.workload
    unsupported = [
        ("template.metadata.annotations", bool(meta.annotations)),
        ("template.spec.driver_config", spec.HasField("driver_config")),
        ("template.spec.desired_service_level", spec.HasField("desired_service_level")),
        ("template.spec.workload.resources.gpu", workload.resources.HasField("gpu")),
    ]
    for field, given in unsupported:
        if given:
            raise mapping.InvalidRequest(f"{field}: not supported by sandstream")
    resources = workload.resources
    try:
        limits = SandboxResources(
            cpu_millicores=cpu_millicores(resources.cpu) if resources.cpu else None,
            memory_mib=memory_mib(resources.memory) if resources.memory else None,
        )
        checked = SandboxSpec(
            image=workload.image or default_image,
            command=list(mapping.DEFAULT_COMMAND),
            env=dict(workload.environment),
            labels=dict(meta.labels),
            resources=limits if limits.cpu_millicores or limits.memory_mib else None,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise mapping.InvalidRequest(f"template ({where}): {first['msg']}") from None
    return TemplateBody(spec=checked)


def template_message(info: TemplateInfo) -> os_0_1.SandboxWorkloadTemplate:
    spec = info.body.spec
    message = os_0_1.SandboxWorkloadTemplate()
    meta = message.metadata
    meta.id, meta.name, meta.workspace = f"template:{info.name}", info.name, "default"
    meta.resource_version = info.revision
    meta.created_time.FromDatetime(info.created_at)
    meta.labels.update(spec.labels)
    workload = message.spec.workload
    workload.image = spec.image
    workload.environment.update(spec.env)
    if spec.resources is not None and spec.resources.cpu_millicores:
        workload.resources.cpu = f"{spec.resources.cpu_millicores}m"
    if spec.resources is not None and spec.resources.memory_mib:
        workload.resources.memory = f"{spec.resources.memory_mib}Mi"
    return message


class TemplateRpcs:
    def __init__(self, door: Door) -> None:
        self.door = door

    async def _read(self, raw: bytes, kind: type[M], context: Context) -> M:
        try:
            return kind.FromString(raw)
        except DecodeError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"not a {kind.__name__}: {exc}")

    async def _name(self, name: str, workspace: str | None, context: Context) -> None:
        if workspace not in (None, "", mapping.DEFAULT_WORKSPACE):
            await abort(context, grpc.StatusCode.NOT_FOUND, f"workspace {workspace!r} not found")
        if not re.fullmatch(SANDBOX_NAME_PATTERN, name):
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"name: {name[:300]!r} is no DNS label"
            )

    async def CreateSandboxTemplate(
        self, raw: bytes, context: Context
    ) -> os_0_1.SandboxTemplateResponse:
        principal = await self.door.authorize(context, WRITE)
        request = await self._read(raw, os_0_1.CreateSandboxTemplateRequest, context)
        name = request.template.metadata.name
        await self._name(name, mapping.selected_workspace(request.workspace_scope), context)
        try:
            body = template_body(request.template, self.door.default_image)
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        async with self.door.pool.acquire() as conn:
            try:
                info = await templates.create_template(conn, name, body, principal.name, now())
            except templates.TemplateExists as exc:
                await abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        return os_0_1.SandboxTemplateResponse(template=template_message(info))

    async def GetSandboxTemplate(
        self, raw: bytes, context: Context
    ) -> os_0_1.SandboxTemplateResponse:
        await self.door.authorize(context, READ)
        request = await self._read(raw, os_0_1.GetSandboxTemplateRequest, context)
        workspace = mapping.selected_workspace(request.workspace_scope)
        await self._name(request.name, workspace, context)
        async with self.door.pool.acquire() as conn:
            info = await templates.get_template(conn, request.name)
        if info is None:
            await abort(
                context, grpc.StatusCode.NOT_FOUND, str(templates.TemplateMissing(request.name))
            )
        return os_0_1.SandboxTemplateResponse(template=template_message(info))

    async def ListSandboxTemplates(
        self, raw: bytes, context: Context
    ) -> os_0_1.ListSandboxTemplatesResponse:
        """A page by name (``page_token``: the last name of the page before); the label
        selector matches the templates' labels."""
        await self.door.authorize(context, READ)
        request = await self._read(raw, os_0_1.ListSandboxTemplatesRequest, context)
        if request.page_size < 0:  # as ListSandboxes
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "page_size: negative")
        if mapping.selected_workspace(request.workspace_scope) not in (
            None, "", mapping.DEFAULT_WORKSPACE,
        ):  # fmt: skip
            return os_0_1.ListSandboxTemplatesResponse()
        try:
            wanted = [f.partition("=")[::2] for f in mapping.label_filters(request.label_selector)]
        except mapping.InvalidRequest as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        async with self.door.pool.acquire() as conn:
            found = await templates.list_templates(conn)
        matching = [
            i for i in found
            if i.name > request.page_token
            and all(i.body.spec.labels.get(k) == v for k, v in wanted)
        ]  # fmt: skip
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        items = matching[:size]
        return os_0_1.ListSandboxTemplatesResponse(
            templates=[template_message(i) for i in items],
            next_page_token=items[-1].name if len(matching) > size else "",
        )

    async def DeleteSandboxTemplate(
        self, raw: bytes, context: Context
    ) -> os_0_1.DeleteSandboxTemplateResponse:
        await self.door.authorize(context, WRITE)
        request = await self._read(raw, os_0_1.DeleteSandboxTemplateRequest, context)
        workspace = mapping.selected_workspace(request.workspace_scope)
        await self._name(request.name, workspace, context)
        async with self.door.pool.acquire() as conn:
            try:
                await templates.delete_template(conn, request.name)
            except templates.TemplateMissing as exc:
                if not request.allow_missing:
                    await abort(context, grpc.StatusCode.NOT_FOUND, str(exc))
                return os_0_1.DeleteSandboxTemplateResponse(
                    outcome=os_0_1.DELETION_OUTCOME_ALREADY_ABSENT
                )
        return os_0_1.DeleteSandboxTemplateResponse(outcome=os_0_1.DELETION_OUTCOME_COMPLETED)

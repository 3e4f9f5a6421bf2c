"""Suspend that keeps memory on Podman: a CRIU checkpoint of the generation's container, kept
beside the workspace volume, restored as the next generation's container on resume.

The checkpoint is libpod's exported archive (``POST /containers/{id}/checkpoint?export``,
without the volumes: the workspace stays in its volume), one file per incarnation in the
driver's checkpoint directory. A resume's launch restores it (``POST /containers/restore
?import``) under the new generation's name, its labels rewritten to that generation, when the
container would be created from the same arguments (the ``LABEL_SPEC_HASH`` label) and no
provider values are mounted (a restored process would keep the old ones in its memory);
its generation and identity labels and its exec environment are the new generation's;
otherwise, or when the restore fails, the launch creates a fresh container on the kept
workspace. Either way the archive is used once and removed, and the launch says which
(``LaunchResult.note``).

CRIU refuses ``mntns-compat-mode`` on a dump, and needs it to restore the init's bind mount
(catatonit, a file mounted on the ``/run`` tmpfs). So a restored container names a CRIU
config file of its own (``org.criu.config``) that holds the option only while its restore
runs, and is empty for any later checkpoint. Podman reads these files on its own host: the
checkpoint directory must be on the machine of the Podman service (docs/drivers.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from uuid import UUID

from drivers.podman_objects import volume_name
from drivers.protocol import IDENTITY_ENV, LABEL_GENERATION, LABEL_IDENTITY

LABEL_SPEC_HASH = "io.sandstream.spec-hash"
CRIU_CONFIG_ANNOTATION = "org.criu.config"
RESTORE_OPTIONS = "mntns-compat-mode\n"
# Options of both calls: a connection or a lock the agent holds comes back with it.
CRIU_PARAMS = {"tcpEstablished": "true", "fileLocks": "true", "ignoreVolumes": "true"}
CHUNK = 1 << 20


def spec_hash(args: dict[str, Any]) -> str:
    """What a restore must match: the create arguments but what each generation has of its own
    (name, generation, identity)."""
    own = (LABEL_GENERATION, LABEL_IDENTITY, LABEL_SPEC_HASH)
    labels = {k: v for k, v in args.get("labels", {}).items() if k not in own}
    env = {k: v for k, v in args.get("environment", {}).items() if k != IDENTITY_ENV}
    rest = {k: v for k, v in args.items() if k not in ("name", "labels", "environment")}
    text = json.dumps({"labels": labels, "environment": env, **rest}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Checkpoints:
    """The driver's checkpoint directory: an archive and its facts per incarnation, and the
    CRIU config file of each restored container."""

    root: Path

    def archive(self, key: str, sandbox_id: UUID) -> Path:
        return self.root / f"{volume_name(key, sandbox_id)}.tar"

    def facts(self, key: str, sandbox_id: UUID) -> Path:
        return self.root / f"{volume_name(key, sandbox_id)}.json"

    def criu_config(self, container: str) -> Path:
        return self.root / f"{container}.criu.conf"

    def save(self, key: str, sandbox_id: UUID, chunks: Any, facts: dict[str, str]) -> int:
        """Write the streamed archive, then its facts (a partial archive has none: unused).
        The directory and the archives are the owner's only: they hold the agents' memory."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = self.archive(key, sandbox_id)
        partial = target.with_suffix(".partial")
        size = 0
        try:
            with private(partial) as out:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
        except BaseException:  # a full disk, a broken stream: no part of the memory stays
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise
        partial.replace(target)
        self.facts(key, sandbox_id).write_text(json.dumps(facts))
        return size

    def load(self, key: str, sandbox_id: UUID) -> dict[str, str] | None:
        """The facts of a complete checkpoint of the incarnation, or None."""
        facts, archive = self.facts(key, sandbox_id), self.archive(key, sandbox_id)
        if not (facts.exists() and archive.exists()):
            return None
        try:
            found: dict[str, str] = json.loads(facts.read_text())
        except ValueError:
            return None
        return found

    def held(self) -> list[tuple[str, UUID]]:
        """The incarnations with a checkpoint here."""
        found = []
        for facts in sorted(self.root.glob("*.json")) if self.root.exists() else []:
            with contextlib.suppress(ValueError, KeyError, OSError):
                data = json.loads(facts.read_text())
                found.append((str(data["key"]), UUID(data["sandbox_id"])))
        return found

    def remove(self, key: str, sandbox_id: UUID | None = None) -> bool:
        """Remove the checkpoints of ``key`` (of one incarnation); True if there were any."""
        ids = [s for k, s in self.held() if k == key and sandbox_id in (None, s)]
        if sandbox_id is not None and sandbox_id not in ids:
            ids.append(sandbox_id)  # an archive whose facts were never written
        removed = False
        for incarnation in ids:
            for path in (self.facts(key, incarnation), self.archive(key, incarnation)):
                if path.exists():
                    path.unlink(missing_ok=True)
                    removed = True
        return removed

    def remove_config(self, container: str) -> None:
        # Never in the way of the removal it follows (a directory gone or unusable).
        with contextlib.suppress(OSError):
            self.criu_config(container).unlink(missing_ok=True)


@dataclass(frozen=True)
class Rewrite:
    """What the restored container gets of the new generation's own."""

    generation: int
    identity: str
    criu_config: str

    def container(self, config: dict[str, Any]) -> None:
        """config.dump: the labels, and the spec it embeds."""
        labels = config.setdefault("labels", {})
        labels[LABEL_GENERATION] = str(self.generation)
        labels[LABEL_IDENTITY] = self.identity
        self.spec(config.setdefault("spec", {}))

    def spec(self, spec: dict[str, Any]) -> None:
        """spec.dump (OCI): the CRIU config annotation, and the identity for new processes
        (an exec); the restored ones keep what their memory holds."""
        spec.setdefault("annotations", {})[CRIU_CONFIG_ANNOTATION] = self.criu_config
        process = spec.setdefault("process", {})
        env = [e for e in process.get("env") or [] if not e.startswith(f"{IDENTITY_ENV}=")]
        process["env"] = [*env, f"{IDENTITY_ENV}={self.identity}"]


def rewrite_archive(source: IO[bytes], out: IO[bytes], rewrite: Rewrite) -> None:
    """Copy the exported archive with config.dump and spec.dump rewritten for the new
    generation."""
    with (
        tarfile.open(fileobj=source, mode="r|") as src,
        tarfile.open(fileobj=out, mode="w|") as dst,
    ):
        for member in src:
            data = src.extractfile(member) if member.isfile() else None
            if member.name in ("config.dump", "spec.dump") and data is not None:
                document = json.load(data)
                if member.name == "config.dump":
                    rewrite.container(document)
                else:
                    rewrite.spec(document)
                body = json.dumps(document).encode()
                member.size = len(body)
                dst.addfile(member, io.BytesIO(body))
            else:
                dst.addfile(member, data)


def copy_rewritten(archive: Path, target: Path, rewrite: Rewrite) -> None:
    with archive.open("rb") as source, private(target) as out:
        rewrite_archive(source, out, rewrite)


def private(path: Path) -> IO[bytes]:
    """``path`` opened for writing, created with mode 0600 (truncated if it exists)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")

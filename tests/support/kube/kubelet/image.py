"""The shoal image as the process kubelet runs it: the Dockerfile's final stage (ENTRYPOINT, CMD,
ENV, WORKDIR), with the image's paths mapped to this checkout and its virtual environment.

Every container image is taken to be the shoal image: a container without `command` runs its
ENTRYPOINT (`/opt/venv/bin/python /opt/shoal/image/entrypoint.py`, here
`<venv>/bin/python <checkout>/image/entrypoint.py`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.kube.binaries import REPO

DOCKERFILE = REPO / "Dockerfile"
# PATH of the base images (Docker's default)
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_PYTHON = re.compile(r"python(3(\.\d+)?)?")
_ENV_REF = re.compile(r"\$(\w+)|\$\{(\w+)\}")


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    workdir: str


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")))
    found: list[tuple[str, str]] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            found = []
        found.append((keyword.upper(), rest.strip()))
    return found


def _exec_form(arguments: str) -> tuple[str, ...]:
    if arguments.startswith("["):
        return tuple(json.loads(arguments))
    return ("/bin/sh", "-c", arguments)


def _env_pairs(arguments: str, env: dict[str, str]) -> dict[str, str]:
    words = shlex.split(arguments)
    if "=" not in words[0]:  # legacy form: ENV KEY value with spaces
        return {words[0]: " ".join(words[1:])}
    def expand(value: str) -> str:
        return _ENV_REF.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)
    return {key: expand(value) for key, _, value in (w.partition("=") for w in words)}


def parse_dockerfile(text: str) -> ImageConfig:
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env = {"PATH": BASE_PATH}
    workdir = "/"
    for keyword, arguments in _instructions(text):
        if keyword == "ENTRYPOINT":
            entrypoint, cmd = _exec_form(arguments), ()
        elif keyword == "CMD":
            cmd = _exec_form(arguments)
        elif keyword == "ENV":
            env.update(_env_pairs(arguments, env))
        elif keyword == "WORKDIR":
            workdir = arguments
    return ImageConfig(entrypoint=entrypoint, cmd=cmd, env=env, workdir=workdir)


@dataclass(frozen=True)
class HostPaths:
    """Image path prefix → where it is on this machine, most specific first."""
    mapping: tuple[tuple[str, str], ...]

    @classmethod
    def of_this_checkout(cls) -> HostPaths:
        cache = os.environ.get("SHOAL_CACHE_DIR", str(Path.home() / ".cache" / "shoal"))
        return cls(mapping=(("/opt/venv", sys.prefix), ("/opt/shoal/image", str(REPO / "image")),
                            ("/opt/shoal", cache)))

    def path(self, value: str) -> str:
        for prefix, host in self.mapping:
            if value == prefix or value.startswith(prefix + "/"):
                return host + value[len(prefix):]
        return value

    def env_value(self, value: str) -> str:
        """Absolute paths and PATH-like lists of them."""
        if not value.startswith("/"):
            return value
        return ":".join(self.path(part) for part in value.split(":"))

    def command(self, argv: list[str]) -> list[str]:
        """`python`/`python3` become the venv's python; image paths become host paths."""
        if not argv:
            return argv
        first = argv[0]
        if _PYTHON.fullmatch(os.path.basename(first)) and (
                "/" not in first or os.path.dirname(first) in ("/usr/bin", "/usr/local/bin")):
            first = sys.executable
        return [self.path(first), *(self.path(arg) for arg in argv[1:])]


def shoal_image() -> ImageConfig:
    return parse_dockerfile(DOCKERFILE.read_text())

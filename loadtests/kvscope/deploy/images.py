"""Image facts for the Ansible build play: build arguments from docker/versions.yaml and a content tag.

The tag hashes the image's pinned versions, its Dockerfile and everything it copies in, so a rebuild is
skipped only when none of them changed (community.docker's docker_image_build checks existence only).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml

from kvscope import REPO

CONTEXT = {"gb10": ["docker/gb10/Dockerfile", "docker/verify_image.py", "connector"],
           "gb10-pypi": ["docker/gb10-pypi/Dockerfile", "docker/verify_image.py", "connector"],
           "cpu": ["docker/cpu/Dockerfile", "docker/cpu/constraints.txt", "connector", "loadtests"]}
BASE_ARG = {"cpu": "PYTHON_IMAGE", "gb10-pypi": "BASE_IMAGE"}  # images on a base made by docker/base/build.sh
_ARG = re.compile(r"^ARG\s+([A-Z0-9_]+)=(.*)$", re.M)


def versions(image: str, repo: Path = REPO) -> dict[str, str]:
    doc = yaml.safe_load((repo / "docker" / "versions.yaml").read_text())
    if image not in doc:
        raise ValueError(f"docker/versions.yaml has no image '{image}'; it has {sorted(doc)}")
    return {k: str(v) for k, v in doc[image].items()}


def dockerfile_args(image: str, repo: Path = REPO) -> dict[str, str]:
    """ARG defaults of the image's Dockerfile (the last definition of a name wins, as in a final stage)."""
    text = (repo / "docker" / image / "Dockerfile").read_text()
    return {name: value.strip().strip('"') for name, value in _ARG.findall(text)}


def _files(repo: Path, entry: str):
    path = repo / entry
    if path.is_file():
        yield path
    else:
        yield from (p for p in sorted(path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                    and not p.name.endswith(".pyc") and ".egg-info" not in str(p))


def content_tag(image: str, repo: Path = REPO, pinned: dict[str, str] | None = None) -> str:
    digest = hashlib.sha256(yaml.safe_dump(pinned or versions(image, repo), sort_keys=True).encode())
    for entry in CONTEXT[image]:
        for path in _files(repo, entry):
            digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes())
    return f"{versions(image, repo).get('KVSCOPE_CONNECTOR_VERSION', '0')}-{digest.hexdigest()[:12]}"


def info(image: str, repo: Path = REPO, base: str | None = None) -> dict:
    """Build facts; `base`: the image's base as docker/base/build.sh built it (a content-tagged name), part of
    the tag."""
    pinned = versions(image, repo)
    if base:
        if image not in BASE_ARG:
            raise ValueError(f"--base applies to {sorted(BASE_ARG)} (gb10 picks its base with image_gb10_base)")
        pinned[BASE_ARG[image]] = base
    return {"image": image, "tag": content_tag(image, repo, pinned), "build_args": pinned,
            "labels": {f"org.kvscope.pin.{k.lower()}": v for k, v in pinned.items()}}

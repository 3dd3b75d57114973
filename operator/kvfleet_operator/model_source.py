"""Pure: model URIs -> what to download, from where, into which folder, and the path kvfleet-server loads.

URIs (``spec.model.uri``, ``spec.engine.speculative.draftModel``, ``spec.model.tokenizer``,
``spec.adapters[].uri``):

- ``hf://ORG/REPO[@REVISION]`` — a Hugging Face repository (safetensors); REVISION a branch, tag or
  commit (default ``main``), ``refs/pr/N`` included;
- ``hf://ORG/REPO[@REVISION]/PATH/FILE.gguf`` — one GGUF file of a repository (REVISION is then one
  path segment or ``refs/pr/N``);
- ``s3://BUCKET[/PREFIX]`` — the files under PREFIX in an S3 or S3-compatible bucket; a PREFIX ending
  in ``.gguf`` names one GGUF object;
- ``pvc://CLAIM[/PATH]`` (mounted read-only), ``file:///PATH`` (inside the serving image),
  ``bundled://smollm2`` (the GGUF of the CPU image).

hf:// and s3:// sources are *downloaded*: the operator pins them (``Pin``: a commit, or the digest
of the objects' ETags — ``kvfleet_operator.resolve``) and every download fetches exactly that pin
into ``cache_dir(source, revision)`` = ``/models/hf/ORG/REPO/REVISION`` or
``/models/s3/BUCKET/PREFIX/REVISION`` of the model cache volume. ``downloader_args`` is the
``kvfleet-download`` command line of one source (``kvfleet_server.download``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MODEL_ROOT = "/models"
URI_FORMS = ("hf://ORG/REPO[@REVISION][/PATH/FILE.gguf], s3://BUCKET[/PREFIX], pvc://CLAIM[/PATH], "
             "file:///PATH or bundled://smollm2")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HF = re.compile(rf"^hf://(?P<repo>{_NAME}/{_NAME})(@(?P<rev>refs/pr/[0-9]+|[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*?))?"
                 rf"(/(?P<file>[^\s@]+\.gguf))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(?P<prefix>[^\s]*))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(/(?P<path>[^\s]*))?$")
_FILE = re.compile(r"^file://(?P<path>/[^\s]+)$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Source:
    """One model location. ``store``: hf, s3, pvc, file or bundled. ``name``: ORG/REPO, the bucket or
    the claim. ``ref``: the revision asked for (hf; default main). ``prefix``: the s3 folder.
    ``file``: one .gguf file, relative to the repository root or the prefix. ``role``: model (weights,
    config, tokenizer) or tokenizer (its files only). ``field``: the spec field it came from."""
    uri: str
    field: str
    store: str
    name: str
    ref: str | None = None
    prefix: str = ""
    file: str | None = None
    role: str = "model"

    @property
    def downloaded(self) -> bool:
        """Fetched into the model cache (hf, s3) rather than mounted or built in."""
        return self.store in ("hf", "s3")


@dataclass(frozen=True)
class Pin:
    """What a download fetches: ``revision``, the commit of an hf repository or the digest of the
    ETags of every object under an s3 prefix (``kvfleet_server.model_files.s3_revision``)."""
    revision: str


ADAPTER_FORMS = "hf://ORG/REPO[@REVISION], s3://BUCKET[/PREFIX], pvc://CLAIM[/PATH] or file:///PATH"


def parse(uri: str, field: str, role: str = "model") -> Source:
    """Parse a model URI (``role`` model, tokenizer or adapter: a PEFT LoRA adapter's folder, which is never
    a .gguf file nor the bundled model). Raises ValueError naming ``field`` and the accepted forms."""
    if role == "adapter":
        try:
            source = parse(uri, field) if not uri.startswith("bundled://") else None
        except ValueError:
            source = None
        if source is None or source.file is not None:
            raise ValueError(f"{field}: {uri!r} is not a LoRA adapter uri; expected {ADAPTER_FORMS} (a folder "
                             f"holding adapter_config.json and adapter_model.safetensors)")
        return Source(source.uri, field, source.store, source.name, source.ref, source.prefix, None, role)
    if m := _HF.match(uri):
        return Source(uri, field, "hf", m["repo"], m["rev"] or "main", file=m["file"], role=role)
    if m := _S3.match(uri):
        prefix = (m["prefix"] or "").strip("/")
        if prefix.endswith(".gguf"):
            folder, _, name = prefix.rpartition("/")
            return Source(uri, field, "s3", m["bucket"], prefix=folder, file=name, role=role)
        return Source(uri, field, "s3", m["bucket"], prefix=prefix, role=role)
    if m := _PVC.match(uri):
        return Source(uri, field, "pvc", m["claim"], prefix=(m["path"] or "").strip("/"), role=role)
    if m := _FILE.match(uri):
        return Source(uri, field, "file", "", prefix=m["path"], role=role)
    if uri == "bundled://smollm2":
        return Source(uri, field, "bundled", "smollm2", role=role)
    raise ValueError(f"{field}: {uri!r} is not a model uri; expected {URI_FORMS}")


def cache_dir(source: Source, revision: str) -> str:
    """Folder of the model cache volume that holds ``source`` at ``revision`` (mounted at MODEL_ROOT)."""
    if source.store == "hf":
        return f"{MODEL_ROOT}/hf/{source.name}/{revision}"
    folder = f"/{source.prefix}" if source.prefix else ""
    return f"{MODEL_ROOT}/s3/{source.name}{folder}/{revision}"


def unpinned(source: Source) -> Pin:
    """The pin of a source nobody resolved (``kvfleet-operator render`` offline): the revision asked
    for (hf; the downloader resolves it itself) or ``latest`` (s3: whatever the prefix holds)."""
    return Pin(source.ref or "latest")


def served_path(source: Source, pin: Pin) -> str:
    """The --model (or draft/tokenizer) path kvfleet-server loads for a downloaded source."""
    base = cache_dir(source, pin.revision)
    return f"{base}/{source.file}" if source.file else base


@dataclass(frozen=True)
class S3Options:
    """Where an S3-compatible store is (spec.model.s3): endpoint URL, region, addressing style."""
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None


def downloader_args(source: Source, pin: Pin, s3: S3Options, hf_endpoint: str | None = None,
                    keep: list[str] | None = None, progress_port: int | None = None) -> list[str]:
    """``kvfleet-download`` arguments fetching ``source`` at ``pin`` into its cache folder. ``keep``
    (shared cache): prune the source's other revisions except these; None: prune nothing."""
    dest = cache_dir(source, pin.revision)
    if source.store == "hf":
        args = ["hf", source.name, "--revision", pin.revision, "--dest", dest]
        if hf_endpoint:
            args += ["--endpoint", hf_endpoint]
    else:
        args = ["s3", source.name, "--dest", dest]
        if source.prefix:
            args += ["--prefix", source.prefix]
        if pin.revision != unpinned(source).revision:
            args += ["--revision", pin.revision]
        for flag, value in (("--endpoint-url", s3.endpoint_url), ("--region", s3.region),
                            ("--addressing-style", s3.addressing_style)):
            if value:
                args += [flag, value]
    if source.file:
        args += ["--file", source.file]
    if source.role != "model":
        args += ["--role", source.role]
    if keep is not None:
        args += ["--prune"] + [a for rev in sorted(set(keep)) if rev != pin.revision for a in ("--keep", rev)]
    if progress_port:
        args += ["--progress-port", str(progress_port)]
    return args

"""I/O: pin a downloaded model source — a branch or tag to its commit, an s3 prefix to its ETag digest.

The reconcile calls ``resolve`` once per generation for each hf:// and s3:// source of the spec
(``weights.pins``), so every replica of that generation fetches the same bytes. Clients are the
well-kept ones: ``huggingface_hub.HfApi.model_info`` (the Hub at ``HF_ENDPOINT``, default
huggingface.co) and boto3's ``list_objects_v2`` (``kvfleet_server.download.list_s3``). The listing
is also checked against what serving needs (``kvfleet_server.model_files.select``): a .gguf path
that is not in the repository, or a repository without safetensors weights, is refused here, before
anything is downloaded.

Credentials: the operator's own, never the InferenceService's Secret (spec.model.credentialsSecret
goes to the downloader only): anonymous, or ``HF_TOKEN`` / the AWS variables / a workload identity
given to the operator's pod (docs/operator.md). A repository the operator may not read but whose
uri names a full commit (``hf://ORG/REPO@<40 hex digits>``) needs no resolution: the commit is the pin.
"""
from __future__ import annotations

import asyncio
import os

from kvfleet_server.download import Failure, classify, list_s3, s3_client
from kvfleet_server.model_files import s3_revision, select

from .model_source import COMMIT, Pin, S3Options, Source


def hf_endpoint() -> str | None:
    """The Hub the operator resolves against (``HF_ENDPOINT`` of its environment; None: huggingface.co).
    The downloads it renders use the same one."""
    return os.environ.get("HF_ENDPOINT") or None


def resolve_sync(source: Source, s3: S3Options) -> Pin:
    """The pin of a downloaded source (blocking). Raises ``kvfleet_server.download.Failure``."""
    if source.store == "hf":
        from huggingface_hub import HfApi

        where = f"hf://{source.name}@{source.ref}"
        try:
            info = HfApi(endpoint=hf_endpoint()).model_info(source.name, revision=source.ref)
            select([s.rfilename for s in info.siblings or []], source.role, gguf_file=source.file)
        except Exception as exc:  # noqa: BLE001 - classified: not found, unauthorized, unreachable ...
            failure = classify(exc, where)
            if COMMIT.match(source.ref or "") and failure.reason in ("Unauthorized", "RepositoryNotFound"):
                return Pin(source.ref)  # private to the operator; the downloader has the credentials
            raise failure from exc
        return Pin(info.sha or source.ref or "main")
    where = f"s3://{source.name}/{source.prefix}".rstrip("/")
    try:
        listing = list_s3(s3_client(s3.endpoint_url, s3.region, s3.addressing_style), source.name, source.prefix)
        if not listing:
            raise Failure("FileNotFound", f"{where}: no objects under this prefix")
        select(list(listing), source.role, gguf_file=source.file)
    except Exception as exc:  # noqa: BLE001
        raise classify(exc, where) from exc
    return Pin(s3_revision({name: etag for name, (_, etag) in listing.items()}))


async def resolve(source: Source, s3: S3Options) -> Pin:
    """``resolve_sync`` in a worker thread (the clients block)."""
    return await asyncio.to_thread(resolve_sync, source, s3)

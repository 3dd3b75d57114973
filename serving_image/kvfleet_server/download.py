"""``kvfleet-download``: fetch the files kvfleet-server needs from a Hugging Face repository or an S3 prefix.

The operator runs it as the download Job of a shared model cache, or as the init container of a
serving pod (per-pod caches), from the serving image::

    kvfleet-download hf ORG/REPO --revision COMMIT --dest DIR [--file PATH.gguf] [--role model|tokenizer|adapter]
                     [--endpoint URL] [--prune --keep REV ...] [--progress-port N]
    kvfleet-download s3 BUCKET [--prefix P] [--revision DIGEST] --dest DIR [--file KEY.gguf] [--role ...]
                     [--endpoint-url URL] [--region R] [--addressing-style auto|virtual|path] [...]

Clients: huggingface_hub (``HfApi.model_info`` lists the files at the pinned commit,
``snapshot_download(allow_patterns=...)`` fetches exactly the chosen ones, resumable, into ``--dest``)
and boto3 (``list_objects_v2`` + ``download_file``: multipart, retried). Which files: see
``model_files.select`` — never a file serving does not read (``original/*.pth`` stays on the Hub).

Pinning: ``--revision`` is the commit the operator resolved (hf) or the digest of the objects' ETags
(s3, ``model_files.s3_revision``); an s3 prefix whose objects changed since is refused
(``ObjectsChanged``) rather than mixed. Credentials come from the environment only (``HF_TOKEN``;
the AWS variables or the pod's workload identity): the operator puts them in this container alone.
``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` (a serving setting that may reach this container
through spec.engine.env) are ignored: downloading is this program's whole job.

Progress: ``--progress-port`` serves Prometheus gauges ``kvfleet:model_download_downloaded_bytes``
(bytes on disk under ``--dest``, partial files included) and ``kvfleet:model_download_expected_bytes``
(total of the chosen files), which the operator reads into the ModelReady condition.
Exit status: 0 done; 3 a failure retrying cannot fix (not found, unauthorized, disk full, objects
changed, nothing servable: the Job stops at once); 1 anything else (network: the Job retries).
The last stderr line is ``error: REASON: MESSAGE`` (the pod's termination message).
"""
from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass

from .model_files import INDEX_FILE, ROLES, FileMissing, NothingToServe, s3_revision, select, small_files

OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
DOWNLOADED = "kvfleet:model_download_downloaded_bytes"
EXPECTED = "kvfleet:model_download_expected_bytes"
EXIT_PERMANENT = 3


@dataclass
class Failure(Exception):
    """A failed fetch or listing: ``reason`` (CamelCase), ``message``, ``permanent`` (retrying cannot help).

    Reasons: RepositoryNotFound, RevisionNotFound, BucketNotFound, Unauthorized, FileNotFound,
    NothingToServe, ObjectsChanged, DiskFull (permanent); Unreachable (not)."""
    reason: str
    message: str
    permanent: bool = True

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def classify(exc: BaseException, where: str) -> Failure:
    """The ``Failure`` an exception of huggingface_hub, botocore or the OS stands for (``where`` names
    the repository, bucket or file in the message). Shared with the operator's resolver."""
    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, NothingToServe):
        return Failure("FileNotFound" if isinstance(exc, FileMissing) else "NothingToServe", f"{where}: {exc}")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Failure("DiskFull", f"{where}: no space left on the model cache volume ({exc.strerror})")
    from huggingface_hub import errors as hf

    if isinstance(exc, hf.GatedRepoError):
        return Failure("Unauthorized", f"{where}: gated repository: the token (HF_TOKEN) is missing or has not "
                                       f"been granted access")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return Failure("RepositoryNotFound", f"{where}: repository not found, or private and the token "
                                             f"(HF_TOKEN) is missing or lacks access")
    if isinstance(exc, hf.RevisionNotFoundError):
        return Failure("RevisionNotFound", f"{where}: no such branch, tag or commit")
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return Failure("FileNotFound", f"{where}: file not found in the repository")
    if isinstance(exc, hf.HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return Failure("Unauthorized", f"{where}: the Hub refused the token (HTTP {exc.response.status_code})")
    try:
        from botocore import exceptions as boto
    except ImportError:  # boto3 absent: nothing of it can have been raised
        boto = None
    if boto is not None and isinstance(exc, boto.NoCredentialsError):
        return Failure("Unauthorized", f"{where}: no AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a "
                                       f"workload identity)")
    if boto is not None and isinstance(exc, boto.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchBucket",):
            return Failure("BucketNotFound", f"{where}: bucket not found")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401",
                    "ExpiredToken", "InvalidToken"):
            return Failure("Unauthorized", f"{where}: access denied ({code})")
        if code in ("NoSuchKey", "404"):
            return Failure("FileNotFound", f"{where}: object not found")
    return Failure("Unreachable", f"{where}: {type(exc).__name__}: {exc}".strip(), permanent=False)


# ------------------------------------------------------------------------------------------ progress
def bytes_on_disk(path: str) -> int:
    """Bytes stored under ``path`` (allocated blocks, so a sparse file being filled counts what is
    written; partial downloads included)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # renamed or removed while walking
            total += min(st.st_size, st.st_blocks * 512)
    return total


class Progress:
    """Prometheus gauges of one download, refreshed from the disk every ``period`` seconds."""

    def __init__(self, dest: str, port: int | None, period: float = 1.0):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.dest, self.period = dest, period
        self.registry = CollectorRegistry()
        self.downloaded = Gauge(DOWNLOADED, "Bytes of the model downloaded so far.", registry=self.registry)
        self.expected = Gauge(EXPECTED, "Bytes of the model files to download.", registry=self.registry)
        self._stop = threading.Event()
        if port:
            start_http_server(port, addr="0.0.0.0", registry=self.registry)
        self._thread = threading.Thread(target=self._run, name="download-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.refresh()

    def refresh(self) -> None:
        self.downloaded.set(bytes_on_disk(self.dest) if os.path.isdir(self.dest) else 0)

    def stop(self) -> None:
        self._stop.set()
        self.refresh()


# ---------------------------------------------------------------------------------------- fetching
def _patterns(names: list[str]) -> list[str]:
    return [glob.escape(n) for n in names]  # exact names (fnmatch would read [, ?, * as wildcards)


def fetch_hf(args: argparse.Namespace, progress: Progress) -> tuple[str, list[str], int]:
    """Download from the Hub; returns (commit, files, bytes)."""
    from huggingface_hub import HfApi, snapshot_download

    where = f"hf://{args.source}"
    try:
        info = HfApi(endpoint=args.endpoint).model_info(args.source, revision=args.revision, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        commit = info.sha or args.revision

        def get(files: list[str]) -> None:
            snapshot_download(args.source, revision=commit, allow_patterns=_patterns(files), local_dir=args.dest,
                              endpoint=args.endpoint)
        files = _choose(args, list(sizes), get)
        progress.expected.set(sum(sizes[f] for f in files))
        get(files)
    except Exception as exc:  # noqa: BLE001 - every failure is reported by reason
        raise classify(exc, f"{where}@{args.revision}") from exc
    return commit, files, sum(sizes[f] for f in files)


def _choose(args: argparse.Namespace, names: list[str], get) -> list[str]:
    """``select`` over the listing; the index (and config/tokenizer files) fetched first when sharded."""
    if args.file or args.role != "model" or INDEX_FILE not in names:
        return select(names, args.role, gguf_file=args.file)
    get(small_files(names, args.role))
    with open(os.path.join(args.dest, INDEX_FILE)) as f:
        return select(names, args.role, index_weight_files=json.load(f)["weight_map"].values())


def s3_client(endpoint_url: str | None, region: str | None, addressing_style: str | None):
    """A boto3 S3 client for an S3-compatible store (credentials from the environment)."""
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": addressing_style or "auto"}, retries={"mode": "standard",
                                                                                 "max_attempts": 10})
    return boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config)


def list_s3(client, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """Objects under ``prefix`` (a folder: '/' is appended unless empty): name relative to it -> (size, ETag)."""
    folder = prefix.strip("/") + "/" if prefix.strip("/") else ""
    out: dict[str, tuple[int, str]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder):
        for obj in page.get("Contents") or []:
            rel = obj["Key"][len(folder):]
            if rel and not rel.endswith("/"):
                out[rel] = (int(obj["Size"]), str(obj["ETag"]))
    return out


def fetch_s3(args: argparse.Namespace, progress: Progress) -> tuple[str, list[str], int]:
    """Download from S3; returns (revision digest, files, bytes)."""
    where = f"s3://{args.source}/{args.prefix}".rstrip("/")
    folder = args.prefix.strip("/") + "/" if args.prefix.strip("/") else ""
    try:
        client = s3_client(args.endpoint_url, args.region, args.addressing_style)
        listing = list_s3(client, args.source, args.prefix)

        def get(files: list[str]) -> None:
            for name in files:
                target = os.path.join(args.dest, name)
                if os.path.isfile(target) and os.path.getsize(target) == listing[name][0]:
                    continue  # fetched by an earlier attempt (the revision directory pins the ETags)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                client.download_file(args.source, folder + name, target)  # via a temporary name, renamed
        revision = s3_revision({f: e for f, (_, e) in listing.items()})
        if args.revision and revision != args.revision:
            raise Failure("ObjectsChanged", f"{where}: the objects changed since the operator pinned them "
                                            f"({args.revision}, now {revision}); it pins them again")
        files = _choose(args, list(listing), get)
        progress.expected.set(sum(listing[f][0] for f in files))
        get(files)
        if s3_revision({f: e for f, (_, e) in list_s3(client, args.source, args.prefix).items()}) != revision:
            raise Failure("ObjectsChanged", f"{where}: objects were overwritten during the download; it starts over")
    except Exception as exc:  # noqa: BLE001 - every failure is reported by reason
        raise classify(exc, where) from exc
    return revision, files, sum(listing[f][0] for f in files)


def prune(dest: str, keep: list[str]) -> list[str]:
    """Remove the other revisions of this source beside ``dest`` (sibling folders not in ``keep``);
    returns their names. The shared cache keeps the revision being fetched and the one being served."""
    parent, own = os.path.split(os.path.normpath(dest))
    removed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        if name not in keep and name != own and os.path.isdir(os.path.join(parent, name)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


# --------------------------------------------------------------------------------------------- cli
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet-download", description=__doc__.split("\n\n")[0])
    p.add_argument("store", choices=("hf", "s3"), help="hf: a Hugging Face repository; s3: an S3 bucket")
    p.add_argument("source", help="hf: ORG/REPO; s3: BUCKET")
    p.add_argument("--prefix", default="", help="s3: the folder of the model in the bucket")
    p.add_argument("--revision", default=None,
                   help="hf: commit (or branch/tag, resolved once here); s3: ETag digest to insist on")
    p.add_argument("--dest", required=True, help="folder the files go to")
    p.add_argument("--file", default=None, help="one .gguf file (path in the repository or under the prefix)")
    p.add_argument("--role", choices=ROLES, default="model", help="what the files are for")
    p.add_argument("--endpoint", default=None, help="hf: the Hub's URL (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--endpoint-url", default=None, help="s3: an S3-compatible store's URL")
    p.add_argument("--region", default=None, help="s3: region")
    p.add_argument("--addressing-style", choices=("auto", "virtual", "path"), default=None,
                   help="s3: bucket in the host name (virtual) or in the path")
    p.add_argument("--prune", action="store_true", help="remove the other revisions beside --dest first")
    p.add_argument("--keep", action="append", default=[], help="with --prune: a revision folder to keep")
    p.add_argument("--progress-port", type=int, default=None, help="serve progress gauges on this port")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvfleet-download``; returns the exit status."""
    for name in OFFLINE_ENV:  # before huggingface_hub reads them at import
        os.environ.pop(name, None)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # progress is the gauges; logs stay readable
    args = build_parser().parse_args(argv)
    if args.store == "hf" and args.revision is None:
        args.revision = "main"
    if args.prune:
        for name in prune(args.dest, args.keep):
            print(f"removed revision {name} beside {args.dest}", file=sys.stderr)
    os.makedirs(args.dest, exist_ok=True)
    progress = Progress(args.dest, args.progress_port)
    started = time.monotonic()
    try:
        revision, files, size = (fetch_hf if args.store == "hf" else fetch_s3)(args, progress)
    except Failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PERMANENT if exc.permanent else 1
    finally:
        progress.stop()
    print(f"done: {len(files)} files, {size} bytes of {args.store}://{args.source} at {revision} in "
          f"{time.monotonic() - started:.1f}s: {' '.join(files)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

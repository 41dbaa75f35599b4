"""One storage layer: local paths and ``gs://`` URLs behave the same to the rest of the code.

Every path the project reads or writes (run dir, run files, published weights, prompt
datasets, HF model dirs, script inputs and outputs) goes through this module, never
through ``pathlib.Path`` on a URL (which turns ``gs://b/r`` into a local folder ``gs:/b/r``).
Files go through fsspec (gcsfs for ``gs://``); Orbax checkpoints go through Orbax and
tensorstore's own GCS drivers, pointed at the same endpoint by ``configure_environment``.

    storage.check_location("gs://bucket/run1", "run_dir", write=True)   # fail fast
    storage.write_text(storage.join(run_dir, "config.yaml"), text)
    local_hf_dir = storage.local_copy("gs://bucket/models/qwen")          # cached download

Credentials are Application Default Credentials, as the Google libraries expect. Against
an emulator set ``STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT``; ``configure_environment``
(the one place that knows what an emulator needs beyond that) points tensorstore at it and
stops every client from probing the cloud metadata server.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

SCHEMES = ("gs",)  # URL schemes we support; anything else is an error, never a local folder
DEFAULT_CACHE_DIR = "~/.cache/areal_jax"


class StorageError(RuntimeError):
    """A path that cannot be used: unsupported scheme, missing bucket, no credentials."""


# ----------------------------------------------------------------------------- environment
def _gcsfs_without_bucket_type_probe() -> None:
    """gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when it is imported and then serves
    ``gs://`` with its experimental file system (a bucket-type probe per open: "Could not
    determine bucket type", a minute each against an emulator). If something imported it
    before the variable was set to false, the plain file system is put back for ``gs://``."""
    import sys

    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is None or os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "").lower() in (
            "true", "1"):
        return
    core = getattr(getattr(gcsfs, "core", None), "GCSFileSystem", None)
    if core is None or getattr(gcsfs, "GCSFileSystem", None) is core:
        return
    import fsspec

    gcsfs.GCSFileSystem = core  # type: ignore[attr-defined]  # gcsfs has no stubs
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, core, clobber=True)


def configure_environment() -> None:
    """Points every GCS client at ``STORAGE_EMULATOR_HOST`` when it is set (idempotent).

    gcsfs and google-cloud-storage read ``STORAGE_EMULATOR_HOST`` themselves; tensorstore
    (Orbax's array writes) reads ``TENSORSTORE_GCS_HTTP_URL`` instead and needs a token
    so that it stops looking for credentials. The metadata-server probes are pointed at
    an unused local port so nothing tries to leave the machine. A real bucket needs none
    of this; values the user set are kept.
    """
    import fsspec.config

    host = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # no gRPC probe per open
    _gcsfs_without_bucket_type_probe()
    # Every gcsfs instance (also etils.epath's, which Orbax lists steps with) re-lists: other
    # processes write the same bucket, and a cached listing would hide their new objects.
    gs_defaults = fsspec.config.conf.setdefault("gs", {})
    gs_defaults.setdefault("use_listings_cache", False)
    if not host:
        return
    gs_defaults.setdefault("token", "anon")  # the emulator takes no credentials
    if "://" not in host:
        host = "http://" + host
        os.environ["STORAGE_EMULATOR_HOST"] = host
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("NO_GCE_CHECK", "true")
    os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")  # discard port: refused at once
    os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")


def using_emulator() -> bool:
    return bool(os.environ.get("STORAGE_EMULATOR_HOST"))


# ----------------------------------------------------------------------------- paths
def scheme_of(path: str | os.PathLike) -> str | None:
    """``"gs"`` for ``gs://b/x``; None for a local path. Raises on an unsupported scheme."""
    text = os.fspath(path)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme == "file":
            return None
        if scheme not in SCHEMES:
            raise StorageError(f"{text}: unsupported URL scheme {scheme!r}; use a local path or "
                               f"{', '.join(s + '://' for s in SCHEMES)}")
        return scheme
    head = text.split("/", 1)[0]
    if head.endswith(":") and len(head) > 2 and head[:-1].isalpha():  # "gs:/b/r", "s3:bucket"
        raise StorageError(f"{text}: looks like a mangled URL (a URL needs '://'); use a local "
                           f"path or {', '.join(s + '://' for s in SCHEMES)}")
    return None


def is_url(path: str | os.PathLike) -> bool:
    """True for a supported cloud URL (``gs://``); raises on an unsupported scheme."""
    return scheme_of(path) is not None


def _strip_file(text: str) -> str:
    return text[len("file://"):] if text.lower().startswith("file://") else text


def normalize(path: str | os.PathLike) -> str:
    """A URL without trailing '/', or an absolute local path (``~`` expanded)."""
    text = os.fspath(path)
    if is_url(text):
        scheme, rest = text.split("://", 1)
        return f"{scheme.lower()}://{rest.strip('/')}"
    return os.path.abspath(os.path.expanduser(_strip_file(text)))


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base/part/...`` for URLs and local paths alike."""
    text = os.fspath(base)
    if is_url(text):
        return "/".join([text.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(_strip_file(text), *parts)


def parent_of(path: str | os.PathLike) -> str:
    """The directory holding ``path`` (``gs://b/run/weights`` for ``gs://b/run/weights/v3``)."""
    text = os.fspath(path).rstrip("/")
    if is_url(text):
        return text.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(text))


def name_of(path: str | os.PathLike) -> str:
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def bucket_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


# ----------------------------------------------------------------------------- filesystems
def filesystem(path: str | os.PathLike) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a local path or URL."""
    text = os.fspath(path)
    if not is_url(text):
        import fsspec

        return fsspec.filesystem("file"), os.path.abspath(os.path.expanduser(_strip_file(text)))
    configure_environment()
    try:
        import gcsfs
    except ImportError:
        raise StorageError(f"{text}: gs:// paths need the gcsfs package "
                           "(pip install 'areal-jax[gcs]')") from None
    fs = gcsfs.GCSFileSystem()  # defaults from configure_environment (fsspec config)
    return fs, text.split("://", 1)[1].rstrip("/")


def exists(path: str | os.PathLike) -> bool:
    fs, p = filesystem(path)
    return bool(fs.exists(p))


def isdir(path: str | os.PathLike) -> bool:
    fs, p = filesystem(path)
    return bool(fs.isdir(p))


def isfile(path: str | os.PathLike) -> bool:
    fs, p = filesystem(path)
    return bool(fs.isfile(p))


def listdir(path: str | os.PathLike) -> list[str]:
    """Names (not paths) of the entries directly under ``path``; [] if it does not exist."""
    fs, p = filesystem(path)
    try:
        entries = fs.ls(p, detail=False)
    except FileNotFoundError:
        return []
    return sorted({name_of(e) for e in entries if e.rstrip("/") != p})


def makedirs(path: str | os.PathLike) -> None:
    """Local: ``mkdir -p``. Object stores have no directories; nothing to do there."""
    if not is_url(path):
        os.makedirs(normalize(path), exist_ok=True)


def open_file(path: str | os.PathLike, mode: str = "rb") -> IO:
    fs, p = filesystem(path)
    if "w" in mode and not is_url(path):
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    return fs.open(p, mode)


def read_bytes(path: str | os.PathLike) -> bytes:
    fs, p = filesystem(path)
    return fs.cat_file(p)


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes a whole file; atomic on both (local: tmp + rename; objects: one upload)."""
    fs, p = filesystem(path)
    if is_url(path):
        fs.pipe_file(p, data)
        return
    os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)}.", dir=os.path.dirname(p))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def remove(path: str | os.PathLike, recursive: bool = False) -> None:
    fs, p = filesystem(path)
    if fs.exists(p):
        fs.rm(p, recursive=recursive)


# ----------------------------------------------------------------------------- transfers
def upload(local: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Copies a local file, or a directory tree, to ``dest`` (local or URL)."""
    local = os.fspath(local)
    if not is_url(dest):
        if os.path.isdir(local):
            shutil.copytree(local, normalize(dest), dirs_exist_ok=True)
        else:
            os.makedirs(os.path.dirname(normalize(dest)) or ".", exist_ok=True)
            shutil.copyfile(local, normalize(dest))
        return
    fs, p = filesystem(dest)
    if os.path.isdir(local):
        for root, _, files in os.walk(local):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), local).replace(os.sep, "/")
                fs.put_file(os.path.join(root, name), f"{p}/{rel}")
    else:
        fs.put_file(local, p)


def download(src: str | os.PathLike, local: str | os.PathLike,
             exclude_top: Iterable[str] = ()) -> list[str]:
    """Copies ``src`` (a file or a directory tree) to the local path ``local``.

    ``exclude_top``: names directly under a directory ``src`` that are skipped.
    Returns the relative paths copied.
    """
    fs, p = filesystem(src)
    local = os.fspath(local)
    if fs.isfile(p):
        os.makedirs(os.path.dirname(os.path.abspath(local)) or ".", exist_ok=True)
        fs.get_file(p, local)
        return [os.path.basename(local)]
    skip = set(exclude_top)
    copied = []
    for obj in fs.find(p):
        rel = obj[len(p):].lstrip("/")
        if not rel or rel.split("/", 1)[0] in skip or rel.endswith("/"):
            continue
        target = os.path.join(local, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(obj, target)
        copied.append(rel)
    return copied


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host: temporary files and cache slots named
    after a process that is gone are leftovers of a killed run, safe to delete."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def cache_root(cache_dir: str | None = None) -> Path:
    """Where cloud inputs are cached and run files are worked on locally."""
    root = cache_dir or os.environ.get("AREAL_JAX_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(os.path.expanduser(root)).absolute()


def local_cache_path(url: str, kind: str, cache_dir: str | None = None) -> Path:
    """A stable local directory for ``url`` under the cache root (``<kind>/<bucket>/<path>``)."""
    url = normalize(url)
    rest = url.split("://", 1)[1]
    digest = hashlib.sha1(url.encode()).hexdigest()[:8]
    return cache_root(cache_dir) / kind / f"{rest.replace('/', '__')}-{digest}"


def local_copy(path: str | os.PathLike, cache_dir: str | None = None,
               kind: str = "models") -> Path:
    """A local directory or file with the contents of ``path``.

    Local paths come back as they are. A URL is downloaded once into the cache (a
    ``.complete`` marker says the copy finished; a partial copy is redone) and the
    cached copy is returned.
    """
    if not is_url(path):
        return Path(normalize(path))
    url = normalize(path)
    dest = local_cache_path(url, kind, cache_dir)
    marker = dest.parent / f"{dest.name}.complete"
    if marker.exists() and dest.exists():
        return dest
    if not exists(url):
        raise StorageError(f"{url} does not exist")
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    download(url, tmp)
    if marker.exists() and dest.exists():  # another process finished the same copy first
        shutil.rmtree(tmp, ignore_errors=True)
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    marker.write_text(url + "\n")
    return dest


# ----------------------------------------------------------------------------- fail fast
def check_location(path: str | os.PathLike, what: str, *, write: bool = False,
                   must_exist: bool = False) -> str:
    """Validates ``path`` before any long work; returns it normalised.

    Raises StorageError with one line naming ``what``, the path and the cause: an
    unsupported scheme, gcsfs missing, no credentials, a missing bucket, no permission
    (``write=True`` writes and deletes a probe object), or ``must_exist`` and absent.
    """
    text = os.fspath(path)
    try:
        local = not is_url(text)
    except StorageError as e:
        raise StorageError(f"{what} {e}") from None
    if local:
        norm = normalize(text)
        if must_exist and not os.path.exists(norm):
            raise StorageError(f"{what} {text} does not exist")
        return norm
    if not bucket_of(text):
        raise StorageError(f"{what} {text}: no bucket name")
    url = normalize(text)
    bucket = bucket_of(url)
    try:
        fs, p = filesystem(url)
    except StorageError as e:
        raise StorageError(f"{what} {e}") from None
    if not using_emulator():
        _check_credentials(url, what)
    try:
        if not fs.exists(bucket):
            raise StorageError(f"{what} {url}: bucket gs://{bucket} does not exist")
        if must_exist and not fs.exists(p):
            raise StorageError(f"{what} {url} does not exist")
        if write:
            probe = f"{p}/.areal-write-probe-{os.getpid()}"
            fs.pipe_file(probe, b"")
            fs.rm_file(probe)
    except StorageError:
        raise
    except PermissionError as e:
        raise StorageError(f"{what} {url}: permission denied ({_one_line(e)})") from None
    except Exception as e:  # noqa: BLE001 - transport/auth errors of the cloud client
        raise StorageError(f"{what} {url}: cannot access the bucket "
                           f"({type(e).__name__}: {_one_line(e)})") from None
    return url


def _check_credentials(url: str, what: str) -> None:
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:
        return  # gcsfs will report it
    try:
        google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    except DefaultCredentialsError:
        raise StorageError(
            f"{what} {url}: no Google Cloud credentials found (run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, or run on a "
            "machine with a service account; for an emulator set STORAGE_EMULATOR_HOST)") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


# ----------------------------------------------------------------------------- run files
class RunFiles:
    """The run dir's own files (config, metrics, logs, TensorBoard) in a local working copy.

    Objects cannot be appended to, so for a ``gs://`` run dir the files are written in a
    local directory and uploaded whole: on a schedule (every ``upload_every_s`` seconds,
    by a background thread), at every checkpoint and at the end (``sync``). A killed run
    loses at most what happened since the last upload. On start the working copy is
    replaced by what the bucket holds, so a resumed run continues the same files. For a
    local run dir the working copy is the run dir itself and ``sync`` does nothing.

    Checkpoints and published weights are not run files: they are written to the bucket
    directly (``exclude`` names their top-level folders).
    """

    def __init__(self, run_dir: str, *, cache_dir: str | None = None,
                 upload_every_s: float = 60.0, exclude: Iterable[str] = ()) -> None:
        self.run_dir = normalize(run_dir)
        self.remote = is_url(self.run_dir)
        self.exclude = set(exclude)
        self.upload_every_s = upload_every_s
        if self.remote:
            self.local = local_cache_path(self.run_dir, "runs", cache_dir)
            shutil.rmtree(self.local, ignore_errors=True)
            self.local.mkdir(parents=True)
            download(self.run_dir, self.local, exclude_top=self.exclude)
        else:
            self.local = Path(self.run_dir)
            self.local.mkdir(parents=True, exist_ok=True)
        self._uploaded: dict[str, tuple[int, int]] = {
            str(p.relative_to(self.local)): _stamp(p) for p in self._files()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path(self, *parts: str) -> Path:
        """A local path inside the working copy."""
        return self.local.joinpath(*parts)

    def _files(self) -> list[Path]:
        return [p for p in self.local.rglob("*") if p.is_file()
                and p.relative_to(self.local).parts[0] not in self.exclude]

    def sync(self) -> int:
        """Uploads every file changed since the last upload; returns how many."""
        if not self.remote:
            return 0
        with self._lock:
            n = 0
            for p in self._files():
                rel = str(p.relative_to(self.local)).replace(os.sep, "/")
                stamp = _stamp(p)
                if self._uploaded.get(rel) == stamp:
                    continue
                upload(p, join(self.run_dir, rel))
                self._uploaded[rel] = stamp
                n += 1
            return n

    def start(self) -> None:
        """Starts the scheduled uploads (gs:// run dirs only)."""
        if not self.remote or self.upload_every_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="run-files-upload", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.upload_every_s):
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - retried at the next tick; close() raises
                logger.warning("uploading run files to %s failed: %s", self.run_dir, _one_line(e))

    def close(self) -> None:
        """Stops the schedule and uploads what changed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self.sync()


def _stamp(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_mtime_ns, st.st_size


"""Models from the Hugging Face Hub, through `huggingface_hub` and its cache.

Owns `pull_hub` (list the repo at one commit, pick the files as llama.cpp's `-hf` does, fetch
them with `hf_hub_download` — resumable `.incomplete` blobs, its cache, `HF_TOKEN` — and check
each fresh LFS file's sha256), `cached_hub_model` (the same pick over what is already cached,
no network) and `list_hub_models`. `HF_ENDPOINT`, `HF_HOME` / `HF_HUB_CACHE` are read at call
time, so they may change after import. An interrupted download leaves only huggingface_hub's
`.incomplete` blob, which the next pull resumes; nothing half-written is ever resolved.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from minfer.errors import DownloadError, ModelNotFoundError
from minfer.store.hub_select import (
    HubFile,
    HubRef,
    parse_hub_ref,
    rank_mmproj,
    select_files,
    split_info,
)

_CHUNK = 1 << 20


def hub_cache_dir() -> Path:
    """huggingface_hub's cache directory, as it resolves it (read now, not at import)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME")
                                             or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def _endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


@contextmanager
def _hub_errors(ref: HubRef) -> Iterator[None]:
    """Turn huggingface_hub / HTTP failures into one-line minfer errors."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError:
        raise DownloadError(f"{ref}: the repository is gated; accept its terms on the Hub and "
                            "set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFoundError(f"{ref}: no such repository on the Hub (a private one needs "
                                 "HF_TOKEN)") from None
    except EntryNotFoundError as exc:
        raise ModelNotFoundError(f"{ref}: {exc}") from None
    except (OSError, ValueError, RuntimeError) as exc:
        raise DownloadError(f"{ref}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # httpx and friends: connection refused, timeouts
        raise DownloadError(f"{ref}: {type(exc).__name__}: {exc}") from None


def list_repo(ref: HubRef) -> tuple[str, list[HubFile]]:
    """The repo's commit hash and its files (size, LFS sha256) at the main revision."""
    from huggingface_hub import HfApi

    with _hub_errors(ref):
        info = HfApi(endpoint=_endpoint()).model_info(ref.repo, files_metadata=True)
    files = [HubFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None)
             for s in info.siblings or []]
    if not info.sha:
        raise DownloadError(f"{ref}: the Hub gave no commit for the repository")
    return info.sha, files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(ref: HubRef, f: HubFile, path: Path) -> None:
    """Size and LFS sha256 of a freshly downloaded file; a bad blob is removed."""
    size = path.stat().st_size
    if (f.size is not None and size != f.size) or (f.sha256 and _sha256(path) != f.sha256):
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise DownloadError(f"{ref}: {f.path} fails its checksum (got {size} bytes; the Hub "
                            f"says {f.size} bytes, sha256 {f.sha256}); removed, pull again")


def _fetch(ref: HubRef, commit: str, f: HubFile, progress: bool) -> Path:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cache = hub_cache_dir()
    cached = try_to_load_from_cache(ref.repo, f.path, cache_dir=cache, revision=commit)
    if isinstance(cached, str):
        return Path(cached)
    with _hub_errors(ref), _progress_bars(progress):
        path = Path(hf_hub_download(ref.repo, f.path, revision=commit, cache_dir=cache,
                                    endpoint=_endpoint()))
    _verify(ref, f, path)
    return path


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub's own progress bars on or off for the duration."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if not enabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


def pull_hub(arg: str | HubRef, *, progress: bool = True, mmproj: bool = True) -> Path:
    """Download the model files `hf:ORG/REPO[:SEL]` names and, unless mmproj is False, the
    repo's mmproj for it as `llama-server -hf` does (`rank_mmproj`: it lands in the model's
    snapshot, where the model's vision encoder is looked for); return the (first) .gguf path."""
    ref = arg if isinstance(arg, HubRef) else parse_hub_ref(arg)
    commit, files = list_repo(ref)
    chosen = select_files(files, ref)
    if mmproj and (best := rank_mmproj([f.path for f in files], chosen[0].path)):
        chosen = [*chosen, next(f for f in files if f.path == best[0])]
    paths = [_fetch(ref, commit, f, progress) for f in chosen]
    _write_main_ref(ref, commit)
    return paths[0]


def _write_main_ref(ref: HubRef, commit: str) -> None:
    """Point refs/main at the commit pulled (hf_hub_download only does so for a branch name)."""
    refs = _repo_dir(ref.repo) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    tmp = refs / ".main.tmp"
    tmp.write_text(commit)
    os.replace(tmp, refs / "main")


def _repo_dir(repo: str) -> Path:
    return hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def _snapshot_files(snapshot: Path) -> list[HubFile]:
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf")
                   if p.is_file())
    return [HubFile(p) for p in files]


def cached_hub_model(arg: str | HubRef) -> Path | None:
    """The model file ref names in the local cache's main snapshot, all parts present; or None."""
    ref = arg if isinstance(arg, HubRef) else parse_hub_ref(arg)
    main = _repo_dir(ref.repo) / "refs" / "main"
    if not main.is_file():
        return None
    snapshot = _repo_dir(ref.repo) / "snapshots" / main.read_text().strip()
    try:
        chosen = select_files(_snapshot_files(snapshot), ref)
    except ModelNotFoundError:
        return None
    return snapshot / chosen[0].path


def list_hub_models() -> list[tuple[str, Path]]:
    """(`hf:ORG/REPO:FILE`, path) per cached model file (first parts) in the main snapshots."""
    root = hub_cache_dir()
    found = []
    for repo_dir in sorted(root.glob("models--*")) if root.is_dir() else []:
        main = repo_dir / "refs" / "main"
        if not main.is_file():
            continue
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        snapshot = repo_dir / "snapshots" / main.read_text().strip()
        for f in _snapshot_files(snapshot):
            if split_info(f.path)[1] == 1 and "mmproj" not in f.path:
                found.append((f"hf:{repo}:{f.path}", snapshot / f.path))
    return found

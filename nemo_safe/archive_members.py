"""What extracting an archive will create, checked before anything is written.

tarfile before Python 3.14 (without ``filter="data"``) writes absolute member names, ``..``
paths, device files, and through symlinks the archive itself made: the same archive that
Python 3.14 refuses would write outside the destination. The staging extraction of
:mod:`nemo_safe.patches.torchvision_downloads` checks the members first, and then checks the
staging folder still holds every one of them before publishing (another process may have
removed it).
"""

from __future__ import annotations

import posixpath
import tarfile
import zipfile
from collections.abc import Iterator

from nemo_safe.errors import UnsafeArchivePath


def _resolve(path: str, links: dict[str, str]) -> str | None:
    """``path`` (relative to an archive's root) with the archive's own symlinks (``links``: path ->
    target) resolved like the kernel would; None when it leads out of the root or loops."""
    done: list[str] = []
    todo = path.split("/")[::-1]
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                return None
            done.pop()
            continue
        done.append(part)
        target = links.get("/".join(done))
        if target is not None:
            hops += 1
            if hops > 40 or target.startswith("/"):
                return None
            done.pop()
            todo.extend(target.split("/")[::-1])
    return "/".join(done)


def _tar_member_problem(member: tarfile.TarInfo, links: dict[str, str]) -> str | None:
    """Why extracting ``member`` would write outside the destination, or None; records its symlink.

    tarfile before Python 3.14 (without ``filter="data"``) extracts absolute names, ``..``, device
    files, and writes through symlinks the archive made: this refuses what the data filter refuses."""
    name = member.name.rstrip("/")
    if member.name.startswith("/") or member.linkname.startswith("/"):
        return "has an absolute path" if member.name.startswith("/") else f"links to the absolute {member.linkname!r}"
    if member.isdev():
        return "is a device file or a pipe"
    if member.issym():
        parent, base = posixpath.split(name)
        where = _resolve(parent, links)
        if where is None or base in ("", ".", ".."):
            return "lies outside the destination"
        if _resolve(posixpath.join(where, member.linkname), links) is None:
            return f"is a symlink to {member.linkname!r}, outside the destination"
        links[posixpath.join(where, base)] = member.linkname
        return None
    if member.islnk() and _resolve(member.linkname, links) is None:
        return f"is a hard link to {member.linkname!r}, outside the destination"
    return "lies outside the destination" if _resolve(name, links) is None else None


def _zip_name(filename: str) -> str:
    """Where zipfile extracts ``filename``: it drops empty, ``.`` and ``..`` parts (and a leading ``/``)."""
    return "/".join(p for p in filename.split("/") if p not in ("", ".", ".."))


def checked_tar_members(tar: tarfile.TarFile, path: str, names: list[str]) -> Iterator[tarfile.TarInfo]:
    """The members of ``tar`` as it reads them, each checked before it is extracted (raises
    UnsafeArchivePath for one that would be written outside the destination), their paths added
    to ``names`` so that the staging folder can be checked complete before it is published. Given
    to ``extractall(members=...)`` it makes the one pass over the archive upstream makes."""
    links: dict[str, str] = {}
    for member in tar:
        problem = _tar_member_problem(member, links)
        if problem:
            raise UnsafeArchivePath(
                f"{path}: member {member.name!r} {problem}; nothing was extracted (Python 3.14's "
                "tarfile refuses it too). The archive is damaged or malicious: get it from a trusted mirror."
            )
        if member.name.rstrip("/"):
            names.append(member.name.rstrip("/"))
        yield member


def zip_names(archive: zipfile.ZipFile) -> list[str]:
    """The relative paths extracting ``archive`` creates (zipfile keeps every name inside the
    destination itself); read from the central directory, no pass over the data."""
    return [n for n in (_zip_name(i.filename) for i in archive.infolist()) if n]

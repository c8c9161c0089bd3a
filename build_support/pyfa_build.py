"""PEP 517 build backend of pyfa: builds libpyfa with the Swift toolchain and
packs it, with its headers and the Python package, into a platform wheel.

The Python package loads libpyfa through cffi in ABI mode, so the wheel does
not depend on the Python version (``py3-none``) but does on the platform
(``linux_x86_64``, ``macosx_..._arm64``): a Linux .so must not install on a Mac.
No third-party build tools are needed; wheels and sdists are plain zip / tar
files written here.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore

ROOT = Path(__file__).resolve().parent.parent


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _dist_name() -> str:
    return _project()["name"].replace("-", "_")


def _metadata() -> str:
    p = _project()
    lines = ["Metadata-Version: 2.1", f"Name: {p['name']}", f"Version: {p['version']}",
             f"Summary: {p.get('description', '')}", f"Requires-Python: {p.get('requires-python', '>=3')}"]
    lines += [f"Requires-Dist: {d}" for d in p.get("dependencies", [])]
    for extra, deps in p.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {d}; extra == \"{extra}\"" for d in deps]
    readme = ROOT / "README.md"
    if readme.is_file():
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + readme.read_text()
    return "\n".join(lines) + "\n"


def _platform_tag() -> str:
    """The wheel's platform tag, honest about what was built: the machine's
    own platform (not manylinux: nothing here audits the .so's symbol versions)."""
    plat = sysconfig.get_platform()
    if plat.startswith("macosx"):
        _, version, arch = plat.split("-", 2)
        major = version.split(".")[0]
        return f"macosx_{max(int(major), 11)}_0_{arch}"
    return plat.replace("-", "_").replace(".", "_")


def _build_library() -> Path:
    """Runs scripts/build.sh (SwiftPM) and returns pyfa/_lib."""
    if shutil.which("swift") is None:
        raise RuntimeError(
            "pyfa: building needs the Swift toolchain (`swift` on PATH, Swift 6 or newer; "
            "https://www.swift.org/install), which builds the native library libpyfa")
    subprocess.run(["bash", str(ROOT / "scripts" / "build.sh")], cwd=ROOT, check=True)
    lib = ROOT / "pyfa" / "_lib"
    if not any(lib.glob("libpyfa.*")):
        raise RuntimeError(f"pyfa: scripts/build.sh left no libpyfa in {lib}")
    return lib


def _package_files() -> list[Path]:
    pkg = ROOT / "pyfa"
    files = [p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts]
    lib = pkg / "_lib"
    files += sorted(lib.glob("libpyfa.*")) + sorted((lib / "include").glob("*.h"))
    return sorted(set(files))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(directory: str, files: list[tuple[str, bytes]]) -> str:
    name, version = _dist_name(), _project()["version"]
    tag = f"py3-none-{_platform_tag()}"
    wheel_name = f"{name}-{version}-{tag}.whl"
    dist_info = f"{name}-{version}.dist-info"
    meta = [(f"{dist_info}/METADATA", _metadata().encode()),
            (f"{dist_info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: pyfa_build\nRoot-Is-Purelib: false\nTag: {tag}\n".encode())]
    records = []
    path = Path(directory) / wheel_name
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for arcname, data in files + meta:
            info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arcname.endswith((".so", ".dylib")) else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            records.append(_record_line(arcname, data))
        records.append(f"{dist_info}/RECORD,,")
        z.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
    return wheel_name


# ---- PEP 517 hooks ----

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_library()
    files = [(str(p.relative_to(ROOT)), p.read_bytes()) for p in _package_files()]
    return _write_wheel(wheel_directory, files)


def build_sdist(sdist_directory, config_settings=None):
    """The tracked source tree (git ls-files when in a checkout)."""
    name, version = _dist_name(), _project()["version"]
    base = f"{name}-{version}"
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
        paths = [p for p in tracked.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".build", "__pycache__", "_lib", "bundle", "dist"}
        paths = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]
    out = Path(sdist_directory) / f"{base}.tar.gz"
    with tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT) as t:
        for rel in sorted(paths):
            t.add(ROOT / rel, arcname=f"{base}/{rel}", recursive=False)
        pkg_info = _metadata().encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        t.addfile(info, io.BytesIO(pkg_info))
    return out.name

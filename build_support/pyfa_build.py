"""PEP 517 build backend of pyfa: builds libpyfa with the Swift toolchain and
packs it, with its headers and the Python package, into a platform wheel.

The Python package loads libpyfa through cffi in ABI mode, so the wheel does
not depend on the Python version (``py3-none``) but does on the platform
(``linux_x86_64``, ``macosx_..._arm64``): a Linux .so must not install on a Mac.
No third-party build tools are needed; wheels and sdists are plain zip / tar
files written here.

The build runs in the source tree (pip builds local directories in place), so
an existing ``.build`` from ``scripts/build.sh`` or ``swift build -c release``
is reused and a rebuild after an edit is incremental.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import platform
import re
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
    """The wheel's platform tag, honest about what was built: the machine's own
    platform on Linux (not manylinux: nothing here audits the .so's symbol
    versions against a manylinux policy); on macOS the machine's architecture
    (SwiftPM builds for the host only, never universal2) and the deployment
    target Package.swift declares (the oldest macOS the library loads on)."""
    plat = sysconfig.get_platform()
    if plat.startswith("macosx"):
        declared = re.search(r"\.macOS\(\.v(\d+)\)", (ROOT / "Package.swift").read_text())
        major = max(int(declared.group(1)) if declared else 11, 11)
        return f"macosx_{major}_0_{platform.machine()}"
    return plat.replace("-", "_").replace(".", "_")


def _library_name() -> str:
    return "libpyfa.dylib" if sys.platform == "darwin" else "libpyfa.so"


class ToolchainError(SystemExit):
    """Building needs what is missing; raised as SystemExit so that pip shows
    this message as the build's last line instead of a traceback."""


_SWIFT_HINT = ("pyfa builds its native library (libpyfa) with the Swift toolchain, Swift 6 or newer "
               "(https://www.swift.org/install); put its bin directory on PATH")


def _check_toolchain() -> None:
    """Fails with a message naming the toolchain when `swift` is missing or older than 6."""
    swift = shutil.which("swift")
    if swift is None:
        raise ToolchainError(f"pyfa: `swift` was not found on PATH. {_SWIFT_HINT}.")
    try:
        banner = subprocess.run([swift, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"pyfa: `{swift} --version` failed ({e}). {_SWIFT_HINT}.") from None
    version = re.search(r"Swift version (\d+)\.", banner)
    if version is None or int(version.group(1)) < 6:
        found = banner.strip().splitlines()[0] if banner.strip() else "no version banner"
        raise ToolchainError(f"pyfa: {swift} is not Swift 6 or newer ({found}). {_SWIFT_HINT}.")


def _build_library() -> Path:
    """Runs scripts/build.sh (SwiftPM) and returns pyfa/_lib."""
    _check_toolchain()
    subprocess.run(["bash", str(ROOT / "scripts" / "build.sh")], cwd=ROOT, check=True)
    lib = ROOT / "pyfa" / "_lib"
    if not (lib / _library_name()).is_file():
        raise RuntimeError(f"pyfa: scripts/build.sh left no {_library_name()} in {lib}")
    return lib


def _package_files() -> list[Path]:
    """The package's Python files, the library built for this platform and the
    headers scripts/build.sh installs beside it (the cffi binding reads them at
    import); nothing else that may lie in pyfa/_lib."""
    pkg = ROOT / "pyfa"
    files = [p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts and "_lib" not in p.relative_to(pkg).parts]
    include = pkg / "_lib" / "include"
    headers = [p.name for p in (ROOT / "shaders" / "common").glob("*.h")] + ["pyfa.h"]
    missing = [h for h in headers if not (include / h).is_file()]
    if missing:
        raise RuntimeError(f"pyfa: scripts/build.sh left no {', '.join(missing)} in {include}")
    files += [pkg / "_lib" / _library_name()] + [include / h for h in headers]
    return sorted(set(files))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _dist_info_files() -> list[tuple[str, bytes]]:
    """(path, bytes) of the .dist-info files other than RECORD."""
    name, version = _dist_name(), _project()["version"]
    dist_info = f"{name}-{version}.dist-info"
    wheel = f"Wheel-Version: 1.0\nGenerator: pyfa_build\nRoot-Is-Purelib: false\nTag: py3-none-{_platform_tag()}\n"
    return [(f"{dist_info}/METADATA", _metadata().encode()), (f"{dist_info}/WHEEL", wheel.encode())]


def _write_wheel(directory: str, files: list[tuple[str, bytes]]) -> str:
    name, version = _dist_name(), _project()["version"]
    wheel_name = f"{name}-{version}-py3-none-{_platform_tag()}.whl"
    dist_info = f"{name}-{version}.dist-info"
    records = []
    path = Path(directory) / wheel_name
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for arcname, data in files + _dist_info_files():
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


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    """The wheel's metadata without building it, so a frontend resolves the
    dependencies before the (minutes-long when cold) Swift build starts."""
    for arcname, data in _dist_info_files():
        target = Path(metadata_directory) / arcname
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return _dist_info_files()[0][0].split("/")[0]


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

"""The README's Swift section shows the example app (examples/swift-app) as it is: every line of
its code snippet is a line of the app, and its manifest snippet's calls are the example
package's, so the snippet cannot drift from the program CI builds by version."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "swift-app"


def _swift_blocks():
    if not APP.is_dir():  # the wheel check and the GPU bundle run a copy of tests/ with README.md only
        pytest.skip(f"no {APP} (not a source tree)")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Swift\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```swift\n(.*?)```", section, re.S)


def test_readme_swift_snippet_lines_are_the_example_apps():
    blocks = _swift_blocks()
    code = [b for b in blocks if "import PyfaKit" in b]
    assert len(code) == 1, "the Swift section has one snippet importing PyfaKit"
    app_lines = {line.strip() for line in (APP / "Sources" / "PyfaApp" / "main.swift").read_text().splitlines()}
    missing = [line for line in code[0].splitlines() if line.strip() and line.strip() not in app_lines]
    assert not missing, f"README Swift lines not in examples/swift-app: {missing}"


def test_readme_swift_manifest_is_the_example_packages():
    manifest = [b for b in _swift_blocks() if ".package(url:" in b]
    assert len(manifest) == 1, "the Swift section has one manifest snippet"
    package = re.sub(r"\s", "", (APP / "Package.swift").read_text())
    calls = re.findall(r"\.(?:package|product)\([^()]*\)", re.sub(r"\s", "", manifest[0]))
    assert len(calls) == 2, calls
    for call in calls:
        assert call in package, f"{call} is not in examples/swift-app/Package.swift"

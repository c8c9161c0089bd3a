"""The documentation points only into the repository: every relative link of
README.md and docs/**/*.md, and every repository path written in backticks,
names a file or folder of this source tree, and none leaves it."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TOP = r"(?:pyfa|tests|scripts|docs|benchmarks|native|shaders|build_support|\.ci)"
_CODE_PATH = re.compile(rf"`({_TOP}/[\w./-]*[\w/])`")


def _documents():
    if not (ROOT / "Package.swift").is_file():
        pytest.skip(f"{ROOT} is not a source tree (no Package.swift)")
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def dangling(text: str, doc_dir: Path, root: Path = ROOT) -> list[str]:
    """The links (relative to ``doc_dir``) and backticked repository paths of ``text`` that do
    not resolve inside ``root``."""
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of this page
        path = (doc_dir / target.split("#")[0]).resolve()
        if not path.is_relative_to(root) or not path.exists():
            bad.append(f"link {target}")
    for written in _CODE_PATH.findall(text):
        if not (root / written).exists():
            bad.append(f"path `{written}`")
    return bad


def test_documentation_points_inside_the_repository():
    problems = {str(d.relative_to(ROOT)): dangling(d.read_text(), d.parent) for d in _documents()}
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, f"links or paths that do not resolve inside the repository: {problems}"


def test_dangling_finds_links_and_paths_outside(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / "scripts" / "setup.sh").write_text("")
    (root / "README.md").write_text("")
    (tmp_path / "elsewhere.md").write_text("")  # exists, but outside the repository
    text = ("[up](../../elsewhere.md) [ok](../README.md) [web](https://example.org) [a](#x)\n"
            "`scripts/no_such_script.sh` `scripts/setup.sh`\n")
    assert dangling(text, root / "docs", root.resolve()) == ["link ../../elsewhere.md",
                                                            "path `scripts/no_such_script.sh`"]

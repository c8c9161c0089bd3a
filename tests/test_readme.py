"""Every ```python block of README.md runs, each on its own (a fresh namespace:
a snippet must define or import what it uses), against the pyfa that the
suite imports. A snippet that raises fails here, with the README line numbers
in its traceback.

What a snippet needs beyond numpy and pyfa is read from its code, so the
README needs no markers: ``import torch`` needs torch, ``import transformers``
(or ``pyfa.integrations.transformers``) needs transformers, ``device="cuda"``
needs a CUDA GPU that both torch and pyfa open, and ``from_pretrained(``
needs a model checkpoint, which tests never download. Such snippets skip,
saying what is missing.
"""
import importlib.util
import re
from pathlib import Path

import pytest

import pyfa

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^#+\s+(.*)$")


def python_blocks(text: str):
    """(first code line number, section heading, code) of each ```python block."""
    blocks, heading, lang, start, lines = [], "", None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, lines = fence.group(1), number + 1, []
            elif _HEADING.match(line):
                heading = _HEADING.match(line).group(1)
        elif line.strip() == "```":
            if lang == "python":
                blocks.append((start, heading, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    if lang is not None:
        raise AssertionError(f"README.md: the ``` block opened at line {start - 1} is never closed")
    return blocks


def missing_requirement(code: str) -> str | None:
    """Why this snippet cannot run here, or None."""
    imports = set(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", code, re.M))
    imports |= {m for line in re.findall(r"^\s*import\s+(.+)$", code, re.M) for m in re.findall(r"[\w.]+", line)}
    if "from_pretrained(" in re.sub(r"#.*", "", code):  # a call, not a comment mentioning one
        return "loads a pretrained model checkpoint (tests do not download models)"
    needs_transformers = any(m.split(".")[0] == "transformers" or m == "pyfa.integrations.transformers"
                             for m in imports)
    if needs_transformers and importlib.util.find_spec("transformers") is None:
        return "needs transformers (not installed)"
    needs_cuda = re.search(r"""device\s*=\s*["']cuda""", code) is not None
    if ("torch" in imports or needs_cuda) and importlib.util.find_spec("torch") is None:
        return "needs torch (not installed)"
    if needs_cuda:
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA GPU (torch sees none)"
        if "cuda" not in pyfa.available_backends():
            return "needs a CUDA GPU (pyfa's cuda backend does not open)"
    return None


BLOCKS = python_blocks(README.read_text()) if README.is_file() else []


def test_readme_has_python_snippets():
    if not README.is_file():
        pytest.skip(f"no README.md beside {Path(__file__).parent} (not a source tree)")
    assert len(BLOCKS) >= 3, "README.md: expected its ```python usage snippets"


@pytest.mark.parametrize("start,heading,code", BLOCKS, ids=[f"line{s}" for s, _, _ in BLOCKS])
def test_readme_snippet_runs(start, heading, code):
    default = pyfa.default_device()
    if default.backend == "metal" and not default.is_gpu:
        # The snippets' shapes are realistic ones (16 s a run on the executor in
        # checking mode); the executor passes run the ops' own tests instead.
        pytest.skip("README snippets run on the CPU and GPUs, not on the Metal backend's CPU executor")
    reason = missing_requirement(code)
    if reason:
        pytest.skip(f"README.md line {start} ({heading}): {reason}")
    # Blank lines in front keep the README's line numbers in tracebacks.
    compiled = compile("\n" * (start - 1) + code, str(README), "exec")
    exec(compiled, {"__name__": "__readme__"})


def test_block_parser_reads_fences_and_headings():
    text = "# A\n```python\nx = 1\n```\n## B\n    indented\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(3, "A", "x = 1\n"), (11, "B", "y = 2\nz = 3\n")]
    with pytest.raises(AssertionError, match="never closed"):
        python_blocks("```python\nx = 1\n")


def test_requirements_are_read_from_the_code():
    assert missing_requirement("import numpy as np, pyfa\n") is None
    assert "checkpoint" in missing_requirement("m = AutoModel.from_pretrained(path)\n")
    if importlib.util.find_spec("torch") is None:
        assert "torch" in missing_requirement("import torch, pyfa\n")
        assert "torch" in missing_requirement('x = make(device="cuda")\n')
    if importlib.util.find_spec("transformers") is None:
        assert "transformers" in missing_requirement("import pyfa.integrations.transformers as hf\n")

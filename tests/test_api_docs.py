"""docs/API.md is what scripts/gen_api_docs.py writes from the docstrings of
the pyfa this suite imports (so a docstring edit without regenerating the
page fails here, and so does a public name without a docstring), and the
docstrings' ``>>>`` examples run."""
import doctest
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

import pyfa

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "scripts" / "gen_api_docs.py"
PAGE = ROOT / "docs" / "API.md"
# Every module of the package whose docstrings carry examples (or may).
EXAMPLE_MODULES = ["pyfa", "pyfa.decode", "pyfa.prefill", "pyfa.device", "pyfa.kvcache", "pyfa.turboquant",
                   "pyfa.reference", "pyfa.errors", "pyfa.dtypes", "pyfa.integrations",
                   "pyfa.integrations.transformers"]


def _generator():
    if not GENERATOR.is_file() or not PAGE.is_file():
        pytest.skip(f"scripts/gen_api_docs.py or docs/API.md not beside {Path(__file__).parent} (not a source tree)")
    spec = importlib.util.spec_from_file_location("gen_api_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_page_is_current():
    gen = _generator()
    try:
        page = gen.render()
    except gen.MissingDoc as e:
        pytest.fail(f"{e}: every public name needs a docstring (then run `{gen.REGENERATE}`)")
    assert page == PAGE.read_text(), f"docs/API.md is stale: run `{gen.REGENERATE}` and commit it"


def test_api_page_covers_every_public_name():
    text = PAGE.read_text() if PAGE.is_file() else pytest.skip("no docs/API.md (not a source tree)")
    for name in pyfa.__all__:
        assert f"`pyfa.{name}`" in text, f"docs/API.md does not document pyfa.{name}"


def test_generator_refuses_a_public_name_without_a_docstring(monkeypatch):
    gen = _generator()

    def undocumented(x):
        return x

    monkeypatch.setattr(pyfa, "undocumented", undocumented, raising=False)
    monkeypatch.setattr(pyfa, "__all__", pyfa.__all__ + ["undocumented"])
    with pytest.raises(gen.MissingDoc, match="pyfa.undocumented has no docstring"):
        gen.render()


@pytest.mark.parametrize("name", EXAMPLE_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed (output above)"
    if ">>>" in inspect.getsource(module):
        assert result.attempted > 0, f"{name}: its source has examples, but none was found to run"

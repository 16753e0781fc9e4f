"""Every public name has a docstring with an example, and the examples run (doctest)."""

import doctest
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import linbackprop as lbp

# every module with a docstring example (found, so that a new or split module is not missed)
ALL_MODULES = sorted(".".join(f.relative_to(Path(lbp.__file__).parent).with_suffix("").parts).removesuffix(".__init__")
                     for f in Path(lbp.__file__).parent.rglob("*.py") if f.name != "__main__.py")
MODULES = [m for m in ALL_MODULES if ">>> " in inspect.getsource(importlib.import_module(f"linbackprop.{m}"))]


@pytest.mark.parametrize("name", lbp.__all__)
def test_public_names_have_docstrings_with_examples(name):
    doc = inspect.getdoc(getattr(lbp, name)) or ""
    assert len(doc) > 80 and ">>>" in doc, f"lbp.{name} needs a docstring with a runnable example"


@pytest.mark.slow  # the docstrings' examples: the slow tier, with the guides' code
@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    with jax.enable_x64(False):
        mod = importlib.import_module(f"linbackprop.{module}")
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


def _python_blocks(path: Path) -> list[str]:
    return [b.split("```", 1)[0] for b in path.read_text().split("```python\n")[1:]]


def _run_blocks(relative: str) -> int:
    """Run the Python blocks of one page in order, in one namespace (as a reader would)."""
    blocks = _python_blocks(ROOT / relative)
    namespace: dict = {}
    with jax.enable_x64(False):
        for block in blocks:
            exec(compile(block, relative, "exec"), namespace)
    return len(blocks)


def test_readme_python_blocks_run():
    """The quick start of README.md runs as written."""
    assert _run_blocks("README.md") >= 1


@pytest.mark.slow  # the docs' code: the slow tier (README's quick start stays in the default one)
@pytest.mark.parametrize("page", [p for p in PAGES if _python_blocks(ROOT / p)])
def test_guide_python_blocks_run(page):
    """Every Python block of the documentation runs as written (guides, getting started)."""
    assert _run_blocks(page) >= 1


def test_guides_have_code():
    """The guides that show code keep showing it (a page losing its blocks would pass silently)."""
    with_code = {p for p in PAGES if _python_blocks(ROOT / p)}
    expected = {"docs/getting-started.md", "docs/guides/networks.md", "docs/guides/sequences.md",
                "docs/guides/curvature.md", "docs/guides/bring-your-model.md", "docs/guides/training.md",
                "docs/guides/influence.md"}
    assert expected <= with_code


def api_page(name: str) -> str:
    """The API page of a public name, relative to docs/: a function whose name differs from a
    class's only in case (``capture`` and ``Capture``) gets ``-function`` (no two pages may differ
    only in case: a macOS or Windows checkout would hold one of them)."""
    twin = any(other != name and other.lower() == name for other in lbp.__all__)
    return f"api/{name}-function.md" if twin else f"api/{name}.md"


def test_every_public_name_has_an_api_page_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in lbp.__all__:
        page = ROOT / "docs" / api_page(name)
        assert page.exists() and f"::: linbackprop.{name}" in page.read_text(), api_page(name)
        assert f"{api_page(name)}" in nav, f"mkdocs.yml's nav lacks {api_page(name)}"


def test_no_two_files_differ_only_in_case():
    """A case-insensitive file system (macOS, Windows) holds one of two such files."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [f.lower() for f in tracked.splitlines()]
    assert files and len(files) == len(set(files)), sorted({f for f in files if files.count(f) > 1})


@pytest.mark.slow  # the docs build: the slow tier
def test_docs_site_builds_strictly(tmp_path):
    """mkdocs build --strict: a broken link or cross-reference, a page outside the nav, or a
    docstring mkdocstrings cannot render fails the build."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    page = (tmp_path / "api" / "grad_by_solve" / "index.html").read_text()
    # the signature formatted one parameter a line (ruff, in the test and docs extras), the name once
    signature = re.sub(r"<[^>]+>", "", page[page.index("doc-signature"):][:4000])
    assert "\n    fun: Callable,\n" in signature, signature[:400]
    assert page.count("<h1") == 1
    # each function's page a parameter table, each class's its attributes (or its arguments)
    for name in lbp.__all__:
        obj = getattr(lbp, name)
        if issubclass(obj, Exception) if inspect.isclass(obj) else not inspect.signature(obj).parameters:
            continue
        html = (tmp_path / api_page(name).removesuffix(".md") / "index.html").read_text()
        titles = re.findall(r'doc-section-title">(\w+):<', html)
        assert {"Parameters", "Attributes"} & set(titles), (name, titles)
    # one result, one row: a Returns description whose continuation lines were not indented
    # came out as one row per line, each with the type again
    for html in (tmp_path / "api").rglob("index.html"):
        for section in html.read_text().split('doc-section-title">Returns:<')[1:]:
            body = section.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
            assert body.count("<tr") == 1, f"{html.parent.name}: a Returns table of {body.count('<tr')} rows"
    # no formula made emphasis: two subscripts in plain text (Σ_k … F_(t−k)) became <em>…</em>
    for html in (tmp_path / "api").rglob("index.html"):
        for em in re.findall(r"<em>([^<]*)</em>", html.read_text()):
            assert not re.search(r"[=^Σ∑/]", em), f"{html.parent.name}: math rendered as emphasis: {em!r}"
    # every docstring example renders as code (an "Example:" header made one prose)
    for html in (tmp_path / "api").rglob("index.html"):
        text = re.sub(r"<pre.*?</pre>", "", html.read_text(), flags=re.S)
        assert "&gt;&gt;&gt;" not in text, f"{html.parent.name}: an example rendered outside a code block"
    # Offline: no stylesheet, script or font from another host.
    index = (tmp_path / "index.html").read_text()
    # math left for KaTeX by arithmatex, KaTeX shipped with the site
    assert 'class="arithmatex"' in index and (tmp_path / "javascripts" / "katex" / "katex.min.js").exists()
    assert "fonts.googleapis" not in index and "cdn." not in index


GUIDES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md")) + [
    "docs/getting-started.md", "docs/index.md"]


@pytest.mark.parametrize("page", GUIDES)
def test_user_pages_speak_of_the_library_not_its_history(page):
    """Guides are for users: no private module names (implementation goes to architecture.md)
    and no issue numbers (history goes to the CHANGELOG and the performance notes)."""
    text = (ROOT / page).read_text()
    assert "linbackprop/_" not in text and not re.search(r"`_(engine|plan|transforms|curvature|outer|solve|checkpoint|"
                                                         r"stacking|graph|operators|settings|traced)\b", text), page
    assert not re.search(r"\b[Ii]ssue #\d", text), page


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_pages_name_no_path_outside_the_repository(page):
    """A reader's checkout has only the repository: no ../ tools, no machine's absolute paths."""
    text = (ROOT / page).read_text()
    assert not re.search(r"\.\./shared|/work/|/root/|/home/|/tmp/", text), page


def _documents_its_parameters(where: str, fn, doc: str) -> None:
    parameters = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
    if parameters:
        args = doc.split("Args:", 1)[1].split("\n\n", 1)[0] if "Args:" in doc else ""
        for p in parameters:
            label = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
            assert re.search(rf"^    {re.escape(label)}:", args, flags=re.M), f"{where}: Args lacks {label}"


@pytest.mark.parametrize("name", lbp.__all__)
def test_public_names_document_their_parameters(name):
    """mkdocstrings renders Google style's sections as tables: a function's every parameter in
    ``Args:`` and its result in ``Returns:``; a class's ``Attributes:``, and every parameter of
    its public methods in their ``Args:``."""
    obj = getattr(lbp, name)
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj):
        assert "Attributes:" in doc, name
        for method, fn in inspect.getmembers(obj, predicate=inspect.isfunction):
            if not method.startswith("_"):
                _documents_its_parameters(f"{name}.{method}", fn, inspect.getdoc(fn) or "")
        return
    _documents_its_parameters(name, obj, doc)
    assert "Returns:" in doc, name


# A letter with a subscript or superscript written as plain text (U_i, H^{1/2}): on the API pages
# it is text, or emphasis where two underscores pair up; as TeX ($U_i$) KaTeX renders it.
PLAIN_MATH = re.compile(r"(?<![\w\\])[A-Za-zΛΦΘΓθλδμ∂]_(\{[^}]*\}|[A-Za-z0-9]{1,3})(?!\w)|\w\^[{(\w]")


def _prose(doc: str) -> str:
    """A docstring without its examples, code, TeX and link targets."""
    doc = "\n".join(line for line in doc.splitlines() if not line.strip().startswith((">>>", "...")))
    for pattern in (r"\$\$.*?\$\$", r"\$[^$]*\$", r"\\\(.*?\\\)", r"``.*?``", r"`[^`]*`", r"\]\[[^\]]*\]"):
        doc = re.sub(pattern, "", doc, flags=re.S)
    return doc


@pytest.mark.parametrize("name", lbp.__all__)
def test_public_docstrings_write_math_as_tex(name):
    """Math with subscripts or superscripts in the public docstrings (and their methods') is TeX."""
    obj = getattr(lbp, name)
    docs = [(name, inspect.getdoc(obj) or "")]
    if inspect.isclass(obj):
        docs += [(f"{name}.{m}", inspect.getdoc(f) or "") for m, f in inspect.getmembers(obj)
                 if not m.startswith("_") and (inspect.isfunction(f) or isinstance(f, property))]
    plain = [(where, m.group(0)) for where, doc in docs for m in PLAIN_MATH.finditer(_prose(doc))]
    assert not plain, plain


def test_math_renders_offline_with_the_katex_shipped():
    """pymdownx.arithmatex (generic) keeps the math for KaTeX, whose script, stylesheet and fonts
    are files of the site (no CDN); the home page writes its equations as TeX."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert "pymdownx.arithmatex" in config and "generic: true" in config
    scripts = re.findall(r"^  - (javascripts/\S+\.js)", config, flags=re.M)
    assert scripts and all((ROOT / "docs" / s).exists() for s in scripts), scripts
    css = (ROOT / "docs" / "javascripts" / "katex" / "katex.min.css").read_text()
    fonts = set(re.findall(r"url\((fonts/[^)]+)\)", css))
    assert fonts and all((ROOT / "docs" / "javascripts" / "katex" / f).exists() for f in fonts), fonts
    assert "$$" in (ROOT / "docs" / "index.md").read_text()


def test_every_example_links_to_its_source_page():
    """The examples page links each script in examples/ to its page, which the hook
    docs/hooks/example_pages.py makes from the script's source (the built site has it: no
    repository address needed); the site build test renders them."""
    spec = importlib.util.spec_from_file_location("example_pages", ROOT / "docs" / "hooks" / "example_pages.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    made = hook.pages()
    scripts = sorted((ROOT / "examples").glob("*.py"))
    assert sorted(made) == [f"examples/{s.stem}.md" for s in scripts]
    for script in scripts:
        assert script.read_text() in made[f"examples/{script.stem}.md"]
    listed = (ROOT / "docs" / "examples.md").read_text()
    links = re.findall(r"\[`examples/(\w+)\.py`\]\(examples/(\w+)\.md\)", listed)
    assert sorted(a for a, b in links if a == b) == [s.stem for s in scripts], links
    assert "docs/hooks/example_pages.py" in (ROOT / "mkdocs.yml").read_text()


def test_docstring_examples_fit_the_column():
    """The API pages show the examples as code blocks: 88 columns, as the guides."""
    wide = []
    for path in sorted((ROOT / "linbackprop").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.strip()
            if code.startswith((">>>", "...")) and len(code) > 88:
                wide.append(f"{path.relative_to(ROOT)}:{number}: {len(code)} characters")
    assert not wide, "\n".join(wide)


def test_docstring_examples_are_an_examples_section():
    """Google style's section is "Examples:"; mkdocstrings renders "Example:" or "Example (...):"
    as prose, the doctest lines run together."""
    for module in ALL_MODULES:
        source = inspect.getsource(importlib.import_module(f"linbackprop.{module}"))
        assert not re.search(r"^\s*Example\b(?!s:)", source, flags=re.M), module


def test_docstrings_have_no_sphinx_roles():
    """mkdocstrings renders markdown: :func:`x` showed as raw text on the API pages."""
    for module in ALL_MODULES:
        source = inspect.getsource(importlib.import_module(f"linbackprop.{module}"))
        assert not re.search(r":(func|class|meth|attr|mod):`", source), module


def test_api_pages_name_their_object_once_and_the_nav_groups_them():
    """Each API page is the object's own heading (no second title), and the nav groups the pages."""
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in lbp.__all__:
        text = (ROOT / "docs" / api_page(name)).read_text()
        assert not any(line.startswith("# ") for line in text.splitlines()), name
        assert nav.count(f"{api_page(name)}\n") == 1, name
    for group in ("Transforms", "Networks", "Operators", "Curvature", "Interop", "Pictures"):
        assert f"      - {group}:\n" in nav, group


GUIDES_ONLY = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md"))


@pytest.mark.parametrize("page", GUIDES_ONLY)
def test_guides_are_sections_with_headings(page):
    """A guide a reader scans: its parts are headings (the table of contents), not bold leads."""
    text = (ROOT / page).read_text()
    assert len(re.findall(r"^## ", text, flags=re.M)) >= 2, page
    assert not re.search(r"^\*\*[^*\n]+\.\*\* ", text, flags=re.M), f"{page}: a bold lead where a heading belongs"


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_code_lines_fit_the_column(page):
    """The docs' column shows about 95 characters of code at 1280 px: longer lines scroll
    sideways and hide their ends (88, as black and ruff format)."""
    lines, inside = [], False
    for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = not inside
        elif inside and len(line) > 88:
            lines.append(f"{page}:{number}: {len(line)} characters")
    assert not lines, "\n".join(lines)


def test_the_api_index_links_every_public_name_without_signatures():
    """The index lists every public name once, linked to its page; signatures live on the pages
    (generated from the code), so the index cannot fall out of date with them."""
    text = (ROOT / "docs" / "api" / "index.md").read_text()
    for name in lbp.__all__:
        link = f"[`{name}`]({api_page(name).removeprefix('api/')})"
        assert text.count(link) == 1, link
    assert not re.search(r"\[`\w+\(", text), "a signature in the index"
    # a table broken by a blank line drops its rows out of the table
    for table in re.split(r"\n\s*\n", text):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        if rows:
            assert rows[1].startswith("|---"), table[:200]

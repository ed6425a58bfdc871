"""Every repository path and first-party module the README and docs/ name exists.

What counts as a reference, in README.md and every docs/**/*.md:
- a Markdown link or image target that is not a URL: resolved against the doc's own folder (what a
  reader's click resolves); its `#anchor`, if any, must be a heading of the target;
- a token of an inline code span or of a fenced block whose first path segment is a top-level entry
  of the repository (`serving/model.py`, `docs/demo`, `models/demo-base`, `.ci/run`): resolved
  against the repository root, or the doc's folder. `*` must match something, `{a,b}` expands, and a
  segment with a placeholder (`<name>`, `{id}`, `…`) ends what is checked;
- a bare file name in a code span with a source or doc suffix (`run.sh`, `requirements*.txt`): a
  file of that name exists somewhere in the repository;
- a dotted name in a code span that starts with a first-party package (`core.supervisor`,
  `serving.engine.EmbeddedEngine`), and the module after `-m` (`python -m cli`): its longest module
  prefix is a file or package, and the first name after it, if any, is defined at that module's top
  level.

Not references: URLs, absolute paths (`/v1/feedback`, `/usr/bin/chromium`), `$FLYWHEEL_HOME/...`,
paths under a first segment that is not in the repository (`var/`, `.venv/`, `store/...`), and other
bare names (`config.json`, `keys.json`: files of a run, not of the repository).
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

PACKAGES = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])
MODULE_ROOTS = {*PACKAGES, "bench", "scripts", "tests"}
NOT_REPO = {"var", ".venv", ".git", "__pycache__"}  # FLYWHEEL_HOME's default and the venv: never in the repository


def _in_repo(name: str, is_dir: bool) -> bool:
    hidden_dir = name.startswith(".") and is_dir and name != ".ci"  # caches
    return name not in NOT_REPO and not name.endswith(".egg-info") and not hidden_dir


ROOTS = {*MODULE_ROOTS, "docs", "models", ".ci"} | {p.name for p in ROOT.iterdir() if _in_repo(p.name, p.is_dir())}
BARE_SUFFIXES = (".py", ".sh", ".md", ".toml", ".txt", ".yml", ".yaml", ".j2", ".cfg", ".ini")
FILE_SUFFIXES = {s.lstrip(".") for s in BARE_SUFFIXES} | {"json", "png", "db", "log", "prom", "fws", "safetensors"}

FENCE = re.compile(r"^ *(```|~~~)[^\n]*\n(.*?)^ *\1", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)
PLACEHOLDER = re.compile(r"[<>…$\[\]]|\{[^,}]*\}|\.\.\.")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


@dataclass(frozen=True)
class Doc:
    path: Path
    text: str

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    @functools.cached_property
    def prose(self) -> str:
        """The text outside fenced blocks."""
        return FENCE.sub("", self.text)

    @functools.cached_property
    def fences(self) -> list[str]:
        return [m.group(2) for m in FENCE.finditer(self.text)]

    @functools.cached_property
    def spans(self) -> list[str]:
        return [m.group(2) for m in SPAN.finditer(self.prose)]


def _tokens(text: str) -> list[str]:
    out = []
    for tok in text.split():
        tok = tok.strip("\"'()[],;:")
        tok = tok[2:] if tok.startswith("./") else tok
        if tok:
            out.append(tok)
    return out


# ---- paths ----------------------------------------------------------------------------------------


@functools.cache
def repo_file_names() -> frozenset[str]:
    names = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if _in_repo(d, True)]
        names.update(files)
    return frozenset(names)


def _expand(path: str) -> list[str]:
    """`a.{md,json}` -> a.md, a.json (brace groups with a comma; several groups multiply)."""
    groups = re.split(r"(\{[^{}]*,[^{}]*\})", path)
    choices = [g[1:-1].split(",") if g.startswith("{") and "," in g else [g] for g in groups]
    return ["".join(c) for c in itertools.product(*choices)]


def _checked_part(path: str) -> str | None:
    """What of `path` is checked: the segments before the first placeholder; None: not a repo path."""
    segments = []
    for seg in path.split("/"):
        if PLACEHOLDER.search(seg):
            break
        segments.append(seg)
    return "/".join(segments) if segments and segments[0] in ROOTS else None


def _exists(path: str, bases: list[Path]) -> bool:
    if "*" in path:
        return any(any(base.glob(path.rstrip("/"))) for base in bases)
    return any((base / path).exists() for base in bases)


def path_problems(doc: Doc) -> list[str]:
    problems = []
    for text in doc.spans + doc.fences:
        for tok in _tokens(text):
            if "/" not in tok or tok.startswith("/") or URL.match(tok):
                continue
            for path in _expand(tok):
                part = _checked_part(path)
                if part is not None and not _exists(part, [ROOT, doc.path.parent]):
                    problems.append(f"{doc.name}: `{tok}`: no {part}")
    for span in doc.spans:
        for tok in _tokens(span):
            if "/" in tok or not tok.endswith(BARE_SUFFIXES) or not re.fullmatch(r"[\w*.-]+", tok):
                continue
            pattern = re.compile(re.escape(tok).replace(r"\*", ".*"))
            if not any(pattern.fullmatch(n) for n in repo_file_names()):
                problems.append(f"{doc.name}: `{tok}`: no file of that name in the repository")
    return problems


# ---- links and anchors ----------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text in lower case, punctuation other than `-` and `_`
    dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*]", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    for m in HEADING.finditer(FENCE.sub("", text)):
        s = slug(m.group(1))
        seen[s] = seen.get(s, 0) + 1
        if seen[s] > 1:
            seen[f"{s}-{seen[s] - 1}"] = 1
    return set(seen)


def link_problems(doc: Doc) -> list[str]:
    problems = []
    for m in LINK.finditer(doc.prose):
        target = m.group(1)
        if URL.match(target) or target.startswith("//"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.path.parent / path).resolve() if path else doc.path
        if path and not file.exists():
            problems.append(f"{doc.name}: link ({target}): no {os.path.relpath(file, ROOT)}")
        elif anchor and file.suffix == ".md":
            text = file.read_text() if path else doc.text
            if anchor not in anchors(text):
                problems.append(f"{doc.name}: link ({target}): no heading #{anchor} in {os.path.relpath(file, ROOT)}")
    return problems


# ---- modules --------------------------------------------------------------------------------------


@functools.cache
def top_level_names(module: Path) -> frozenset[str]:
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))):
                    visit(block)

    visit(ast.parse(module.read_text()).body)
    return frozenset(names)


def module_problem(dotted: str) -> str | None:
    """None when `dotted` is a module or package, optionally followed by names, the first of them
    defined at the module's top level; else what is missing."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    if not here.is_dir():
        return f"no package {parts[0]}/"
    module, i = here / "__init__.py", 1
    while i < len(parts):
        if (here / parts[i]).is_dir():
            here = here / parts[i]
            module, i = here / "__init__.py", i + 1
        elif (here / f"{parts[i]}.py").is_file():
            module, i = here / f"{parts[i]}.py", i + 1
            break
        else:
            break
    if i == len(parts) or (module.is_file() and parts[i] in top_level_names(module)):
        return None
    return f"no module or name {parts[i]!r} in {os.path.relpath(module if module.is_file() else here, ROOT)}"


def module_problems(doc: Doc) -> list[str]:
    refs = []
    for span in doc.spans:
        for tok in _tokens(span):
            m = DOTTED.match(tok)
            if m and m.group(0).split(".")[0] in MODULE_ROOTS and "/" not in tok and not PLACEHOLDER.search(m.group(0)):
                if m.group(0).rsplit(".", 1)[1] in FILE_SUFFIXES and module_problem(m.group(0)):
                    continue  # a file name such as `demo.md` or `registry.db`, not a module
                refs.append(m.group(0))
    for text in doc.spans + doc.fences:
        words = [w.strip("\"'`,;") for w in text.split()]
        for prev, word in zip(words, words[1:]):
            if prev == "-m" and word.split(".")[0] in MODULE_ROOTS and not PLACEHOLDER.search(word):
                refs.append(word)
    return [f"{doc.name}: `{ref}`: {why}" for ref in dict.fromkeys(refs) if (why := module_problem(ref))]


def problems(doc: Doc) -> list[str]:
    return path_problems(doc) + link_problems(doc) + module_problems(doc)


# ---- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_module_a_doc_names_exists(path):
    found = problems(Doc(path, path.read_text()))
    assert not found, "\n".join(found)


PROBE = ROOT / "docs" / "probe.md"  # never written: the text is given


@pytest.mark.parametrize(
    "text",
    [
        "`demo/product.py`",
        "`serving/modle.py`",
        "`a gateway: python -m core.cli serve`",
        "[x](../serving/nothing.py)",
        "[x](serving/model.py)",  # relative to docs/: not there
        "[x](design.md#no-such-heading)",
        "[x](#no-such-heading)",
        "`core.cli`",
        "`serving.engine.NoSuchEngine`",
        "`docs/demo/report.{md,txt}`",
        "`feedback/*.pyx`",
        "`nothere.sh`",
        "```bash\n.venv/bin/python scripts/screenshots.py\n```",
    ],
)
def test_the_check_catches_a_missing_path_or_module(text):
    assert problems(Doc(PROBE, f"# Probe\n\n{text}\n")), text


@pytest.mark.parametrize(
    "text",
    [
        "`serving/model.py`, `docs/demo.md`, `models/demo-base`, `scripts/run.sh`, `.ci/run`, `tests/serving`",
        "[x](design.md#processes), [y](../README.md), [z](#probe), ![p](demo/report.png)",
        "`core.supervisor`, `serving.engine.EmbeddedEngine`, `registry.registry.Registry.heartbeat`",
        "`python -m cli serve`, `python -m scripts.demo_screenshots`, `-m pytest`",
        "`registry.db`, `demo.md`, `keys.json`, `run.sh`, `requirements*.txt`, `flywheel.feedback`",
        "`docs/demo/report.{md,json,png}`, `docs/demo/report.*`, `feedback/*.py`, `bench/results/<name>.json`",
        "`$FLYWHEEL_HOME/models/demo-base`, `<home>/metrics/joiner.prom`, `var/demo-report/demo/seed0`",
        "`store/v0007.delta.fws`, `/v1/feedback`, `/usr/bin/chromium`, `http://127.0.0.1:8000/dashboard`",
        "[x](https://example.com/a/b.py), `postgresql+psycopg://…`, `DIR/report.{json,md,png}`",
        "```\n product ──HTTP──▶ gateway (api/) ──▶ fleet (serving/)\n```",
    ],
)
def test_the_check_passes_what_exists_or_is_no_repo_path(text):
    assert not problems(Doc(PROBE, f"# Probe\n\n{text}\n"))

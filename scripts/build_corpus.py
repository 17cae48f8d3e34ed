#!/usr/bin/env python3
"""Build the seeded prompt -> answer conversation corpus used to train small models.

Three domains are produced from text found on any Debian machine with Python:

* ``code``  -- bodies of Python standard-library functions, prompted by their signature
  (and docstring, when there is one);
* ``prose`` -- ``pydoc_data`` language-reference topics, stdlib module/class/function
  docstrings and a seeded sample of rendered man pages (sections 1, 5 and 8);
* ``math``  -- generated multi-step arithmetic word problems with worked solutions.

Usage::

    python scripts/build_corpus.py --out data/corpus [--seed 0] [--eval-prompts zoo/eval_prompts]

Every output is a deterministic function of the seed and of the text installed on the
machine, so two runs on the same machine produce byte-identical files.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import gzip
import hashlib
import inspect
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import tokenize
from decimal import Decimal
from pathlib import Path
from typing import Callable, Iterable, Sequence

DOMAINS: tuple[str, ...] = ("code", "prose", "math")
HELDOUT_FRACTION = 0.05
EVAL_PROMPTS_PER_DOMAIN = 120
EVAL_MIN_ANSWER_CHARS = 150

# --- code -----------------------------------------------------------------------------
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"})
CODE_MIN_BODY_LINES = 2
CODE_MAX_BODY_LINES = 60
CODE_MAX_ANSWER_CHARS = 2500
CODE_INSTRUCTIONS_DOC: tuple[str, ...] = (
    "Complete the body of this Python function from the `{module}` module.",
    "Implement the following function from the Python standard library module `{module}`.",
    "Write the implementation of this function (module `{module}`), following its docstring.",
    "Fill in the body so that this `{module}` function does what its docstring says.",
    "Continue this Python function definition from `{module}`.",
)
CODE_INSTRUCTIONS_NODOC: tuple[str, ...] = (
    "Write the body of this Python function from the `{module}` module.",
    "Implement this function from the Python standard library module `{module}`.",
    "Complete the following function definition (module `{module}`).",
)

# --- prose ----------------------------------------------------------------------------
TOPIC_MAX_CHARS = 1500
TOPIC_MIN_CHARS = 100
DOCSTRING_MIN_CHARS = 200
MAN_SECTIONS: tuple[str, ...] = ("man1", "man5", "man8")
MAN_ROOT = Path("/usr/share/man")
MAN_SAMPLE = 600
MAN_PER_GROUP = 10
MAN_TIMEOUT_S = 10.0
MAN_WORKERS = 2
MAN_MIN_CHARS = 120
MAN_MAX_CHARS = 2000
MAN_MAX_CHUNKS_PER_SECTION = 3
MAN_MAX_CONVS_PER_PAGE = 12
MAN_MAX_SHARE = 0.60
MAN_SKIP_SECTIONS = frozenset(
    {"NAME", "SEE ALSO", "AUTHOR", "AUTHORS", "COPYRIGHT", "REPORTING BUGS", "COLOPHON", "LICENSE", "LICENCE"}
)
MAN_KINDS = {"man1": "command", "man5": "file format", "man8": "administration command"}
MAN_HEADING_RE = re.compile(r"[A-Z][A-Z0-9 ,/&()'_-]{1,39}")
TOPIC_FIRST: tuple[str, ...] = (
    "Explain {label} in Python.",
    "How does {label} work in Python?",
    "Tell me about {label} in Python.",
    "What should I know about {label} in Python?",
)
TOPIC_NEXT: tuple[str, ...] = (
    "Continue explaining {label} in Python (part {part}).",
    "Tell me more about {label} in Python (part {part}).",
)
MODULE_PROMPTS: tuple[str, ...] = (
    "What does the Python module `{name}` provide?",
    "Describe the `{name}` module from the Python standard library.",
    "What is the purpose of the Python module `{name}`?",
)
CLASS_PROMPTS: tuple[str, ...] = (
    "Describe the class `{name}`.",
    "What is the class `{name}` in the Python standard library?",
    "Explain what the Python class `{name}` is for.",
)
FUNCTION_PROMPTS: tuple[str, ...] = (
    "What does the function `{name}` do?",
    "Describe the Python function `{name}`.",
    "Explain the standard library function `{name}`.",
)
METHOD_PROMPTS: tuple[str, ...] = (
    "What does the method `{name}` do?",
    "Describe the Python method `{name}`.",
)
MAN_FIRST: tuple[str, ...] = (
    "Describe the {sec} section of the `{cmd}` manual page.",
    "What does the `{cmd}` man page say under {SEC}?",
    "Summarize the {sec} of the `{cmd}` {kind}.",
    "Explain the {sec} of the `{cmd}` {kind}.",
)
MAN_NEXT: tuple[str, ...] = (
    "Continue the {sec} section of the `{cmd}` manual page (part {part}).",
    "Go on describing the {sec} of the `{cmd}` {kind} (part {part}).",
)

# --- math -----------------------------------------------------------------------------
MATH_TRAIN = 30_000
NAMES: tuple[str, ...] = (
    "Ava", "Ben", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jonas",
    "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara",
    "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe", "Amir", "Bea", "Carlos", "Dina",
    "Emil", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Marco", "Nina",
)
# (singular, plural, min cents, max cents)
SHOP_ITEMS: tuple[tuple[str, str, int, int], ...] = (
    ("notebook", "notebooks", 120, 480), ("pen", "pens", 40, 250), ("apple", "apples", 30, 120),
    ("loaf of bread", "loaves of bread", 180, 450), ("bottle of juice", "bottles of juice", 150, 400),
    ("T-shirt", "T-shirts", 600, 2500), ("book", "books", 500, 2400), ("candle", "candles", 150, 900),
    ("cup of coffee", "cups of coffee", 180, 520), ("pack of stickers", "packs of stickers", 100, 400),
    ("sandwich", "sandwiches", 350, 900), ("ticket", "tickets", 500, 1800), ("plant pot", "plant pots", 250, 1200),
    ("bag of rice", "bags of rice", 200, 800), ("pair of socks", "pairs of socks", 250, 900),
)
# (container plural, item plural)
CONTAINERS: tuple[tuple[str, str], ...] = (
    ("boxes", "pencils"), ("crates", "oranges"), ("bags", "marbles"), ("trays", "cookies"), ("packs", "cards"),
    ("cartons", "eggs"), ("jars", "candies"), ("baskets", "apples"), ("shelves", "books"), ("rolls", "stickers"),
)
VEHICLES: tuple[str, ...] = ("car", "bus", "train", "truck", "motorbike", "van")
GOODS: tuple[str, ...] = ("bike", "game", "jacket", "guitar", "tablet", "camera", "pair of skates", "telescope")
# (singular, plural, min dollars, max dollars)
SALE_GOODS: tuple[tuple[str, str, int, int], ...] = (
    ("jacket", "jackets", 40, 180), ("pair of shoes", "pairs of shoes", 30, 150), ("lamp", "lamps", 15, 90),
    ("backpack", "backpacks", 20, 120), ("board game", "board games", 12, 70), ("watch", "watches", 50, 300),
    ("blender", "blenders", 25, 140), ("chair", "chairs", 20, 200), ("scarf", "scarves", 8, 45),
    ("headphone set", "headphone sets", 20, 250),
)
WORKERS: tuple[tuple[str, str], ...] = (
    ("machine", "bottles"), ("printer", "pages"), ("worker", "boxes"), ("robot", "parts"),
    ("baker", "rolls"), ("volunteer", "envelopes"),
)


@dataclasses.dataclass
class Conv:
    """One prompt/answer pair together with the group used for the held-out split."""

    group: str
    user: str
    assistant: str
    continuation: bool = False

    @property
    def chars(self) -> int:
        """Total number of characters in both turns."""
        return len(self.user) + len(self.assistant)


@dataclasses.dataclass
class SourceFile:
    """A parsed standard-library source file."""

    rel: str
    module: str
    lines: list[str]
    tree: ast.Module


def make_rng(seed: int, stream: str) -> random.Random:
    """Return an independent, reproducible random stream named ``stream``."""
    return random.Random(f"dspark-corpus:{seed}:{stream}")


# ======================================================================================
# Standard-library sources
# ======================================================================================


def list_stdlib_files(root: Path) -> list[Path]:
    """List ``.py`` files under ``root`` in sorted order, skipping test/tool directories."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def module_name(rel: str) -> str:
    """Turn a path relative to the stdlib root into a dotted module name."""
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def parse_stdlib(root: Path) -> list[SourceFile]:
    """Read and parse every usable stdlib file; unreadable or unparsable files are skipped."""
    parsed: list[SourceFile] = []
    for path in list_stdlib_files(root):
        try:
            with tokenize.open(path) as fh:
                source = fh.read()
            tree = ast.parse(source, filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        rel = path.relative_to(root).as_posix()
        parsed.append(SourceFile(rel, module_name(rel), source.splitlines(keepends=True), tree))
    return parsed


def stmt_first_line(stmt: ast.stmt) -> int:
    """Return the first source line of a statement, including any decorators."""
    decorators = getattr(stmt, "decorator_list", None) or []
    return min([stmt.lineno] + [d.lineno for d in decorators])


def strip_prefix(lines: Sequence[str], prefix: str) -> str:
    """Remove the def's indentation ``prefix`` from each line (as much of it as is present)."""
    out = []
    for line in lines:
        if line.startswith(prefix):
            out.append(line[len(prefix):])
        else:
            lead = len(line) - len(line.lstrip(" \t"))
            out.append(line[min(lead, len(prefix)):])
    return "".join(out)


def trim_blank_lines(text: str) -> str:
    """Drop leading and trailing blank lines and trailing whitespace at the end."""
    lines = text.splitlines(keepends=True)
    while lines and not lines[0].strip():
        lines.pop(0)
    return "".join(lines).rstrip() + "\n" if lines else ""


def functions_in_order(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Return every (async) function or method in the module, nested ones included, in source order."""
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def extract_function(
    src: SourceFile, node: ast.FunctionDef | ast.AsyncFunctionDef, include_undocumented: bool
) -> tuple[str, str, bool] | None:
    """Slice a function into (signature [+ docstring], body) text, or None if unsuitable."""
    has_doc = ast.get_docstring(node, clean=False) is not None
    if not has_doc and not include_undocumented:
        return None
    if len(node.body) < (2 if has_doc else 1) or node.end_lineno is None:
        return None
    def_line = src.lines[node.lineno - 1]
    if not def_line.lstrip().startswith(("def ", "async ")):
        return None
    prefix = def_line[: len(def_line) - len(def_line.lstrip(" \t"))]
    if has_doc:
        doc = node.body[0]
        if doc.end_lineno is None or stmt_first_line(node.body[1]) <= doc.end_lineno:
            return None
        head_end = doc.end_lineno
    else:
        head_end = stmt_first_line(node.body[0]) - 1
        if head_end < node.lineno:
            return None
    head = strip_prefix(src.lines[node.lineno - 1 : head_end], prefix).rstrip() + "\n"
    body = trim_blank_lines(strip_prefix(src.lines[head_end : node.end_lineno], prefix))
    n_lines = sum(1 for line in body.splitlines() if line.strip())
    if not CODE_MIN_BODY_LINES <= n_lines <= CODE_MAX_BODY_LINES or len(body) > CODE_MAX_ANSWER_CHARS:
        return None
    try:
        ast.parse(head + body)
    except SyntaxError:
        return None
    return head, body, has_doc


def build_code(sources: Sequence[SourceFile], seed: int, include_undocumented: bool) -> list[Conv]:
    """Build code conversations (grouped by source file) in deterministic order."""
    rng = make_rng(seed, "code-prompts")
    seen: set[tuple[str, str]] = set()
    convs: list[Conv] = []
    for src in sources:
        for node in functions_in_order(src.tree):
            sliced = extract_function(src, node, include_undocumented)
            if sliced is None:
                continue
            head, body, has_doc = sliced
            if (head, body) in seen:
                continue
            seen.add((head, body))
            phrasings = CODE_INSTRUCTIONS_DOC if has_doc else CODE_INSTRUCTIONS_NODOC
            instruction = rng.choice(phrasings).format(module=src.module)
            convs.append(Conv(group=src.rel, user=f"{instruction}\n\n{head.rstrip()}", assistant=body))
    return convs


# ======================================================================================
# Prose: pydoc topics
# ======================================================================================


def is_underline(line: str, title: str, chars: str) -> bool:
    """True when ``line`` is an RST-style underline (of one of ``chars``) for ``title``."""
    s = line.strip()
    if not title.strip() or len(s) < 3 or s[0] not in chars or set(s) != {s[0]}:
        return False
    return len(s) >= len(title.strip()) - 2


def pack_paragraphs(text: str, max_chars: int) -> list[str]:
    """Greedily pack blank-line separated paragraphs into chunks of at most ``max_chars``."""
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text.strip("\n")):
        if not para.strip():
            continue
        if len(para) <= max_chars:
            pieces.append(para.rstrip())
            continue
        current = ""
        for line in para.splitlines():
            while len(line) > max_chars:
                if current:
                    pieces.append(current)
                    current = ""
                pieces.append(line[:max_chars])
                line = line[max_chars:]
            if current and len(current) + 1 + len(line) > max_chars:
                pieces.append(current)
                current = line
            else:
                current = f"{current}\n{line}" if current else line
        if current.strip():
            pieces.append(current.rstrip())
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        if current and len(current) + 2 + len(piece) > max_chars:
            chunks.append(current)
            current = piece
        else:
            current = f"{current}\n\n{piece}" if current else piece
    if current:
        chunks.append(current)
    return chunks


def label_words(title: str) -> str:
    """Lower-case capitalised title words ("Format String Syntax" -> "format string syntax")."""
    keep = {"Python", "Unicode", "ASCII", "I/O"}
    words = [w.lower() if re.fullmatch(r"[A-Z][a-z]+", w) and w not in keep else w for w in title.split(" ")]
    return " ".join(words)


def split_topic(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Split a pydoc topic into its title and (section label, section text) pairs."""
    lines = text.splitlines()
    title = ""
    if len(lines) > 1 and is_underline(lines[1], lines[0], "*"):
        title, lines = lines[0].strip(), lines[2:]
    sections: list[tuple[str, list[str]]] = [(title, [])]
    i = 0
    while i < len(lines):
        heading = bool(lines[i].strip()) and not lines[i].startswith(" ")
        if heading and i + 1 < len(lines) and is_underline(lines[i + 1], lines[i], "=-~"):
            sections.append((lines[i].strip(), []))
            i += 2
            continue
        sections[-1][1].append(lines[i])
        i += 1
    return title, [(label or title, "\n".join(body)) for label, body in sections if "\n".join(body).strip()]


def build_topic_convs(seed: int) -> list[Conv]:
    """Turn ``pydoc_data.topics`` into explanation conversations grouped by topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    rng = make_rng(seed, "prose-topics")
    convs: list[Conv] = []
    seen_texts: set[str] = set()
    for key in sorted(topics):
        text = topics[key]
        if text in seen_texts:
            continue
        seen_texts.add(text)
        _title, sections = split_topic(text)
        for label, body in sections:
            chunks = [textwrap.dedent(c) for c in pack_paragraphs(textwrap.dedent(body), TOPIC_MAX_CHARS)]
            chunks = [c for c in chunks if len(c) >= TOPIC_MIN_CHARS]
            for idx, chunk in enumerate(chunks):
                templates = TOPIC_FIRST if idx == 0 else TOPIC_NEXT
                prompt = rng.choice(templates).format(label=label_words(label), part=idx + 1)
                convs.append(Conv(group=f"topic:{key}", user=prompt, assistant=chunk, continuation=idx > 0))
    return convs


# ======================================================================================
# Prose: stdlib docstrings
# ======================================================================================


def build_docstring_convs(sources: Sequence[SourceFile], seed: int) -> list[Conv]:
    """Module, class, function and method docstrings (>= 200 chars) grouped by source file."""
    rng = make_rng(seed, "prose-docstrings")
    convs: list[Conv] = []
    seen: set[str] = set()

    def add(templates: tuple[str, ...], name: str, doc: str | None, group: str) -> None:
        """Append one docstring conversation unless it is too short or already seen."""
        if not doc:
            return
        doc = inspect.cleandoc(doc).strip()
        if len(doc) < DOCSTRING_MIN_CHARS or doc in seen:
            return
        seen.add(doc)
        convs.append(Conv(group=group, user=rng.choice(templates).format(name=name), assistant=doc))

    for src in sources:
        add(MODULE_PROMPTS, src.module, ast.get_docstring(src.tree, clean=False), src.rel)
        for node in src.tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                add(CLASS_PROMPTS, f"{src.module}.{node.name}", ast.get_docstring(node, clean=False), src.rel)
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        name = f"{src.module}.{node.name}.{sub.name}"
                        add(METHOD_PROMPTS, name, ast.get_docstring(sub, clean=False), src.rel)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                add(FUNCTION_PROMPTS, f"{src.module}.{node.name}", ast.get_docstring(node, clean=False), src.rel)
    return convs


# ======================================================================================
# Prose: man pages
# ======================================================================================


def man_page_name(path: Path) -> str:
    """Return the command name of a man page file, e.g. ``ls`` for ``ls.1.gz``."""
    name = path.name[: -len(".gz")] if path.name.endswith(".gz") else path.name
    return name.rsplit(".", 1)[0] if "." in name else name


def is_so_redirect(path: Path) -> bool:
    """True when a man page source is only a ``.so`` include of another page."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rb") as fh:
            head = fh.read(256)
    except (OSError, EOFError):
        return True
    return head.lstrip().startswith(b".so ")


def sample_man_pages(seed: int, limit: int) -> list[Path]:
    """Pick a seeded, diversity-capped sample of English man pages (sections 1, 5, 8)."""
    rng = make_rng(seed, "man-sample")
    groups: dict[str, list[Path]] = {}
    for section in MAN_SECTIONS:
        directory = MAN_ROOT / section
        if not directory.is_dir():
            continue
        for entry in sorted(directory.iterdir()):
            if entry.is_symlink() or not entry.is_file():
                continue
            key = re.split(r"[-_.]", man_page_name(entry), maxsplit=1)[0].lower() or entry.name
            groups.setdefault(key, []).append(entry)
    candidates: list[Path] = []
    for key in sorted(groups):
        members = sorted(groups[key])
        rng.shuffle(members)
        candidates.extend(members[:MAN_PER_GROUP])
    candidates.sort()
    rng.shuffle(candidates)
    chosen: list[Path] = []
    for path in candidates:
        if len(chosen) >= limit:
            break
        if not is_so_redirect(path):
            chosen.append(path)
    return sorted(chosen)


def render_man_page(path: Path) -> str | None:
    """Render one man page to plain text (``man -l`` | ``col -bx``); None on failure."""
    drop = {"MAN_KEEP_FORMATTING", "MANPAGER", "PAGER", "MANOPT", "MANROFFOPT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"MANWIDTH": "80", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "MAN_DISABLE_SECCOMP": "1"})
    try:
        raw = subprocess.run(
            ["man", "--no-hyphenation", "--no-justification", "-l", str(path)],
            env=env, capture_output=True, timeout=MAN_TIMEOUT_S, check=True,
        ).stdout
        plain = subprocess.run(
            ["col", "-bx"], input=raw, env=env, capture_output=True, timeout=MAN_TIMEOUT_S, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    text = plain.decode("utf-8", errors="replace")
    return text if text.strip() else None


def man_sections(text: str) -> list[tuple[str, str]]:
    """Split a rendered man page into (HEADING, dedented body) pairs."""
    lines = [line.rstrip() for line in text.splitlines()]
    nonblank = [i for i, line in enumerate(lines) if line.strip()]
    if len(nonblank) < 3:
        return []
    lines = lines[nonblank[0] + 1 : nonblank[-1]]  # drop running header and footer
    sections: list[tuple[str, list[str]]] = []
    for line in lines:
        if line and not line[0].isspace() and MAN_HEADING_RE.fullmatch(line):
            sections.append((line.strip(), []))
        elif sections:
            sections[-1][1].append(line)
    result = []
    for heading, body in sections:
        cleaned = re.sub(r"\n{3,}", "\n\n", textwrap.dedent("\n".join(body))).strip("\n")
        if cleaned.strip():
            result.append((heading, cleaned))
    return result


def man_page_convs(path: Path, text: str, rng: random.Random, seen: set[str]) -> list[Conv]:
    """Build the conversations for one rendered man page, skipping answers already in ``seen``."""
    cmd = man_page_name(path)
    kind = MAN_KINDS.get(path.parent.name, "command")
    convs: list[Conv] = []
    for heading, body in man_sections(text):
        if heading in MAN_SKIP_SECTIONS:
            continue
        sec = heading.lower()
        chunks = [textwrap.dedent(c) for c in pack_paragraphs(body, MAN_MAX_CHARS)]
        chunks = [c for c in chunks if len(c) >= MAN_MIN_CHARS]
        for idx, chunk in enumerate(chunks[:MAN_MAX_CHUNKS_PER_SECTION]):
            if chunk in seen:
                continue
            seen.add(chunk)
            templates = MAN_FIRST if idx == 0 else MAN_NEXT
            prompt = rng.choice(templates).format(sec=sec, SEC=heading, cmd=cmd, kind=kind, part=idx + 1)
            group = f"man:{path.parent.name}/{path.name}"
            convs.append(Conv(group=group, user=prompt, assistant=chunk, continuation=idx > 0))
            if len(convs) >= MAN_MAX_CONVS_PER_PAGE:
                return convs
    return convs


def build_man_convs(seed: int, limit: int) -> tuple[list[list[Conv]], int]:
    """Render a sample of man pages; return per-page conversation lists and pages rendered."""
    if limit <= 0 or shutil.which("man") is None or shutil.which("col") is None:
        return [], 0
    paths = sample_man_pages(seed, limit)
    with concurrent.futures.ThreadPoolExecutor(max_workers=MAN_WORKERS) as pool:
        rendered = list(pool.map(render_man_page, paths))
    rng = make_rng(seed, "man-prompts")
    pages: list[list[Conv]] = []
    seen: set[str] = set()
    n_ok = 0
    for path, text in zip(paths, rendered):
        if text is None:
            continue
        n_ok += 1
        convs = man_page_convs(path, text, rng, seen)
        if convs:
            pages.append(convs)
    return pages, n_ok


def build_prose(sources: Sequence[SourceFile], seed: int, man_limit: int) -> tuple[list[Conv], dict[str, int]]:
    """Assemble prose conversations, capping man pages at ~60% of prose characters."""
    topics = build_topic_convs(seed)
    docs = build_docstring_convs(sources, seed)
    pages, n_rendered = build_man_convs(seed, man_limit)
    other_chars = sum(c.chars for c in topics + docs)
    budget = other_chars * MAN_MAX_SHARE / (1.0 - MAN_MAX_SHARE)
    order = list(range(len(pages)))
    make_rng(seed, "man-balance").shuffle(order)
    keep: set[int] = set()
    used = 0
    for i in order:
        size = sum(c.chars for c in pages[i])
        if used + size <= budget:
            keep.add(i)
            used += size
    man = [c for i in sorted(keep) for c in pages[i]]
    stats = {"man_pages_rendered": n_rendered, "man_pages_used": len(keep), "topic_convs": len(topics),
             "docstring_convs": len(docs), "man_convs": len(man)}
    return topics + docs + man, stats


# ======================================================================================
# Math word problems
# ======================================================================================

Problem = tuple[str, list[str], str]


def money(value: Decimal) -> str:
    """Format a Decimal amount of money as ``$12.34``."""
    return f"${value:.2f}"


def plural(n: int, word: str) -> str:
    """Return ``"1 hour"`` / ``"3 hours"`` style counts."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def cents(rng: random.Random, lo: int, hi: int, step: int = 5) -> Decimal:
    """Draw a price between ``lo`` and ``hi`` cents (multiple of ``step``) as Decimal dollars."""
    return Decimal(rng.randrange(lo // step, hi // step + 1) * step) / 100


def p_shopping(rng: random.Random) -> Problem:
    """Buying several items at unit prices, optionally paying with a bill and getting change."""
    name = rng.choice(NAMES)
    picks = rng.sample(SHOP_ITEMS, rng.choice((2, 2, 3)))
    steps: list[str] = []
    parts: list[str] = []
    costs: list[Decimal] = []
    for _one, many, lo, hi in picks:
        qty, price = rng.randint(2, 9), cents(rng, lo, hi)
        cost = qty * price
        costs.append(cost)
        parts.append(f"{qty} {many} at {money(price)} each")
        steps.append(f"{qty} {many} × {money(price)} = {money(cost)}.")
    total = sum(costs, Decimal(0))
    steps.append(" + ".join(money(c) for c in costs) + f" = {money(total)} in total.")
    listing = ", ".join(parts[:-1]) + f" and {parts[-1]}"
    if rng.random() < 0.6:
        bill = next((Decimal(b) for b in (10, 20, 50, 100, 200, 500) if b >= total), Decimal(1000))
        steps.append(f"{money(bill)} − {money(total)} = {money(bill - total)} change.")
        question = f"{name} buys {listing}, and pays with a {money(bill)} bill. How much change does {name} get?"
        return question, steps, f"{bill - total:.2f}"
    question = f"{name} buys {listing}. How much does {name} spend?"
    return question, steps, f"{total:.2f}"


def p_containers(rng: random.Random) -> Problem:
    """Counting items in containers, then giving some away or adding more."""
    name = rng.choice(NAMES)
    (c1, item), n1, per1 = rng.choice(CONTAINERS), rng.randint(2, 12), rng.randint(4, 24)
    n2, per2 = rng.randint(2, 9), rng.randint(3, 15)
    first, second = n1 * per1, n2 * per2
    total = first + second
    given = rng.randint(1, total - 1)
    question = (f"{name} has {n1} {c1} of {per1} {item} and {n2} smaller {c1} of {per2} {item}. "
                f"{name} gives away {given} {item}. How many {item} are left?")
    steps = [
        f"{n1} × {per1} = {first} {item}.",
        f"{n2} × {per2} = {second} {item}.",
        f"{first} + {second} = {total} {item}.",
        f"{total} − {given} = {total - given} {item} left.",
    ]
    return question, steps, str(total - given)


def p_travel(rng: random.Random) -> Problem:
    """Distance from speed and time over two legs, optionally the distance still to go."""
    vehicle = rng.choice(VEHICLES)
    s1, t1 = rng.randrange(30, 121, 5), rng.randint(1, 5)
    s2, t2 = rng.randrange(30, 121, 5), rng.randint(1, 4)
    d1, d2 = s1 * t1, s2 * t2
    steps = [f"{s1} km/h × {t1} h = {d1} km.", f"{s2} km/h × {t2} h = {d2} km.", f"{d1} + {d2} = {d1 + d2} km."]
    intro = f"A {vehicle} travels at {s1} km/h for {plural(t1, 'hour')}, then at {s2} km/h for {plural(t2, 'hour')}."
    if rng.random() < 0.5:
        trip = d1 + d2 + rng.randrange(10, 400, 5)
        steps.append(f"{trip} − {d1 + d2} = {trip - d1 - d2} km still to go.")
        return f"{intro} The whole trip is {trip} km. How many kilometres are left?", steps, str(trip - d1 - d2)
    return f"{intro} How far does it travel in total?", steps, str(d1 + d2)


def p_round_trip(rng: random.Random) -> Problem:
    """Time needed for a round trip at constant speed, plus a rest stop."""
    name = rng.choice(NAMES)
    speed, hours = rng.randrange(10, 81, 5), rng.randint(2, 8)
    while (speed * hours) % 2:
        hours += 1
    one_way, rest = speed * hours // 2, rng.choice((15, 30, 45, 60, 90))
    steps = [
        f"2 × {one_way} km = {speed * hours} km in total.",
        f"{speed * hours} km ÷ {speed} km/h = {hours} hours.",
        f"{hours} hours = {hours * 60} minutes.",
        f"{hours * 60} + {rest} = {hours * 60 + rest} minutes.",
    ]
    question = (f"{name} rides {one_way} km to a lake and back at {speed} km/h, "
                f"and rests for {rest} minutes at the lake. How many minutes does the whole outing take?")
    return question, steps, str(hours * 60 + rest)


def p_sharing(rng: random.Random) -> Problem:
    """Equal sharing with a remainder, or the number of containers needed."""
    name = rng.choice(NAMES)
    (container, item), trays, per = rng.choice(CONTAINERS), rng.randint(2, 9), rng.randint(6, 30)
    extra, k = rng.randint(1, 20), rng.randint(3, 12)
    total = trays * per + extra
    q, r = divmod(total, k)
    steps = [f"{trays} × {per} = {trays * per} {item}.", f"{trays * per} + {extra} = {total} {item}.",
             f"{total} ÷ {k} = {q} remainder {r}."]
    intro = f"{name} has {trays} full {container} of {per} {item} plus {extra} loose {item}."
    mode = rng.randrange(3)
    if mode == 0:
        question = f"{intro} They are shared equally among {k} friends. How many {item} does each friend get?"
        return question, steps, str(q)
    if mode == 1:
        steps.append(f"{r} {item} are left over.")
        return f"{intro} They are shared equally among {k} friends. How many {item} are left over?", steps, str(r)
    need = q + (1 if r else 0)
    if r:
        steps.append(f"{q} + 1 = {need} packets, because {r} {item} still need a packet.")
    else:
        steps.append(f"{q} packets are exactly full.")
    return f"{intro} They are packed into packets of {k}. How many packets are needed?", steps, str(need)


def p_discount(rng: random.Random) -> Problem:
    """Percentage discount on a price, times a quantity, optionally minus a coupon."""
    name, (one, many, lo, hi) = rng.choice(NAMES), rng.choice(SALE_GOODS)
    price, pct, qty = Decimal(rng.randint(lo, hi)), rng.choice((5, 10, 15, 20, 25, 30, 40, 50)), rng.randint(1, 6)
    off = price * pct / 100
    sale = price - off
    total = sale * qty
    what = one if qty == 1 else many
    steps = [f"{money(price)} × {pct}% = {money(price)} × {pct} ÷ 100 = {money(off)} off.",
             f"{money(price)} − {money(off)} = {money(sale)} each."]
    steps.append(f"{qty} × {money(sale)} = {money(total)}." if qty > 1 else f"1 {one} costs {money(sale)}.")
    question = f"A {one} costs {money(price)} and is on sale for {pct}% off. {name} buys {qty} {what}."
    if rng.random() < 0.4 and total > 10:
        coupon = Decimal(rng.randint(1, min(20, int(total) - 1)))
        steps.append(f"{money(total)} − {money(coupon)} = {money(total - coupon)}.")
        question += f" {name} also uses a {money(coupon)} coupon."
        total -= coupon
    return f"{question} How much does {name} pay?", steps, f"{total:.2f}"


def p_savings(rng: random.Random) -> Problem:
    """Savings over weeks: money left after a purchase, or weeks needed to reach a goal."""
    name, thing = rng.choice(NAMES), rng.choice(GOODS)
    start, weekly = rng.randint(0, 120), rng.randrange(5, 61, 5)
    if rng.random() < 0.5:
        weeks = rng.randint(3, 20)
        saved = weekly * weeks
        cost = rng.randint(10, start + saved - 1) if start + saved > 10 else start + saved
        left = start + saved - cost
        steps = [f"${weekly} × {weeks} weeks = ${saved}.", f"${start} + ${saved} = ${start + saved}.",
                 f"${start + saved} − ${cost} = ${left}."]
        question = (f"{name} has ${start} and saves ${weekly} every week. After {weeks} weeks, "
                    f"{name} buys a {thing} for ${cost}. How many dollars does {name} have left?")
        return question, steps, str(left)
    goal = start + rng.randint(weekly + 1, weekly * 25)
    need = goal - start
    q, r = divmod(need, weekly)
    weeks = q + (1 if r else 0)
    steps = [f"${goal} − ${start} = ${need} still needed.", f"${need} ÷ ${weekly} = {q} remainder {r}."]
    if r:
        steps.append(f"{q} + 1 = {weeks} weeks, since {plural(q, 'week')} is not quite enough.")
    else:
        steps.append(f"Exactly {plural(q, 'week')}.")
    question = (f"{name} wants a {thing} that costs ${goal}. {name} already has ${start} and saves ${weekly} "
                f"each week. How many weeks until {name} can buy it?")
    return question, steps, str(weeks)


def p_geometry(rng: random.Random) -> Problem:
    """Rectangle perimeter (fence cost) or area minus a square patch."""
    length, width = rng.randint(4, 60), rng.randint(3, 40)
    if rng.random() < 0.5:
        price = rng.randint(2, 25)
        per = 2 * (length + width)
        steps = [f"{length} + {width} = {length + width} m.", f"2 × {length + width} = {per} m of fence.",
                 f"{per} × ${price} = ${per * price}."]
        question = (f"A rectangular garden is {length} m long and {width} m wide. Fencing costs ${price} "
                    f"per metre. How many dollars does it cost to fence the whole garden?")
        return question, steps, str(per * price)
    side = rng.randint(1, max(1, min(length, width) - 1))
    area, patch = length * width, side * side
    steps = [f"{length} × {width} = {area} m².", f"{side} × {side} = {patch} m².",
             f"{area} − {patch} = {area - patch} m²."]
    question = (f"A lawn is {length} m by {width} m. A square flower bed with {side} m sides is dug in it. "
                f"How many square metres of lawn remain?")
    return question, steps, str(area - patch)


def p_ages(rng: random.Random) -> Problem:
    """Chained age relations followed by a shift in time."""
    a, b, c = rng.sample(NAMES, 3)
    age_c, diff, mult, years = rng.randint(2, 15), rng.randint(1, 9), rng.randint(2, 4), rng.randint(1, 12)
    age_b = age_c + diff
    age_a = mult * age_b
    steps = [f"{c} is {age_c}, so {b} is {age_c} + {diff} = {age_b}.", f"{a} is {mult} × {age_b} = {age_a}."]
    if rng.random() < 0.5:
        steps.append(f"In {plural(years, 'year')}: {age_a} + {years} = {age_a + years}.")
        question = (f"{b} is {plural(diff, 'year')} older than {c}, and {a} is {mult} times as old as {b}. "
                    f"{c} is {age_c}. How old will {a} be in {plural(years, 'year')}?")
        return question, steps, str(age_a + years)
    total = age_a + age_b + age_c
    steps.append(f"{age_a} + {age_b} + {age_c} = {total}.")
    question = (f"{c} is {age_c}. {b} is {plural(diff, 'year')} older than {c}, and {a} is {mult} times as old as {b}. "
                f"What is the sum of their ages?")
    return question, steps, str(total)


def p_work(rng: random.Random) -> Problem:
    """Two workers with hourly rates: output over some hours, or hours to reach a target."""
    (worker, unit), r1, r2 = rng.choice(WORKERS), rng.randint(3, 40), rng.randint(3, 40)
    both = r1 + r2
    hours = rng.randint(2, 10)
    if rng.random() < 0.5:
        made = both * hours
        bad = rng.randint(2, max(2, made // 10))
        steps = [f"{r1} + {r2} = {both} {unit} per hour together.", f"{both} × {hours} = {made} {unit}.",
                 f"{made} − {bad} = {made - bad} good {unit}."]
        question = (f"One {worker} makes {r1} {unit} per hour and another makes {r2} per hour. They work "
                    f"together for {hours} hours, and {bad} of the {unit} are faulty. How many good {unit} are made?")
        return question, steps, str(made - bad)
    target = both * hours
    steps = [f"{r1} + {r2} = {both} {unit} per hour together.", f"{target} ÷ {both} = {hours} hours."]
    question = (f"One {worker} makes {r1} {unit} per hour and another makes {r2} per hour. Working together, "
                f"how many hours do they need to make {target} {unit}?")
    return question, steps, str(hours)


def p_inventory(rng: random.Random) -> Problem:
    """Stock level after deliveries and daily sales."""
    item = rng.choice(CONTAINERS)[1]
    stock, deliveries, size = rng.randint(20, 500), rng.randint(1, 6), rng.randint(10, 80)
    delivered = deliveries * size
    days = rng.randint(2, 14)
    per_day = rng.randint(2, max(2, (stock + delivered) // days))
    sold = per_day * days
    left = stock + delivered - sold
    steps = [f"{deliveries} × {size} = {delivered} {item} delivered.",
             f"{stock} + {delivered} = {stock + delivered} {item}.",
             f"{per_day} × {days} = {sold} {item} sold.",
             f"{stock + delivered} − {sold} = {left} {item}."]
    question = (f"A shop has {stock} {item}. It gets {deliveries} {'delivery' if deliveries == 1 else 'deliveries'} "
                f"of {size} {item} and then sells "
                f"{per_day} {item} a day for {days} days. How many {item} are left?")
    return question, steps, str(left)


MATH_TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    p_shopping, p_containers, p_travel, p_round_trip, p_sharing, p_discount, p_savings, p_geometry, p_ages,
    p_work, p_inventory,
)


def render_solution(steps: Sequence[str], answer: str) -> str:
    """Format worked steps, one per line, followed by the final ``Answer:`` line."""
    return "\n".join(f"Step {i}: {s}" for i, s in enumerate(steps, 1)) + f"\nAnswer: {answer}"


def generate_math(rng: random.Random, count: int, avoid: Sequence[Conv] = ()) -> list[Conv]:
    """Generate ``count`` distinct word problems sharing neither prompt nor solution with ``avoid``."""
    convs: list[Conv] = []
    seen = {c.user for c in avoid}
    avoid_solutions = {c.assistant for c in avoid}
    while len(convs) < count:
        template = rng.choice(MATH_TEMPLATES)
        question, steps, answer = template(rng)
        solution = render_solution(steps, answer)
        if question in seen or solution in avoid_solutions:
            continue
        seen.add(question)
        convs.append(Conv(group=template.__name__, user=question, assistant=solution))
    return convs


# ======================================================================================
# Splitting, writing, reporting
# ======================================================================================


def split_by_group(convs: Sequence[Conv], rng: random.Random, fraction: float) -> set[str]:
    """Choose whole groups, in seeded order, until they hold ``fraction`` of the conversations."""
    sizes: dict[str, int] = {}
    for c in convs:
        sizes[c.group] = sizes.get(c.group, 0) + 1
    order = sorted(sizes)
    rng.shuffle(order)
    target = fraction * len(convs)
    chosen: set[str] = set()
    taken = 0
    for group in order:
        if taken >= target:
            break
        chosen.add(group)
        taken += sizes[group]
    return chosen


def records(domain: str, convs: Iterable[tuple[int, Conv]]) -> list[dict[str, object]]:
    """Turn numbered conversations into JSON-ready records."""
    return [{"id": f"{domain}-{i:06d}", "domain": domain, "turns": [c.user, c.assistant]} for i, c in convs]


def write_jsonl(path: Path, rows: Sequence[dict[str, object]]) -> str:
    """Write rows as UTF-8 JSON lines and return the file's sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def choose_eval_prompts(domain: str, heldout: Sequence[tuple[int, Conv]], seed: int) -> list[dict[str, object]]:
    """Sample eval prompts (user turn only): held-out, self-contained, unique, long answers."""
    counts: dict[str, int] = {}
    for _i, conv in heldout:
        counts[conv.user] = counts.get(conv.user, 0) + 1
    eligible = [
        (i, conv) for i, conv in heldout
        if not conv.continuation and counts[conv.user] == 1 and len(conv.assistant) >= EVAL_MIN_ANSWER_CHARS
    ]
    if len(eligible) < EVAL_PROMPTS_PER_DOMAIN:
        print(f"warning: only {len(eligible)} eligible eval prompts for {domain}", file=sys.stderr)
    picked = make_rng(seed, f"eval-{domain}").sample(eligible, min(EVAL_PROMPTS_PER_DOMAIN, len(eligible)))
    picked.sort(key=lambda item: item[0])
    return [{"id": f"{domain}-{i:06d}", "domain": domain, "turns": [conv.user]} for i, conv in picked]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: build all domains, write files, print and save a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/corpus"), help="output directory for the jsonl splits")
    parser.add_argument("--seed", type=int, default=0, help="seed for every random choice")
    parser.add_argument("--eval-prompts", type=Path, default=Path("zoo/eval_prompts"),
                        help="directory for the evaluation prompts")
    parser.add_argument("--math-train", type=int, default=MATH_TRAIN, help="number of math training problems")
    parser.add_argument("--man-pages", type=int, default=MAN_SAMPLE, help="max man pages to render (0 disables)")
    parser.add_argument("--code-docstring-only", action="store_true",
                        help="only use functions that have a docstring (smaller code domain)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = parse_stdlib(stdlib)
    print(f"parsed {len(sources)} stdlib files from {stdlib} ({time.perf_counter() - t0:.1f}s)", flush=True)

    splits: dict[str, tuple[list[Conv], list[Conv]]] = {}
    code = build_code(sources, args.seed, include_undocumented=not args.code_docstring_only)
    held_files = split_by_group(code, make_rng(args.seed, "split-code"), HELDOUT_FRACTION)
    splits["code"] = ([c for c in code if c.group not in held_files], [c for c in code if c.group in held_files])
    print(f"code: {len(code)} conversations ({time.perf_counter() - t0:.1f}s)", flush=True)

    prose, prose_stats = build_prose(sources, args.seed, args.man_pages)
    held_prose: set[str] = {c.group for c in prose if c.group in held_files}  # docstrings follow the code split
    for kind in ("topic:", "man:"):
        part = [c for c in prose if c.group.startswith(kind)]
        held_prose |= split_by_group(part, make_rng(args.seed, f"split-prose-{kind}"), HELDOUT_FRACTION)
    splits["prose"] = ([c for c in prose if c.group not in held_prose], [c for c in prose if c.group in held_prose])
    print(f"prose: {len(prose)} conversations {prose_stats} ({time.perf_counter() - t0:.1f}s)", flush=True)

    math_train = generate_math(make_rng(args.seed, "math-train"), args.math_train)
    n_math_held = round(args.math_train * HELDOUT_FRACTION / (1.0 - HELDOUT_FRACTION))
    math_held = generate_math(make_rng(args.seed, "math-heldout"), n_math_held, avoid=math_train)
    splits["math"] = (math_train, math_held)

    manifest: dict[str, object] = {
        "seed": args.seed,
        "python": platform.python_version(),
        "stdlib_files": len(sources),
        "code_docstring_only": args.code_docstring_only,
        "prose_sources": prose_stats,
        "files": {},
    }
    files: dict[str, dict[str, object]] = {}
    lines = [f"{'file':<34} {'convs':>7} {'chars':>11}  sha256"]
    for domain in DOMAINS:
        train, held = splits[domain]
        numbered = list(enumerate(train + held))  # ids are unique across both splits
        train_rows = records(domain, numbered[: len(train)])
        held_rows = records(domain, numbered[len(train):])
        eval_rows = choose_eval_prompts(domain, numbered[len(train):], args.seed)
        outputs = (
            (args.out / f"{domain}_train.jsonl", train_rows),
            (args.out / f"{domain}_heldout.jsonl", held_rows),
            (args.eval_prompts / f"{domain}.jsonl", eval_rows),
        )
        for path, rows in outputs:
            digest = write_jsonl(path, rows)
            chars = sum(len(t) for r in rows for t in r["turns"])  # type: ignore[union-attr]
            files[path.as_posix()] = {"conversations": len(rows), "chars": chars, "sha256": digest}
            lines.append(f"{path.as_posix():<34} {len(rows):>7} {chars:>11}  {digest}")
    manifest["files"] = files
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(f"done in {time.perf_counter() - t0:.1f}s; manifest: {(args.out / 'manifest.json').as_posix()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

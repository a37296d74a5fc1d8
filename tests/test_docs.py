"""The documentation holds together: its links resolve and its commands run as quoted.

README.md and docs/*.md link to each other's sections and quote commands to copy. A
renamed heading, a moved page, a script or flag that no longer exists would leave a
reader with a dead link or a command that fails; these tests fail first. Commands are
read from fenced shell blocks and inline code: ``python -m simulations.NAME ...`` (also
``.venv/bin/python -m ...`` and ``python -m fedpers.simulations.NAME``) must name a
script under simulations/ and only long options its ``--help`` lists; ``make TARGET``
must name a target of the Makefile.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
SCRIPT_MODULE = re.compile(r"^(?:fedpers\.)?simulations\.(\w+)$")
LONG_OPTION = re.compile(r"--[A-Za-z0-9][\w-]*")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "do", "then", "else"}


# ----------------------------------------------------------------------- reading
def without_code(text: str) -> str:
    """``text`` without fenced blocks and inline code, where links are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation other than '-' and
    '_' dropped, spaces turned into '-' (markup removed first: a link keeps its text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``; a repeated heading gets '-1', '-2', ..."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The link targets of ``page`` that are not URLs (``path``, ``path#a``, ``#a``)."""
    targets = LINK.findall(without_code(page.read_text()))
    return [t for t in targets if not SCHEME.match(t)]


def shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def link_defect(page: Path, target: str) -> str | None:
    """Why ``target``, a link of ``page``, does not resolve, or None."""
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    if not destination.exists():
        return f"{target}: {shown(destination)} does not exist"
    if anchor:
        if destination.suffix != ".md":
            return f"{target}: an anchor into {destination.name}, which is not markdown"
        if anchor not in anchors(destination):
            return f"{target}: no heading of {shown(destination)} has anchor '{anchor}'"
    return None


def command_lines(text: str) -> Iterator[str]:
    """Each shell line of the fenced shell blocks (continuations joined) and each inline
    code span of ``text`` (spans that wrap across lines joined)."""
    for match in FENCE.finditer(text):
        if match.group(2).strip().lower() in SHELL_FENCES:
            yield from match.group(3).replace("\\\n", " ").splitlines()
    for span in INLINE_CODE.findall(FENCE.sub("", text)):
        yield " ".join(span.split())


def tokens(line: str) -> list[str]:
    """Shell words of ``line``, with separators (``;``, ``&&``, ``|``) apart and comments
    dropped; a line that does not parse as shell (a quote left open) is split on blanks."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:
        return line.split()


@dataclass(frozen=True)
class ScriptCall:
    """``python -m MODULE FLAGS...`` as quoted on a page."""

    module: str
    script: str
    flags: tuple[str, ...]
    line: str


def script_calls(line: str) -> list[ScriptCall]:
    """Every call of a simulations script in ``line``, with the long options it passes."""
    words = tokens(line)
    calls = []
    for i, word in enumerate(words[:-2]):
        if Path(word).name not in {"python", "python3"} or words[i + 1] != "-m":
            continue
        match = SCRIPT_MODULE.match(words[i + 2])
        if match is None:
            continue
        flags = []
        for argument in words[i + 3 :]:
            if argument in SEPARATORS:
                break
            if LONG_OPTION.fullmatch(argument.split("=", 1)[0]):
                flags.append(argument.split("=", 1)[0])
        calls.append(ScriptCall(words[i + 2], match.group(1), tuple(flags), line.strip()))
    return calls


def make_targets_called(line: str) -> list[str]:
    """The targets of every ``make TARGET`` in ``line`` (``make`` as a command)."""
    words = tokens(line)
    return [
        words[i + 1]
        for i, word in enumerate(words[:-1])
        if word == "make"
        and (i == 0 or words[i - 1] in SEPARATORS)
        and not words[i + 1].startswith("-")
    ]


def makefile_targets() -> set[str]:
    """The explicit targets of the Makefile."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_][\w.-]*)[ \t]*:(?!=)", text, re.M))
    for phony in re.findall(r"^\.PHONY:(.*)$", text, re.M):
        targets.update(phony.split())
    return targets


def long_options(help_text: str) -> set[str]:
    """The long options an argparse ``--help`` lists: in its usage and its option lines
    (the invocation part, before the description)."""
    usage = help_text.split("\n\n", 1)[0]
    options = set(LONG_OPTION.findall(usage))
    for line in help_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("-"):
            options.update(LONG_OPTION.findall(re.split(r"\s{2,}", stripped)[0]))
    return options


def script_file(module: str) -> Path | None:
    """The file of a simulations module (``fedpers.simulations.X`` is simulations/X.py,
    or fedpers/simulations/X.py if the folder lives there), or None."""
    name = module.rsplit(".", 1)[1]
    for folder in (ROOT / "simulations", ROOT / "fedpers" / "simulations"):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    return None


def all_calls() -> list[tuple[Path, ScriptCall]]:
    return [
        (page, call)
        for page in PAGES
        for line in command_lines(page.read_text())
        for call in script_calls(line)
    ]


# One interpreter runs every quoted script's ``--help`` as ``python -m`` would (runpy),
# so the scripts that import torch, scikit-learn or Flower's server at the top cost that
# import once, not once each; each help (or why it failed) goes to a JSON file.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
target, modules, helps = sys.argv[1], sys.argv[2:], {}
for module in modules:
    sys.argv, out, code = [module, "--help"], io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException as error:
        code = f"{type(error).__name__}: {error}"
    helps[module] = [code, out.getvalue()]
with open(target, "w") as file:
    json.dump(helps, file)
"""


@pytest.fixture(scope="module")
def accepted_options(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str] | str]:
    """The long options of every script quoted with flags, from its ``--help`` (run
    once per script), or why its ``--help`` failed."""
    modules = sorted(
        {call.module for _, call in all_calls() if call.flags and script_file(call.module)}
    )
    target = tmp_path_factory.mktemp("helps") / "helps.json"
    done = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, str(target), *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    options: dict[str, set[str] | str] = {}
    for module, (code, text) in json.loads(target.read_text()).items():
        ok = code in (0, None)
        options[module] = long_options(text) if ok else f"--help failed ({code})"
    return options


def page_id(page: Path) -> str:
    return shown(page)


# ------------------------------------------------------------------------ checks
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page: Path) -> None:
    defects = [d for t in relative_links(page) if (d := link_defect(page, t)) is not None]
    assert defects == []


# One worker for every page: accepted_options runs every script's --help once.
@pytest.mark.xdist_group("script-helps")
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_quoted_script_exists_and_takes_its_flags(
    page: Path, accepted_options: dict[str, set[str] | str]
) -> None:
    defects = []
    for where, call in all_calls():
        if where != page:
            continue
        if script_file(call.module) is None:
            defects.append(f"{call.line}: no script simulations/{call.script}.py")
            continue
        if not call.flags:
            continue
        accepted = accepted_options[call.module]
        if isinstance(accepted, str):
            defects.append(f"{call.line}: {call.module} {accepted}")
            continue
        unknown = [f for f in call.flags if f not in accepted]
        if unknown:
            defects.append(f"{call.line}: {call.module} does not take {', '.join(unknown)}")
    assert defects == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_quoted_make_target_exists(page: Path) -> None:
    targets = makefile_targets()
    called = [t for line in command_lines(page.read_text()) for t in make_targets_called(line)]
    assert sorted(set(called) - targets) == []


def test_the_pages_are_there_and_the_checks_see_what_they_quote() -> None:
    names = {page_id(p) for p in PAGES}
    assert {
        "README.md",
        "docs/architecture.md",
        "docs/benchmarks.md",
        "docs/configuration.md",
        "docs/deploying.md",
        "docs/extending.md",
        "docs/reproducing.md",
    } <= names
    readme = ROOT / "README.md"
    # The README links to every page of docs/.
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in relative_links(readme)}
    assert {p.resolve() for p in PAGES if p.parent.name == "docs"} <= linked
    calls = all_calls()
    assert {c.script for p, c in calls if p == readme} >= {"fedrep_images"}
    assert len({c.script for _, c in calls}) >= 8
    assert {"run", "test"} <= {
        t for line in command_lines(readme.read_text()) for t in make_targets_called(line)
    }


# ------------------------------------------------------- the readers on their own
def test_github_slug_follows_githubs_rule() -> None:
    assert github_slug("Quick start") == "quick-start"
    assert github_slug("By hand with `flwr run`") == "by-hand-with-flwr-run"
    assert github_slug("Where the time went, and what was done about it") == (
        "where-the-time-went-and-what-was-done-about-it"
    )
    assert github_slug("Faults, attacks, checkpoints, determinism") == (
        "faults-attacks-checkpoints-determinism"
    )
    assert github_slug("A simulation across machines (Ray cluster)") == (
        "a-simulation-across-machines-ray-cluster"
    )
    assert github_slug("FedRep, Figures 3-4 (linear)") == "fedrep-figures-3-4-linear"
    assert github_slug("[Linked](x.md) client_app.py") == "linked-client_apppy"


def test_links_in_code_are_not_links_and_urls_are_skipped(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\nSee [a](other.md#part), [b](#title), [c](https://example.org/x)\n"
        "and `[d](not-a-link.md)`.\n\n```sh\necho [e](neither.md)\n```\n"
    )
    (tmp_path / "other.md").write_text("## Part\n\n```sh\n# not a heading\n```\n")
    assert relative_links(page) == ["other.md#part", "#title"]
    assert anchors(tmp_path / "other.md") == {"part"}
    assert link_defect(page, "other.md#part") is None
    assert link_defect(page, "#title") is None
    assert "no heading" in str(link_defect(page, "other.md#not-a-heading"))
    assert "no heading" in str(link_defect(page, "#part"))
    assert "does not exist" in str(link_defect(page, "missing.md"))


def test_script_calls_read_flags_up_to_the_next_command() -> None:
    text = (
        "```sh\n"
        ".venv/bin/python -m simulations.tune --out DIR --key lr \\\n"
        "    --values 0.1,1 --seeds=3  # a --comment\n"
        "make run && python -m fedpers.simulations.scale --sizes 100; ls --all\n"
        "```\n\n"
        "Run `python -m simulations.robustness --out\nDIR` or `python -m fedpers.config "
        "markdown` or `python -c 'import simulations.conf'`.\n"
    )
    calls = [c for line in command_lines(text) for c in script_calls(line)]
    assert [(c.module, c.flags) for c in calls] == [
        ("simulations.tune", ("--out", "--key", "--values", "--seeds")),
        ("fedpers.simulations.scale", ("--sizes",)),
        ("simulations.robustness", ("--out",)),
    ]
    make = [t for line in command_lines(text) for t in make_targets_called(line)]
    assert make == ["run"]


def test_long_options_of_an_argparse_help() -> None:
    help_text = (
        "usage: x.py [-h] --out OUT [--num-clients INT]\n"
        "            [--run-config 'KEY=VALUE ...' or FILE.toml]\n\n"
        "What x does, see --not-an-option.\n\n"
        "options:\n"
        "  -h, --help            show this help message and exit\n"
        "  --num-clients INT, --clients INT\n"
        "                        clients (--also-not-an-option)\n"
        "  --quick               a small version\n"
    )
    assert long_options(help_text) == {
        "--out",
        "--num-clients",
        "--run-config",
        "--help",
        "--clients",
        "--quick",
    }

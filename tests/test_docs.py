"""The docs, checked: docs/config.md is what docs/build.py generates from the config's field comments, and
docs/support.md what docs/support.py generates from the validator's rules; the README stays short, every
relative link in README.md and docs/*.md reaches a file (and, for #anchors, a heading), every path into the
code they name exists, and every output they show is either rewritten by `make docs` or says the commit it was
measured at."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
PACKAGES = ("models", "data", "parallel", "checkpoint", "observe", "plan")


def _build_module():
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _build_module()
SUPPORT = BUILD._support()
DOCS = BUILD.markdown_files()


def prose(text: str, *, spans: bool = False) -> str:
    """The text outside fenced code blocks, where links and headings live; code spans blanked (links in them
    are no links) unless `spans`."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else line if spans else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings, repeats numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text, spans=True).splitlines():
        heading = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
        if heading is None:
            continue
        base = slug(heading.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: Path, text: str) -> list[str]:
    """Every relative link (or image) of `text`, a file at `path`, that reaches no file or no heading."""
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md":
            body = text if dest == path else dest.read_text(encoding="utf-8")
            if anchor not in anchors(body):
                problems.append(f"{path.name}: {target}: no such heading in {dest.name}")
    return problems


# A path into the repository: tetron/..., a package-relative module (parallel/zero.py), a test, a benchmark,
# a config. Not one inside another path (~/.cache/tetron/tokens, ../tetron/ in a link: links are checked above).
CODE_PATH = re.compile(r"(?<![\w./~-])(tetron/[\w/-]*(?:\.py)?|(?:%s)/\w+\.py|(?:tests|bench|docs)/\w+\.py"
                       r"|configs/[\w.-]+\.yaml)" % "|".join(PACKAGES))


def stale_paths(text: str) -> list[str]:
    """The paths into the code that `text` names and the repository does not have."""
    missing = []
    for found in CODE_PATH.findall(text):
        path = found if found.split("/")[0] in ("tetron", "tests", "bench", "docs", "configs") else f"tetron/{found}"
        if not (ROOT / path.rstrip("/")).exists():
            missing.append(found)
    return sorted(set(missing))


def unmarked_outputs(text: str) -> list[str]:
    """Output blocks (```text) that neither follow an `<!-- output: ... -->` marker, with the output filled
    in, nor say in the lines just before or after them the commit they were measured at."""
    lines = text.splitlines()
    problems = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```text":
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        before = [line for line in lines[max(0, i - 4):i] if line.strip()]
        after = " ".join(lines[end + 1:end + 3])
        if before and BUILD.MARKER.match(before[-1].strip()):
            command = BUILD.MARKER.match(before[-1].strip()).group(1)
            if end == i + 1 or lines[i + 1] != f"$ {command}":
                problems.append(f"line {i + 1}: the output of `{command}` is not filled in (make docs)")
        else:
            commits = re.findall(r"measured at ([0-9a-f]{7,40})\b", " ".join(before[-3:]) + " " + after)
            if not commits:
                problems.append(f"line {i + 1}: an output that says neither `measured at COMMIT` nor comes "
                                f"from make docs")
            problems += [f"line {i + 1}: measured at {c}: no such commit" for c in commits if not _is_commit(c)]
        i = end + 1
    return problems


def _is_commit(ref: str) -> bool:
    if not (ROOT / ".git").exists():
        return True  # a copy without history: nothing to check against
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True)
    if shallow.stdout.strip() == "true":
        return True  # a shallow clone holds only its last commits
    done = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}^{{commit}}"], capture_output=True)
    return done.returncode == 0


def test_config_md_is_what_build_generates():
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == BUILD.config_markdown(), \
        "docs/config.md is stale: run `make docs`"


def test_config_md_lists_every_field_and_short_flag():
    from tetron.config import SECTIONS
    from tetron.overrides import SHORT_FLAGS, field_docs

    text = BUILD.config_markdown()
    for section, cls in SECTIONS.items():
        for name, *_ in field_docs(cls):
            assert f"| `{section}.{name}` |" in text
    for flag in SHORT_FLAGS:
        assert f"| `--{flag}` |" in text


def test_build_check_fails_on_a_stale_config_md(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(BUILD.config_markdown().replace("| `train.lr` |", "| `train.learning_rate` |"))
    monkeypatch.setattr(BUILD, "CONFIG_MD", stale)
    assert BUILD.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    stale.write_text(BUILD.config_markdown())
    assert BUILD.main(["--check"]) == 0


def test_support_md_is_what_support_generates():
    assert (ROOT / "docs" / "support.md").read_text(encoding="utf-8") == SUPPORT.support_markdown(), \
        "docs/support.md is stale: run `make docs`"


def test_support_md_follows_the_validators_rules(monkeypatch):
    """A rule added to validate changes the page (so the test above fails until it is regenerated): here a refusal
    of ZeRO-3 under pipeline parallelism, which shows in the pp column with its message."""
    from tetron import validate as validate_module
    from tetron.errors import check

    rule = "parallel.zero=3 with parallel.pp=4: a rule of this test"
    original = validate_module._validate_memory

    def stricter(cfg):
        check(not (cfg.parallel.zero == 3 and cfg.parallel.pp > 1), rule.replace("4", str(cfg.parallel.pp)))
        original(cfg)

    monkeypatch.setattr(validate_module, "_validate_memory", stricter)
    text = SUPPORT.support_markdown()
    assert text != (ROOT / "docs" / "support.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| ZeRO: zero=3 |"))
    assert row.split(" | ")[4].startswith("refused") and rule.replace("4", "2") in text


def test_support_md_names_real_tests():
    missing = [test for axes in SUPPORT.TESTED.values() for tests in axes.values() for test in tests
               if f"def {test.split('::')[1]}(" not in (ROOT / "tests" / test.split("::")[0]).read_text()]
    assert missing == []
    names = {f.name for f in SUPPORT.features()}
    assert set(SUPPORT.TESTED) <= names, set(SUPPORT.TESTED) - names


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the rest into docs/"


def test_readme_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## Two commands" in text
    assert "make demo   #" in text and "make test   #" in text


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_lead_somewhere(path):
    assert broken_links(path, path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_into_the_code_exist(path):
    assert stale_paths(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_outputs_are_generated_or_say_their_commit(path):
    assert unmarked_outputs(path.read_text(encoding="utf-8")) == []


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []


def test_the_checkers_find_what_is_wrong(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading, twice\n\n## A code heading twice\n")
    page.write_text("# Page\n")
    text = ("# Page\n\n[ok](other.md#a-code-heading-twice-1) [ok](#page) [web](https://example.com)\n"
            "[gone](missing.md) [no heading](other.md#nope) [self](#nowhere) `[in code](missing.md)`\n")
    assert broken_links(page, text) == ["page.md: missing.md: no such file",
                                        "page.md: other.md#nope: no such heading in other.md",
                                        "page.md: #nowhere: no such heading in page.md"]
    assert slug("What `tetron train` does, and --resume auto") == "what-tetron-train-does-and---resume-auto"
    assert stale_paths("see tetron/model.py, parallel/zero.py, tetron/observe/, tetron/nothing/ and "
                       "~/.cache/tetron/tokens") == ["tetron/model.py", "tetron/nothing/"]
    outputs = "measured at a0247de:\n\n```text\nout\n```\n\nprose\n\nmore prose\n\n```text\nout\n```\n"
    assert unmarked_outputs(outputs) == ["line 11: an output that says neither `measured at COMMIT` nor comes "
                                         "from make docs"]
    assert unmarked_outputs("measured at 0000000:\n```text\nout\n```\n") == [
        "line 2: measured at 0000000: no such commit"]
    assert unmarked_outputs("<!-- output: tetron --version -->\n```text\n```\n") != []


def test_make_demo_says_what_it_does_before_each_long_wait(tmp_path):
    """`make demo` installs (minutes) and tokenizes (a minute) before its first output: a line says so first."""
    done = subprocess.run(["make", "-n", "-B", "demo", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, check=True)
    commands = done.stdout.splitlines()
    install = next(i for i, c in enumerate(commands) if "pip install" in c)
    train = next(i for i, c in enumerate(commands) if "tetron train" in c)
    assert any(c.startswith("echo ") and "installing" in c for c in commands[:install]), done.stdout
    assert any(c.startswith("echo ") and "training the demo" in c for c in commands[install:train]), done.stdout


def section_commands(path: Path, heading: str) -> list[list[str]]:
    """The commands of the bash blocks under `heading` (continuation lines joined, comments dropped)."""
    import shlex

    text = path.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line))
    return commands


def _world(command: list[str]) -> int | None:
    """The ranks a command starts: torchrun's nodes x processes, tetron slurm's nodes x GPUs; None: the config's."""
    def flag(name: str, default: int) -> int:
        return int(command[command.index(name) + 1]) if name in command else default

    if command[0].endswith("torchrun"):
        return flag("--nnodes", 1) * flag("--nproc-per-node", 1)
    if command[1] == "slurm":
        return flag("--nodes", 1) * flag("--gpus-per-node", 1)
    return None


SLURM_JOB_FLAGS = {"--nodes", "--gpus-per-node", "--partition", "--time", "--account", "--job-name",
                   "--cpus-per-task"}  # tetron slurm's own (each with a value); --submit stands alone


def _without(args: list[str], flags: set[str], alone: set[str] = frozenset()) -> list[str]:
    """`args` without `flags` and their values, and without the flags in `alone`."""
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif a not in alone:
            kept.append(a)
    return kept


def test_the_gpu_quickstart_commands_are_real(tmp_path, monkeypatch, capsys):
    """docs/gpu.md's quickstart, command by command, through the CLI's own parsers: each train config (as
    torchrun and tetron slurm would give it) validates for the ranks the command starts, and its predicted peak
    fits an 80 GB GPU; each plan command's arguments parse; tetron slurm writes its job (into a scratch folder,
    not submitted)."""
    from tetron.cli import main
    from tetron.config import load_config
    from tetron.plan.commands import plan_args
    from tetron.plan.hardware import gpu
    from tetron.plan.memory import heaviest_ranks, predict
    from tetron.plan.search import memory_limit
    from tetron.validate import validate

    commands = section_commands(ROOT / "docs" / "gpu.md", "## Quickstart")
    assert {c[0].rsplit("/", 1)[1] for c in commands} == {"tetron", "torchrun"} and len(commands) >= 7
    monkeypatch.chdir(tmp_path)  # a relative `out` is checked for writability under the working folder
    kinds = []
    for command in commands:
        args = command[command.index("tetron.cli") + 1:] if command[0].endswith("torchrun") else command[1:]
        kinds.append(args[0])
        config = str(ROOT / args[1])
        if args[0] == "plan":
            plan_args([config, *args[2:]])
            continue
        if args[0] == "slurm":
            job = _without(args[2:], {"--out"}, {"--submit"})
            assert main(["slurm", config, *job, "--out", str(tmp_path / "job")]) == 0, capsys.readouterr().err
        cfg = load_config(config, _without(args[2:], SLURM_JOB_FLAGS if args[0] == "slurm" else set(), {"--submit"}))
        world = _world(command) or cfg.world_size
        validate(cfg, world_size=world)
        peak = predict(cfg, ranks=heaviest_ranks(cfg)).total
        assert peak <= memory_limit(gpu("H100"), min(world, 8)), (command, peak / 2**30)
    assert kinds.count("train") >= 5 and "plan" in kinds and "slurm" in kinds


def test_the_continued_pretraining_recipe_parses():
    """docs/training.md's recipe: the flags of its tetron commands are flags the CLI knows (its model folder is
    a download, not here)."""
    from tetron.config import load_raw
    from tetron.plan.commands import plan_args

    commands = section_commands(ROOT / "docs" / "training.md", "## Continued pre-training")
    tetron = [c[1:] for c in commands if c[0].endswith("/tetron")]
    assert [c[0] for c in tetron] == ["plan", "train", "generate"]
    plan_args(tetron[0][1:])
    raw = load_raw(None, tetron[1][1:])
    assert raw["checkpoint"]["init_from"] == "models/Qwen3-0.6B" and "model" not in raw

"""Every command in README.md and docs/*.md: each `python SCRIPT …` parses with that script's own CLI and passes its
flag checks (a renamed flag or a stale value fails here), each file or script a command names exists, shell
scripts parse; the Quickstart's training commands run end to end with a tiny model and tiny sizes."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHONS = re.compile(r"^(python3?|\.venv[\w-]*/bin/python)$")


def shell_commands(markdown: str) -> list[str]:
    """The commands in the fenced code blocks: continuation lines joined, comments dropped, `&&` chains split."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", markdown, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in line.split("&&")]
    return commands


def without_env(command: str) -> list[str]:
    """The command's words after its leading `NAME=value` environment settings."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # FLAGS="--pop 16" is one word
        words = words[1:]
    return words


def script_argv(command: str) -> tuple[str, list[str]] | None:
    """(script, its arguments) for a `[ENV=…] python[3] SCRIPT …` or `torchrun … SCRIPT …` command, else None."""
    words = without_env(command)
    if words and (PYTHONS.match(words[0]) or words[0] == "torchrun"):
        for i, word in enumerate(words[1:], 1):
            if word.endswith(".py"):
                return word, words[i + 1:]
    return None


@functools.cache
def load_script(path: str):
    if str(ROOT / "bench") not in sys.path:  # bench scripts import their `util`
        sys.path.insert(0, str(ROOT / "bench"))
    name = Path(path).stem + "_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def docstring_commands(script: str) -> list[str]:
    """The `python …` / `torchrun …` lines of a script's module docstring (its "Run it" section)."""
    text = ast.get_docstring(ast.parse((ROOT / script).read_text())).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("python ", "torchrun "))]


SCRIPTS = ("es.py", "es_lowrank.py", "grpo.py", "grpo_es.py", "eval_passk.py")
ALL = [(doc.name, command) for doc in DOCS for command in shell_commands(doc.read_text())] + [
    (script, command) for script in SCRIPTS for command in docstring_commands(script)]


def test_the_file_table_counts_the_lines_of_today() -> None:
    counts = dict(re.findall(r"^\| \[`([\w.]+)`\]\(\1\) \| (\d+) \|", (ROOT / "README.md").read_text(), re.M))
    assert set(counts) == {"es.py", "es_lowrank.py", "grpo.py", "grpo_es.py", "eval_passk.py", "common.py",
                           "harness.py"}
    assert {f: int(n) for f, n in counts.items()} == {f: len((ROOT / f).read_text().splitlines()) for f in counts}


def test_the_docs_have_commands() -> None:
    assert len([c for _, c in ALL if script_argv(c)]) >= 15 and {d.name for d in DOCS} >= {
        "README.md", "gpu.md", "vllm.md", "benchmarks.md", "results-cpu.md"}


def parse_and_check(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags, choices and types by the script's own parser (--resume applied), then its range checks: no model."""
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    args = harness.cli(module.Args)
    if hasattr(module, "check_args"):
        module.check_args(args)


@pytest.mark.parametrize("doc,command", ALL, ids=[f"{d}:{c[:60]}" for d, c in ALL])
def test_every_command_in_the_docs_is_current(doc: str, command: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a fresh clone has no runs/: --out-dir checks see an empty place
    found, words = script_argv(command), without_env(command)
    if found:
        script, argv = found
        assert (ROOT / script).is_file(), script
        module = load_script(script)
        if "--resume" in argv:  # a run to resume, as its first invocation with the defaults left it
            run = tmp_path / argv[argv.index("--resume") + 1]
            run.mkdir(parents=True)
            (run / "args.json").write_text(json.dumps({"args": dataclasses.asdict(module.Args())}))
        parse_and_check(script, argv, monkeypatch)
    elif words[0] in ("bash", "sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / words[1])]).returncode == 0
        env = dict(word.split("=", 1) for word in shlex.split(command)[:-len(words)])  # the leading NAME=value
        if "FLAGS" in env:  # bench/quickstart_seeds.sh passes them to SCRIPT (es.py by default)
            parse_and_check(env.get("SCRIPT", "es.py"), shlex.split(env["FLAGS"]), monkeypatch)
    elif "pip" in words[0] or words[:2] == ["python3", "-m"] and "venv" in words:
        for i, word in enumerate(words):
            if word == "-r":
                assert (ROOT / words[i + 1]).is_file(), words[i + 1]
    else:
        assert words[0] in ("mkdir", "cp", "cd", "git", "pytest") or PYTHONS.match(words[0]), command


README = (ROOT / "README.md").read_text()
QUICKSTART = [script_argv(c) for c in shell_commands(README.split("## Files")[0])]
CPU_SIZED = [found for c in shell_commands(README) if (found := script_argv(c)) and found[0] in (
    "es.py", "es_lowrank.py", "grpo.py", "grpo_es.py") and not {"--model", "--resume"} & set(found[1])]
TINY = {"es.py": ["--iterations", "2", "--pop", "2", "--prompts-per-iter", "2"],
        "es_lowrank.py": ["--iterations", "2", "--pop", "2", "--prompts-per-iter", "2"],
        "grpo.py": ["--steps", "2", "--group-size", "2", "--prompts-per-step", "2"],
        "grpo_es.py": ["--total-updates", "2", "--es.pop", "2", "--es.prompts-per-iter", "2", "--grpo.group-size", "2",
                       "--grpo.prompts-per-step", "2"]}


def test_the_quickstart_installs_the_cpu_torch_before_the_requirements() -> None:
    """Copy-paste order is install order: without a GPU, the CPU build of requirements.txt's torch must be installed
    before requirements.txt, or pip fetches PyPI's CUDA build (several GB) first."""
    pin = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    cpu_torch = f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu"
    commands = shell_commands(README.split("## Files")[0])
    requirements = [i for i, c in enumerate(commands) if "requirements.txt" in without_env(c)]
    assert cpu_torch in commands and requirements, commands
    assert commands.index(cpu_torch) < requirements[0]


def test_the_quickstart_names_every_panel_of_its_picture() -> None:
    """es.py's curves.png has a panel per harness.CURVES + es.ES_CURVES entry; the text under the Quickstart's
    picture, before its table, says what each one shows (by the panel's title, without its unit)."""
    es = load_script("es.py")
    names = [re.sub(r"^\w+: |\s*\(.*\)$", "", title) for _, title in (*harness.CURVES, *es.ES_CURVES)]
    assert names == ["train reward", "held-out reward", "held-out accuracy", "JS diversity"]
    picture = re.search(r"^!\[[^]]*\]\((docs/[\w.-]+\.png)\)$", README.split("## Files")[0], re.M)
    assert picture and (ROOT / picture.group(1)).is_file()
    under = " ".join(README[picture.end():].split("\n|", 1)[0].split()).lower()
    assert [name for name in names if name.lower() not in under] == []


def test_the_quickstart_trains_with_es() -> None:
    quick = [q for q in QUICKSTART if q]
    assert [script for script, _ in quick] == ["es.py"] and quick[0] in CPU_SIZED
    assert {script for script, _ in CPU_SIZED} == {"es.py", "es_lowrank.py", "grpo.py", "grpo_es.py"}  # one size


@pytest.mark.parametrize("script,argv", CPU_SIZED, ids=[s for s, _ in CPU_SIZED])
def test_the_cpu_sized_training_commands_run(script: str, argv: list[str], tiny_model: str, tmp_path: Path) -> None:
    """The README's CPU-sized es.py / es_lowrank.py / grpo.py / grpo_es.py commands as written, with the tiny random
    model and tiny sizes appended (tyro keeps the last value of a flag): each exits 0 and leaves its curves and
    weights."""
    result = subprocess.run([sys.executable, script, *argv, "--model", tiny_model, *TINY[script], "--max-new-tokens",
                             "4", "--eval-every", "1", "--eval-prompts", "2", "--out-dir", str(tmp_path / "run")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "final" / "config.json").is_file() if script == "grpo_es.py" else (
        (run / "curves.png").is_file() and (run / "checkpoints").is_dir())

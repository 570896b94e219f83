"""bench/gpu_check.py, the script run whenever a GPU is lent: its CPU dry run on a box as bare as that one.

The dry run runs in a subprocess with the optional packages blocked (sys.modules[name] = None: `import` fails and
find_spec finds nothing), as on a box with only torch and transformers. ~25–60 s on 2 shared cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
import gpu_check  # noqa: E402

BLOCKED = ("tyro", "trl", "datasets", "vllm", "math_verify", "matplotlib", "pytest")


def sections(markdown: str) -> dict[int, str]:
    """Check number → its section's text ("## 3. …" up to the next "## ")."""
    return {int(m[1]): m[2] for m in re.finditer(r"^## (\d+)\. (.*?)(?=^## |\Z)", markdown, re.M | re.S)}


def test_gpu_sh_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu.sh")], check=True)


def test_dry_run_on_a_bare_box(tmp_path: Path) -> None:
    code = (f"import sys, runpy; sys.modules.update({{m: None for m in {BLOCKED!r}}}); "
            f"sys.argv = ['bench/gpu_check.py', '--dry', '--out', {str(tmp_path)!r}]; "
            "runpy.run_path('bench/gpu_check.py', run_name='__main__')")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "gpu-check.md").read_text()
    assert "FAILED" not in md, md
    for module in BLOCKED:
        assert re.search(rf"^\| {module} \| absent \|", md, re.M), module
    found = sections(md)
    assert sorted(found) == list(range(1, 11)), md
    assert "skipped: tyro not installed" in found[10]  # the scripts' command lines need it
    assert "skipped: no CUDA device" in found[2]
    assert "skipped: vllm not installed" in found[8]
    assert "skipped: trl/tyro not installed" in found[9]
    # the CPU-capable checks ran and wrote their table rows
    assert re.search(r"^\| 20 perturb.* \| yes \| 0 \|$", found[3], re.M), found[3]
    assert re.search(r"^\| master_device=cpu .* \| yes \| 0 \|$", found[3], re.M), found[3]
    for number, model in ((4, "tiny-qwen2"), (7, "tiny-qwen2-untied")):  # ES: memory twice, speed once
        assert f"random {model} (" in found[number] and found[number].count("### master on") == 2, found[number]
        assert len(re.findall(r"^\| peak of update, N = 4 \| \d+\.\d\d \| — \| — \|$",
                              found[number], re.M)) == 2, found[number]
        assert re.search(r"^\| rollout: 2 prompts × 4 tokens .* \| \d+ tok/s \|$", found[number], re.M)
        assert re.search(r"^\| per member: \(perturb \+ restore\) / rollout \| [\d.e-]+ \|", found[number], re.M)
    assert re.search(r"^\| \(b\) grpo.token_logprobs .*\|$", found[5], re.M), found[5]
    assert re.search(r"^\| \(a\) old: .* \| \d[\d.e+-]* \|$", found[5], re.M), found[5]  # max abs diff to (b)
    for checkpointing in ("on", "off"):
        assert re.search(rf"^\| {checkpointing} \| \d+\.\d\d \| — \| — \| [\d.]+ / [\d.]+ \| fp32 weights",
                         found[6], re.M), found[6]
    # the closing table: each measurement beside its docs/gpu.md row
    confirms = md.split("## docs/gpu.md rows these measurements confirm")[-1]
    for key in ("es-exact", "es-memory", "es-speed", "grpo-logprobs", "grpo-memory"):
        assert f"| {gpu_check.ROWS[key]} |" in confirms, key
    assert "## Summary" in md


def test_each_row_the_check_confirms_is_a_row_of_docs_gpu_md() -> None:
    table = (ROOT / "docs" / "gpu.md").read_text().split("## What only a GPU can confirm")[1].split("\n## ")[0]
    items = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if line.startswith("| ")]
    for row in gpu_check.ROWS.values():
        assert any(item.startswith(row) for item in items), row


def test_a_failing_check_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    ctx = gpu_check.Context(True, "cpu", gpu_check.DRY, tmp_path, tmp_path, {})

    def broken(ctx: gpu_check.Context) -> list[str]:
        raise ValueError("boom | bang\nsecond line")

    def missing(ctx: gpu_check.Context) -> list[str]:
        raise gpu_check.Skip("vllm not installed")

    assert gpu_check.run_check(broken, ctx, 10) == ("FAILED: ValueError: boom / bang second line", [])
    assert gpu_check.run_check(missing, ctx, 10) == ("skipped: vllm not installed", [])
    assert gpu_check.run_check(lambda ctx: ["| a |"], ctx, 10) == ("ok", ["| a |"])


def test_the_trl_check_fails_when_a_side_of_its_table_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/grpo_vs_trl.py exits 0 with a crashed side as a "failed" row: check 9 must not read that as ok."""
    ctx = gpu_check.Context(True, "cpu", gpu_check.DRY, tmp_path, tmp_path, {"qwen2-None": "m"})
    rows = {"ours": "| ours | 1.0 | 2.0 |", "trl": "| trl | 0.21 | 2.1 |"}

    def fake_script(ctx: gpu_check.Context, name: str, *argv: str, log: str = "") -> tuple[float, str]:
        (tmp_path / "grpo_vs_trl.md").write_text("# title\n\n| side | version |\n" + "\n".join(rows.values()))
        return 1.0, ""

    monkeypatch.setattr(gpu_check, "present", lambda module: True)
    monkeypatch.setattr(gpu_check, "script", fake_script)
    monkeypatch.setattr(gpu_check.Context, "model", lambda self, arch, layers=None: "m")
    assert gpu_check.run_check(gpu_check.check_trl, ctx, 10)[0] == "ok"
    rows["trl"] = "| trl | failed (see stderr) |  |  |"
    status, _ = gpu_check.run_check(gpu_check.check_trl, ctx, 10)
    assert status.startswith("FAILED") and "trl failed" in status, status


def test_a_check_over_its_budget_is_stopped(tmp_path: Path) -> None:
    ctx = gpu_check.Context(True, "cpu", gpu_check.DRY, tmp_path, tmp_path, {})

    def slow(ctx: gpu_check.Context) -> list[str]:
        time.sleep(30)
        return ["never"]

    assert gpu_check.run_check(slow, ctx, 1) == ("skipped: stopped at its 1 s time budget", [])  # not "ok" after 30 s


@pytest.mark.parametrize("module", ["vllm", "no_such_module_xyz"])
def test_present_respects_blocked_modules(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    assert not gpu_check.present(module)


def test_the_es_check_expects_the_resident_items_plus_each_steps_transient() -> None:
    """By hand, from made-up items: what CUDA should count after load and at each step, and the allocator's cap (the
    preflight's total less the CUDA context: resident + the largest transient)."""
    estimate = {"staged θ": 2, "fp32 master": 40, "θ₀": 300, "fp32 scratch": 5000, "master copy transient": 60000,
                "vLLM reload transient": 700000, "CUDA context": harness.CUDA_CONTEXT,
                "total": 5342 + 700000 + harness.CUDA_CONTEXT}
    assert gpu_check.es_expected(estimate) == {"load": 5342, "perturb": 65342, "restore": 5342, "update": 5342,
                                               "cap": 705342}

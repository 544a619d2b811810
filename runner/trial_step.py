"""Real training steps of a config (or its cut) on this rank, through the recipe's one step
(`Trial`): for scripts/check_cluster.py's `real_step` row on a new cluster, bench_mfu and the
benchmarks that compare two variants of a step (bench_compile, bench_step_overhead).

The cut keeps the config's layout, precision, activation checkpointing, loss and optimizers and
`layers` decoder layers of its model (one Engram layer among them, with its full tables). On
accelerators the widths, sequence length and batch stay the config's, so the step's peak memory
and speed are those of the real run's layers. On cpu ranks the widths shrink too (`cpu_cut`): a
32B layer does not fit a test machine. The batch is synthetic (random token ids and table rows):
the check times the step, not the data.

It lives in runner/ because it assembles a run (build_model_parts), as model_parts.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from engram.config import JobConfig, load_config
from engram.data.tokenizer import load_tokenizer
from engram.hashing.ngram import engram_table_rows
from engram.models.args import MODEL_FLAVORS
from engram.models.builder import build_model, flavor_args
from engram.optim.builder import build_lr_schedulers, build_optimizers
from engram.runtime import device as dev
from engram.runtime.device_specs import Peak, resolve_peak
from engram.train.flops import FlopCount, model_flops
from engram.train.nonfinite import NonFiniteGuard
from parallelisms.parallel_dims import ParallelDims, axis_divisors, parallel_dims_from_config
from runner.loop import ReadAhead
from runner.model_parts import build_model_parts
from runner.step import TrainStep

CPU_WIDTH_DIV = 16  # cpu: model width, FFN width and vocabulary / 16; attention heads / 8
CPU_SEQ_LEN = 256
CPU_TABLE_DIV = 1000  # cpu: Engram table rows / 1000


def _multiple(n: int, k: int) -> int:
    return max(k, -(-n // k) * k)


def vocab_size(cfg: JobConfig) -> int:
    """The model's vocabulary: its flavor's, the config's, else its tokenizer's (debug flavors)."""
    fixed = flavor_args(cfg.model).vocab_size or cfg.model.vocab_size
    return fixed or load_tokenizer(cfg.model.tokenizer_path).vocab_size


def cut_config(
    cfg: JobConfig, layers: int, cpu: bool, tp: int = 1, pp: int = 1, cp: int = 1
) -> tuple[JobConfig, str]:
    """The config with its model cut to `layers` decoder layers (registered as a flavor
    "<flavor>-cut<layers>[-cpu]" so every piece, the planner too, builds it by name) and one
    Engram layer among them; with `cpu`, widths, sequence, batch and tables shrunk (the batch to
    one sample, or under PP (`pp` > 1) to one sample per micro-batch; the head counts stay
    divisible by what `tp` and `cp` divide: parallel_dims.axis_divisors). Returns the config and
    a sentence saying what was cut."""
    args = flavor_args(cfg.model)
    # Debug flavors take the vocabulary from the tokenizer; the cut fixes it (no tokenizer read later).
    vocab = vocab_size(cfg)
    changes: dict[str, object] = {"n_layers": layers, "vocab_size": vocab}
    training = dataclasses.replace(cfg.training, grad_accum_steps=1, global_batch_size=0)
    engram = cfg.engram
    if cpu:
        head_div = axis_divisors(tp, True, cp=cp, cp_method=cfg.parallelism.cp_method).heads
        kv = _multiple(max(1, args.n_kv_heads // 8), head_div)
        heads = _multiple(max(kv, args.n_heads // 8), kv * tp)
        head_dim = max(8, args.head_dim // 2 // 2 * 2)
        changes.update(
            n_heads=heads, n_kv_heads=kv, head_dim=head_dim, dim=heads * head_dim,
            ffn_dim=_multiple(max(64, args.ffn_dim // CPU_WIDTH_DIV), tp * 8),
            # Not below the shipped debug tokenizer's 2048 ids (the planner reads it for "").
            vocab_size=_multiple(max(2048, vocab // CPU_WIDTH_DIV), tp * 64),
        )  # fmt: skip
        p = cfg.pipeline
        batch = (p.microbatches or pp * p.virtual_stages) if pp > 1 else 1
        training = dataclasses.replace(
            training, seq_len=min(training.seq_len, CPU_SEQ_LEN), local_batch_size=batch
        )
        per_head = max(1, engram.n_embed_per_ngram // CPU_WIDTH_DIV // engram.n_head_per_ngram)
        engram = dataclasses.replace(
            engram,
            n_embed_per_ngram=per_head * engram.n_head_per_ngram,
            vocab_size_per_ngram=[max(17, v // CPU_TABLE_DIV) for v in engram.vocab_size_per_ngram],
        )
    if engram.enabled and engram.layer_ids:
        kept = [i for i in engram.layer_ids if i < layers] or [layers - 1]
        engram = dataclasses.replace(engram, layer_ids=kept[:1])
    flavor = f"{cfg.model.flavor}-cut{layers}" + ("-cpu" if cpu else "")
    MODEL_FLAVORS[cfg.model.name][flavor] = args.replace(**changes)
    model = dataclasses.replace(
        cfg.model, flavor=flavor, tokenizer_path="", vocab_size=0, hf_checkpoint=""
    )
    cut = dataclasses.replace(cfg, model=model, engram=engram, training=training)
    cut_args = MODEL_FLAVORS[cfg.model.name][flavor]
    what = (
        f"{cfg.model.name}/{cfg.model.flavor} cut to {layers} layers"
        + (
            f", Engram at layer {engram.layer_ids[0]}"
            if engram.enabled and engram.layer_ids
            else ""
        )
        + f"; dim {cut_args.dim}, {cut_args.n_heads} heads, seq {training.seq_len}, "
        f"batch {training.local_batch_size}"
        + (
            f" (cpu: widths / {CPU_WIDTH_DIV}, tables / {CPU_TABLE_DIV}, shorter sequence)"
            if cpu
            else " (the config's widths)"
        )
    )
    return cut, what


def current_rss_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@dataclass
class TrialStep:
    step_time_s: float
    cpu_time_s: float
    """This process's CPU time (all threads) during the timed step: on a shared cpu machine,
    cpu_time_s / (step_time_s x threads) is the share of the cores the step got."""
    peak_bytes: int
    """Peak live tensors (accelerators), or growth of the resident set during build + steps
    (cpu: approximate, allocator caching and lazily loaded libraries included)."""
    flops: FlopCount
    peak: Peak
    tflops: float
    mfu: float


def _synthetic_batch(cfg: JobConfig, vocab: int, seed: int, device) -> dict[str, torch.Tensor]:
    t = cfg.training
    gen = torch.Generator().manual_seed(seed)
    shape = (t.local_batch_size, t.seq_len)
    batch = {
        "input_ids": torch.randint(0, vocab, shape, generator=gen),
        "labels": torch.randint(0, vocab, shape, generator=gen),
    }
    e = cfg.engram
    if e.enabled and e.layer_ids:
        rows = engram_table_rows(e)
        ids = [
            torch.randint(0, rows[layer], (*shape, 1, e.num_heads), generator=gen)
            for layer in e.layer_ids
        ]
        batch["hash_ids"] = torch.cat(ids, dim=2)
    return {k: v.to(device) for k, v in batch.items()}


@dataclass
class TimedStep:
    wall_s: float
    cpu_s: float
    """This process's CPU time (all threads) during the step."""
    loss: float


class _SyntheticLoader:
    """A synthetic batch per step (seeded by the step), read as the loop reads a loader
    (nothing to hold: no loader state is checkpointed here)."""

    def __init__(self, cfg: JobConfig, vocab: int, seed: int) -> None:
        self.cfg, self.vocab, self.seed = cfg, vocab, seed

    def __iter__(self):
        step = 0
        while True:
            yield _synthetic_batch(self.cfg, self.vocab, self.seed + 7919 * step, "cpu")
            step += 1

    def hold(self) -> None:
        pass

    def release(self) -> None:
        pass


class Trial:
    """`cfg`'s model built with the recipe's placement and stepped by the recipe's one step
    (runner/step.py TrainStep with the recipe's schedules and non-finite guard: the
    context-parallel cut, the pipeline schedule under PP, the loss, clip, the guard, the update)
    on synthetic batches, one per step, read one step ahead with the loop's ReadAhead: NVMe
    tables page in step N + 1's rows while step N runs, as in training. What the trial step,
    bench_mfu and the benchmarks that compare two variants (compile on / off, Engram on / off;
    interleaved step by step) time."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims, device: torch.device) -> None:
        self.device = device
        rows = engram_table_rows(cfg.engram) if cfg.engram.enabled else {}
        meta = build_model(
            cfg.model, cfg.engram, vocab_size(cfg), rows, "meta", max_seq_len=cfg.training.seq_len
        )
        self.flops = model_flops(meta, cfg)
        self.model_parts, self.loss_fn, pp = build_model_parts(meta, cfg, dims, device)
        optimizers = [opt for part in self.model_parts for opt in build_optimizers(part, cfg)]
        self.train_step = TrainStep(
            cfg, dims, self.model_parts, self.loss_fn, optimizers,
            build_lr_schedulers(optimizers, cfg), pp=pp,
            guard=NonFiniteGuard(cfg.training.max_nonfinite_steps),
        )  # fmt: skip
        # Whole samples, one per dp rank (the cp ranks of a replica share it; the step cuts it).
        seed = 1000 + dims.mesh("dp").get_local_rank()
        loader = _SyntheticLoader(cfg, meta.args.vocab_size, seed)
        self.data = ReadAhead(loader, 1, device, last_step=2**62)  # (no last step: always ahead)
        self.steps = 0

    def timed_step(self) -> TimedStep:
        """One optimizer step, timed (wall and CPU) from the batch on the device to the update
        (the next step's batch read before the clock starts, as the loop's data time), and on a
        log step the loss and the telemetry read as the loop's Progress reads them."""
        self.steps += 1
        batches, ahead = self.data.take(self.steps)
        with self.loss_fn.context():
            dev.synchronize(self.device)
            t0, c0 = time.perf_counter(), time.process_time()
            result = self.train_step(batches, self.steps, ahead)
            if self.train_step.telemetry.is_log_step(self.steps):
                self.train_step.telemetry.metrics()
            loss = float(result.loss)
            dev.synchronize(self.device)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return TimedStep(wall, cpu, loss)


def one_process_trial(argv: list[str]) -> Trial:
    """A Trial of the config `argv` loads (`--job.config_file ...` and overrides) on this
    process's cpu, at world size 1 (the process group already initialised)."""
    cfg = load_config(["--job.device=cpu", *argv])
    dims = parallel_dims_from_config(cfg, 1)
    dims.build_mesh("cpu")
    return Trial(cfg, dims, torch.device("cpu"))


def run_trial_step(
    cfg: JobConfig, dims: ParallelDims, device: torch.device, steps: int = 2
) -> TrialStep:
    """Build `cfg`'s model (a cut: see cut_config) and run `steps` steps of the recipe's own
    step on a synthetic batch (Trial); the last one is timed (the first pays for allocations
    and kernel selection)."""
    dev.reset_peak_memory(device)
    rss_before = current_rss_bytes()
    trial = Trial(cfg, dims, device)
    for _ in range(steps):
        timed = trial.timed_step()
    if device.type == "cpu":
        peak = max(0, dev.peak_memory_bytes(device)[0] - rss_before)
    else:
        peak = dev.peak_memory_bytes(device)[0]
    t = cfg.training
    tokens_per_s = t.local_batch_size * t.seq_len * dims.dp_size / timed.wall_s
    tflops = trial.flops.per_token * tokens_per_s / dims.world_size / 1e12
    peak_spec = resolve_peak(device.type, dev.device_name(device), cfg.metrics.peak_tflops)
    return TrialStep(
        timed.wall_s, timed.cpu_s, peak, trial.flops, peak_spec, tflops,
        100 * tflops / peak_spec.tflops,
    )  # fmt: skip

"""What a training run's folder is (`job.dump_folder / job.run_name`), in one function, so tools
that write files (scripts/export_hf.py) can refuse to write into one."""

from __future__ import annotations

from pathlib import Path

from engram.checkpoint.folder import step_folders


def run_folder_markers(path: str | Path, checkpoint_folder: str = "checkpoint") -> list[str]:
    """The files of `path` that make it a run folder (empty: it is none): the metrics log
    `metrics.jsonl`, the resolved config `config.toml` (a TOML with a `[job]` table, as the run
    writes it), a checkpoint folder `checkpoint_folder` holding `step-<N>` folders, or `step-<N>`
    folders in `path` itself (it is a checkpoint folder)."""
    path = Path(path)
    if not path.is_dir():
        return []
    found = []
    if (path / "metrics.jsonl").is_file():
        found.append("metrics.jsonl")
    toml = path / "config.toml"
    if toml.is_file() and "[job]" in toml.read_text(errors="replace"):
        found.append("config.toml")
    if step_folders(path / checkpoint_folder):
        found.append(f"{checkpoint_folder}/step-*")
    if step_folders(path):
        found.append("step-*")
    return found

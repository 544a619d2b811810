"""Prepared token shards: scripts/prepare_data.py -> data.dataset = "tokens" (engram/data/).

Round trip (the model sees the tokenizer's output), layout independence, exact resume from a
global JSON state at any layout (every source), mixtures, bad input, interrupted prepare, and
the memory bound of prepare and reader (RSS measured in subprocesses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

import engram.data.prepare as prep
from engram.config import ConfigError, config_from_dict, load_config, to_toml
from engram.data.loader import build_dataloader
from engram.data.packing import segment_ids
from engram.data.shards import MANIFEST, TokenShards, tokenizer_fingerprint
from engram.data.synthetic import SyntheticFacts
from engram.data.tokenizer import load_tokenizer
from engram.data.tokens import TokenMixture, permute

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

ROOT = Path(__file__).resolve().parent.parent
TOK = load_tokenizer("")
SEQ = 31


class StandInHasher:
    def __call__(self, input_ids: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
        out = input_ids[:, :, None, None] * np.array([[1, 3, 7]], dtype=np.int64)
        if segment_ids is not None:
            out = out + 1000 * segment_ids[:, :, None, None]
        return out


def _write_corpus(folder: Path, seed: int, n_jsonl: int = 300, n_text: int = 100) -> list[str]:
    """A .jsonl and a .txt file of fact documents; returns the documents in prepare order."""
    folder.mkdir(parents=True, exist_ok=True)
    facts = SyntheticFacts(seed, 48, seed, "train")
    docs = [facts[i] for i in range(n_jsonl + n_text)]
    docs[3] = "Zürich — ünïcode line one\nline two"  # non-ASCII, multi-line (jsonl)
    with (folder / "a.jsonl").open("w", encoding="utf-8") as f:
        for i, d in enumerate(docs[:n_jsonl]):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
            if i % 50 == 0:
                f.write("\n")  # blank lines are skipped
    with (folder / "b.txt").open("w", encoding="utf-8") as f:
        for d in docs[n_jsonl:]:
            f.write(d.replace(". ", ".\n", 1) + "\n \n")
    return [d if i < n_jsonl else d.replace(". ", ".\n", 1) for i, d in enumerate(docs)]


def _prepare(corpus: Path, out: Path, workers: int = 1, **kw) -> dict:
    opts = prep.Options(shard_bytes=kw.pop("shard_bytes", 20_000), workers=workers, **kw)
    return prep.prepare([str(corpus)], out, opts, progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    docs = _write_corpus(root / "corpus", seed=1)
    _prepare(root / "corpus", root / "prepared", workers=2)
    return root, docs


def _cfg(path, batch=4, workers=0, seq_len=SEQ, **data):
    data = {"dataset": "tokens", "num_workers": workers, **data}
    if "sources" not in data:
        data["path"] = str(path)
    return config_from_dict(
        {
            "training": {"seq_len": seq_len, "local_batch_size": batch},
            "data": data,
            "engram": {"respect_doc_boundaries": True},
        }
    )


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _reference_chunks(docs: list[str]) -> tuple[dict[bytes, int], int]:
    stream = np.concatenate([np.asarray(TOK.encode(d) + [TOK.eos_id]) for d in docs])
    n = len(stream) // (SEQ + 1)
    chunks = stream[: n * (SEQ + 1)].reshape(n, SEQ + 1)
    return {c.astype(np.int64).tobytes(): i for i, c in enumerate(chunks)}, n


# ----------------------------------------------------------------------------- round trip


def test_prepare_round_trip_model_sees_tokenizer_output(corpus):
    root, docs = corpus
    manifest = json.loads((root / "prepared" / MANIFEST).read_text())
    assert manifest["num_docs"] == len(docs) and len(manifest["shards"]) > 3
    assert manifest["dtype"] == "<u2" and manifest["tokenizer"]["eos_id"] == TOK.eos_id
    assert [s["path"] for s in manifest["sources"]] == [
        str(root / "corpus" / "a.jsonl"),
        str(root / "corpus" / "b.txt"),
    ]
    table, n = _reference_chunks(docs)
    period = min(100, n)
    loader = build_dataloader(_cfg(root / "prepared"), TOK, StandInHasher(), 0, 1)
    seen = []
    for batch in _take(loader, 12):
        ids, labels, seg = (batch[k].numpy() for k in ("input_ids", "labels", "segment_ids"))
        for row in range(ids.shape[0]):
            x = np.concatenate([ids[row], labels[row, -1:]])
            assert x.tobytes() in table, "a sample is not a chunk of the tokenizer's output"
            seen.append(table[x.tobytes()])
        assert np.array_equal(seg, segment_ids(ids, TOK.eos_id))
        assert np.array_equal(batch["hash_ids"].numpy(), StandInHasher()(ids, seg))
    assert all(c % period != period - 1 for c in seen)  # never a held-out chunk
    assert len(set(seen)) == len(seen) and sorted(seen) != seen  # shuffled, no repeats
    val = _take(build_dataloader(_cfg(root / "prepared"), TOK, None, 0, 1, split="val"), 2)
    for batch in val:
        for row in range(batch["input_ids"].shape[0]):
            x = np.concatenate([batch["input_ids"][row], batch["labels"][row, -1:]]).astype(
                np.int64
            )
            assert table[x.tobytes()] % period == period - 1  # only held-out chunks
    # One epoch of the train split visits every train chunk exactly once.
    mix = TokenMixture([str(root / "prepared")], [1.0], None, TOK.vocab_size, SEQ, "train", 0)
    stream = mix.streams[0]
    epoch = stream.chunk_of(np.arange(stream.size))
    assert sorted(epoch.tolist()) == [c for c in range(n) if c % period != period - 1]
    assert not np.array_equal(epoch, stream.chunk_of(np.arange(stream.size, 2 * stream.size)))


@pytest.mark.parametrize("n", [1, 2, 3, 17, 100, 1000, 4097])
def test_feistel_permutation_is_a_bijection(n):
    p = permute(np.arange(n), n, [5, 1])
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, permute(np.arange(n), n, [5, 1]))
    if n > 16:
        assert not np.array_equal(p, permute(np.arange(n), n, [6, 1]))


# ----------------------------------------------------------------------------- prepare


def test_prepare_is_deterministic_and_resumes_after_interruption(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    reference = root / "prepared"
    _prepare(root / "corpus", tmp_path / "one_worker", workers=1)
    names = sorted(p.name for p in reference.iterdir())
    assert not [n for n in names if n.endswith(".tmp")]
    for name in names:  # byte-identical whatever the worker count
        assert (reference / name).read_bytes() == (tmp_path / "one_worker" / name).read_bytes()

    # Interrupt after two shards: a crash mid-shard leaves only *.tmp files behind.
    real = prep.write_shard

    def crash_at_shard_2(out, index, header, opts):
        if index == 2:
            (out / "shard_00002.bin.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        return real(out, index, header, opts)

    out = tmp_path / "interrupted"
    monkeypatch.setattr(prep, "write_shard", crash_at_shard_2)
    with pytest.raises(KeyboardInterrupt):
        _prepare(root / "corpus", out)
    monkeypatch.setattr(prep, "write_shard", real)
    assert (out / "shard_00001.json").is_file() and not (out / "shard_00002.json").exists()
    with pytest.raises(FileNotFoundError, match="interrupted: rerun the same prepare command"):
        build_dataloader(_cfg(out), TOK, None, 0, 1)
    kept = {n: (out / n).stat().st_mtime_ns for n in ("shard_00000.bin", "shard_00001.bin")}
    _prepare(root / "corpus", out)
    assert kept == {n: (out / n).stat().st_mtime_ns for n in kept}  # finished shards kept
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (reference / name).read_bytes() == (out / name).read_bytes()
    # A rerun with other inputs into the same folder is refused, nothing is overwritten.
    with pytest.raises(ValueError, match="other inputs, tokenizer or options"):
        _prepare(root / "corpus", out, append_eos=False)


def test_prepare_script_cli(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", "--input", str(root / "corpus" / "a.jsonl"),
         "--out", str(out), "--config", "train_configs/debug_model.toml", "--shard-mb", "0.01",
         "--workers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "prepare: " in proc.stderr and 'data.dataset = "tokens"' in proc.stdout
    assert json.loads((out / MANIFEST).read_text())["num_docs"] == 300


# ----------------------------------------------------------------------------- layout, resume


@pytest.mark.parametrize("world,workers", [(2, 0), (4, 0), (2, 2)])
def test_tokens_batches_independent_of_layout(corpus, world, workers):
    root, _ = corpus
    b, steps = 2, 4
    single = _take(build_dataloader(_cfg(root / "prepared", world * b), TOK, StandInHasher(), 0, 1), steps)  # fmt: skip
    for rank in range(world):
        cfg = _cfg(root / "prepared", b, workers)
        mine = _take(build_dataloader(cfg, TOK, StandInHasher(), rank, world), steps)
        for step in range(steps):
            for key in single[step]:
                want = single[step][key][rank * b : (rank + 1) * b].numpy()
                assert np.array_equal(mine[step][key].numpy(), want), (rank, step, key)


def test_tokens_rank_reads_and_hashes_only_its_rows(corpus, monkeypatch):
    """O(local batch) per rank: at dp 64 a rank reads b chunks and hashes a [b, T] batch."""
    root, _ = corpus
    reads, hashed = [], []
    real = TokenShards.read
    monkeypatch.setattr(
        TokenShards, "read", lambda self, a, b: reads.append(b - a) or real(self, a, b)
    )

    class CountingHasher(StandInHasher):
        def __call__(self, input_ids, segment_ids=None):
            hashed.append(input_ids.shape)
            return super().__call__(input_ids, segment_ids)

    b = 2
    _take(build_dataloader(_cfg(root / "prepared", b), TOK, CountingHasher(), 63, 64), 3)
    assert reads == [SEQ + 1] * (3 * b) and hashed == [(b, SEQ)] * 3


def _source_cfg(kind: str, root: Path, batch: int, workers: int):
    if kind == "tokens":
        return _cfg(root / "prepared", batch, workers)
    data = {"num_workers": workers, "synthetic_num_entities": 32}
    if kind == "jsonl":
        data |= {"dataset": "jsonl", "path": str(root / "corpus" / "a.jsonl")}
    elif kind == "text":
        data |= {"dataset": "text", "path": str(root / "corpus" / "b.txt")}
    elif kind == "chat":  # its text records: chat rows, packed by conversation
        data |= {"dataset": "chat", "path": str(root / "corpus" / "a.jsonl")}
    elif kind == "synthetic_chat":
        data |= {"dataset": "synthetic_chat", "synthetic_part": "finetune"}
    return config_from_dict({"training": {"seq_len": SEQ, "local_batch_size": batch}, "data": data})


@pytest.mark.parametrize(
    "kind", ["tokens", "jsonl", "text", "synthetic_facts", "chat", "synthetic_chat"]
)
def test_resume_from_json_state_at_any_layout(corpus, kind):
    """Save at (dp 2, 2 workers), restore at (dp 1, 0 workers) and (dp 4, 0 workers)."""
    root, _ = corpus
    k, m, g = 3, 3, 4
    full = _take(build_dataloader(_source_cfg(kind, root, g, 0), TOK, None, 0, 1), k + m)
    states = []
    for rank in range(2):
        loader = build_dataloader(_source_cfg(kind, root, 2, 2), TOK, None, rank, 2)
        _take(loader, k)
        states.append(json.loads(json.dumps(loader.state_dict())))  # plain, JSON-able
    assert states[0] == states[1]  # global: every rank saves the same state
    state = states[0]
    assert state["batches"] == k and state["position"]["sample"] == k * g
    assert state["format"] == "engram-loader/1" and state["dataset"] == kind
    for world in (1, 4):
        tails = []
        for rank in range(world):
            loader = build_dataloader(
                _source_cfg(kind, root, g // world, 0), TOK, None, rank, world
            )
            loader.load_state_dict(state)
            tails.append(_take(loader, m))
        for step in range(m):
            got = np.concatenate([t[step]["input_ids"].numpy() for t in tails])
            assert np.array_equal(got, full[k + step]["input_ids"].numpy()), (world, step)
            assert loader.state_dict()["batches"] == k + m


def test_resume_with_another_global_batch_continues_at_the_sample(corpus):
    root, _ = corpus
    full = _take(build_dataloader(_cfg(root / "prepared", 4), TOK, None, 0, 1), 4)
    loader = build_dataloader(_cfg(root / "prepared", 4), TOK, None, 0, 1)
    _take(loader, 3)
    smaller = build_dataloader(_cfg(root / "prepared", 2), TOK, None, 0, 1)
    smaller.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    first, second = _take(smaller, 2)  # global samples 12-13, then 14-15
    assert np.array_equal(first["input_ids"], full[3]["input_ids"][:2])
    assert np.array_equal(second["input_ids"], full[3]["input_ids"][2:])


# ----------------------------------------------------------------------------- mixtures


def test_mixture_weights_sources_and_counts(corpus, tmp_path):
    root, _ = corpus
    other_docs = _write_corpus(tmp_path / "corpus2", seed=2, n_jsonl=150, n_text=0)
    _prepare(tmp_path / "corpus2", tmp_path / "other")
    tables = [_reference_chunks(corpus[1])[0], _reference_chunks(other_docs)[0]]
    folders = [str(root / "prepared"), str(tmp_path / "other")]
    mix = TokenMixture(folders, [3.0, 1.0], None, TOK.vocab_size, SEQ, "train", 0)
    assert mix.counts.tolist() == [3072, 1024] and mix.names == ["prepared", "other"]
    n = 200
    labels = []
    for s in mix.samples(0, n):
        x = np.concatenate([s["input_ids"], s["labels"][-1:]]).tobytes()
        hits = [i for i, t in enumerate(tables) if x in t]
        assert len(hits) == 1
        labels.append(hits[0])
    counts = mix.samples_per_source(n)
    assert counts == {"prepared": labels.count(0), "other": labels.count(1)}
    assert abs(counts["prepared"] / n - 0.75) < 0.1
    assert mix.samples_per_source(2 * 4096) == {"prepared": 2 * 3072, "other": 2 * 1024}
    # The loader: [[data.sources]] from TOML, counts of consumed samples, layout independence.
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[training]\nseq_len = {SEQ}\nlocal_batch_size = 4\n[data]\ndataset = "tokens"\n'
        f'[[data.sources]]\npath = "{folders[0]}"\nweight = 3.0\n'
        f'[[data.sources]]\npath = "{folders[1]}"\nweight = 1.0\n'
    )
    cfg = load_config([f"--job.config_file={toml}"])
    assert [s.weight for s in cfg.data.sources] == [3.0, 1.0]
    assert load_config([f"--job.config_file={_roundtrip(tmp_path, cfg)}"]).data == cfg.data
    loader = build_dataloader(cfg, TOK, None, 0, 1)
    batches = _take(loader, 5)
    assert sum(loader.samples_per_source().values()) == 20
    assert loader.samples_per_source() == mix.samples_per_source(20)
    first = np.concatenate([batches[0]["input_ids"][0], batches[0]["labels"][0, -1:]])
    assert first.tobytes() in tables[labels[0]]


def _roundtrip(tmp_path: Path, cfg) -> Path:
    path = tmp_path / "roundtrip.toml"
    path.write_text(to_toml(cfg))
    return path


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"dataset": "jsonl", "path": "x", "sources": [{"path": "a"}]}, 'needs data.dataset = "tokens"'),
        ({"dataset": "tokens", "path": "x", "sources": [{"path": "a"}]}, "not both"),
        ({"dataset": "tokens"}, "data.path is required"),
        ({"dataset": "tokens", "sources": [{"path": "a", "wieght": 1}]}, "unknown key(s) ['wieght']"),
        ({"dataset": "tokens", "sources": [{"path": "a", "weight": 0}]}, "weight must be > 0"),
        ({"dataset": "tokens", "sources": [{"path": "a", "weight": float("inf")}]}, "weight (source 'a') must be a finite number"),
        ({"dataset": "tokens", "sources": [{"path": "a", "weight": float("nan")}]}, "weight (source 'a') must be a finite number"),
        ({"dataset": "tokens", "sources": ["a"]}, "must be a table"),
    ],
)  # fmt: skip
def test_mixture_config_errors(data, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data": data})
    assert needle in str(e.value)


def test_mixture_is_not_a_cli_override():
    with pytest.raises(ConfigError, match="list of tables: set it in the TOML file"):
        load_config(["--data.dataset=tokens", "--data.sources=a,b"])


# ----------------------------------------------------------------------------- bad input


def _other_tokenizer(path: Path) -> Path:
    vocab = {t: i for i, t in enumerate(["<unk>", "</s>", *"abcdefghijklmnopqrstuvwxyz .,"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<unk>", "</s>"])
    tok.save(str(path))
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_refuses_garbage_with_errors_that_name_the_file_and_fix(corpus, tmp_path):
    root, _ = corpus
    good = root / "prepared"
    fp = tokenizer_fingerprint(TOK)
    # Shards made with another tokenizer.
    other = _other_tokenizer(tmp_path / "other.json")
    _prepare(root / "corpus" / "a.jsonl", tmp_path / "other_tok", tokenizer_path=str(other))
    with pytest.raises(ValueError, match=r"dataset.json.*model.tokenizer_path"):
        build_dataloader(_cfg(tmp_path / "other_tok"), TOK, None, 0, 1)
    # Ids beyond the model's vocabulary.
    with pytest.raises(ValueError, match="does not fit the model's vocabulary of 100"):
        TokenShards(good, fp, vocab_size=100)
    # A truncated shard, a missing index, a missing manifest.
    bad = _copy(good, tmp_path / "truncated")
    with (bad / "shard_00001.bin").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r"shard_00001\.bin has 100 bytes.*truncated"):
        build_dataloader(_cfg(bad), TOK, None, 0, 1)
    bad = _copy(good, tmp_path / "no_index")
    (bad / "shard_00002.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard_00002\.idx is missing.*rerun"):
        build_dataloader(_cfg(bad), TOK, None, 0, 1)
    with pytest.raises(FileNotFoundError, match="not a prepared dataset.*prepare_data.py"):
        build_dataloader(_cfg(tmp_path / "nothing"), TOK, None, 0, 1)
    # Corrupt token bytes (header fine): caught when the chunk is read.
    bad = _copy(good, tmp_path / "corrupt")
    raw = np.fromfile(bad / "shard_00000.bin", dtype="<u2")
    np.full_like(raw, 65535).tofile(bad / "shard_00000.bin")
    with pytest.raises(ValueError, match=r"token id 65535 >= vocabulary 2048.*corrupt"):
        _take(build_dataloader(_cfg(bad, batch=64), TOK, None, 0, 1), 3)
    # Bad prepare input: the file, the place and the fix.
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"text": "ok"}\n{"content": "no"}\n')
    with pytest.raises(
        ValueError, match=r"x\.jsonl \(byte 15\): no string 'text' field.*--text-field"
    ):
        _prepare(tmp_path / "bad", tmp_path / "bad_out")
    with pytest.raises(ValueError, match="unknown input type"):
        prep.input_files([str(other)])


def test_token_dtype_must_be_one_prepare_writes_and_fit_the_vocabulary(corpus, tmp_path):
    root, _ = corpus
    fp = tokenizer_fingerprint(TOK)
    bad = _copy(root / "prepared", tmp_path / "f2")
    manifest = json.loads((bad / "dataset.json").read_text())
    (bad / "dataset.json").write_text(json.dumps({**manifest, "dtype": "<f2"}))
    with pytest.raises(ValueError, match=r"dataset\.json: token dtype '<f2' is not one prepare"):
        TokenShards(bad, fp, vocab_size=TOK.vocab_size)
    with pytest.raises(ValueError, match=r"holds ids up to 65535, but the vocabulary needs 69999"):
        TokenShards(root / "prepared", fp, vocab_size=70_000)


def test_prepare_names_non_utf8_input_and_leaves_no_partial_shard(tmp_path):
    for name, data in [
        ("x.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
        ("x.txt", b"fine line\n\ncaf\xe9 au lait\n"),
    ]:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(data)
        offset = data.index(b"\xe9")
        with pytest.raises(ValueError, match=rf"{name} \(byte {offset}\): not UTF-8.*iconv"):
            _prepare(folder / name, folder / "out")
        assert not list((folder / "out").glob("*.tmp")), name


# ----------------------------------------------------------------------------- memory


_MEMORY_SCRIPT = """
import json, os, resource, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from engram.data.prepare import Options, prepare
from engram.data.shards import FORMAT, MANIFEST, tokenizer_fingerprint, write_json_atomic
from engram.data.tokenizer import load_tokenizer
from engram.data.tokens import TokenMixture

def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024

mode, folder = sys.argv[1], sys.argv[2]
if mode == "prepare":
    prepare([folder + "/corpus.jsonl"], folder + "/out", Options(shard_bytes=64 << 20, workers=2),
            progress=False)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({{"peak_mb": max(rss_mb("VmHWM"), kids)}}))
else:
    tok = load_tokenizer("")
    mix = TokenMixture([folder], [1.0], tokenizer_fingerprint(tok), tok.vocab_size, 8191,
                       "train", 0)
    stream = mix.streams[0]
    n = int(stream.size * 0.8)
    t0 = time.perf_counter()
    total = 0
    for j in range(0, n, 8):
        total += sum(int(s["input_ids"][0]) for s in mix.samples(j, 8))
    print(json.dumps({{"peak_mb": rss_mb("VmHWM"), "read_mb": n * 8192 * 2 / 2**20,
                      "s": time.perf_counter() - t0}}))
"""


def _run_memory(mode: str, folder: Path) -> dict:
    script = _MEMORY_SCRIPT.format(root=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script, mode, str(folder)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write_big_shards(folder: Path, tokens: int, shards: int) -> None:
    """A prepared folder of random ids written straight in the documented format (fast)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    per = tokens // shards
    entries = []
    for k in range(shards):
        ids = rng.integers(0, TOK.vocab_size, per, dtype=np.uint16)
        ids[ids == TOK.eos_id] = 0
        ends = np.arange(500, per, 500, dtype=np.uint64)
        ends = np.append(ends, np.uint64(per))
        ids[ends.astype(np.int64) - 1] = TOK.eos_id
        name = f"shard_{k:05d}"
        ids.tofile(folder / f"{name}.bin")
        ends.astype("<u8").tofile(folder / f"{name}.idx")
        entries.append({"name": name, "tokens": per, "docs": len(ends), "sha256": str(k)})
    manifest = {
        "format": "engram-tokens/1", "dtype": "<u2", "max_token_id": TOK.vocab_size - 1,
        "fingerprint": "big", "shards": entries, "num_tokens": per * shards,
        "tokenizer": {"fingerprint": tokenizer_fingerprint(TOK), "path": "", "eos_id": TOK.eos_id},
    }  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_memory_bound_of_prepare_and_reader(tmp_path):
    """A 250 MB corpus is prepared and 80% of a 320 MB token folder is read, each in a process
    whose peak RSS (measured) stays under a 100 MB budget (the reader without dropping its
    mapped pages peaks at ~370 MB)."""
    budget_mb = 100
    # Prepare: 300 MB of jsonl whose bulk is a metadata field (cheap to tokenise), so the test
    # exercises streaming, hashing and shard planning of a corpus larger than the budget.
    line = json.dumps({"text": "The capital of Zorland is Brimfast.", "meta": "x" * 20_000})
    with (tmp_path / "corpus.jsonl").open("w") as f:
        for _ in range(250 * 2**20 // len(line)):
            f.write(line + "\n")
    assert (tmp_path / "corpus.jsonl").stat().st_size > 2.4 * budget_mb * 2**20
    got = _run_memory("prepare", tmp_path)
    assert got["peak_mb"] < budget_mb, got
    # Reader: 320 MB of token shards, 80% of it read in shuffled order.
    big = tmp_path / "big"
    _write_big_shards(big, 160 * 2**20, shards=4)
    got = _run_memory("read", big)
    assert got["read_mb"] > 2.4 * budget_mb and got["peak_mb"] < budget_mb, got


# ----------------------------------------------------------------------------- training


def _train(rank: int, world: int, raw: dict) -> list[float]:
    from recipes.train import train

    return train(config_from_dict(raw)).losses


@pytest.mark.slow
def test_train_on_a_prepared_mixture_logs_tokens_per_source(corpus, tmp_path):
    from launcher import run_distributed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = corpus
    _write_corpus(tmp_path / "corpus2", seed=2, n_jsonl=150, n_text=0)
    _prepare(tmp_path / "corpus2", tmp_path / "other")
    sources = [{"path": str(root / "prepared"), "weight": 0.7}, {"path": str(tmp_path / "other"), "weight": 0.3}]  # fmt: skip
    raw = {
        "job": {"dump_folder": str(tmp_path), "run_name": "mix", "device": "cpu"},
        "engram": {
            "n_head_per_ngram": 2,
            "vocab_size_per_ngram": [1009, 997],
            "n_embed_per_ngram": 32,
        },  # fmt: skip
        "training": {"seq_len": SEQ, "local_batch_size": 4, "steps": 3},
        "data": {"dataset": "tokens", "sources": sources, "eval_batches": 1},
    }
    losses = run_distributed(_train, 1, raw)[0]
    assert len(losses) == 3 and all(np.isfinite(losses))
    run = tmp_path / "mix"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    per_source = {k: v for k, v in last.items() if k.startswith("data_tokens/")}
    assert set(per_source) == {"data_tokens/prepared", "data_tokens/other"}
    assert sum(per_source.values()) == 3 * 4 * SEQ
    assert any("eval_loss" in r for r in records)
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert len(acc.Scalars("data_tokens/prepared")) == 3
    assert load_config([f"--job.config_file={run / 'config.toml'}"]).data.sources[1].weight == 0.3


@pytest.mark.slow
def test_bench_loader_stays_runnable():
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_loader.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tokens |" in proc.stdout and "| debug (2,048) | 1 |" in proc.stdout
